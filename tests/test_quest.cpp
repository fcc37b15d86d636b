// QUEST / pooled page selection and attention over selected pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <tuple>
#include <cstring>

#include "sparsa/quest.h"
#include "test_util.h"

using namespace sparsa;

namespace {

using sparsa_test::randn;

PagedKVCache filled_cache(int64_t heads_kv, int64_t len, int64_t d, uint32_t seed) {
  auto c = PagedKVCache::create({heads_kv, d, 16});
  EXPECT_TRUE(c.ok());
  PagedKVCache cache = std::move(c).value();
  HostArray k = randn({1, heads_kv, len, d}, seed), v = randn({1, heads_kv, len, d}, seed + 1);
  EXPECT_TRUE(cache.append(k.view(), v.view()).ok());
  return cache;
}

// Attention of q row (h, r) over an explicit token list, with cpu_ref dense on a gathered copy.
void reference_rows(const Tensor& q, const PagedKVCache& cache, int64_t h, int64_t r, const std::vector<int64_t>& tokens,
                    float* out, float* lse) {
  const int64_t d = q.shape[3], h_kv = h / (q.shape[1] / cache.heads_kv()), n = static_cast<int64_t>(tokens.size());
  if (n == 0) {
    std::fill_n(out, d, 0.0f);
    *lse = -INFINITY;
    return;
  }
  HostArray qa(DType::f32, {1, 1, 1, d}), k(DType::f32, {1, 1, n, d}), v(DType::f32, {1, 1, n, d});
  std::copy_n(q.ptr<float>() + q.offset({0, h, r, 0}), d, qa.ptr<float>());
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(cache.key(h_kv, tokens[i]), d, k.ptr<float>() + i * d);
    std::copy_n(cache.value(h_kv, tokens[i]), d, v.ptr<float>() + i * d);
  }
  AttentionOptions o;
  o.backend = Backend::cpu_ref;
  auto res = dense(qa.view(), k.view(), v.view(), o);
  ASSERT_TRUE(res.ok());
  std::copy_n(res->out.ptr<float>(), d, out);
  *lse = res->lse.ptr<float>()[0];
}

std::vector<int64_t> page_tokens(const PagedKVCache& cache, const int32_t* pages, int64_t count) {
  std::vector<int64_t> t;
  for (int64_t s = 0; s < count; ++s)
    for (int64_t j = 0; j < cache.page_length(pages[s]); ++j) t.push_back(int64_t{pages[s]} * 16 + j);
  return t;
}

bool has(const Status& s, const char* what) { return !s.ok() && s.message().find(what) != std::string::npos; }

}  // namespace

TEST(Quest, ScoreIsAnUpperBoundOfEveryKeyInThePage) {
  const int64_t d = 37;
  PagedKVCache cache = filled_cache(1, 16 * 9 + 5, d, 3);
  HostArray q = randn({1, 1, 1, d}, 9);
  for (int64_t p = 0; p < cache.num_pages(); ++p) {
    const float bound = quest_page_score(q.ptr<float>(), cache.page_min(0, p), cache.page_max(0, p), d);
    for (int64_t j = 0; j < cache.page_length(p); ++j) {
      double dot = 0;
      for (int64_t t = 0; t < d; ++t) dot += double{q.ptr<float>()[t]} * cache.key(0, p * 16 + j)[t];
      EXPECT_LE(dot, bound + 1e-4 * (1 + std::abs(bound)));  // f32 sum of d terms
    }
  }
}

TEST(Quest, SelectionMatchesBruteForceTopKWithForcedPages) {
  const int64_t Hq = 6, Hkv = 2, rows = 5, d = 16, len = 16 * 40 + 7;
  PagedKVCache cache = filled_cache(Hkv, len, d, 11);
  HostArray q = randn({1, Hq, rows, d}, 12);
  for (PageSelector sel : {PageSelector::quest, PageSelector::pooled}) {
    for (auto [first, last] : {std::pair{false, false}, std::pair{true, true}, std::pair{false, true}}) {
      PageSelectOptions o;
      o.selector = sel;
      o.budget = 128;  // 8 pages of 41
      o.force_first = first;
      o.force_last = last;
      auto plan = select_pages(q.view(), cache, o);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      ASSERT_EQ(plan->capacity, 8);
      for (int64_t h = 0; h < Hq; ++h) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = q.ptr<float>() + (h * rows + r) * d;
          std::vector<std::pair<float, int32_t>> scored;
          std::set<int32_t> expect;
          if (first) expect.insert(0);
          if (last) expect.insert(static_cast<int32_t>(cache.num_pages() - 1));
          for (int32_t p = 0; p < cache.num_pages(); ++p) {
            if (expect.count(p)) continue;
            const float s = sel == PageSelector::quest
                                ? quest_page_score(qr, cache.page_min(h / 3, p), cache.page_max(h / 3, p), d)
                                : pooled_page_score(qr, cache.page_key_sum(h / 3, p), cache.page_length(p), d);
            scored.push_back({-s, p});
          }
          std::sort(scored.begin(), scored.end());
          for (size_t i = 0; expect.size() < 8; ++i) expect.insert(scored[i].second);
          ASSERT_EQ(plan->count(h, r), 8);
          std::vector<int32_t> got(plan->row_pages(h, r), plan->row_pages(h, r) + 8);
          EXPECT_EQ(got, std::vector<int32_t>(expect.begin(), expect.end())) << "h " << h << " r " << r;
        }
      }
    }
  }
}

// The cpu selection scores several rows at once with pages in vector lanes and keeps only the
// candidates above a threshold; none of that may change a pick. Brute force over
// quest_page_score (the one order every backend uses), with what those paths special-case:
// full row blocks and leftover rows, head_dims with and without a tail of dims, duplicated
// pages (ties go to the lower page), a NaN key (its kv head scores with both products; NaN
// scores rank last), every forced-page combination.
TEST(Quest, CpuSelectionMatchesBruteForceOnEveryPath) {
  const int64_t Hq = 4, Hkv = 2, rows = 19, len = 16 * 70 + 5;
  for (int64_t d : {int64_t{37}, int64_t{64}, int64_t{80}}) {
    HostArray k = randn({1, Hkv, len, d}, 41), v = randn({1, Hkv, len, d}, 42);
    for (int64_t j = 0; j < 16; ++j)  // page 10 of kv head 0 repeats page 3: equal scores
      std::copy_n(k.ptr<float>() + (3 * 16 + j) * d, d, k.ptr<float>() + (10 * 16 + j) * d);
    k.ptr<float>()[(len + 20 * 16 + 2) * d + 5] = NAN;  // kv head 1, page 20
    auto created = PagedKVCache::create({Hkv, d, 16});
    ASSERT_TRUE(created.ok());
    PagedKVCache cache = std::move(created).value();
    ASSERT_TRUE(cache.append(k.view(), v.view()).ok());
    HostArray q = randn({1, Hq, rows, d}, 43);
    q.ptr<float>()[3] = 0.0f;
    q.ptr<float>()[d + 4] = -0.0f;
    for (auto [first, last] : {std::pair{false, false}, std::pair{true, true}, std::pair{true, false}}) {
      PageSelectOptions o;
      o.budget = 16 * 9;
      o.force_first = first;
      o.force_last = last;
      auto plan = select_pages(q.view(), cache, o);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      for (int64_t h = 0; h < Hq; ++h) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = q.ptr<float>() + (h * rows + r) * d;
          std::set<int32_t> expect;
          if (first) expect.insert(0);
          if (last) expect.insert(static_cast<int32_t>(cache.num_pages() - 1));
          std::vector<std::tuple<bool, float, int32_t>> scored;  // NaN last, higher score, lower page
          for (int32_t p = 0; p < cache.num_pages(); ++p) {
            if (expect.count(p)) continue;
            const float s = quest_page_score(qr, cache.page_min(h / 2, p), cache.page_max(h / 2, p), d);
            scored.push_back({std::isnan(s), std::isnan(s) ? 0.0f : -s, p});
          }
          std::sort(scored.begin(), scored.end());
          for (size_t i = 0; expect.size() < 9; ++i) expect.insert(std::get<2>(scored[i]));
          ASSERT_EQ(plan->count(h, r), 9);
          EXPECT_EQ(std::vector<int32_t>(plan->row_pages(h, r), plan->row_pages(h, r) + 9),
                    std::vector<int32_t>(expect.begin(), expect.end()))
              << "d " << d << " h " << h << " r " << r << " first " << first << " last " << last;
        }
      }
    }
  }
}

// The cpu executor (one row per work item, keys in vector lanes) against cpu_ref (block_sparse
// over a gathered copy) on the head_dims its accumulator special-cases and one it does not,
// with a partial last page, a custom scale and the union mode.
TEST(Quest, CpuExecutorMatchesCpuRef) {
  const int64_t Hq = 4, Hkv = 2, rows = 9, len = 16 * 31 + 11;
  for (int64_t d : {int64_t{20}, int64_t{64}, int64_t{128}}) {
    PagedKVCache cache = filled_cache(Hkv, len, d, 51);
    HostArray q = randn({1, Hq, rows, d}, 52);
    PageSelectOptions o;
    o.budget = 16 * 5;
    auto plan = select_pages(q.view(), cache, o);
    ASSERT_TRUE(plan.ok());
    for (bool uni : {false, true}) {
      HostArray out[2] = {HostArray(DType::f32, {1, Hq, rows, d}), HostArray(DType::f32, {1, Hq, rows, d})};
      HostArray lse[2] = {HostArray(DType::f32, {1, Hq, rows}), HostArray(DType::f32, {1, Hq, rows})};
      for (int b = 0; b < 2; ++b) {
        PagedAttentionOptions po;
        po.attention.backend = b == 0 ? Backend::cpu_ref : Backend::cpu;
        po.attention.scale = 0.3f;
        po.attend_union = uni;
        ASSERT_TRUE(paged_attention(q.view(), cache, *plan, out[b].view(), lse[b].view(), po).ok());
      }
      // f32 sums of up to ~500 products against the f64 reference: 1e-5 absolute on O ~ N(0, 1/n).
      for (int64_t i = 0; i < out[0].numel(); ++i)
        ASSERT_NEAR(out[1].ptr<float>()[i], out[0].ptr<float>()[i], 1e-5) << "d " << d << " union " << uni << " i " << i;
      for (int64_t i = 0; i < lse[0].numel(); ++i)
        ASSERT_NEAR(lse[1].ptr<float>()[i], lse[0].ptr<float>()[i], 1e-5) << "d " << d << " union " << uni;
    }
  }
}

TEST(Quest, PlantedPageIsFound) {
  const int64_t d = 32, len = 16 * 64;
  PagedKVCache cache = filled_cache(1, 0 + 16, d, 1);  // page 0: noise
  HostArray noise = randn({1, 1, len - 16, d}, 2);
  const int64_t planted = 37;  // page 37 of the whole cache holds keys aligned with q
  HostArray q = randn({1, 1, 1, d}, 3);
  for (int64_t j = 0; j < 16; ++j)
    for (int64_t t = 0; t < d; ++t) noise.ptr<float>()[((planted - 1) * 16 + j) * d + t] = 3.0f * q.ptr<float>()[t];
  ASSERT_TRUE(cache.append(noise.view(), noise.view()).ok());
  for (PageSelector sel : {PageSelector::quest, PageSelector::pooled}) {
    PageSelectOptions o;
    o.selector = sel;
    o.budget = 16;
    o.force_last = false;
    auto plan = select_pages(q.view(), cache, o);
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->count(0, 0), 1);
    EXPECT_EQ(plan->row_pages(0, 0)[0], planted) << page_selector_name(sel);
  }
}

TEST(Quest, TiesGoToTheLowerPage) {
  const int64_t d = 4;
  auto c = PagedKVCache::create({1, d, 16});
  PagedKVCache cache = std::move(c).value();
  HostArray k(DType::f32, {1, 1, 16 * 6, d});
  for (int64_t i = 0; i < k.numel(); ++i) k.ptr<float>()[i] = 1.0f;  // identical pages
  ASSERT_TRUE(cache.append(k.view(), k.view()).ok());
  HostArray q = randn({1, 1, 1, d}, 5);
  PageSelectOptions o;
  o.budget = 48;
  o.force_last = false;
  auto plan = select_pages(q.view(), cache, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(std::vector<int32_t>(plan->row_pages(0, 0), plan->row_pages(0, 0) + 3), (std::vector<int32_t>{0, 1, 2}));
}

TEST(Quest, FullBudgetEqualsDense) {
  const int64_t Hq = 4, Hkv = 2, rows = 3, d = 24, len = 16 * 7 + 9;  // partial last page
  PagedKVCache cache = filled_cache(Hkv, len, d, 21);
  HostArray q = randn({1, Hq, rows, d}, 22);
  for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
    for (bool uni : {false, true}) {
      PageSelectOptions o;
      o.budget = 16 * 8;  // every page
      auto plan = select_pages(q.view(), cache, o);
      ASSERT_TRUE(plan.ok());
      HostArray out(DType::f32, {1, Hq, rows, d}), lse(DType::f32, {1, Hq, rows});
      PagedAttentionOptions po;
      po.attention.backend = be;
      po.attend_union = uni;
      PagedAttentionStats st;
      ASSERT_TRUE(paged_attention(q.view(), cache, *plan, out.view(), lse.view(), po, &st).ok());
      EXPECT_EQ(st.pages_loaded, 8 * Hkv);
      EXPECT_EQ(st.tokens_loaded, len * Hkv);
      AttentionOptions ao;
      ao.backend = Backend::cpu_ref;
      auto ref = dense(q.view(), cache.keys(), cache.values(), ao);
      ASSERT_TRUE(ref.ok());
      // f32 accumulation over ~120 keys against the f64 reference: 1e-5 absolute on O ~ N(0, 1/n).
      for (int64_t i = 0; i < out.numel(); ++i) EXPECT_NEAR(out.ptr<float>()[i], ref->out.ptr<float>()[i], 1e-5);
      for (int64_t i = 0; i < lse.numel(); ++i) EXPECT_NEAR(lse.ptr<float>()[i], ref->lse.ptr<float>()[i], 1e-5);
    }
  }
}

TEST(Quest, SparseAttentionMatchesAttentionOverTheSelectedTokens) {
  const int64_t Hq = 6, Hkv = 3, rows = 5, d = 17, len = 16 * 23 + 3;
  PagedKVCache cache = filled_cache(Hkv, len, d, 31);
  HostArray q = randn({1, Hq, rows, d}, 32);
  for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
    for (bool uni : {false, true}) {
      PageSelectOptions o;
      o.budget = 64;
      o.force_first = true;  // forced last page is the partial one
      auto plan = select_pages(q.view(), cache, o);
      ASSERT_TRUE(plan.ok());
      HostArray out(DType::f32, {1, Hq, rows, d}), lse(DType::f32, {1, Hq, rows});
      PagedAttentionOptions po;
      po.attention.backend = be;
      po.attend_union = uni;
      PagedAttentionStats st;
      ASSERT_TRUE(paged_attention(q.view(), cache, *plan, out.view(), lse.view(), po, &st).ok());
      // The loaded union per kv head is the set union over its query heads and rows.
      int64_t loaded = 0;
      for (int64_t h_kv = 0; h_kv < Hkv; ++h_kv) {
        std::set<int32_t> u;
        for (int64_t h = h_kv * 2; h < h_kv * 2 + 2; ++h)
          for (int64_t r = 0; r < rows; ++r) u.insert(plan->row_pages(h, r), plan->row_pages(h, r) + plan->count(h, r));
        EXPECT_EQ(st.loaded[h_kv], std::vector<int32_t>(u.begin(), u.end()));
        EXPECT_EQ(u.count(static_cast<int32_t>(cache.num_pages() - 1)), 1u);
        loaded += static_cast<int64_t>(u.size());
      }
      EXPECT_EQ(st.pages_loaded, loaded);
      std::vector<float> ro(d);
      float rl;
      for (int64_t h = 0; h < Hq; ++h) {
        for (int64_t r = 0; r < rows; ++r) {
          const auto& u = st.loaded[h / 2];
          const auto tokens = uni ? page_tokens(cache, u.data(), u.size())
                                  : page_tokens(cache, plan->row_pages(h, r), plan->count(h, r));
          reference_rows(q.view(), cache, h, r, tokens, ro.data(), &rl);
          for (int64_t t = 0; t < d; ++t) EXPECT_NEAR(out.ptr<float>()[(h * rows + r) * d + t], ro[t], 1e-5);
          EXPECT_NEAR(lse.ptr<float>()[h * rows + r], rl, 1e-5);
        }
      }
    }
  }
}

TEST(Quest, EmptyCacheGivesEmptyRows) {
  auto c = PagedKVCache::create({1, 8, 16});
  PagedKVCache cache = std::move(c).value();
  HostArray q = randn({1, 2, 3, 8}, 1);
  auto plan = select_pages(q.view(), cache, {});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->capacity, 0);
  HostArray out = randn({1, 2, 3, 8}, 2), lse(DType::f32, {1, 2, 3});
  PagedAttentionStats st;
  ASSERT_TRUE(paged_attention(q.view(), cache, *plan, out.view(), lse.view(), {}, &st).ok());
  EXPECT_EQ(st.pages_loaded, 0);
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(out.ptr<float>()[i], 0.0f);
  for (int64_t i = 0; i < lse.numel(); ++i) EXPECT_EQ(lse.ptr<float>()[i], -INFINITY);
}

TEST(Quest, BadBudgetsAndShapesGiveClearErrors) {
  PagedKVCache cache = filled_cache(2, 100, 8, 1);
  HostArray q = randn({1, 4, 2, 8}, 2);
  for (int64_t budget : {0L, -16L, 100L, 8L}) {
    PageSelectOptions o;
    o.budget = budget;
    auto plan = select_pages(q.view(), cache, o);
    ASSERT_FALSE(plan.ok());
    EXPECT_NE(plan.status().message().find("budget: expected a positive multiple of the page size 16"),
              std::string::npos) << plan.status().message();
  }
  PageSelectOptions both;
  both.budget = 16;
  both.force_first = true;
  auto p2 = select_pages(q.view(), cache, both);
  ASSERT_FALSE(p2.ok());
  EXPECT_NE(p2.status().message().find("forced"), std::string::npos);
  HostArray q3 = randn({1, 3, 2, 8}, 3), qd = randn({1, 4, 2, 9}, 4), qb = randn({2, 4, 2, 8}, 5);
  EXPECT_TRUE(has(select_pages(q3.view(), cache, {}).status(), "multiple of the cache's heads_kv"));
  EXPECT_TRUE(has(select_pages(qd.view(), cache, {}).status(), "head_dim 9"));
  EXPECT_TRUE(has(select_pages(qb.view(), cache, {}).status(), "batch 1"));
  EXPECT_TRUE(has(parse_page_selector("nope").status(), "selector"));
  // A plan that does not fit the query or the cache.
  auto plan = select_pages(q.view(), cache, {});
  ASSERT_TRUE(plan.ok());
  HostArray out(DType::f32, {1, 4, 2, 8}), lse(DType::f32, {1, 4, 2});
  PagePlan bad = *plan;
  bad.pages[0] = 99;
  EXPECT_TRUE(has(paged_attention(q.view(), cache, bad, out.view(), lse.view()), "plan.pages"));
  HostArray q1 = randn({1, 4, 1, 8}, 6);
  EXPECT_TRUE(has(paged_attention(q1.view(), cache, *plan, out.view(), lse.view()), "out: expected shape"));
}

TEST(Quest, SharedGroupPolicyPicksByTheGroupMaximum) {
  const int64_t Hq = 6, Hkv = 2, rows = 3, d = 16, len = 16 * 30;
  PagedKVCache cache = filled_cache(Hkv, len, d, 41);
  HostArray q = randn({1, Hq, rows, d}, 42);
  PageSelectOptions o;
  o.group = GroupPolicy::shared;
  o.budget = 64;
  o.force_last = false;
  auto plan = select_pages(q.view(), cache, o);
  ASSERT_TRUE(plan.ok());
  for (int64_t h_kv = 0; h_kv < Hkv; ++h_kv) {
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<std::pair<float, int32_t>> scored;
      for (int32_t p = 0; p < cache.num_pages(); ++p) {
        float best = -INFINITY;
        for (int64_t h = h_kv * 3; h < h_kv * 3 + 3; ++h)
          best = std::max(best, quest_page_score(q.ptr<float>() + (h * rows + r) * d, cache.page_min(h_kv, p),
                                                 cache.page_max(h_kv, p), d));
        scored.push_back({-best, p});
      }
      std::sort(scored.begin(), scored.end());
      std::vector<int32_t> expect;
      for (int i = 0; i < 4; ++i) expect.push_back(scored[i].second);
      std::sort(expect.begin(), expect.end());
      for (int64_t h = h_kv * 3; h < h_kv * 3 + 3; ++h) {
        ASSERT_EQ(plan->count(h, r), 4);
        EXPECT_EQ(std::vector<int32_t>(plan->row_pages(h, r), plan->row_pages(h, r) + 4), expect);
      }
    }
  }
  // The union per kv head is at most rows x pages per query.
  for (const auto& u : page_union(*plan, Hkv)) EXPECT_LE(u.size(), 3u * 4u);
}

TEST(Quest, OneCallFormMatchesDenseAtFullBudgetAndTheStepsOtherwise) {
  const int64_t batch = 2, Hq = 4, Hkv = 2, Lq = 5, Lk = 16 * 6 + 3, d = 16;
  HostArray q = randn({batch, Hq, Lq, d}, 61), k = randn({batch, Hkv, Lk, d}, 62), v = randn({batch, Hkv, Lk, d}, 63);
  PageSelectOptions full;
  full.budget = 16 * 7;
  auto r = quest_attention(q.view(), k.view(), v.view(), full);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_DOUBLE_EQ(r->density, 1.0);
  auto d0 = dense(q.view(), k.view(), v.view());
  ASSERT_TRUE(d0.ok());
  for (int64_t i = 0; i < d0->out.numel(); ++i) EXPECT_NEAR(r->attention.out.ptr<float>()[i], d0->out.ptr<float>()[i], 1e-5);
  // A small budget: batch element 1 equals select_pages + paged_attention on its own cache.
  PageSelectOptions small;
  small.budget = 32;
  auto s = quest_attention(q.view(), k.view(), v.view(), small);
  ASSERT_TRUE(s.ok());
  EXPECT_LT(s->density, 0.5);
  auto cache = PagedKVCache::create({Hkv, d, 16});
  Tensor k1 = k.view(), v1 = v.view(), q1 = q.view();
  for (Tensor* t : {&k1, &v1, &q1}) {
    t->data = t->ptr<float>() + t->strides[0];
    t->shape[0] = 1;
  }
  ASSERT_TRUE(cache->append(k1, v1).ok());
  auto plan = select_pages(q1, *cache, small);
  HostArray o(DType::f32, {1, Hq, Lq, d}), l(DType::f32, {1, Hq, Lq});
  ASSERT_TRUE(paged_attention(q1, *cache, *plan, o.view(), l.view()).ok());
  EXPECT_EQ(std::memcmp(o.data(), s->attention.out.ptr<float>() + Hq * Lq * d, o.nbytes()), 0);
  // Errors name the argument.
  HostArray k3 = randn({batch, 3, Lk, d}, 64);
  EXPECT_TRUE(has(quest_attention(q.view(), k3.view(), k3.view(), small).status(), "heads_q (4) must be a multiple"));
  PageSelectOptions bad;
  bad.budget = 20;
  EXPECT_TRUE(has(quest_attention(q.view(), k.view(), v.view(), bad).status(), "budget"));
}
