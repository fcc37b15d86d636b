// Finite inputs whose f32 arithmetic overflows, and NaN inputs (issue 14): the fast `cpu`
// backend gives cpu_ref's answer (cpu redoes such rows in f64, as cpu_ref computes them),
// or, when the log-sum-exp itself does not fit f32, both refuse with non_finite naming the
// row. Never all-NaN O from finite inputs, never LSE = -inf (the empty-row answer) for a
// row that saw keys.
//
// Tolerance: O within 1e-5 * max|O_ref| and LSE within 1e-5 * max(1, |LSE_ref|), the
// f32-versus-f64 bound of tests/test_cpu_attention.cpp; the rows redone in f64 match
// cpu_ref to the last bit (same code), the others are ordinary rows.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "sparsa/attention.h"
#include "sparsa/llsa.h"
#include "sparsa/quest.h"
#include "test_util.h"

namespace {

using namespace sparsa;
using sparsa_test::randn;

constexpr float kBig = 3.0e38f;  // near FLT_MAX (3.4e38)

AttentionOptions on(Backend backend, std::optional<float> scale = std::nullopt) {
  AttentionOptions o;
  o.backend = backend;
  o.scale = scale;
  return o;
}

void expect_same(const AttentionOutput& ref, const AttentionOutput& got, const std::string& what) {
  ASSERT_EQ(ref.out.numel(), got.out.numel());
  double max_ref = 0;
  for (int64_t i = 0; i < ref.out.numel(); ++i) max_ref = std::max(max_ref, std::abs(double(ref.out.ptr<float>()[i])));
  int bad = 0;
  for (int64_t i = 0; i < ref.out.numel(); ++i) {
    const float r = ref.out.ptr<float>()[i], g = got.out.ptr<float>()[i];
    const bool both_nan = std::isnan(r) && std::isnan(g);
    if (!both_nan && !(std::abs(double(r) - g) <= 1e-5 * max_ref) && bad++ < 4) {
      ADD_FAILURE() << what << ": out[" << i << "] cpu " << g << " vs cpu_ref " << r;
    }
  }
  for (int64_t i = 0; i < ref.lse.numel(); ++i) {
    const float r = ref.lse.ptr<float>()[i], g = got.lse.ptr<float>()[i];
    const bool same = (std::isnan(r) && std::isnan(g)) || r == g ||
                      std::abs(double(r) - g) <= 1e-5 * std::max(1.0, std::abs(double(r)));
    if (!same && bad++ < 8) ADD_FAILURE() << what << ": lse[" << i << "] cpu " << g << " vs cpu_ref " << r;
  }
  EXPECT_EQ(bad, 0) << what;
}

bool all_finite(const HostArray& a) {
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (!std::isfinite(a.ptr<float>()[i])) return false;
  }
  return true;
}

void fill(HostArray& a, float value) {
  for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] = value;
}

// V of magnitude ~FLT_MAX: O, a convex combination of V rows, fits f32, but the f32
// accumulator sum_j p_j v_j (up to l * FLT_MAX) overflowed to inf, then NaN.
TEST(Overflow, HugeValuesGiveTheReferenceAnswer) {
  for (int64_t len : {1, 17, 200}) {
    SCOPED_TRACE("len " + std::to_string(len));
    HostArray q = randn({1, 2, len, 16}, 1), k = randn({1, 2, len, 16}, 2), v = randn({1, 2, len, 16}, 3);
    for (int64_t i = 0; i < v.numel(); ++i) v.ptr<float>()[i] = v.ptr<float>()[i] > 0 ? kBig : -kBig;
    auto ref = dense(q.view(), k.view(), v.view(), on(Backend::cpu_ref));
    auto got = dense(q.view(), k.view(), v.view(), on(Backend::cpu));
    ASSERT_TRUE(ref.ok() && got.ok()) << ref.status().to_string() << got.status().to_string();
    EXPECT_TRUE(all_finite(ref->out));
    EXPECT_TRUE(all_finite(got->out));
    expect_same(*ref, *got, "dense");

    BlockIndexBuffer plan = BlockIndexBuffer::full(1, 2, len, len, 16, 16);
    auto ref_bs = block_sparse(q.view(), k.view(), v.view(), plan.view(), on(Backend::cpu_ref));
    auto got_bs = block_sparse(q.view(), k.view(), v.view(), plan.view(), on(Backend::cpu));
    ASSERT_TRUE(ref_bs.ok() && got_bs.ok()) << got_bs.status().to_string();
    EXPECT_TRUE(all_finite(got_bs->out));
    expect_same(*ref_bs, *got_bs, "block_sparse");
  }
}

// Products q_t k_t of +-1e40 overflow f32 while the logits (their sum, 0) do not: the f32
// dot product is inf - inf = NaN, the f64 one exactly 0 (uniform attention: O = mean V).
TEST(Overflow, CancellingProductsGiveTheReferenceAnswer) {
  HostArray q(DType::f32, {1, 1, 5, 4}), k(DType::f32, {1, 1, 9, 4});
  HostArray v = randn({1, 1, 9, 4}, 7);
  for (int64_t i = 0; i < 5; ++i) {
    float* row = q.ptr<float>() + i * 4;
    row[0] = row[1] = 1e20f;
    row[2] = row[3] = 0.0f;
  }
  for (int64_t j = 0; j < 9; ++j) {
    float* row = k.ptr<float>() + j * 4;
    row[0] = 1e20f;
    row[1] = -1e20f;
    row[2] = row[3] = 0.0f;
  }
  auto ref = dense(q.view(), k.view(), v.view(), on(Backend::cpu_ref, 1.0f));
  auto got = dense(q.view(), k.view(), v.view(), on(Backend::cpu, 1.0f));
  ASSERT_TRUE(ref.ok() && got.ok()) << got.status().to_string();
  EXPECT_TRUE(all_finite(got->out));
  EXPECT_NEAR(got->lse.ptr<float>()[0], std::log(9.0f), 1e-5);
  expect_same(*ref, *got, "dense");
}

// A scale near FLT_MAX (what `sparsa run --scale 3e38` passes): logits ~1e38 * |q.k|, whose
// log-sum-exp exceeds f32. No finite answer exists: both backends refuse, naming the row.
TEST(Overflow, LseBeyondF32IsAnErrorOnBothBackends) {
  HostArray q = randn({1, 1, 33, 8}, 4), k = randn({1, 1, 40, 8}, 5), v = randn({1, 1, 40, 8}, 6);
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    SCOPED_TRACE(backend_name(backend));
    auto r = dense(q.view(), k.view(), v.view(), on(backend, kBig));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::non_finite);
    EXPECT_NE(r.status().message().find("lse[0, 0, "), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("exceeds the f32 range"), std::string::npos) << r.status().message();
    BlockIndexBuffer plan = BlockIndexBuffer::full(1, 1, 33, 40, 8, 8);
    auto bs = block_sparse(q.view(), k.view(), v.view(), plan.view(), on(backend, kBig));
    ASSERT_FALSE(bs.ok());
    EXPECT_EQ(bs.status().code(), StatusCode::non_finite);
  }
  // Inputs near FLT_MAX at the default scale: logits ~1e77, the same refusal.
  HostArray big_q = q, big_k = k;
  fill(big_q, kBig);
  fill(big_k, kBig);
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    auto r = dense(big_q.view(), big_k.view(), v.view(), on(backend));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::non_finite) << r.status().to_string();
  }
}

// A NaN query row comes out NaN (O and LSE), not as an empty row (O = 0, LSE = -inf);
// the other rows are unaffected.
TEST(Overflow, NanQueryRowStaysNan) {
  for (int64_t len : {3, 70}) {
    HostArray q = randn({1, 2, len, 16}, 8), k = randn({1, 2, len, 16}, 9), v = randn({1, 2, len, 16}, 10);
    for (int t = 0; t < 16; ++t) q.ptr<float>()[(len + 1) * 16 + t] = std::nanf("");  // head 1, row 1
    auto ref = dense(q.view(), k.view(), v.view(), on(Backend::cpu_ref));
    auto got = dense(q.view(), k.view(), v.view(), on(Backend::cpu));
    ASSERT_TRUE(ref.ok() && got.ok());
    const float lse = got->lse.ptr<float>()[len + 1];
    EXPECT_TRUE(std::isnan(lse)) << "lse of the NaN row: " << lse;
    EXPECT_TRUE(std::isnan(got->out.ptr<float>()[(len + 1) * 16]));
    expect_same(*ref, *got, "dense len " + std::to_string(len));
    BlockIndexBuffer plan = BlockIndexBuffer::full(1, 2, len, len, 16, 16);
    auto ref_bs = block_sparse(q.view(), k.view(), v.view(), plan.view(), on(Backend::cpu_ref));
    auto got_bs = block_sparse(q.view(), k.view(), v.view(), plan.view(), on(Backend::cpu));
    ASSERT_TRUE(ref_bs.ok() && got_bs.ok());
    EXPECT_TRUE(std::isnan(got_bs->lse.ptr<float>()[len + 1]));
    expect_same(*ref_bs, *got_bs, "block_sparse len " + std::to_string(len));
  }
}

// quest runs the block-sparse executor over the pages it picks: the same guarantee.
TEST(Overflow, QuestWithHugeValues) {
  HostArray q = randn({1, 2, 40, 16}, 11), k = randn({1, 2, 64, 16}, 12), v = randn({1, 2, 64, 16}, 13);
  for (int64_t i = 0; i < v.numel(); ++i) v.ptr<float>()[i] = v.ptr<float>()[i] > 0 ? kBig : -kBig;
  PageSelectOptions select;
  select.budget = 32;
  PagedAttentionOptions ref_options, cpu_options;
  ref_options.attention.backend = Backend::cpu_ref;
  cpu_options.attention.backend = Backend::cpu;
  auto ref = quest_attention(q.view(), k.view(), v.view(), select, ref_options);
  auto got = quest_attention(q.view(), k.view(), v.view(), select, cpu_options);
  ASSERT_TRUE(ref.ok() && got.ok()) << got.status().to_string();
  EXPECT_TRUE(all_finite(got->attention.out));
  expect_same(ref->attention, got->attention, "quest");
}

// llsa's cpu forward redoes the whole forward in f64 when a row overflowed.
TEST(Overflow, LlsaWithHugeValues) {
  HostArray q = randn({1, 2, 64, 16}, 14), k = randn({1, 2, 64, 16}, 15), v = randn({1, 2, 64, 16}, 16);
  for (int64_t i = 0; i < v.numel(); ++i) v.ptr<float>()[i] = v.ptr<float>()[i] > 0 ? kBig : -kBig;
  LlsaOptions options;
  options.block = 4;
  options.topk = 2;
  auto plan = llsa_plan(q.view(), k.view(), options);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  AttentionOutput ref{HostArray(DType::f32, {1, 2, 64, 16}), HostArray(DType::f32, {1, 2, 64})};
  AttentionOutput got{HostArray(DType::f32, {1, 2, 64, 16}), HostArray(DType::f32, {1, 2, 64})};
  options.backend = Backend::cpu_ref;
  ASSERT_TRUE(llsa_forward(q.view(), k.view(), v.view(), *plan, ref.out.view(), ref.lse.view(), options).ok());
  options.backend = Backend::cpu;
  ASSERT_TRUE(llsa_forward(q.view(), k.view(), v.view(), *plan, got.out.view(), got.lse.view(), options).ok());
  EXPECT_TRUE(all_finite(got.out));
  EXPECT_TRUE(all_finite(got.lse));
  expect_same(ref, got, "llsa");

  // A NaN query row: NaN LSE, not -inf.
  q.ptr<float>()[5 * 16] = std::nanf("");
  ASSERT_TRUE(llsa_forward(q.view(), k.view(), v.view(), *plan, got.out.view(), got.lse.view(), options).ok());
  EXPECT_TRUE(std::isnan(got.lse.ptr<float>()[5])) << got.lse.ptr<float>()[5];

  // A scale whose LSE exceeds f32: refused on both backends.
  HostArray v_small = randn({1, 2, 64, 16}, 17);
  q = randn({1, 2, 64, 16}, 14);
  options.scale = kBig;
  for (Backend backend : {Backend::cpu_ref, Backend::cpu}) {
    options.backend = backend;
    Status s = llsa_forward(q.view(), k.view(), v_small.view(), *plan, got.out.view(), got.lse.view(), options);
    EXPECT_EQ(s.code(), StatusCode::non_finite) << backend_name(backend) << ": " << s.to_string();
  }
}

}  // namespace
