// The paged prefix KV cache: appends, page metadata (min/max/sum) and errors.
#include <gtest/gtest.h>

#include <random>

#include "sparsa/kv_cache.h"
#include "test_util.h"

using namespace sparsa;

namespace {

using sparsa_test::randn;

PagedKVCache make_cache(int64_t heads_kv, int64_t d, int page = 16) {
  auto c = PagedKVCache::create({heads_kv, d, page});
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return std::move(c).value();
}

// Brute-force page metadata from the list of every appended key: keys[h][token][t].
void expect_metadata(const PagedKVCache& cache, const std::vector<std::vector<std::vector<float>>>& keys) {
  const int64_t H = cache.heads_kv(), D = cache.head_dim(), P = cache.page_size();
  ASSERT_EQ(cache.length(), static_cast<int64_t>(keys[0].size()));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t p = 0; p < cache.num_pages(); ++p) {
      const int64_t n = std::min<int64_t>(P, cache.length() - p * P);
      ASSERT_EQ(cache.page_length(p), n);
      for (int64_t t = 0; t < D; ++t) {
        float mn = keys[h][p * P][t], mx = mn, sm = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          const float x = keys[h][p * P + j][t];
          mn = std::min(mn, x);
          mx = std::max(mx, x);
          sm += x;  // same order as the cache: exact equality expected
        }
        EXPECT_EQ(cache.page_min(h, p)[t], mn) << "h " << h << " page " << p << " dim " << t;
        EXPECT_EQ(cache.page_max(h, p)[t], mx) << "h " << h << " page " << p << " dim " << t;
        EXPECT_EQ(cache.page_key_sum(h, p)[t], sm) << "h " << h << " page " << p << " dim " << t;
      }
    }
  }
}

}  // namespace

TEST(KVCache, CreateRejectsBadConfig) {
  auto a = PagedKVCache::create({0, 64, 16});
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("heads_kv"), std::string::npos) << a.status().message();
  auto b = PagedKVCache::create({2, 0, 16});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("head_dim"), std::string::npos);
  auto c = PagedKVCache::create({2, 64, 0});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("page_size"), std::string::npos);
}

TEST(KVCache, AppendsStraddlingPagesKeepExactMetadata) {
  const int64_t H = 3, D = 17;
  PagedKVCache cache = make_cache(H, D);
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(cache.num_pages(), 0);
  EXPECT_FALSE(cache.keys().defined());
  std::vector<std::vector<std::vector<float>>> keys(H), values(H);
  uint32_t seed = 1;
  // 20 tokens (one full page + 4), then blocks of 16 that straddle page boundaries,
  // then odd sizes; far past the first capacity so the storage re-lays out.
  for (int64_t n : {20, 16, 16, 1, 3, 113, 16, 40}) {
    HostArray k = randn({1, H, n, D}, seed++), v = randn({1, H, n, D}, seed++);
    ASSERT_TRUE(cache.append(k.view(), v.view()).ok());
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) {
        keys[h].emplace_back(k.ptr<float>() + (h * n + i) * D, k.ptr<float>() + (h * n + i + 1) * D);
        values[h].emplace_back(v.ptr<float>() + (h * n + i) * D, v.ptr<float>() + (h * n + i + 1) * D);
      }
    expect_metadata(cache, keys);
  }
  EXPECT_EQ(cache.length(), 225);
  EXPECT_EQ(cache.num_pages(), 15);  // ceil(225 / 16)
  EXPECT_EQ(cache.page_length(14), 1);
  const Tensor kt = cache.keys(), vt = cache.values();
  ASSERT_EQ(kt.shape_vector(), (std::vector<int64_t>{1, H, 225, D}));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < 225; ++j)
      for (int64_t t = 0; t < D; ++t) {
        ASSERT_EQ(kt.ptr<float>()[kt.offset({0, h, j, t})], keys[h][j][t]);
        ASSERT_EQ(vt.ptr<float>()[vt.offset({0, h, j, t})], values[h][j][t]);
        ASSERT_EQ(cache.key(h, j)[t], keys[h][j][t]);
      }
}

TEST(KVCache, AcceptsStridedViews) {
  const int64_t H = 2, D = 8, n = 5;
  HostArray big = randn({1, H, 2 * n, D}, 7);  // take every other token
  Tensor k = big.view();
  k.shape[2] = n;
  k.strides[2] = 2 * D;
  PagedKVCache cache = make_cache(H, D, 4);
  ASSERT_TRUE(cache.append(k, k).ok());
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t t = 0; t < D; ++t) EXPECT_EQ(cache.key(h, i)[t], big.ptr<float>()[(h * 2 * n + 2 * i) * D + t]);
  EXPECT_EQ(cache.num_pages(), 2);
}

TEST(KVCache, BadAppendsAreRejectedAndLeaveTheCacheUnchanged) {
  const int64_t H = 2, D = 8;
  PagedKVCache cache = make_cache(H, D);
  HostArray ok = randn({1, H, 4, D}, 1);
  ASSERT_TRUE(cache.append(ok.view(), ok.view()).ok());
  HostArray heads = randn({1, H + 1, 4, D}, 2), dims = randn({1, H, 4, D + 1}, 3), batch = randn({2, H, 4, D}, 4);
  HostArray bf(DType::bf16, {1, H, 4, D});
  HostArray vshort = randn({1, H, 3, D}, 5);
  auto has = [](const Status& s, const char* what) {
    return !s.ok() && s.message().find(what) != std::string::npos;
  };
  EXPECT_TRUE(has(cache.append(heads.view(), heads.view()), "k: expected shape"));
  EXPECT_TRUE(has(cache.append(dims.view(), dims.view()), "k: expected shape"));
  EXPECT_TRUE(has(cache.append(batch.view(), batch.view()), "k: expected shape"));
  EXPECT_TRUE(has(cache.append(bf.view(), bf.view()), "k: expected dtype f32"));
  EXPECT_TRUE(has(cache.append(ok.view(), vshort.view()), "v: expected shape"));
  EXPECT_TRUE(has(cache.append(Tensor{}, ok.view()), "k: is missing"));
  EXPECT_EQ(cache.length(), 4);
  PagedKVCache uncreated;
  EXPECT_FALSE(uncreated.append(ok.view(), ok.view()).ok());
}
