// Block-diffusion decoding on the device (sparsa/device_losa.h) against the CPU specification
// (sparsa/losa.h, sparsa/quest.h, cpu_ref backend): the paged cache's contents and page min/max,
// the active rows, QUEST's page plans (the same pages, ties aside) and the step outputs (within
// the bf16 bound) for dense, quest, losa and reuse, each row over its own pages or over its kv
// head's union (attend_union); stable rows' state untouched bit for bit; a batch of sequences of
// different lengths; a step captured in a CUDA graph and replayed equals the eager steps; every
// bad input is a clear error.
// Tests that need a device skip without one; the config checks run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sparsa/decode_trace.h"
#include "sparsa/device_losa.h"
#include "sparsa/kv_cache.h"
#include "sparsa/losa.h"
#include "sparsa/quest.h"
#include "test_util.h"

#if defined(SPARSA_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace sparsa;

namespace {

bool have_device() { return backend_available(Backend::cuda); }

// ---- config checks (no device needed) ---------------------------------------------------------

TEST(LosaCudaConfig, BadCacheConfigsNameTheField) {
  struct Bad {
    DeviceKVCacheConfig c;
    const char* field;
  };
  auto good = [] {
    DeviceKVCacheConfig c;
    c.heads_kv = 2;
    c.head_dim = 64;
    c.pool_pages = 8;
    return c;
  };
  std::vector<Bad> bad;
  for (int i = 0; i < 8; ++i) bad.push_back({good(), ""});
  bad[0].c.heads_kv = 0, bad[0].field = "heads_kv:";
  bad[1].c.head_dim = 96, bad[1].field = "head_dim:";
  bad[2].c.page_size = 0, bad[2].field = "page_size:";
  bad[3].c.page_size = 65, bad[3].field = "page_size:";
  bad[4].c.dtype = DType::f32, bad[4].field = "dtype:";
  bad[5].c.pool_pages = 0, bad[5].field = "pool_pages:";
  bad[6].c.pool_pages = (int64_t{1} << 31) / 16, bad[6].field = "pool_pages:";  // 2^31 tokens of 16
  // pool_pages * page_size wraps to 32: the check must not multiply first.
  bad[7].c.pool_pages = (int64_t{1} << 59) + 1, bad[7].c.page_size = 32, bad[7].field = "pool_pages:";
  for (const Bad& b : bad) {
    auto cache = DevicePagedKVCache::create(b.c);
    ASSERT_FALSE(cache.ok()) << b.field;
    EXPECT_EQ(cache.status().message().rfind(b.field, 0), 0u) << cache.status().to_string();
  }
}

TEST(LosaCudaConfig, BadStateConfigsNameTheField) {
  auto good = [] {
    DeviceLosaConfig c;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.head_dim = 64;
    return c;
  };
  LosaOptions o;
  o.attention.backend = Backend::cuda;
  struct Bad {
    DeviceLosaConfig c;
    LosaOptions o;
    const char* field;
  };
  std::vector<Bad> bad(11, Bad{good(), o, ""});
  bad[0].c.batch = 0, bad[0].field = "batch:";
  bad[1].c.batch = 65, bad[1].field = "batch:";
  bad[2].c.heads_q = 7, bad[2].field = "heads_q:";
  bad[3].c.block_size = 65, bad[3].field = "block_size:";
  bad[4].o.select.group = GroupPolicy::shared, bad[4].field = "group:";
  bad[5].o.select.selector = PageSelector::pooled, bad[5].field = "selector:";
  bad[6].o.attention.backend = Backend::cpu, bad[6].field = "backend:";
  bad[7].o.active_k = 17, bad[7].field = "active_k:";
  bad[8].o.mse_threshold = -1.0, bad[8].field = "mse_threshold:";
  bad[9].c.heads_q = 8192, bad[9].field = "heads_q:";  // past the candidates grid's y dimension
  bad[10].c.heads_kv = 2048, bad[10].c.heads_q = 2048, bad[10].field = "heads_kv:";
  for (const Bad& b : bad) {
    auto state = DevicePrefixAttention::create(b.c, b.o);
    ASSERT_FALSE(state.ok()) << b.field;
    EXPECT_EQ(state.status().message().rfind(b.field, 0), 0u) << state.status().to_string();
  }
  auto dtype = DevicePrefixAttention::create(good(), o, 0, DType::f32);
  ASSERT_FALSE(dtype.ok());
  EXPECT_EQ(dtype.status().message().rfind("dtype:", 0), 0u) << dtype.status().to_string();
}

// The decode-trace driver: every method on one backend (mixed backends are refused), no kept plans
// on the device, and without a device a clear error.
TEST(LosaCudaConfig, TheTraceDriverOnCudaRefusesWhatItCannotDo) {
  DecodeTraceConfig c;
  c.prefix_len = 64;
  auto t = DecodeTrace::generate(c);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  LosaOptions cpu, cuda;
  cuda.attention.backend = Backend::cuda;
  auto mixed = run_trace(*t, {cpu, cuda});
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.status().message().rfind("methods[1]: backend: expected cpu", 0), 0u) << mixed.status().to_string();
  TraceRunOptions keep;
  keep.keep_plans = true;
  auto plans = run_trace(*t, {cuda}, keep);
  ASSERT_FALSE(plans.ok());
  EXPECT_EQ(plans.status().message().rfind("keep_plans:", 0), 0u) << plans.status().to_string();
  if (!have_device()) {
    auto none = run_trace(*t, {cuda});
    ASSERT_FALSE(none.ok());
    // The argument, then why: not compiled in, or no device visible (a build without CUDA once
    // said "no CUDA device").
    EXPECT_NE(none.status().message().find("device: " + backend_status(Backend::cuda).message()), std::string::npos)
        << none.status().to_string();
  }
}

#if defined(SPARSA_WITH_CUDA)

// ---- host <-> device helpers -------------------------------------------------------------------

// bf16-rounded N(0, sigma^2) values as f32 (what both paths compute on).
HostArray bf16_values(std::vector<int64_t> shape, uint32_t seed, float sigma = 1.0f) {
  HostArray a = sparsa_test::randn(std::move(shape), seed, sigma);
  for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] = bf16_to_float(float_to_bf16(a.ptr<float>()[i]));
  return a;
}

DeviceArray to_device(const HostArray& f32) {
  HostArray b(DType::bf16, f32.shape());
  for (int64_t i = 0; i < f32.numel(); ++i) b.ptr<uint16_t>()[i] = float_to_bf16(f32.ptr<float>()[i]);
  auto d = DeviceArray::allocate(DType::bf16, f32.shape(), {DeviceType::cuda, 0});
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(cudaMemcpy(d->data(), b.data(), b.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  return std::move(d).value();
}

// A device tensor (any strides) as f32 on the host.
std::vector<float> to_host_f32(const Tensor& t) {
  std::vector<float> out(t.numel());
  if (out.empty()) return out;
  // Copy the whole strided extent, then gather.
  int64_t extent = 1;
  for (int d = 0; d < t.ndim; ++d) extent += (t.shape[d] - 1) * t.strides[d];
  std::vector<std::byte> raw(extent * dtype_size(t.dtype));
  EXPECT_EQ(cudaMemcpy(raw.data(), t.data, raw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  const Tensor host = [&] {
    Tensor h = t;
    h.data = raw.data();
    h.device = Device{};
    return h;
  }();
  for (int64_t i = 0; i < host.numel(); ++i) out[i] = static_cast<float>(load_as_double(host, i));
  return out;
}

Tensor row_block(const HostArray& a, int64_t b) {  // entry b of [B, ...] as [1, ...]
  Tensor t = a.view();
  t.data = static_cast<std::byte*>(const_cast<void*>(a.data())) + b * t.strides[0] * 4;
  t.shape[0] = 1;
  return t;
}

// Rows [begin, begin + n) of [1, H, L, D] as a view.
Tensor tokens(const HostArray& a, int64_t begin, int64_t n) {
  Tensor t = a.view();
  t.data = static_cast<std::byte*>(const_cast<void*>(a.data())) + begin * t.strides[2] * 4;
  t.shape[2] = n;
  return t;
}
Tensor device_tokens(const DeviceArray& a, int64_t begin, int64_t n) {
  Tensor t = a.view();
  t.data = static_cast<std::byte*>(a.data()) + begin * t.strides[2] * 2;
  t.shape[2] = n;
  return t;
}

// ---- the cache ---------------------------------------------------------------------------------

TEST(LosaCudaCache, AppendsAndPageMinMaxMatchTheHost) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  DeviceKVCacheConfig c;
  c.heads_kv = 3;
  c.head_dim = 64;
  c.page_size = 16;
  c.pool_pages = 40;
  auto cache = DevicePagedKVCache::create(c);
  ASSERT_TRUE(cache.ok()) << cache.status().to_string();
  auto s0 = cache->add_sequence(300), s1 = cache->add_sequence(100);
  ASSERT_TRUE(s0.ok() && s1.ok());
  const HostArray k = bf16_values({1, 3, 300, 64}, 1), v = bf16_values({1, 3, 300, 64}, 2);
  const DeviceArray dk = to_device(k), dv = to_device(v);
  int64_t at = 0;
  for (int64_t n : {5, 16, 23, 1, 200}) {  // partial pages extended, whole pages, a long run
    ASSERT_TRUE(cache->append(*s0, device_tokens(dk, at, n), device_tokens(dv, at, n)).ok());
    at += n;
  }
  ASSERT_TRUE(cache->append(*s1, device_tokens(dk, 0, 40), device_tokens(dv, 0, 40)).ok());
  EXPECT_EQ(cache->length(*s0).value(), 245);
  EXPECT_EQ(cache->length(*s1).value(), 40);
  const std::vector<float> keys = to_host_f32(cache->keys(*s0).value()), values = to_host_f32(cache->values(*s0).value());
  auto host = PagedKVCache::create({3, 64, 16});
  ASSERT_TRUE(host.ok());
  ASSERT_TRUE(host->append(tokens(k, 0, 245), tokens(v, 0, 245)).ok());
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t t = 0; t < 245; ++t)
      for (int64_t e = 0; e < 64; ++e) {
        ASSERT_EQ(keys[(h * 245 + t) * 64 + e], host->key(h, t)[e]);
        ASSERT_EQ(values[(h * 245 + t) * 64 + e], host->value(h, t)[e]);
      }
  const std::vector<float> mn = to_host_f32(cache->page_min(*s0).value()), mx = to_host_f32(cache->page_max(*s0).value());
  ASSERT_EQ(static_cast<int64_t>(mn.size()), 3 * host->num_pages() * 64);
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t p = 0; p < host->num_pages(); ++p)
      for (int64_t e = 0; e < 64; ++e) {
        ASSERT_EQ(mn[(h * host->num_pages() + p) * 64 + e], host->page_min(h, p)[e]) << "page " << p;
        ASSERT_EQ(mx[(h * host->num_pages() + p) * 64 + e], host->page_max(h, p)[e]) << "page " << p;
      }
  // The second sequence's pages are its own.
  const std::vector<float> keys1 = to_host_f32(cache->keys(*s1).value());
  for (int64_t e = 0; e < 64; ++e) ASSERT_EQ(keys1[e], host->key(0, 0)[e]);
}

TEST(LosaCudaCache, CapacityAndArgumentErrorsAreClear) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  DeviceKVCacheConfig c;
  c.heads_kv = 2;
  c.head_dim = 64;
  c.pool_pages = 10;
  auto cache = DevicePagedKVCache::create(c);
  ASSERT_TRUE(cache.ok());
  auto s0 = cache->add_sequence(100);  // 7 pages
  ASSERT_TRUE(s0.ok());
  for (int64_t huge : {int64_t{161}, int64_t{1} << 40, INT64_MAX}) {  // past the pool: never a page count that wraps
    auto h = cache->add_sequence(huge);
    ASSERT_FALSE(h.ok()) << huge;
    EXPECT_EQ(h.status().code(), StatusCode::out_of_memory);
    EXPECT_EQ(h.status().message().rfind("max_tokens:", 0), 0u) << h.status().to_string();
  }
  EXPECT_EQ(cache->free_pages(), 3);
  auto big = cache->add_sequence(100);  // 7 more: only 3 free
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::out_of_memory);
  EXPECT_NE(big.status().message().find("no free run"), std::string::npos) << big.status().to_string();
  const DeviceArray k = to_device(bf16_values({1, 2, 120, 64}, 3));
  auto over = cache->append(*s0, k.view(), k.view());
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.code(), StatusCode::out_of_memory);
  EXPECT_EQ(cache->length(*s0).value(), 0) << "a refused append wrote nothing";
  const DeviceArray wrong_heads = to_device(bf16_values({1, 3, 4, 64}, 4));
  auto shape = cache->append(*s0, wrong_heads.view(), wrong_heads.view());
  ASSERT_FALSE(shape.ok());
  EXPECT_EQ(shape.message().rfind("k:", 0), 0u) << shape.to_string();
  HostArray host(DType::bf16, {1, 2, 4, 64});
  auto on_host = cache->append(*s0, host.view(), host.view());
  ASSERT_FALSE(on_host.ok());
  EXPECT_EQ(on_host.message().rfind("k:", 0), 0u) << on_host.to_string();
  EXPECT_FALSE(cache->append(7, k.view(), k.view()).ok());
  ASSERT_TRUE(cache->remove_sequence(*s0).ok());
  EXPECT_FALSE(cache->length(*s0).ok()) << "a removed sequence is gone";
  EXPECT_TRUE(cache->add_sequence(160).ok()) << "its pages are free again";
}

// ---- steps against the CPU -------------------------------------------------------------------

struct Shape {
  int64_t heads_q = 8, heads_kv = 2, d = 64, block = 16;
  int64_t page_size = 16;
  int64_t budget = 64;  // 4 pages of 16
  std::vector<int64_t> prefix = {700};  // per batch entry
  PrefixMethod method = PrefixMethod::losa;
  int active_k = 4;
  std::optional<double> mse_threshold;
  bool padded_q = false;  // q's rows d + 1 elements apart (not on 16 bytes)
  bool attend_union = false;
};

// One decode trace per batch entry: the prefix, then per step q (rows drifting slightly, two
// rows jumping), k_block, v_block.
struct Trace {
  std::vector<HostArray> prefix_k, prefix_v;  // [1, Hkv, N, d]
  std::vector<HostArray> q, k, v;             // per step: [B, H, Bb, d]
};
Trace make_trace(const Shape& s, int steps, uint32_t seed) {
  Trace t;
  const int64_t B = static_cast<int64_t>(s.prefix.size());
  for (int64_t b = 0; b < B; ++b) {
    t.prefix_k.push_back(bf16_values({1, s.heads_kv, s.prefix[b], s.d}, seed + 10 * b));
    t.prefix_v.push_back(bf16_values({1, s.heads_kv, s.prefix[b], s.d}, seed + 10 * b + 1));
  }
  HostArray q = bf16_values({B, s.heads_q, s.block, s.d}, seed + 100);
  std::mt19937 rng(seed + 200);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int step = 0; step < steps; ++step) {
    if (step > 0) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t jump1 = (step * 5 + b) % s.block, jump2 = (step * 11 + 3 * b + 7) % s.block;
        for (int64_t h = 0; h < s.heads_q; ++h)
          for (int64_t i = 0; i < s.block; ++i) {
            const float move = (i == jump1 || i == jump2) ? 1.0f : 0.02f;
            float* row = q.ptr<float>() + ((b * s.heads_q + h) * s.block + i) * s.d;
            for (int64_t e = 0; e < s.d; ++e) row[e] = bf16_to_float(float_to_bf16(row[e] + move * nd(rng)));
          }
      }
    }
    t.q.push_back(q);
    t.k.push_back(bf16_values({B, s.heads_kv, s.block, s.d}, seed + 300 + step));
    t.v.push_back(bf16_values({B, s.heads_kv, s.block, s.d}, seed + 400 + step));
  }
  return t;
}

LosaOptions options_of(const Shape& s, Backend backend) {
  LosaOptions o;
  o.method = s.method;
  o.select.budget = s.budget;
  o.select.force_first = true;
  o.select.force_last = true;
  o.active_k = s.active_k;
  o.mse_threshold = s.mse_threshold;
  o.attend_union = s.attend_union;
  o.attention.backend = backend;
  return o;
}

// f32 values [..., d] as a bf16 device view whose rows are d + 1 elements apart (rows on 2-byte
// boundaries only); buf holds the memory.
Tensor to_device_padded_rows(const HostArray& f32, DeviceArray& buf) {
  std::vector<int64_t> shape = f32.shape();
  const int64_t d = shape.back(), rows = f32.numel() / d;
  shape.back() = d + 1;
  HostArray wide(DType::f32, shape);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e <= d; ++e) wide.ptr<float>()[r * (d + 1) + e] = e < d ? f32.ptr<float>()[r * d + e] : 0.0f;
  buf = to_device(wide);
  Tensor t = buf.view();
  t.shape[t.ndim - 1] = d;
  return t;
}

struct DeviceRun {
  std::vector<std::vector<float>> out, lse;
  std::vector<std::vector<int32_t>> active, active_counts, plan_pages, plan_counts;
  int64_t capacity = 0;
};

std::vector<int32_t> ints(const DeviceArray& a) {
  std::vector<int32_t> out(a.numel());
  EXPECT_EQ(cudaMemcpy(out.data(), a.data(), a.nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// bf16 bound: O is rounded to bf16 twice on the device (O_p is kept in bf16, then out), each at
// most 2^-9 relative of |O| <= max |v|; 2^-7 * max|v| leaves a margin for the f32 sums' order.
// LSE is f32 on both sides, differing by accumulation order and exp2f: 2e-3 absolute.
constexpr double kOutTol = 1.0 / 128, kLseTol = 2e-3;

void check_against_cpu(const Shape& s, int steps) {
  const int64_t B = static_cast<int64_t>(s.prefix.size());
  const Trace tr = make_trace(s, steps, 17);
  // The device: one cache, B sequences.
  DeviceKVCacheConfig cc;
  cc.heads_kv = s.heads_kv;
  cc.head_dim = s.d;
  cc.page_size = s.page_size;
  int64_t pages = 0;
  for (int64_t n : s.prefix) pages += (n + s.block + s.page_size - 1) / s.page_size;
  cc.pool_pages = pages + 4;
  auto cache = DevicePagedKVCache::create(cc);
  ASSERT_TRUE(cache.ok()) << cache.status().to_string();
  std::vector<int> seqs;
  for (int64_t b = 0; b < B; ++b) {
    auto id = cache->add_sequence(s.prefix[b] + s.block);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    seqs.push_back(*id);
    if (s.prefix[b] == 0) continue;
    const DeviceArray k = to_device(tr.prefix_k[b]), v = to_device(tr.prefix_v[b]);
    ASSERT_TRUE(cache->append(*id, k.view(), v.view()).ok());
  }
  DeviceLosaConfig dc;
  dc.batch = B;
  dc.heads_q = s.heads_q;
  dc.heads_kv = s.heads_kv;
  dc.head_dim = s.d;
  dc.block_size = s.block;
  auto dev = DevicePrefixAttention::create(dc, options_of(s, Backend::cuda));
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  // The CPU: one cache and state per entry.
  std::vector<PagedKVCache> host_cache;
  std::vector<PrefixAttention> host_state;
  for (int64_t b = 0; b < B; ++b) {
    auto hc = PagedKVCache::create({s.heads_kv, s.d, static_cast<int>(s.page_size)});
    ASSERT_TRUE(hc.ok());
    if (s.prefix[b] > 0) ASSERT_TRUE(hc->append(tr.prefix_k[b].view(), tr.prefix_v[b].view()).ok());
    host_cache.push_back(std::move(hc).value());
    LosaConfig lc{s.heads_q, s.heads_kv, s.d, s.block};
    auto hs = PrefixAttention::create(lc, options_of(s, Backend::cpu_ref));
    ASSERT_TRUE(hs.ok()) << hs.status().to_string();
    host_state.push_back(std::move(hs).value());
  }
  auto out = DeviceArray::allocate(DType::bf16, {B, s.heads_q, s.block, s.d}, {DeviceType::cuda, 0});
  auto lse = DeviceArray::allocate(DType::f32, {B, s.heads_q, s.block}, {DeviceType::cuda, 0});
  ASSERT_TRUE(out.ok() && lse.ok());
  HostArray prev_o, prev_l, prev_q;  // the state (O_p, L_p, Q_ref) after the previous step
  for (int step = 0; step < steps; ++step) {
    const DeviceArray k = to_device(tr.k[step]), v = to_device(tr.v[step]);
    DeviceArray q;
    const Tensor q_view = s.padded_q ? to_device_padded_rows(tr.q[step], q) : (q = to_device(tr.q[step])).view();
    const Status st = dev->step(*cache, seqs, q_view, k.view(), v.view(), out->view(), lse->view());
    ASSERT_TRUE(st.ok()) << st.to_string();
    const std::vector<float> o = to_host_f32(out->view()), l = to_host_f32(lse->view());
    const std::vector<int32_t> active = ints(dev->active_rows()), counts = ints(dev->active_counts());
    // Stable rows (after a block's first step, losa and reuse): O_p, L_p and Q_ref as they were, bit
    // for bit.
    HostArray now_o = dev->o_p().to_host().value(), now_l = dev->l_p().to_host().value(),
              now_q = dev->q_ref().to_host().value();
    if (step > 0 && (s.method == PrefixMethod::losa || s.method == PrefixMethod::reuse)) {
      for (int64_t b = 0; b < B; ++b) {
        std::vector<char> is_active(s.block, 0);
        for (int32_t i = 0; i < counts[b]; ++i) is_active[active[b * s.block + i]] = 1;
        for (int64_t h = 0; h < s.heads_q; ++h)
          for (int64_t r = 0; r < s.block; ++r) {
            if (is_active[r]) continue;
            const int64_t row = (b * s.heads_q + h) * s.block + r;
            ASSERT_EQ(std::memcmp(now_o.ptr<uint16_t>() + row * s.d, prev_o.ptr<uint16_t>() + row * s.d, s.d * 2), 0)
                << "O_p of stable row " << r << ", step " << step << " entry " << b;
            ASSERT_EQ(std::memcmp(now_q.ptr<uint16_t>() + row * s.d, prev_q.ptr<uint16_t>() + row * s.d, s.d * 2), 0)
                << "Q_ref of stable row " << r << ", step " << step << " entry " << b;
            ASSERT_EQ(std::memcmp(now_l.ptr<float>() + row, prev_l.ptr<float>() + row, sizeof(float)), 0)
                << "L_p of stable row " << r << ", step " << step << " entry " << b;
          }
      }
    }
    prev_o = std::move(now_o), prev_l = std::move(now_l), prev_q = std::move(now_q);
    const bool sparse = s.method == PrefixMethod::quest || (s.method == PrefixMethod::losa && step > 0);
    std::vector<int32_t> plan, plan_counts;
    if (sparse) {
      plan = ints(dev->plan_pages());
      plan_counts = ints(dev->plan_counts());
    }
    for (int64_t b = 0; b < B; ++b) {
      HostArray ho(DType::f32, {1, s.heads_q, s.block, s.d}), hl(DType::f32, {1, s.heads_q, s.block});
      StepStats stats;
      const Status hs = host_state[b].step(host_cache[b], row_block(tr.q[step], b), row_block(tr.k[step], b),
                                           row_block(tr.v[step], b), ho.view(), hl.view(), &stats);
      ASSERT_TRUE(hs.ok()) << hs.to_string();
      // The active rows: exactly the CPU's.
      ASSERT_EQ(counts[b], static_cast<int32_t>(stats.recomputed.size())) << "step " << step << " entry " << b;
      for (size_t i = 0; i < stats.recomputed.size(); ++i)
        ASSERT_EQ(active[b * s.block + i], stats.recomputed[i]) << "step " << step << " entry " << b;
      // The pages: the CPU's, up to pages whose scores tie with the kept boundary (the two paths
      // sum the score in different orders: at most a few f32 ulps apart).
      if (sparse) {
        const PagePlan& cp = stats.plan;
        for (int64_t h = 0; h < s.heads_q; ++h)
          for (int64_t slot = 0; slot < static_cast<int64_t>(stats.recomputed.size()); ++slot) {
            const int64_t row = (b * s.heads_q + h) * s.block + slot;
            std::vector<int32_t> got(plan.begin() + row * dev->plan_capacity(),
                                     plan.begin() + row * dev->plan_capacity() + plan_counts[row]);
            std::vector<int32_t> want(cp.row_pages(h, slot), cp.row_pages(h, slot) + cp.count(h, slot));
            if (got == want) continue;
            // Scores of the differing pages, by the CPU's own function.
            const int64_t r = stats.recomputed[slot], h_kv = h / (s.heads_q / s.heads_kv);
            const float* qr = tr.q[step].ptr<float>() + ((b * s.heads_q + h) * s.block + r) * s.d;
            auto score = [&](int32_t p) {
              return quest_page_score(qr, host_cache[b].page_min(h_kv, p), host_cache[b].page_max(h_kv, p), s.d);
            };
            float boundary = INFINITY;
            for (int32_t p : want) boundary = std::min(boundary, score(p));
            std::vector<int32_t> diff;
            std::set_symmetric_difference(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(diff));
            for (int32_t p : diff)
              ASSERT_LE(std::fabs(score(p) - boundary), 1e-4f * (std::fabs(boundary) + 1.0f))
                  << "step " << step << " entry " << b << " head " << h << " slot " << slot << ": page " << p;
          }
      }
      for (int64_t i = 0; i < ho.numel(); ++i) {
        ASSERT_NEAR(o[b * ho.numel() + i], ho.ptr<float>()[i], kOutTol) << "out, step " << step << " entry " << b;
      }
      for (int64_t i = 0; i < hl.numel(); ++i) {
        ASSERT_NEAR(l[b * hl.numel() + i], hl.ptr<float>()[i], kLseTol) << "lse, step " << step << " entry " << b;
      }
    }
  }
}

TEST(LosaCudaStep, LosaMatchesTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  check_against_cpu(Shape{}, 4);
}

TEST(LosaCudaStep, QuestEveryRowMatchesTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.method = PrefixMethod::quest;
  check_against_cpu(s, 3);
}

TEST(LosaCudaStep, DenseMatchesTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.method = PrefixMethod::dense;
  s.prefix = {1000};  // the split-KV route
  check_against_cpu(s, 2);
}

// The rules' extremes, each its own launch shape of the rows kernel (one CTA per row the rule
// can make active, then CTAs for the rows it can leave stable): no row active (K 0), every row
// active (K = the block), and thresholds whose active rows change in number from step to step
// (the two rows that jump, one when they coincide; every row at threshold 0).
TEST(LosaCudaStep, ActiveRuleExtremesMatchTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int k : {0, 16}) {
    SCOPED_TRACE("active_k " + std::to_string(k));
    Shape s;
    s.active_k = k;
    check_against_cpu(s, 3);
  }
  for (double threshold : {0.05, 0.0}) {
    SCOPED_TRACE("mse_threshold " + std::to_string(threshold));
    Shape s;
    s.mse_threshold = threshold;
    s.prefix = {700, 1500};
    check_against_cpu(s, 4);
  }
}

// q whose rows do not start on 16 bytes: the candidates kernel reads it element by element
// (the other tests' q takes its 16-byte vector loads).
TEST(LosaCudaStep, QueriesOffSixteenByteRowsMatchTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int64_t d : {64, 128}) {
    SCOPED_TRACE("d " + std::to_string(d));
    Shape s;
    s.d = d;
    s.padded_q = true;
    s.prefix = {700, 2100};
    check_against_cpu(s, 3);
  }
}

TEST(LosaCudaStep, HeadDim128GqaFourAndAPartialLastPage) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.heads_q = 8;
  s.heads_kv = 2;
  s.d = 128;
  s.prefix = {1234};
  s.budget = 128;
  check_against_cpu(s, 3);
}

TEST(LosaCudaStep, ABatchOfSequencesOfDifferentLengths) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.prefix = {700, 1500, 33, 16};  // the last two: budgets covering the whole prefix
  check_against_cpu(s, 3);
}

// Prefixes of several page tiles (128 pages each, the last partial), so that a row's pages come
// from several tiles' candidates: a small budget (rounds of a warp minimum over the candidates),
// a budget above 32 pages (the radix select over them, and a tile shorter than its keep padded),
// and one above a tile's 128 pages (whole tiles as candidates).
TEST(LosaCudaStep, PrefixesOfSeveralPageTilesAtEveryBudgetRegime) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int64_t budget : {256, 1024, 2560}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    Shape s;
    s.prefix = {5000, 2100};  // 313 pages (3 tiles, 57 in the last), 132 pages (2 tiles, 4 in the last)
    s.budget = budget;
    check_against_cpu(s, 3);
    s.method = PrefixMethod::quest;
    check_against_cpu(s, 2);
  }
}

// Pages of other sizes than the 8-key tiles the rows kernel loads: smaller than a tile (4), not
// a multiple of it (12, 20) and larger (40), at head_dim 128; a tile never reads past its page.
TEST(LosaCudaStep, PageSizesOtherThanSixteen) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int64_t page : {4, 12, 20, 40}) {
    SCOPED_TRACE("page size " + std::to_string(page));
    Shape s;
    s.d = 128;
    s.page_size = page;
    s.budget = 8 * page;
    s.prefix = {1003, 250};
    check_against_cpu(s, 3);
    s.method = PrefixMethod::quest;
    check_against_cpu(s, 2);
  }
}

// GQA groups of 4 and 8 at head_dim 128: a candidates CTA's 16 queries are a group's heads at
// 4 and 2 active rows (query qi = slot * group + g), and K = 4 rows of a group of 8 fill two CTAs.
TEST(LosaCudaStep, GroupsOfFourAndEightAtHeadDim128) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int64_t heads_q : {8, 16}) {
    SCOPED_TRACE("heads_q " + std::to_string(heads_q));
    Shape s;
    s.d = 128;
    s.heads_q = heads_q;
    s.heads_kv = 2;
    s.prefix = {2600, 700};
    check_against_cpu(s, 3);
    s.method = PrefixMethod::quest;
    check_against_cpu(s, 2);
  }
}

// Prefixes of many page tiles: a row's candidates are more than one slice of 128, so its
// selection runs in levels (budget 256: 288 candidates, two levels; budget 512: 576 candidates,
// three), each keeping the slices' best pages in position order.
TEST(LosaCudaStep, PrefixesOfManyPageTilesSelectInLevels) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int64_t budget : {256, 512}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    Shape s;
    s.prefix = {36000, 17000};  // 2250 pages (18 tiles), 1063 pages (9 tiles)
    s.budget = budget;
    check_against_cpu(s, 2);
    s.method = PrefixMethod::quest;
    check_against_cpu(s, 2);
  }
}

// A level of the CTA selection whose last slice holds fewer keys than `keep`: 2875 pages of 4
// (23 tiles of 128) and keep 28 give 644 candidates, a last slice of 4 keys padded to 28, and a
// next level whose second slice has 40 entries of which 16 are keys. Counted as 40, the rounds
// reached the padding and read and wrote past the level (memcheck runs this test).
TEST(LosaCudaStep, PrefixesOfManyPageTilesWithAShortLastSlice) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.page_size = 4;
  s.budget = 28 * 4;
  s.prefix = {11500, 3000};  // 2875 pages (23 tiles), 750 pages (6 tiles)
  check_against_cpu(s, 2);
  s.method = PrefixMethod::quest;
  check_against_cpu(s, 2);
}

// A prefix whose selection needs more shared memory than a block gets (60,000 pages of one token
// keeping 128 a row: the radix selection's 4 bytes a candidate): refused before any launch, with
// an error naming seqs, and the outputs untouched.
TEST(LosaCudaStep, APrefixTooLongForTheSelectionIsRefusedBeforeAnyLaunch) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kTokens = 60000;
  DeviceKVCacheConfig cc;
  cc.heads_kv = 2;
  cc.head_dim = 64;
  cc.page_size = 1;
  cc.pool_pages = kTokens + 16;
  auto cache = DevicePagedKVCache::create(cc);
  ASSERT_TRUE(cache.ok());
  const int seq = cache->add_sequence(kTokens + 16).value();
  const DeviceArray k = to_device(bf16_values({1, 2, kTokens, 64}, 7));
  ASSERT_TRUE(cache->append(seq, k.view(), k.view()).ok());
  Shape s;
  s.page_size = 1;
  s.budget = 128;
  s.method = PrefixMethod::quest;
  auto dev = DevicePrefixAttention::create(DeviceLosaConfig{1, s.heads_q, s.heads_kv, s.d, s.block},
                                           options_of(s, Backend::cuda));
  ASSERT_TRUE(dev.ok());
  const DeviceArray q = to_device(bf16_values({1, 8, 16, 64}, 8)), kv = to_device(bf16_values({1, 2, 16, 64}, 9));
  const DeviceArray out = to_device(bf16_values({1, 8, 16, 64}, 10));
  auto lse = DeviceArray::allocate(DType::f32, {1, 8, 16}, {DeviceType::cuda, 0}, /*zero_fill=*/true);
  ASSERT_TRUE(lse.ok());
  const std::vector<float> out_before = to_host_f32(out.view());
  const Status st = dev->step(*cache, {seq}, q.view(), kv.view(), kv.view(), out.view(), lse->view());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message().rfind("seqs: the longest prefix, 60000 pages", 0), 0u) << st.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(to_host_f32(out.view()), out_before) << "a refused step wrote its output";
}

// Budgets far past the prefix, and plans longer than the rows kernel keeps in shared memory
// (kPlanSmemPages = 2048 pages): a budget of 2^20 tokens over short prefixes takes every page
// without a plan in shared memory sized by the budget; a budget of 2100 pages over a 2500-page
// prefix reads its plan back from global memory.
TEST(LosaCudaStep, HugeBudgetsAndLongPlans) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.prefix = {700, 40};
  s.budget = int64_t{1} << 20;
  check_against_cpu(s, 2);
  s.method = PrefixMethod::quest;
  check_against_cpu(s, 2);
  s.prefix = {40000};
  s.budget = 2100 * 16;
  s.method = PrefixMethod::losa;
  check_against_cpu(s, 2);
}

// The engine's tiny SDAR shape (2/1 heads, d 64, blocks of 4): the score kernel's shared memory
// lands near the 48 KiB default limit, where a static array on top of it failed to launch.
TEST(LosaCudaStep, ATinyGroupAndBlockAtHeadDim64) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.block = 4;
  s.active_k = 2;
  s.prefix = {100, 44};
  s.budget = 32;
  check_against_cpu(s, 3);
  s.method = PrefixMethod::quest;
  check_against_cpu(s, 2);
}

TEST(LosaCudaStep, AnEmptyPrefixTakesTheBlockAlone) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.prefix = {0, 40};
  check_against_cpu(s, 2);
}

// ---- the decode-trace driver on the device ---------------------------------------------------

// A generated decode trace with every tensor rounded to bf16 (rebuilt as a recorded trace), so the
// CPU path (f32) and the device path (bf16) read the same values.
DecodeTrace bf16_trace(const DecodeTraceConfig& c) {
  auto g = DecodeTrace::generate(c);
  EXPECT_TRUE(g.ok()) << g.status().to_string();
  std::deque<HostArray> held;  // the rounded tensors (a deque: views stay valid as it grows)
  auto rounded = [&](const Tensor& x) {
    HostArray b = convert(x, DType::bf16).value();
    held.push_back(convert(b.view(), DType::f32).value());
    return held.back().view();
  };
  std::vector<RecordedTraceBlock> blocks(c.num_blocks);
  for (int64_t b = 0; b < c.num_blocks; ++b) {
    for (int64_t s = 0; s < g->steps_per_block(); ++s) {
      blocks[b].q.push_back(rounded(g->q(b, s)));
      blocks[b].k.push_back(rounded(g->k(b, s)));
      blocks[b].v.push_back(rounded(g->v(b, s)));
      blocks[b].unmasked.push_back(g->unmasked_after(b, s));
    }
    blocks[b].final_k = rounded(g->final_k(b));
    blocks[b].final_v = rounded(g->final_v(b));
  }
  const Tensor pk = c.prefix_len > 0 ? rounded(g->prefix_k()) : Tensor{};
  const Tensor pv = c.prefix_len > 0 ? rounded(g->prefix_v()) : Tensor{};
  auto t = DecodeTrace::from_recorded(pk, pv, blocks);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return std::move(t).value();
}

// `sparsa trace --backend cuda`'s driver against its CPU run on the same bf16 trace (two blocks, a
// commit between them): dense, quest, losa, reuse and losa over the union recompute the same rows
// every step, load the same pages (up to pages tied at the selection boundary: 2%), and their
// errors against their own backend's dense reference agree within the bf16 bound: O_p and the
// output are rounded to bf16 on the device, each at most 2^-9 relative, in the method and in the
// reference, so the relative errors differ by at most about 4 x 2^-8 = 0.016 (0.02 written).
TEST(LosaCudaTrace, TheDriverOnTheDeviceMatchesItsCpuRun) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  DecodeTraceConfig c;
  c.prefix_len = 1500;
  c.num_blocks = 2;
  c.tokens_per_step = 2;  // 8 steps a block
  const DecodeTrace t = bf16_trace(c);
  std::vector<LosaOptions> methods;
  for (PrefixMethod m : {PrefixMethod::dense, PrefixMethod::quest, PrefixMethod::losa, PrefixMethod::reuse}) {
    LosaOptions o;
    o.method = m;
    o.select.budget = 128;
    o.active_k = 2;
    methods.push_back(o);
  }
  LosaOptions over_union = methods[2];
  over_union.attend_union = true;
  methods.push_back(over_union);
  auto run_on = [&](Backend backend) {
    std::vector<LosaOptions> ms = methods;
    for (LosaOptions& o : ms) o.attention.backend = backend;
    auto r = run_trace(t, ms);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return std::move(r).value();
  };
  const auto cpu = run_on(Backend::cpu_ref), dev = run_on(Backend::cuda);
  ASSERT_EQ(dev.size(), cpu.size());
  for (size_t m = 0; m < methods.size(); ++m) {
    ASSERT_EQ(dev[m].size(), cpu[m].size());
    for (size_t i = 0; i < cpu[m].size(); ++i) {
      SCOPED_TRACE("method " + std::to_string(m) + " step " + std::to_string(i));
      const TraceStep &d = dev[m][i], &h = cpu[m][i];
      EXPECT_EQ(d.stats.recomputed, h.stats.recomputed);
      EXPECT_EQ(d.stats.dense_prefix, h.stats.dense_prefix);
      EXPECT_EQ(d.stats.prefix_pages, h.stats.prefix_pages);
      EXPECT_NEAR(d.stats.pages_loaded, h.stats.pages_loaded, 0.02 * h.stats.pages_loaded);
      EXPECT_NEAR(d.stats.pages_attended, h.stats.pages_attended, 0.02 * h.stats.pages_attended);
      EXPECT_NEAR(d.err, h.err, 0.02);
      EXPECT_NEAR(d.err_prefix, h.err_prefix, 0.02);
      EXPECT_NEAR(d.err_masked, h.err_masked, 0.02);
      EXPECT_NEAR(d.recall, h.recall, 0.02);
      if (methods[m].method == PrefixMethod::dense) EXPECT_EQ(d.err, 0.0) << "dense against its own reference";
    }
  }
}

// reuse: LoSA's active rows, their prefix dense (the split-KV executor for every row into scratch,
// the active rows adopting theirs); the stable rows keep their state bit for bit (checked in
// check_against_cpu). Top-K, none, every row, a threshold; an empty prefix; GQA 8 at d 128.
TEST(LosaCudaStep, ReuseMatchesTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int k : {4, 0, 16}) {
    SCOPED_TRACE("active_k " + std::to_string(k));
    Shape s;
    s.method = PrefixMethod::reuse;
    s.active_k = k;
    s.prefix = {1000, 333, 0};
    check_against_cpu(s, 4);
  }
  Shape s;
  s.method = PrefixMethod::reuse;
  s.mse_threshold = 0.05;
  s.prefix = {700, 1500};
  check_against_cpu(s, 4);
  s = Shape{};
  s.method = PrefixMethod::reuse;
  s.d = 128;
  s.heads_q = 16;
  s.heads_kv = 2;
  s.prefix = {2600};
  check_against_cpu(s, 3);
}

// attend_union: every active row over the union of the pages its kv head's query heads chose at
// the entry's active rows (the CPU's paged_attention with attend_union), for losa and quest (every
// row active: the largest unions); the plans are still each row's own. d 64 and 128; groups of 4
// and 8; a budget past 32 pages (the radix select) over prefixes of many tiles; budgets covering a
// prefix (every page); a threshold rule, whose unions change in size step to step; pages of 12.
TEST(LosaCudaStep, AttendUnionMatchesTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (int64_t d : {64, 128}) {
    SCOPED_TRACE("d " + std::to_string(d));
    Shape s;
    s.d = d;
    s.attend_union = true;
    s.prefix = {700, 2100, 40};
    check_against_cpu(s, 3);
    s.method = PrefixMethod::quest;
    check_against_cpu(s, 2);
  }
  {
    SCOPED_TRACE("group 8, budget 1024");
    Shape s;
    s.attend_union = true;
    s.heads_q = 16;
    s.heads_kv = 2;
    s.budget = 1024;
    s.prefix = {5000, 36000};
    check_against_cpu(s, 3);
  }
  {
    SCOPED_TRACE("threshold");
    Shape s;
    s.attend_union = true;
    s.mse_threshold = 0.05;
    s.prefix = {700, 1500};
    check_against_cpu(s, 4);
  }
  {
    SCOPED_TRACE("pages of 12");
    Shape s;
    s.attend_union = true;
    s.page_size = 12;
    s.budget = 8 * 12;
    s.prefix = {1003, 250};
    check_against_cpu(s, 3);
  }
}

// A LoSA step captured in a CUDA graph (the prefix does not change within a block) and replayed
// on new queries gives the eager steps' outputs bit for bit; each row over its own pages, and over
// its kv head's union.
void check_graph_replay(const Shape& s) {
  const int steps = 5;
  const Trace tr = make_trace(s, steps, 29);
  const int64_t B = 2;
  DeviceKVCacheConfig cc;
  cc.heads_kv = s.heads_kv;
  cc.head_dim = s.d;
  cc.pool_pages = 200;
  auto cache = DevicePagedKVCache::create(cc);
  ASSERT_TRUE(cache.ok());
  std::vector<int> seqs;
  for (int64_t b = 0; b < B; ++b) {
    seqs.push_back(cache->add_sequence(s.prefix[b]).value());
    const DeviceArray k = to_device(tr.prefix_k[b]), v = to_device(tr.prefix_v[b]);
    ASSERT_TRUE(cache->append(seqs[b], k.view(), v.view()).ok());
  }
  DeviceLosaConfig dc{B, s.heads_q, s.heads_kv, s.d, s.block};
  auto eager = DevicePrefixAttention::create(dc, options_of(s, Backend::cuda));
  auto graphed = DevicePrefixAttention::create(dc, options_of(s, Backend::cuda));
  ASSERT_TRUE(eager.ok() && graphed.ok());
  const Device cuda0{DeviceType::cuda, 0};
  auto q_in = DeviceArray::allocate(DType::bf16, {B, s.heads_q, s.block, s.d}, cuda0);
  auto k_in = DeviceArray::allocate(DType::bf16, {B, s.heads_kv, s.block, s.d}, cuda0);
  auto v_in = DeviceArray::allocate(DType::bf16, {B, s.heads_kv, s.block, s.d}, cuda0);
  auto out = DeviceArray::allocate(DType::bf16, {B, s.heads_q, s.block, s.d}, cuda0);
  auto lse = DeviceArray::allocate(DType::f32, {B, s.heads_q, s.block}, cuda0);
  ASSERT_TRUE(q_in.ok() && k_in.ok() && v_in.ok() && out.ok() && lse.ok());
  std::vector<std::vector<float>> eager_out, eager_lse;
  for (int step = 0; step < steps; ++step) {
    const DeviceArray q = to_device(tr.q[step]), k = to_device(tr.k[step]), v = to_device(tr.v[step]);
    ASSERT_TRUE(eager->step(*cache, seqs, q.view(), k.view(), v.view(), out->view(), lse->view()).ok());
    eager_out.push_back(to_host_f32(out->view()));
    eager_lse.push_back(to_host_f32(lse->view()));
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto load = [&](int step) {  // the step's inputs into the captured buffers
    const DeviceArray q = to_device(tr.q[step]), k = to_device(tr.k[step]), v = to_device(tr.v[step]);
    ASSERT_EQ(cudaMemcpy(q_in->data(), q.data(), q.nbytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(k_in->data(), k.data(), k.nbytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(v_in->data(), v.data(), v.nbytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
  };
  // Steps 0 and 1 eager (the second sizes the page plan and scores), then step 2 captured.
  for (int step = 0; step < 2; ++step) {
    load(step);
    ASSERT_TRUE(graphed->step(*cache, seqs, q_in->view(), k_in->view(), v_in->view(), out->view(), lse->view(), stream).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(to_host_f32(out->view()), eager_out[step]) << "eager step " << step;
  }
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status captured =
      graphed->step(*cache, seqs, q_in->view(), k_in->view(), v_in->view(), out->view(), lse->view(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured.to_string();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int step = 2; step < steps; ++step) {
    load(step);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(to_host_f32(out->view()), eager_out[step]) << "replayed step " << step;
    EXPECT_EQ(to_host_f32(lse->view()), eager_lse[step]) << "replayed step " << step;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  *graphed = DevicePrefixAttention();  // its page plan was allocated on `stream`: freed before it goes
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
}

TEST(LosaCudaStep, AGraphReplayEqualsEagerSteps) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (bool attend_union : {false, true}) {
    SCOPED_TRACE(attend_union ? "attend_union" : "own pages");
    Shape s;
    s.prefix = {900, 400};
    s.attend_union = attend_union;
    check_graph_replay(s);
  }
}

// A cache and a state made on the non-blocking stream their appends and steps run on (what the DLM
// engine does): the pool and the state are zeroed there, ordered before the first append and step,
// and the steps give what a cache and state on the legacy default stream give.
TEST(LosaCudaStep, ACacheAndStateOnTheStepsStreamMatchTheDefaultStreams) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Shape s;
  s.prefix = {700, 333};
  const int steps = 3;
  const Trace tr = make_trace(s, steps, 31);
  const int64_t B = 2;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<std::vector<float>> outs[2];
  for (int on_stream = 0; on_stream < 2; ++on_stream) {
    void* st = on_stream ? stream : nullptr;
    DeviceKVCacheConfig cc;
    cc.heads_kv = s.heads_kv;
    cc.head_dim = s.d;
    cc.pool_pages = 200;
    cc.stream = st;
    auto cache = DevicePagedKVCache::create(cc);
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    std::vector<int> seqs;
    for (int64_t b = 0; b < B; ++b) {
      seqs.push_back(cache->add_sequence(s.prefix[b]).value());
      const DeviceArray k = to_device(tr.prefix_k[b]), v = to_device(tr.prefix_v[b]);
      ASSERT_TRUE(cache->append(seqs[b], k.view(), v.view(), st).ok());
      ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(st)), cudaSuccess);  // before k, v go
    }
    DeviceLosaConfig dc{B, s.heads_q, s.heads_kv, s.d, s.block};
    auto state = DevicePrefixAttention::create(dc, options_of(s, Backend::cuda), 0, DType::bf16, st);
    ASSERT_TRUE(state.ok()) << state.status().to_string();
    const Device cuda0{DeviceType::cuda, 0};
    auto out = DeviceArray::allocate(DType::bf16, {B, s.heads_q, s.block, s.d}, cuda0, false, st);
    auto lse = DeviceArray::allocate(DType::f32, {B, s.heads_q, s.block}, cuda0, false, st);
    ASSERT_TRUE(out.ok() && lse.ok());
    for (int step = 0; step < steps; ++step) {
      const DeviceArray q = to_device(tr.q[step]), k = to_device(tr.k[step]), v = to_device(tr.v[step]);
      ASSERT_TRUE(state->step(*cache, seqs, q.view(), k.view(), v.view(), out->view(), lse->view(), st).ok());
      ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(st)), cudaSuccess);
      outs[on_stream].push_back(to_host_f32(out->view()));
    }
  }  // everything made on `stream` is freed before it goes
  for (int step = 0; step < steps; ++step) EXPECT_EQ(outs[1][step], outs[0][step]) << "step " << step;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
}

// Entries [b, b + count) of a [B, ...] tensor (a view).
Tensor batch_entries(Tensor t, int64_t b, int64_t count) {
  t.data = static_cast<std::byte*>(t.data) + b * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  t.shape[0] = count;
  return t;
}

// Entries of one batched state that do not step together (the engine's requests: one idle while
// the others step, one starting a new block while the others are mid-block) give, entry by
// entry, what a state of its own gives for the same calls: step_entries over sub-ranges, step()
// over entries in different phases (a dense first step beside sparse ones in one call), and
// begin_block of one entry.
TEST(LosaCudaStep, EntriesOutOfStepMatchAStateEach) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  for (PrefixMethod method : {PrefixMethod::losa, PrefixMethod::quest}) {
    SCOPED_TRACE(method == PrefixMethod::losa ? "losa" : "quest");
    Shape s;
    s.method = method;
    s.prefix = {700, 1500, 2100};  // 44, 94 and 132 pages: one, one and two page tiles
    const int64_t B = 3;
    // Rounds: (first entry, count, entry that begins a new block before the round or -1).
    struct Round {
      int64_t first, count, begin;
    };
    const std::vector<Round> rounds = {{0, 3, -1}, {0, 2, -1}, {0, 3, 1}, {1, 2, -1}, {2, 1, -1}, {0, 3, 2}, {0, 1, 0}};
    const Trace tr = make_trace(s, static_cast<int>(rounds.size()), 41);
    DeviceKVCacheConfig cc;
    cc.heads_kv = s.heads_kv;
    cc.head_dim = s.d;
    cc.pool_pages = 400;
    auto cache = DevicePagedKVCache::create(cc);
    ASSERT_TRUE(cache.ok());
    std::vector<int> seqs;
    for (int64_t b = 0; b < B; ++b) {
      seqs.push_back(cache->add_sequence(s.prefix[b]).value());
      const DeviceArray k = to_device(tr.prefix_k[b]), v = to_device(tr.prefix_v[b]);
      ASSERT_TRUE(cache->append(seqs[b], k.view(), v.view()).ok());
    }
    const LosaOptions o = options_of(s, Backend::cuda);
    auto batched = DevicePrefixAttention::create({B, s.heads_q, s.heads_kv, s.d, s.block}, o);
    ASSERT_TRUE(batched.ok()) << batched.status().to_string();
    std::vector<DevicePrefixAttention> single;
    for (int64_t b = 0; b < B; ++b) {
      auto one = DevicePrefixAttention::create({1, s.heads_q, s.heads_kv, s.d, s.block}, o);
      ASSERT_TRUE(one.ok());
      single.push_back(std::move(one).value());
    }
    const Device cuda0{DeviceType::cuda, 0};
    auto out = DeviceArray::allocate(DType::bf16, {B, s.heads_q, s.block, s.d}, cuda0);
    auto lse = DeviceArray::allocate(DType::f32, {B, s.heads_q, s.block}, cuda0);
    auto out1 = DeviceArray::allocate(DType::bf16, {1, s.heads_q, s.block, s.d}, cuda0);
    auto lse1 = DeviceArray::allocate(DType::f32, {1, s.heads_q, s.block}, cuda0);
    ASSERT_TRUE(out.ok() && lse.ok() && out1.ok() && lse1.ok());
    for (size_t r = 0; r < rounds.size(); ++r) {
      const Round& rd = rounds[r];
      SCOPED_TRACE("round " + std::to_string(r));
      if (rd.begin >= 0) {
        batched->begin_block(rd.begin);
        single[rd.begin].begin_block();
      }
      const DeviceArray q = to_device(tr.q[r]), k = to_device(tr.k[r]), v = to_device(tr.v[r]);
      const std::vector<int> ids(seqs.begin() + rd.first, seqs.begin() + rd.first + rd.count);
      const Tensor o_run = batch_entries(out->view(), 0, rd.count), l_run = batch_entries(lse->view(), 0, rd.count);
      const Status st =
          rd.count == B ? batched->step(*cache, ids, q.view(), k.view(), v.view(), o_run, l_run)
                        : batched->step_entries(rd.first, *cache, ids, batch_entries(q.view(), rd.first, rd.count),
                                                batch_entries(k.view(), rd.first, rd.count),
                                                batch_entries(v.view(), rd.first, rd.count), o_run, l_run);
      ASSERT_TRUE(st.ok()) << st.to_string();
      const std::vector<float> got_out = to_host_f32(o_run), got_lse = to_host_f32(l_run);
      const int64_t per_out = s.heads_q * s.block * s.d, per_lse = s.heads_q * s.block;
      for (int64_t i = 0; i < rd.count; ++i) {
        const int64_t b = rd.first + i;
        ASSERT_TRUE(single[b]
                        .step(*cache, {seqs[b]}, batch_entries(q.view(), b, 1), batch_entries(k.view(), b, 1),
                              batch_entries(v.view(), b, 1), out1->view(), lse1->view())
                        .ok());
        const std::vector<float> want_out = to_host_f32(out1->view()), want_lse = to_host_f32(lse1->view());
        // The same launches on the same data, entry by entry: equal bit for bit.
        EXPECT_TRUE(std::equal(want_out.begin(), want_out.end(), got_out.begin() + i * per_out)) << "out, entry " << b;
        EXPECT_TRUE(std::equal(want_lse.begin(), want_lse.end(), got_lse.begin() + i * per_lse)) << "lse, entry " << b;
        EXPECT_EQ(batched->steps_in_block(b), single[b].steps_in_block()) << "entry " << b;
      }
    }
  }
  // A range outside the batch, named.
  Shape s;
  s.prefix = {64};
  DeviceKVCacheConfig cc;
  cc.heads_kv = s.heads_kv;
  cc.head_dim = s.d;
  cc.pool_pages = 20;
  auto cache = DevicePagedKVCache::create(cc);
  ASSERT_TRUE(cache.ok());
  const int id = cache->add_sequence(64).value();
  auto state = DevicePrefixAttention::create({2, s.heads_q, s.heads_kv, s.d, s.block}, options_of(s, Backend::cuda));
  ASSERT_TRUE(state.ok());
  auto q = DeviceArray::allocate(DType::bf16, {1, s.heads_q, s.block, s.d}, {DeviceType::cuda, 0});
  auto kv = DeviceArray::allocate(DType::bf16, {1, s.heads_kv, s.block, s.d}, {DeviceType::cuda, 0});
  auto l = DeviceArray::allocate(DType::f32, {1, s.heads_q, s.block}, {DeviceType::cuda, 0});
  ASSERT_TRUE(q.ok() && kv.ok() && l.ok());
  const Status far = state->step_entries(2, *cache, {id}, q->view(), kv->view(), kv->view(), q->view(), l->view());
  EXPECT_EQ(far.message().rfind("first:", 0), 0u) << far.to_string();
  const Status many = state->step_entries(1, *cache, {id, id}, q->view(), kv->view(), kv->view(), q->view(), l->view());
  EXPECT_EQ(many.message().rfind("seqs:", 0), 0u) << many.to_string();
}

TEST(LosaCudaStep, BadStepInputsNameTheArgument) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  DeviceKVCacheConfig cc;
  cc.heads_kv = 2;
  cc.head_dim = 64;
  cc.pool_pages = 20;
  auto cache = DevicePagedKVCache::create(cc);
  ASSERT_TRUE(cache.ok());
  const int seq = cache->add_sequence(200).value();
  Shape s;
  DeviceLosaConfig dc{1, s.heads_q, s.heads_kv, s.d, s.block};
  auto dev = DevicePrefixAttention::create(dc, options_of(s, Backend::cuda));
  ASSERT_TRUE(dev.ok());
  const DeviceArray q = to_device(bf16_values({1, 8, 16, 64}, 1)), kv = to_device(bf16_values({1, 2, 16, 64}, 2));
  const DeviceArray short_q = to_device(bf16_values({1, 8, 15, 64}, 3));
  auto out = DeviceArray::allocate(DType::bf16, {1, 8, 16, 64}, {DeviceType::cuda, 0});
  auto lse = DeviceArray::allocate(DType::f32, {1, 8, 16}, {DeviceType::cuda, 0});
  ASSERT_TRUE(out.ok() && lse.ok());
  auto expect = [](const Status& st, const char* prefix) {
    ASSERT_FALSE(st.ok()) << prefix;
    EXPECT_EQ(st.message().rfind(prefix, 0), 0u) << st.to_string();
  };
  expect(dev->step(*cache, {seq, seq}, q.view(), kv.view(), kv.view(), out->view(), lse->view()), "seqs:");
  expect(dev->step(*cache, {9}, q.view(), kv.view(), kv.view(), out->view(), lse->view()), "seqs[0]:");
  expect(dev->step(*cache, {seq}, short_q.view(), kv.view(), kv.view(), out->view(), lse->view()), "q:");
  expect(dev->step(*cache, {seq}, q.view(), q.view(), kv.view(), out->view(), lse->view()), "k_block:");
  expect(dev->step(*cache, {seq}, q.view(), kv.view(), kv.view(), out->view(), out->view()), "lse:");
  HostArray host_out(DType::bf16, {1, 8, 16, 64});
  expect(dev->step(*cache, {seq}, q.view(), kv.view(), kv.view(), host_out.view(), lse->view()), "out:");
  // A commit that does not fit is refused before anything is written.
  const int small = cache->add_sequence(10).value();
  ASSERT_TRUE(cache->append(small, device_tokens(kv, 0, 10), device_tokens(kv, 0, 10)).ok());
  auto small_state = DevicePrefixAttention::create(dc, options_of(s, Backend::cuda));
  ASSERT_TRUE(small_state.ok());
  const Status full = small_state->commit(*cache, {small}, kv.view(), kv.view());
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.code(), StatusCode::out_of_memory);
  EXPECT_EQ(cache->length(small).value(), 10);
  // A batch of two that names one sequence twice: refused, nothing written.
  DeviceLosaConfig dc2{2, s.heads_q, s.heads_kv, s.d, s.block};
  auto pair = DevicePrefixAttention::create(dc2, options_of(s, Backend::cuda));
  ASSERT_TRUE(pair.ok());
  const DeviceArray kv2 = to_device(bf16_values({2, 2, 16, 64}, 5));
  const int64_t before = cache->length(seq).value();
  expect(pair->commit(*cache, {seq, seq}, kv2.view(), kv2.view()), "seqs[1]:");
  EXPECT_EQ(cache->length(seq).value(), before);
}

#endif  // SPARSA_WITH_CUDA

}  // namespace
