#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "sparsa/attention.h"
#include "sparsa/index.h"

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

// block_index_density reads the index on the host: a full plan visits everything, a device plan
// (here host memory labelled cuda, never read) gives NaN instead of dereferencing device pointers.
TEST(Smoke, BlockIndexDensityOfHostAndDevicePlans) {
  BlockIndexBuffer plan = BlockIndexBuffer::full(1, 2, 100, 70, 32, 16);
  EXPECT_DOUBLE_EQ(block_index_density(plan.view(), 100, 70), 1.0);
  plan.counts.ptr<int32_t>()[0] = 1;  // row 0 keeps key block 0 only: 32 x 16 of its 32 x 70 pairs
  EXPECT_DOUBLE_EQ(block_index_density(plan.view(), 100, 70), 1.0 - (32.0 * 54.0) / (2 * 100.0 * 70.0));
  BlockIndex device = plan.view();
  device.counts.device = device.indices.device = Device{DeviceType::cuda, 0};
  EXPECT_TRUE(std::isnan(block_index_density(device, 100, 70)));
}
