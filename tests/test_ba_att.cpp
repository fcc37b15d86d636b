// BA-Att selector: budgets, sorting, compensation, GQA, errors, and cpu against cpu_ref.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "test_util.h"

using namespace sparsa;

namespace {

using sparsa_test::randn;
// Heavy-tailed token norms, so sorting matters.
HostArray heavy_tailed(std::vector<int64_t> shape, uint32_t seed) {
  return sparsa_test::heavy_tailed(std::move(shape), seed, 0.8f);
}

float at(const HostArray& a, std::initializer_list<int64_t> idx) {
  int64_t off = 0, d = 0;
  for (int64_t i : idx) off = off * a.shape()[d++] + i;
  return a.ptr<float>()[off];
}

// perm[0, h, p] of an i32 [1, heads, len] permutation.
int64_t at_perm(const HostArray& perm, int64_t h, int64_t p) { return perm.ptr<int32_t>()[h * perm.shape()[2] + p]; }

double max_abs_diff(const HostArray& a, const HostArray& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, (double)std::abs(a.ptr<float>()[i] - b.ptr<float>()[i]));
  return m;
}

std::vector<int32_t> row_of(const BlockIndexBuffer& plan, int64_t row) {
  const int64_t cap = plan.indices.shape()[3];
  const int32_t* ix = plan.indices.ptr<int32_t>() + row * cap;
  return {ix, ix + plan.counts.ptr<int32_t>()[row]};
}

BaAttOptions small_options() {
  BaAttOptions o;
  o.block_q = 16;
  o.block_kv = 8;
  return o;
}

}  // namespace

// Must-show 1a: with every block kept, ba_att is dense attention for any switches.
// (mass = 1 is not "every block" here: heavy-tailed norms make compensated logits span more
// than 745, so some blocks have exactly zero f64 softmax weight and are not needed.)
TEST(BaAtt, EveryBlockKeptEqualsDense) {
  HostArray q = heavy_tailed({2, 4, 77, 32}, 1), k = heavy_tailed({2, 2, 101, 32}, 2), v = randn({2, 2, 101, 32}, 3);
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    AttentionOptions dense_opt;
    dense_opt.backend = backend;
    auto ref = dense(q.view(), k.view(), v.view(), dense_opt);
    ASSERT_TRUE(ref.ok());
    for (int sq = 0; sq < 2; ++sq)
      for (int sk = 0; sk < 2; ++sk)
        for (int comp = 0; comp < 2; ++comp)
          for (int64_t window : {0, 32})
            for (Budget budget : {Budget::density(1.0), Budget::top_kappa(1000)}) {
              BaAttOptions o = small_options();
              o.sort_q = sq;
              o.sort_k = sk;
              o.compensate = comp;
              o.sort_window = window;
              o.budget = budget;
              o.backend = backend;
              auto out = ba_att(q.view(), k.view(), v.view(), o);
              ASSERT_TRUE(out.ok()) << out.status().to_string();
              // Same visited keys, different summation order: f64 (cpu_ref) / f32 online softmax (cpu).
              const double tol = backend == Backend::cpu_ref ? 1e-6 : 2e-5;
              EXPECT_LT(max_abs_diff(out->out, ref->out), tol) << sq << sk << comp << window << describe(budget);
              EXPECT_LT(max_abs_diff(out->lse, ref->lse), tol);
            }
  }
}

// Must-show 1b: top-kappa equals a brute-force sort of the block scores (ties: lower index).
TEST(BaAtt, TopKappaEqualsBruteForceSort) {
  HostArray q = heavy_tailed({1, 2, 150, 16}, 4), k = heavy_tailed({1, 2, 230, 16}, 5);
  for (int64_t kappa : {1, 3, 7, 29, 100}) {
    BaAttOptions o = small_options();
    o.budget = Budget::top_kappa(kappa);
    auto scores = ba_att_scores(q.view(), k.view(), o);
    auto plan = ba_att_plan(q.view(), k.view(), o);
    ASSERT_TRUE(scores.ok() && plan.ok());
    const int64_t nk = scores->num_kv_blocks, rows = scores->logits.numel() / nk;
    for (int64_t r = 0; r < rows; ++r) {
      const float* l = scores->logits.ptr<float>() + r * nk;
      std::vector<int32_t> order(nk);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] != l[b] ? l[a] > l[b] : a < b; });
      order.resize(std::min<int64_t>(kappa, nk));
      std::sort(order.begin(), order.end());
      EXPECT_EQ(row_of(*plan, r), order) << "kappa " << kappa << " row " << r;
    }
  }
}

// Density fraction -> kappa = ceil(fraction * num_kv_blocks), robust to 0.7 * 10 = 7.000000000000001.
TEST(BaAtt, DensityFractionGivesCeilKappa) {
  HostArray q = randn({1, 1, 16, 8}, 6), k = randn({1, 1, 80, 8}, 7);  // 10 key blocks of 8
  BaAttOptions o = small_options();
  for (auto [fraction, kappa] : std::vector<std::pair<double, int>>{{0.7, 7}, {0.3, 3}, {0.01, 1}, {0.55, 6}, {1.0, 10}}) {
    o.budget = Budget::density(fraction);
    auto plan = ba_att_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->counts.ptr<int32_t>()[0], kappa) << fraction;
  }
}

// Must-show 1c: the tau plan is the smallest set reaching tau of the softmax mass.
TEST(BaAtt, MassPlanIsSmallestSetReachingTau) {
  HostArray q = heavy_tailed({1, 2, 96, 16}, 8), k = heavy_tailed({1, 1, 200, 16}, 9);
  for (double tau : {0.3, 0.5, 0.9, 0.99}) {
    BaAttOptions o = small_options();
    o.budget = Budget::mass(tau);
    auto scores = ba_att_scores(q.view(), k.view(), o);
    auto plan = ba_att_plan(q.view(), k.view(), o);
    ASSERT_TRUE(scores.ok() && plan.ok());
    const int64_t nk = scores->num_kv_blocks, rows = scores->logits.numel() / nk;
    for (int64_t r = 0; r < rows; ++r) {
      const float* l = scores->logits.ptr<float>() + r * nk;
      const double mx = *std::max_element(l, l + nk);
      std::vector<double> p(nk);
      double z = 0;
      for (int64_t j = 0; j < nk; ++j) z += p[j] = std::exp(l[j] - mx);
      for (double& x : p) x /= z;
      const auto kept = row_of(*plan, r);
      double kept_mass = 0, smallest = 1;
      for (int32_t j : kept) {
        kept_mass += p[j];
        smallest = std::min(smallest, p[j]);
      }
      EXPECT_GE(kept_mass, tau - 1e-12) << "row " << r;
      // Any set of |kept| - 1 blocks holds at most kept_mass - smallest (kept is a top set).
      EXPECT_LT(kept_mass - smallest, tau + 1e-12) << "row " << r << " is not minimal";
      std::vector<double> sorted = p;
      std::sort(sorted.rbegin(), sorted.rend());
      EXPECT_NEAR(kept_mass, std::accumulate(sorted.begin(), sorted.begin() + kept.size(), 0.0), 1e-12);
    }
  }
}

// Must-show 1d: perm_q / perm_kv are permutations, sorted by norm, and outputs return in
// the original order: each original query row equals attention over the keys of its plan row.
TEST(BaAtt, PermutationsAndOriginalOrder) {
  const int64_t B = 1, Hq = 4, Hkv = 2, Lq = 53, Lk = 70, D = 16;
  HostArray q = heavy_tailed({B, Hq, Lq, D}, 10), k = heavy_tailed({B, Hkv, Lk, D}, 11), v = randn({B, Hkv, Lk, D}, 12);
  BaAttOptions o = small_options();
  o.budget = Budget::top_kappa(3);
  o.backend = Backend::cpu_ref;
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  ASSERT_FALSE(plan->perm_q.empty() || plan->perm_kv.empty());
  ASSERT_TRUE(validate_block_index(plan->view(), B, Hq, Hkv, Lq, Lk).ok());
  auto norm = [&](const HostArray& x, int64_t h, int64_t i) {
    double s = 0;
    for (int64_t t = 0; t < D; ++t) s += (double)at(x, {0, h, i, t}) * at(x, {0, h, i, t});
    return std::sqrt(s);
  };
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t p = 1; p < Lq; ++p)
      EXPECT_LE(norm(q, h, at_perm(plan->perm_q, h, p - 1)), norm(q, h, at_perm(plan->perm_q, h, p)));
  auto out = ba_att(q.view(), k.view(), v.view(), o);
  ASSERT_TRUE(out.ok());
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t h_kv = h / 2;
    for (int64_t p = 0; p < Lq; ++p) {
      const int64_t i = plan->perm_q.ptr<int32_t>()[h * Lq + p], qb = p / o.block_q;
      std::vector<int64_t> keys;
      for (int32_t kb : row_of(*plan, h * plan->num_q_blocks + qb))
        for (int64_t pk = kb * o.block_kv; pk < std::min<int64_t>((kb + 1) * o.block_kv, Lk); ++pk)
          keys.push_back(plan->perm_kv.ptr<int32_t>()[h_kv * Lk + pk]);
      std::vector<double> s;
      double mx = -1e300;
      for (int64_t j : keys) {
        double dot = 0;
        for (int64_t t = 0; t < D; ++t) dot += (double)at(q, {0, h, i, t}) * at(k, {0, h_kv, j, t});
        s.push_back(dot / std::sqrt((double)D));
        mx = std::max(mx, s.back());
      }
      double z = 0;
      for (double& x : s) z += x = std::exp(x - mx);
      for (int64_t t = 0; t < D; ++t) {
        double o_t = 0;
        for (size_t n = 0; n < keys.size(); ++n) o_t += s[n] / z * at(v, {0, h_kv, keys[n], t});
        EXPECT_NEAR(at(out->out, {0, h, i, t}), o_t, 1e-5) << "head " << h << " token " << i;
      }
    }
  }
}

// Must-show 1e: a windowed sort never moves a token out of its window, and sorts inside it.
TEST(BaAtt, WindowedSortNeverCrossesAWindow) {
  const int64_t L = 150, W = 32;  // last window partial (22 tokens)
  HostArray q = heavy_tailed({1, 2, L, 8}, 13), k = heavy_tailed({1, 1, L, 8}, 14);
  BaAttOptions o = small_options();
  o.sort_window = W;
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  for (const HostArray* perm : {&plan->perm_q, &plan->perm_kv}) {
    for (int64_t h = 0; h < perm->shape()[1]; ++h) {
      std::set<int64_t> seen;
      for (int64_t p = 0; p < L; ++p) {
        const int64_t t = at_perm(*perm, h, p);
        EXPECT_EQ(t / W, p / W) << "token " << t << " moved from window " << t / W << " to " << p / W;
        seen.insert(t);
      }
      EXPECT_EQ((int64_t)seen.size(), L);
    }
  }
  // Inside a window: ascending norms.
  for (int64_t p = 1; p < L; ++p) {
    if (p % W == 0) continue;
    auto norm = [&](int64_t i) {
      double s = 0;
      for (int64_t t = 0; t < 8; ++t) s += (double)at(k, {0, 0, i, t}) * at(k, {0, 0, i, t});
      return s;
    };
    EXPECT_LE(norm(at_perm(plan->perm_kv, 0, p - 1)), norm(at_perm(plan->perm_kv, 0, p)));
  }
}

// The sort is stable: tokens of equal norm keep their original order.
TEST(BaAtt, NormSortIsStable) {
  const std::vector<double> norms = {3, 1, 2, 1, 3, 0, 1};
  std::vector<int32_t> perm(norms.size());
  norm_sort(norms.data(), (int64_t)norms.size(), 0, perm.data());
  EXPECT_EQ(perm, (std::vector<int32_t>{5, 1, 3, 6, 2, 0, 4}));
  norm_sort(norms.data(), (int64_t)norms.size(), 4, perm.data());  // windows [0,4) and [4,7)
  EXPECT_EQ(perm, (std::vector<int32_t>{1, 3, 2, 0, 5, 6, 4}));
}

namespace {
// Blocks with exactly diagonal covariance: block tokens are mean +- a_t e_t (one token per
// sign and dimension), so every off-diagonal covariance entry is 0.
HostArray diagonal_covariance_blocks(int64_t blocks, int64_t d, uint32_t seed) {
  const int64_t block = 2 * d;
  HostArray x(DType::f32, {1, 1, blocks * block, d});
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (int64_t g = 0; g < blocks; ++g) {
    std::vector<float> mean(d), amp(d);
    for (auto& m : mean) m = nd(rng);
    for (auto& a : amp) a = std::abs(nd(rng)) + 0.1f;
    for (int64_t t = 0; t < d; ++t)
      for (int sign = 0; sign < 2; ++sign) {
        float* row = x.ptr<float>() + (g * block + 2 * t + sign) * d;
        for (int64_t u = 0; u < d; ++u) row[u] = mean[u];
        row[t] += sign ? amp[t] : -amp[t];
      }
  }
  return x;
}
}  // namespace

// Must-show 1f: Eq. 14 equals the exact (full-covariance) term on diagonal-covariance
// inputs; Eq. 13 as printed (trace) is its VarQ*VarK part only.
TEST(BaAtt, DiagonalCompensationEqualsExactOnDiagonalCovariance) {
  const int64_t d = 8;
  HostArray q = diagonal_covariance_blocks(5, d, 15), k = diagonal_covariance_blocks(7, d, 16);
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    BaAttOptions o;
    o.block_q = o.block_kv = 2 * d;
    o.sort_q = o.sort_k = false;
    o.backend = backend;
    o.compensation = Compensation::diagonal;
    auto diag = ba_att_scores(q.view(), k.view(), o);
    o.compensation = Compensation::exact;
    auto exact = ba_att_scores(q.view(), k.view(), o);
    o.compensation = Compensation::trace;
    auto trace = ba_att_scores(q.view(), k.view(), o);
    o.compensate = false;
    auto base = ba_att_scores(q.view(), k.view(), o);
    ASSERT_TRUE(diag.ok() && exact.ok() && trace.ok() && base.ok());
    // f32 logits of magnitude ~10: 1e-5 relative.
    for (int64_t i = 0; i < diag->logits.numel(); ++i) {
      const float dl = diag->logits.ptr<float>()[i], el = exact->logits.ptr<float>()[i];
      EXPECT_NEAR(dl, el, 1e-5 * (1 + std::abs(dl)));
    }
    // trace = scale^2 sum_t VarQ_t VarK_t on these inputs; VarQ_t = a_t^2 / d (2 of 2d tokens deviate).
    for (int64_t qb = 0; qb < 5; ++qb)
      for (int64_t kb = 0; kb < 7; ++kb) {
        double want = 0;
        for (int64_t t = 0; t < d; ++t) {
          const double aq = at(q, {0, 0, qb * 2 * d + 2 * t + 1, t}) - at(q, {0, 0, qb * 2 * d + 2 * t, t});
          const double ak = at(k, {0, 0, kb * 2 * d + 2 * t + 1, t}) - at(k, {0, 0, kb * 2 * d + 2 * t, t});
          want += (aq * aq / 4 / d) * (ak * ak / 4 / d);  // a = half the +- gap; Var = a^2 * 2/(2d)
        }
        want /= d;  // scale^2
        const int64_t cell = qb * 7 + kb;
        EXPECT_NEAR(trace->logits.ptr<float>()[cell] - base->logits.ptr<float>()[cell], want, 1e-5);
      }
  }
}

// The exact term is the variance of the block pair's token logits (what Eq. 14 estimates):
// checked against a brute-force variance over all (i, j) pairs on arbitrary inputs.
TEST(BaAtt, ExactCompensationIsTokenLogitVariance) {
  const int64_t d = 8, bq = 12, bk = 10;
  HostArray q = heavy_tailed({1, 1, 40, d}, 17), k = heavy_tailed({1, 1, 35, d}, 18);  // partial last blocks
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    BaAttOptions o;
    o.block_q = bq;
    o.block_kv = bk;
    o.sort_q = o.sort_k = false;
    o.backend = backend;
    o.compensation = Compensation::exact;
    auto exact = ba_att_scores(q.view(), k.view(), o);
    o.compensate = false;
    auto base = ba_att_scores(q.view(), k.view(), o);
    ASSERT_TRUE(exact.ok() && base.ok());
    for (int64_t qb = 0; qb < exact->num_q_blocks; ++qb)
      for (int64_t kb = 0; kb < exact->num_kv_blocks; ++kb) {
        std::vector<double> logits;
        for (int64_t i = qb * bq; i < std::min<int64_t>(40, (qb + 1) * bq); ++i)
          for (int64_t j = kb * bk; j < std::min<int64_t>(35, (kb + 1) * bk); ++j) {
            double dot = 0;
            for (int64_t t = 0; t < d; ++t) dot += (double)at(q, {0, 0, i, t}) * at(k, {0, 0, j, t});
            logits.push_back(dot / std::sqrt((double)d));
          }
        const double mean = std::accumulate(logits.begin(), logits.end(), 0.0) / logits.size();
        double var = 0;
        for (double l : logits) var += (l - mean) * (l - mean);
        var /= logits.size();
        const int64_t cell = qb * exact->num_kv_blocks + kb;
        EXPECT_NEAR(base->logits.ptr<float>()[cell], mean, 1e-5 * (1 + std::abs(mean)));  // Eq. 2 = mean token logit
        EXPECT_NEAR(exact->logits.ptr<float>()[cell] - base->logits.ptr<float>()[cell], var, 2e-5 * (1 + var));
      }
  }
}

// Must-show 1g: beta = 0 and no sorting is plain mean-pool top-k (computed here by hand).
TEST(BaAtt, BetaZeroNoSortIsMeanPoolTopK) {
  const int64_t Lq = 70, Lk = 90, d = 8, bq = 16, bk = 8;
  HostArray q = heavy_tailed({1, 1, Lq, d}, 19), k = heavy_tailed({1, 1, Lk, d}, 20);
  BaAttOptions o;
  o.block_q = bq;
  o.block_kv = bk;
  o.sort_q = o.sort_k = false;
  o.beta = 0.0f;
  o.budget = Budget::top_kappa(4);
  auto plan = ba_att_plan(q.view(), k.view(), o);
  o.compensate = false;
  o.beta = 1.0f;
  auto plan_off = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok() && plan_off.ok());
  EXPECT_TRUE(plan->perm_q.empty() && plan->perm_kv.empty());
  auto mean_of = [&](const HostArray& x, int64_t begin, int64_t end) {
    std::vector<double> m(d, 0);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < d; ++t) m[t] += at(x, {0, 0, i, t}) / double(end - begin);
    return m;
  };
  const int64_t nq = (Lq + bq - 1) / bq, nk = (Lk + bk - 1) / bk;
  for (int64_t qb = 0; qb < nq; ++qb) {
    const auto qm = mean_of(q, qb * bq, std::min(Lq, (qb + 1) * bq));
    std::vector<std::pair<double, int32_t>> s;
    for (int64_t kb = 0; kb < nk; ++kb) {
      const auto km = mean_of(k, kb * bk, std::min(Lk, (kb + 1) * bk));
      double dot = 0;
      for (int64_t t = 0; t < d; ++t) dot += qm[t] * km[t];
      s.push_back({-dot, (int32_t)kb});
    }
    std::sort(s.begin(), s.end());
    std::vector<int32_t> want;
    for (int i = 0; i < 4; ++i) want.push_back(s[i].second);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(row_of(*plan, qb), want) << "query block " << qb;
    EXPECT_EQ(row_of(*plan_off, qb), want) << "query block " << qb;
  }
}

// Must-show 1h: a query block that matches a distant key block selects it.
TEST(BaAtt, PlantedBlockIsSelected) {
  const int64_t L = 512, d = 32, B = 32;
  HostArray q = randn({1, 1, L, d}, 21, 0.5f), k = randn({1, 1, L, d}, 22, 0.5f);
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  std::vector<float> u(d);
  for (auto& x : u) x = nd(rng);
  const int64_t q_block = 2, k_block = 13;  // distant: 11 blocks apart
  for (int64_t i = 0; i < B; ++i)
    for (int64_t t = 0; t < d; ++t) {
      q.ptr<float>()[((q_block * B + i) * d) + t] += 1.5f * u[t];
      k.ptr<float>()[((k_block * B + i) * d) + t] += 1.5f * u[t];
    }
  BaAttOptions o;
  o.block_q = o.block_kv = B;
  o.budget = Budget::top_kappa(1);
  o.sort_q = o.sort_k = false;
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(row_of(*plan, q_block), std::vector<int32_t>{k_block});
  // Sorted: the planted tokens have the largest norms, so they form the last permuted block
  // on both sides, and that block must select its partner.
  o.sort_q = o.sort_k = true;
  auto sorted = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(sorted.ok());
  std::set<int64_t> last_q, last_k;
  for (int64_t p = L - B; p < L; ++p) {
    last_q.insert(at_perm(sorted->perm_q, 0, p) / B);
    last_k.insert(at_perm(sorted->perm_kv, 0, p) / B);
  }
  ASSERT_EQ(last_q, std::set<int64_t>{q_block});
  ASSERT_EQ(last_k, std::set<int64_t>{k_block});
  EXPECT_EQ(row_of(*sorted, L / B - 1), std::vector<int32_t>{(int32_t)(L / B - 1)});
}

// Must-show 1i: ties are deterministic (lower block index wins), on both backends.
TEST(BaAtt, TiesAreDeterministic) {
  HostArray q(DType::f32, {1, 2, 64, 8}), k(DType::f32, {1, 1, 96, 8});  // all zero: every logit ties
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    BaAttOptions o = small_options();
    o.backend = backend;
    o.budget = Budget::top_kappa(5);
    auto plan = ba_att_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    for (int64_t r = 0; r < 2 * 4; ++r) EXPECT_EQ(row_of(*plan, r), (std::vector<int32_t>{0, 1, 2, 3, 4}));
    for (int64_t p = 0; p < 96; ++p) EXPECT_EQ(at_perm(plan->perm_kv, 0, p), p);  // stable sort of equal norms
    o.budget = Budget::mass(0.5);  // 12 equal blocks: 6 needed, the first six
    auto mass = ba_att_plan(q.view(), k.view(), o);
    ASSERT_TRUE(mass.ok());
    EXPECT_EQ(row_of(*mass, 0), (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  }
}

// GQA: query head h scores the key blocks of kv head h / group, exactly as if K were repeated.
TEST(BaAtt, GqaMatchesRepeatedKv) {
  const int64_t Hq = 6, Hkv = 2, L = 80, d = 16;
  HostArray q = heavy_tailed({1, Hq, L, d}, 24), k = heavy_tailed({1, Hkv, L, d}, 25);
  HostArray k_rep(DType::f32, {1, Hq, L, d});
  for (int64_t h = 0; h < Hq; ++h)
    std::copy(k.ptr<float>() + (h / 3) * L * d, k.ptr<float>() + (h / 3 + 1) * L * d, k_rep.ptr<float>() + h * L * d);
  BaAttOptions o = small_options();
  o.budget = Budget::top_kappa(3);
  auto gqa = ba_att_plan(q.view(), k.view(), o);
  auto rep = ba_att_plan(q.view(), k_rep.view(), o);
  ASSERT_TRUE(gqa.ok() && rep.ok());
  EXPECT_EQ(gqa->perm_kv.shape(), (std::vector<int64_t>{1, Hkv, L}));
  for (int64_t r = 0; r < Hq * gqa->num_q_blocks; ++r) EXPECT_EQ(row_of(*gqa, r), row_of(*rep, r));
}

// The fast path against the specification: logits to f32 rounding, plans identical except
// where two ref logits are within that tolerance of the selection boundary.
TEST(BaAtt, CpuMatchesCpuRef) {
  struct Case { int64_t hq, hkv, lq, lk, d; int bq, bk; int64_t window; Compensation comp; DType dtype; };
  const std::vector<Case> cases = {
      {2, 1, 113, 131, 32, 16, 16, 0, Compensation::diagonal, DType::f32},
      {4, 2, 17, 203, 64, 8, 32, 32, Compensation::diagonal, DType::f32},
      {3, 3, 100, 100, 16, 32, 8, 0, Compensation::exact, DType::f32},
      {2, 1, 65, 77, 8, 4, 4, 8, Compensation::trace, DType::f32},
      {2, 2, 97, 50, 32, 16, 16, 0, Compensation::diagonal, DType::bf16},
  };
  for (const Case& c : cases) {
    HostArray qf = heavy_tailed({1, c.hq, c.lq, c.d}, 26), kf = heavy_tailed({1, c.hkv, c.lk, c.d}, 27);
    auto q = convert(qf.view(), c.dtype), k = convert(kf.view(), c.dtype);
    ASSERT_TRUE(q.ok() && k.ok());
    BaAttOptions o;
    o.block_q = c.bq;
    o.block_kv = c.bk;
    o.sort_window = c.window;
    o.compensation = c.comp;
    o.budget = Budget::top_kappa(3);
    o.backend = Backend::cpu_ref;
    auto ref = ba_att_scores(q->view(), k->view(), o);
    auto ref_plan = ba_att_plan(q->view(), k->view(), o);
    o.backend = Backend::cpu;
    o.num_threads = 2;
    auto fast = ba_att_scores(q->view(), k->view(), o);
    auto fast_plan = ba_att_plan(q->view(), k->view(), o);
    ASSERT_TRUE(ref.ok() && fast.ok() && ref_plan.ok() && fast_plan.ok()) << fast.status().to_string();
    ASSERT_EQ(ref->perm_q.numel(), fast->perm_q.numel());
    for (int64_t i = 0; i < ref->perm_q.numel(); ++i) ASSERT_EQ(ref->perm_q.ptr<int32_t>()[i], fast->perm_q.ptr<int32_t>()[i]);
    // f32 features and f32 accumulation over F <= d + 2 d^2 terms against f64: 1e-4 of the
    // logit magnitude plus the compensation scale.
    const int64_t nk = ref->num_kv_blocks;
    double max_logit = 0;
    for (int64_t i = 0; i < ref->logits.numel(); ++i) max_logit = std::max(max_logit, (double)std::abs(ref->logits.ptr<float>()[i]));
    const double tol = 1e-5 * (1 + max_logit) * (c.comp == Compensation::diagonal ? 1 : 10);
    for (int64_t i = 0; i < ref->logits.numel(); ++i)
      ASSERT_NEAR(ref->logits.ptr<float>()[i], fast->logits.ptr<float>()[i], tol) << "logit " << i;
    for (int64_t r = 0; r < ref->logits.numel() / nk; ++r) {
      const auto a = row_of(*ref_plan, r), b = row_of(*fast_plan, r);
      if (a == b) continue;
      // Allowed only at a near-tie: the 3rd and 4th ref logits within 2 tol.
      std::vector<float> l(ref->logits.ptr<float>() + r * nk, ref->logits.ptr<float>() + (r + 1) * nk);
      std::sort(l.rbegin(), l.rend());
      EXPECT_LT(l[2] - l[3], 2 * tol) << "row " << r << " differs without a near-tie";
    }
  }
}

// Must-show 1j: bad budgets, block sizes and inputs give clear errors naming the argument.
TEST(BaAtt, BadArgumentsGiveClearErrors) {
  HostArray q = randn({1, 2, 64, 8}, 28), k = randn({1, 1, 64, 8}, 29), k3 = randn({1, 3, 64, 8}, 30);
  auto expect_error = [&](BaAttOptions o, const std::string& needle, const Tensor* kk = nullptr) {
    auto plan = ba_att_plan(q.view(), kk ? *kk : k.view(), o);
    ASSERT_FALSE(plan.ok()) << needle;
    EXPECT_NE(plan.status().message().find(needle), std::string::npos) << plan.status().to_string();
  };
  BaAttOptions o;
  o.block_q = 0;
  expect_error(o, "block_q: expected a block size > 0");
  o = {};
  o.block_kv = -8;
  expect_error(o, "block_kv: expected a block size > 0");
  o = {};
  o.sort_window = 96;
  expect_error(o, "sort_window: expected a multiple of block_q");
  o = {};
  o.sort_window = -1;
  expect_error(o, "sort_window");
  for (Budget b : {Budget::top_kappa(0), Budget{BudgetKind::top_kappa, 2.5}, Budget::density(0.0), Budget::density(1.5),
                   Budget::density(std::nan("")), Budget::mass(0.0), Budget::mass(1.01)}) {
    o = {};
    o.budget = b;
    expect_error(o, "budget: ");
  }
  o = {};
  o.beta = std::nanf("");
  expect_error(o, "beta: expected a finite number");
  o = {};
  o.backend = Backend::cuda;
  expect_error(o, "q: the cuda backend expected a tensor on a cuda device, got cpu");
  o = {};
  o.scale = -1.0f;
  expect_error(o, "scale:");
  const Tensor bad_heads = k3.view();
  expect_error({}, "k: heads_q (2) must be a multiple of heads_kv (3)", &bad_heads);
  HostArray q3 = randn({2, 64, 8}, 31);
  auto plan = ba_att_plan(q3.view(), k.view());
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("q: expected 4 dimensions"), std::string::npos);
}

// NaN in the input never becomes a plan.
TEST(BaAtt, NonFiniteInputIsRefused) {
  HostArray q = randn({1, 1, 64, 8}, 32), k = randn({1, 1, 64, 8}, 33);
  q.ptr<float>()[77] = std::nanf("");
  for (bool sort : {true, false}) {
    BaAttOptions o;
    o.sort_q = o.sort_k = sort;
    auto plan = ba_att_plan(q.view(), k.view(), o);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::non_finite) << plan.status().to_string();
  }
}

// The count a fixed budget keeps, shared by the CPU selector and the GPU one (src/cuda/select).
TEST(BaAttBudget, FixedBlockCount) {
  // 0.07 * 100 is 7.000000000000001 in binary: 7 blocks, not 8 (the tolerance in fixed_block_count).
  EXPECT_EQ(fixed_block_count(Budget::density(0.07), 100), 7);
  EXPECT_EQ(fixed_block_count(Budget::density(0.7), 10), 7);
  EXPECT_EQ(fixed_block_count(Budget::density(0.71), 10), 8);
  EXPECT_EQ(fixed_block_count(Budget::density(1e-6), 10), 1);  // never fewer than one block
  EXPECT_EQ(fixed_block_count(Budget::top_kappa(3), 10), 3);
  EXPECT_EQ(fixed_block_count(Budget::top_kappa(20), 10), 10);  // never more than the row
  EXPECT_EQ(fixed_block_count(Budget::mass(0.9), 10), 0);       // depends on the scores
}
