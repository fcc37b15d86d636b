// LLSA backward: the f64 reference against central finite differences, and the fast
// CPU path against the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "llsa_test_util.h"
#include "methods/llsa/internal.h"
#include "sparsa/llsa.h"

using namespace sparsa;
using llsa_test::randn;

namespace {

std::vector<double> to_vec(const HostArray& a) {
  return std::vector<double>(a.ptr<float>(), a.ptr<float>() + a.numel());
}

// loss = sum(G * O) for the fixed plan (selection is not differentiated).
double loss(const llsa_detail::RefShape& shape, const LlsaPlan& plan, const std::vector<double>& q,
            const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>& g) {
  std::vector<double> out(q.size()), lse(q.size() / shape.head_dim);
  llsa_detail::ref_forward(shape, plan, q.data(), k.data(), v.data(), out.data(), lse.data());
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += g[i] * out[i];
  return s;
}

}  // namespace

TEST(LlsaGrad, ReferenceMatchesCentralDifferencesInF64) {
  // Batch 2, GQA 2:1, N = 37 with B = 3 (partial blocks at every level: 37 -> 13 -> 5),
  // K = 2, L = 2, d = 5. Every element of dq, dk, dv is checked.
  // Central differences with h = 1e-5 in f64: truncation h^2 * f''' ~ 1e-10 and
  // round-off 1e-16 / h ~ 1e-11, so 1e-6 relative to the largest gradient is a
  // margin of ~1e4 over the expected error, and far below any real mistake (a
  // missing pooled path or a wrong 1/count moves gradients by O(1e-2) or more).
  const int64_t batch = 2, hq = 2, hkv = 1, n = 37, d = 5;
  auto qf = randn({batch, hq, n, d}, 101), kf = randn({batch, hkv, n, d}, 102), vf = randn({batch, hkv, n, d}, 103);
  for (bool dedupe : {false, true}) {
    LlsaOptions o;
    o.block = 3;
    o.topk = 2;
    o.levels = 2;
    o.dedupe = dedupe;
    auto plan = llsa_plan(qf.view(), kf.view(), o);
    ASSERT_TRUE(plan.ok());
    const llsa_detail::RefShape shape{batch, hq, hkv, n, d, 1.0 / std::sqrt(double(d))};
    auto q = to_vec(qf), k = to_vec(kf), v = to_vec(vf);
    std::vector<double> g(q.size());
    std::mt19937 rng(7);
    std::normal_distribution<double> nd;
    for (double& x : g) x = nd(rng);

    std::vector<double> out(q.size()), lse(q.size() / d), dq(q.size()), dk(k.size()), dv(v.size());
    llsa_detail::ref_forward(shape, *plan, q.data(), k.data(), v.data(), out.data(), lse.data());
    llsa_detail::ref_backward(shape, *plan, q.data(), k.data(), v.data(), out.data(), lse.data(), g.data(), dq.data(),
                              dk.data(), dv.data());
    const double h = 1e-5;
    for (auto [name, x, grad] : {std::tuple{"dq", &q, &dq}, std::tuple{"dk", &k, &dk}, std::tuple{"dv", &v, &dv}}) {
      double max_grad = 0.0, max_err = 0.0;
      for (size_t i = 0; i < x->size(); ++i) {
        const double saved = (*x)[i];
        (*x)[i] = saved + h;
        const double up = loss(shape, *plan, q, k, v, g);
        (*x)[i] = saved - h;
        const double down = loss(shape, *plan, q, k, v, g);
        (*x)[i] = saved;
        const double fd = (up - down) / (2 * h);
        ASSERT_TRUE(std::isfinite((*grad)[i])) << name << "[" << i << "]";
        max_grad = std::max(max_grad, std::abs(fd));
        max_err = std::max(max_err, std::abs(fd - (*grad)[i]));
      }
      EXPECT_GT(max_grad, 1e-3) << name;
      EXPECT_LT(max_err / max_grad, 1e-6) << name << " dedupe " << dedupe << ": max error " << max_err
                                          << " max gradient " << max_grad;
    }
  }
}

TEST(LlsaGrad, PooledPathCarriesGradient) {
  // A key that no query block picks finely still gets a gradient, through the pooled
  // tokens above it (enrichment); with enrichment off it gets none.
  const int64_t n = 64, d = 4;
  auto q = randn({1, 1, n, d}, 5), k = randn({1, 1, n, d}, 6), v = randn({1, 1, n, d}, 7), g = randn({1, 1, n, d}, 8);
  for (bool enrich : {true, false}) {
    LlsaOptions o;
    o.block = 4;
    o.topk = 1;
    o.levels = 2;
    o.enrich = enrich;
    o.backend = Backend::cpu_ref;
    auto plan = llsa_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    std::vector<bool> picked(n / 4, false);
    for (int64_t qb = 0; qb < n / 4; ++qb) picked[plan->pick(1, 0, 0, qb, 0)] = true;
    int64_t unpicked = -1;
    for (int64_t kb = 0; kb < n / 4; ++kb)
      if (!picked[kb]) unpicked = kb;
    ASSERT_GE(unpicked, 0);
    AttentionOutput fwd;
    fwd.out = HostArray(DType::f32, {1, 1, n, d});
    fwd.lse = HostArray(DType::f32, {1, 1, n});
    ASSERT_TRUE(llsa_forward(q.view(), k.view(), v.view(), *plan, fwd.out.view(), fwd.lse.view(), o).ok());
    HostArray dq(DType::f32, {1, 1, n, d}), dk(DType::f32, {1, 1, n, d}), dv(DType::f32, {1, 1, n, d});
    ASSERT_TRUE(llsa_backward(q.view(), k.view(), v.view(), *plan, fwd.out.view(), fwd.lse.view(), g.view(), dq.view(),
                              dk.view(), dv.view(), o)
                    .ok());
    double mag = 0.0;
    for (int64_t t = unpicked * 4 * d; t < (unpicked + 1) * 4 * d; ++t) mag += std::abs(dv.ptr<float>()[t]);
    if (enrich) EXPECT_GT(mag, 1e-4);
    else EXPECT_EQ(mag, 0.0);
  }
}

TEST(LlsaGrad, CpuMatchesReference) {
  // f32 fast path against the f64 reference (via the public API). Tolerance 1e-4
  // relative to the largest gradient: f32 sums over a few hundred keys, and for dK/dV
  // over all query blocks that visit a token (the coarsest tokens are visited by
  // every query), ~1e-6 relative per term.
  struct Case { int64_t n; int block, topk, levels; int64_t hq, hkv, d; bool dedupe; };
  for (const Case& c : {Case{113, 4, 3, -1, 2, 1, 16, false}, Case{1023, 8, 4, 2, 4, 2, 24, true},
                        Case{4113, 16, 8, -1, 1, 1, 64, false}, Case{300, 5, 2, 3, 1, 1, 33, true}}) {
    auto q = randn({2, c.hq, c.n, c.d}, 51), k = randn({2, c.hkv, c.n, c.d}, 52), v = randn({2, c.hkv, c.n, c.d}, 53);
    auto g = randn({2, c.hq, c.n, c.d}, 54);
    LlsaOptions o;
    o.block = c.block;
    o.topk = c.topk;
    o.levels = c.levels;
    o.dedupe = c.dedupe;
    auto plan = llsa_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    struct Grads { HostArray dq, dk, dv; };
    std::vector<Grads> grads;
    auto fwd = llsa_forward(q.view(), k.view(), v.view(), o);  // saved O, LSE from the fast path
    ASSERT_TRUE(fwd.ok());
    for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
      o.backend = backend;
      Grads gr{HostArray(DType::f32, q.shape()), HostArray(DType::f32, k.shape()), HostArray(DType::f32, k.shape())};
      Status s = llsa_backward(q.view(), k.view(), v.view(), *plan, fwd->out.view(), fwd->lse.view(), g.view(),
                               gr.dq.view(), gr.dk.view(), gr.dv.view(), o);
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_TRUE(llsa_test::all_finite(gr.dq) && llsa_test::all_finite(gr.dk) && llsa_test::all_finite(gr.dv));
      grads.push_back(std::move(gr));
    }
    for (auto [name, a, b] : {std::tuple{"dq", &grads[0].dq, &grads[1].dq}, std::tuple{"dk", &grads[0].dk, &grads[1].dk},
                              std::tuple{"dv", &grads[0].dv, &grads[1].dv}}) {
      const double scale = llsa_test::max_abs(*a);
      EXPECT_GT(scale, 0.0) << name;
      EXPECT_LT(llsa_test::max_abs_diff(*a, *b) / scale, 1e-4) << name << " n " << c.n;
    }
  }
}

TEST(LlsaGrad, AllocatingFormRebuildsThePlan) {
  auto q = randn({1, 2, 200, 8}, 61), k = randn({1, 2, 200, 8}, 62), v = randn({1, 2, 200, 8}, 63);
  auto g = randn({1, 2, 200, 8}, 64);
  LlsaOptions o;
  o.block = 4;
  o.topk = 2;
  auto plan = llsa_plan(q.view(), k.view(), o);
  auto fwd = llsa_forward(q.view(), k.view(), v.view(), o);
  ASSERT_TRUE(plan.ok() && fwd.ok());
  HostArray a[3] = {HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape())};
  HostArray b[3] = {HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape())};
  ASSERT_TRUE(llsa_backward(q.view(), k.view(), v.view(), *plan, fwd->out.view(), fwd->lse.view(), g.view(), a[0].view(),
                            a[1].view(), a[2].view(), o).ok());
  ASSERT_TRUE(llsa_backward(q.view(), k.view(), v.view(), fwd->out.view(), fwd->lse.view(), g.view(), b[0].view(),
                            b[1].view(), b[2].view(), o).ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(llsa_test::max_abs_diff(a[i], b[i]), 0.0);
}

TEST(LlsaGrad, DeterministicForAThreadCountAndCloseAcrossThreadCounts) {
  auto q = randn({1, 3, 777, 16}, 71), k = randn({1, 3, 777, 16}, 72), v = randn({1, 3, 777, 16}, 73);
  auto g = randn({1, 3, 777, 16}, 74);
  LlsaOptions o;
  o.block = 8;
  o.topk = 4;
  auto fwd = llsa_forward(q.view(), k.view(), v.view(), o);
  ASSERT_TRUE(fwd.ok());
  auto grads = [&](int threads) {
    o.num_threads = threads;
    std::vector<HostArray> gr;
    for (int i = 0; i < 3; ++i) gr.emplace_back(DType::f32, q.shape());
    EXPECT_TRUE(llsa_backward(q.view(), k.view(), v.view(), fwd->out.view(), fwd->lse.view(), g.view(), gr[0].view(),
                              gr[1].view(), gr[2].view(), o)
                    .ok());
    return gr;
  };
  const auto a = grads(3), b = grads(3), c = grads(1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(llsa_test::max_abs_diff(a[i], b[i]), 0.0);
    // Other thread counts sum the same terms in another order: f32 rounding only.
    EXPECT_LT(llsa_test::max_abs_diff(a[i], c[i]) / llsa_test::max_abs(c[i]), 1e-5);
  }
}
