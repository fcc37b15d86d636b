// XAttention's cuda selector (Backend::cuda) against the CPU path on the same inputs.
//
// The device cases run where a CUDA device is visible (GTEST_SKIP elsewhere); the argument and
// availability contracts run everywhere.
//
// What is compared, and why not bit for bit:
//  - Masses. The reference is cpu_ref's (f64 antidiagonals, f64 softmax). The device forms each
//    antidiagonal score a = scale/S * sum of F = S d products in f32, one running sum: its error
//    is at most F 2^-24 scale/S sum_f |Qr_f Kr_f| <= F 2^-24 scale/S ||Qr_g|| ||Kr_c||
//    (Cauchy-Schwarz) =: delta_g for every key group c of query group g. A probability
//    exp(a - max) / sum then errs by at most 2 delta_g relative (its own logit and the
//    normaliser's), plus a few roundings (expf, the division: 8 units of 2^-24 together); a block
//    mass sums at most G * C of them (G query groups of the block, C key groups of a key block) in
//    f32, which adds G C 2^-24 relative. So |X_dev - X_ref| <= X_ref (2 max_g delta_g + (G C + 8)
//    2^-24) + 1e-12.
//  - Plans. Given the device's f32 masses the budget is exact: the device plan equals
//    select_blocks / select_visible_blocks (with XAttention's forced blocks) run on the device
//    masses copied back, for fixed budgets bit for bit. Mass budgets sum f64 weights in another
//    order (a tree, not a loop), so there the count may differ only where the cumulative mass sits
//    within 1e-12 relative of tau * total (checked as such).
//  - Output. xattention() on the device against cpu_ref's block-sparse executor over the device
//    plan under the same mask: relative Frobenius error within 4 units of bf16 (2^-8), as BA-Att's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/attention_params.h"
#include "core/backends.h"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "sparsa/xattention.h"
#include "test_util.h"

#if defined(SPARSA_WITH_CUDA)
#include <cuda_runtime.h>

#include "cuda_test_input.h"
#endif

using namespace sparsa;

namespace {

bool have_device() { return backend_available(Backend::cuda); }

XAttentionOptions cuda_options() {
  XAttentionOptions o;
  o.backend = Backend::cuda;
  o.block_q = o.block_kv = 32;
  o.stride = 4;
  return o;
}

}  // namespace

// ---- contracts that need no device ------------------------------------------------------------

TEST(XAttentionCuda, HostTensorsAreRefusedNamingTheArgument) {
  HostArray q(DType::bf16, {1, 2, 64, 64}), k(DType::bf16, {1, 2, 64, 64}), v(DType::bf16, {1, 2, 64, 64});
  const XAttentionOptions o = cuda_options();
  auto plan = xattention_plan(q.view(), k.view(), o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(plan.status().message().find("q: the cuda backend expected a tensor on a cuda device, got cpu"),
            std::string::npos)
      << plan.status().to_string();
  auto scores = xattention_scores(q.view(), k.view(), o);
  ASSERT_FALSE(scores.ok());
  EXPECT_NE(scores.status().message().find("q:"), std::string::npos) << scores.status().to_string();
  auto out = xattention(q.view(), k.view(), v.view(), o);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("q:"), std::string::npos) << out.status().to_string();
}

TEST(XAttentionCuda, KeyOnAnotherDeviceIsRefused) {
  HostArray q(DType::bf16, {1, 2, 64, 64}), k(DType::bf16, {1, 2, 64, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};  // only the label: placement is checked before any pointer is read
  auto plan = xattention_plan(qd, k.view(), cuda_options());
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("k: expected a tensor on cuda:0, got cpu"), std::string::npos)
      << plan.status().to_string();
}

TEST(XAttentionCuda, CheckFiniteIsUnsupported) {
  HostArray q(DType::bf16, {1, 1, 64, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};
  XAttentionOptions o = cuda_options();
  o.check_finite = true;
  auto plan = xattention_plan(qd, qd, o);
  ASSERT_FALSE(plan.ok());
  if (have_device()) {
    EXPECT_EQ(plan.status().code(), StatusCode::unsupported) << plan.status().to_string();
    EXPECT_NE(plan.status().message().find("check_finite"), std::string::npos) << plan.status().to_string();
  }
}

TEST(XAttentionCuda, WithoutADeviceTheBackendIsUnsupported) {
  if (have_device()) GTEST_SKIP() << "a CUDA device is present";
  HostArray q(DType::bf16, {1, 1, 64, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};
  auto plan = xattention_plan(qd, qd, cuda_options());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::unsupported) << plan.status().to_string();
}

TEST(XAttentionCuda, StrideStillDividesTheBlocks) {
  HostArray q(DType::bf16, {1, 1, 64, 64});
  Tensor qd = q.view();
  qd.device = {DeviceType::cuda, 0};
  XAttentionOptions o = cuda_options();
  o.stride = 5;
  auto plan = xattention_plan(qd, qd, o);
  ASSERT_FALSE(plan.ok());
  if (have_device()) {
    EXPECT_NE(plan.status().message().find("stride: expected a divisor of block_q"), std::string::npos)
        << plan.status().to_string();
  }
}

#if defined(SPARSA_WITH_CUDA)

namespace {

struct Case {
  std::string name;
  DType dtype = DType::bf16;
  int64_t batch = 1, heads_q = 2, heads_kv = 2, len_q = 300, len_kv = 300, head_dim = 64;
  int block_q = 64, block_kv = 64, stride = 8;
  Budget budget = Budget::mass(0.9);
  bool force_first = true, force_diagonal = true;
  Mask mask;
  bool mask_aware = false;
  int64_t seq_pad = 0;  // extra elements between token rows (strided views)
  float sigma = 1.0f;
  uint32_t seed = 1;
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

using Input = sparsa_test::DeviceInput;

Input make_input(const Case& c, int64_t heads, int64_t len, uint32_t seed, float sigma) {
  return sparsa_test::device_input(sparsa_test::randn({c.batch, heads, len, c.head_dim}, seed, sigma), c.dtype,
                                   c.seq_pad);
}

XAttentionOptions options_of(const Case& c, Backend backend) {
  XAttentionOptions o;
  o.block_q = c.block_q;
  o.block_kv = c.block_kv;
  o.stride = c.stride;
  o.budget = c.budget;
  o.force_first = c.force_first;
  o.force_diagonal = c.force_diagonal;
  o.mask = c.mask;
  o.mask_aware = c.mask_aware;
  o.backend = backend;
  return o;
}

std::vector<int32_t> row_of(const BlockIndexBuffer& plan, int64_t row) {
  const int64_t cap = plan.indices.shape()[3];
  const int32_t* ix = plan.indices.ptr<int32_t>() + row * cap;
  return {ix, ix + plan.counts.ptr<int32_t>()[row]};
}

// ||Qr_g|| per (batch, head_q, query group) and ||Kr_c|| per (batch, head_kv, key group), f64.
std::vector<double> group_norms(const Tensor& x, int64_t stride) {
  const int64_t B = x.shape[0], H = x.shape[1], L = x.shape[2], d = x.shape[3], G = (L + stride - 1) / stride;
  std::vector<double> n(B * H * G, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t t = 0; t < d; ++t) {
          const double v = detail::load_element(x.data, x.dtype, x.offset({b, h, i, t}));
          n[(b * H + h) * G + i / stride] += v * v;
        }
  for (double& v : n) v = std::sqrt(v);
  return n;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](Case c) {
    c.seed = static_cast<uint32_t>(out.size() * 7 + 1);
    out.push_back(c);
  };
  Case c;
  c.name = "len300_b64_s8_mass";
  add(c);
  c.name = "len300_b64_s8_density03";
  c.budget = Budget::density(0.3);
  add(c);
  c.name = "len300_b64_s8_kappa2_noforce";
  c.budget = Budget::top_kappa(2);
  c.force_first = c.force_diagonal = false;
  add(c);
  c = Case{};
  c.name = "gqa4_lq200_lk520_b32x64_s4_f16_mass95";  // len_q != len_kv: the end-aligned diagonal
  c.dtype = DType::f16;
  c.heads_q = 8, c.heads_kv = 2;
  c.len_q = 200, c.len_kv = 520;
  c.block_q = 32, c.block_kv = 64, c.stride = 4;
  c.budget = Budget::mass(0.95);
  add(c);
  c = Case{};
  c.name = "f32_d128_len1000_b128_s16_density05_batch2";  // (no executor: it takes bf16 / f16)
  c.dtype = DType::f32;
  c.batch = 2, c.head_dim = 128, c.len_q = c.len_kv = 1000;
  c.block_q = c.block_kv = 128, c.stride = 16;
  c.budget = Budget::density(0.5);
  add(c);
  c = Case{};
  c.name = "len17_b16_s1_unaligned";  // stride 1, a partial block, padded rows
  c.len_q = c.len_kv = 17, c.block_q = c.block_kv = 16, c.stride = 1;
  c.seq_pad = 3;
  add(c);
  c = Case{};
  c.name = "d36_len257_b16_s2_kappa3";  // head_dim not a multiple of the slice
  c.head_dim = 36, c.len_q = c.len_kv = 257, c.block_q = c.block_kv = 16, c.stride = 2;
  c.budget = Budget::top_kappa(3);
  add(c);
  c = Case{};
  c.name = "nk10000_b1_s1_kappa5";  // rows of 10000 key blocks: the select kernel's global sort
  c.heads_q = c.heads_kv = 1, c.len_q = 16, c.len_kv = 10000, c.block_q = 16, c.block_kv = 1, c.stride = 1;
  c.budget = Budget::top_kappa(5);
  add(c);
  c = Case{};
  c.name = "peaked_len512_b64_s8_mass09";  // large logits: masses near 0 and 1
  c.len_q = c.len_kv = 512, c.sigma = 3.0f;
  add(c);
  // The masks, seen by the selection (mask_aware) or not.
  const Mask masks[] = {Mask::causal(), Mask::block_causal(16), Mask::sliding_window(100, 0)};
  const char* names[] = {"causal", "block_causal16", "window100"};
  for (int m = 0; m < 3; ++m) {
    for (bool aware : {true, false}) {
      c = Case{};
      c.name = std::string(names[m]) + (aware ? "_aware" : "_blind") + "_len300_b32_s4_mass";
      c.len_q = c.len_kv = 300, c.block_q = c.block_kv = 32, c.stride = 4;
      c.mask = masks[m];
      c.mask_aware = aware;
      add(c);
    }
    c.name = std::string(names[m]) + "_aware_lq200_lk520_b64x32_s8_density03";
    c.len_q = 200, c.len_kv = 520, c.block_q = 64, c.block_kv = 32, c.stride = 8;
    c.mask_aware = true;
    c.budget = Budget::density(0.3);
    add(c);
  }
  return out;
}

class XAttentionCudaCase : public ::testing::TestWithParam<Case> {};

TEST_P(XAttentionCudaCase, MatchesTheCpuPath) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  const Input q = make_input(c, c.heads_q, c.len_q, c.seed, c.sigma);
  const Input k = make_input(c, c.heads_kv, c.len_kv, c.seed + 1000, c.sigma);
  const XAttentionOptions dev_opt = options_of(c, Backend::cuda);

  // Masses within the bound of the header.
  auto dev = xattention_scores(q.device_view, k.device_view, dev_opt);
  ASSERT_TRUE(dev.ok()) << dev.status().to_string();
  auto ref = xattention_scores(q.host_view, k.host_view, options_of(c, Backend::cpu_ref));
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  ASSERT_EQ(dev->shape(), ref->shape());
  const int64_t nq = ref->shape()[2], nk = ref->shape()[3], S = c.stride, F = S * c.head_dim;
  const int64_t qg = (c.len_q + S - 1) / S, kg = (c.len_kv + S - 1) / S, group = c.heads_q / c.heads_kv;
  const std::vector<double> qn = group_norms(q.host_view, S), kn = group_norms(k.host_view, S);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim)), u = std::ldexp(1.0, -24);
  const double G = static_cast<double>(c.block_q / S), C = static_cast<double>(c.block_kv / S);
  for (int64_t r = 0; r < c.batch * c.heads_q * nq; ++r) {
    const int64_t qb = r % nq, h = (r / nq) % c.heads_q, b = r / (nq * c.heads_q);
    double k_max = 0;
    for (int64_t g = 0; g < kg; ++g) k_max = std::max(k_max, kn[(b * c.heads_kv + h / group) * kg + g]);
    double delta = 0;
    for (int64_t g = qb * (c.block_q / S); g < std::min(qg, (qb + 1) * (c.block_q / S)); ++g)
      delta = std::max(delta, F * u * scale / S * qn[(b * c.heads_q + h) * qg + g] * k_max);
    for (int64_t kb = 0; kb < nk; ++kb) {
      const double want = ref->ptr<float>()[r * nk + kb], got = dev->ptr<float>()[r * nk + kb];
      ASSERT_NEAR(got, want, want * (2 * delta + (G * C + 8) * u) + 1e-12) << "row " << r << " block " << kb;
    }
  }

  // The plan: the CPU's budget on the device's masses.
  auto plan = xattention_plan(q.device_view, k.device_view, dev_opt);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_TRUE(plan->on_device());
  auto host = plan->to_host();
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  std::vector<BlockVisibility> vis(nk, BlockVisibility::visible);
  std::unique_ptr<bool[]> forced(new bool[nk]);
  for (int64_t r = 0; r < c.batch * c.heads_q * nq; ++r) {
    const int64_t qb = r % nq;
    if (c.mask_aware) mask_block_visibility(c.mask, qb, c.block_q, c.block_kv, c.len_q, c.len_kv, vis.data());
    std::fill(forced.get(), forced.get() + nk, false);
    if (c.force_first) forced[0] = true;
    const int64_t diagonal = qb + nk - nq;
    if (c.force_diagonal && diagonal >= 0 && diagonal < nk) forced[diagonal] = true;
    std::vector<double> mass(dev->ptr<float>() + r * nk, dev->ptr<float>() + (r + 1) * nk);
    std::vector<int32_t> want(nk);
    want.resize(c.mask_aware ? select_visible_blocks(mass.data(), mass.data(), forced.get(), vis.data(), nk, c.budget,
                                                     want.data())
                             : select_blocks(mass.data(), mass.data(), forced.get(), nk, c.budget, want.data()));
    const std::vector<int32_t> got = row_of(*host, r);
    if (c.budget.kind != BudgetKind::mass || got == want) {
      ASSERT_EQ(got, want) << "row " << r;
      continue;
    }
    // Mass: the visit order (forced by index, then the rest by descending mass); the device's count
    // must reach tau within the slack, be minimal, and keep that order's prefix.
    std::vector<int32_t> order;
    for (int64_t j = 0; j < nk; ++j)
      if (vis[j] != BlockVisibility::hidden && (forced[j] || vis[j] == BlockVisibility::diagonal))
        order.push_back(static_cast<int32_t>(j));
    const size_t n_forced = order.size();
    for (int64_t j = 0; j < nk; ++j)
      if (vis[j] == BlockVisibility::visible && !forced[j]) order.push_back(static_cast<int32_t>(j));
    std::stable_sort(order.begin() + n_forced, order.end(), [&](int32_t a, int32_t b) { return mass[a] > mass[b]; });
    std::vector<double> cum(order.size() + 1, 0.0);
    for (size_t p = 0; p < order.size(); ++p) cum[p + 1] = cum[p] + mass[order[p]];
    const double required = c.budget.value * cum.back(), slack = 1e-12 * cum.back();
    const size_t n = got.size();
    ASSERT_GE(n, n_forced) << "row " << r;
    ASSERT_TRUE(cum[n] >= required - slack || n == order.size()) << "row " << r;
    ASSERT_TRUE(n == n_forced || cum[n - 1] < required + slack) << "row " << r;
    std::vector<int32_t> prefix(order.begin(), order.begin() + n);
    std::sort(prefix.begin(), prefix.end());
    ASSERT_EQ(got, prefix) << "row " << r;
  }

  // The executor over the device plan (bf16 / f16, head_dim 64, 128 or 256: what the cuda executor
  // takes), against cpu_ref under the same mask.
  if (c.dtype == DType::f32 || (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256)) return;
  const Input v = make_input(c, c.heads_kv, c.len_kv, c.seed + 2000, 1.0f);
  auto out = xattention(q.device_view, k.device_view, v.device_view, dev_opt);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  AttentionOptions ref_opt;
  ref_opt.backend = Backend::cpu_ref;
  ref_opt.mask = c.mask;
  auto expected = block_sparse(q.host_view, k.host_view, v.host_view, host->view(), ref_opt);
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();
  double num = 0, den = 0;
  for (int64_t i = 0; i < out->out.numel(); ++i) {
    const double a = detail::load_element(out->out.data(), c.dtype, i);
    const double e = detail::load_element(expected->out.data(), c.dtype, i);
    num += (a - e) * (a - e);
    den += e * e;
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 4 * std::ldexp(1.0, -8));
}

INSTANTIATE_TEST_SUITE_P(Shapes, XAttentionCudaCase, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Identical tokens give identical masses: ties go to the lower key block, as on the CPU, and the
// f32 masses of this input are exact enough for the plans to be equal to the CPU's.
TEST(XAttentionCuda, TiesFollowTheCpuOrder) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  HostArray host(DType::bf16, {1, 2, 256, 64});
  for (int64_t r = 0; r < 2 * 256; ++r)
    for (int64_t t = 0; t < 64; ++t)  // one token value everywhere: every mass of a row is equal
      detail::store_element(host.data(), DType::bf16, r * 64 + t, ((t % 3) - 1) * 0.25f);
  auto dev = DeviceArray::allocate(DType::bf16, {1, 2, 256, 64}, {DeviceType::cuda, 0});
  ASSERT_TRUE(dev.ok());
  ASSERT_EQ(cudaMemcpy(dev->data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  XAttentionOptions o = cuda_options();
  o.budget = Budget::top_kappa(3);
  o.force_first = false;
  auto gpu = xattention_plan(dev->view(), dev->view(), o);
  o.backend = Backend::cpu_ref;
  auto cpu = xattention_plan(host.view(), host.view(), o);
  ASSERT_TRUE(gpu.ok()) << gpu.status().to_string();
  ASSERT_TRUE(cpu.ok());
  auto h = gpu->to_host();
  ASSERT_TRUE(h.ok());
  for (int64_t r = 0; r < 2 * 8; ++r) EXPECT_EQ(row_of(*h, r), row_of(*cpu, r)) << "row " << r;
}

TEST(XAttentionCuda, NonFiniteInputsAreRefused) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  HostArray host = sparsa_test::randn({1, 2, 128, 64}, 5);
  host.ptr<float>()[(1 * 128 + 70) * 64 + 3] = std::numeric_limits<float>::quiet_NaN();
  auto dev = DeviceArray::allocate(DType::f32, {1, 2, 128, 64}, {DeviceType::cuda, 0});
  ASSERT_TRUE(dev.ok());
  ASSERT_EQ(cudaMemcpy(dev->data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  auto clean = DeviceArray::allocate(DType::f32, {1, 2, 128, 64}, {DeviceType::cuda, 0}, true);
  ASSERT_TRUE(clean.ok());
  for (int which = 0; which < 2; ++which) {  // NaN in q, then in k
    const Tensor q = which == 0 ? dev->view() : clean->view(), k = which == 0 ? clean->view() : dev->view();
    auto plan = xattention_plan(q, k, cuda_options());
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::non_finite) << plan.status().to_string();
    EXPECT_NE(plan.status().message().find("xattention: block mass"), std::string::npos)
        << plan.status().to_string();
    // The next call on clean inputs is not affected.
    auto ok = xattention_plan(clean->view(), clean->view(), cuda_options());
    EXPECT_TRUE(ok.ok()) << ok.status().to_string();
  }
}

// On a stream of the caller's: the plan and the output come out ordered on it, equal to the
// default stream's.
TEST(XAttentionCuda, RunsOnTheCallersStream) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Case c;
  c.len_q = c.len_kv = 400;
  c.budget = Budget::density(0.4);
  const Input q = make_input(c, c.heads_q, c.len_q, 77, 1.0f);
  const Input k = make_input(c, c.heads_kv, c.len_kv, 78, 1.0f);
  const Input v = make_input(c, c.heads_kv, c.len_kv, 79, 1.0f);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  XAttentionOptions o = options_of(c, Backend::cuda);
  auto base = xattention(q.device_view, k.device_view, v.device_view, o);
  ASSERT_TRUE(base.ok()) << base.status().to_string();
  o.stream = stream;
  {  // the arrays allocated on `stream` go before it does (DeviceArray: the stream must outlive them)
    auto out = DeviceArray::allocate(c.dtype, {1, c.heads_q, c.len_q, c.head_dim}, {DeviceType::cuda, 0}, false,
                                     stream);
    auto lse = DeviceArray::allocate(DType::f32, {1, c.heads_q, c.len_q}, {DeviceType::cuda, 0}, false, stream);
    ASSERT_TRUE(out.ok() && lse.ok());
    const Status run = xattention(q.device_view, k.device_view, v.device_view, out->view(), lse->view(), o);
    ASSERT_TRUE(run.ok()) << run.to_string();
    auto host_out = out->to_host();
    ASSERT_TRUE(host_out.ok());
    EXPECT_EQ(0, std::memcmp(host_out->data(), base->out.data(), base->out.nbytes()));
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace

#endif  // SPARSA_WITH_CUDA
