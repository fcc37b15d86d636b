// BA-Att's cuda selector (Backend::cuda) against the CPU path on the same inputs.
//
// The device cases run where a CUDA device is visible (GTEST_SKIP elsewhere); the argument and
// availability contracts run everywhere.
//
// What is compared, and why not bit for bit:
//  - Norms. The CPU sorts by f64 norms, the device by f32 norms (f32 sum of d squares, then
//    sqrtf). The f32 sum of d non-negative terms has relative error <= d * 2^-24 (+ one rounding
//    for sqrtf, and the square root halves the relative error of the sum), so the device norm is
//    checked against the f64 norm within (d + 2) * 2^-24 relative.
//  - Permutations. With f32 norms, tokens whose norms differ by less than that error may sort in
//    the other order, so the device permutation is checked exactly against norm_sort (the CPU's
//    stable sort) applied to the device's own norms, and against the CPU's permutation only as
//    order statistics: at every position the f64 norms of the two tokens differ by at most twice
//    the norm tolerance (the k-th smallest of perturbed values is within the perturbation of the
//    k-th smallest of the exact values).
//  - Logits. The reference is cpu_ref's scoring (f64) of the blocks formed by the DEVICE's
//    permutations, so both score the same blocks. The device accumulates means and variances over
//    at most `block` tokens and the feature product over F terms in f32; each partial sum errs by
//    at most (its length) * 2^-24 times the sum of the absolute values of its terms, so the bound
//    is 2 * (block + F) * 2^-24 * M, where M bounds the absolute terms of the logit (computed below
//    from block means of |x| and of x^2 in f64). The tensor-core product (3xTF32) errs by at most
//    ~2^-21 = 8 * 2^-24 per term (the split x = hi + lo keeps ~22 bits, and lo * lo is dropped) and
//    by at most 2 * 2^-24 per addition if the tensor cores truncate: block + 2 F + 8 units in all,
//    inside the bound when max(block_q, block_kv) >= 8 (16 or more in every case here).
//  - Plans. Given the same f32 logits the budget is exact: the device's kept set for top_kappa and
//    density equals select_blocks() on the device logits copied back, bit for bit. Mass sums f64
//    weights in a different order (a tree, not a loop), so there the count may differ only where
//    the cumulative mass sits within 1e-12 relative of tau * total. Against the full CPU path (its
//    own f64 permutations and logits), counts must match for fixed budgets, and the device's kept
//    blocks must all score (reference logits) at least the best dropped block minus 2 * tol: either
//    side of a near-tie is acceptable, a wrong block is not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "core/attention_params.h"
#include "core/backends.h"
#include "cuda/select/ba_att_hooks.h"
#include "cuda/select/ba_att_keys.h"
#include "methods/ba_att/ba_att_impl.h"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "test_util.h"

#if defined(SPARSA_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace sparsa;

namespace {

bool have_device() { return backend_available(Backend::cuda); }

}  // namespace

// ---- contracts that need no device ------------------------------------------------------------

TEST(BaAttCuda, HostTensorsAreRefusedNamingTheArgument) {
  HostArray q(DType::bf16, {1, 2, 16, 64}), k(DType::bf16, {1, 2, 16, 64});
  BaAttOptions o;
  o.backend = Backend::cuda;
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(plan.status().message().find("q: the cuda backend expected a tensor on a cuda device, got cpu"),
            std::string::npos)
      << plan.status().to_string();
  auto scores = ba_att_scores(q.view(), k.view(), o);
  ASSERT_FALSE(scores.ok());
  EXPECT_NE(scores.status().message().find("q:"), std::string::npos) << scores.status().to_string();
  HostArray v(DType::bf16, {1, 2, 16, 64});
  auto out = ba_att(q.view(), k.view(), v.view(), o);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("q:"), std::string::npos) << out.status().to_string();
}

TEST(BaAttCuda, KeyOnAnotherDeviceIsRefused) {
  HostArray q(DType::bf16, {1, 2, 16, 64}), k(DType::bf16, {1, 2, 16, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};  // only the label: placement is checked before any pointer is read
  BaAttOptions o;
  o.backend = Backend::cuda;
  auto plan = ba_att_plan(qd, k.view(), o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("k: expected a tensor on cuda:0, got cpu"), std::string::npos)
      << plan.status().to_string();
}

TEST(BaAttCuda, UnsupportedDtypeNamesTheArgument) {
  HostArray q(DType::i32, {1, 1, 16, 64}), k(DType::i32, {1, 1, 16, 64});
  Tensor qd = q.view(), kd = k.view();
  qd.device = kd.device = {DeviceType::cuda, 0};
  BaAttOptions o;
  o.backend = Backend::cuda;
  auto plan = ba_att_plan(qd, kd, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::unsupported_dtype);
  EXPECT_NE(plan.status().message().find("q: expected dtype f32, f16 or bf16, got i32"), std::string::npos)
      << plan.status().to_string();
}

TEST(BaAttCuda, WithoutADeviceTheBackendIsUnsupported) {
  if (have_device()) GTEST_SKIP() << "a CUDA device is present";
  HostArray q(DType::bf16, {1, 1, 16, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};
  BaAttOptions o;
  o.backend = Backend::cuda;
  auto plan = ba_att_plan(qd, qd, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::unsupported) << plan.status().to_string();
  // and device memory cannot be had either
  auto a = DeviceArray::allocate(DType::i32, {4}, {DeviceType::cuda, 0});
  EXPECT_FALSE(a.ok());
}

TEST(BaAttCuda, HostPlanToHostIsItself) {
  BlockIndexBuffer plan = BlockIndexBuffer::full(1, 2, 10, 20, 4, 8);
  EXPECT_FALSE(plan.on_device());
  auto copy = plan.to_host();
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ(copy->counts.numel(), plan.counts.numel());
  EXPECT_EQ(0, std::memcmp(copy->indices.data(), plan.indices.data(), plan.indices.nbytes()));
  auto bad = DeviceArray::allocate(DType::i32, {4}, Device{});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected a cuda device"), std::string::npos);
}

// The integer keys the device sorts by encode the CPU's orders (host-checked, no device needed).
TEST(BaAttCuda, RowKeysOrderAsSelectBlocks) {
  using namespace sparsa::cuda::ba_att;
  const float inf = std::numeric_limits<float>::infinity();
  const float den = std::numeric_limits<float>::denorm_min();
  const std::vector<float> logits = {3.5f, -0.0f, 0.0f, -inf,  inf,   den, -den, 3.5f, -2.25f, 1e-30f,
                                     -1e30f, 7.0f, 0.0f, -0.0f, 1e30f, 2.0f, -2.25f, den};
  const int64_t n = static_cast<int64_t>(logits.size());
  std::vector<uint64_t> keys(n);
  for (int64_t j = 0; j < n; ++j) {
    keys[j] = order_key(logits[j], static_cast<int32_t>(j));
    EXPECT_EQ(index_of(keys[j]), j);
    const float back = logit_of(keys[j]);
    EXPECT_TRUE(back == logits[j]) << j;  // -0 comes back as +0, which compares equal
  }
  std::vector<int64_t> by_key(n), expected(n);
  std::iota(by_key.begin(), by_key.end(), 0);
  std::iota(expected.begin(), expected.end(), 0);
  std::sort(by_key.begin(), by_key.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::stable_sort(expected.begin(), expected.end(),
                   [&](int64_t a, int64_t b) { return static_cast<double>(logits[a]) > static_cast<double>(logits[b]); });
  EXPECT_EQ(by_key, expected);
  // and the first kappa keys, ascending, are select_blocks' top-kappa set
  std::vector<double> key(logits.begin(), logits.end()), weight(n, 1.0);
  for (int64_t kappa : {1, 2, 5, 9, 18}) {
    std::vector<int32_t> want(n);
    want.resize(select_blocks(key.data(), weight.data(), nullptr, n, Budget::top_kappa(kappa), want.data()));
    std::vector<int32_t> got(by_key.begin(), by_key.begin() + kappa);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want) << "kappa " << kappa;
  }
}

// The norm kernel's division by invariant integers (token -> (batch * head, token), token ->
// window) equals integer division for every numerator below 2^31.
TEST(BaAttCuda, FastDivIsIntegerDivision) {
  using namespace sparsa::cuda::ba_att;
  const uint32_t top = 0x7fffffffu;
  std::vector<uint32_t> divisors = {1, 2, 3, 5, 7, 12, 64, 100, 128, 1000, 1023, 1025, 4096, 65535, 65536, 65537,
                                    131072, 1u << 30, (1u << 30) + 1, 3u << 29, top - 1, top};
  uint64_t state = 12345;
  auto next = [&]() {  // splitmix64
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int r = 0; r < 200; ++r) divisors.push_back(static_cast<uint32_t>(next() % top) + 1);
  for (int r = 0; r < 50; ++r) divisors.push_back(static_cast<uint32_t>(next() % 5000) + 1);
  for (uint32_t d : divisors) {
    const FastDiv f(d);
    std::vector<uint32_t> numerators = {0, 1, d - 1, d, top, top - 1, top - d + 1};
    if (d < top) numerators.push_back(d + 1);
    for (uint32_t k : {2u, 3u, 1000u, top / d, top / d - 1}) {
      const uint64_t m = static_cast<uint64_t>(k) * d;
      if (m <= top) numerators.push_back(static_cast<uint32_t>(m));
      if (m >= 1 && m - 1 <= top) numerators.push_back(static_cast<uint32_t>(m - 1));
      if (m + 1 <= top) numerators.push_back(static_cast<uint32_t>(m + 1));
    }
    for (int r = 0; r < 2000; ++r) numerators.push_back(static_cast<uint32_t>(next() % (uint64_t{top} + 1)));
    for (uint32_t n : numerators) ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
  }
  const FastDiv small(7);
  for (uint32_t n = 0; n < 1u << 20; ++n) ASSERT_EQ(small.div(n), n / 7) << n;
}

TEST(BaAttCuda, NormKeysSortAsNormSortWithinSegments) {
  using namespace sparsa::cuda::ba_att;
  // Two rows of 12 tokens, windows of 4: ties, zeros and a wide range of norms.
  const std::vector<float> norms = {2.0f, 0.0f, 2.0f, 1e-38f, 5.0f, 5.0f, 0.5f, 3e38f, 1.0f, 1.0f, 0.0f, 7.0f,
                                    9.0f, 8.0f, 7.0f, 6.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.25f, 4.0f, 0.25f, 1e-45f};
  const int64_t len = 12, window = 4, windows = 3;
  const int index_bits = bits_for(window);
  ASSERT_EQ(index_bits, 2);
  ASSERT_EQ(bits_for(1), 0);
  ASSERT_EQ(bits_for(5), 3);
  std::vector<uint64_t> keys(norms.size());
  for (size_t g = 0; g < norms.size(); ++g) {
    const int64_t row = g / len, i = g % len;
    keys[g] = norm_key(static_cast<uint64_t>(row * windows + i / window), norms[g], static_cast<uint32_t>(i % window),
                       index_bits);
  }
  // The keys are distinct (the index is in them), so any sort gives one order; the device sorts
  // only the bits above the index, stably: the same order, since tokens enter by index.
  std::vector<uint64_t> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
  std::vector<uint64_t> stable = keys;
  std::stable_sort(stable.begin(), stable.end(),
                   [&](uint64_t a, uint64_t b) { return (a >> index_bits) < (b >> index_bits); });
  EXPECT_EQ(stable, sorted);
  for (int64_t row = 0; row < 2; ++row) {
    std::vector<double> row_norms(norms.begin() + row * len, norms.begin() + (row + 1) * len);
    std::vector<int32_t> expected(len);
    norm_sort(row_norms.data(), len, window, expected.data());
    for (int64_t p = 0; p < len; ++p) {
      // perm_from_keys_kernel's rule: the window of position p, plus the index the key carries.
      const int64_t token = p / window * window + norm_key_index(sorted[row * len + p], index_bits);
      EXPECT_EQ(token, expected[p]) << row << " " << p;
    }
  }
  // The widest layout still fits 64 bits (segment_bits + index_bits <= 33 when bh * len < 2^31).
  const uint64_t top = norm_key((uint64_t{1} << 17) - 1, 3e38f, (1u << 16) - 1, 16);
  EXPECT_EQ(top >> 63, 1u);
  EXPECT_EQ(norm_key_index(top, 16), (1u << 16) - 1);
}

#if defined(SPARSA_WITH_CUDA)

namespace {

struct Case {
  std::string name;
  DType dtype = DType::bf16;
  int64_t batch = 1, heads_q = 2, heads_kv = 2, len_q = 300, len_kv = 300, head_dim = 64;
  int block_q = 64, block_kv = 64;
  bool sort_q = true, sort_k = true;
  int64_t window = 0;
  bool compensate = true;
  Compensation compensation = Compensation::diagonal;
  float beta = 1.0f;
  Budget budget = Budget::density(0.3);
  int64_t seq_pad = 0;  // extra elements between token rows (strided views)
  bool run_executor = true;
  bool simt_logits = false;  // true: the SIMT logits kernel even where the tensor-core one applies
  bool mma_sync_logits = false;  // true: the mma.sync tensor-core kernel instead of the wgmma one
  bool serial_sides = false;  // true: the key side's steps 1-3 after the query side's, on one stream
  uint32_t seed = 1;
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

// Host (f32 values of the dtype) and device copies of one [batch, heads, len, d] input, stored
// with c.seq_pad elements of padding after every token row.
struct Input {
  HostArray host;       // the dtype, padded layout
  Tensor host_view;     // strided view of host
  DeviceArray device;   // same bytes on the device
  Tensor device_view;
};

Input make_input(const Case& c, int64_t heads, int64_t len, uint32_t seed, float norm_sigma) {
  const int64_t d = c.head_dim, row = d + c.seq_pad;
  HostArray values = sparsa_test::heavy_tailed({c.batch, heads, len, d}, seed, norm_sigma);
  Input in;
  in.host = HostArray(c.dtype, {c.batch, heads, len, row});
  for (int64_t r = 0; r < c.batch * heads * len; ++r) {
    for (int64_t t = 0; t < d; ++t)
      detail::store_element(in.host.data(), c.dtype, r * row + t, values.ptr<float>()[r * d + t]);
  }
  in.host_view = in.host.view();
  in.host_view.shape[3] = d;
  auto dev = DeviceArray::allocate(c.dtype, {c.batch, heads, len, row}, {DeviceType::cuda, 0});
  EXPECT_TRUE(dev.ok()) << dev.status().to_string();
  in.device = std::move(dev).value();
  EXPECT_EQ(cudaMemcpy(in.device.data(), in.host.data(), in.host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  in.device_view = in.device.view();
  in.device_view.shape[3] = d;
  return in;
}

BaAttOptions options_of(const Case& c, Backend backend) {
  BaAttOptions o;
  o.block_q = c.block_q;
  o.block_kv = c.block_kv;
  o.sort_q = c.sort_q;
  o.sort_k = c.sort_k;
  o.sort_window = c.window;
  o.compensate = c.compensate;
  o.compensation = c.compensation;
  o.beta = c.beta;
  o.budget = c.budget;
  o.backend = backend;
  return o;
}

// f64 L2 norms of every token: [batch * heads * len].
std::vector<double> norms_of(const Tensor& x) {
  const int64_t B = x.shape[0], H = x.shape[1], L = x.shape[2], d = x.shape[3];
  std::vector<double> n(B * H * L);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        double s = 0;
        for (int64_t t = 0; t < d; ++t) {
          const double v = detail::load_element(x.data, x.dtype, x.offset({b, h, i, t}));
          s += v * v;
        }
        n[(b * H + h) * L + i] = std::sqrt(s);
      }
  return n;
}

double norm_tolerance(int64_t d, double norm) { return (d + 2) * std::ldexp(1.0, -24) * norm + 1e-30; }

// Checks step 1 for one input: device norms, the device permutation against norm_sort of those
// norms, and against the CPU's permutation as order statistics.
void check_sort(const char* name, const Case& c, const Input& x, const HostArray& device_perm,
                const HostArray& cpu_perm) {
  SCOPED_TRACE(name);
  const int64_t rows = x.host_view.shape[0] * x.host_view.shape[1], len = x.host_view.shape[2];
  HostArray device_norms;
  ASSERT_TRUE(ba_att_cuda::token_norms(x.device_view, &device_norms).ok());
  const std::vector<double> exact = norms_of(x.host_view);
  double max_tol = 0;
  for (int64_t i = 0; i < rows * len; ++i) {
    const double tol = norm_tolerance(c.head_dim, exact[i]);
    max_tol = std::max(max_tol, tol);
    ASSERT_NEAR(device_norms.ptr<float>()[i], exact[i], tol) << "token " << i;
  }
  std::vector<int32_t> expected(len);
  std::vector<double> row_norms(len);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < len; ++i) row_norms[i] = device_norms.ptr<float>()[r * len + i];
    norm_sort(row_norms.data(), len, c.window, expected.data());
    const int32_t* got = device_perm.ptr<int32_t>() + r * len;
    const int32_t* cpu = cpu_perm.ptr<int32_t>() + r * len;
    for (int64_t p = 0; p < len; ++p) {
      ASSERT_EQ(got[p], expected[p]) << "row " << r << " position " << p;
      ASSERT_LE(std::abs(exact[r * len + got[p]] - exact[r * len + cpu[p]]), 2 * max_tol)
          << "row " << r << " position " << p << ": device token " << got[p] << ", cpu token " << cpu[p];
    }
  }
}

// Bound M on the absolute terms of every logit, and the tolerance 2 (block + F) 2^-24 M.
struct LogitTolerance {
  std::vector<double> tol;  // [batch, heads_q, nq, nk]
};

// Per block: mean |x_t| and mean x_t^2 over the permuted tokens of the block (f64).
void abs_moments(const Tensor& x, const HostArray* perm, int64_t block, int64_t nb, std::vector<double>* mean_abs,
                 std::vector<double>* mean_sq) {
  const int64_t B = x.shape[0], H = x.shape[1], L = x.shape[2], d = x.shape[3];
  mean_abs->assign(B * H * nb * d, 0.0);
  mean_sq->assign(B * H * nb * d, 0.0);
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t begin = blk * block, end = std::min(begin + block, L);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t tok = perm ? perm->ptr<int32_t>()[bh * L + p] : p;
        for (int64_t t = 0; t < d; ++t) {
          const double v = detail::load_element(x.data, x.dtype, x.offset({bh / H, bh % H, tok, t}));
          (*mean_abs)[(bh * nb + blk) * d + t] += std::abs(v) / (end - begin);
          (*mean_sq)[(bh * nb + blk) * d + t] += v * v / (end - begin);
        }
      }
    }
}

LogitTolerance logit_tolerance(const Case& c, const Tensor& q, const Tensor& k, const HostArray* perm_q,
                               const HostArray* perm_kv, int64_t nq, int64_t nk) {
  const int64_t d = c.head_dim, group = c.heads_q / c.heads_kv;
  std::vector<double> qa, qs, ka, ks;
  abs_moments(q, perm_q, c.block_q, nq, &qa, &qs);
  abs_moments(k, perm_kv, c.block_kv, nk, &ka, &ks);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d)), c2 = std::abs(c.beta) * scale * scale;
  int64_t F = d;
  if (c.compensate) F = c.compensation == Compensation::diagonal ? 3 * d
                        : c.compensation == Compensation::trace  ? d + d * d
                                                                 : d + 2 * d * d;
  const double factor = 2.0 * (std::max(c.block_q, c.block_kv) + F) * std::ldexp(1.0, -24);
  LogitTolerance t;
  t.tol.resize(c.batch * c.heads_q * nq * nk);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h)
      for (int64_t qb = 0; qb < nq; ++qb)
        for (int64_t kb = 0; kb < nk; ++kb) {
          const double* A = &qa[((b * c.heads_q + h) * nq + qb) * d];
          const double* S = &qs[((b * c.heads_q + h) * nq + qb) * d];
          const double* Bv = &ka[((b * c.heads_kv + h / group) * nk + kb) * d];
          const double* T = &ks[((b * c.heads_kv + h / group) * nk + kb) * d];
          double plain = 0, diag = 0, sum_s = 0, sum_t = 0, sum_a2 = 0, sum_b2 = 0;
          for (int64_t u = 0; u < d; ++u) {
            plain += A[u] * Bv[u];
            diag += S[u] * Bv[u] * Bv[u] + T[u] * A[u] * A[u] + S[u] * T[u];
            sum_s += S[u];
            sum_t += T[u];
            sum_a2 += A[u] * A[u];
            sum_b2 += Bv[u] * Bv[u];
          }
          double m = scale * plain;
          if (c.compensate) {
            if (c.compensation == Compensation::diagonal) m += c2 * diag;
            else if (c.compensation == Compensation::trace) m += c2 * sum_s * sum_t;
            else m += c2 * (sum_b2 * sum_s + sum_a2 * sum_t + sum_s * sum_t);
          }
          t.tol[((b * c.heads_q + h) * nq + qb) * nk + kb] = factor * m + 1e-30;
        }
  return t;
}

// cpu_ref's logits of the blocks formed by the given permutations.
HostArray reference_logits(const Case& c, const Tensor& q, const Tensor& k, const HostArray* perm_q,
                           const HostArray* perm_kv, int64_t nq, int64_t nk) {
  detail::BaAttParams p;
  p.q = q;
  p.k = k;
  p.batch = c.batch;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.len_q = c.len_q;
  p.len_kv = c.len_kv;
  p.head_dim = c.head_dim;
  p.block_q = c.block_q;
  p.block_kv = c.block_kv;
  p.num_q_blocks = nq;
  p.num_kv_blocks = nk;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  p.compensate = c.compensate;
  p.compensation = c.compensation;
  p.beta = c.beta;
  p.perm_q = perm_q ? perm_q->ptr<int32_t>() : nullptr;
  p.perm_kv = perm_kv ? perm_kv->ptr<int32_t>() : nullptr;
  HostArray logits(DType::f32, {c.batch, c.heads_q, nq, nk});
  p.logits = logits.ptr<float>();
  EXPECT_TRUE(ba_att_cpu_ref::scores(p).ok());
  return logits;
}

std::vector<int32_t> row_of(const BlockIndexBuffer& plan, int64_t row) {
  const int64_t cap = plan.indices.shape()[3];
  const int32_t* ix = plan.indices.ptr<int32_t>() + row * cap;
  return {ix, ix + plan.counts.ptr<int32_t>()[row]};
}

// The budget on one row of f32 logits, as the CPU path applies it.
std::vector<int32_t> cpu_select(const float* logits, int64_t nk, const Budget& budget) {
  std::vector<double> key(nk), weight(nk);
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < nk; ++j) max_logit = std::max(max_logit, key[j] = logits[j]);
  for (int64_t j = 0; j < nk; ++j) weight[j] = std::exp(key[j] - max_logit);
  std::vector<int32_t> out(nk);
  out.resize(select_blocks(key.data(), weight.data(), nullptr, nk, budget, out.data()));
  return out;
}

// Mass budget on a row: is `count` the smallest prefix (descending logits, ties to the lower
// index) reaching tau, up to 1e-12 relative in the cumulative sums?
bool mass_count_acceptable(const float* logits, int64_t nk, double tau, int64_t count) {
  std::vector<int32_t> order(nk);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const double max_logit = logits[order[0]];
  std::vector<double> cum(nk + 1, 0.0);
  for (int64_t p = 0; p < nk; ++p) cum[p + 1] = cum[p] + std::exp(static_cast<double>(logits[order[p]]) - max_logit);
  const double required = tau * cum[nk], slack = 1e-12 * cum[nk];
  if (count < 1 || count > nk) return false;
  const bool reaches = cum[count] >= required - slack || count == nk;
  const bool minimal = count == 1 || cum[count - 1] < required + slack;
  return reaches && minimal;
}

class BaAttCudaCase : public ::testing::TestWithParam<Case> {};

TEST_P(BaAttCudaCase, MatchesTheCpuPath) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  const Input q = make_input(c, c.heads_q, c.len_q, c.seed, 0.6f);
  const Input k = make_input(c, c.heads_kv, c.len_kv, c.seed + 100, 0.6f);
  const int64_t nq = (c.len_q + c.block_q - 1) / c.block_q, nk = (c.len_kv + c.block_kv - 1) / c.block_kv;

  struct LogitsSwitch {  // the case's logits kernel, restored however the test ends
    bool saved = ba_att_cuda::set_tensor_core_logits(true);
    ~LogitsSwitch() { ba_att_cuda::set_tensor_core_logits(saved); }
  } logits_switch;
  ba_att_cuda::set_tensor_core_logits(!c.simt_logits);
  struct WgmmaSwitch {
    bool saved = ba_att_cuda::set_wgmma_logits(true);
    ~WgmmaSwitch() { ba_att_cuda::set_wgmma_logits(saved); }
  } wgmma_switch;
  ba_att_cuda::set_wgmma_logits(!c.mma_sync_logits);
  struct SidesSwitch {  // the case's stream layout, restored however the test ends
    bool saved = ba_att_cuda::set_concurrent_sides(true);
    ~SidesSwitch() { ba_att_cuda::set_concurrent_sides(saved); }
  } sides_switch;
  ba_att_cuda::set_concurrent_sides(!c.serial_sides);

  // The device's steps 1-3 and the CPU's (cpu_ref: f64 norms, its own permutations).
  auto dev = ba_att_scores(q.device_view, k.device_view, options_of(c, Backend::cuda));
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  // The tensor-core (3xTF32) logits wherever F % 4 == 0 (d % 4 == 0 for every kind) unless the
  // case asks for the SIMT kernel, on wgmma unless it asks for mma.sync; all are held to the same
  // f32 bound below.
  EXPECT_EQ(ba_att_cuda::last_logits_used_tensor_cores(), !c.simt_logits && c.head_dim % 4 == 0)
      << "logits kernel";
  EXPECT_EQ(ba_att_cuda::last_logits_used_wgmma(), !c.simt_logits && !c.mma_sync_logits && c.head_dim % 4 == 0)
      << "wgmma logits kernel";
  EXPECT_EQ(ba_att_cuda::last_selection_concurrent(), !c.serial_sides) << "the key side on its own stream";
  auto cpu = ba_att_scores(q.host_view, k.host_view, options_of(c, Backend::cpu_ref));
  ASSERT_TRUE(cpu.ok()) << cpu.status().to_string();
  ASSERT_EQ(dev->num_q_blocks, nq);
  ASSERT_EQ(dev->num_kv_blocks, nk);
  ASSERT_EQ(dev->perm_q.empty(), !c.sort_q);
  ASSERT_EQ(dev->perm_kv.empty(), !c.sort_k);
  if (c.sort_q) check_sort("q", c, q, dev->perm_q, cpu->perm_q);
  if (c.sort_k) check_sort("k", c, k, dev->perm_kv, cpu->perm_kv);
  if (HasFatalFailure()) return;

  // Logits of the device's blocks against cpu_ref on the same blocks.
  const HostArray* pq = c.sort_q ? &dev->perm_q : nullptr;
  const HostArray* pk = c.sort_k ? &dev->perm_kv : nullptr;
  const HostArray ref = reference_logits(c, q.host_view, k.host_view, pq, pk, nq, nk);
  const LogitTolerance tol = logit_tolerance(c, q.host_view, k.host_view, pq, pk, nq, nk);
  for (int64_t i = 0; i < ref.numel(); ++i)
    ASSERT_NEAR(dev->logits.ptr<float>()[i], ref.ptr<float>()[i], tol.tol[i]) << "logit " << i;

  // The plan: device arrays, the same permutations, the budget exactly as select_blocks on the
  // device's logits (fixed budgets) or up to 1e-12 in the cumulative mass.
  auto plan = ba_att_plan(q.device_view, k.device_view, options_of(c, Backend::cuda));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_TRUE(plan->on_device());
  auto host = plan->to_host();
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  const BlockIndexBuffer& hp = host.value();
  ASSERT_TRUE(validate_block_index(hp.view(), c.batch, c.heads_q, c.heads_kv, c.len_q, c.len_kv).ok());
  if (c.sort_q) {
    ASSERT_EQ(0, std::memcmp(hp.perm_q.data(), dev->perm_q.data(), dev->perm_q.nbytes()));
  } else {
    ASSERT_TRUE(hp.perm_q.empty());
  }
  if (c.sort_k) {
    ASSERT_EQ(0, std::memcmp(hp.perm_kv.data(), dev->perm_kv.data(), dev->perm_kv.nbytes()));
  } else {
    ASSERT_TRUE(hp.perm_kv.empty());
  }
  auto cpu_plan = ba_att_plan(q.host_view, k.host_view, options_of(c, Backend::cpu_ref));
  ASSERT_TRUE(cpu_plan.ok());
  const bool mass = c.budget.kind == BudgetKind::mass;
  for (int64_t r = 0; r < c.batch * c.heads_q * nq; ++r) {
    const float* dl = dev->logits.ptr<float>() + r * nk;
    const std::vector<int32_t> got = row_of(hp, r);
    if (!mass) {
      ASSERT_EQ(got, cpu_select(dl, nk, c.budget)) << "row " << r;
      ASSERT_EQ(got.size(), row_of(*cpu_plan, r).size()) << "row " << r;
    } else {
      ASSERT_TRUE(mass_count_acceptable(dl, nk, c.budget.value, static_cast<int64_t>(got.size()))) << "row " << r;
    }
    // Against the reference logits: no dropped block beats a kept one by more than 2 tol.
    std::vector<char> kept(nk, 0);
    for (int32_t j : got) kept[j] = 1;
    double worst_kept = std::numeric_limits<double>::infinity(), best_dropped = -worst_kept, cut_tol = 0;
    for (int64_t j = 0; j < nk; ++j) {
      const double l = ref.ptr<float>()[r * nk + j];
      if (kept[j]) worst_kept = std::min(worst_kept, l);
      else best_dropped = std::max(best_dropped, l);
      cut_tol = std::max(cut_tol, tol.tol[r * nk + j]);
    }
    ASSERT_GE(worst_kept, best_dropped - 2 * cut_tol) << "row " << r;
  }

  // Plan + executor (bf16/f16 only): O against cpu_ref attention under the device's plan.
  if (!c.run_executor || c.dtype == DType::f32) return;
  Input v = make_input(c, c.heads_kv, c.len_kv, c.seed + 200, 0.3f);
  auto out = ba_att(q.device_view, k.device_view, v.device_view, options_of(c, Backend::cuda));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  AttentionOptions ref_opt;
  ref_opt.backend = Backend::cpu_ref;
  auto expected = block_sparse(q.host_view, k.host_view, v.host_view, hp.view(), ref_opt);
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();
  // The executor rounds probabilities and the output to the dtype (unit roundoff u); the relative
  // L2 error of O is a few u (test_cuda_attention.cpp bounds it tightly); 4u here only catches
  // a wrongly wired plan (permutations, device arrays), whose error is O(1).
  const double u = c.dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  double num = 0, den = 0, lse_err = 0;
  const int64_t n_out = out->out.numel();
  for (int64_t i = 0; i < n_out; ++i) {
    const double a = detail::load_element(out->out.data(), c.dtype, i);
    const double b = detail::load_element(expected->out.data(), c.dtype, i);
    num += (a - b) * (a - b);
    den += b * b;
  }
  for (int64_t i = 0; i < out->lse.numel(); ++i) {
    const double a = out->lse.ptr<float>()[i], b = expected->lse.ptr<float>()[i];
    lse_err = std::max(lse_err, std::abs(a - b) / (1 + std::abs(b)));
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 4 * u);
  EXPECT_LE(lse_err, 2e-4);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](std::string name, auto&& edit) {
    Case c;
    c.name = std::move(name);
    edit(c);
    c.seed = static_cast<uint32_t>(v.size() * 7 + 1);
    v.push_back(c);
  };
  add("len1", [](Case& c) { c.len_q = c.len_kv = 1; });
  add("len17", [](Case& c) { c.len_q = c.len_kv = 17; c.budget = Budget::top_kappa(1); });
  add("len300_b64_density", [](Case& c) {});
  add("len300_b128_gqa4_2", [](Case& c) { c.heads_q = 4; c.block_q = c.block_kv = 128; });
  add("len1000_b128_d128", [](Case& c) {
    c.len_q = c.len_kv = 1000; c.block_q = c.block_kv = 128; c.head_dim = 128; c.budget = Budget::density(0.5);
  });
  add("len1000_b64_heads3_topk", [](Case& c) {
    c.len_q = 1000; c.len_kv = 777; c.heads_q = c.heads_kv = 3; c.budget = Budget::top_kappa(4);
  });
  add("gqa3_1_mixed_blocks", [](Case& c) { c.heads_q = 3; c.heads_kv = 1; c.block_q = 64; c.block_kv = 128; });
  add("window256", [](Case& c) { c.len_q = c.len_kv = 1000; c.window = 256; });
  add("window128_b128", [](Case& c) { c.len_q = c.len_kv = 1000; c.window = 128; c.block_q = c.block_kv = 128; });
  add("mass0.9", [](Case& c) { c.len_q = c.len_kv = 1000; c.budget = Budget::mass(0.9); });
  add("mass1", [](Case& c) { c.budget = Budget::mass(1.0); });
  add("topk_over_nk", [](Case& c) { c.budget = Budget::top_kappa(100); });
  add("no_compensation", [](Case& c) { c.compensate = false; });
  add("beta_half", [](Case& c) { c.beta = 0.5f; });
  add("trace", [](Case& c) { c.compensation = Compensation::trace; c.len_q = c.len_kv = 200; });
  add("exact", [](Case& c) { c.compensation = Compensation::exact; c.len_q = c.len_kv = 200; c.heads_q = 4; });
  add("no_sort", [](Case& c) { c.sort_q = c.sort_k = false; });
  add("sort_k_only", [](Case& c) { c.sort_q = false; });
  add("f16", [](Case& c) { c.dtype = DType::f16; c.head_dim = 128; c.block_q = c.block_kv = 128; c.len_q = 700; });
  add("f32_plan_only", [](Case& c) { c.dtype = DType::f32; });
  add("strided_batch2", [](Case& c) { c.batch = 2; c.seq_pad = 8; c.len_kv = 513; });
  // Rows not 16-byte aligned: the scalar paths of the norm and statistics kernels.
  add("unaligned_rows", [](Case& c) { c.seq_pad = 3; c.len_q = 333; c.heads_q = 4; });
  // d % 4 != 0: the scalar norm path and the 64x64 SIMT logits kernel (F % 4 != 0); the wgmma one
  // takes every other case unless a case switches it off.
  add("d6_f_not_multiple_of_4", [](Case& c) { c.head_dim = 6; c.len_q = 200; c.len_kv = 333; c.run_executor = false; });
  // Many key blocks per row. A fixed budget up to 8192 blocks: one CTA per row (select_top_kernel);
  // a mass budget of 5000 blocks: the row sorted in >48 KiB of shared memory (select_kernel<false>,
  // the opt-in limit); 10000 blocks: the global-memory fallback of the row sort (select_kernel<true>),
  // for a mass and for a fixed budget.
  add("nk5000_top_cta", [](Case& c) {
    c.len_q = 64; c.len_kv = 5000; c.block_kv = 1; c.budget = Budget::density(0.1); c.heads_q = c.heads_kv = 1;
  });
  add("nk5000_shared", [](Case& c) {
    c.len_q = 64; c.len_kv = 5000; c.block_kv = 1; c.budget = Budget::mass(0.8); c.heads_q = c.heads_kv = 1;
  });
  add("nk10000_global", [](Case& c) {
    c.len_q = 130; c.len_kv = 10000; c.block_kv = 1; c.budget = Budget::mass(0.8); c.heads_q = c.heads_kv = 1;
  });
  add("nk10000_global_density", [](Case& c) {
    c.len_q = 130; c.len_kv = 10000; c.block_kv = 1; c.budget = Budget::density(0.05); c.heads_q = c.heads_kv = 1;
  });
  // Every lane count of the vector norm kernel (16-byte chunks per token: d * sizeof(T) / 16):
  // 1 (d 8), 2 (d 16), 4 (d 32), 8 with 3 idle lanes (d 40: 5 chunks), 32 (d 256), and 32 lanes
  // over 64 chunks (d 512: two chunks per lane); f32 d 4 (1 chunk of 4 floats). The same shapes
  // take the block statistics kernel with 256, 128, 64, 51 (of 5 chunks: 255 of 256 threads), 8
  // and 4 row groups.
  add("d8_lanes1", [](Case& c) { c.head_dim = 8; c.len_q = 333; c.len_kv = 300; c.run_executor = false; });
  add("d16_lanes2", [](Case& c) { c.head_dim = 16; c.len_q = 300; c.len_kv = 333; c.run_executor = false; });
  add("d32_lanes4", [](Case& c) { c.head_dim = 32; c.len_q = 333; c.run_executor = false; });
  add("d40_5chunks", [](Case& c) { c.head_dim = 40; c.len_q = 333; c.len_kv = 200; c.run_executor = false; });
  add("d256_lanes32", [](Case& c) { c.head_dim = 256; c.len_q = 300; c.run_executor = false; });
  add("d512_two_chunks_per_lane", [](Case& c) {
    c.head_dim = 512; c.len_q = c.len_kv = 200; c.compensate = false; c.run_executor = false;
  });
  add("f32_d4", [](Case& c) { c.dtype = DType::f32; c.head_dim = 4; c.len_q = 333; });
  // Blocks of more than 256 tokens: every thread of block_stats_kernel prefetches two
  // permutation entries (n_max 512 here, 64 KiB of bf16 rows per stage).
  add("b512_two_perm_regs", [](Case& c) {
    c.len_q = c.len_kv = 1500; c.block_q = c.block_kv = 512; c.budget = Budget::top_kappa(2); c.run_executor = false;
  });
  // More (batch * head, block) items than CTAs in block_stats_kernel's wave (f32 d 128 blocks of
  // 128: 64 KiB per stage, one CTA per SM), so each CTA walks several items through both
  // stages; the 1-token key blocks of nk5000 / nk10000 do the same with n = 1.
  add("f32_d128_many_items", [](Case& c) {
    c.dtype = DType::f32; c.head_dim = 128; c.len_q = c.len_kv = 20000; c.block_q = c.block_kv = 128;
    c.budget = Budget::density(0.1);
  });
  // 10000 query-block rows: more than the warps of select_top_warp_kernel's grid (132 SMs x 16
  // CTAs x 4 warps = 8448 on an H200), so warps take a second row; 1-token query blocks also give
  // block_stats_kernel 10000 items.
  add("nq10000_warp_rows", [](Case& c) {
    c.len_q = 10000; c.block_q = 1; c.len_kv = 300; c.heads_q = c.heads_kv = 1; c.budget = Budget::top_kappa(2);
    c.run_executor = false;
  });
  // The SIMT 128x128 logits kernel, which the tensor-core kernel replaced where F % 4 == 0: kept
  // reachable (set_tensor_core_logits(false)) and held to the same bound.
  add("simt_logits_len1000_b128_d128", [](Case& c) {
    c.len_q = c.len_kv = 1000; c.block_q = c.block_kv = 128; c.head_dim = 128; c.simt_logits = true;
  });
  add("simt_logits_exact_gqa2", [](Case& c) {
    c.compensation = Compensation::exact; c.len_q = c.len_kv = 200; c.heads_q = 4; c.simt_logits = true;
  });
  // Both sides on one stream (K reusing Q's sort buffers), as before the side stream: a sorted
  // case, a windowed one, one with K unsorted, and the large-F exact kind.
  add("serial_sides_len1000_b128_d128", [](Case& c) {
    c.len_q = c.len_kv = 1000; c.block_q = c.block_kv = 128; c.head_dim = 128; c.serial_sides = true;
  });
  add("serial_sides_window256_gqa4_2", [](Case& c) {
    c.len_q = c.len_kv = 1000; c.window = 256; c.heads_q = 4; c.serial_sides = true;
  });
  add("serial_sides_sort_q_only", [](Case& c) { c.sort_k = false; c.serial_sides = true; });
  add("serial_sides_exact", [](Case& c) {
    c.compensation = Compensation::exact; c.len_q = c.len_kv = 200; c.serial_sides = true;
  });
  // The tensor-core kernel (wgmma, the default) over several 128-block tiles in both directions
  // with an odd nk (the scalar stores) and a large F (the exact kind: F = d + 2 d^2, 8256 at d 64).
  add("tc_logits_nq300_nk301_exact", [](Case& c) {
    c.len_q = 300 * 16; c.len_kv = 301 * 16; c.block_q = c.block_kv = 16; c.heads_q = c.heads_kv = 1;
    c.compensation = Compensation::exact; c.budget = Budget::top_kappa(7); c.run_executor = false;
  });
  // The wgmma kernel where F is not a multiple of its 32-float K chunk (the plain kind: F = d;
  // F = 4 is one chunk of zeros but four columns, F = 36 a full chunk and a nearly empty one; the
  // diagonal kind at d 36: F = 108), partial tiles in both directions (nq, nk not multiples of
  // 128, nk odd and even: the scalar and the 8-byte stores), and GQA (query head h reads kv head
  // h / group).
  add("wgmma_logits_plain_d4_nq300_nk301", [](Case& c) {
    c.dtype = DType::f32; c.head_dim = 4; c.compensate = false; c.len_q = 300 * 16; c.len_kv = 301 * 16;
    c.block_q = c.block_kv = 16; c.heads_q = c.heads_kv = 1; c.budget = Budget::top_kappa(7); c.run_executor = false;
  });
  add("wgmma_logits_plain_d36_gqa4_2", [](Case& c) {
    c.head_dim = 36; c.compensate = false; c.len_q = 300 * 16; c.len_kv = 301 * 16; c.block_q = c.block_kv = 16;
    c.heads_q = 4; c.heads_kv = 2; c.budget = Budget::density(0.2); c.run_executor = false;
  });
  add("wgmma_logits_diagonal_d36_gqa3_1_nk130", [](Case& c) {
    c.head_dim = 36; c.len_q = 129 * 16; c.len_kv = 130 * 16; c.block_q = c.block_kv = 16; c.heads_q = 3;
    c.heads_kv = 1; c.budget = Budget::top_kappa(5); c.run_executor = false;
  });
  // The mma.sync tensor-core kernel, which the wgmma one replaced: kept reachable
  // (set_wgmma_logits(false)) and held to the same bound, on the same awkward shapes.
  add("mma_sync_logits_nq300_nk301_exact", [](Case& c) {
    c.len_q = 300 * 16; c.len_kv = 301 * 16; c.block_q = c.block_kv = 16; c.heads_q = c.heads_kv = 1;
    c.compensation = Compensation::exact; c.budget = Budget::top_kappa(7); c.run_executor = false;
    c.mma_sync_logits = true;
  });
  add("mma_sync_logits_plain_d36_gqa4_2", [](Case& c) {
    c.head_dim = 36; c.compensate = false; c.len_q = 300 * 16; c.len_kv = 301 * 16; c.block_q = c.block_kv = 16;
    c.heads_q = 4; c.heads_kv = 2; c.budget = Budget::density(0.2); c.run_executor = false; c.mma_sync_logits = true;
  });
  add("mma_sync_logits_len1000_b128_d128", [](Case& c) {
    c.len_q = c.len_kv = 1000; c.block_q = c.block_kv = 128; c.head_dim = 128; c.mma_sync_logits = true;
  });
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, BaAttCudaCase, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n = info.param.name;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

// mask_aware on the device: every row of the device plan is select_visible_blocks (the CPU's rule)
// applied to the device's own logits under the same mask: hidden key blocks out, the diagonal
// ones (each query's last visible key) forced, the budget over the visible ones; exactly for
// fixed budgets, and for mass up to 1e-12 of the cumulative mass at the cut (the device sums in
// another order). Then ba_att on the device under the mask matches cpu_ref's masked block-sparse
// attention over the device plan, and every query that sees a key keeps one (no empty row).
TEST(BaAttCuda, MaskAwarePlansFollowTheCpuRule) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  struct Shape {
    int64_t len_q, len_kv;
    int block_q, block_kv;
  };
  const Shape shapes[] = {{300, 300, 64, 64}, {200, 520, 64, 32}, {520, 200, 16, 64}, {1000, 1000, 128, 128}};
  const Mask masks[] = {Mask::causal(), Mask::block_causal(16), Mask::block_causal(100), Mask::sliding_window(100, 0),
                        Mask::sliding_window(60)};
  const Budget budgets[] = {Budget::density(0.3), Budget::top_kappa(2), Budget::mass(0.9), Budget::density(1.0)};
  uint32_t seed = 900;
  for (const Shape& sh : shapes) {
    for (const Mask& mask : masks) {
      for (const Budget& budget : budgets) {
        SCOPED_TRACE(std::to_string(sh.len_q) + "x" + std::to_string(sh.len_kv) + " blocks " +
                     std::to_string(sh.block_q) + "x" + std::to_string(sh.block_kv) + " " + mask_string(mask) + " " +
                     describe(budget));
        Case c;
        c.len_q = sh.len_q, c.len_kv = sh.len_kv, c.block_q = sh.block_q, c.block_kv = sh.block_kv;
        c.sort_q = c.sort_k = false;
        c.compensate = budget.kind != BudgetKind::top_kappa;  // both, across the budgets
        c.budget = budget;
        c.heads_q = 4, c.heads_kv = 2;
        const Input q = make_input(c, c.heads_q, c.len_q, seed++, 0.6f);
        const Input k = make_input(c, c.heads_kv, c.len_kv, seed++, 0.6f);
        BaAttOptions o = options_of(c, Backend::cuda);
        o.mask = mask;
        o.mask_aware = true;
        auto dev = ba_att_scores(q.device_view, k.device_view, o);
        ASSERT_TRUE(dev.ok()) << dev.status().to_string();
        auto plan = ba_att_plan(q.device_view, k.device_view, o);
        ASSERT_TRUE(plan.ok()) << plan.status().to_string();
        auto host = plan->to_host();
        ASSERT_TRUE(host.ok());
        const int64_t nq = dev->num_q_blocks, nk = dev->num_kv_blocks;
        std::vector<BlockVisibility> vis(nk);
        for (int64_t r = 0; r < c.batch * c.heads_q * nq; ++r) {
          const int64_t qb = r % nq;
          mask_block_visibility(mask, qb, c.block_q, c.block_kv, c.len_q, c.len_kv, vis.data());
          const float* l = dev->logits.ptr<float>() + r * nk;
          std::vector<double> key(nk), weight(nk);
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < nk; ++j) {
            key[j] = l[j];
            if (vis[j] != BlockVisibility::hidden) mx = std::max(mx, key[j]);
          }
          for (int64_t j = 0; j < nk; ++j) weight[j] = std::exp(key[j] - mx);
          std::vector<int32_t> want(nk);
          want.resize(select_visible_blocks(key.data(), weight.data(), nullptr, vis.data(), nk, budget, want.data()));
          const std::vector<int32_t> got = row_of(*host, r);
          if (budget.kind != BudgetKind::mass || got == want) {
            ASSERT_EQ(got, want) << "row " << r;
            continue;
          }
          // Mass: the visit order (forced by index, then visible by descending logit); the device's
          // count must reach tau within the slack and be minimal, and keep that order's prefix.
          std::vector<int32_t> order;
          for (int64_t j = 0; j < nk; ++j)
            if (vis[j] == BlockVisibility::diagonal) order.push_back(static_cast<int32_t>(j));
          const size_t forced = order.size();
          for (int64_t j = 0; j < nk; ++j)
            if (vis[j] == BlockVisibility::visible) order.push_back(static_cast<int32_t>(j));
          std::stable_sort(order.begin() + forced, order.end(), [&](int32_t a, int32_t b) { return key[a] > key[b]; });
          std::vector<double> cum(order.size() + 1, 0.0);
          for (size_t p = 0; p < order.size(); ++p) cum[p + 1] = cum[p] + weight[order[p]];
          const double required = budget.value * cum.back(), slack = 1e-12 * cum.back();
          const size_t n = got.size();
          ASSERT_GE(n, std::max<size_t>(forced, 1)) << "row " << r;
          ASSERT_TRUE(cum[n] >= required - slack || n == order.size()) << "row " << r;
          ASSERT_TRUE(n == std::max<size_t>(forced, 1) || cum[n - 1] < required + slack) << "row " << r;
          std::vector<int32_t> prefix(order.begin(), order.begin() + n);
          std::sort(prefix.begin(), prefix.end());
          ASSERT_EQ(got, prefix) << "row " << r;
        }
        // The masked executor over the device plan, against cpu_ref under the same mask.
        const Input v = make_input(c, c.heads_kv, c.len_kv, seed++, 0.3f);
        auto out = ba_att(q.device_view, k.device_view, v.device_view, o);
        ASSERT_TRUE(out.ok()) << out.status().to_string();
        AttentionOptions ref_opt;
        ref_opt.backend = Backend::cpu_ref;
        ref_opt.mask = mask;
        auto expected = block_sparse(q.host_view, k.host_view, v.host_view, host->view(), ref_opt);
        ASSERT_TRUE(expected.ok()) << expected.status().to_string();
        const double u = std::ldexp(1.0, -8);
        double num = 0, den = 0;
        int64_t empty = 0;
        for (int64_t i = 0; i < out->out.numel(); ++i) {
          const double a = detail::load_element(out->out.data(), c.dtype, i);
          const double b = detail::load_element(expected->out.data(), c.dtype, i);
          num += (a - b) * (a - b);
          den += b * b;
        }
        for (int64_t i = 0; i < out->lse.numel(); ++i) {
          const int64_t row = i % c.len_q;
          const bool sees = mask_key_begin(mask, row, c.len_q, c.len_kv) < mask_key_end(mask, row, c.len_q, c.len_kv);
          empty += sees && std::isinf(out->lse.ptr<float>()[i]);
        }
        EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 4 * u);
        EXPECT_EQ(empty, 0) << "queries that see a key lost every key";
      }
    }
  }
}

// Ties: identical tokens have identical norms (ties must keep the original order) and identical
// blocks have identical logits (ties must go to the lower key block), exactly as on the CPU.
TEST(BaAttCuda, TiesFollowTheCpuOrder) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Case c;
  c.len_q = c.len_kv = 256;
  c.block_q = c.block_kv = 32;
  c.budget = Budget::top_kappa(3);
  HostArray host(DType::bf16, {1, 2, 256, 64});
  for (int64_t r = 0; r < 2 * 256; ++r)
    for (int64_t t = 0; t < 64; ++t)  // four distinct token values, repeated
      detail::store_element(host.data(), DType::bf16, r * 64 + t, ((r % 4) + 1) * ((t % 3) - 1) * 0.25f);
  auto dev = DeviceArray::allocate(DType::bf16, {1, 2, 256, 64}, {DeviceType::cuda, 0});
  ASSERT_TRUE(dev.ok());
  ASSERT_EQ(cudaMemcpy(dev->data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  auto gpu = ba_att_plan(dev->view(), dev->view(), options_of(c, Backend::cuda));
  auto cpu = ba_att_plan(host.view(), host.view(), options_of(c, Backend::cpu_ref));
  ASSERT_TRUE(gpu.ok()) << gpu.status().to_string();
  ASSERT_TRUE(cpu.ok());
  auto h = gpu->to_host();
  ASSERT_TRUE(h.ok());
  // Exact f32 arithmetic here (sums of a few multiples of 1/16): the plans are identical.
  EXPECT_EQ(0, std::memcmp(h->perm_q.data(), cpu->perm_q.data(), cpu->perm_q.nbytes()));
  EXPECT_EQ(0, std::memcmp(h->perm_kv.data(), cpu->perm_kv.data(), cpu->perm_kv.nbytes()));
  for (int64_t r = 0; r < 2 * 8; ++r) EXPECT_EQ(row_of(*h, r), row_of(*cpu, r)) << "row " << r;
}

TEST(BaAttCuda, NonFiniteInputsAreRefused) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Case c;
  c.len_q = c.len_kv = 100;
  Input q = make_input(c, 2, 100, 5, 0.5f);
  const Input k = make_input(c, 2, 100, 6, 0.5f);
  const uint16_t nan_bits = float_to_bf16(std::nanf(""));
  // token [0, 1, 37] of q gets a NaN
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(q.device.data()) + ((1 * 100 + 37) * 64 + 5) * 2, &nan_bits, 2,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  auto plan = ba_att_plan(q.device_view, k.device_view, options_of(c, Backend::cuda));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::non_finite);
  EXPECT_NE(plan.status().message().find("q: token [0, 1, 37] has a NaN/Inf norm"), std::string::npos)
      << plan.status().to_string();
  c.sort_q = false;  // no norm to catch it: the logit check must
  plan = ba_att_plan(q.device_view, k.device_view, options_of(c, Backend::cuda));
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("ba_att: block logit [0, 1, 0, "), std::string::npos)
      << plan.status().to_string();
  // The device error word outlives a call: after an error it must be reset (the next call sees
  // clean inputs as clean), and a clean read-back lets the call after skip the reset, which must
  // not let a new error through unseen.
  c.sort_q = true;
  const Input clean = make_input(c, 2, 100, 7, 0.5f);
  for (int round = 0; round < 2; ++round) {
    plan = ba_att_plan(clean.device_view, k.device_view, options_of(c, Backend::cuda));
    ASSERT_TRUE(plan.ok()) << "round " << round << ": " << plan.status().to_string();
  }
  plan = ba_att_plan(k.device_view, q.device_view, options_of(c, Backend::cuda));
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("k: token [0, 1, 37] has a NaN/Inf norm"), std::string::npos)
      << plan.status().to_string();
}

// A NaN in one key block makes that logit column non-finite in every query row of its head; each
// logits kernel must report the lowest flat index, row 0 of that column. Column 201 sits in the
// second 128-wide tile at an odd position: with nk = 300 the tensor-core kernels store it as the
// second half of an 8-byte pair whose first half is finite, with nk = 301 through the scalar stores.
TEST(BaAttCuda, NonFiniteLogitIsFoundByEveryLogitsKernel) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  struct Restore {  // the default kernels, however the test ends
    bool tc = ba_att_cuda::set_tensor_core_logits(true);
    bool wgmma = ba_att_cuda::set_wgmma_logits(true);
    ~Restore() {
      ba_att_cuda::set_tensor_core_logits(tc);
      ba_att_cuda::set_wgmma_logits(wgmma);
    }
  } restore;
  for (const int64_t nk : {300, 301}) {
    Case c;
    c.len_q = 300;
    c.len_kv = nk * 16;
    c.block_q = c.block_kv = 16;
    c.sort_q = c.sort_k = false;  // no norm to catch it: the logit check must
    const Input q = make_input(c, 2, c.len_q, 11, 0.5f);
    Input k = make_input(c, 2, c.len_kv, 12, 0.5f);
    const uint16_t nan_bits = float_to_bf16(std::nanf(""));
    const int64_t token = 201 * 16 + 5;  // in key block 201 of head 1
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(k.device.data()) + ((1 * c.len_kv + token) * 64 + 3) * 2, &nan_bits, 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    for (int kernel = 0; kernel < 3; ++kernel) {  // wgmma, mma.sync, SIMT 128x128
      ba_att_cuda::set_tensor_core_logits(kernel < 2);
      ba_att_cuda::set_wgmma_logits(kernel == 0);
      auto plan = ba_att_plan(q.device_view, k.device_view, options_of(c, Backend::cuda));
      ASSERT_FALSE(plan.ok()) << "nk " << nk << ", kernel " << kernel;
      EXPECT_EQ(ba_att_cuda::last_logits_used_tensor_cores(), kernel < 2) << "kernel " << kernel;
      EXPECT_EQ(ba_att_cuda::last_logits_used_wgmma(), kernel == 0) << "kernel " << kernel;
      EXPECT_EQ(plan.status().code(), StatusCode::non_finite);
      EXPECT_NE(plan.status().message().find("ba_att: block logit [0, 1, 0, 201]"), std::string::npos)
          << "nk " << nk << ", kernel " << kernel << ": " << plan.status().to_string();
    }
  }
}

// The logits switches return the previous setting (the tests and the benchmark restore through it).
TEST(BaAttCuda, LogitsSwitchesReturnThePreviousSetting) {
  const bool tc = ba_att_cuda::set_tensor_core_logits(false);
  EXPECT_FALSE(ba_att_cuda::set_tensor_core_logits(tc));
  const bool wgmma = ba_att_cuda::set_wgmma_logits(false);
  EXPECT_FALSE(ba_att_cuda::set_wgmma_logits(true));
  EXPECT_TRUE(ba_att_cuda::set_wgmma_logits(wgmma));
}

TEST(BaAttCuda, HostPointerLabelledCudaIsRefused) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  HostArray q(DType::bf16, {1, 1, 16, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};
  BaAttOptions o;
  o.backend = Backend::cuda;
  auto plan = ba_att_plan(qd, qd, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("q: expected memory of cuda:0"), std::string::npos)
      << plan.status().to_string();
}

TEST(BaAttCuda, CheckFiniteIsUnsupported) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  auto dev = DeviceArray::allocate(DType::bf16, {1, 1, 16, 64}, {DeviceType::cuda, 0}, true);
  ASSERT_TRUE(dev.ok());
  BaAttOptions o;
  o.backend = Backend::cuda;
  o.check_finite = true;
  auto plan = ba_att_plan(dev->view(), dev->view(), o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::unsupported);
  EXPECT_NE(plan.status().message().find("check_finite:"), std::string::npos);
}

// Plans live in DeviceArrays from a stream-ordered pool: a released array's memory comes back to
// the next allocation, so zero_fill must still give zeros after the old contents were written, a
// plan must outlive the arrays released around it, and releasing 2 GiB of arrays over and over
// must not exhaust the device.
TEST(BaAttCuda, DeviceArraysReuseReleasedMemory) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Device cuda0{DeviceType::cuda, 0};
  constexpr int64_t n = 1 << 20;
  for (int round = 0; round < 3; ++round) {
    auto dirty = DeviceArray::allocate(DType::i32, {n}, cuda0);
    ASSERT_TRUE(dirty.ok());
    ASSERT_EQ(cudaMemset(dirty->data(), 0xab, n * 4), cudaSuccess);
    *dirty = DeviceArray();  // released: its memory is the pool's next candidate
    auto clean = DeviceArray::allocate(DType::i32, {n}, cuda0, true);
    ASSERT_TRUE(clean.ok());
    auto host = clean->to_host();
    ASSERT_TRUE(host.ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(host->ptr<int32_t>()[i], 0) << "round " << round << " element " << i;
  }
  for (int round = 0; round < 40; ++round) {
    auto big = DeviceArray::allocate(DType::f32, {int64_t{1} << 29}, cuda0);  // 2 GiB
    ASSERT_TRUE(big.ok()) << "round " << round << ": " << big.status().to_string();
  }
  Case c;
  c.len_q = c.len_kv = 256;
  const Input q = make_input(c, c.heads_q, c.len_q, 3, 0.6f);
  const Input k = make_input(c, c.heads_kv, c.len_kv, 4, 0.6f);
  auto first = ba_att_plan(q.device_view, k.device_view, options_of(c, Backend::cuda));
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto first_host = first->to_host();
  ASSERT_TRUE(first_host.ok());
  for (int round = 0; round < 3; ++round) {  // the next plans reuse released scratch, not the live plan
    auto again = ba_att_plan(q.device_view, k.device_view, options_of(c, Backend::cuda));
    ASSERT_TRUE(again.ok());
  }
  auto first_again = first->to_host();
  ASSERT_TRUE(first_again.ok());
  EXPECT_EQ(0, std::memcmp(first_again->indices.data(), first_host->indices.data(), first_host->indices.nbytes()));
  EXPECT_EQ(0, std::memcmp(first_again->perm_q.data(), first_host->perm_q.data(), first_host->perm_q.nbytes()));
}

}  // namespace

#endif  // SPARSA_WITH_CUDA
