#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "sparsa/attention.h"

using namespace sparsa;

TEST(Smoke, DenseCpuMatchesRef) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  HostArray q(DType::f32, {1, 4, 77, 64}), k(DType::f32, {1, 2, 131, 64}), v(DType::f32, {1, 2, 131, 64});
  for (auto* a : {&q, &k, &v})
    for (int64_t i = 0; i < a->numel(); ++i) a->ptr<float>()[i] = nd(rng);
  AttentionOptions ref_opt;
  ref_opt.backend = Backend::cpu_ref;
  auto ref = dense(q.view(), k.view(), v.view(), ref_opt);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto fast = dense(q.view(), k.view(), v.view());
  ASSERT_TRUE(fast.ok()) << fast.status().to_string();
  double max_err = 0;
  for (int64_t i = 0; i < ref->out.numel(); ++i)
    max_err = std::max(max_err, (double)std::abs(ref->out.ptr<float>()[i] - fast->out.ptr<float>()[i]));
  EXPECT_LT(max_err, 1e-5);
  for (int64_t i = 0; i < ref->lse.numel(); ++i)
    EXPECT_NEAR(ref->lse.ptr<float>()[i], fast->lse.ptr<float>()[i], 1e-5);
}
