// The fast CPU path (Backend::cpu) against the specification (Backend::cpu_ref), dense
// and block-sparse, over awkward shapes: lengths that are not multiples of any tile
// (1, 3, 17, 113, 1023), head_dim 16/40/64/128, GQA, strided views, f16/bf16 inputs,
// permuted blocks, partial and empty query blocks.
//
// Tolerances: tests/attention_compare.h (shared with the mask and varlen tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>

#include "attention_compare.h"
#include "sparsa/attention.h"

namespace {

using namespace sparsa;

struct Case {
  int64_t batch = 1, heads_q = 1, heads_kv = 1, len_q = 1, len_kv = 1, head_dim = 64;
  DType dtype = DType::f32;
  bool strided = false;  // q/k/v stored as [batch, seq, heads, head_dim] and viewed as [b, h, s, d]

  std::string name() const {
    return "b" + std::to_string(batch) + "_hq" + std::to_string(heads_q) + "_hkv" + std::to_string(heads_kv) +
           "_lq" + std::to_string(len_q) + "_lkv" + std::to_string(len_kv) + "_d" + std::to_string(head_dim) +
           "_" + dtype_name(dtype) + (strided ? "_strided" : "");
  }
};

using sparsa_test::expect_close;
using sparsa_test::Input;
using sparsa_test::make_input;
using sparsa_test::with_backend;

class DenseCpu : public ::testing::TestWithParam<Case> {};

TEST_P(DenseCpu, MatchesRef) {
  const Case c = GetParam();
  std::mt19937 rng(1234);
  const Input q = make_input(c.batch, c.heads_q, c.len_q, c.head_dim, c.dtype, c.strided, rng);
  const Input k = make_input(c.batch, c.heads_kv, c.len_kv, c.head_dim, c.dtype, c.strided, rng);
  const Input v = make_input(c.batch, c.heads_kv, c.len_kv, c.head_dim, c.dtype, c.strided, rng);
  auto ref = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref));
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto got = dense(q.view, k.view, v.view, with_backend(Backend::cpu));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  expect_close(*ref, *got, c.dtype, c.name());
}

std::vector<Case> dense_cases() {
  std::vector<Case> cases;
  for (int64_t len : {1, 3, 17, 113})
    for (int64_t d : {16, 40, 64, 128}) cases.push_back({1, 2, 2, len, len, d});
  // Lq != Lk, both ways, across the tile sizes.
  cases.push_back({1, 2, 1, 3, 1023, 64});
  cases.push_back({1, 2, 1, 1023, 17, 128});
  cases.push_back({1, 1, 1, 1023, 1023, 128});
  cases.push_back({2, 6, 2, 113, 200, 40});  // GQA 3:1, batch 2
  cases.push_back({1, 8, 1, 65, 129, 64});   // GQA 8:1 (multi-query)
  cases.push_back({2, 12, 2, 70, 90, 16});   // GQA 6:1: heads shared in sets of 4 + 2
  cases.push_back({2, 4, 2, 77, 131, 64, DType::f32, true});
  for (DType dt : {DType::f16, DType::bf16}) {
    cases.push_back({1, 4, 2, 113, 130, 64, dt});
    cases.push_back({1, 2, 2, 17, 1023, 128, dt});
    cases.push_back({1, 2, 1, 70, 33, 40, dt, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, DenseCpu, ::testing::ValuesIn(dense_cases()),
                         [](const auto& info) { return info.param.name(); });

// Block-sparse: a random plan per (batch, head, query block), with some query blocks
// empty, and optional random permutations of queries and keys.
struct SparseCase {
  Case shape;
  int block_q = 16, block_kv = 16;
  double keep = 0.5;  // probability a key block is listed
  bool perm = false;

  std::string name() const {
    return shape.name() + "_bq" + std::to_string(block_q) + "_bkv" + std::to_string(block_kv) + "_keep" +
           std::to_string(static_cast<int>(keep * 100)) + (perm ? "_perm" : "");
  }
};

BlockIndexBuffer random_plan(const SparseCase& c, std::mt19937& rng) {
  const Case& s = c.shape;
  const int64_t nq = (s.len_q + c.block_q - 1) / c.block_q, nkv = (s.len_kv + c.block_kv - 1) / c.block_kv;
  BlockIndexBuffer plan = BlockIndexBuffer::empty(s.batch, s.heads_q, s.len_q, s.len_kv, c.block_q, c.block_kv, nkv);
  std::bernoulli_distribution take(c.keep);
  for (int64_t row = 0; row < s.batch * s.heads_q * nq; ++row) {
    int32_t count = 0;
    // Every third query block is empty: O = 0, LSE = -inf.
    if (row % 3 != 1) {
      for (int32_t kb = 0; kb < nkv; ++kb)
        if (take(rng)) plan.indices.ptr<int32_t>()[row * nkv + count++] = kb;
    }
    plan.counts.ptr<int32_t>()[row] = count;
  }
  if (c.perm) {
    auto fill_perm = [&](HostArray& a, int64_t heads, int64_t len) {
      a = HostArray(DType::i32, {s.batch, heads, len});
      for (int64_t bh = 0; bh < s.batch * heads; ++bh) {
        int32_t* p = a.ptr<int32_t>() + bh * len;
        std::iota(p, p + len, 0);
        std::shuffle(p, p + len, rng);
      }
    };
    fill_perm(plan.perm_q, s.heads_q, s.len_q);
    fill_perm(plan.perm_kv, s.heads_kv, s.len_kv);
  }
  return plan;
}

class BlockSparseCpu : public ::testing::TestWithParam<SparseCase> {};

TEST_P(BlockSparseCpu, MatchesRef) {
  const SparseCase c = GetParam();
  const Case& s = c.shape;
  std::mt19937 rng(99);
  const Input q = make_input(s.batch, s.heads_q, s.len_q, s.head_dim, s.dtype, s.strided, rng);
  const Input k = make_input(s.batch, s.heads_kv, s.len_kv, s.head_dim, s.dtype, s.strided, rng);
  const Input v = make_input(s.batch, s.heads_kv, s.len_kv, s.head_dim, s.dtype, s.strided, rng);
  const BlockIndexBuffer plan = random_plan(c, rng);
  const BlockIndex index = plan.view();
  auto ref = block_sparse(q.view, k.view, v.view, index, with_backend(Backend::cpu_ref));
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto got = block_sparse(q.view, k.view, v.view, index, with_backend(Backend::cpu));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  expect_close(*ref, *got, s.dtype, c.name());

  // Rows of empty query blocks: O = 0 exactly and LSE = -inf (checked on the fast path
  // directly, not only through agreement with the reference).
  const int64_t nq = index.num_q_blocks;
  int64_t empty_rows = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads_q; ++h) {
      for (int64_t qb = 0; qb < nq; ++qb) {
        if (plan.counts.ptr<int32_t>()[(b * s.heads_q + h) * nq + qb] != 0) continue;
        for (int64_t pq = qb * c.block_q; pq < std::min<int64_t>((qb + 1) * c.block_q, s.len_q); ++pq) {
          const int64_t i = c.perm ? plan.perm_q.ptr<int32_t>()[(b * s.heads_q + h) * s.len_q + pq] : pq;
          const int64_t row = (b * s.heads_q + h) * s.len_q + i;
          EXPECT_EQ(got->lse.ptr<float>()[row], -std::numeric_limits<float>::infinity());
          for (int64_t t = 0; t < s.head_dim; ++t)
            ASSERT_EQ(load_as_double(got->out.view(), row * s.head_dim + t), 0.0) << c.name() << " row " << i;
          ++empty_rows;
        }
      }
    }
  }
  if (s.len_q > c.block_q) EXPECT_GT(empty_rows, 0) << "the plan should contain empty query blocks";
}

std::vector<SparseCase> sparse_cases() {
  std::vector<SparseCase> cases;
  for (int64_t d : {16, 40, 64, 128}) cases.push_back({{1, 2, 2, 113, 113, d}, 16, 16, 0.5, false});
  cases.push_back({{1, 2, 2, 1, 1, 64}, 16, 16, 1.0, false});
  cases.push_back({{1, 2, 2, 3, 17, 64}, 2, 5, 0.7, true});
  cases.push_back({{1, 2, 1, 1023, 1023, 64}, 64, 64, 0.3, true});
  cases.push_back({{1, 2, 2, 1023, 1023, 128}, 128, 32, 0.2, false});  // query blocks larger than a tile
  cases.push_back({{2, 4, 2, 200, 150, 40}, 100, 24, 0.5, true});       // GQA, partial blocks
  cases.push_back({{1, 4, 1, 113, 113, 64, DType::f32, true}, 16, 32, 0.6, true});
  for (DType dt : {DType::f16, DType::bf16}) {
    cases.push_back({{1, 4, 2, 113, 130, 64, dt}, 16, 16, 0.5, true});
    cases.push_back({{1, 2, 2, 300, 257, 128, dt}, 64, 64, 0.4, false});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Plans, BlockSparseCpu, ::testing::ValuesIn(sparse_cases()),
                         [](const auto& info) { return info.param.name(); });

// A single thread and many threads give the same answer (work split must not matter).
TEST(CpuAttention, ThreadCountDoesNotChangeResult) {
  std::mt19937 rng(5);
  const Input qq = make_input(1, 3, 130, 64, DType::f32, false, rng);
  const Input k = make_input(1, 3, 200, 64, DType::f32, false, rng);
  const Input v = make_input(1, 3, 200, 64, DType::f32, false, rng);
  AttentionOptions one = with_backend(Backend::cpu), many = with_backend(Backend::cpu);
  one.num_threads = 1;
  many.num_threads = 7;
  auto a = dense(qq.view, k.view, v.view, one);
  auto b = dense(qq.view, k.view, v.view, many);
  ASSERT_TRUE(a.ok() && b.ok());
  for (int64_t i = 0; i < a->out.numel(); ++i) ASSERT_EQ(a->out.ptr<float>()[i], b->out.ptr<float>()[i]);
}

}  // namespace
