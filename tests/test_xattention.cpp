// XAttention selector: the antidiagonal scores, forced blocks, budgets, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "sparsa/attention.h"
#include "sparsa/xattention.h"
#include "test_util.h"

using namespace sparsa;

namespace {

using sparsa_test::randn;

std::vector<int32_t> row_of(const BlockIndexBuffer& plan, int64_t row) {
  const int64_t cap = plan.indices.shape()[3];
  const int32_t* ix = plan.indices.ptr<int32_t>() + row * cap;
  return {ix, ix + plan.counts.ptr<int32_t>()[row]};
}

}  // namespace

// Independent brute force of the definition on a tiny case (S = 2, blocks of 4 tokens).
TEST(XAttention, ScoresMatchTheDefinition) {
  const int64_t Lq = 8, Lk = 12, d = 4, S = 2, B = 4;
  HostArray q = randn({1, 1, Lq, d}, 1), k = randn({1, 1, Lk, d}, 2);
  XAttentionOptions o;
  o.block_q = o.block_kv = B;
  o.stride = S;
  auto x = xattention_scores(q.view(), k.view(), o);
  ASSERT_TRUE(x.ok());
  auto dot = [&](int64_t i, int64_t j) {
    double s = 0;
    for (int64_t t = 0; t < d; ++t) s += (double)q.ptr<float>()[i * d + t] * k.ptr<float>()[j * d + t];
    return s;
  };
  const double scale = 1.0 / std::sqrt(double(d)) / S;
  for (int64_t qb = 0; qb < Lq / B; ++qb) {
    std::vector<double> mass(Lk / B, 0.0);
    for (int64_t g = qb * B / S; g < (qb + 1) * B / S; ++g) {
      std::vector<double> a(Lk / S);
      for (int64_t c = 0; c < Lk / S; ++c) a[c] = scale * (dot(g * S + 1, c * S) + dot(g * S, c * S + 1));  // antidiagonal
      double z = 0;
      for (double v : a) z += std::exp(v);
      for (int64_t c = 0; c < Lk / S; ++c) mass[c * S / B] += std::exp(a[c]) / z;
    }
    for (int64_t kb = 0; kb < Lk / B; ++kb) EXPECT_NEAR(x->ptr<float>()[qb * (Lk / B) + kb], mass[kb], 1e-6);
  }
}

// Fast path against the reference: lengths not multiples of the stride or the block, GQA.
TEST(XAttention, CpuMatchesCpuRef) {
  HostArray q = randn({2, 4, 203, 32}, 3), k = randn({2, 2, 117, 32}, 4);
  XAttentionOptions o;
  o.block_q = 32;
  o.block_kv = 16;
  o.stride = 8;
  o.backend = Backend::cpu_ref;
  auto ref = xattention_scores(q.view(), k.view(), o);
  o.backend = Backend::cpu;
  auto fast = xattention_scores(q.view(), k.view(), o);
  ASSERT_TRUE(ref.ok() && fast.ok());
  // f32 products of length S*d = 256 against f64, then the same f64 softmax: 1e-5.
  for (int64_t i = 0; i < ref->numel(); ++i) ASSERT_NEAR(ref->ptr<float>()[i], fast->ptr<float>()[i], 1e-5) << i;
  // A block's masses sum to its number of query groups (4 for full blocks, ceil(11/8) = 2 for the last).
  const int64_t nk = ref->shape()[3], nq = ref->shape()[2];
  for (int64_t r = 0; r < ref->numel() / nk; ++r) {
    const float* m = ref->ptr<float>() + r * nk;
    EXPECT_NEAR(std::accumulate(m, m + nk, 0.0), (r % nq == nq - 1) ? 2.0 : 4.0, 1e-5);
  }
}

// First and diagonal key blocks are always kept, and count against the budget.
TEST(XAttention, ForcedBlocksAndBudgets) {
  HostArray q = randn({1, 1, 128, 16}, 5), k = randn({1, 1, 256, 16}, 6);  // nq = 8, nk = 16
  XAttentionOptions o;
  o.block_q = o.block_kv = 16;
  o.stride = 4;
  o.budget = Budget::mass(1e-6);
  auto plan = xattention_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  for (int64_t qb = 0; qb < 8; ++qb) {
    EXPECT_EQ(row_of(*plan, qb), (std::vector<int32_t>{0, (int32_t)(qb + 8)})) << qb;  // diagonal aligned to the end
  }
  o.budget = Budget::top_kappa(5);
  plan = xattention_plan(q.view(), k.view(), o);
  auto x = xattention_scores(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok() && x.ok());
  for (int64_t qb = 0; qb < 8; ++qb) {
    const auto row = row_of(*plan, qb);
    ASSERT_EQ(row.size(), 5u);
    EXPECT_TRUE(std::count(row.begin(), row.end(), 0) && std::count(row.begin(), row.end(), qb + 8));
    // The other three are the top three of the rest.
    std::vector<std::pair<float, int32_t>> rest;
    for (int32_t kb = 0; kb < 16; ++kb)
      if (kb != 0 && kb != qb + 8) rest.push_back({-x->ptr<float>()[qb * 16 + kb], kb});
    std::sort(rest.begin(), rest.end());
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::count(row.begin(), row.end(), rest[i].second));
  }
  o.force_first = o.force_diagonal = false;
  o.budget = Budget::top_kappa(1);
  plan = xattention_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  for (int64_t qb = 0; qb < 8; ++qb) EXPECT_EQ(plan->counts.ptr<int32_t>()[qb], 1);
}

// Every block kept: dense attention.
TEST(XAttention, EveryBlockKeptEqualsDense) {
  HostArray q = randn({1, 2, 100, 16}, 7), k = randn({1, 1, 90, 16}, 8), v = randn({1, 1, 90, 16}, 9);
  XAttentionOptions o;
  o.block_q = o.block_kv = 16;
  o.stride = 4;
  o.budget = Budget::density(1.0);
  auto out = xattention(q.view(), k.view(), v.view(), o);
  auto ref = dense(q.view(), k.view(), v.view());
  ASSERT_TRUE(out.ok() && ref.ok());
  for (int64_t i = 0; i < ref->out.numel(); ++i) EXPECT_NEAR(out->out.ptr<float>()[i], ref->out.ptr<float>()[i], 1e-5);
}

// mask_aware, stated independently on a small case: each query group's softmax runs over the
// key groups holding a key some query of the group sees (brute force over the element rule);
// the plan never keeps a hidden block, always keeps the block of each query's last visible key,
// and at density 1 the output is masked dense attention. cpu against cpu_ref; mask none with
// mask_aware is the plain selector.
TEST(XAttention, MaskAwareSoftmaxAndPlanSeeTheMask) {
  const int64_t Lq = 40, Lk = 56, d = 8, S = 4, B = 8;
  HostArray q = randn({1, 2, Lq, d}, 12), k = randn({1, 1, Lk, d}, 13), v = randn({1, 1, Lk, d}, 14);
  auto dot = [&](int64_t h, int64_t i, int64_t j) {
    double s = 0;
    for (int64_t t = 0; t < d; ++t) s += (double)q.ptr<float>()[(h * Lq + i) * d + t] * k.ptr<float>()[j * d + t];
    return s;
  };
  for (const Mask& m : {Mask::causal(), Mask::block_causal(12), Mask::sliding_window(9, 2)}) {
    XAttentionOptions o;
    o.block_q = o.block_kv = B;
    o.stride = S;
    o.mask = m;
    o.mask_aware = true;
    o.backend = Backend::cpu_ref;
    auto x = xattention_scores(q.view(), k.view(), o);
    ASSERT_TRUE(x.ok()) << x.status().to_string();
    o.backend = Backend::cpu;
    auto fast = xattention_scores(q.view(), k.view(), o);
    ASSERT_TRUE(fast.ok());
    for (int64_t i = 0; i < x->numel(); ++i) ASSERT_NEAR(x->ptr<float>()[i], fast->ptr<float>()[i], 1e-5) << i;
    const double scale = 1.0 / std::sqrt(double(d)) / S;
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t qb = 0; qb < Lq / B; ++qb) {
        std::vector<double> mass(Lk / B, 0.0);
        for (int64_t g = qb * B / S; g < (qb + 1) * B / S; ++g) {
          std::vector<double> a;
          std::vector<int64_t> groups;
          for (int64_t c = 0; c < Lk / S; ++c) {
            bool seen = false;
            for (int64_t i = g * S; i < (g + 1) * S; ++i)
              for (int64_t j = c * S; j < (c + 1) * S; ++j) seen = seen || mask_visible(m, i, j, Lq, Lk);
            if (!seen) continue;
            double sum = 0;
            for (int64_t s2 = 0; s2 < S; ++s2) sum += dot(h, g * S + S - 1 - s2, c * S + s2);
            a.push_back(scale * sum);
            groups.push_back(c);
          }
          double z = 0;
          for (double t : a) z += std::exp(t);
          for (size_t t = 0; t < a.size(); ++t) mass[groups[t] * S / B] += std::exp(a[t]) / z;
        }
        for (int64_t kb = 0; kb < Lk / B; ++kb) {
          EXPECT_NEAR(x->ptr<float>()[(h * (Lq / B) + qb) * (Lk / B) + kb], mass[kb], 1e-6) << mask_string(m);
        }
      }
    }
    o.budget = Budget::top_kappa(1);
    o.force_first = o.force_diagonal = false;
    auto plan = xattention_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    for (int64_t r = 0; r < 2 * (Lq / B); ++r) {
      const auto row = row_of(*plan, r);
      const int64_t qb = r % (Lq / B);
      for (int64_t kb = 0; kb < Lk / B; ++kb) {
        bool any = false;
        for (int64_t i = qb * B; i < (qb + 1) * B; ++i)
          for (int64_t j = kb * B; j < (kb + 1) * B; ++j) any = any || mask_visible(m, i, j, Lq, Lk);
        if (!any) EXPECT_EQ(std::count(row.begin(), row.end(), kb), 0) << mask_string(m) << " hidden " << kb;
      }
      for (int64_t i = qb * B; i < (qb + 1) * B; ++i) {
        int64_t last = -1;
        for (int64_t j = 0; j < Lk; ++j)
          if (mask_visible(m, i, j, Lq, Lk)) last = j;
        if (last >= 0) EXPECT_EQ(std::count(row.begin(), row.end(), last / B), 1) << mask_string(m) << " query " << i;
      }
    }
    o.budget = Budget::density(1.0);
    auto out = xattention(q.view(), k.view(), v.view(), o);
    AttentionOptions masked;
    masked.mask = m;
    auto ref = dense(q.view(), k.view(), v.view(), masked);
    ASSERT_TRUE(out.ok() && ref.ok());
    for (int64_t i = 0; i < ref->out.numel(); ++i) {
      ASSERT_NEAR(out->out.ptr<float>()[i], ref->out.ptr<float>()[i], 1e-5) << mask_string(m) << " " << i;
    }
  }
  XAttentionOptions plain, none;
  none.block_q = none.block_kv = plain.block_q = plain.block_kv = B;
  none.stride = plain.stride = S;
  none.mask_aware = true;
  auto a = xattention_plan(q.view(), k.view(), plain), b = xattention_plan(q.view(), k.view(), none);
  ASSERT_TRUE(a.ok() && b.ok());
  for (int64_t r = 0; r < 2 * (Lq / B); ++r) EXPECT_EQ(row_of(*a, r), row_of(*b, r));
}

TEST(XAttention, BadArgumentsGiveClearErrors) {
  HostArray q = randn({1, 1, 64, 8}, 10), k = randn({1, 1, 64, 8}, 11);
  XAttentionOptions o;
  o.stride = 3;
  auto r = xattention_plan(q.view(), k.view(), o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("stride: expected a divisor of block_q"), std::string::npos);
  o = {};
  o.stride = 0;
  EXPECT_NE(xattention_plan(q.view(), k.view(), o).status().message().find("stride: expected >= 1"), std::string::npos);
  o = {};
  o.budget = Budget::mass(2.0);
  EXPECT_NE(xattention_plan(q.view(), k.view(), o).status().message().find("budget:"), std::string::npos);
  o = {};
  o.block_kv = 0;
  EXPECT_NE(xattention_plan(q.view(), k.view(), o).status().message().find("block_kv:"), std::string::npos);
}
