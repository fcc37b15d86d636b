// Oracle block mass (Eq. 3) and the selector metrics.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "sparsa/oracle.h"
#include "test_util.h"

using namespace sparsa;

namespace {

using sparsa_test::randn;
// Heavy-tailed token norms, so sorting matters.
HostArray heavy_tailed(std::vector<int64_t> shape, uint32_t seed) {
  return sparsa_test::heavy_tailed(std::move(shape), seed, 0.6f);
}

// Rows of x [1, H, L, d] gathered by perm [1, H, L]: out[h, p] = x[h, perm[h, p]].
HostArray gather(const HostArray& x, const HostArray& perm) {
  HostArray out(DType::f32, x.shape());
  const int64_t H = x.shape()[1], L = x.shape()[2], d = x.shape()[3];
  for (int64_t h = 0; h < H; ++h)
    for (int64_t p = 0; p < L; ++p) {
      const int64_t t = perm.ptr<int32_t>()[h * L + p];
      std::copy(x.ptr<float>() + (h * L + t) * d, x.ptr<float>() + (h * L + t + 1) * d, out.ptr<float>() + (h * L + p) * d);
    }
  return out;
}

}  // namespace

// The fast pass against the specification, on a permuted partition with partial blocks and GQA.
TEST(Oracle, CpuMatchesCpuRef) {
  HostArray q = heavy_tailed({2, 4, 113, 32}, 1), k = heavy_tailed({2, 2, 131, 32}, 2);
  BaAttOptions o;
  o.block_q = 24;  // not a multiple of the 64-row tile
  o.block_kv = 16;
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  const BlockPartition part = partition_of(plan->view());
  OracleOptions ref_opt;
  ref_opt.backend = Backend::cpu_ref;
  auto ref = oracle_blocks(q.view(), k.view(), part, ref_opt);
  auto fast = oracle_blocks(q.view(), k.view(), part);
  ASSERT_TRUE(ref.ok() && fast.ok()) << fast.status().to_string();
  // Mass: f32 logits and a degree-7 exp2 against f64: 1e-5 absolute on masses <= 1.
  // Logit extremes: f32 dot products of length 32 with |logit| <~ 30: 1e-4 absolute.
  for (int64_t i = 0; i < ref->mass.numel(); ++i) {
    ASSERT_NEAR(ref->mass.ptr<float>()[i], fast->mass.ptr<float>()[i], 1e-5) << i;
    ASSERT_NEAR(ref->logit_max.ptr<float>()[i], fast->logit_max.ptr<float>()[i], 1e-4) << i;
    ASSERT_NEAR(ref->logit_min.ptr<float>()[i], fast->logit_min.ptr<float>()[i], 1e-4) << i;
  }
  // Eq. 3 rows sum to one.
  const int64_t nk = ref->num_kv_blocks;
  for (int64_t r = 0; r < ref->mass.numel() / nk; ++r) {
    const float* m = ref->mass.ptr<float>() + r * nk;
    EXPECT_NEAR(std::accumulate(m, m + nk, 0.0), 1.0, 1e-5);
  }
}

// A permuted partition is the identity partition of permuted tensors.
TEST(Oracle, PermutedPartitionEqualsPermutedTensors) {
  HostArray q = heavy_tailed({1, 2, 64, 16}, 3), k = heavy_tailed({1, 2, 80, 16}, 4);
  BaAttOptions o;
  o.block_q = o.block_kv = 16;
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  auto permuted = oracle_blocks(q.view(), k.view(), partition_of(plan->view()));
  HostArray qp = gather(q, plan->perm_q), kp = gather(k, plan->perm_kv);
  BlockPartition identity;
  identity.block_q = identity.block_kv = 16;
  auto direct = oracle_blocks(qp.view(), kp.view(), identity);
  ASSERT_TRUE(permuted.ok() && direct.ok());
  for (int64_t i = 0; i < direct->mass.numel(); ++i)
    EXPECT_NEAR(permuted->mass.ptr<float>()[i], direct->mass.ptr<float>()[i], 1e-6);
}

// Mass recall from the oracle equals the per-token recall from executor LSEs (full blocks),
// and the full plan recalls everything.
TEST(Oracle, MassRecallTwoWaysAgree) {
  const int64_t L = 128;
  HostArray q = heavy_tailed({1, 4, L, 16}, 5), k = heavy_tailed({1, 2, L, 16}, 6), v = randn({1, 2, L, 16}, 7);
  BaAttOptions o;
  o.block_q = o.block_kv = 16;
  o.budget = Budget::density(0.25);
  auto plan = ba_att_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  auto oracle = oracle_blocks(q.view(), k.view(), partition_of(plan->view()));
  auto sparse = block_sparse(q.view(), k.view(), v.view(), plan->view());
  auto full = dense(q.view(), k.view(), v.view());
  ASSERT_TRUE(oracle.ok() && sparse.ok() && full.ok());
  auto recall = mass_recall(plan->view(), *oracle);
  auto recall_lse = mass_recall_from_lse(sparse->lse.view(), full->lse.view());
  ASSERT_TRUE(recall.ok() && recall_lse.ok());
  EXPECT_GT(*recall, 0.25);
  EXPECT_LT(*recall, 1.0);
  EXPECT_NEAR(*recall, *recall_lse, 1e-5);
  const BlockIndexBuffer all = BlockIndexBuffer::full(1, 4, L, L, 16, 16);
  auto oracle_plain = oracle_blocks(q.view(), k.view(), partition_of(all.view()));
  ASSERT_TRUE(oracle_plain.ok());
  EXPECT_NEAR(mass_recall(all.view(), *oracle_plain).value(), 1.0, 1e-5);
  // A plan on another partition is refused.
  BlockIndexBuffer other = BlockIndexBuffer::full(1, 4, L, L, 32, 32);
  EXPECT_FALSE(mass_recall(other.view(), *oracle).ok());
}

TEST(Oracle, RelativeErrorAndPearson) {
  HostArray a(DType::f32, {1, 1, 2, 2}), b(DType::f32, {1, 1, 2, 2});
  const float av[] = {1, 2, 3, 4}, bv[] = {1, 2, 3, 5};
  std::copy(av, av + 4, a.ptr<float>());
  std::copy(bv, bv + 4, b.ptr<float>());
  EXPECT_NEAR(relative_error(b.view(), a.view()).value(), 1.0 / std::sqrt(30.0), 1e-12);
  const double x[] = {1, 2, 3, 4}, y[] = {2, 4, 6, 8}, z[] = {4, 3, 2, 1}, c[] = {1, 1, 1, 1};
  EXPECT_NEAR(pearson(x, y, 4), 1.0, 1e-12);
  EXPECT_NEAR(pearson(x, z, 4), -1.0, 1e-12);
  EXPECT_TRUE(std::isnan(pearson(x, c, 4)));
  const double u[] = {1, 2, 3}, w[] = {1, 3, 2};
  EXPECT_NEAR(pearson(u, w, 3), 0.5, 1e-12);
}

// Eq. 8 holds on every block pair, and the observed deviation is the brute-force maximum.
TEST(Oracle, DeviationBoundHoldsAndMatchesBruteForce) {
  const int64_t L = 48, d = 8, B = 12;
  HostArray q = heavy_tailed({1, 2, L, d}, 8), k = heavy_tailed({1, 1, L, d}, 9);
  for (bool sorted : {false, true}) {
    BaAttOptions o;
    o.block_q = o.block_kv = B;
    o.sort_q = o.sort_k = sorted;
    auto plan = ba_att_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    const BlockPartition part = partition_of(plan->view());
    auto oracle = oracle_blocks(q.view(), k.view(), part);
    ASSERT_TRUE(oracle.ok());
    auto bound = deviation_bound(q.view(), k.view(), part, *oracle);
    ASSERT_TRUE(bound.ok()) << bound.status().to_string();
    EXPECT_EQ(bound->violations, 0);
    EXPECT_EQ(bound->pearson_per_head.size(), 2u);
    auto token = [&](const HostArray& perm, int64_t h, int64_t p) -> int64_t {
      return perm.empty() ? p : perm.ptr<int32_t>()[h * L + p];
    };
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t qb = 0; qb < L / B; ++qb)
        for (int64_t kb = 0; kb < L / B; ++kb) {
          std::vector<double> qm(d, 0), km(d, 0);
          for (int64_t p = 0; p < B; ++p)
            for (int64_t t = 0; t < d; ++t) {
              qm[t] += q.ptr<float>()[(h * L + token(plan->perm_q, h, qb * B + p)) * d + t] / double(B);
              km[t] += k.ptr<float>()[(token(plan->perm_kv, 0, kb * B + p)) * d + t] / double(B);
            }
          const double l = std::inner_product(qm.begin(), qm.end(), km.begin(), 0.0) / std::sqrt(double(d));
          double dev = 0;
          for (int64_t pi = 0; pi < B; ++pi)
            for (int64_t pj = 0; pj < B; ++pj) {
              const float* qi = q.ptr<float>() + (h * L + token(plan->perm_q, h, qb * B + pi)) * d;
              const float* kj = k.ptr<float>() + token(plan->perm_kv, 0, kb * B + pj) * d;
              double s = 0;
              for (int64_t t = 0; t < d; ++t) s += (double)qi[t] * kj[t];
              dev = std::max(dev, std::abs(s / std::sqrt(double(d)) - l));
            }
          // Eq. 7-8 by hand: radii and max norms of the two blocks.
          double rq = 0, mq = 0, rk = 0, mk = 0;
          for (int64_t p = 0; p < B; ++p) {
            const float* qi = q.ptr<float>() + (h * L + token(plan->perm_q, h, qb * B + p)) * d;
            const float* kj = k.ptr<float>() + token(plan->perm_kv, 0, kb * B + p) * d;
            double r2q = 0, n2q = 0, r2k = 0, n2k = 0;
            for (int64_t t = 0; t < d; ++t) {
              r2q += (qi[t] - qm[t]) * (qi[t] - qm[t]);
              n2q += (double)qi[t] * qi[t];
              r2k += (kj[t] - km[t]) * (kj[t] - km[t]);
              n2k += (double)kj[t] * kj[t];
            }
            rq = std::max(rq, std::sqrt(r2q));
            mq = std::max(mq, std::sqrt(n2q));
            rk = std::max(rk, std::sqrt(r2k));
            mk = std::max(mk, std::sqrt(n2k));
          }
          const double u = (rq * mk + mq * rk + rq * rk) / std::sqrt(double(d));
          const int64_t cell = (h * (L / B) + qb) * (L / B) + kb;
          EXPECT_NEAR(bound->bound.ptr<float>()[cell], u, 1e-5 * (1 + u));
          EXPECT_NEAR(bound->deviation.ptr<float>()[cell], dev, 1e-4 * (1 + dev));
          EXPECT_LE(dev, bound->bound.ptr<float>()[cell] * (1 + 1e-5) + 1e-5);
        }
  }
}

TEST(Oracle, BadArgumentsGiveClearErrors) {
  HostArray q = randn({1, 2, 32, 8}, 10), k = randn({1, 1, 32, 8}, 11);
  BlockPartition part;
  part.block_q = 0;
  auto r = oracle_blocks(q.view(), k.view(), part);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("partition.block_q"), std::string::npos);
  part.block_q = 8;
  HostArray bad_perm(DType::i32, {1, 2, 32});  // all zeros: not a permutation
  part.perm_q = bad_perm.view();
  r = oracle_blocks(q.view(), k.view(), part);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("partition.perm_q: row [0, 0] is not a permutation"), std::string::npos)
      << r.status().to_string();
}
