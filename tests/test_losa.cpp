// LoSA: the per-layer prefix-attention state machine and its baselines.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "sparsa/losa.h"
#include "test_util.h"

using namespace sparsa;

namespace {

using sparsa_test::randn;

bool has(const Status& s, const char* what) { return !s.ok() && s.message().find(what) != std::string::npos; }

// A small decode: a random prefix, then blocks whose queries drift a little every step
// and where a few rows jump (unmasked) — enough to exercise every path.
struct Trace {
  int64_t Hq, Hkv, B, D;
  PagedKVCache cache;
  std::mt19937 rng{123};
  HostArray q, k, v;  // current block inputs

  Trace(int64_t hq, int64_t hkv, int64_t b, int64_t d, int64_t prefix) : Hq(hq), Hkv(hkv), B(b), D(d) {
    cache = std::move(PagedKVCache::create({hkv, d, 16})).value();
    if (prefix > 0) {
      HostArray kp = randn({1, hkv, prefix, d}, 1), vp = randn({1, hkv, prefix, d}, 2);
      EXPECT_TRUE(cache.append(kp.view(), vp.view()).ok());
    }
    new_block(7);
  }
  void new_block(uint32_t seed) {
    q = randn({1, Hq, B, D}, seed);
    k = randn({1, Hkv, B, D}, seed + 1);
    v = randn({1, Hkv, B, D}, seed + 2);
  }
  // Every row drifts by `drift`; rows in `jump` move by a fresh N(0, 1) vector.
  void advance(float drift, std::vector<int64_t> jump) {
    std::normal_distribution<float> nd;
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < B; ++i) {
        const bool j = std::find(jump.begin(), jump.end(), i) != jump.end();
        for (int64_t t = 0; t < D; ++t) {
          float& x = q.ptr<float>()[(h * B + i) * D + t];
          x = j ? nd(rng) : x + drift * nd(rng);
        }
      }
    for (HostArray* a : {&k, &v})
      for (int64_t i = 0; i < a->numel(); ++i) a->ptr<float>()[i] += drift * nd(rng);
  }
};

PrefixAttention make(const Trace& t, LosaOptions o) {
  auto pa = PrefixAttention::create({t.Hq, t.Hkv, t.D, t.B}, o);
  EXPECT_TRUE(pa.ok()) << pa.status().to_string();
  return std::move(pa).value();
}

struct Out {
  HostArray o, l;
  Out(const Trace& t) : o(DType::f32, {1, t.Hq, t.B, t.D}), l(DType::f32, {1, t.Hq, t.B}) {}
};

double max_abs_diff(const HostArray& a, const HostArray& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float x = a.ptr<float>()[i], y = b.ptr<float>()[i];
    if (x == y) continue;  // both -inf
    m = std::max(m, std::abs(double{x} - y));
  }
  return m;
}

bool rows_equal(const HostArray& a, const HostArray& b, int64_t H, int64_t B, int64_t row_elems, int64_t row) {
  for (int64_t h = 0; h < H; ++h)
    if (std::memcmp(a.ptr<float>() + (h * B + row) * row_elems, b.ptr<float>() + (h * B + row) * row_elems,
                    row_elems * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace

// (1) Every token active and a full budget: LoSA is dense prefix attention at every step,
// across commits (the second block straddles a page boundary: prefix 200 = 12.5 pages).
TEST(Losa, AllActiveFullBudgetEqualsDenseEveryStep) {
  for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
    for (bool uni : {false, true}) {
      Trace t(4, 2, 16, 32, 200);
      LosaOptions lo;
      lo.active_k = 16;
      lo.select.budget = 16 * 64;
      lo.attend_union = uni;
      lo.attention.backend = be;
      LosaOptions dn = lo;
      dn.method = PrefixMethod::dense;
      PrefixAttention losa = make(t, lo), ref = make(t, dn);
      Out a(t), b(t);
      for (int blk = 0; blk < 2; ++blk) {
        for (int s = 0; s < 5; ++s) {
          StepStats st;
          ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
          ASSERT_TRUE(ref.step(t.cache, t.q.view(), t.k.view(), t.v.view(), b.o.view(), b.l.view()).ok());
          EXPECT_EQ(st.dense_prefix, s == 0);
          EXPECT_EQ(st.recomputed.size(), 16u);
          // f32 accumulation over <= 232 keys vs the same math in another executor order.
          EXPECT_LT(max_abs_diff(a.o, b.o), 1e-5) << "block " << blk << " step " << s;
          EXPECT_LT(max_abs_diff(a.l, b.l), 1e-5) << "block " << blk << " step " << s;
          t.advance(0.1f, {s % 16});
        }
        ASSERT_TRUE(losa.commit(t.cache, t.k.view(), t.v.view()).ok());
        ref.begin_block();  // both layers read one cache; only one appends to it
        t.new_block(100 + blk);
      }
    }
  }
}

// (2) quest with a full budget is dense, every step, and it never reuses.
TEST(Losa, QuestFullBudgetEqualsDense) {
  Trace t(6, 3, 5, 16, 16 * 9 + 11);
  LosaOptions qo;
  qo.method = PrefixMethod::quest;
  qo.select.budget = 16 * 10;
  LosaOptions dn = qo;
  dn.method = PrefixMethod::dense;
  PrefixAttention quest = make(t, qo), ref = make(t, dn);
  Out a(t), b(t);
  for (int s = 0; s < 4; ++s) {
    StepStats st;
    ASSERT_TRUE(quest.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
    ASSERT_TRUE(ref.step(t.cache, t.q.view(), t.k.view(), t.v.view(), b.o.view(), b.l.view()).ok());
    EXPECT_FALSE(st.dense_prefix);
    EXPECT_EQ(st.recomputed.size(), 5u);
    EXPECT_EQ(st.pages_loaded, 10 * 3);
    EXPECT_LT(max_abs_diff(a.o, b.o), 1e-5);
    EXPECT_LT(max_abs_diff(a.l, b.l), 1e-5);
    t.advance(0.3f, {});
  }
}

// (3)-(5), (7): first step dense; later steps recompute exactly the top-K rows by MSE,
// stable rows keep O_p, L_p, Q_ref bit for bit, active rows get Q_ref = Q and the sparse
// result of the selector; the loaded union per kv head is the union of the plan's pages.
TEST(Losa, StateMachineUpdatesOnlyActiveRows) {
  for (Backend be : {Backend::cpu_ref, Backend::cpu}) {
    Trace t(8, 2, 16, 16, 16 * 30 + 5);
    LosaOptions lo;
    lo.active_k = 3;
    lo.select.budget = 64;
    lo.attention.backend = be;
    PrefixAttention losa = make(t, lo);
    Out a(t);
    StepStats st;
    ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
    // First step: dense for every row, bitwise the dense executor on the cache.
    EXPECT_TRUE(st.dense_prefix);
    EXPECT_EQ(st.pages_loaded, 31 * 2);
    AttentionOptions ao;
    ao.backend = be;
    auto d0 = dense(t.q.view(), t.cache.keys(), t.cache.values(), ao);
    ASSERT_TRUE(d0.ok());
    EXPECT_EQ(std::memcmp(losa.o_p().data(), d0->out.data(), d0->out.nbytes()), 0);
    EXPECT_EQ(std::memcmp(losa.l_p().data(), d0->lse.data(), d0->lse.nbytes()), 0);
    EXPECT_EQ(std::memcmp(losa.q_ref().data(), t.q.data(), t.q.nbytes()), 0);

    for (int s = 1; s < 6; ++s) {
      const std::vector<int64_t> jump = {(2 * s) % 16, (5 * s + 1) % 16};
      t.advance(0.01f, jump);
      HostArray o_before = HostArray::copy_of(losa.o_p().view()), l_before = HostArray::copy_of(losa.l_p().view()),
                q_before = HostArray::copy_of(losa.q_ref().view());
      ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
      EXPECT_FALSE(st.dense_prefix);
      ASSERT_EQ(st.recomputed.size(), 3u);
      // The jumped rows have by far the largest MSE, so they are active.
      for (int64_t j : jump) EXPECT_TRUE(std::count(st.recomputed.begin(), st.recomputed.end(), j)) << j;
      // Exactly the top-3 by MSE.
      std::vector<int64_t> order(16);
      for (int64_t i = 0; i < 16; ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return st.mse[x] > st.mse[y]; });
      std::vector<int64_t> top(order.begin(), order.begin() + 3);
      std::sort(top.begin(), top.end());
      EXPECT_EQ(st.recomputed, top);
      for (int64_t i = 0; i < 16; ++i) {
        const bool active = std::count(st.recomputed.begin(), st.recomputed.end(), i) > 0;
        EXPECT_EQ(rows_equal(losa.o_p(), o_before, 8, 16, 16, i), !active) << "row " << i;
        EXPECT_EQ(rows_equal(losa.l_p(), l_before, 8, 16, 1, i), !active) << "row " << i;
        EXPECT_EQ(rows_equal(losa.q_ref(), q_before, 8, 16, 16, i), !active) << "row " << i;
        if (active) EXPECT_TRUE(rows_equal(losa.q_ref(), t.q, 8, 16, 16, i));
      }
      // Active rows hold the selector's sparse result, computed here independently.
      HostArray qa(DType::f32, {1, 8, 3, 16});
      for (int64_t h = 0; h < 8; ++h)
        for (int64_t i = 0; i < 3; ++i)
          std::memcpy(qa.ptr<float>() + (h * 3 + i) * 16, t.q.ptr<float>() + (h * 16 + st.recomputed[i]) * 16, 64);
      auto plan = select_pages(qa.view(), t.cache, lo.select);
      ASSERT_TRUE(plan.ok());
      EXPECT_EQ(plan->pages, st.plan.pages);
      EXPECT_EQ(plan->counts, st.plan.counts);
      HostArray oa(DType::f32, {1, 8, 3, 16}), la(DType::f32, {1, 8, 3});
      PagedAttentionOptions po;
      po.attention.backend = be;
      ASSERT_TRUE(paged_attention(qa.view(), t.cache, *plan, oa.view(), la.view(), po).ok());
      for (int64_t h = 0; h < 8; ++h)
        for (int64_t i = 0; i < 3; ++i) {
          EXPECT_EQ(std::memcmp(losa.o_p().ptr<float>() + (h * 16 + st.recomputed[i]) * 16, oa.ptr<float>() + (h * 3 + i) * 16, 64), 0);
          EXPECT_EQ(losa.l_p().ptr<float>()[h * 16 + st.recomputed[i]], la.ptr<float>()[h * 3 + i]);
        }
      // Union per kv head = union over its 4 query heads and the 3 active rows.
      int64_t total = 0;
      for (int64_t h_kv = 0; h_kv < 2; ++h_kv) {
        std::set<int32_t> u;
        for (int64_t h = h_kv * 4; h < h_kv * 4 + 4; ++h)
          for (int64_t r = 0; r < 3; ++r) u.insert(plan->row_pages(h, r), plan->row_pages(h, r) + plan->count(h, r));
        EXPECT_EQ(st.loaded[h_kv], std::vector<int32_t>(u.begin(), u.end()));
        total += static_cast<int64_t>(u.size());
        EXPECT_LE(u.size(), 4u * 3u * 4u);  // at most heads x rows x budget pages
      }
      EXPECT_EQ(st.pages_loaded, total);
    }
  }
}

// (6) Commit appends the block's K/V with the right page metadata, and the next step is dense.
TEST(Losa, CommitAppendsBlockAndRestartsDense) {
  Trace t(4, 2, 16, 8, 20);  // 20-token prefix: the block straddles pages 1 and 2
  LosaOptions lo;
  lo.active_k = 2;
  lo.select.budget = 16;
  lo.select.force_last = false;
  PrefixAttention losa = make(t, lo);
  Out a(t);
  ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()).ok());
  t.advance(0.1f, {3});
  ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()).ok());
  EXPECT_EQ(losa.steps_in_block(), 2);
  ASSERT_TRUE(losa.commit(t.cache, t.k.view(), t.v.view()).ok());
  EXPECT_EQ(losa.steps_in_block(), 0);
  EXPECT_EQ(losa.blocks_committed(), 1);
  EXPECT_EQ(t.cache.length(), 36);
  EXPECT_EQ(t.cache.num_pages(), 3);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t d = 0; d < 8; ++d) {
        EXPECT_EQ(t.cache.key(h, 20 + i)[d], t.k.ptr<float>()[(h * 16 + i) * 8 + d]);
        EXPECT_EQ(t.cache.value(h, 20 + i)[d], t.v.ptr<float>()[(h * 16 + i) * 8 + d]);
      }
    for (int64_t p = 0; p < 3; ++p)
      for (int64_t d = 0; d < 8; ++d) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t j = p * 16; j < std::min<int64_t>(36, p * 16 + 16); ++j) {
          mn = std::min(mn, t.cache.key(h, j)[d]);
          mx = std::max(mx, t.cache.key(h, j)[d]);
        }
        EXPECT_EQ(t.cache.page_min(h, p)[d], mn);
        EXPECT_EQ(t.cache.page_max(h, p)[d], mx);
      }
  }
  t.new_block(50);
  StepStats st;
  ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
  EXPECT_TRUE(st.dense_prefix);
  EXPECT_EQ(st.block, 1);
  EXPECT_EQ(st.step, 0);
  EXPECT_EQ(st.recomputed.size(), 16u);
  EXPECT_EQ(st.pages_loaded, 3 * 2);
}

// (8) The merge of prefix and intra-block attention is attention over prefix + block.
TEST(Losa, MergeWithIntraBlockEqualsAttentionOverPrefixAndBlock) {
  for (int64_t prefix : {0, 1, 16 * 5 + 3}) {
    Trace t(6, 2, 7, 24, prefix);
    LosaOptions dn;
    dn.method = PrefixMethod::dense;
    dn.attention.backend = Backend::cpu_ref;
    PrefixAttention ref = make(t, dn);
    Out a(t);
    ASSERT_TRUE(ref.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()).ok());
    const int64_t n = prefix + 7;
    HostArray k(DType::f32, {1, 2, n, 24}), v(DType::f32, {1, 2, n, 24});
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t j = 0; j < n; ++j) {
        const float* ks = j < prefix ? t.cache.key(h, j) : t.k.ptr<float>() + (h * 7 + j - prefix) * 24;
        const float* vs = j < prefix ? t.cache.value(h, j) : t.v.ptr<float>() + (h * 7 + j - prefix) * 24;
        std::copy_n(ks, 24, k.ptr<float>() + (h * n + j) * 24);
        std::copy_n(vs, 24, v.ptr<float>() + (h * n + j) * 24);
      }
    AttentionOptions ao;
    ao.backend = Backend::cpu_ref;
    auto full = dense(t.q.view(), k.view(), v.view(), ao);
    ASSERT_TRUE(full.ok());
    // Both f64 references rounded to f32, the merge adds a few f32 roundings.
    EXPECT_LT(max_abs_diff(a.o, full->out), 2e-6) << "prefix " << prefix;
    EXPECT_LT(max_abs_diff(a.l, full->lse), 2e-6) << "prefix " << prefix;
  }
}

// cpu and cpu_ref follow the same trajectory (same active rows, same pages) within f32 error.
TEST(Losa, CpuMatchesCpuRef) {
  Trace t1(4, 1, 13, 32, 16 * 40);
  for (PrefixMethod m : {PrefixMethod::losa, PrefixMethod::quest, PrefixMethod::reuse, PrefixMethod::dense}) {
    for (PageSelector sel : {PageSelector::quest, PageSelector::pooled}) {
      LosaOptions o;
      o.method = m;
      o.select.selector = sel;
      o.select.budget = 128;
      o.active_k = 2;
      o.attention.backend = Backend::cpu_ref;
      LosaOptions f = o;
      f.attention.backend = Backend::cpu;
      PrefixAttention ref = make(t1, o), fast = make(t1, f);
      Out a(t1), b(t1);
      for (int s = 0; s < 4; ++s) {
        StepStats sa, sb;
        ASSERT_TRUE(ref.step(t1.cache, t1.q.view(), t1.k.view(), t1.v.view(), a.o.view(), a.l.view(), &sa).ok());
        ASSERT_TRUE(fast.step(t1.cache, t1.q.view(), t1.k.view(), t1.v.view(), b.o.view(), b.l.view(), &sb).ok());
        EXPECT_EQ(sa.recomputed, sb.recomputed);
        EXPECT_EQ(sa.loaded, sb.loaded);
        EXPECT_LT(max_abs_diff(a.o, b.o), 1e-5) << prefix_method_name(m) << " step " << s;
        EXPECT_LT(max_abs_diff(a.l, b.l), 1e-5);
        t1.advance(0.05f, {s});
      }
    }
  }
}

// reuse: stable rows keep the cache, active rows are dense.
TEST(Losa, ReuseRecomputesActiveRowsDensely) {
  Trace t(4, 2, 8, 16, 16 * 12);
  LosaOptions ro;
  ro.method = PrefixMethod::reuse;
  ro.active_k = 1;
  PrefixAttention reuse = make(t, ro);
  Out a(t);
  ASSERT_TRUE(reuse.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()).ok());
  t.advance(0.0f, {5});
  StepStats st;
  ASSERT_TRUE(reuse.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
  EXPECT_TRUE(st.dense_prefix);
  EXPECT_EQ(st.recomputed, std::vector<int64_t>{5});
  EXPECT_EQ(st.pages_loaded, 12 * 2);
  auto d = dense(t.q.view(), t.cache.keys(), t.cache.values());
  ASSERT_TRUE(d.ok());
  // With zero drift, reuse equals dense exactly where it matters: every row.
  EXPECT_LT(max_abs_diff(reuse.o_p(), d->out), 1e-6);
}

TEST(Losa, ActiveRowSelection) {
  const std::vector<double> mse = {0.1, 0.5, 0.5, 0.0, 0.9, 0.2};
  EXPECT_EQ(active_rows(mse, 2, std::nullopt), (std::vector<int64_t>{1, 4}));  // tie 1 vs 2: the lower row
  EXPECT_EQ(active_rows(mse, 0, std::nullopt), (std::vector<int64_t>{}));
  EXPECT_EQ(active_rows(mse, 6, std::nullopt), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(active_rows(mse, 4, 0.15), (std::vector<int64_t>{1, 2, 4, 5}));  // threshold ignores K
  std::vector<double> with_nan = mse;
  with_nan[3] = NAN;
  EXPECT_EQ(active_rows(with_nan, 1, std::nullopt), (std::vector<int64_t>{3}));
}

TEST(Losa, ThresholdPicksRowsAboveIt) {
  Trace t(2, 1, 8, 8, 64);
  LosaOptions lo;
  lo.mse_threshold = 0.05;
  lo.select.budget = 32;
  PrefixAttention losa = make(t, lo);
  Out a(t);
  ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()).ok());
  t.advance(0.001f, {1, 6});
  StepStats st;
  ASSERT_TRUE(losa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
  EXPECT_EQ(st.recomputed, (std::vector<int64_t>{1, 6}));
}

TEST(Losa, EmptyPrefixIsIntraBlockAttentionOnly) {
  Trace t(2, 2, 4, 8, 0);
  for (PrefixMethod m : {PrefixMethod::losa, PrefixMethod::quest, PrefixMethod::dense}) {
    LosaOptions o;
    o.method = m;
    PrefixAttention pa = make(t, o);
    Out a(t);
    for (int s = 0; s < 2; ++s) {
      StepStats st;
      ASSERT_TRUE(pa.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view(), &st).ok());
      EXPECT_EQ(st.pages_loaded, 0);
      auto d = dense(t.q.view(), t.k.view(), t.v.view());
      ASSERT_TRUE(d.ok());
      EXPECT_LT(max_abs_diff(a.o, d->out), 1e-6);
      EXPECT_LT(max_abs_diff(a.l, d->lse), 1e-6);
    }
  }
}

TEST(Losa, BadBudgetsKAndBlockSizesGiveClearErrors) {
  LosaConfig c{8, 2, 64, 16};
  auto err = [&](LosaConfig cc, LosaOptions o, const char* what) {
    auto r = PrefixAttention::create(cc, o);
    EXPECT_FALSE(r.ok()) << what;
    if (!r.ok()) EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().message();
  };
  LosaOptions o;
  o.select.budget = 100;
  err(c, o, "budget: expected a positive multiple of the page size 16");
  o.select.budget = 0;
  err(c, o, "budget");
  o = {};
  o.active_k = -1;
  err(c, o, "active_k: expected 0 to block_size (16)");
  o.active_k = 17;
  err(c, o, "active_k: expected 0 to block_size (16)");
  o = {};
  o.mse_threshold = -1.0;
  err(c, o, "mse_threshold");
  o = {};
  err({8, 2, 64, 0}, o, "block_size: expected 1 to 1024");
  err({8, 2, 64, 2000}, o, "block_size: expected 1 to 1024");
  err({8, 3, 64, 16}, o, "heads_kv: heads_q (8) must be a multiple of heads_kv (3)");
  err({8, 2, 0, 16}, o, "head_dim");
  o.attention.backend = Backend::cuda;
  auto r = PrefixAttention::create(c, o);
  EXPECT_FALSE(r.ok());
  // dense ignores the budget it never uses
  LosaOptions dn;
  dn.method = PrefixMethod::dense;
  dn.select.budget = 3;
  EXPECT_TRUE(PrefixAttention::create(c, dn).ok());

  // Inputs that do not fit the block.
  Trace t(4, 2, 16, 8, 32);
  PrefixAttention pa = make(t, {});
  Out a(t);
  HostArray q15 = randn({1, 4, 15, 8}, 1), k3 = randn({1, 3, 16, 8}, 2);
  EXPECT_TRUE(has(pa.step(t.cache, q15.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()),
                  "q: expected block_size 16 tokens (dim 2), got 15"));
  EXPECT_TRUE(has(pa.step(t.cache, t.q.view(), k3.view(), t.v.view(), a.o.view(), a.l.view()), "k_block: expected shape"));
  auto other = PagedKVCache::create({2, 8, 32});
  ASSERT_TRUE(other.ok());
  LosaOptions b24;
  b24.select.budget = 48;  // a multiple of 16, not of the other cache's page size 32
  PrefixAttention pb = make(t, b24);
  EXPECT_TRUE(has(pb.step(*other, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()),
                  "budget: expected a positive multiple of the page size 32"));
  auto wrong = PagedKVCache::create({1, 8, 16});
  EXPECT_TRUE(has(pa.step(*wrong, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()), "cache: expected heads_kv 2"));
  EXPECT_TRUE(has(pa.commit(t.cache, q15.view(), q15.view()), "k_block: expected shape"));
  PrefixAttention uncreated;
  EXPECT_FALSE(uncreated.step(t.cache, t.q.view(), t.k.view(), t.v.view(), a.o.view(), a.l.view()).ok());
  EXPECT_TRUE(has(parse_prefix_method("sparse").status(), "method: expected dense, quest, losa or reuse"));
}

// ---- the decode-trace driver ---------------------------------------------------------

#include "sparsa/decode_trace.h"

namespace {

struct Clean {
  HostArray q, k, v;
  Clean(int64_t hq, int64_t hkv, int64_t rows, int64_t len, int64_t d)
      : q(randn({1, hq, rows, d}, 91)), k(randn({1, hkv, len, d}, 92)), v(randn({1, hkv, len, d}, 93)) {}
};

double row_mse(const Tensor& a, const Tensor& b, int64_t i) {
  double s = 0;
  const int64_t H = a.shape[1], D = a.shape[3];
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < D; ++t) {
      const double x = double{a.ptr<float>()[a.offset({0, h, i, t})]} - b.ptr<float>()[b.offset({0, h, i, t})];
      s += x * x;
    }
  return s / (H * D);
}

}  // namespace

TEST(DecodeTrace, UnmasksEveryTokenOnceAndMovesItToItsCleanRow) {
  DecodeTraceConfig c;
  c.prefix_len = 40;
  c.block_size = 8;
  c.num_blocks = 2;
  c.tokens_per_step = 3;  // steps: 3 (3 + 3 + 2)
  c.drift = 0.0f;
  c.neighbour_move = 0.0f;
  Clean cl(4, 2, 20, 40 + 16, 32);
  auto tr = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
  ASSERT_TRUE(tr.ok()) << tr.status().to_string();
  ASSERT_EQ(tr->steps_per_block(), 3);
  EXPECT_EQ(tr->prefix_k().shape_vector(), (std::vector<int64_t>{1, 2, 40, 32}));
  EXPECT_FALSE(tr->q(2, 0).defined());  // out of range: undefined, not a crash
  EXPECT_FALSE(tr->k(0, 3).defined());
  EXPECT_FALSE(tr->final_v(-1).defined());
  EXPECT_TRUE(tr->unmasked_after(0, 9).empty());
  for (int64_t b = 0; b < 2; ++b) {
    std::set<int64_t> seen;
    for (int64_t s = 0; s < 3; ++s) {
      for (int64_t i : tr->unmasked_after(b, s)) EXPECT_TRUE(seen.insert(i).second);
      EXPECT_EQ(tr->unmasked_after(b, s).size(), s < 2 ? 3u : 2u);
    }
    EXPECT_EQ(seen.size(), 8u);
    // Clean queries are the last 16 rows of q; block b's are rows 4 + 8b ...
    Tensor clean_q = cl.q.view();
    clean_q.data = cl.q.ptr<float>() + (4 + 8 * b) * 32;
    clean_q.shape[2] = 8;
    std::set<int64_t> done;
    for (int64_t s = 0; s < 3; ++s) {
      const Tensor q = tr->q(b, s);
      for (int64_t i = 0; i < 8; ++i) {
        const double m = row_mse(q, clean_q, i);
        if (done.count(i)) EXPECT_EQ(m, 0.0) << "unmasked token " << i << " at step " << s;
        else EXPECT_GT(m, 0.2) << "masked token " << i << " is off its clean row by ~unmask_move^2";
      }
      for (int64_t i : tr->unmasked_after(b, s)) done.insert(i);
    }
    // The committed K/V are the clean rows of the block.
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 8; ++i)
        EXPECT_EQ(tr->final_k(b).ptr<float>()[tr->final_k(b).offset({0, h, i, 0})],
                  cl.k.ptr<float>()[(h * 56 + 40 + 8 * b + i) * 32]);
  }
}

TEST(DecodeTrace, QueryChangesAreLocal) {
  DecodeTraceConfig c;
  c.prefix_len = 16;
  c.block_size = 16;
  c.unmask_move = 1.0f;
  c.neighbour_move = 0.1f;
  c.drift = 0.01f;
  Clean cl(8, 2, 16, 32, 64);
  auto tr = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
  ASSERT_TRUE(tr.ok());
  ASSERT_EQ(tr->steps_per_block(), 16);
  for (int64_t s = 1; s < 16; ++s) {
    const int64_t u = tr->unmasked_after(0, s - 1)[0];
    for (int64_t i = 0; i < 16; ++i) {
      // rms^2 ~ 1 here: expected MSE ~ 2 (jump onto the clean row from rms-1 noise),
      // ~0.01 for neighbours, ~1e-4 for the rest; bounds are generous for 512 samples.
      const double m = row_mse(tr->q(0, s), tr->q(0, s - 1), i);
      if (i == u) EXPECT_GT(m, 0.5);
      else if (i == u - 1 || i == u + 1) EXPECT_LT(m, 0.03);
      else EXPECT_LT(m, 3e-4);
    }
  }
  // Same config and seed: the same trace.
  auto again = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
  EXPECT_EQ(std::memcmp(again->q(0, 7).data, tr->q(0, 7).data, 8 * 16 * 64 * 4), 0);
}

TEST(DecodeTrace, BadConfigsGiveClearErrors) {
  Clean cl(4, 2, 16, 48, 8);
  auto err = [&](DecodeTraceConfig c, const char* what) {
    auto tr = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
    ASSERT_FALSE(tr.ok()) << what;
    EXPECT_NE(tr.status().message().find(what), std::string::npos) << tr.status().message();
  };
  DecodeTraceConfig c;
  c.prefix_len = 32;
  c.block_size = 3;
  err(c, "block_size: expected 4 to 32 tokens, got 3");
  c.block_size = 33;
  err(c, "block_size: expected 4 to 32 tokens, got 33");
  c.block_size = 16;
  c.tokens_per_step = 0;
  err(c, "tokens_per_step");
  c.tokens_per_step = 2;
  c.steps_per_block = 7;
  err(c, "steps_per_block: unmasking 2 token(s) per step needs 8");
  c.steps_per_block = 0;
  c.drift = -1;
  err(c, "drift");
  c.drift = 0.01f;
  c.prefix_len = 40;
  err(c, "k: expected [1, heads, 56, head_dim]");
  c.prefix_len = 32;
  EXPECT_TRUE(DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view()).ok());
}

// On a trace, LoSA with every token active and a full budget is dense at every step.
TEST(DecodeTrace, LosaOnATraceFollowsDenseWithFullBudget) {
  DecodeTraceConfig c;
  c.prefix_len = 16 * 6 + 5;
  c.block_size = 8;
  c.num_blocks = 2;
  c.tokens_per_step = 2;
  Clean cl(4, 2, 16, c.prefix_len + 16, 16);
  auto tr = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
  ASSERT_TRUE(tr.ok());
  auto cache = PagedKVCache::create({2, 16, 16});
  ASSERT_TRUE(cache->append(tr->prefix_k(), tr->prefix_v()).ok());
  LosaOptions lo;
  lo.active_k = 8;
  lo.select.budget = 16 * 8;
  LosaOptions dn;
  dn.method = PrefixMethod::dense;
  auto losa = PrefixAttention::create({4, 2, 16, 8}, lo);
  auto ref = PrefixAttention::create({4, 2, 16, 8}, dn);
  HostArray o1(DType::f32, {1, 4, 8, 16}), l1(DType::f32, {1, 4, 8}), o2 = o1, l2 = l1;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s < tr->steps_per_block(); ++s) {
      ASSERT_TRUE(losa->step(*cache, tr->q(b, s), tr->k(b, s), tr->v(b, s), o1.view(), l1.view()).ok());
      ASSERT_TRUE(ref->step(*cache, tr->q(b, s), tr->k(b, s), tr->v(b, s), o2.view(), l2.view()).ok());
      EXPECT_LT(max_abs_diff(o1, o2), 1e-5);
    }
    ASSERT_TRUE(losa->commit(*cache, tr->final_k(b), tr->final_v(b)).ok());
    ref->begin_block();
  }
  EXPECT_EQ(cache->length(), c.prefix_len + 16);
}

// A trace rebuilt from its own recorded parts (what `sparsa trace --capture` builds from a
// model's capture) is the same trace: run_trace gives bit-identical results on both.
TEST(DecodeTrace, FromRecordedRebuildsATraceExactly) {
  DecodeTraceConfig c;
  c.prefix_len = 16 * 6 + 5;  // a partial last page
  c.block_size = 8;
  c.num_blocks = 2;
  c.tokens_per_step = 3;  // 3 steps a block (3 + 3 + 2)
  Clean cl(4, 2, 16, c.prefix_len + 16, 16);
  auto tr = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
  ASSERT_TRUE(tr.ok());
  std::vector<RecordedTraceBlock> blocks(2);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s < tr->steps_per_block(); ++s) {
      blocks[b].q.push_back(tr->q(b, s));
      blocks[b].k.push_back(tr->k(b, s));
      blocks[b].v.push_back(tr->v(b, s));
      blocks[b].unmasked.push_back(tr->unmasked_after(b, s));
    }
    blocks[b].final_k = tr->final_k(b);
    blocks[b].final_v = tr->final_v(b);
  }
  auto rec = DecodeTrace::from_recorded(tr->prefix_k(), tr->prefix_v(), blocks);
  ASSERT_TRUE(rec.ok()) << rec.status().to_string();
  EXPECT_EQ(rec->config().prefix_len, c.prefix_len);
  EXPECT_EQ(rec->config().num_blocks, 2);
  EXPECT_EQ(rec->steps_per_block(), 3);
  EXPECT_EQ(rec->config().tokens_per_step, 3);
  EXPECT_EQ(rec->heads_q(), 4);
  EXPECT_EQ(rec->heads_kv(), 2);
  LosaOptions dn, quest, losa;
  dn.method = PrefixMethod::dense;
  quest.method = PrefixMethod::quest;
  quest.select.budget = 32;
  losa.active_k = 2;
  losa.select.budget = 32;
  auto a = run_trace(*tr, {dn, quest, losa});
  auto r = run_trace(*rec, {dn, quest, losa});
  ASSERT_TRUE(a.ok() && r.ok());
  for (size_t m = 0; m < 3; ++m) {
    ASSERT_EQ((*a)[m].size(), (*r)[m].size());
    for (size_t i = 0; i < (*a)[m].size(); ++i) {
      EXPECT_EQ((*a)[m][i].err, (*r)[m][i].err) << m << " " << i;
      EXPECT_EQ((*a)[m][i].err_masked, (*r)[m][i].err_masked) << m << " " << i;
      EXPECT_EQ((*a)[m][i].recall, (*r)[m][i].recall) << m << " " << i;
      EXPECT_EQ((*a)[m][i].stats.pages_loaded, (*r)[m][i].stats.pages_loaded) << m << " " << i;
    }
  }
  EXPECT_GT((*a)[2][4].err, 0.0);  // the sparse steps do differ from dense: the comparison has teeth

  // No prefix: the trace starts at the first block.
  auto bare = DecodeTrace::from_recorded(Tensor{}, Tensor{}, blocks);
  ASSERT_TRUE(bare.ok()) << bare.status().to_string();
  EXPECT_EQ(bare->config().prefix_len, 0);
  EXPECT_FALSE(bare->prefix_k().defined());

  // Bad parts name themselves.
  const auto err = [&](std::vector<RecordedTraceBlock> bl, const std::string& what, Tensor pk = {}, Tensor pv = {}) {
    auto t = DecodeTrace::from_recorded(pk, pv, bl);
    ASSERT_FALSE(t.ok()) << what;
    EXPECT_NE(t.status().message().find(what), std::string::npos) << t.status().message();
  };
  err({}, "blocks: expected at least one");
  auto fewer = blocks;
  fewer[1].q.pop_back();
  err(fewer, "blocks[1]: expected 3 steps");
  auto badu = blocks;
  badu[1].unmasked[2] = {5, 5};
  err(badu, "blocks[1][step 2].unmasked");
  badu[1].unmasked[2] = {8};
  err(badu, "blocks[1][step 2].unmasked");
  auto badk = blocks;
  badk[0].k[1] = tr->q(0, 1);  // 4 heads where 2 belong
  err(badk, "blocks[0][step 1].k");
  auto nofinal = blocks;
  nofinal[1].final_v = Tensor{};
  err(nofinal, "blocks[1].final_v");
  err(blocks, "prefix_v", tr->prefix_k(), Tensor{});
  err(blocks, "prefix_v: expected [1, 2, 8, 16]", tr->final_k(0), tr->prefix_v());  // 8 rows of keys, 101 of values
}

TEST(DecodeTrace, RunTraceMeasuresEveryMethodAgainstDense) {
  DecodeTraceConfig c;
  c.prefix_len = 16 * 10;
  c.block_size = 8;
  c.num_blocks = 2;
  c.tokens_per_step = 2;
  Clean cl(4, 2, 16, c.prefix_len + 16, 16);
  auto tr = DecodeTrace::from_tensors(c, cl.q.view(), cl.k.view(), cl.v.view());
  ASSERT_TRUE(tr.ok());
  LosaOptions dn, full, sparse;
  dn.method = PrefixMethod::dense;
  full.active_k = 8;
  full.select.budget = 16 * 11;
  sparse.active_k = 2;
  sparse.select.budget = 16;
  TraceRunOptions ro;
  ro.repeats = 2;
  auto runs = run_trace(*tr, {dn, full, sparse}, ro);
  ASSERT_TRUE(runs.ok()) << runs.status().to_string();
  ASSERT_EQ(runs->size(), 3u);
  for (const auto& steps : *runs) ASSERT_EQ(steps.size(), 2u * 4u);
  for (const TraceStep& s : (*runs)[0]) EXPECT_EQ(s.err, 0.0);  // dense is its own reference
  for (const TraceStep& s : (*runs)[1]) EXPECT_LT(s.err, 1e-5);
  bool some_error = false;
  for (const TraceStep& s : (*runs)[2]) {
    if (s.stats.step == 0) EXPECT_EQ(s.err, 0.0);  // the first step is dense
    some_error = some_error || s.err > 1e-3;
    EXPECT_GT(s.recall, 0.0);
    EXPECT_LE(s.recall, 1.0 + 1e-6);
  }
  EXPECT_TRUE(some_error);
  EXPECT_EQ((*runs)[2][5].stats.block, 1);  // block 1, step 1 (the cache grew by block 0)
  EXPECT_EQ((*runs)[2][5].stats.prefix_pages, 11);
  const TraceSummary s = summarise((*runs)[2], 2);
  EXPECT_EQ(s.recomputed, 2.0);
  EXPECT_GT(s.pages, 0.0);
  EXPECT_EQ(s.pages, 1.0);  // a one-page budget is the forced last page, shared by every row
  EXPECT_FALSE(run_trace(*tr, {}).ok());
  // Masked-row error: at a block's first step every row is masked, so it is the whole error.
  LosaOptions quest;
  quest.method = PrefixMethod::quest;
  quest.select.budget = 16;
  auto q = run_trace(*tr, {quest});
  ASSERT_TRUE(q.ok());
  EXPECT_GT((*q)[0][0].err, 1e-3);
  EXPECT_EQ((*q)[0][0].err_masked, (*q)[0][0].err);
  EXPECT_EQ((*q)[0][4].err_masked, (*q)[0][4].err);  // block 1, step 0
  EXPECT_NE((*q)[0][3].err_masked, (*q)[0][3].err);  // 6 of 8 rows unmasked by step 3
  for (const TraceStep& st : (*runs)[1]) EXPECT_LT(st.err_masked, 1e-5);
}

TEST(DecodeTrace, GeneratesOnTheWorkloadGenerator) {
  DecodeTraceConfig c;
  c.workload.heads_q = 4;
  c.workload.heads_kv = 2;
  c.workload.head_dim = 32;
  c.prefix_len = 200;
  c.block_size = 8;
  c.num_blocks = 2;
  auto tr = DecodeTrace::generate(c);
  ASSERT_TRUE(tr.ok()) << tr.status().to_string();
  EXPECT_EQ(tr->steps_per_block(), 8);
  // The trace is the generator's clean tensors: prefix K/V and the blocks' final K/V
  // are its first and last rows, and the last step's unmasked rows are its queries.
  WorkloadConfig w = c.workload;
  w.len_q = 16;
  w.len_kv = 216;
  auto clean = generate_workload(w);
  ASSERT_TRUE(clean.ok());
  const Tensor pk = tr->prefix_k();
  EXPECT_EQ(pk.shape_vector(), (std::vector<int64_t>{1, 2, 200, 32}));
  EXPECT_EQ(pk.ptr<float>()[pk.offset({0, 1, 199, 31})], clean->k.ptr<float>()[(216 + 199) * 32 + 31]);
  const Tensor fk = tr->final_k(1);
  EXPECT_EQ(fk.ptr<float>()[fk.offset({0, 0, 7, 0})], clean->k.ptr<float>()[(208 + 7) * 32]);
  const auto& last = tr->unmasked_after(1, 7);
  std::set<int64_t> masked_at_last_step(last.begin(), last.end());
  const Tensor q = tr->q(1, 7);
  for (int64_t i = 0; i < 8; ++i) {
    if (masked_at_last_step.count(i)) continue;
    // Unmasked earlier: its clean query plus drift since (small against its norm).
    double diff = 0, norm = 0;
    for (int64_t t = 0; t < 32; ++t) {
      const double x = q.ptr<float>()[q.offset({0, 0, i, t})], y = clean->q.ptr<float>()[(8 + i) * 32 + t];
      diff += (x - y) * (x - y);
      norm += y * y;
    }
    EXPECT_LT(std::sqrt(diff / norm), 0.5) << "row " << i;
  }
  DecodeTraceConfig bad = c;
  bad.workload.retrieval_span = 64;  // longer than the 16 decoded queries
  EXPECT_FALSE(DecodeTrace::generate(bad).ok());
}
