// The cuda backend of dense and block-sparse attention against cpu_ref (docs/testing.md).
//
// Runs where a CUDA device is visible (scripts/gpu-check); elsewhere the device cases skip and
// only the "not available" contract is checked.
//
// Error bound (docs/testing.md): the reference is cpu_ref on the exact f32 values of the bf16/f16
// inputs (f64 accumulation). A "naive" half-precision implementation rounds the logits, the
// normalised probabilities and the output to the input dtype (f32 accumulation in between); the
// cuda output's relative L2 error must be at most twice the naive one. LSE is computed from f32
// logits of exact products and f32 sums of exponentials: its error is a few f32 ulps of the
// logits times the accumulation length, far under 2e-4 * (1 + |lse|), the bound used.
// Every output element must be written and finite; poisoned bytes around and between the
// output rows must stay untouched; rows that see no key must be exactly O = 0, LSE = -inf.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <ostream>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "sparsa/attention.h"

#if defined(SPARSA_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda/attention/route.h"
#endif

using namespace sparsa;

TEST(CudaAttention, ReportsAvailabilityHonestly) {
  HostArray q(DType::bf16, {1, 1, 4, 64}), out(DType::bf16, {1, 1, 4, 64}), lse(DType::f32, {1, 1, 4});
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  const Status st = dense(q.view(), q.view(), q.view(), out.view(), lse.view(), opt);
  ASSERT_FALSE(st.ok());  // host tensors are never accepted by the cuda backend
  if (!backend_available(Backend::cuda)) {
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
  } else {
    EXPECT_NE(st.message().find("q:"), std::string::npos) << st.to_string();
  }
}

#if defined(SPARSA_WITH_CUDA)

namespace {

// Rung 3's consumer schedules by name, and a guard that restores the process-wide one.
constexpr std::pair<const char*, cuda::detail::FlashSchedule> kFlashSchedules[] = {
    {"plain", cuda::detail::FlashSchedule::plain},
    {"pingpong", cuda::detail::FlashSchedule::pingpong},
    {"overlap", cuda::detail::FlashSchedule::overlap},
    {"late", cuda::detail::FlashSchedule::late}};
struct ScheduleGuard {
  cuda::detail::FlashSchedule saved = cuda::detail::set_flash_schedule(cuda::detail::FlashSchedule::overlap);
  ~ScheduleGuard() { cuda::detail::set_flash_schedule(saved); }
};

// Switches of the cases that came with later kernels (masks, variable-length batches, head_dim
// 256): on, the cases run against cpu_ref under the same bound as every other case and
// CudaAttentionMasks.RefusedByNameNeverIgnored stops expecting a refusal; off, the cases skip and
// the refusal is checked.
constexpr bool kCudaMaskKernel = true;
constexpr bool kCudaVarlenKernel = true;
constexpr bool kCudaHeadDim256 = true;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) { reset(n); }
  void reset(size_t n) {
    cudaFree(ptr);
    bytes = n;
    if (cudaMalloc(&ptr, std::max<size_t>(n, 16)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
};

struct Case {
  std::string name;
  DType dtype = DType::bf16;
  int64_t batch = 1, heads_q = 2, heads_kv = 2, len_q = 17, len_kv = 33, head_dim = 64;
  bool sparse = false;
  int block_q = 64, block_kv = 64;
  double keep = 1.0;        // fraction of key blocks kept (diagonal forced)
  bool perms = false;       // random perm_q / perm_kv
  bool empty_rows = false;  // some query blocks get count 0
  int64_t seq_pad = 0;      // extra elements between rows of q, k, v and out (strided views)
  float amplitude = 1.0f;   // q scale: larger gives peakier softmax
  int repeats = 1;          // calls on the same buffers; every one checked, all bitwise equal
  bool interleave = false;  // between repeats, a split-KV call of another shape (other merge groups)
  int expect_splits = 0;    // split-KV: 1 = exactly one split; n > 1 = at least n splits; 0 = unchecked
  int64_t merge_wait_ns = -1;  // split-KV: the merge's waiting bound (0 forces its fallback); -1: default
  bool split_kv_tma = true;    // split-KV: allow rung 2 (wgmma + TMA); false forces rung 1 (mma.sync)
  bool flash_tma = true;       // flash: allow rung 3 (TMA producer); false forces rung 2 (cp.async)
  std::optional<cuda::detail::FlashSchedule> flash_schedule;  // flash rung 3's (route.h); none: the default
  int dense_key_tile = 128;    // flash rung 3's dense key tile at head_dim 128 (route.h): 128 or 176
  Mask mask;                   // the per-element mask (cases of CudaAttentionMasks)
  uint32_t seed = 1;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

float round_to(DType dtype, float x) {
  return dtype == DType::bf16 ? bf16_to_float(float_to_bf16(x)) : half_to_float(float_to_half(x));
}
uint16_t encode(DType dtype, float x) { return dtype == DType::bf16 ? float_to_bf16(x) : float_to_half(x); }
float decode(DType dtype, uint16_t x) { return dtype == DType::bf16 ? bf16_to_float(x) : half_to_float(x); }

// Visible keys and rows of the plan, in original token order (the semantics of cpu_ref).
struct Group {
  std::vector<int64_t> rows, keys;
};
std::vector<Group> groups_of(const Case& c, const BlockIndexBuffer* plan, int64_t b, int64_t h) {
  std::vector<Group> out;
  if (plan == nullptr) {
    Group g;
    for (int64_t i = 0; i < c.len_q; ++i) g.rows.push_back(i);
    for (int64_t j = 0; j < c.len_kv; ++j) g.keys.push_back(j);
    out.push_back(g);
    return out;
  }
  const int64_t h_kv = h / (c.heads_q / c.heads_kv);
  const BlockIndex ix = plan->view();
  for (int64_t qb = 0; qb < plan->num_q_blocks; ++qb) {
    Group g;
    const int32_t count = ix.counts.ptr<int32_t>()[ix.counts.offset({b, h, qb})];
    for (int32_t s = 0; s < count; ++s) {
      const int64_t kb = ix.indices.ptr<int32_t>()[ix.indices.offset({b, h, qb, s})];
      for (int64_t p = kb * c.block_kv; p < std::min<int64_t>((kb + 1) * c.block_kv, c.len_kv); ++p)
        g.keys.push_back(ix.perm_kv.defined() ? ix.perm_kv.ptr<int32_t>()[ix.perm_kv.offset({b, h_kv, p})] : p);
    }
    for (int64_t p = qb * c.block_q; p < std::min<int64_t>((qb + 1) * c.block_q, c.len_q); ++p)
      g.rows.push_back(ix.perm_q.defined() ? ix.perm_q.ptr<int32_t>()[ix.perm_q.offset({b, h, p})] : p);
    out.push_back(g);
  }
  return out;
}

BlockIndexBuffer make_plan(const Case& c, std::mt19937& rng) {
  const int64_t nq = (c.len_q + c.block_q - 1) / c.block_q, nkv = (c.len_kv + c.block_kv - 1) / c.block_kv;
  BlockIndexBuffer plan = BlockIndexBuffer::empty(c.batch, c.heads_q, c.len_q, c.len_kv, c.block_q, c.block_kv, nkv);
  std::uniform_real_distribution<double> u(0, 1);
  int32_t* counts = plan.counts.ptr<int32_t>();
  int32_t* indices = plan.indices.ptr<int32_t>();
  for (int64_t r = 0; r < c.batch * c.heads_q * nq; ++r) {
    const int64_t qb = r % nq;
    int32_t n = 0;
    if (!(c.empty_rows && qb % 3 == 1)) {
      for (int64_t kb = 0; kb < nkv; ++kb)
        if (kb == qb || u(rng) < c.keep) indices[r * nkv + n++] = static_cast<int32_t>(kb);
    }
    counts[r] = n;
    for (int64_t s = n; s < nkv; ++s) indices[r * nkv + s] = -7;  // padding is never read as a block
  }
  if (c.perms) {
    auto perm = [&](int64_t heads, int64_t len) {
      HostArray a(DType::i32, {c.batch, heads, len});
      for (int64_t r = 0; r < c.batch * heads; ++r) {
        std::vector<int32_t> p(len);
        std::iota(p.begin(), p.end(), 0);
        std::shuffle(p.begin(), p.end(), rng);
        std::copy(p.begin(), p.end(), a.ptr<int32_t>() + r * len);
      }
      return a;
    };
    plan.perm_q = perm(c.heads_q, c.len_q);
    plan.perm_kv = perm(c.heads_kv, c.len_kv);
  }
  return plan;
}

// Naive half-precision attention (see the header comment): relative L2 error vs the reference.
double naive_error(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v, const BlockIndexBuffer* plan, const std::vector<float>& ref) {
  const int64_t D = c.head_dim, group = c.heads_q / c.heads_kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  double err = 0, norm = 0;
  std::vector<float> s;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.heads_q; ++h) {
      const int64_t h_kv = h / group;
      for (const Group& g : groups_of(c, plan, b, h)) {
        for (int64_t i : g.rows) {
          const float* qi = &q[((b * c.heads_q + h) * c.len_q + i) * D];
          std::vector<int64_t> keys;  // the group's keys that the mask shows row i
          for (int64_t j : g.keys)
            if (mask_visible(c.mask, i, j, c.len_q, c.len_kv)) keys.push_back(j);
          s.assign(keys.size(), 0.0f);
          float m = -INFINITY;
          for (size_t n = 0; n < keys.size(); ++n) {
            const float* kj = &k[((b * c.heads_kv + h_kv) * c.len_kv + keys[n]) * D];
            float dot = 0;
            for (int64_t t = 0; t < D; ++t) dot += qi[t] * kj[t];
            s[n] = round_to(c.dtype, dot * scale);
            m = std::max(m, s[n]);
          }
          float sum = 0;
          for (float& x : s) sum += (x = std::exp(x - m));
          for (int64_t t = 0; t < D; ++t) {
            float o = 0;
            for (size_t n = 0; n < keys.size(); ++n)
              o += round_to(c.dtype, s[n] / sum) * v[((b * c.heads_kv + h_kv) * c.len_kv + keys[n]) * D + t];
            const double r = ref[((b * c.heads_q + h) * c.len_q + i) * D + t];
            const double d = round_to(c.dtype, o) - r;
            err += d * d;
            norm += r * r;
          }
        }
      }
    }
  }
  return norm > 0 ? std::sqrt(err / norm) : 0.0;
}

// Uploads host values (dense [B, H, L, D]) into a strided device view with seq_pad.
Tensor upload(const Case& c, const std::vector<float>& x, int64_t heads, int64_t len, DeviceBuffer& buf) {
  const int64_t D = c.head_dim, row = D + c.seq_pad;
  std::vector<uint16_t> h(static_cast<size_t>(c.batch * heads * len * row), 0);
  for (int64_t r = 0; r < c.batch * heads * len; ++r)
    for (int64_t t = 0; t < D; ++t) h[r * row + t] = encode(c.dtype, x[r * D + t]);
  buf.reset(h.size() * 2);
  cudaMemcpy(buf.ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  Tensor t;
  t.data = buf.ptr;
  t.dtype = c.dtype;
  t.device = Device{DeviceType::cuda, 0};
  t.ndim = 4;
  const int64_t shape[4] = {c.batch, heads, len, D}, strides[4] = {heads * len * row, len * row, row, 1};
  std::copy(shape, shape + 4, t.shape);
  std::copy(strides, strides + 4, t.strides);
  return t;
}

// b16 values (bf16 or f16 bits) into buf on the device (at least 2 bytes, for empty arrays).
void upload_u16(const std::vector<uint16_t>& x, DeviceBuffer& buf) {
  buf.reset(std::max<size_t>(x.size(), 1) * 2);
  ASSERT_EQ(cudaMemcpy(buf.ptr, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
}

// Rows [row0, row0 + len) of a [total, heads, D] varlen array as a [heads, len, D] one (a
// sequence's own fixed-length call).
std::vector<uint16_t> sequence_rows(const std::vector<uint16_t>& x, int64_t heads, int64_t D, int64_t row0,
                                    int64_t len) {
  std::vector<uint16_t> y(heads * len * D);
  for (int64_t i = 0; i < len; ++i)
    for (int64_t h = 0; h < heads; ++h) std::copy_n(&x[((row0 + i) * heads + h) * D], D, &y[(h * len + i) * D]);
  return y;
}

// The (row, head) pairs whose O or LSE differ bit-wise between a sequence's own call (O [1, H, len,
// D], LSE [1, H, len]) and its rows [row0, row0 + len) of a varlen call (O [total, H, D], LSE [H, total]).
int64_t rows_differing(const std::vector<uint16_t>& out_one, const std::vector<float>& lse_one,
                       const std::vector<uint16_t>& out_var, const std::vector<float>& lse_var, int64_t H, int64_t D,
                       int64_t total, int64_t row0, int64_t len) {
  int64_t n = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < len; ++i) {
      n += std::memcmp(&lse_one[h * len + i], &lse_var[h * total + row0 + i], 4) != 0;
      n += std::memcmp(&out_one[(h * len + i) * D], &out_var[((row0 + i) * H + h) * D], D * 2) != 0;
    }
  return n;
}

Tensor upload_i32(const HostArray& a, DeviceBuffer& buf) {
  buf.reset(a.nbytes());
  cudaMemcpy(buf.ptr, a.data(), a.nbytes(), cudaMemcpyHostToDevice);
  Tensor t = a.view();
  t.data = buf.ptr;
  t.device = Device{DeviceType::cuda, 0};
  return t;
}

// A split-KV call of a fixed shape unlike the cases' (2 x 3 kv heads, 5 queries, 3000 keys, d 64,
// zeros) whose result is not looked at: between two calls of a case it runs with other merge
// groups, another instantiation and maybe a workspace reallocation, and must leave the counters
// as it found them (zero).
void other_split_kv_call() {
  const Device gpu{DeviceType::cuda, 0};
  const int64_t B = 2, Hq = 6, Hkv = 3, Lq = 5, Lkv = 3000, D = 64;
  DeviceBuffer q(B * Hq * Lq * D * 2), k(B * Hkv * Lkv * D * 2), v(B * Hkv * Lkv * D * 2), o(B * Hq * Lq * D * 2),
      l(B * Hq * Lq * 4);
  CUDA_OK(cudaMemset(q.ptr, 0, q.bytes));
  CUDA_OK(cudaMemset(k.ptr, 0, k.bytes));
  CUDA_OK(cudaMemset(v.ptr, 0, v.bytes));
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  const Status st = dense(Tensor::contiguous(q.ptr, DType::bf16, {B, Hq, Lq, D}, gpu),
                          Tensor::contiguous(k.ptr, DType::bf16, {B, Hkv, Lkv, D}, gpu),
                          Tensor::contiguous(v.ptr, DType::bf16, {B, Hkv, Lkv, D}, gpu),
                          Tensor::contiguous(o.ptr, DType::bf16, {B, Hq, Lq, D}, gpu),
                          Tensor::contiguous(l.ptr, DType::f32, {B, Hq, Lq}, gpu), opt);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(cuda::detail::last_dense_route(), cuda::detail::Route::split_kv);
  ASSERT_GT(cuda::detail::last_split_kv_splits(), 1);
  ASSERT_TRUE(cuda::detail::split_kv_counters_zero(0)) << "split-KV: a call left its merge counters non-zero";
}

// The output checks of one call: guards and padding untouched, empty rows exact, LSE within
// 2e-4 * (1 + |lse|), every element finite and the relative L2 error within `bound`.
void check_output(const Case& c, const std::vector<uint16_t>& out_h, const std::vector<float>& lse_h,
                  const AttentionOutput& ref, const std::vector<float>& ref_out, double bound, int64_t guard) {
  const int64_t D = c.head_dim, row = D + c.seq_pad, rows = c.batch * c.heads_q * c.len_q;
  // Guards and padding untouched.
  for (int64_t i = 0; i < guard; ++i) {
    ASSERT_EQ(out_h[i], 0xffff) << "out: wrote before the buffer";
    ASSERT_EQ(out_h[guard + rows * row + i], 0xffff) << "out: wrote past the buffer";
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = D; t < row; ++t) ASSERT_EQ(out_h[guard + r * row + t], 0xffff) << "out: wrote into row padding";
  uint32_t lse_poison;
  std::memset(&lse_poison, 0xff, 4);
  for (int64_t i = 0; i < guard; ++i) {
    ASSERT_EQ(std::memcmp(&lse_h[i], &lse_poison, 4), 0) << "lse: wrote before the buffer";
    ASSERT_EQ(std::memcmp(&lse_h[guard + rows + i], &lse_poison, 4), 0) << "lse: wrote past the buffer";
  }

  double err = 0, norm = 0;
  int64_t lse_bad = 0, empty_bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float l = lse_h[guard + r], lr = ref.lse.ptr<float>()[r];
    if (std::isinf(lr)) {  // a row that sees no key
      bool zero = l == -INFINITY;
      for (int64_t t = 0; t < D; ++t) zero = zero && decode(c.dtype, out_h[guard + r * row + t]) == 0.0f;
      empty_bad += !zero;
      continue;
    }
    if (!(std::abs(l - lr) <= 2e-4 * (1.0 + std::abs(lr)))) ++lse_bad;
    for (int64_t t = 0; t < D; ++t) {
      const double o = decode(c.dtype, out_h[guard + r * row + t]), rf = ref_out[r * D + t];
      if (!std::isfinite(o)) {
        FAIL() << "out: element " << r << "," << t << " is not finite (unwritten or NaN): " << o;
      }
      err += (o - rf) * (o - rf);
      norm += rf * rf;
    }
  }
  const double rel = norm > 0 ? std::sqrt(err / norm) : 0.0;
  EXPECT_EQ(empty_bad, 0) << "rows that see no key must be O = 0, LSE = -inf";
  EXPECT_EQ(lse_bad, 0) << "lse outside 2e-4 * (1 + |lse|)";
  EXPECT_LE(rel, bound + 1e-7) << "relative L2 error " << rel << " vs bound " << bound << " (twice naive)";
  std::printf("  %-40s rel_err %.3e  bound %.3e\n", c.name.c_str(), rel, bound);
}

class Ops : public ::testing::TestWithParam<Case> {};

TEST_P(Ops, MatchesReference) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  if (!c.mask.is_none() && !kCudaMaskKernel) GTEST_SKIP() << "no cuda mask kernel yet (kCudaMaskKernel)";
  if (c.head_dim == 256 && !kCudaHeadDim256) GTEST_SKIP() << "no cuda head_dim 256 kernel yet (kCudaHeadDim256)";
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd;
  const int64_t D = c.head_dim;
  auto random = [&](int64_t n, float amp) {
    std::vector<float> x(n);
    for (float& e : x) e = round_to(c.dtype, amp * nd(rng));
    return x;
  };
  const std::vector<float> q = random(c.batch * c.heads_q * c.len_q * D, c.amplitude);
  const std::vector<float> k = random(c.batch * c.heads_kv * c.len_kv * D, 1.0f);
  const std::vector<float> v = random(c.batch * c.heads_kv * c.len_kv * D, 1.0f);
  std::optional<BlockIndexBuffer> plan;
  if (c.sparse) plan = make_plan(c, rng);

  // Reference: cpu_ref on the exact f32 values of the half inputs.
  AttentionOptions ref_opt;
  ref_opt.backend = Backend::cpu_ref;
  ref_opt.mask = c.mask;
  auto host = [&](const std::vector<float>& x, int64_t heads, int64_t len) {
    HostArray a(DType::f32, {c.batch, heads, len, D});
    std::copy(x.begin(), x.end(), a.ptr<float>());
    return a;
  };
  HostArray qh = host(q, c.heads_q, c.len_q), kh = host(k, c.heads_kv, c.len_kv), vh = host(v, c.heads_kv, c.len_kv);
  auto ref = plan ? block_sparse(qh.view(), kh.view(), vh.view(), plan->view(), ref_opt)
                  : dense(qh.view(), kh.view(), vh.view(), ref_opt);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  const std::vector<float> ref_out(ref->out.ptr<float>(), ref->out.ptr<float>() + ref->out.numel());
  const double bound = 2.0 * naive_error(c, q, k, v, plan ? &*plan : nullptr, ref_out);

  // Device inputs, plan and poisoned outputs.
  DeviceBuffer qb(0), kb(0), vb(0), cb(0), ib(0), pqb(0), pkb(0);
  const Tensor qd = upload(c, q, c.heads_q, c.len_q, qb), kd = upload(c, k, c.heads_kv, c.len_kv, kb),
               vd = upload(c, v, c.heads_kv, c.len_kv, vb);
  BlockIndex ixd;
  if (plan) {
    ixd = plan->view();
    ixd.counts = upload_i32(plan->counts, cb);
    ixd.indices = upload_i32(plan->indices, ib);
    if (!plan->perm_q.empty()) ixd.perm_q = upload_i32(plan->perm_q, pqb);
    if (!plan->perm_kv.empty()) ixd.perm_kv = upload_i32(plan->perm_kv, pkb);
  }
  const int64_t row = D + c.seq_pad, rows = c.batch * c.heads_q * c.len_q, guard = 256;
  DeviceBuffer out_buf((rows * row + 2 * guard) * 2), lse_buf((rows + 2 * guard) * 4);
  Tensor out = qd;
  out.data = static_cast<uint16_t*>(out_buf.ptr) + guard;
  Tensor lse = Tensor::contiguous(static_cast<float*>(lse_buf.ptr) + guard, DType::f32,
                                  {c.batch, c.heads_q, c.len_q}, Device{DeviceType::cuda, 0});
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  opt.mask = c.mask;
  std::vector<uint16_t> first_out;
  std::vector<float> first_lse;
  struct WaitBound {  // the case's merge waiting bound, restored however the test ends
    unsigned long long saved = 0;
    bool set = false;
    ~WaitBound() {
      if (set) cuda::detail::set_split_kv_merge_wait_ns(saved);
    }
  } wait_bound;
  struct TmaSwitch {  // the case's split-KV rung, restored however the test ends
    bool saved = cuda::detail::set_split_kv_tma(true);
    ~TmaSwitch() { cuda::detail::set_split_kv_tma(saved); }
  } tma_switch;
  cuda::detail::set_split_kv_tma(c.split_kv_tma);
  struct FlashTmaSwitch {  // the case's flash rung, restored however the test ends
    bool saved = cuda::detail::set_flash_tma(true);
    ~FlashTmaSwitch() { cuda::detail::set_flash_tma(saved); }
  } flash_tma_switch;
  cuda::detail::set_flash_tma(c.flash_tma);
  struct ScheduleSwitch {  // the case's rung-3 schedule, restored however the test ends
    cuda::detail::FlashSchedule saved = cuda::detail::set_flash_schedule(cuda::detail::FlashSchedule::plain);
    ~ScheduleSwitch() { cuda::detail::set_flash_schedule(saved); }
  } schedule_switch;
  const cuda::detail::FlashSchedule schedule = c.flash_schedule.value_or(schedule_switch.saved);
  cuda::detail::set_flash_schedule(schedule);
  struct KeyTileSwitch {  // the case's dense key tile, restored however the test ends
    int saved = cuda::detail::set_flash_dense_key_tile(128);
    ~KeyTileSwitch() { cuda::detail::set_flash_dense_key_tile(saved); }
  } key_tile_switch;
  cuda::detail::set_flash_dense_key_tile(c.dense_key_tile);
  if (c.merge_wait_ns >= 0) {
    wait_bound.saved = cuda::detail::set_split_kv_merge_wait_ns(static_cast<unsigned long long>(c.merge_wait_ns));
    wait_bound.set = true;
  }
  for (int call = 0; call < c.repeats; ++call) {
    SCOPED_TRACE("call " + std::to_string(call + 1) + " of " + std::to_string(c.repeats));
    if (call > 0 && c.interleave) ASSERT_NO_FATAL_FAILURE(other_split_kv_call());
    CUDA_OK(cudaMemset(out_buf.ptr, 0xff, out_buf.bytes));
    CUDA_OK(cudaMemset(lse_buf.ptr, 0xff, lse_buf.bytes));
    const Status st = plan ? block_sparse(qd, kd, vd, ixd, out, lse, opt) : dense(qd, kd, vd, out, lse, opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    // The executor the shape is meant to reach (the split-KV rule of attention.cu: head_dim 256
    // takes the flash executor).
    const bool split_kv = !plan && c.len_q <= 64 && c.len_kv >= 512 && c.head_dim <= 128;
    // Plans with a key permutation over >= 1024 aligned keys gather K and V first (attention.cu).
    const bool gathered = plan && c.perms && c.len_kv >= 1024 && c.seq_pad % 8 == 0;
    const cuda::detail::Route want = gathered   ? cuda::detail::Route::flash_block_sparse_gathered
                                     : plan     ? cuda::detail::Route::flash_block_sparse
                                     : split_kv ? cuda::detail::Route::split_kv
                                                : cuda::detail::Route::flash_dense;
    ASSERT_EQ(static_cast<int>(cuda::detail::last_dense_route()), static_cast<int>(want)) << "executor taken";
    if (want != cuda::detail::Route::split_kv) {  // rung 3 (TMA) needs K, V in order and 16-byte aligned
      const bool tma = c.flash_tma && (!c.perms || gathered) && c.seq_pad % 8 == 0;
      EXPECT_EQ(cuda::detail::last_flash_used_tma(), tma) << "flash kernel: TMA (rung 3) or cp.async (rung 2)";
      EXPECT_EQ(static_cast<int>(cuda::detail::last_flash_schedule()),
                static_cast<int>(tma ? schedule : cuda::detail::FlashSchedule::plain))
          << "rung 3's consumer schedule";
      // 176-key tiles: rung 3's dense calls at head_dim 128 without a mask; 128 (64 for small
      // plan blocks and head_dim 256) otherwise.
      if (c.dense_key_tile == 176) {
        const bool wide = tma && !plan && c.head_dim == 128 && c.mask.is_none();
        EXPECT_EQ(cuda::detail::last_flash_key_tile(), wide ? 176 : 128) << "the dense key tile";
      }
    }
    if (want == cuda::detail::Route::split_kv) {  // rung 2 (wgmma + TMA) needs 16-byte aligned K, V
      EXPECT_EQ(cuda::detail::last_split_kv_used_tma(), c.split_kv_tma && c.seq_pad % 8 == 0)
          << "split-KV kernel: wgmma + TMA (rung 2) or mma.sync (rung 1)";
    }
    const int splits = cuda::detail::last_split_kv_splits();
    if (c.expect_splits == 1) EXPECT_EQ(splits, 1) << "split-KV: one split (no workspace, no merge)";
    if (c.expect_splits > 1) EXPECT_GE(splits, c.expect_splits) << "split-KV: the fused merge of many splits";
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> out_h(out_buf.bytes / 2);
    std::vector<float> lse_h(lse_buf.bytes / 4);
    CUDA_OK(cudaMemcpy(out_h.data(), out_buf.ptr, out_buf.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse_h.data(), lse_buf.ptr, lse_buf.bytes, cudaMemcpyDeviceToHost));
    ASSERT_NO_FATAL_FAILURE(check_output(c, out_h, lse_h, *ref, ref_out, bound, guard));
    EXPECT_TRUE(cuda::detail::split_kv_counters_zero(0)) << "split-KV: a call left its merge counters non-zero";
    // Every call computes the same thing in the same order (whichever CTA merges a row), so
    // repeated calls agree to the bit; a counter left non-zero by a call would break the next.
    if (call == 0) {
      first_out = out_h;
      first_lse = lse_h;
    } else {
      EXPECT_TRUE(out_h == first_out) << "out differs from the first call";
      EXPECT_EQ(std::memcmp(lse_h.data(), first_lse.data(), lse_h.size() * 4), 0) << "lse differs from the first call";
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(c); };
  // Small (also run under compute-sanitizer).
  add({.name = "Small_dense_bf16_d64_17x33", .len_q = 17, .len_kv = 33});
  add({.name = "Small_dense_f16_d128_gqa4x2_113x77", .dtype = DType::f16, .heads_q = 4, .heads_kv = 2,
       .len_q = 113, .len_kv = 77, .head_dim = 128, .seed = 2});
  add({.name = "Small_dense_bf16_d128_1x1", .len_q = 1, .len_kv = 1, .head_dim = 128, .seed = 3});
  add({.name = "Small_sparse_bf16_d128_perm_empty", .batch = 2, .heads_q = 2, .heads_kv = 1, .len_q = 200,
       .len_kv = 190, .head_dim = 128, .sparse = true, .keep = 0.4, .perms = true, .empty_rows = true, .seed = 4});
  add({.name = "Small_sparse_f16_d64_odd_blocks_unaligned", .dtype = DType::f16, .heads_q = 3, .heads_kv = 1,
       .len_q = 131, .len_kv = 150, .sparse = true, .block_q = 17, .block_kv = 23, .keep = 0.5, .perms = true,
       .seq_pad = 3, .seed = 5});
  add({.name = "Small_dense_bf16_d64_strided", .heads_q = 2, .heads_kv = 1, .len_q = 70, .len_kv = 129,
       .seq_pad = 8, .amplitude = 4.0f, .seed = 6});
  // Split-KV prefix executor: dense calls with len_q <= 64 and len_kv >= 512 take it (each case
  // checks the executor it reached). Partial last key tiles (len_kv not a multiple of 64), GQA
  // stacking across m-tiles (group * len_q > 64) and partial m-tiles, one split (written
  // directly, no workspace), unaligned strides. The merge is fused into the kernel (counters in
  // the workspace, reset by each call): "many" cases have 16 to 78 splits (40000 keys), "repeat"
  // cases call 2-3 times on the same buffers, with a split-KV call of another shape in between
  // when interleaved, and require every call correct and all of them bitwise equal.
  add({.name = "Small_splitkv_bf16_d128_gqa4_16x1100", .heads_q = 8, .heads_kv = 2, .len_q = 16, .len_kv = 1100,
       .head_dim = 128, .expect_splits = 2, .seed = 21});
  add({.name = "Small_splitkv_f16_d64_one_split_17x520", .dtype = DType::f16, .heads_q = 4, .heads_kv = 2,
       .len_q = 17, .len_kv = 520, .expect_splits = 1, .seed = 22});
  add({.name = "Small_splitkv_repeat_bf16_d128_gqa4_16x1100", .heads_q = 8, .heads_kv = 2, .len_q = 16,
       .len_kv = 1100, .head_dim = 128, .repeats = 3, .interleave = true, .expect_splits = 2, .seed = 28});
  add({.name = "Small_splitkv_fused_merge_bf16_d64_gqa2_3x4000", .heads_q = 2, .heads_kv = 1, .len_q = 3,
       .len_kv = 4000, .repeats = 2, .interleave = true, .expect_splits = 4, .seed = 31});
  add({.name = "SplitKv_bf16_d128_block_diffusion_16x4099", .heads_q = 32, .heads_kv = 8, .len_q = 16,
       .len_kv = 4099, .head_dim = 128, .expect_splits = 8, .seed = 23});
  add({.name = "SplitKv_repeat_bf16_d128_block_diffusion_16x4099", .heads_q = 32, .heads_kv = 8, .len_q = 16,
       .len_kv = 4099, .head_dim = 128, .repeats = 3, .seed = 29});
  add({.name = "SplitKv_f16_d64_mha_1x2000", .dtype = DType::f16, .batch = 2, .heads_q = 3, .heads_kv = 3,
       .len_q = 1, .len_kv = 2000, .expect_splits = 2, .seed = 24});
  add({.name = "SplitKv_bf16_d128_gqa8_64x1500", .heads_q = 8, .heads_kv = 1, .len_q = 64, .len_kv = 1500,
       .head_dim = 128, .expect_splits = 2, .seed = 25});
  add({.name = "SplitKv_f16_d128_unaligned_peaky_one_split_5x777", .dtype = DType::f16, .batch = 2,
       .heads_q = 6, .heads_kv = 2, .len_q = 5, .len_kv = 777, .head_dim = 128, .seq_pad = 3, .amplitude = 4.0f,
       .expect_splits = 1, .seed = 26});
  add({.name = "SplitKv_bf16_d64_gqa2_33x9000", .heads_q = 4, .heads_kv = 2, .len_q = 33, .len_kv = 9000,
       .seq_pad = 8, .expect_splits = 8, .seed = 27});
  add({.name = "SplitKv_f16_d64_unaligned_33x9000", .dtype = DType::f16, .heads_q = 4, .heads_kv = 2,
       .len_q = 33, .len_kv = 9000, .seq_pad = 3, .expect_splits = 8, .seed = 30});
  // One split because the merge groups (600 kv heads) already fill a wave: no workspace.
  add({.name = "SplitKv_bf16_d64_one_split_wave_bound_1x2000", .heads_q = 600, .heads_kv = 600, .len_q = 1,
       .len_kv = 2000, .expect_splits = 1, .seed = 32});
  // Many splits (40000 keys = 625 key tiles): 1, 3, 16 and 64 queries, GQA groups 4 and 8, d 64
  // and 128, unaligned, peaky (partial LSEs far apart), repeated and interleaved.
  add({.name = "SplitKv_many_bf16_d128_gqa4_16x40000", .heads_q = 4, .heads_kv = 1, .len_q = 16,
       .len_kv = 40000, .head_dim = 128, .repeats = 3, .expect_splits = 16, .seed = 33});
  add({.name = "SplitKv_many_f16_d64_gqa8_unaligned_peaky_3x40000", .dtype = DType::f16, .heads_q = 8,
       .heads_kv = 1, .len_q = 3, .len_kv = 40000, .seq_pad = 3, .amplitude = 4.0f, .repeats = 3,
       .interleave = true, .expect_splits = 16, .seed = 34});
  add({.name = "SplitKv_many_bf16_d128_gqa4_64x40000", .heads_q = 4, .heads_kv = 1, .len_q = 64, .len_kv = 40000,
       .head_dim = 128, .repeats = 2, .expect_splits = 16, .seed = 35});
  add({.name = "SplitKv_many_f16_d64_mha_1x40000", .dtype = DType::f16, .heads_q = 2, .heads_kv = 2, .len_q = 1,
       .len_kv = 40000, .repeats = 3, .interleave = true, .expect_splits = 16, .seed = 36});
  add({.name = "SplitKv_many_bf16_d64_gqa8_16x40000", .heads_q = 16, .heads_kv = 2, .len_q = 16,
       .len_kv = 40000, .repeats = 2, .expect_splits = 16, .seed = 37});
  // The merge's fallback: no waiting, so the CTAs that are not the last to arrive mostly leave
  // their rows to the last CTA out (which CTAs do varies from call to call; the result may not).
  add({.name = "Small_splitkv_no_wait_bf16_d128_gqa4_16x1100", .heads_q = 8, .heads_kv = 2, .len_q = 16,
       .len_kv = 1100, .head_dim = 128, .repeats = 3, .expect_splits = 2, .merge_wait_ns = 0, .seed = 38});
  add({.name = "SplitKv_no_wait_f16_d64_gqa8_unaligned_5x40000", .dtype = DType::f16, .heads_q = 16,
       .heads_kv = 2, .len_q = 5, .len_kv = 40000, .seq_pad = 3, .repeats = 3, .interleave = true,
       .expect_splits = 16, .merge_wait_ns = 0, .seed = 39});
  add({.name = "SplitKv_no_wait_bf16_d128_block_diffusion_16x8192", .heads_q = 32, .heads_kv = 8, .len_q = 16,
       .len_kv = 8192, .head_dim = 128, .repeats = 2, .expect_splits = 16, .merge_wait_ns = 0, .seed = 40});
  // Rung 1 (mma.sync, cp.async) on inputs rung 2 would take: it stays the path for unaligned
  // inputs, so it is tested on the block-diffusion shape, many splits and the merge fallback too.
  add({.name = "Small_splitkv_rung1_bf16_d128_gqa4_16x1100", .heads_q = 8, .heads_kv = 2, .len_q = 16,
       .len_kv = 1100, .head_dim = 128, .expect_splits = 2, .split_kv_tma = false, .seed = 41});
  add({.name = "SplitKv_rung1_bf16_d128_block_diffusion_16x4099", .heads_q = 32, .heads_kv = 8, .len_q = 16,
       .len_kv = 4099, .head_dim = 128, .repeats = 2, .expect_splits = 8, .split_kv_tma = false, .seed = 42});
  add({.name = "SplitKv_rung1_many_f16_d64_gqa8_16x40000", .dtype = DType::f16, .heads_q = 16, .heads_kv = 2,
       .len_q = 16, .len_kv = 40000, .repeats = 2, .interleave = true, .expect_splits = 16, .merge_wait_ns = 0,
       .split_kv_tma = false, .seed = 43});
  // The flash executor's rung 2 (cp.async, no producer warp) on inputs rung 3 would take: what the
  // benchmark's "rung 2" rows time, dense and over a plan, d 64 and 128, partial tiles.
  add({.name = "Small_dense_rung2_bf16_d128_gqa2_130x300", .heads_q = 4, .heads_kv = 2, .len_q = 130,
       .len_kv = 300, .head_dim = 128, .flash_tma = false, .seed = 48});
  add({.name = "Small_sparse_rung2_f16_d64_b64", .dtype = DType::f16, .heads_q = 2, .heads_kv = 1, .len_q = 200,
       .len_kv = 333, .sparse = true, .block_q = 64, .block_kv = 64, .keep = 0.5, .flash_tma = false, .seed = 49});
  // Rung 3's other consumer schedules (ping-pong; ping-pong with the softmax overlapping P V;
  // ping-pong's order without the turns):
  // dense and over plans (skipped tiles, query blocks with no tile, gathered permutations), d 64 /
  // 128 / 256, one and many key tiles.
  for (const auto& [label, schedule] : {std::pair{"pingpong", cuda::detail::FlashSchedule::pingpong},
                                        std::pair{"overlap", cuda::detail::FlashSchedule::overlap},
                                        std::pair{"late", cuda::detail::FlashSchedule::late}}) {
    const std::string l = label;
    add({.name = "Small_dense_" + l + "_bf16_d128_gqa2_130x300", .heads_q = 4, .heads_kv = 2, .len_q = 130,
         .len_kv = 300, .head_dim = 128, .flash_schedule = schedule, .seed = 50});
    add({.name = "Small_dense_" + l + "_f16_d64_17x33", .dtype = DType::f16, .len_q = 17, .len_kv = 33,
         .flash_schedule = schedule, .seed = 51});
    add({.name = "Small_sparse_" + l + "_bf16_d128_b64_empty", .heads_q = 2, .heads_kv = 1, .len_q = 300,
         .len_kv = 333, .head_dim = 128, .sparse = true, .block_q = 64, .block_kv = 64, .keep = 0.4,
         .empty_rows = true, .flash_schedule = schedule, .seed = 52});
    add({.name = "Medium_dense_" + l + "_bf16_d128_gqa4_1023x1500", .heads_q = 4, .heads_kv = 1, .len_q = 1023,
         .len_kv = 1500, .head_dim = 128, .repeats = 2, .flash_schedule = schedule, .seed = 53});
    add({.name = "Medium_sparse_" + l + "_f16_d128_perm_gathered_b128_600x2100", .dtype = DType::f16,
         .heads_q = 2, .heads_kv = 1, .len_q = 600, .len_kv = 2100, .head_dim = 128, .sparse = true,
         .block_q = 128, .block_kv = 128, .keep = 0.3, .perms = true, .flash_schedule = schedule, .seed = 54});
    add({.name = "Medium_dense_" + l + "_bf16_d256_513x1000", .heads_q = 2, .heads_kv = 2, .len_q = 513,
         .len_kv = 1000, .head_dim = 256, .flash_schedule = schedule, .seed = 55});
    add({.name = "Medium_dense_" + l + "_peaky_f16_d64_gqa2_700x2000", .dtype = DType::f16, .heads_q = 4,
         .heads_kv = 2, .len_q = 700, .len_kv = 2000, .amplitude = 4.0f, .flash_schedule = schedule, .seed = 56});
  }
  // Rung 3's 176-key tiles (dense, head_dim 128, no mask) with each schedule: one tile, a partial
  // last tile, many tiles, GQA; and a strided input that rung 3 cannot read (rung 2, 128-key tiles).
  for (const auto& [label, schedule] : {std::pair{"plain", cuda::detail::FlashSchedule::plain},
                                        std::pair{"pingpong", cuda::detail::FlashSchedule::pingpong},
                                        std::pair{"overlap", cuda::detail::FlashSchedule::overlap},
                                        std::pair{"late", cuda::detail::FlashSchedule::late}}) {
    const std::string l = label;
    add({.name = "Small_dense_tile176_" + l + "_bf16_d128_17x176", .len_q = 17, .len_kv = 176, .head_dim = 128,
         .flash_schedule = schedule, .dense_key_tile = 176, .seed = 60});
    add({.name = "Small_dense_tile176_" + l + "_f16_d128_gqa2_130x300", .dtype = DType::f16, .heads_q = 4,
         .heads_kv = 2, .len_q = 130, .len_kv = 300, .head_dim = 128, .flash_schedule = schedule,
         .dense_key_tile = 176, .seed = 61});
    add({.name = "Small_dense_tile176_" + l + "_bf16_d128_5x1", .len_q = 5, .len_kv = 1, .head_dim = 128,
         .flash_schedule = schedule, .dense_key_tile = 176, .seed = 62});
    add({.name = "Medium_dense_tile176_" + l + "_peaky_bf16_d128_gqa4_1023x1500", .heads_q = 4, .heads_kv = 1,
         .len_q = 1023, .len_kv = 1500, .head_dim = 128, .amplitude = 4.0f, .repeats = 2, .flash_schedule = schedule,
         .dense_key_tile = 176, .seed = 63});
  }
  add({.name = "Small_dense_tile176_strided_rung2_bf16_d128_130x300", .heads_q = 2, .len_q = 130, .len_kv = 300,
       .head_dim = 128, .seq_pad = 3, .dense_key_tile = 176, .seed = 64});
  // Rung 2 on one split (direct write) and a 64-row m-tile that is only partly real (group 3 x 7).
  add({.name = "Small_splitkv_f16_d128_one_split_gqa3_7x600", .dtype = DType::f16, .heads_q = 6, .heads_kv = 2,
       .len_q = 7, .len_kv = 600, .head_dim = 128, .expect_splits = 1, .seed = 44});
  // Medium.
  add({.name = "Medium_dense_bf16_d128_gqa4x1_1023x1500", .heads_q = 4, .heads_kv = 1, .len_q = 1023,
       .len_kv = 1500, .head_dim = 128, .seed = 7});
  add({.name = "Medium_dense_f16_d64_peaky_1000x1000", .dtype = DType::f16, .heads_q = 2, .heads_kv = 2,
       .len_q = 1000, .len_kv = 1000, .amplitude = 4.0f, .seed = 8});
  add({.name = "Medium_sparse_f16_d64_b64_perm_gathered", .dtype = DType::f16, .heads_q = 4, .heads_kv = 1,
       .len_q = 700, .len_kv = 2000, .head_dim = 64, .sparse = true, .block_q = 64, .block_kv = 64, .keep = 0.4,
       .perms = true, .seed = 21});
  add({.name = "Medium_sparse_bf16_d128_b128_perm_strided_gathered", .batch = 2, .heads_q = 2, .heads_kv = 2,
       .len_q = 300, .len_kv = 1500, .head_dim = 128, .sparse = true, .block_q = 128, .block_kv = 128,
       .keep = 0.5, .perms = true, .seq_pad = 8, .seed = 22});
  add({.name = "Medium_sparse_bf16_d128_b128_perm", .heads_q = 4, .heads_kv = 2, .len_q = 1000, .len_kv = 1100,
       .head_dim = 128, .sparse = true, .block_q = 128, .block_kv = 128, .keep = 0.3, .perms = true,
       .empty_rows = true, .seed = 9});
  add({.name = "Medium_sparse_f16_d128_bq200_bkv96", .dtype = DType::f16, .heads_q = 2, .heads_kv = 2,
       .len_q = 777, .len_kv = 1023, .head_dim = 128, .sparse = true, .block_q = 200, .block_kv = 96,
       .keep = 0.5, .seq_pad = 8, .seed = 10});
  add({.name = "Medium_sparse_bf16_d64_b128_dense_plan", .heads_q = 2, .heads_kv = 1, .len_q = 1024,
       .len_kv = 1024, .sparse = true, .block_q = 128, .block_kv = 128, .keep = 1.0, .seed = 11});
  return v;
}

INSTANTIATE_TEST_SUITE_P(CudaAttention, Ops, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Every mask x dtype x head_dim, dense and over a plan (permuted too), awkward lengths, len_q !=
// len_kv both ways (causal with len_q > len_kv leaves empty rows), split-KV shapes; head_dim 256
// dense. Skipped until kCudaMaskKernel / kCudaHeadDim256.
std::vector<Case> mask_cases() {
  std::vector<Case> v;
  const std::pair<const char*, Mask> masks[] = {{"causal", Mask::causal()},
                                                {"block_causal16", Mask::block_causal(16)},
                                                {"block_causal7", Mask::block_causal(7)},
                                                {"window128", Mask::sliding_window(128)},
                                                {"window100_0", Mask::sliding_window(100, 0)}};
  uint32_t seed = 100;
  for (const auto& [label, mask] : masks) {
    for (DType dt : {DType::bf16, DType::f16}) {
      const std::string d = dt == DType::bf16 ? "bf16" : "f16";
      for (int64_t hd : {64, 128}) {
        const std::string base = std::string(label) + "_" + d + "_d" + std::to_string(hd);
        v.push_back({.name = base + "_dense_300x300", .dtype = dt, .heads_q = 4, .heads_kv = 2, .len_q = 300,
                     .len_kv = 300, .head_dim = hd, .mask = mask, .seed = seed++});
        v.push_back({.name = base + "_dense_130x700", .dtype = dt, .heads_q = 2, .heads_kv = 1, .len_q = 130,
                     .len_kv = 700, .head_dim = hd, .mask = mask, .seed = seed++});
        v.push_back({.name = base + "_dense_700x130", .dtype = dt, .heads_q = 2, .heads_kv = 2, .len_q = 700,
                     .len_kv = 130, .head_dim = hd, .mask = mask, .seed = seed++});
        v.push_back({.name = base + "_splitkv_16x4099", .dtype = dt, .heads_q = 8, .heads_kv = 2, .len_q = 16,
                     .len_kv = 4099, .head_dim = hd, .mask = mask, .seed = seed++});
        v.push_back({.name = base + "_sparse_b64_500x500", .dtype = dt, .heads_q = 2, .heads_kv = 1, .len_q = 500,
                     .len_kv = 500, .head_dim = hd, .sparse = true, .keep = 0.6, .empty_rows = true,
                     .mask = mask, .seed = seed++});
        v.push_back({.name = base + "_sparse_perm_b64_300x1100", .dtype = dt, .heads_q = 2, .heads_kv = 2,
                     .len_q = 300, .len_kv = 1100, .head_dim = hd, .sparse = true, .keep = 0.5, .perms = true,
                     .mask = mask, .seed = seed++});
      }
    }
    // Rung 2 (cp.async, no producer warp) on inputs rung 3 would take; unaligned rows (rung 2's
    // element copies, and the in-kernel key gather of a permuted plan); a longer causal-shaped
    // case where most key tiles of a query tile are skipped.
    v.push_back({.name = std::string(label) + "_rung2_bf16_d128_dense_gqa2_400x520", .heads_q = 4, .heads_kv = 2,
                 .len_q = 400, .len_kv = 520, .head_dim = 128, .flash_tma = false, .mask = mask, .seed = seed++});
    v.push_back({.name = std::string(label) + "_rung2_f16_d64_sparse_b64_333x333", .dtype = DType::f16,
                 .heads_q = 2, .heads_kv = 1, .len_q = 333, .len_kv = 333, .sparse = true, .keep = 0.7,
                 .flash_tma = false, .mask = mask, .seed = seed++});
    v.push_back({.name = std::string(label) + "_unaligned_f16_d64_dense_250x260", .dtype = DType::f16,
                 .heads_q = 2, .heads_kv = 2, .len_q = 250, .len_kv = 260, .seq_pad = 3, .mask = mask,
                 .seed = seed++});
    v.push_back({.name = std::string(label) + "_unaligned_bf16_d64_sparse_perm_b32_200x1100", .heads_q = 2,
                 .heads_kv = 1, .len_q = 200, .len_kv = 1100, .sparse = true, .block_q = 32, .block_kv = 32,
                 .keep = 0.5, .perms = true, .seq_pad = 3, .mask = mask, .seed = seed++});
    v.push_back({.name = std::string(label) + "_splitkv_unaligned_f16_d128_gqa4_40x3000", .dtype = DType::f16,
                 .heads_q = 8, .heads_kv = 2, .len_q = 40, .len_kv = 3000, .head_dim = 128, .seq_pad = 3,
                 .mask = mask, .seed = seed++});
    v.push_back({.name = std::string(label) + "_splitkv_rung1_bf16_d64_gqa8_64x5000", .heads_q = 8, .heads_kv = 1,
                 .len_q = 64, .len_kv = 5000, .split_kv_tma = false, .mask = mask, .seed = seed++});
    v.push_back({.name = std::string(label) + "_long_bf16_d128_dense_1500x1500", .heads_q = 2, .heads_kv = 1,
                 .len_q = 1500, .len_kv = 1500, .head_dim = 128, .mask = mask, .seed = seed++});
    v.push_back({.name = std::string(label) + "_bf16_d256_dense_300x300", .heads_q = 2, .heads_kv = 1,
                 .len_q = 300, .len_kv = 300, .head_dim = 256, .mask = mask, .seed = seed++});
    // Rung 3's other schedules under the mask: fully masked tiles skipped (fewer turns per CTA,
    // query tiles with none), masked over a plan.
    for (const auto& [sl, schedule] : {std::pair{"pingpong", cuda::detail::FlashSchedule::pingpong},
                                       std::pair{"overlap", cuda::detail::FlashSchedule::overlap},
                                       std::pair{"late", cuda::detail::FlashSchedule::late}}) {
      v.push_back({.name = std::string(label) + "_" + sl + "_bf16_d128_dense_gqa2_700x700", .heads_q = 4,
                   .heads_kv = 2, .len_q = 700, .len_kv = 700, .head_dim = 128, .flash_schedule = schedule,
                   .mask = mask, .seed = seed++});
      v.push_back({.name = std::string(label) + "_" + sl + "_f16_d64_sparse_b64_500x500", .dtype = DType::f16,
                   .heads_q = 2, .heads_kv = 1, .len_q = 500, .len_kv = 500, .sparse = true, .keep = 0.6,
                   .empty_rows = true, .flash_schedule = schedule, .mask = mask, .seed = seed++});
    }
  }
  // The masked kernels over batches and odd head counts (a CTA's head and sequence from the grid,
  // the reversed tile order per head), rung 3 and rung 2, dense and over a plan.
  for (const auto& [label_c, mask] : {std::pair<const char*, Mask>{"causal", Mask::causal()},
                                      std::pair<const char*, Mask>{"block_causal16", Mask::block_causal(16)},
                                      std::pair<const char*, Mask>{"window200", Mask::sliding_window(200)}}) {
    const std::string label = label_c;
    v.push_back({.name = label + "_batches_batch3_heads5_bf16_d128_dense_900x900", .batch = 3, .heads_q = 5,
                 .heads_kv = 5, .len_q = 900, .len_kv = 900, .head_dim = 128, .mask = mask, .seed = seed++});
    v.push_back({.name = label + "_batches_f16_d64_gqa3_batch2_dense_1100x1100", .dtype = DType::f16, .batch = 2,
                 .heads_q = 3, .heads_kv = 1, .len_q = 1100, .len_kv = 1100, .mask = mask, .seed = seed++});
    v.push_back({.name = label + "_batches_rung2_bf16_d128_heads3_dense_700x700", .heads_q = 3, .heads_kv = 3,
                 .len_q = 700, .len_kv = 700, .head_dim = 128, .flash_tma = false, .mask = mask, .seed = seed++});
    v.push_back({.name = label + "_batches_bf16_d64_sparse_b64_batch2_heads3_800x800", .batch = 2, .heads_q = 3,
                 .heads_kv = 1, .len_q = 800, .len_kv = 800, .sparse = true, .keep = 0.6, .mask = mask,
                 .seed = seed++});
  }
  v.push_back({.name = "none_bf16_d256_dense_513x1000", .heads_q = 2, .heads_kv = 2, .len_q = 513, .len_kv = 1000,
               .head_dim = 256, .seed = seed++});
  v.push_back({.name = "none_f16_d256_dense_17x33", .dtype = DType::f16, .len_q = 17, .len_kv = 33,
               .head_dim = 256, .seed = seed++});
  v.push_back({.name = "causal_bf16_d256_few_queries_16x2000", .heads_q = 4, .heads_kv = 2, .len_q = 16,
               .len_kv = 2000, .head_dim = 256, .mask = Mask::causal(), .seed = seed++});
  v.push_back({.name = "none_bf16_d256_sparse_perm_b64_300x1100", .heads_q = 2, .heads_kv = 1, .len_q = 300,
               .len_kv = 1100, .head_dim = 256, .sparse = true, .keep = 0.5, .perms = true, .seed = seed++});
  return v;
}

INSTANTIATE_TEST_SUITE_P(CudaAttentionMasks, Ops, ::testing::ValuesIn(mask_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Until the kernels exist: a mask or a variable-length batch is refused by name (unsupported),
// before any launch (no route taken) and without writing the outputs; never run unmasked.
TEST(CudaAttentionMasks, RefusedByNameNeverIgnored) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Device gpu{DeviceType::cuda, 0};
  const int64_t H = 2, L = 96, D = 64;
  DeviceBuffer q(H * L * D * 2), o(H * L * D * 2), l(H * L * 4), counts(64), indices(64), cu(64);
  CUDA_OK(cudaMemset(q.ptr, 0, q.bytes));
  const Tensor qd = Tensor::contiguous(q.ptr, DType::bf16, {1, H, L, D}, gpu);
  const Tensor od = Tensor::contiguous(o.ptr, DType::bf16, {1, H, L, D}, gpu);
  const Tensor ld = Tensor::contiguous(l.ptr, DType::f32, {1, H, L}, gpu);
  const BlockIndexBuffer plan = BlockIndexBuffer::full(1, H, L, L, 64, 64);
  BlockIndex ixd = plan.view();
  ixd.counts = upload_i32(plan.counts, counts);
  ixd.indices = upload_i32(plan.indices, indices);
  auto untouched = [&]() {
    std::vector<uint16_t> out_h(o.bytes / 2);
    cudaMemcpy(out_h.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost);
    return std::all_of(out_h.begin(), out_h.end(), [](uint16_t x) { return x == 0xffff; });
  };
  for (Mask mask : {Mask::causal(), Mask::block_causal(16), Mask::sliding_window(128), Mask::sliding_window(64, 0)}) {
    if (kCudaMaskKernel) break;
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    opt.mask = mask;
    const std::string want = "mask " + mask_string(mask) + ": no cuda kernel yet";
    CUDA_OK(cudaMemset(o.ptr, 0xff, o.bytes));
    Status st = dense(qd, qd, qd, od, ld, opt);
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
    EXPECT_EQ(st.message().rfind(want, 0), 0u) << st.to_string();
    EXPECT_EQ(static_cast<int>(cuda::detail::last_dense_route()), static_cast<int>(cuda::detail::Route::none));
    st = block_sparse(qd, qd, qd, ixd, od, ld, opt);
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
    EXPECT_EQ(st.message().rfind(want, 0), 0u) << st.to_string();
    EXPECT_EQ(static_cast<int>(cuda::detail::last_dense_route()), static_cast<int>(cuda::detail::Route::none));
    EXPECT_TRUE(untouched()) << "a refused call wrote its output";
  }
  if (!kCudaVarlenKernel) {
    const int32_t offsets[3] = {0, 40, static_cast<int32_t>(L)};
    CUDA_OK(cudaMemcpy(cu.ptr, offsets, sizeof offsets, cudaMemcpyHostToDevice));
    const Tensor cud = Tensor::contiguous(cu.ptr, DType::i32, {3}, gpu);
    const Tensor q3 = Tensor::contiguous(q.ptr, DType::bf16, {L, H, D}, gpu);
    const Tensor o3 = Tensor::contiguous(o.ptr, DType::bf16, {L, H, D}, gpu);
    const Tensor l2 = Tensor::contiguous(l.ptr, DType::f32, {H, L}, gpu);
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    CUDA_OK(cudaMemset(o.ptr, 0xff, o.bytes));
    const std::string want = "cu_seqlens_q: variable-length batches have no cuda kernel yet";
    Status st = dense_varlen(q3, q3, q3, cud, cud, o3, l2, opt);
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
    EXPECT_EQ(st.message().rfind(want, 0), 0u) << st.to_string();
    BlockIndexBuffer vplan = BlockIndexBuffer::full(2, H, 56, 56, 64, 64);
    BlockIndex vixd = vplan.view();
    vixd.counts = upload_i32(vplan.counts, counts);
    vixd.indices = upload_i32(vplan.indices, indices);
    st = block_sparse_varlen(q3, q3, q3, cud, cud, vixd, o3, l2, opt);
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
    EXPECT_EQ(st.message().rfind(want, 0), 0u) << st.to_string();
    EXPECT_TRUE(untouched()) << "a refused varlen call wrote its output";
  }
  // A head_dim without a kernel (256 until kCudaHeadDim256; 96 always) is refused by name.
  for (int64_t hd : {int64_t{256}, int64_t{96}}) {
    if (hd == 256 && kCudaHeadDim256) continue;
    DeviceBuffer qx(H * L * hd * 2), ox(H * L * hd * 2);
    const Tensor qdx = Tensor::contiguous(qx.ptr, DType::bf16, {1, H, L, hd}, gpu);
    const Tensor odx = Tensor::contiguous(ox.ptr, DType::bf16, {1, H, L, hd}, gpu);
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    const Status st = dense(qdx, qdx, qdx, odx, ld, opt);
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
    EXPECT_NE(st.message().find("head_dim " + std::to_string(hd)), std::string::npos) << st.to_string();
  }
}

// Variable-length batches against cpu_ref (skipped until kCudaVarlenKernel): 7 sequences with
// empty ones (no queries, no keys, neither), a single token, len_q != len_kv, every mask, each of
// rung 3's schedules; the bound is twice the naive half-precision error summed over the sequences.
TEST(CudaAttentionVarlen, MatchesReference) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  if (!kCudaVarlenKernel) GTEST_SKIP() << "no cuda varlen kernel yet (kCudaVarlenKernel)";
  const std::vector<int32_t> lens_q = {300, 0, 1000, 1, 64, 5, 0}, lens_kv = {300, 20, 700, 1, 2000, 0, 0};
  const int64_t H = 4, Hkv = 2, D = 128;
  std::vector<int32_t> cu_q(1, 0), cu_kv(1, 0);
  for (size_t s = 0; s < lens_q.size(); ++s) {
    cu_q.push_back(cu_q.back() + lens_q[s]);
    cu_kv.push_back(cu_kv.back() + lens_kv[s]);
  }
  const int64_t total_q = cu_q.back(), total_kv = cu_kv.back();
  for (Mask mask : {Mask::none(), Mask::causal(), Mask::block_causal(16), Mask::sliding_window(128)}) {
    if (!mask.is_none() && !kCudaMaskKernel) continue;
    SCOPED_TRACE(mask_string(mask));
    std::mt19937 rng(77);
    std::normal_distribution<float> nd;
    auto random = [&](int64_t n) {
      std::vector<float> x(n);
      for (float& e : x) e = round_to(DType::bf16, nd(rng));
      return x;
    };
    // [total, heads, D] rows in f32 (the exact values of the bf16 inputs).
    const std::vector<float> q = random(total_q * H * D), k = random(total_kv * Hkv * D), v = random(total_kv * Hkv * D);
    HostArray qh(DType::f32, {total_q, H, D}), kh(DType::f32, {total_kv, Hkv, D}), vh(DType::f32, {total_kv, Hkv, D});
    std::copy(q.begin(), q.end(), qh.ptr<float>());
    std::copy(k.begin(), k.end(), kh.ptr<float>());
    std::copy(v.begin(), v.end(), vh.ptr<float>());
    HostArray cqh(DType::i32, {static_cast<int64_t>(cu_q.size())}), ckh(DType::i32, {static_cast<int64_t>(cu_kv.size())});
    std::copy(cu_q.begin(), cu_q.end(), cqh.ptr<int32_t>());
    std::copy(cu_kv.begin(), cu_kv.end(), ckh.ptr<int32_t>());
    AttentionOptions ref_opt;
    ref_opt.backend = Backend::cpu_ref;
    ref_opt.mask = mask;
    auto ref = dense_varlen(qh.view(), kh.view(), vh.view(), cqh.view(), ckh.view(), ref_opt);
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    // The naive error per sequence (as [1, heads, len, D] cases), summed as squares.
    double err2 = 0, norm2 = 0;
    for (size_t s = 0; s < lens_q.size(); ++s) {
      if (lens_q[s] == 0 || lens_kv[s] == 0) continue;
      Case c{.name = "seq", .heads_q = H, .heads_kv = Hkv, .len_q = lens_q[s], .len_kv = lens_kv[s], .head_dim = D,
             .mask = mask};
      auto gather = [&](const std::vector<float>& x, int64_t heads, int64_t begin, int64_t len) {
        std::vector<float> y(heads * len * D);
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < len; ++i)
            std::copy_n(&x[((begin + i) * heads + h) * D], D, &y[(h * len + i) * D]);
        return y;
      };
      const std::vector<float> rs = gather(std::vector<float>(ref->out.ptr<float>(), ref->out.ptr<float>() + ref->out.numel()),
                                           H, cu_q[s], lens_q[s]);
      const double e = naive_error(c, gather(q, H, cu_q[s], lens_q[s]), gather(k, Hkv, cu_kv[s], lens_kv[s]),
                                   gather(v, Hkv, cu_kv[s], lens_kv[s]), nullptr, rs);
      double n2 = 0;
      for (float x : rs) n2 += double{x} * x;
      err2 += e * e * n2;
      norm2 += n2;
    }
    const double bound = 2.0 * std::sqrt(err2 / norm2);
    auto upload_rows = [&](const std::vector<float>& x, DeviceBuffer& buf) {
      std::vector<uint16_t> h(x.size());
      for (size_t i = 0; i < x.size(); ++i) h[i] = float_to_bf16(x[i]);
      buf.reset(h.size() * 2);
      cudaMemcpy(buf.ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
    };
    const Device gpu{DeviceType::cuda, 0};
    DeviceBuffer qb(0), kb(0), vb(0), cqb(0), ckb(0), ob(total_q * H * D * 2), lb(total_q * H * 4);
    upload_rows(q, qb);
    upload_rows(k, kb);
    upload_rows(v, vb);
    const Tensor cqd = upload_i32(cqh, cqb), ckd = upload_i32(ckh, ckb);
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    opt.mask = mask;
    ScheduleGuard schedule_guard;
    for (const auto& [label, schedule] : kFlashSchedules) {  // rung 3 takes the process's schedule
    SCOPED_TRACE(label);
    cuda::detail::set_flash_schedule(schedule);
    CUDA_OK(cudaMemset(ob.ptr, 0xff, ob.bytes));
    CUDA_OK(cudaMemset(lb.ptr, 0xff, lb.bytes));
    const Status st = dense_varlen(Tensor::contiguous(qb.ptr, DType::bf16, {total_q, H, D}, gpu),
                                   Tensor::contiguous(kb.ptr, DType::bf16, {total_kv, Hkv, D}, gpu),
                                   Tensor::contiguous(vb.ptr, DType::bf16, {total_kv, Hkv, D}, gpu), cqd, ckd,
                                   Tensor::contiguous(ob.ptr, DType::bf16, {total_q, H, D}, gpu),
                                   Tensor::contiguous(lb.ptr, DType::f32, {H, total_q}, gpu), opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(cuda::detail::last_flash_used_tma()) << "a dense varlen call reads K and V through TMA";
    EXPECT_EQ(static_cast<int>(cuda::detail::last_flash_schedule()), static_cast<int>(schedule));
    std::vector<uint16_t> out_h(total_q * H * D);
    std::vector<float> lse_h(total_q * H);
    CUDA_OK(cudaMemcpy(out_h.data(), ob.ptr, ob.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse_h.data(), lb.ptr, lb.bytes, cudaMemcpyDeviceToHost));
    double err = 0, norm = 0;
    for (int64_t i = 0; i < total_q * H; ++i) {
      const float lr = ref->lse.ptr<float>()[i];
      if (std::isinf(lr)) {
        EXPECT_EQ(lse_h[i], lr) << "lse[" << i << "]: an empty row";
      } else {
        EXPECT_LE(std::abs(lse_h[i] - lr), 2e-4 * (1.0 + std::abs(lr))) << "lse[" << i << "]";
      }
    }
    for (int64_t i = 0; i < total_q * H * D; ++i) {
      const double o = bf16_to_float(out_h[i]), r = ref->out.ptr<float>()[i];
      ASSERT_TRUE(std::isfinite(o)) << "out[" << i << "]";
      err += (o - r) * (o - r);
      norm += r * r;
    }
    EXPECT_LE(std::sqrt(err / norm), bound + 1e-7);
    }
  }
}

// Offsets in device memory are read back and checked as on the host, each error naming the
// argument, before anything is launched (the output stays as it was).
TEST(CudaAttentionVarlen, BadDeviceOffsetsNamed) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Device gpu{DeviceType::cuda, 0};
  const int64_t H = 2, L = 96, D = 64;
  DeviceBuffer q(L * H * D * 2), o(L * H * D * 2), l(L * H * 4), cu(64), cu_ok(64);
  CUDA_OK(cudaMemset(q.ptr, 0, q.bytes));
  const Tensor q3 = Tensor::contiguous(q.ptr, DType::bf16, {L, H, D}, gpu);
  const Tensor o3 = Tensor::contiguous(o.ptr, DType::bf16, {L, H, D}, gpu);
  const Tensor l2 = Tensor::contiguous(l.ptr, DType::f32, {H, L}, gpu);
  const int32_t good[3] = {0, 40, static_cast<int32_t>(L)};
  CUDA_OK(cudaMemcpy(cu_ok.ptr, good, sizeof good, cudaMemcpyHostToDevice));
  const Tensor good_d = Tensor::contiguous(cu_ok.ptr, DType::i32, {3}, gpu);
  struct Bad {
    std::vector<int32_t> offsets;
    const char* want;
  };
  const Bad bads[] = {{{1, 40, 96}, "cu_seqlens_q: expected cu_seqlens_q[0] = 0, got 1"},
                      {{0, 50, 40, 96}, "cu_seqlens_q: offsets must not decrease"},
                      {{0, 40, 95}, "cu_seqlens_q: the last offset"}};
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.want);
    CUDA_OK(cudaMemcpy(cu.ptr, bad.offsets.data(), bad.offsets.size() * 4, cudaMemcpyHostToDevice));
    const Tensor bad_d =
        Tensor::contiguous(cu.ptr, DType::i32, {static_cast<int64_t>(bad.offsets.size())}, gpu);
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    CUDA_OK(cudaMemset(o.ptr, 0xff, o.bytes));
    const Status st = dense_varlen(q3, q3, q3, bad_d, bad.offsets.size() == 3 ? good_d : bad_d, o3, l2, opt);
    EXPECT_EQ(st.code(), StatusCode::invalid_argument) << st.to_string();
    EXPECT_EQ(st.message().rfind(bad.want, 0), 0u) << st.to_string();
    std::vector<uint16_t> out_h(o.bytes / 2);
    CUDA_OK(cudaMemcpy(out_h.data(), o.ptr, o.bytes, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(std::all_of(out_h.begin(), out_h.end(), [](uint16_t x) { return x == 0xffff; }));
  }
}

// A dense varlen call reads K and V through TMA (rung 3), whose box of a sequence's partial last
// key tile spans the next sequence's rows. Their scores are masked, and the kernel zeroes those V
// rows in shared memory: with the next sequence's K and V all NaN and infinity, every other
// sequence's rows stay bit for bit as they were, and a sequence's rows equal its own dense call
// (where the box's rows past the end arrive as zeros). The same on rung 2 (cp.async, which
// zero-fills them itself). Masks none and causal; rung 3 with each of its schedules (a partial tile's
// zeroing is a barrier of both consumer warpgroups, which the turns of the ping-pong schedules
// must not deadlock on).
TEST(CudaAttentionVarlen, NonFiniteNeighboursStayOut) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Device gpu{DeviceType::cuda, 0};
  const std::vector<int32_t> lens = {300, 129, 1000, 77};  // 300 = 2 x 128 + 44: its last box reads 84 poisoned rows
  const int64_t S = static_cast<int64_t>(lens.size()), H = 4, Hkv = 2, D = 128;
  std::vector<int32_t> cu(1, 0);
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  const int64_t total = cu.back();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> q(total * H * D), k(total * Hkv * D), v(total * Hkv * D);
  for (auto* x : {&q, &k, &v})
    for (uint16_t& e : *x) e = float_to_bf16(nd(rng));
  std::vector<uint16_t> k_bad = k, v_bad = v;  // sequence 1's rows: NaN and +-infinity
  for (int64_t i = cu[1] * Hkv * D; i < cu[2] * Hkv * D; ++i) {
    k_bad[i] = i % 3 == 0 ? 0x7fc0 : i % 3 == 1 ? 0x7f80 : 0xff80;
    v_bad[i] = i % 3 == 0 ? 0xff80 : i % 3 == 1 ? 0x7fc0 : 0x7f80;
  }
  HostArray cuh(DType::i32, {S + 1});
  std::copy(cu.begin(), cu.end(), cuh.ptr<int32_t>());
  DeviceBuffer qb(0), kb(0), vb(0), cub(0), ob(total * H * D * 2), lb(total * H * 4);
  upload_u16(q, qb);
  const Tensor cud = upload_i32(cuh, cub);
  struct Result {
    std::vector<uint16_t> out;
    std::vector<float> lse;
  };
  auto run_varlen = [&](const std::vector<uint16_t>& kx, const std::vector<uint16_t>& vx, const Mask& mask,
                        bool want_tma) {
    upload_u16(kx, kb);
    upload_u16(vx, vb);
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    opt.mask = mask;
    const Status st = dense_varlen(Tensor::contiguous(qb.ptr, DType::bf16, {total, H, D}, gpu),
                                   Tensor::contiguous(kb.ptr, DType::bf16, {total, Hkv, D}, gpu),
                                   Tensor::contiguous(vb.ptr, DType::bf16, {total, Hkv, D}, gpu), cud, cud,
                                   Tensor::contiguous(ob.ptr, DType::bf16, {total, H, D}, gpu),
                                   Tensor::contiguous(lb.ptr, DType::f32, {H, total}, gpu), opt);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(cuda::detail::last_flash_used_tma(), want_tma);
    Result r{std::vector<uint16_t>(total * H * D), std::vector<float>(total * H)};
    EXPECT_EQ(cudaMemcpy(r.out.data(), ob.ptr, ob.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(r.lse.data(), lb.ptr, lb.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return r;
  };
  ScheduleGuard schedule_guard;
  for (int run = 0; run < 5; ++run) {  // rung 3 with each schedule, then rung 2
    const bool tma = run < 4;
    const char* rung = tma ? kFlashSchedules[run].first : "rung 2";
    if (tma) cuda::detail::set_flash_schedule(kFlashSchedules[run].second);
    const bool saved = cuda::detail::set_flash_tma(tma);
    for (Mask mask : {Mask::none(), Mask::causal()}) {
      SCOPED_TRACE(std::string(rung) + ", " + mask_string(mask));
      const Result clean = run_varlen(k, v, mask, tma);
      const Result poisoned = run_varlen(k_bad, v_bad, mask, tma);
      for (int64_t s : {0, 2, 3}) {  // the same rows of two varlen calls: as the rows of sequence s
        const std::vector<uint16_t> o_s = sequence_rows(clean.out, H, D, cu[s], lens[s]);
        std::vector<float> l_s(H * lens[s]);
        for (int64_t h = 0; h < H; ++h)
          std::copy_n(&clean.lse[h * total + cu[s]], lens[s], &l_s[h * lens[s]]);
        EXPECT_EQ(rows_differing(o_s, l_s, poisoned.out, poisoned.lse, H, D, total, cu[s], lens[s]), 0)
            << "sequence " << s;
      }
      // Sequence 0 alone, [1, H, 300, D]: the same rows bit for bit.
      const int64_t n = lens[0];
      DeviceBuffer q1(0), k1(0), v1(0), o1(H * n * D * 2), l1(H * n * 4);
      upload_u16(sequence_rows(q, H, D, 0, n), q1);
      upload_u16(sequence_rows(k, Hkv, D, 0, n), k1);
      upload_u16(sequence_rows(v, Hkv, D, 0, n), v1);
      AttentionOptions opt;
      opt.backend = Backend::cuda;
      opt.mask = mask;
      const Status st = dense(Tensor::contiguous(q1.ptr, DType::bf16, {1, H, n, D}, gpu),
                              Tensor::contiguous(k1.ptr, DType::bf16, {1, Hkv, n, D}, gpu),
                              Tensor::contiguous(v1.ptr, DType::bf16, {1, Hkv, n, D}, gpu),
                              Tensor::contiguous(o1.ptr, DType::bf16, {1, H, n, D}, gpu),
                              Tensor::contiguous(l1.ptr, DType::f32, {1, H, n}, gpu), opt);
      ASSERT_TRUE(st.ok()) << st.to_string();
      std::vector<uint16_t> o_one(H * n * D);
      std::vector<float> l_one(H * n);
      CUDA_OK(cudaMemcpy(o_one.data(), o1.ptr, o1.bytes, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(l_one.data(), l1.ptr, l1.bytes, cudaMemcpyDeviceToHost));
      EXPECT_EQ(rows_differing(o_one, l_one, poisoned.out, poisoned.lse, H, D, total, 0, n), 0)
          << "sequence 0's rows against its own dense call";
    }
    cuda::detail::set_flash_tma(saved);
  }
}

// Block-sparse variable-length batches on the device: each sequence's rows of the output equal,
// bit for bit, a fixed-length call on that sequence alone with its own plan (both on flash rung 2,
// which permuted plans take in a varlen batch, K and V read in place, not gathered: the same
// arithmetic on the same values), which the
// Ops cases check against cpu_ref. Sequences with no queries, no keys, one token; permuted plans;
// junk in the plan rows past a sequence's query blocks (never read); masks. Then a device plan
// that lists a key block past one sequence's keys is refused naming the sequence, as on the host.
TEST(CudaAttentionVarlen, BlockSparseEqualsSeparateCalls) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Device gpu{DeviceType::cuda, 0};
  const std::vector<int32_t> lens_q = {300, 0, 700, 1, 64, 129, 0}, lens_kv = {300, 20, 900, 1, 1000, 0, 5};
  const int64_t S = static_cast<int64_t>(lens_q.size()), H = 4, Hkv = 2, D = 128;
  const int block = 64;
  const int64_t max_q = 700, max_kv = 1000, nq = (max_q + block - 1) / block, nkv = (max_kv + block - 1) / block;
  struct TmaOff {  // the varlen call's rung (permuted plans) for the separate calls too
    bool saved = cuda::detail::set_flash_tma(false);
    ~TmaOff() { cuda::detail::set_flash_tma(saved); }
  } tma_off;
  for (Mask mask : {Mask::none(), Mask::causal(), Mask::sliding_window(100, 0)}) {
    SCOPED_TRACE(mask_string(mask));
    std::mt19937 rng(91);
    std::normal_distribution<float> nd;
    std::vector<int32_t> cu_q(1, 0), cu_kv(1, 0);
    for (int64_t s = 0; s < S; ++s) {
      cu_q.push_back(cu_q.back() + lens_q[s]);
      cu_kv.push_back(cu_kv.back() + lens_kv[s]);
    }
    const int64_t total_q = cu_q.back(), total_kv = cu_kv.back();
    auto random_rows = [&](int64_t n) {
      std::vector<uint16_t> x(n);
      for (uint16_t& e : x) e = float_to_bf16(nd(rng));
      return x;
    };
    const std::vector<uint16_t> q = random_rows(total_q * H * D), k = random_rows(total_kv * Hkv * D),
                                v = random_rows(total_kv * Hkv * D);
    // The varlen plan: sequence s's own random plan (and permutations) in its rows; junk past them.
    BlockIndexBuffer plan = BlockIndexBuffer::empty(S, H, max_q, max_kv, block, block, nkv);
    plan.perm_q = HostArray(DType::i32, {S, H, max_q});
    plan.perm_kv = HostArray(DType::i32, {S, Hkv, max_kv});
    std::bernoulli_distribution take(0.6);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t snq = (lens_q[s] + block - 1) / block, snkv = (lens_kv[s] + block - 1) / block;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t qb = 0; qb < nq; ++qb) {
          const int64_t row = (s * H + h) * nq + qb;
          int32_t n = 0;
          if (qb >= snq) {  // past the sequence: junk, never read
            plan.counts.ptr<int32_t>()[row] = static_cast<int32_t>(nkv);
            for (int32_t kb = 0; kb < nkv; ++kb) plan.indices.ptr<int32_t>()[row * nkv + kb] = kb;
            continue;
          }
          for (int32_t kb = 0; kb < snkv; ++kb)
            if (take(rng)) plan.indices.ptr<int32_t>()[row * nkv + n++] = kb;
          plan.counts.ptr<int32_t>()[row] = n;
        }
      }
      auto fill = [&](HostArray& a, int64_t heads, int64_t max_len, int64_t len) {
        for (int64_t h = 0; h < heads; ++h) {
          int32_t* x = a.ptr<int32_t>() + (s * heads + h) * max_len;
          std::iota(x, x + len, 0);
          std::shuffle(x, x + len, rng);
          std::fill(x + len, x + max_len, -7);
        }
      };
      fill(plan.perm_q, H, max_q, lens_q[s]);
      fill(plan.perm_kv, Hkv, max_kv, lens_kv[s]);
    }
    DeviceBuffer qb(0), kb(0), vb(0), cqb(0), ckb(0), pc(0), pi(0), pq(0), pk(0), ob(total_q * H * D * 2),
        lb(total_q * H * 4);
    upload_u16(q, qb);
    upload_u16(k, kb);
    upload_u16(v, vb);
    HostArray cqh(DType::i32, {S + 1}), ckh(DType::i32, {S + 1});
    std::copy(cu_q.begin(), cu_q.end(), cqh.ptr<int32_t>());
    std::copy(cu_kv.begin(), cu_kv.end(), ckh.ptr<int32_t>());
    BlockIndex ixd = plan.view();
    ixd.counts = upload_i32(plan.counts, pc);
    ixd.indices = upload_i32(plan.indices, pi);
    ixd.perm_q = upload_i32(plan.perm_q, pq);
    ixd.perm_kv = upload_i32(plan.perm_kv, pk);
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    opt.mask = mask;
    const Tensor cqd = upload_i32(cqh, cqb), ckd = upload_i32(ckh, ckb);
    const Status st = block_sparse_varlen(
        Tensor::contiguous(qb.ptr, DType::bf16, {total_q, H, D}, gpu),
        Tensor::contiguous(kb.ptr, DType::bf16, {total_kv, Hkv, D}, gpu),
        Tensor::contiguous(vb.ptr, DType::bf16, {total_kv, Hkv, D}, gpu), cqd, ckd, ixd,
        Tensor::contiguous(ob.ptr, DType::bf16, {total_q, H, D}, gpu),
        Tensor::contiguous(lb.ptr, DType::f32, {H, total_q}, gpu), opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_FALSE(cuda::detail::last_flash_used_tma()) << "a permuted varlen plan runs on rung 2";
    std::vector<uint16_t> out_h(total_q * H * D);
    std::vector<float> lse_h(total_q * H);
    CUDA_OK(cudaMemcpy(out_h.data(), ob.ptr, ob.bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse_h.data(), lb.ptr, lb.bytes, cudaMemcpyDeviceToHost));

    for (int64_t s = 0; s < S; ++s) {
      SCOPED_TRACE("sequence " + std::to_string(s));
      const int64_t lq = lens_q[s], lkv = lens_kv[s];
      if (lq == 0) continue;
      if (lkv == 0) {  // queries and no keys: empty rows
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t h = 0; h < H; ++h) EXPECT_EQ(lse_h[h * total_q + cu_q[s] + i], -INFINITY);
        continue;
      }
      // The same sequence alone: [1, heads, len, D] copies of its rows and its rows of the plan.
      const int64_t snq = (lq + block - 1) / block;
      BlockIndexBuffer one = BlockIndexBuffer::empty(1, H, lq, lkv, block, block, nkv);
      one.perm_q = HostArray(DType::i32, {1, H, lq});
      one.perm_kv = HostArray(DType::i32, {1, Hkv, lkv});
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t r = 0; r < snq; ++r) {
          one.counts.ptr<int32_t>()[h * snq + r] = plan.counts.ptr<int32_t>()[(s * H + h) * nq + r];
          std::copy_n(plan.indices.ptr<int32_t>() + ((s * H + h) * nq + r) * nkv, nkv,
                      one.indices.ptr<int32_t>() + (h * snq + r) * nkv);
        }
        std::copy_n(plan.perm_q.ptr<int32_t>() + (s * H + h) * max_q, lq, one.perm_q.ptr<int32_t>() + h * lq);
      }
      for (int64_t h = 0; h < Hkv; ++h)
        std::copy_n(plan.perm_kv.ptr<int32_t>() + (s * Hkv + h) * max_kv, lkv, one.perm_kv.ptr<int32_t>() + h * lkv);
      DeviceBuffer q1(0), k1(0), v1(0), c1(0), i1(0), pq1(0), pk1(0), o1(H * lq * D * 2), l1(H * lq * 4);
      upload_u16(sequence_rows(q, H, D, cu_q[s], lq), q1);
      upload_u16(sequence_rows(k, Hkv, D, cu_kv[s], lkv), k1);
      upload_u16(sequence_rows(v, Hkv, D, cu_kv[s], lkv), v1);
      BlockIndex ix1 = one.view();
      ix1.counts = upload_i32(one.counts, c1);
      ix1.indices = upload_i32(one.indices, i1);
      ix1.perm_q = upload_i32(one.perm_q, pq1);
      ix1.perm_kv = upload_i32(one.perm_kv, pk1);
      const Status st1 = block_sparse(Tensor::contiguous(q1.ptr, DType::bf16, {1, H, lq, D}, gpu),
                                      Tensor::contiguous(k1.ptr, DType::bf16, {1, Hkv, lkv, D}, gpu),
                                      Tensor::contiguous(v1.ptr, DType::bf16, {1, Hkv, lkv, D}, gpu), ix1,
                                      Tensor::contiguous(o1.ptr, DType::bf16, {1, H, lq, D}, gpu),
                                      Tensor::contiguous(l1.ptr, DType::f32, {1, H, lq}, gpu), opt);
      ASSERT_TRUE(st1.ok()) << st1.to_string();
      std::vector<uint16_t> o_one(H * lq * D);
      std::vector<float> l_one(H * lq);
      CUDA_OK(cudaMemcpy(o_one.data(), o1.ptr, o1.bytes, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(l_one.data(), l1.ptr, l1.bytes, cudaMemcpyDeviceToHost));
      EXPECT_EQ(rows_differing(o_one, l_one, out_h, lse_h, H, D, total_q, cu_q[s], lq), 0)
          << "rows (O or LSE) that differ from the sequence's own call";
    }

    // A key block past sequence 0's keys (300 keys: blocks 0-4; block 10 exists only for the
    // longest), in a row the kernel would read: refused on the host, naming the sequence.
    HostArray bad_counts = plan.counts, bad_indices = plan.indices;
    bad_counts.ptr<int32_t>()[0] = 1;
    bad_indices.ptr<int32_t>()[0] = 10;
    DeviceBuffer bc(0), bi(0);
    BlockIndex bad = ixd;
    bad.counts = upload_i32(bad_counts, bc);
    bad.indices = upload_i32(bad_indices, bi);
    const Status rejected = block_sparse_varlen(
        Tensor::contiguous(qb.ptr, DType::bf16, {total_q, H, D}, gpu),
        Tensor::contiguous(kb.ptr, DType::bf16, {total_kv, Hkv, D}, gpu),
        Tensor::contiguous(vb.ptr, DType::bf16, {total_kv, Hkv, D}, gpu), cqd, ckd, bad,
        Tensor::contiguous(ob.ptr, DType::bf16, {total_q, H, D}, gpu),
        Tensor::contiguous(lb.ptr, DType::f32, {H, total_q}, gpu), opt);
    EXPECT_FALSE(rejected.ok());
    EXPECT_EQ(rejected.message().rfind("sequence 0", 0), 0u) << rejected.to_string();
  }
}

// A mask that hides no key of the shape from any query runs as no mask (attention.cu's set_mask):
// the outputs equal the unmasked call's bit for bit, on the split-KV route (a block step: 16
// queries that are one whole block at the end of a block-causal sequence) and the flash route
// (128 queries, the last block of block_causal(128); a window wider than the sequence), while a
// mask that hides one key changes the result.
TEST(CudaAttentionMasks, HidingNothingIsNoMaskBitForBit) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Device gpu{DeviceType::cuda, 0};
  struct Shape {
    int64_t len_q, len_kv;
    Mask mask;
    bool hides;
  };
  const Shape shapes[] = {{16, 4096, Mask::block_causal(16), false},
                          {128, 1024, Mask::block_causal(128), false},
                          {300, 300, Mask::sliding_window(300), false},
                          {16, 4096, Mask::sliding_window(5000), false},
                          {16, 4096, Mask::block_causal(8), true},
                          {128, 1024, Mask::sliding_window(1022, 0), true}};
  const int64_t H = 4, Hkv = 2, D = 64;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(mask_string(sh.mask) + " " + std::to_string(sh.len_q) + "x" + std::to_string(sh.len_kv));
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    auto upload_random = [&](int64_t n, DeviceBuffer& buf) {
      std::vector<uint16_t> h(n);
      for (uint16_t& x : h) x = float_to_bf16(nd(rng));
      buf.reset(n * 2);
      cudaMemcpy(buf.ptr, h.data(), n * 2, cudaMemcpyHostToDevice);
    };
    DeviceBuffer q(0), k(0), v(0), o1(H * sh.len_q * D * 2), o2(H * sh.len_q * D * 2), l1(H * sh.len_q * 4),
        l2(H * sh.len_q * 4);
    upload_random(H * sh.len_q * D, q);
    upload_random(Hkv * sh.len_kv * D, k);
    upload_random(Hkv * sh.len_kv * D, v);
    auto t = [&](DeviceBuffer& b, int64_t heads, int64_t len) {
      return Tensor::contiguous(b.ptr, DType::bf16, {1, heads, len, D}, gpu);
    };
    AttentionOptions opt;
    opt.backend = Backend::cuda;
    ASSERT_TRUE(dense(t(q, H, sh.len_q), t(k, Hkv, sh.len_kv), t(v, Hkv, sh.len_kv), t(o1, H, sh.len_q),
                      Tensor::contiguous(l1.ptr, DType::f32, {1, H, sh.len_q}, gpu), opt)
                    .ok());
    opt.mask = sh.mask;
    ASSERT_TRUE(dense(t(q, H, sh.len_q), t(k, Hkv, sh.len_kv), t(v, Hkv, sh.len_kv), t(o2, H, sh.len_q),
                      Tensor::contiguous(l2.ptr, DType::f32, {1, H, sh.len_q}, gpu), opt)
                    .ok());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> a(H * sh.len_q * D), b(H * sh.len_q * D);
    CUDA_OK(cudaMemcpy(a.data(), o1.ptr, a.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(b.data(), o2.ptr, b.size() * 2, cudaMemcpyDeviceToHost));
    EXPECT_EQ(a == b, !sh.hides) << (sh.hides ? "a mask that hides keys changed nothing"
                                              : "a mask that hides nothing changed the output");
  }
}

// The block-diffusion prefix shape (16 queries, 32 query heads over 8 kv heads, d 128, 4099
// keys) reaches the split-KV executor with more than one split; one more query (65) or one key
// fewer than 512 does not, nor does a block-sparse plan. Inputs are zeros: only the route matters.
TEST(CudaAttentionRoute, PrefixShapeTakesSplitKv) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  const Device gpu{DeviceType::cuda, 0};
  const int64_t Hq = 32, Hkv = 8, D = 128, max_q = 65, max_kv = 4099;
  DeviceBuffer q(Hq * max_q * D * 2), k(Hkv * max_kv * D * 2), v(Hkv * max_kv * D * 2), o(Hq * max_q * D * 2),
      l(Hq * max_q * 4);
  for (DeviceBuffer* b : {&q, &k, &v}) CUDA_OK(cudaMemset(b->ptr, 0, b->bytes));
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  auto run = [&](int64_t len_q, int64_t len_kv) {
    return dense(Tensor::contiguous(q.ptr, DType::bf16, {1, Hq, len_q, D}, gpu),
                 Tensor::contiguous(k.ptr, DType::bf16, {1, Hkv, len_kv, D}, gpu),
                 Tensor::contiguous(v.ptr, DType::bf16, {1, Hkv, len_kv, D}, gpu),
                 Tensor::contiguous(o.ptr, DType::bf16, {1, Hq, len_q, D}, gpu),
                 Tensor::contiguous(l.ptr, DType::f32, {1, Hq, len_q}, gpu), opt);
  };
  using cuda::detail::Route;
  ASSERT_TRUE(run(16, 4099).ok());
  EXPECT_EQ(cuda::detail::last_dense_route(), Route::split_kv);
  EXPECT_GT(cuda::detail::last_split_kv_splits(), 1);
  EXPECT_TRUE(cuda::detail::last_split_kv_used_tma()) << "aligned contiguous K, V: the wgmma + TMA kernel";
  ASSERT_TRUE(run(64, 512).ok());
  EXPECT_EQ(cuda::detail::last_dense_route(), Route::split_kv);
  ASSERT_TRUE(run(65, 4099).ok());
  EXPECT_EQ(cuda::detail::last_dense_route(), Route::flash_dense);
  EXPECT_EQ(cuda::detail::last_split_kv_splits(), 0);
  ASSERT_TRUE(run(16, 511).ok());
  EXPECT_EQ(cuda::detail::last_dense_route(), Route::flash_dense);

  BlockIndexBuffer plan = BlockIndexBuffer::full(1, Hq, 16, 4099, 64, 64);
  DeviceBuffer cb(0), ib(0);
  BlockIndex ix = plan.view();
  ix.counts = upload_i32(plan.counts, cb);
  ix.indices = upload_i32(plan.indices, ib);
  ASSERT_TRUE(block_sparse(Tensor::contiguous(q.ptr, DType::bf16, {1, Hq, 16, D}, gpu),
                           Tensor::contiguous(k.ptr, DType::bf16, {1, Hkv, 4099, D}, gpu),
                           Tensor::contiguous(v.ptr, DType::bf16, {1, Hkv, 4099, D}, gpu), ix,
                           Tensor::contiguous(o.ptr, DType::bf16, {1, Hq, 16, D}, gpu),
                           Tensor::contiguous(l.ptr, DType::f32, {1, Hq, 16}, gpu), opt)
                  .ok());
  EXPECT_EQ(cuda::detail::last_dense_route(), Route::flash_block_sparse);

  // A call the backend refuses (host memory that claims to be on the device) launches nothing.
  HostArray host_k(DType::bf16, {1, Hkv, 4099, D});
  EXPECT_FALSE(dense(Tensor::contiguous(q.ptr, DType::bf16, {1, Hq, 16, D}, gpu),
                     Tensor::contiguous(host_k.data(), DType::bf16, {1, Hkv, 4099, D}, gpu),
                     Tensor::contiguous(v.ptr, DType::bf16, {1, Hkv, 4099, D}, gpu),
                     Tensor::contiguous(o.ptr, DType::bf16, {1, Hq, 16, D}, gpu),
                     Tensor::contiguous(l.ptr, DType::f32, {1, Hq, 16}, gpu), opt)
                   .ok());
  EXPECT_EQ(cuda::detail::last_dense_route(), Route::none);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(CudaAttentionErrors, NameTheArgument) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer buf(1 << 20);
  const Device gpu{DeviceType::cuda, 0};
  auto view = [&](DType dt, int64_t d, size_t offset = 0) {
    return Tensor::contiguous(static_cast<char*>(buf.ptr) + offset, dt, {1, 2, 8, d}, gpu);
  };
  Tensor q = view(DType::bf16, 64), k = view(DType::bf16, 64, 4096), v = view(DType::bf16, 64, 8192),
         out = view(DType::bf16, 64, 16384);
  Tensor lse = Tensor::contiguous(static_cast<char*>(buf.ptr) + 32768, DType::f32, {1, 2, 8}, gpu);
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  ASSERT_TRUE(dense(q, k, v, out, lse, opt).ok());

  HostArray host_k(DType::bf16, {1, 2, 8, 64});
  Status st = dense(q, host_k.view(), v, out, lse, opt);
  EXPECT_NE(st.message().find("k: expected a tensor on cuda:0"), std::string::npos) << st.to_string();

  Tensor lying = q;  // a host pointer that claims to be on the device
  lying.data = host_k.data();
  st = dense(lying, k, v, out, lse, opt);
  EXPECT_NE(st.message().find("q: expected memory of cuda:0"), std::string::npos) << st.to_string();

  Tensor q32 = view(DType::f32, 64), k32 = view(DType::f32, 64, 4096), v32 = view(DType::f32, 64, 8192),
         o32 = view(DType::f32, 64, 16384);
  st = dense(q32, k32, v32, o32, lse, opt);
  EXPECT_EQ(st.code(), StatusCode::unsupported_dtype) << st.to_string();

  Tensor q96 = view(DType::bf16, 96), k96 = view(DType::bf16, 96, 4096), v96 = view(DType::bf16, 96, 8192),
         o96 = view(DType::bf16, 96, 16384);
  st = dense(q96, k96, v96, o96, lse, opt);
  EXPECT_NE(st.message().find("head_dim 96"), std::string::npos) << st.to_string();

  // A plan on the host is refused by name.
  BlockIndexBuffer plan = BlockIndexBuffer::full(1, 2, 8, 8, 4, 4);
  st = block_sparse(q, k, v, plan.view(), out, lse, opt);
  EXPECT_NE(st.message().find("index.counts: expected a tensor on cuda:0"), std::string::npos) << st.to_string();

  // Garbage index contents on the device: refused by the device check (the default), and, with
  // the check off, guarded by the kernels: no fault here, and nothing out of bounds under
  // compute-sanitizer memcheck, which scripts/gpu-check runs on this test ('*Errors*').
  BlockIndex bad = plan.view();
  HostArray counts(DType::i32, {1, 2, 2}), indices(DType::i32, {1, 2, 2, 2});
  for (int i = 0; i < 4; ++i) counts.ptr<int32_t>()[i] = 1000 * (i % 2 ? -1 : 1);
  for (int i = 0; i < 8; ++i) indices.ptr<int32_t>()[i] = i % 2 ? -5 : 99;
  DeviceBuffer cb(0), ib(0);
  bad.counts = upload_i32(counts, cb);
  bad.indices = upload_i32(indices, ib);
  st = block_sparse(q, k, v, bad, out, lse, opt);
  EXPECT_EQ(st.code(), StatusCode::invalid_argument) << st.to_string();
  EXPECT_NE(st.message().find("index.counts[0, 0, 0]: 1000 is outside [0, capacity = 2]"), std::string::npos)
      << st.to_string();
  AttentionOptions trusting = opt;
  trusting.check_index = false;
  st = block_sparse(q, k, v, bad, out, lse, trusting);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The device check of a BlockIndex (src/cuda/attention/index_check.cu) reports exactly what the
// host check (validate_block_index) reports, for every kind of wrong content, including the first
// of several errors and repeated permutation entries (the second occurrence is named). Shape:
// batch 2, 3 query heads over 1 kv head, 300 x 290 tokens in 17 x 23 blocks (18 x 13 blocks, the
// last ones partial), capacity 5.
TEST(CudaAttentionErrors, IndexContentsCheckedOnTheDeviceAsOnTheHost) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t B = 2, Hq = 3, Hkv = 1, Lq = 300, Lkv = 290, D = 64;
  constexpr int bq = 17, bkv = 23;
  const int64_t nq = (Lq + bq - 1) / bq, nkv = (Lkv + bkv - 1) / bkv, cap = 5;
  const Device gpu{DeviceType::cuda, 0};
  DeviceBuffer qb(B * Hq * Lq * D * 2), kb(B * Hkv * Lkv * D * 2), vb(B * Hkv * Lkv * D * 2),
      ob(B * Hq * Lq * D * 2), lb(B * Hq * Lq * 4);
  CUDA_OK(cudaMemset(qb.ptr, 0, qb.bytes));
  CUDA_OK(cudaMemset(kb.ptr, 0, kb.bytes));
  CUDA_OK(cudaMemset(vb.ptr, 0, vb.bytes));
  const Tensor q = Tensor::contiguous(qb.ptr, DType::bf16, {B, Hq, Lq, D}, gpu);
  const Tensor k = Tensor::contiguous(kb.ptr, DType::bf16, {B, Hkv, Lkv, D}, gpu);
  const Tensor v = Tensor::contiguous(vb.ptr, DType::bf16, {B, Hkv, Lkv, D}, gpu);
  const Tensor out = Tensor::contiguous(ob.ptr, DType::bf16, {B, Hq, Lq, D}, gpu);
  const Tensor lse = Tensor::contiguous(lb.ptr, DType::f32, {B, Hq, Lq}, gpu);

  // A valid plan: row r keeps 1 + r % cap ascending blocks; permutations are reversals.
  struct Plan {
    HostArray counts{DType::i32, {B, Hq, nq}}, indices{DType::i32, {B, Hq, nq, cap}};
    HostArray perm_q{DType::i32, {B, Hq, Lq}}, perm_kv{DType::i32, {B, Hkv, Lkv}};
    int32_t* c() { return counts.ptr<int32_t>(); }
    int32_t* ix(int64_t r, int64_t s) { return indices.ptr<int32_t>() + r * cap + s; }
  };
  auto valid = [&] {
    Plan p;
    for (int64_t r = 0; r < B * Hq * nq; ++r) {
      p.c()[r] = static_cast<int32_t>(1 + r % cap);
      for (int64_t s = 0; s < cap; ++s) *p.ix(r, s) = static_cast<int32_t>(2 * s + r % 3);  // <= 10 < nkv
    }
    for (int64_t i = 0; i < B * Hq * Lq; ++i) p.perm_q.ptr<int32_t>()[i] = static_cast<int32_t>(Lq - 1 - i % Lq);
    for (int64_t i = 0; i < B * Hkv * Lkv; ++i) p.perm_kv.ptr<int32_t>()[i] = static_cast<int32_t>(Lkv - 1 - i % Lkv);
    return p;
  };
  const int64_t r = (1 * Hq + 2) * nq + 4;  // a row of batch 1, head 2 with count 5
  auto pq = [&](Plan& p, int64_t b, int64_t h, int64_t i) -> int32_t& { return p.perm_q.ptr<int32_t>()[(b * Hq + h) * Lq + i]; };
  auto pkv = [&](Plan& p, int64_t b, int64_t i) -> int32_t& { return p.perm_kv.ptr<int32_t>()[b * Lkv + i]; };
  struct Mutation {
    const char* what;
    std::function<void(Plan&)> apply;
  };
  const Mutation mutations[] = {
      {"valid", [](Plan&) {}},
      {"count above capacity", [&](Plan& p) { p.c()[r] = 6; }},
      {"negative count", [&](Plan& p) { p.c()[r] = -1; }},
      {"key block past the end", [&](Plan& p) { *p.ix(r, 4) = 13; }},
      {"negative key block", [&](Plan& p) { *p.ix(r, 0) = -3; }},
      {"key blocks repeated", [&](Plan& p) { *p.ix(r, 2) = *p.ix(r, 1); }},
      {"key blocks descending", [&](Plan& p) { std::swap(*p.ix(r, 1), *p.ix(r, 2)); }},
      {"two errors: the earlier row's is named",
       [&](Plan& p) {
         p.c()[r + 5] = 9;
         *p.ix(r, 3) = 1;
       }},
      {"a slot past the count is not looked at",
       [&](Plan& p) {
         p.c()[r] = 4;
         *p.ix(r, 4) = 99;
       }},
      {"perm_q repeats an entry", [&](Plan& p) { pq(p, 1, 2, 250) = pq(p, 1, 2, 7); }},
      {"perm_q out of range", [&](Plan& p) { pq(p, 0, 1, 11) = static_cast<int32_t>(Lq); }},
      {"perm_kv negative", [&](Plan& p) { pkv(p, 1, Lkv - 1) = -1; }},
      {"index and permutation errors: the index's is named",
       [&](Plan& p) {
         pq(p, 0, 0, 0) = 1;
         p.c()[nq * Hq * B - 1] = 7;
       }},
  };
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  for (const Mutation& m : mutations) {
    SCOPED_TRACE(m.what);
    Plan p = valid();
    m.apply(p);
    BlockIndex host;
    host.block_q = bq;
    host.block_kv = bkv;
    host.num_q_blocks = nq;
    host.num_kv_blocks = nkv;
    host.counts = p.counts.view();
    host.indices = p.indices.view();
    host.perm_q = p.perm_q.view();
    host.perm_kv = p.perm_kv.view();
    const Status expected = validate_block_index(host, B, Hq, Hkv, Lq, Lkv);
    DeviceBuffer cb(0), ib(0), pqb(0), pkb(0);
    BlockIndex dev = host;
    dev.counts = upload_i32(p.counts, cb);
    dev.indices = upload_i32(p.indices, ib);
    dev.perm_q = upload_i32(p.perm_q, pqb);
    dev.perm_kv = upload_i32(p.perm_kv, pkb);
    const Status got = block_sparse(q, k, v, dev, out, lse, opt);
    EXPECT_EQ(got.code(), expected.code()) << got.to_string() << " vs " << expected.to_string();
    EXPECT_EQ(got.message(), expected.message());
    const bool should_pass = std::string(m.what) == "valid" || std::string(m.what).starts_with("a slot past");
    EXPECT_EQ(got.ok(), should_pass) << got.to_string();
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The LSE merge on the device against cpu_ref: every dtype, a head_dim that is not a multiple of
// the warp, a strided second operand, rows where one side or both saw no key (L = -inf, and a
// side of weight 0 whose O is NaN must not leak), and out/lse aliasing o1/lse1. Bound: the kernel
// computes in f32 and rounds O once to the dtype, the reference in f64 rounded once: where the
// exact value sits near a rounding midpoint the two may round apart, so one ulp of the dtype,
// |O - ref| <= 2^-(p-1) * |ref| + 1e-6 (p = 8 bf16, 11 f16; 2^-20 for f32's few roundings);
// LSE within 4e-6 * (1 + |ref|) (f32 expf / logf, a few ulps).
// Three head_dims: 72, whose rows span whole 16-byte chunks in every dtype (the vector kernel, 9
// or 18 chunks a row: groups of 16 or 32 lanes with idle lanes), 256 (32 or 64 chunks: f32's
// lanes loop), and 37, whose rows do not (the per-element kernel).
TEST(CudaAttentionMerge, MatchesCpuRefEveryDtypeStridedAliasedAndEmptySides) {
  if (!backend_available(Backend::cuda)) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t B = 2, H = 3, L = 37, pad = 8;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t D : {int64_t{72}, int64_t{37}, int64_t{256}})
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " head_dim " + std::to_string(D));
    std::vector<float> o1f(B * H * L * D), o2f(B * H * L * (D + pad));
    for (auto& x : o1f) x = normal(rng);
    for (auto& x : o2f) x = normal(rng);
    std::vector<float> l1(B * H * L), l2(B * H * L);
    for (int64_t r = 0; r < B * H * L; ++r) {
      l1[r] = 4 * normal(rng);
      l2[r] = 4 * normal(rng);
      if (r % 7 == 1) l1[r] = -INFINITY;
      if (r % 11 == 2) l2[r] = -INFINITY;
      if (r % 13 == 3) l1[r] = l2[r] = -INFINITY;
    }
    for (int64_t r = 0; r < B * H * L; ++r) {
      if (l1[r] == -INFINITY) o1f[r * D] = NAN;  // weight 0: must not contribute
    }
    HostArray o1 = convert(Tensor::contiguous(o1f.data(), DType::f32, {B, H, L, D}), dt).value();
    HostArray o2_wide = convert(Tensor::contiguous(o2f.data(), DType::f32, {B, H, L, D + pad}), dt).value();
    Tensor o2 = o2_wide.view();
    o2.shape[3] = D;  // rows of D + pad elements, the first D used
    const Tensor lse1 = Tensor::contiguous(l1.data(), DType::f32, {B, H, L});
    const Tensor lse2 = Tensor::contiguous(l2.data(), DType::f32, {B, H, L});
    auto want = merge(o1.view(), lse1, o2, lse2, Backend::cpu_ref);
    ASSERT_TRUE(want.ok()) << want.status().to_string();

    DeviceBuffer d_o1(o1.nbytes()), d_o2(o2_wide.nbytes()), d_l1(l1.size() * 4), d_l2(l2.size() * 4),
        d_out(o1.nbytes()), d_lse(l1.size() * 4);
    CUDA_OK(cudaMemcpy(d_o1.ptr, o1.data(), o1.nbytes(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_o2.ptr, o2_wide.data(), o2_wide.nbytes(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_l1.ptr, l1.data(), l1.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_l2.ptr, l2.data(), l2.size() * 4, cudaMemcpyHostToDevice));
    const Device gpu{DeviceType::cuda, 0};
    auto on_gpu = [&](const Tensor& t, void* p) {
      Tensor x = t;
      x.data = p;
      x.device = gpu;
      return x;
    };
    const Tensor g_o1 = on_gpu(o1.view(), d_o1.ptr), g_o2 = on_gpu(o2, d_o2.ptr), g_l1 = on_gpu(lse1, d_l1.ptr),
                 g_l2 = on_gpu(lse2, d_l2.ptr), g_out = on_gpu(o1.view(), d_out.ptr), g_lse = on_gpu(lse1, d_lse.ptr);
    ASSERT_TRUE(merge(g_o1, g_l1, g_o2, g_l2, g_out, g_lse, Backend::cuda).ok());
    HostArray got_o(dt, {B, H, L, D}), got_l(DType::f32, {B, H, L});
    CUDA_OK(cudaMemcpy(got_o.data(), d_out.ptr, got_o.nbytes(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_l.data(), d_lse.ptr, got_l.nbytes(), cudaMemcpyDeviceToHost));
    const double u = dt == DType::bf16 ? 1.0 / 128 : dt == DType::f16 ? 1.0 / 1024 : 1.0 / (1 << 20);
    for (int64_t r = 0; r < B * H * L; ++r) {
      const float wl = want->lse.ptr<float>()[r], gl = got_l.ptr<float>()[r];
      if (wl == -INFINITY) {
        ASSERT_EQ(gl, -INFINITY) << "row " << r;
      } else {
        ASSERT_NEAR(gl, wl, 4e-6 * (1 + std::fabs(wl))) << "row " << r;
      }
      for (int64_t t = 0; t < D; ++t) {
        const double w = load_as_double(want->out.view(), r * D + t), g = load_as_double(got_o.view(), r * D + t);
        ASSERT_TRUE(std::isfinite(g)) << "row " << r << " col " << t;
        if (wl == -INFINITY) ASSERT_EQ(g, 0.0) << "row " << r;
        ASSERT_NEAR(g, w, u * std::fabs(w) + 1e-6) << "row " << r << " col " << t;
      }
    }
    // In place: out = o1, lse = lse1 gives the same bits.
    ASSERT_TRUE(merge(g_o1, g_l1, g_o2, g_l2, g_o1, g_l1, Backend::cuda).ok());
    HostArray in_place_o(dt, {B, H, L, D}), in_place_l(DType::f32, {B, H, L});
    CUDA_OK(cudaMemcpy(in_place_o.data(), d_o1.ptr, in_place_o.nbytes(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(in_place_l.data(), d_l1.ptr, in_place_l.nbytes(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(in_place_o.data(), got_o.data(), got_o.nbytes()), 0);
    EXPECT_EQ(std::memcmp(in_place_l.data(), got_l.data(), got_l.nbytes()), 0);
    // A host operand is named.
    const Status bad = merge(g_o1, g_l1, o2, g_l2, g_out, g_lse, Backend::cuda);
    EXPECT_FALSE(bad.ok());
    EXPECT_NE(bad.message().find("o2"), std::string::npos) << bad.to_string();
  }
}

}  // namespace

#endif  // SPARSA_WITH_CUDA
