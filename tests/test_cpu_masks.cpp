// Masks (none, causal, block_causal, sliding_window) and variable-length batches on the CPU:
// the rules themselves, cpu_ref against an independent statement of them, the fast path
// against cpu_ref (every mask x dtype x head_dim 64/128/256, dense and block-sparse, fixed and
// variable length, awkward lengths, len_q != len_kv both ways, empty rows and empty sequences),
// negative controls (an ignored mask or ignored sequence boundaries must fail the comparison),
// and the errors of bad masks and bad offsets. Tolerances: tests/attention_compare.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_compare.h"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"

namespace {

using namespace sparsa;
using sparsa_test::count_mismatches;
using sparsa_test::expect_close;
using sparsa_test::Input;
using sparsa_test::make_input;
using sparsa_test::with_backend;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::string mask_label(const Mask& m) {
  std::string s = mask_string(m);
  for (char& c : s)
    if (c == '(' || c == ')' || c == ',') c = '_';
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}

// ---- the rules --------------------------------------------------------------------------

// Literal cases, worked by hand from the definitions in sparsa/attention.h.
TEST(MaskRules, HandWorkedExamples) {
  // causal, len_q 2 < len_kv 5: the queries are the last two tokens, positions 3 and 4.
  EXPECT_TRUE(mask_visible(Mask::causal(), 0, 3, 2, 5));
  EXPECT_FALSE(mask_visible(Mask::causal(), 0, 4, 2, 5));
  EXPECT_TRUE(mask_visible(Mask::causal(), 1, 4, 2, 5));
  // causal, len_q 5 > len_kv 2: query 0 stands at position -3 and sees nothing; query 3 sees key 0.
  EXPECT_FALSE(mask_visible(Mask::causal(), 0, 0, 5, 2));
  EXPECT_FALSE(mask_visible(Mask::causal(), 2, 0, 5, 2));
  EXPECT_TRUE(mask_visible(Mask::causal(), 3, 0, 5, 2));
  EXPECT_FALSE(mask_visible(Mask::causal(), 3, 1, 5, 2));
  // block_causal(2), len 5: blocks {0,1} {2,3} {4}; query 0 sees its block, query 2 blocks 0-1.
  EXPECT_TRUE(mask_visible(Mask::block_causal(2), 0, 1, 5, 5));
  EXPECT_FALSE(mask_visible(Mask::block_causal(2), 0, 2, 5, 5));
  EXPECT_TRUE(mask_visible(Mask::block_causal(2), 2, 3, 5, 5));
  EXPECT_FALSE(mask_visible(Mask::block_causal(2), 3, 4, 5, 5));
  EXPECT_TRUE(mask_visible(Mask::block_causal(2), 4, 4, 5, 5));
  // block_causal(4), len_q 3, len_kv 6: positions 3, 4, 5; position 3 is in block 0 (keys 0-3).
  EXPECT_TRUE(mask_visible(Mask::block_causal(4), 0, 3, 3, 6));
  EXPECT_FALSE(mask_visible(Mask::block_causal(4), 0, 4, 3, 6));
  EXPECT_TRUE(mask_visible(Mask::block_causal(4), 1, 5, 3, 6));
  // sliding_window(1), len 4: query 1 sees 0, 1, 2.
  EXPECT_FALSE(mask_visible(Mask::sliding_window(1), 1, 3, 4, 4));
  EXPECT_TRUE(mask_visible(Mask::sliding_window(1), 1, 0, 4, 4));
  EXPECT_TRUE(mask_visible(Mask::sliding_window(1), 1, 2, 4, 4));
  // sliding_window(2, 0): causal window of 3 keys.
  EXPECT_FALSE(mask_visible(Mask::sliding_window(2, 0), 3, 0, 4, 4));
  EXPECT_TRUE(mask_visible(Mask::sliding_window(2, 0), 3, 1, 4, 4));
  EXPECT_FALSE(mask_visible(Mask::sliding_window(2, 0), 1, 2, 4, 4));
  EXPECT_TRUE(mask_visible(Mask::none(), 0, 1000, 1, 2));
}

std::vector<Mask> all_masks() {
  return {Mask::none(),           Mask::causal(),           Mask::block_causal(1),       Mask::block_causal(3),
          Mask::block_causal(16), Mask::block_causal(1000), Mask::sliding_window(0),     Mask::sliding_window(5),
          Mask::sliding_window(3, 0), Mask::sliding_window(0, 4), Mask::sliding_window(int64_t{1} << 50)};
}

// The range form (what the fast path and the plan construction use) says exactly what the
// per-element form says (what cpu_ref uses), and both ends never decrease along the queries.
TEST(MaskRules, RangeAgreesWithElementRule) {
  for (const Mask& m : all_masks()) {
    for (int64_t len_q : {1, 2, 7, 17, 40}) {
      for (int64_t len_kv : {1, 3, 7, 17, 40}) {
        int64_t prev_begin = 0, prev_end = 0;
        for (int64_t i = 0; i < len_q; ++i) {
          const int64_t begin = mask_key_begin(m, i, len_q, len_kv), end = mask_key_end(m, i, len_q, len_kv);
          ASSERT_GE(begin, prev_begin) << mask_string(m);
          ASSERT_GE(end, prev_end) << mask_string(m);
          prev_begin = begin;
          prev_end = end;
          for (int64_t j = 0; j < len_kv; ++j) {
            ASSERT_EQ(mask_visible(m, i, j, len_q, len_kv), begin <= j && j < end)
                << mask_string(m) << " i " << i << " j " << j << " len_q " << len_q << " len_kv " << len_kv;
          }
        }
      }
    }
  }
}

TEST(MaskRules, ParseAndPrint) {
  for (const Mask& m : all_masks()) {
    auto back = parse_mask(mask_string(m));
    ASSERT_TRUE(back.ok()) << mask_string(m) << ": " << back.status().to_string();
    EXPECT_EQ(mask_string(*back), mask_string(m));
  }
  EXPECT_EQ(mask_string(parse_mask("block_causal:16").value()), "block_causal(16)");
  EXPECT_EQ(mask_string(parse_mask("sliding_window:128").value()), "sliding_window(128)");
  EXPECT_EQ(mask_string(parse_mask("sliding_window:128,0").value()), "sliding_window(128,0)");
  for (const char* bad : {"causl", "block_causal(0)", "block_causal()", "block_causal(-3)", "block_causal(2",
                          "sliding_window(-1)", "sliding_window(1,)", "sliding_window(x)", "window(3)",
                          "block_causal(99999999999999999999)"}) {
    auto r = parse_mask(bad, "--mask");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--mask"), std::string::npos) << r.status().message();
  }
}

TEST(MaskRules, BadMaskParametersAreRefusedByName) {
  std::mt19937 rng(1);
  const Input q = make_input(1, 1, 8, 16, DType::f32, false, rng);
  for (Mask m : {Mask::block_causal(0), Mask::block_causal(-2), Mask::sliding_window(-1, 2)}) {
    for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
      auto r = dense(q.view, q.view, q.view, with_backend(be, m));
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().message().rfind("mask", 0), 0u) << r.status().message();
    }
  }
}

// ---- cpu_ref against an independent statement of the masks --------------------------------
//
// Every mask shows query i the keys [begin, end): cpu_ref with the mask must give, row by row,
// exactly what unmasked cpu_ref gives for that one query over the k/v rows begin..end (views,
// no copy). The same f64 operations over the same keys in the same order: bit-identical.
TEST(MaskRef, EqualsUnmaskedAttentionOverTheVisibleSlice) {
  std::mt19937 rng(7);
  for (auto [len_q, len_kv] : {std::pair<int64_t, int64_t>{23, 23}, {9, 31}, {31, 9}}) {
    const Input q = make_input(1, 2, len_q, 16, DType::f32, false, rng);
    const Input k = make_input(1, 2, len_kv, 16, DType::f32, false, rng);
    const Input v = make_input(1, 2, len_kv, 16, DType::f32, false, rng);
    for (const Mask& m : all_masks()) {
      auto masked = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref, m));
      ASSERT_TRUE(masked.ok()) << masked.status().to_string();
      for (int64_t i = 0; i < len_q; ++i) {
        const int64_t begin = mask_key_begin(m, i, len_q, len_kv), end = mask_key_end(m, i, len_q, len_kv);
        for (int64_t h = 0; h < 2; ++h) {
          const float lse = masked->lse.ptr<float>()[h * len_q + i];
          const float* o = masked->out.ptr<float>() + (h * len_q + i) * 16;
          if (begin >= end) {  // an empty row
            EXPECT_EQ(lse, kNegInf) << mask_string(m) << " row " << i;
            for (int t = 0; t < 16; ++t) ASSERT_EQ(o[t], 0.0f);
            continue;
          }
          Tensor qi = q.view, ks = k.view, vs = v.view;
          qi.data = q.view.ptr<float>() + h * len_q * 16 + i * 16;
          qi.shape[1] = 1;
          qi.shape[2] = 1;
          ks.data = k.view.ptr<float>() + h * len_kv * 16 + begin * 16;
          vs.data = v.view.ptr<float>() + h * len_kv * 16 + begin * 16;
          ks.shape[1] = vs.shape[1] = 1;
          ks.shape[2] = vs.shape[2] = end - begin;
          auto slice = dense(qi, ks, vs, with_backend(Backend::cpu_ref));
          ASSERT_TRUE(slice.ok()) << slice.status().to_string();
          ASSERT_EQ(slice->lse.ptr<float>()[0], lse) << mask_string(m) << " row " << i;
          for (int t = 0; t < 16; ++t) ASSERT_EQ(slice->out.ptr<float>()[t], o[t]) << mask_string(m) << " row " << i;
        }
      }
    }
  }
}

// ---- the fast path against cpu_ref: dense --------------------------------------------------

struct MaskCase {
  int64_t batch = 1, heads_q = 2, heads_kv = 1, len_q = 1, len_kv = 1, head_dim = 64;
  DType dtype = DType::f32;
  Mask mask;
  bool strided = false;

  std::string name() const {
    return mask_label(mask) + "_b" + std::to_string(batch) + "_hq" + std::to_string(heads_q) + "_hkv" +
           std::to_string(heads_kv) + "_lq" + std::to_string(len_q) + "_lkv" + std::to_string(len_kv) + "_d" +
           std::to_string(head_dim) + "_" + dtype_name(dtype) + (strided ? "_strided" : "");
  }
};

std::vector<Mask> test_masks() {
  return {Mask::none(), Mask::causal(), Mask::block_causal(16), Mask::block_causal(7), Mask::sliding_window(40),
          Mask::sliding_window(33, 0)};
}

class DenseMaskCpu : public ::testing::TestWithParam<MaskCase> {};

TEST_P(DenseMaskCpu, MatchesRef) {
  const MaskCase c = GetParam();
  std::mt19937 rng(4321);
  const Input q = make_input(c.batch, c.heads_q, c.len_q, c.head_dim, c.dtype, c.strided, rng);
  const Input k = make_input(c.batch, c.heads_kv, c.len_kv, c.head_dim, c.dtype, c.strided, rng);
  const Input v = make_input(c.batch, c.heads_kv, c.len_kv, c.head_dim, c.dtype, c.strided, rng);
  auto ref = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref, c.mask));
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto got = dense(q.view, k.view, v.view, with_backend(Backend::cpu, c.mask));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  expect_close(*ref, *got, c.dtype, c.name());
  // Rows that see no key (causal with len_q > len_kv): O = 0 exactly and LSE = -inf on the fast
  // path itself.
  for (int64_t row = 0; row < c.batch * c.heads_q * c.len_q; ++row) {
    const int64_t i = row % c.len_q;
    if (mask_key_begin(c.mask, i, c.len_q, c.len_kv) < mask_key_end(c.mask, i, c.len_q, c.len_kv)) continue;
    EXPECT_EQ(got->lse.ptr<float>()[row], kNegInf) << c.name() << " row " << i;
    for (int64_t t = 0; t < c.head_dim; ++t) ASSERT_EQ(load_as_double(got->out.view(), row * c.head_dim + t), 0.0);
  }
  // Negative control: the same output judged against the unmasked reference must fail (a
  // mask the fast path ignored would pass the comparison above only if it changed nothing).
  // Run where the mask hides at least a tenth of the pairs (hiding 2 keys of 1023 moves a bf16
  // output by less than its tolerance).
  int64_t hidden = 0;
  for (int64_t i = 0; i < c.len_q; ++i)
    hidden += c.len_kv - std::max<int64_t>(0, mask_key_end(c.mask, i, c.len_q, c.len_kv) -
                                                 mask_key_begin(c.mask, i, c.len_q, c.len_kv));
  if (hidden * 10 >= c.len_q * c.len_kv) {
    auto unmasked = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref));
    ASSERT_TRUE(unmasked.ok());
    EXPECT_GT(count_mismatches(*unmasked, *got, c.dtype, c.name(), false), 0)
        << c.name() << ": the masked result should differ from unmasked attention";
  }
}

std::vector<MaskCase> dense_mask_cases() {
  std::vector<MaskCase> cases;
  for (const Mask& m : test_masks()) {
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      for (int64_t d : {64, 128, 256}) {
        cases.push_back({1, 2, 1, 113, 113, d, dt, m});  // self-attention, lengths off every tile
      }
      cases.push_back({1, 2, 2, 70, 201, 128, dt, m});   // len_q < len_kv: queries at the end
      cases.push_back({1, 4, 2, 201, 70, 64, dt, m});    // len_q > len_kv: causal leaves empty rows
    }
    cases.push_back({2, 6, 2, 300, 300, 40, DType::f32, m, true});  // GQA 3:1, strided, several tiles
    cases.push_back({1, 2, 2, 1, 1, 64, DType::f32, m});
    cases.push_back({1, 1, 1, 3, 1023, 64, DType::bf16, m});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Masks, DenseMaskCpu, ::testing::ValuesIn(dense_mask_cases()),
                         [](const auto& info) { return info.param.name(); });

// Keys that the mask hides must not reach the result, even when they hold NaN (cpu_ref never
// reads them; the fast path either skips them or gives them weight 0 and redoes a row whose f32
// result the NaN reached, as it does for any non-finite row).
TEST(MaskCpu, HiddenKeysDoNotLeak) {
  std::mt19937 rng(11);
  const int64_t len = 150, d = 64;
  Input q = make_input(1, 1, len, d, DType::f32, false, rng);
  Input k = make_input(1, 1, len, d, DType::f32, false, rng);
  Input v = make_input(1, 1, len, d, DType::f32, false, rng);
  // The last key: hidden from every query but the last under causal.
  for (int64_t t = 0; t < d; ++t) {
    k.storage.ptr<float>()[(len - 1) * d + t] = std::numeric_limits<float>::quiet_NaN();
    v.storage.ptr<float>()[(len - 1) * d + t] = std::numeric_limits<float>::quiet_NaN();
  }
  auto ref = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref, Mask::causal()));
  auto got = dense(q.view, k.view, v.view, with_backend(Backend::cpu, Mask::causal()));
  ASSERT_TRUE(ref.ok() && got.ok());
  for (int64_t i = 0; i < len - 1; ++i) {
    ASSERT_TRUE(std::isfinite(got->lse.ptr<float>()[i])) << "row " << i;
    for (int64_t t = 0; t < d; ++t) ASSERT_TRUE(std::isfinite(got->out.ptr<float>()[i * d + t])) << "row " << i;
  }
  EXPECT_TRUE(std::isnan(got->lse.ptr<float>()[len - 1]));  // the last row sees the NaN key
  AttentionOutput ref_head, got_head;  // rows 0 .. len-2 only
  ref_head.out = HostArray(DType::f32, {1, 1, len - 1, d});
  got_head.out = HostArray(DType::f32, {1, 1, len - 1, d});
  ref_head.lse = HostArray(DType::f32, {1, 1, len - 1});
  got_head.lse = HostArray(DType::f32, {1, 1, len - 1});
  std::copy_n(ref->out.ptr<float>(), (len - 1) * d, ref_head.out.ptr<float>());
  std::copy_n(got->out.ptr<float>(), (len - 1) * d, got_head.out.ptr<float>());
  std::copy_n(ref->lse.ptr<float>(), len - 1, ref_head.lse.ptr<float>());
  std::copy_n(got->lse.ptr<float>(), len - 1, got_head.lse.ptr<float>());
  expect_close(ref_head, got_head, DType::f32, "causal with a NaN last key");
}

// ---- block-sparse with masks ---------------------------------------------------------------

struct SparseMaskCase {
  MaskCase shape;
  int block_q = 16, block_kv = 16;
  double keep = 0.6;
  bool perm = false;

  std::string name() const {
    return shape.name() + "_bq" + std::to_string(block_q) + "_bkv" + std::to_string(block_kv) +
           (perm ? "_perm" : "");
  }
};

// A random plan (every third query block empty), optionally with random permutations.
BlockIndexBuffer random_plan(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t len_q, int64_t len_kv,
                             int block_q, int block_kv, double keep, bool perm, std::mt19937& rng) {
  const int64_t nq = (len_q + block_q - 1) / block_q, nkv = (len_kv + block_kv - 1) / block_kv;
  BlockIndexBuffer plan = BlockIndexBuffer::empty(batch, heads_q, len_q, len_kv, block_q, block_kv, nkv);
  std::bernoulli_distribution take(keep);
  for (int64_t row = 0; row < batch * heads_q * nq; ++row) {
    int32_t count = 0;
    if (row % 3 != 1) {
      for (int32_t kb = 0; kb < nkv; ++kb)
        if (take(rng)) plan.indices.ptr<int32_t>()[row * nkv + count++] = kb;
    }
    plan.counts.ptr<int32_t>()[row] = count;
  }
  if (perm) {
    auto fill_perm = [&](HostArray& a, int64_t heads, int64_t len) {
      a = HostArray(DType::i32, {batch, heads, len});
      for (int64_t bh = 0; bh < batch * heads; ++bh) {
        int32_t* p = a.ptr<int32_t>() + bh * len;
        std::iota(p, p + len, 0);
        std::shuffle(p, p + len, rng);
      }
    };
    fill_perm(plan.perm_q, heads_q, len_q);
    fill_perm(plan.perm_kv, heads_kv, len_kv);
  }
  return plan;
}

class BlockSparseMaskCpu : public ::testing::TestWithParam<SparseMaskCase> {};

TEST_P(BlockSparseMaskCpu, MatchesRef) {
  const SparseMaskCase c = GetParam();
  const MaskCase& s = c.shape;
  std::mt19937 rng(98);
  const Input q = make_input(s.batch, s.heads_q, s.len_q, s.head_dim, s.dtype, s.strided, rng);
  const Input k = make_input(s.batch, s.heads_kv, s.len_kv, s.head_dim, s.dtype, s.strided, rng);
  const Input v = make_input(s.batch, s.heads_kv, s.len_kv, s.head_dim, s.dtype, s.strided, rng);
  const BlockIndexBuffer plan =
      random_plan(s.batch, s.heads_q, s.heads_kv, s.len_q, s.len_kv, c.block_q, c.block_kv, c.keep, c.perm, rng);
  auto ref = block_sparse(q.view, k.view, v.view, plan.view(), with_backend(Backend::cpu_ref, s.mask));
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto got = block_sparse(q.view, k.view, v.view, plan.view(), with_backend(Backend::cpu, s.mask));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  expect_close(*ref, *got, s.dtype, c.name());
  if (!s.mask.is_none()) {  // negative control: the plan without its mask gives another answer
    auto unmasked = block_sparse(q.view, k.view, v.view, plan.view(), with_backend(Backend::cpu_ref));
    ASSERT_TRUE(unmasked.ok());
    EXPECT_GT(count_mismatches(*unmasked, *got, s.dtype, c.name(), false), 0) << c.name();
  }
}

std::vector<SparseMaskCase> sparse_mask_cases() {
  std::vector<SparseMaskCase> cases;
  for (const Mask& m : test_masks()) {
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      for (int64_t d : {64, 128, 256}) cases.push_back({{1, 2, 1, 130, 130, d, dt, m}, 16, 16, 0.6, false});
      cases.push_back({{1, 4, 2, 113, 200, 64, dt, m}, 32, 16, 0.7, true});  // permuted, len_q < len_kv
    }
    cases.push_back({{2, 2, 2, 200, 90, 40, DType::f32, m}, 64, 24, 0.8, false});  // len_q > len_kv
    cases.push_back({{1, 2, 2, 300, 300, 64, DType::f32, m, true}, 128, 32, 0.5, true});  // blocks > a tile
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Masks, BlockSparseMaskCpu, ::testing::ValuesIn(sparse_mask_cases()),
                         [](const auto& info) { return info.param.name(); });

// masked_full_plan lists exactly the key blocks that hold a visible (query, key) pair of the
// query block (brute force over the element rule), and with it block_sparse equals masked dense
// (the plan's two oracles: the dense reference under the same mask, and the sparse reference).
TEST(MaskedPlan, ListsExactlyTheBlocksWithAVisiblePair) {
  for (const Mask& m : all_masks()) {
    for (auto [len_q, len_kv, bq, bkv] : {std::tuple<int64_t, int64_t, int, int>{100, 100, 16, 16},
                                          {37, 90, 8, 12}, {90, 37, 12, 8}, {64, 64, 64, 16}, {5, 5, 1, 1}}) {
      const BlockIndexBuffer plan = masked_full_plan(2, 3, len_q, len_kv, bq, bkv, m);
      ASSERT_TRUE(validate_block_index(plan.view(), 2, 3, 3, len_q, len_kv).ok()) << mask_string(m);
      const int64_t nq = plan.num_q_blocks, nkv = plan.num_kv_blocks, cap = plan.view().capacity();
      for (int64_t row = 0; row < 2 * 3 * nq; ++row) {
        const int64_t qb = row % nq;
        std::vector<int32_t> expected;
        for (int64_t kb = 0; kb < nkv; ++kb) {
          bool any = false;
          for (int64_t i = qb * bq; i < std::min<int64_t>((qb + 1) * bq, len_q); ++i)
            for (int64_t j = kb * bkv; j < std::min<int64_t>((kb + 1) * bkv, len_kv); ++j)
              any = any || mask_visible(m, i, j, len_q, len_kv);
          if (any) expected.push_back(static_cast<int32_t>(kb));
        }
        const int32_t count = plan.counts.ptr<int32_t>()[row];
        std::vector<int32_t> listed(plan.indices.ptr<int32_t>() + row * cap, plan.indices.ptr<int32_t>() + row * cap + count);
        ASSERT_EQ(listed, expected) << mask_string(m) << " query block " << qb;
      }
    }
  }
  // Fully masked blocks are left out: a causal plan over 8 x 8 blocks lists 36 of the 64.
  const BlockIndexBuffer causal = masked_full_plan(1, 1, 128, 128, 16, 16, Mask::causal());
  int64_t listed = 0;
  for (int64_t qb = 0; qb < 8; ++qb) listed += causal.counts.ptr<int32_t>()[qb];
  EXPECT_EQ(listed, 36);
}

TEST(MaskedPlan, BlockSparseOverItEqualsMaskedDense) {
  std::mt19937 rng(3);
  const Input q = make_input(1, 4, 150, 64, DType::f32, false, rng);
  const Input k = make_input(1, 2, 170, 64, DType::f32, false, rng);
  const Input v = make_input(1, 2, 170, 64, DType::f32, false, rng);
  for (const Mask& m : test_masks()) {
    const BlockIndexBuffer plan = masked_full_plan(1, 4, 150, 170, 32, 16, m);
    auto ref = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref, m));
    ASSERT_TRUE(ref.ok());
    for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
      auto got = block_sparse(q.view, k.view, v.view, plan.view(), with_backend(be, m));
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      expect_close(*ref, *got, DType::f32, mask_string(m) + " " + backend_name(be));
    }
  }
}

// BA-Att's executor takes the mask (on original positions, through the norm-sort permutation).
TEST(MaskBaAtt, ExecutorMasksOriginalPositions) {
  std::mt19937 rng(17);
  const Input q = make_input(1, 2, 200, 64, DType::f32, false, rng);
  const Input k = make_input(1, 2, 200, 64, DType::f32, false, rng);
  const Input v = make_input(1, 2, 200, 64, DType::f32, false, rng);
  BaAttOptions options;
  options.block_q = options.block_kv = 32;
  options.budget = Budget::density(0.6);
  options.mask = Mask::block_causal(16);
  auto plan = ba_att_plan(q.view, k.view, options);
  ASSERT_TRUE(plan.ok());
  auto got = ba_att(q.view, k.view, v.view, options);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  auto ref = block_sparse(q.view, k.view, v.view, plan->view(), with_backend(Backend::cpu_ref, options.mask));
  ASSERT_TRUE(ref.ok());
  expect_close(*ref, *got, DType::f32, "ba_att block_causal(16)");
  auto unmasked = block_sparse(q.view, k.view, v.view, plan->view(), with_backend(Backend::cpu_ref));
  ASSERT_TRUE(unmasked.ok());
  EXPECT_GT(count_mismatches(*unmasked, *got, DType::f32, "ba_att", false), 0);
}

// ---- BA-Att with a selection that sees the mask (mask_aware) ----------------------------------

// The plan mask_aware must give, stated independently: per query block, the key blocks with no
// visible pair are out, those holding the last key a query of the block sees are kept (with a
// mask), and the budget picks among the rest by BA-Att's block logit (ties to the lower block),
// counted over all the blocks with a visible pair.
std::vector<int32_t> expected_mask_aware_row(const Mask& m, const float* logits, int64_t qb, int64_t len_q,
                                             int64_t len_kv, int bq, int bkv, const Budget& budget) {
  const int64_t nkv = (len_kv + bkv - 1) / bkv;
  std::vector<int> kind(nkv, 0);  // 0 hidden, 1 visible, 2 holds a query's last visible key
  for (int64_t i = qb * bq; i < std::min<int64_t>((qb + 1) * bq, len_q); ++i) {
    int64_t last = -1;
    for (int64_t j = 0; j < len_kv; ++j) {
      if (!mask_visible(m, i, j, len_q, len_kv)) continue;
      kind[j / bkv] = std::max(kind[j / bkv], 1);
      last = j;
    }
    if (last >= 0 && !m.is_none()) kind[last / bkv] = 2;
  }
  std::vector<int32_t> cut, whole;  // forced first, then the candidates
  for (int64_t kb = 0; kb < nkv; ++kb) {
    if (kind[kb] == 2) cut.push_back(static_cast<int32_t>(kb));
    if (kind[kb] == 1) whole.push_back(static_cast<int32_t>(kb));
  }
  const int64_t n = static_cast<int64_t>(cut.size() + whole.size());
  if (n == 0) return {};
  std::stable_sort(whole.begin(), whole.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  std::vector<int32_t> order = cut;
  order.insert(order.end(), whole.begin(), whole.end());
  int64_t keep = 0;
  if (budget.kind == BudgetKind::top_kappa) {
    keep = std::min<int64_t>(static_cast<int64_t>(budget.value), n);
  } else if (budget.kind == BudgetKind::density) {
    keep = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(budget.value * static_cast<double>(n) - 1e-9)), 1, n);
  } else {
    double top = -std::numeric_limits<double>::infinity(), total = 0, sum = 0;
    for (int32_t kb : order) top = std::max(top, static_cast<double>(logits[kb]));
    for (int32_t kb : order) total += std::exp(logits[kb] - top);
    while (keep < n && sum < budget.value * total) sum += std::exp(logits[order[keep++]] - top);
  }
  keep = std::max<int64_t>(keep, static_cast<int64_t>(cut.size()));
  std::vector<int32_t> row(order.begin(), order.begin() + keep);
  std::sort(row.begin(), row.end());
  return row;
}

TEST(MaskAwareBaAtt, PlanKeepsTheCutBlocksAndTheBestVisibleOnes) {
  std::mt19937 rng(41);
  for (const Mask& m : all_masks()) {
    for (auto [len_q, len_kv, bq, bkv] : {std::tuple<int64_t, int64_t, int, int>{100, 100, 16, 16},
                                          {37, 90, 8, 12}, {90, 37, 12, 8}, {203, 203, 16, 8}}) {
      const Input q = make_input(1, 4, len_q, 32, DType::f32, false, rng);
      const Input k = make_input(1, 2, len_kv, 32, DType::f32, false, rng);
      for (Budget budget : {Budget::density(0.3), Budget::top_kappa(2), Budget::mass(0.8)}) {
        for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
          BaAttOptions o;
          o.block_q = bq;
          o.block_kv = bkv;
          o.sort_q = o.sort_k = false;
          o.compensate = budget.kind != BudgetKind::mass;
          o.budget = budget;
          o.backend = be;
          o.mask = m;
          o.mask_aware = true;
          auto scores = ba_att_scores(q.view, k.view, o);
          ASSERT_TRUE(scores.ok()) << scores.status().to_string();
          auto plan = ba_att_plan(q.view, k.view, o);
          ASSERT_TRUE(plan.ok()) << plan.status().to_string();
          const std::string what = mask_string(m) + " " + describe(budget) + " " + backend_name(be) + " " +
                                   std::to_string(len_q) + "x" + std::to_string(len_kv);
          ASSERT_TRUE(validate_block_index(plan->view(), 1, 4, 2, len_q, len_kv).ok()) << what;
          const int64_t nq = plan->num_q_blocks, nkv = plan->num_kv_blocks, cap = plan->view().capacity();
          for (int64_t row = 0; row < 4 * nq; ++row) {
            const std::vector<int32_t> expected = expected_mask_aware_row(
                m, scores->logits.ptr<float>() + row * nkv, row % nq, len_q, len_kv, bq, bkv, budget);
            const int32_t count = plan->counts.ptr<int32_t>()[row];
            const int32_t* ix = plan->indices.ptr<int32_t>() + row * cap;
            ASSERT_EQ(std::vector<int32_t>(ix, ix + count), expected) << what << " row " << row;
          }
        }
      }
    }
  }
}

// The engine's use: a causal or block-causal prefill (and the other masks, len_q == len_kv, where
// every query sees itself). Every query keeps the block of the last key it sees, so even one key
// block a row leaves no query without keys; with every visible block kept, ba_att is masked
// dense attention; and a sparse plan differs from it.
TEST(MaskAwareBaAtt, EveryQueryKeepsKeysAndFullDensityIsMaskedDense) {
  std::mt19937 rng(43);
  const Input q = make_input(1, 4, 300, 64, DType::f32, false, rng);
  const Input k = make_input(1, 2, 300, 64, DType::f32, false, rng);
  const Input v = make_input(1, 2, 300, 64, DType::f32, false, rng);
  for (const Mask& m : all_masks()) {
    for (auto [bq, bkv] : {std::pair<int, int>{32, 16}, {16, 16}, {64, 64}, {16, 48}}) {
      const std::string what = mask_string(m) + " blocks " + std::to_string(bq) + "/" + std::to_string(bkv);
      BaAttOptions o;
      o.block_q = bq;
      o.block_kv = bkv;
      o.sort_q = o.sort_k = false;
      o.mask = m;
      o.mask_aware = true;
      o.budget = Budget::top_kappa(1);
      auto sparse = ba_att(q.view, k.view, v.view, o);
      ASSERT_TRUE(sparse.ok()) << sparse.status().to_string();
      for (int64_t i = 0; i < sparse->lse.numel(); ++i) {
        ASSERT_TRUE(std::isfinite(sparse->lse.ptr<float>()[i])) << what << " row " << i;
      }
      auto ref = dense(q.view, k.view, v.view, with_backend(Backend::cpu_ref, m));
      ASSERT_TRUE(ref.ok());
      if (m.kind == MaskKind::causal || m.kind == MaskKind::block_causal) {
        EXPECT_GT(count_mismatches(*ref, *sparse, DType::f32, "kappa 1", false), 0) << what;
      }
      o.budget = Budget::density(1.0);
      auto full = ba_att(q.view, k.view, v.view, o);
      ASSERT_TRUE(full.ok()) << full.status().to_string();
      expect_close(*ref, *full, DType::f32, "mask_aware density 1 " + what);
    }
  }
}

TEST(MaskAwareBaAtt, RefusesNormSortsByName) {
  std::mt19937 rng(47);
  const Input q = make_input(1, 2, 64, 16, DType::f32, false, rng);
  BaAttOptions o;
  o.mask = Mask::causal();
  o.mask_aware = true;
  o.sort_q = false;  // sort_k still on
  for (Backend be : {Backend::cpu, Backend::cpu_ref}) {  // (the cuda backend: test_ba_att_cuda.cpp)
    o.backend = be;
    auto plan = ba_att_plan(q.view, q.view, o);
    ASSERT_FALSE(plan.ok());
    EXPECT_NE(plan.status().message().find("mask_aware: "), std::string::npos) << plan.status().to_string();
  }
}

// ---- variable-length batches ------------------------------------------------------------------

// A varlen operand [total, heads, d] of normal values.
HostArray varlen_input(int64_t total, int64_t heads, int64_t d, DType dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  HostArray f32(DType::f32, {total, heads, d});
  for (int64_t i = 0; i < f32.numel(); ++i) f32.ptr<float>()[i] = normal(rng);
  return dtype == DType::f32 ? std::move(f32) : convert(f32.view(), dtype).value();
}

HostArray offsets(const std::vector<int32_t>& lens) {
  HostArray a(DType::i32, {static_cast<int64_t>(lens.size()) + 1});
  for (size_t s = 0; s < lens.size(); ++s) a.ptr<int32_t>()[s + 1] = a.ptr<int32_t>()[s] + lens[s];
  return a;
}

// Sequence s of a varlen operand as a [1, heads, len, d] view.
Tensor sequence_view(const HostArray& a, int64_t begin, int64_t len) {
  Tensor t = a.view();
  const int64_t heads = t.shape[1], d = t.shape[2];
  t.data = static_cast<char*>(t.data) + begin * heads * d * static_cast<int64_t>(dtype_size(t.dtype));
  t.ndim = 4;
  t.shape[0] = 1;
  t.shape[1] = heads;
  t.shape[2] = len;
  t.shape[3] = d;
  t.strides[0] = 0;
  t.strides[1] = d;
  t.strides[2] = heads * d;
  t.strides[3] = 1;
  return t;
}

struct VarlenCase {
  std::vector<int32_t> lens_q, lens_kv;
  int64_t heads_q = 4, heads_kv = 2, head_dim = 64;
  DType dtype = DType::f32;
  Mask mask;
  bool sparse = false;
  bool perm = false;

  std::string name() const {
    std::string n = mask_label(mask) + (sparse ? "_sparse" : "_dense") + (perm ? "_perm" : "") + "_d" +
                    std::to_string(head_dim) + "_" + dtype_name(dtype) + "_q";
    for (int32_t l : lens_q) n += std::to_string(l) + "x";
    n += "_kv";
    for (int32_t l : lens_kv) n += std::to_string(l) + "x";
    return n;
  }
};

// The plan of a varlen batch: one random plan per sequence, laid into rows of the longest.
BlockIndexBuffer varlen_plan(const VarlenCase& c, int block, std::mt19937& rng) {
  const int64_t seqs = static_cast<int64_t>(c.lens_q.size());
  const int64_t max_q = *std::max_element(c.lens_q.begin(), c.lens_q.end());
  const int64_t max_kv = *std::max_element(c.lens_kv.begin(), c.lens_kv.end());
  const int64_t nq = (max_q + block - 1) / block, nkv = (max_kv + block - 1) / block;
  BlockIndexBuffer plan = BlockIndexBuffer::empty(seqs, c.heads_q, max_q, max_kv, block, block, nkv);
  if (c.perm) {
    plan.perm_q = HostArray(DType::i32, {seqs, c.heads_q, max_q});
    plan.perm_kv = HostArray(DType::i32, {seqs, c.heads_kv, max_kv});
  }
  std::bernoulli_distribution take(0.7);
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t snq = (c.lens_q[s] + block - 1) / block, snkv = (c.lens_kv[s] + block - 1) / block;
    for (int64_t h = 0; h < c.heads_q; ++h) {
      for (int64_t qb = 0; qb < nq; ++qb) {
        const int64_t row = (s * c.heads_q + h) * nq + qb;
        int32_t count = 0;
        // Rows past the sequence's query blocks are ignored: fill them with junk to prove it.
        if (qb >= snq) {
          plan.counts.ptr<int32_t>()[row] = static_cast<int32_t>(nkv);
          for (int32_t kb = 0; kb < nkv; ++kb) plan.indices.ptr<int32_t>()[row * nkv + kb] = kb;
          continue;
        }
        for (int32_t kb = 0; kb < snkv; ++kb)
          if (take(rng)) plan.indices.ptr<int32_t>()[row * nkv + count++] = kb;
        plan.counts.ptr<int32_t>()[row] = count;
      }
    }
    if (c.perm) {
      auto fill = [&](HostArray& a, int64_t heads, int64_t max_len, int64_t len) {
        for (int64_t h = 0; h < heads; ++h) {
          int32_t* p = a.ptr<int32_t>() + (s * heads + h) * max_len;
          std::iota(p, p + len, 0);
          std::shuffle(p, p + len, rng);
          std::fill(p + len, p + max_len, -7);  // past the sequence: ignored
        }
      };
      fill(plan.perm_q, c.heads_q, max_q, c.lens_q[s]);
      fill(plan.perm_kv, c.heads_kv, max_kv, c.lens_kv[s]);
    }
  }
  return plan;
}

class VarlenCpu : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenCpu, MatchesRefAndSeparateCalls) {
  const VarlenCase c = GetParam();
  std::mt19937 rng(2024);
  const int64_t total_q = std::accumulate(c.lens_q.begin(), c.lens_q.end(), int64_t{0});
  const int64_t total_kv = std::accumulate(c.lens_kv.begin(), c.lens_kv.end(), int64_t{0});
  const HostArray q = varlen_input(total_q, c.heads_q, c.head_dim, c.dtype, rng);
  const HostArray k = varlen_input(total_kv, c.heads_kv, c.head_dim, c.dtype, rng);
  const HostArray v = varlen_input(total_kv, c.heads_kv, c.head_dim, c.dtype, rng);
  const HostArray cu_q = offsets(c.lens_q), cu_kv = offsets(c.lens_kv);
  const BlockIndexBuffer plan = c.sparse ? varlen_plan(c, 16, rng) : BlockIndexBuffer{};
  auto run = [&](Backend be, Mask mask) {
    return c.sparse ? block_sparse_varlen(q.view(), k.view(), v.view(), cu_q.view(), cu_kv.view(), plan.view(),
                                          with_backend(be, mask))
                    : dense_varlen(q.view(), k.view(), v.view(), cu_q.view(), cu_kv.view(), with_backend(be, mask));
  };
  auto ref = run(Backend::cpu_ref, c.mask);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto got = run(Backend::cpu, c.mask);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_EQ(got->out.view().shape_vector(), (std::vector<int64_t>{total_q, c.heads_q, c.head_dim}));
  ASSERT_EQ(got->lse.view().shape_vector(), (std::vector<int64_t>{c.heads_q, total_q}));
  expect_close(*ref, *got, c.dtype, c.name());

  // Each sequence alone, as a fixed-length call of the same backend (cpu_ref: the same f64
  // operations, so bit-identical to the varlen reference), with its own rows of the plan.
  for (size_t s = 0; s < c.lens_q.size(); ++s) {
    const int64_t bq = cu_q.ptr<int32_t>()[s], lq = c.lens_q[s];
    const int64_t bkv = cu_kv.ptr<int32_t>()[s], lkv = c.lens_kv[s];
    for (int64_t i = 0; i < lq; ++i) {
      for (int64_t h = 0; h < c.heads_q; ++h) {
        if (lkv == 0) {  // a sequence with queries and no keys: empty rows
          EXPECT_EQ(got->lse.ptr<float>()[h * total_q + bq + i], kNegInf);
          EXPECT_EQ(ref->lse.ptr<float>()[h * total_q + bq + i], kNegInf);
          for (int64_t t = 0; t < c.head_dim; ++t)
            ASSERT_EQ(load_as_double(got->out.view(), ((bq + i) * c.heads_q + h) * c.head_dim + t), 0.0);
        }
      }
    }
    if (lq == 0 || lkv == 0) continue;
    const Tensor qs = sequence_view(q, bq, lq), ks = sequence_view(k, bkv, lkv), vs = sequence_view(v, bkv, lkv);
    BlockIndexBuffer one;
    if (c.sparse) {  // sequence s's rows as a plan of its own
      const int64_t nq = (lq + 15) / 16, nkv = (lkv + 15) / 16, full_nq = plan.num_q_blocks, cap = nkv;
      one = BlockIndexBuffer::empty(1, c.heads_q, lq, lkv, 16, 16, cap);
      for (int64_t h = 0; h < c.heads_q; ++h) {
        for (int64_t qb = 0; qb < nq; ++qb) {
          const int64_t src = (s * c.heads_q + h) * full_nq + qb;
          const int32_t count = plan.counts.ptr<int32_t>()[src];
          one.counts.ptr<int32_t>()[h * nq + qb] = count;
          std::copy_n(plan.indices.ptr<int32_t>() + src * plan.view().capacity(), count,
                      one.indices.ptr<int32_t>() + (h * nq + qb) * cap);
        }
      }
      if (c.perm) {
        one.perm_q = HostArray(DType::i32, {1, c.heads_q, lq});
        one.perm_kv = HostArray(DType::i32, {1, c.heads_kv, lkv});
        for (int64_t h = 0; h < c.heads_q; ++h)
          std::copy_n(plan.perm_q.ptr<int32_t>() + (s * c.heads_q + h) * plan.perm_q.view().shape_vector()[2], lq,
                      one.perm_q.ptr<int32_t>() + h * lq);
        for (int64_t h = 0; h < c.heads_kv; ++h)
          std::copy_n(plan.perm_kv.ptr<int32_t>() + (s * c.heads_kv + h) * plan.perm_kv.view().shape_vector()[2], lkv,
                      one.perm_kv.ptr<int32_t>() + h * lkv);
      }
    }
    auto alone = c.sparse ? block_sparse(qs, ks, vs, one.view(), with_backend(Backend::cpu_ref, c.mask))
                          : dense(qs, ks, vs, with_backend(Backend::cpu_ref, c.mask));
    ASSERT_TRUE(alone.ok()) << alone.status().to_string();
    for (int64_t h = 0; h < c.heads_q; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        ASSERT_EQ(alone->lse.ptr<float>()[h * lq + i], ref->lse.ptr<float>()[h * total_q + bq + i])
            << c.name() << " sequence " << s << " head " << h << " row " << i;
        for (int64_t t = 0; t < c.head_dim; ++t) {
          ASSERT_EQ(load_as_double(alone->out.view(), (h * lq + i) * c.head_dim + t),
                    load_as_double(ref->out.view(), ((bq + i) * c.heads_q + h) * c.head_dim + t))
              << c.name() << " sequence " << s;
        }
      }
    }
  }

  // Negative control: one sequence over the whole batch (boundaries ignored) is another answer
  // (once per mask and dtype: at head_dim 64; the f64 reference over the whole batch is the
  // costliest part of these cases).
  if (!c.sparse && c.lens_q.size() > 1 && c.head_dim == 64) {
    HostArray one_q = offsets({static_cast<int32_t>(total_q)}), one_kv = offsets({static_cast<int32_t>(total_kv)});
    auto merged = dense_varlen(q.view(), k.view(), v.view(), one_q.view(), one_kv.view(),
                               with_backend(Backend::cpu_ref, c.mask));
    ASSERT_TRUE(merged.ok()) << merged.status().to_string();
    EXPECT_GT(count_mismatches(*merged, *got, c.dtype, c.name(), false), 0) << c.name();
  }
}

std::vector<VarlenCase> varlen_cases() {
  std::vector<VarlenCase> cases;
  // Awkward lengths: empty sequences (no queries; no keys; neither), a single token, lengths off
  // every tile and block, len_q != len_kv within a sequence.
  const std::vector<int32_t> lens_q = {37, 0, 130, 1, 64, 5, 0};
  const std::vector<int32_t> lens_kv = {37, 20, 90, 1, 200, 0, 0};
  for (const Mask& m : test_masks()) {
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      for (int64_t d : {64, 128, 256}) {
        cases.push_back({lens_q, lens_kv, 4, 2, d, dt, m, false, false});
      }
      cases.push_back({lens_q, lens_kv, 4, 2, 64, dt, m, true, false});
      cases.push_back({lens_q, lens_kv, 2, 1, 128, dt, m, true, true});
    }
    cases.push_back({{300}, {257}, 2, 2, 64, DType::f32, m, false, false});  // one sequence
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Batches, VarlenCpu, ::testing::ValuesIn(varlen_cases()),
                         [](const auto& info) { return info.param.name(); });

// ---- varlen errors -------------------------------------------------------------------------

struct VarlenArgs {
  HostArray q, k, v, cu_q, cu_kv;
  VarlenArgs() {
    std::mt19937 rng(1);
    q = varlen_input(10, 2, 16, DType::f32, rng);
    k = varlen_input(12, 2, 16, DType::f32, rng);
    v = varlen_input(12, 2, 16, DType::f32, rng);
    cu_q = offsets({4, 6});
    cu_kv = offsets({5, 7});
  }
};

std::string varlen_error(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_kv,
                         Backend be = Backend::cpu) {
  auto r = dense_varlen(q, k, v, cu_q, cu_kv, with_backend(be));
  return r.ok() ? "ok" : r.status().message();
}

TEST(VarlenErrors, BadOffsetsNameTheArgument) {
  for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
    VarlenArgs a;
    ASSERT_EQ(varlen_error(a.q.view(), a.k.view(), a.v.view(), a.cu_q.view(), a.cu_kv.view(), be), "ok");
    auto expect = [&](const std::string& got, const std::string& prefix, const std::string& part) {
      EXPECT_EQ(got.rfind(prefix, 0), 0u) << got;
      EXPECT_NE(got.find(part), std::string::npos) << got;
    };
    HostArray bad = offsets({4, 6});
    bad.ptr<int32_t>()[0] = 1;  // not starting at 0
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), bad.view(), a.cu_kv.view(), be), "cu_seqlens_q",
           "cu_seqlens_q[0] = 0, got 1");
    HostArray dec = offsets({5, 7});
    dec.ptr<int32_t>()[1] = 13;  // 0, 13, 12: decreasing
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), a.cu_q.view(), dec.view(), be), "cu_seqlens_kv",
           "must not decrease");
    HostArray short_total = offsets({4, 5});  // ends at 9, q has 10 rows
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), short_total.view(), a.cu_kv.view(), be),
           "cu_seqlens_q", "must equal q's first dimension 10");
    HostArray three = offsets({4, 6, 0});  // 3 sequences against 2
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), three.view(), a.cu_kv.view(), be), "cu_seqlens_kv",
           "4 offsets");
    HostArray wrong_dtype(DType::f32, {3});
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), wrong_dtype.view(), a.cu_kv.view(), be), "cu_seqlens_q",
           "i32");
    HostArray one_offset(DType::i32, {1});
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), one_offset.view(), a.cu_kv.view(), be), "cu_seqlens_q",
           "at least 2 offsets");
    HostArray q4(DType::f32, {1, 10, 2, 16});
    expect(varlen_error(q4.view(), a.k.view(), a.v.view(), a.cu_q.view(), a.cu_kv.view(), be), "q",
           "[total_q, heads_q, head_dim]");
    expect(varlen_error(a.q.view(), a.k.view(), a.v.view(), a.cu_q.view(), Tensor{}, be), "cu_seqlens_kv",
           "missing");
  }
}

TEST(VarlenErrors, BadPlanNamesTheSequence) {
  VarlenArgs a;
  BlockIndexBuffer plan = BlockIndexBuffer::empty(2, 2, 6, 7, 4, 4, 2);
  // Sequence 0 has 5 keys (2 key blocks); sequence 1 has 7 (2 blocks): block 2 exists in neither.
  plan.counts.ptr<int32_t>()[4] = 1;  // row (sequence 1, head 0, query block 0) = (1 * 2 + 0) * 2 + 0
  plan.indices.ptr<int32_t>()[4 * 2] = 2;
  auto r = block_sparse_varlen(a.q.view(), a.k.view(), a.v.view(), a.cu_q.view(), a.cu_kv.view(), plan.view(),
                               with_backend(Backend::cpu));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("sequence 1", 0), 0u) << r.status().message();
  EXPECT_NE(r.status().message().find("index"), std::string::npos) << r.status().message();
  BlockIndexBuffer wrong_rows = BlockIndexBuffer::empty(3, 2, 6, 7, 4, 4, 2);  // 3 sequences, not 2
  auto w = block_sparse_varlen(a.q.view(), a.k.view(), a.v.view(), a.cu_q.view(), a.cu_kv.view(), wrong_rows.view(),
                               with_backend(Backend::cpu));
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().message().rfind("index.counts", 0), 0u) << w.status().message();
}

}  // namespace
