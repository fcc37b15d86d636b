// LLSA forward, plan and errors: the seed's test list (adapted) plus partial blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "llsa_test_util.h"
#include "sparsa/attention.h"
#include "sparsa/llsa.h"

using namespace sparsa;
using llsa_test::max_abs_diff;
using llsa_test::randn;

namespace {

LlsaOptions opts(int block, int topk, int levels, bool enrich, bool dedupe, Backend backend = Backend::cpu) {
  LlsaOptions o;
  o.block = block;
  o.topk = topk;
  o.levels = levels;
  o.enrich = enrich;
  o.dedupe = dedupe;
  o.backend = backend;
  return o;
}

AttentionOutput run(const HostArray& q, const HostArray& k, const HostArray& v, const LlsaOptions& o) {
  auto r = llsa_forward(q.view(), k.view(), v.view(), o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : AttentionOutput{};
}

AttentionOutput dense_ref(const HostArray& q, const HostArray& k, const HostArray& v) {
  AttentionOptions o;
  o.backend = Backend::cpu_ref;
  auto r = dense(q.view(), k.view(), v.view(), o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

}  // namespace

// ---- counted, not run --------------------------------------------------------------

TEST(LlsaShape, AutoLevelsFollowThePaper) {
  // L = floor(log_B N) - 1, at least 1.
  EXPECT_EQ(llsa_auto_levels(1, 16), 1);
  EXPECT_EQ(llsa_auto_levels(1024, 16), 1);
  EXPECT_EQ(llsa_auto_levels(4095, 16), 1);
  EXPECT_EQ(llsa_auto_levels(4096, 16), 2);
  EXPECT_EQ(llsa_auto_levels(32768, 16), 2);
  EXPECT_EQ(llsa_auto_levels(65536, 16), 3);
  EXPECT_EQ(llsa_auto_levels(1 << 20, 16), 4);
}

TEST(LlsaShape, KeysPerQueryGrowLessThanTwiceFrom4KTo1M) {
  LlsaOptions o;  // B = 16, K = 8
  // The seed's table (and the official code's arithmetic): 192, 272, 320, 384.
  EXPECT_EQ(llsa_keys_per_query(1024, o), 192);
  EXPECT_EQ(llsa_keys_per_query(4096, o), 272);
  EXPECT_EQ(llsa_keys_per_query(16384, o), 320);
  EXPECT_EQ(llsa_keys_per_query(32768, o), 384);
  const double growth = double(llsa_keys_per_query(1 << 20, o)) / double(llsa_keys_per_query(4096, o));
  EXPECT_LT(growth, 2.0) << llsa_keys_per_query(1 << 20, o);
  EXPECT_GT(growth, 1.0);
}

TEST(LlsaShape, FormulaMatchesTheBuiltPlan) {
  // The formula above is what a real plan visits (random inputs, N = 4096).
  auto q = randn({1, 1, 4096, 8}, 1), k = randn({1, 1, 4096, 8}, 2);
  for (bool dedupe : {false, true}) {
    LlsaOptions o;
    o.dedupe = dedupe;
    auto plan = llsa_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    EXPECT_EQ(plan->levels, 2);
    EXPECT_DOUBLE_EQ(plan->mean_keys_per_query(), double(llsa_keys_per_query(4096, o)));
  }
}

// ---- equals dense when everything is selected ------------------------------------

TEST(LlsaForward, EverythingSelectedEqualsDense) {
  // topk >= n_1 selects every block at every level. With enrichment off only the fine
  // tokens remain; with dedupe every coarse token is covered finer and left out. Both
  // are then dense attention. f32 tolerance 1e-5: both sides accumulate in f32/f64 over
  // at most 113 keys of O(1) values.
  for (int64_t n : {1, 3, 17, 100, 113}) {
    for (int levels : {1, 2, 3}) {
      const int block = 4;
      const int topk = static_cast<int>((n + block - 1) / block);
      auto q = randn({2, 4, n, 16}, 10 + n), k = randn({2, 2, n, 16}, 20 + n), v = randn({2, 2, n, 16}, 30 + n);
      const auto ref = dense_ref(q, k, v);
      for (Backend backend : {Backend::cpu, Backend::cpu_ref}) {
        for (auto [enrich, dedupe] : {std::pair{false, false}, std::pair{true, true}}) {
          const auto o = run(q, k, v, opts(block, topk, levels, enrich, dedupe, backend));
          const std::string where = "n " + std::to_string(n) + " levels " + std::to_string(levels) + " backend " +
                                    backend_name(backend) + (enrich ? " dedupe" : " no enrichment");
          EXPECT_LT(max_abs_diff(o.out, ref.out), 1e-5) << where;
          EXPECT_LT(max_abs_diff(o.lse, ref.lse), 1e-5) << where;
        }
      }
    }
  }
}

TEST(LlsaForward, EnrichmentOffIsBlockSparseOverTheFinePicks) {
  auto q = randn({1, 2, 300, 32}, 3), k = randn({1, 2, 300, 32}, 4), v = randn({1, 2, 300, 32}, 5);
  const auto o = opts(8, 3, 2, false, false);
  auto plan = llsa_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  const auto index = plan->fine_index();
  auto bs = block_sparse(q.view(), k.view(), v.view(), index.view());
  ASSERT_TRUE(bs.ok()) << bs.status().to_string();
  const auto out = run(q, k, v, o);
  EXPECT_LT(max_abs_diff(out.out, bs->out), 1e-5);
  EXPECT_LT(max_abs_diff(out.lse, bs->lse), 1e-5);
}

// ---- fast path against the specification ---------------------------------------

TEST(LlsaForward, CpuMatchesReference) {
  // Awkward lengths, GQA, partial blocks at every level, with and without dedupe.
  // Tolerance 2e-5 absolute on O(1) outputs: f32 accumulation over a few hundred keys
  // against f64 (observed ~1e-6).
  struct Case { int64_t n; int block, topk, levels; int64_t hq, hkv, d; };
  for (const Case& c : {Case{113, 4, 3, -1, 2, 1, 16}, Case{1023, 8, 4, 2, 3, 3, 24}, Case{4113, 16, 8, -1, 2, 1, 64},
                        Case{600, 5, 2, 3, 1, 1, 33}}) {
    auto q = randn({2, c.hq, c.n, c.d}, 7), k = randn({2, c.hkv, c.n, c.d}, 8), v = randn({2, c.hkv, c.n, c.d}, 9);
    for (bool dedupe : {false, true}) {
      const auto fast = run(q, k, v, opts(c.block, c.topk, c.levels, true, dedupe, Backend::cpu));
      const auto ref = run(q, k, v, opts(c.block, c.topk, c.levels, true, dedupe, Backend::cpu_ref));
      EXPECT_LT(max_abs_diff(fast.out, ref.out), 2e-5) << "n " << c.n << " dedupe " << dedupe;
      EXPECT_LT(max_abs_diff(fast.lse, ref.lse), 2e-5) << "n " << c.n << " dedupe " << dedupe;
    }
  }
}

TEST(LlsaForward, StridedInputs) {
  // q, k, v as [batch, seq, heads, d] buffers viewed as [batch, heads, seq, d].
  const int64_t n = 77, h = 2, d = 16;
  auto qa = randn({1, n, h, d}, 1), ka = randn({1, n, h, d}, 2), va = randn({1, n, h, d}, 3);
  auto view = [&](const HostArray& a) {
    Tensor t = a.view();
    std::swap(t.shape[1], t.shape[2]);
    std::swap(t.strides[1], t.strides[2]);
    return t;
  };
  auto contiguous = [&](const HostArray& a) {
    HostArray c(DType::f32, {1, h, n, d});
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < h; ++j)
        for (int64_t t = 0; t < d; ++t) c.ptr<float>()[(j * n + i) * d + t] = a.ptr<float>()[(i * h + j) * d + t];
    return c;
  };
  const auto o = opts(4, 2, 2, true, false);
  auto strided = llsa_forward(view(qa), view(ka), view(va), o);
  ASSERT_TRUE(strided.ok()) << strided.status().to_string();
  const auto plain = run(contiguous(qa), contiguous(ka), contiguous(va), o);
  EXPECT_EQ(max_abs_diff(strided->out, plain.out), 0.0);
}

// ---- semantics ----------------------------------------------------------------------

TEST(LlsaForward, ConstantValuesGiveThatConstant) {
  // Every pooled value of a constant V is that constant, and softmax weights sum to one,
  // whatever the (log-count) weights. Tolerance 1e-5 relative to the largest |value|
  // (4.75): f32 rounding of the pooled means and of a convex combination of ~300 terms.
  for (int64_t n : {50, 1000, 4113}) {
    auto q = randn({1, 2, n, 32}, 11, 2.0f), k = randn({1, 2, n, 32}, 12, 2.0f);
    HostArray v(DType::f32, {1, 2, n, 32});
    for (int64_t i = 0; i < v.numel(); ++i) v.ptr<float>()[i] = 0.25f * float(i % 32) - 3.0f;
    for (Backend backend : {Backend::cpu, Backend::cpu_ref})
      for (bool dedupe : {false, true}) {
        const auto o = run(q, k, v, opts(16, 8, -1, true, dedupe, backend));
        for (int64_t i = 0; i < o.out.numel(); ++i)
          ASSERT_NEAR(o.out.ptr<float>()[i], 0.25f * float(i % 32) - 3.0f, 4.75e-5) << "n " << n;
      }
  }
}

TEST(LlsaForward, PlantedDistantBlockIsFoundAndAttended) {
  // Query block 3 and key block 200 (of 256) share a strong direction u; the rest is
  // small noise. Selection must reach block 200 through its level-2 ancestor 12, and
  // the queries of block 3 must read block 200's values (a constant c).
  const int64_t n = 4096, d = 32, qb = 3, kb = 200;
  auto q = randn({1, 1, n, d}, 21, 0.1f), k = randn({1, 1, n, d}, 22, 0.1f), v = randn({1, 1, n, d}, 23);
  auto u = randn({d}, 24);
  double norm = 0;
  for (int t = 0; t < d; ++t) norm += u.ptr<float>()[t] * u.ptr<float>()[t];
  for (int t = 0; t < d; ++t) u.ptr<float>()[t] *= float(10.0 / std::sqrt(norm));
  for (int64_t r = 0; r < 16; ++r)
    for (int t = 0; t < d; ++t) {
      q.ptr<float>()[(qb * 16 + r) * d + t] += u.ptr<float>()[t];
      k.ptr<float>()[(kb * 16 + r) * d + t] += u.ptr<float>()[t];
      v.ptr<float>()[(kb * 16 + r) * d + t] = 1.5f;
    }
  LlsaOptions o;  // B 16, K 8, automatic L = 2
  auto plan = llsa_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->levels, 2);
  auto has = [&](int level, int64_t i, int32_t token) {
    for (int s = 0; s < plan->pick_count(level, 0, 0, i); ++s)
      if (plan->pick(level, 0, 0, i, s) == token) return true;
    return false;
  };
  EXPECT_TRUE(has(2, qb / 16, kb / 16)) << plan->to_string(0, 0, 1);
  EXPECT_TRUE(has(1, qb, kb)) << plan->to_string(0, 0, 4);
  for (Backend backend : {Backend::cpu, Backend::cpu_ref}) {
    o.backend = backend;
    const auto out = run(q, k, v, o);
    for (int64_t r = 0; r < 16; ++r)
      for (int t = 0; t < d; ++t) ASSERT_NEAR(out.out.ptr<float>()[(qb * 16 + r) * d + t], 1.5f, 1e-3);
  }
}

TEST(LlsaPlan, TiesGoToTheSmallerIndexAndPrint) {
  HostArray q(DType::f32, {1, 1, 70, 4}), k(DType::f32, {1, 1, 70, 4});  // all zero: every score ties
  auto plan = llsa_plan(q.view(), k.view(), opts(4, 3, 2, true, false));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->level_len, (std::vector<int64_t>{70, 18, 5}));
  for (int64_t i = 0; i < 5; ++i) {
    ASSERT_EQ(plan->pick_count(2, 0, 0, i), 3);
    for (int s = 0; s < 3; ++s) EXPECT_EQ(plan->pick(2, 0, 0, i, s), s);
  }
  // Level 1 scores the children of {0, 1, 2}: tokens 0..11; keeps 0, 1, 2.
  for (int s = 0; s < 3; ++s) EXPECT_EQ(plan->pick(1, 0, 0, 17, s), s);
  const std::string text = plan->to_string(0, 0);
  EXPECT_NE(text.find("level 2 (5 query tokens"), std::string::npos) << text;
  EXPECT_NE(text.find("  q 17: 0 1 2\n"), std::string::npos) << text;
}

TEST(LlsaPlan, MatchesABruteForceSelection) {
  // Small integer inputs, N = 4^3 + 2 with B = 4: every pooled value is a multiple of
  // 1/32 and every score exact in f32, so an independent f64 selection written here must
  // agree pick for pick (ties to the smaller index on both sides).
  const int64_t n = 66, d = 3;
  const int B = 4, K = 2, L = 2;
  HostArray q(DType::f32, {1, 2, n, d}), k(DType::f32, {1, 1, n, d});  // GQA 2:1
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> u(-3, 3);
  for (auto* a : {&q, &k})
    for (int64_t i = 0; i < a->numel(); ++i) a->ptr<float>()[i] = float(u(rng));
  auto plan = llsa_plan(q.view(), k.view(), opts(B, K, L, true, false));
  ASSERT_TRUE(plan.ok());
  auto pool = [&](const HostArray& x, int64_t h) {  // [level][token][d], mean of children
    std::vector<std::vector<std::vector<double>>> lv(L + 1);
    for (int64_t i = 0; i < n; ++i) lv[0].push_back({x.ptr<float>() + (h * n + i) * d, x.ptr<float>() + (h * n + i + 1) * d});
    for (int l = 1; l <= L; ++l)
      for (size_t t = 0; t * B < lv[l - 1].size(); ++t) {
        std::vector<double> m(d, 0.0);
        const size_t kids = std::min<size_t>(B, lv[l - 1].size() - t * B);
        for (size_t c = 0; c < kids; ++c)
          for (int e = 0; e < d; ++e) m[e] += lv[l - 1][t * B + c][e] / double(kids);
        lv[l].push_back(m);
      }
    return lv;
  };
  const auto pk = pool(k, 0);
  for (int64_t h = 0; h < 2; ++h) {
    const auto pq = pool(q, h);
    std::vector<std::vector<std::vector<int>>> picks(L + 1);  // [level][query token] -> picks
    for (int l = L; l >= 1; --l) {
      for (size_t i = 0; i < pq[l].size(); ++i) {
        std::vector<int> cand;
        if (l == L) {
          for (size_t j = 0; j < pk[l].size(); ++j) cand.push_back(int(j));
        } else {
          for (int p : picks[l + 1][i / B])
            for (size_t j = size_t(p) * B; j < std::min(pk[l].size(), size_t(p + 1) * B); ++j) cand.push_back(int(j));
        }
        auto score = [&](int j) {
          double s = 0;
          for (int e = 0; e < d; ++e) s += pq[l][i][e] * pk[l][j][e];
          return s;
        };
        std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return score(a) > score(b); });
        cand.resize(std::min<size_t>(K, cand.size()));
        std::sort(cand.begin(), cand.end());
        picks[l].push_back(cand);
        ASSERT_EQ(plan->pick_count(l, 0, h, int64_t(i)), int(cand.size()));
        for (size_t s = 0; s < cand.size(); ++s) EXPECT_EQ(plan->pick(l, 0, h, int64_t(i), int(s)), cand[s]) << l << " " << i;
      }
    }
  }
}

TEST(LlsaPlan, HugeTopkIsClippedNotAllocated) {
  auto q = randn({1, 1, 100, 4}, 1), k = randn({1, 1, 100, 4}, 2), v = randn({1, 1, 100, 4}, 3);
  auto plan = llsa_plan(q.view(), k.view(), opts(4, 1 << 30, 2, false, false));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->topk, 25);  // ceil(100 / 4) level-1 tokens
  const auto out = run(q, k, v, opts(4, 1 << 30, 2, false, false));
  EXPECT_LT(max_abs_diff(out.out, dense_ref(q, k, v).out), 1e-5);  // everything selected
}

TEST(LlsaForward, HalfPrecisionInputs) {
  // bf16 and f16 inputs are read into f32 (cpu) or f64 (cpu_ref) and the output is
  // rounded back: the two agree to a few units of the output's last place (bf16: 2^-8
  // relative, so 2e-2 absolute on O(1) values; f16: 2^-11, 4e-3).
  auto q = randn({1, 2, 150, 32}, 1), k = randn({1, 2, 150, 32}, 2), v = randn({1, 2, 150, 32}, 3);
  for (auto [dtype, tol] : {std::pair{DType::bf16, 2e-2}, std::pair{DType::f16, 4e-3}}) {
    auto qh = convert(q.view(), dtype), kh = convert(k.view(), dtype), vh = convert(v.view(), dtype);
    ASSERT_TRUE(qh.ok() && kh.ok() && vh.ok());
    auto fast = llsa_forward(qh->view(), kh->view(), vh->view(), opts(8, 4, 2, true, false));
    auto ref = llsa_forward(qh->view(), kh->view(), vh->view(), opts(8, 4, 2, true, false, Backend::cpu_ref));
    ASSERT_TRUE(fast.ok() && ref.ok()) << fast.status().to_string();
    ASSERT_EQ(fast->out.dtype(), dtype);
    double err = 0;
    for (int64_t i = 0; i < fast->out.numel(); ++i)
      err = std::max(err, std::abs(load_as_double(fast->out.view(), i) - load_as_double(ref->out.view(), i)));
    EXPECT_LT(err, tol) << dtype_name(dtype);
    EXPECT_LT(max_abs_diff(fast->lse, ref->lse), 1e-4);
  }
}

// ---- partial blocks ------------------------------------------------------------------

namespace {

// Independent per-block reference: the mean pools computed here, the visited set
// enumerated here from the plan's picks, and every coarse token written out as many
// times as the original tokens it covers, then plain dense attention (cpu_ref).
std::vector<std::vector<float>> pool_levels(const HostArray& x, int64_t n, int64_t d, int block, int levels) {
  std::vector<std::vector<float>> lv(levels + 1);
  lv[0].assign(x.ptr<float>(), x.ptr<float>() + n * d);
  int64_t len = n;
  for (int l = 1; l <= levels; ++l) {
    const int64_t next = (len + block - 1) / block;
    lv[l].assign(next * d, 0.0f);
    for (int64_t t = 0; t < next; ++t) {
      const int64_t kids = std::min<int64_t>(block, len - t * block);
      for (int64_t c = 0; c < kids; ++c)
        for (int64_t e = 0; e < d; ++e) lv[l][t * d + e] += lv[l - 1][(t * block + c) * d + e] / float(kids);
    }
    len = next;
  }
  return lv;
}

}  // namespace

TEST(LlsaPartial, LastPooledTokenWeighsItsRealCount) {
  const int64_t n = 16 * 16 * 16 + 17;  // 4113: level 1 has 258 tokens, level 2 has 17
  auto q = randn({1, 1, n, 8}, 31), k = randn({1, 1, n, 8}, 32);
  auto plan = llsa_plan(q.view(), k.view(), LlsaOptions{});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->levels, 2);
  ASSERT_EQ(plan->level_len, (std::vector<int64_t>{4113, 258, 17}));
  EXPECT_EQ(plan->token_count(1, 256), 16);
  EXPECT_EQ(plan->token_count(1, 257), 1);   // 4113 mod 16
  EXPECT_EQ(plan->token_count(2, 15), 256);
  EXPECT_EQ(plan->token_count(2, 16), 17);   // 4113 mod 256
}

TEST(LlsaPartial, MatchesPerBlockReferenceAt16Cubed17) {
  const int64_t n = 16 * 16 * 16 + 17, d = 16;
  const int B = 16;
  auto q = randn({1, 1, n, d}, 41), k = randn({1, 1, n, d}, 42), v = randn({1, 1, n, d}, 43);
  for (bool dedupe : {false, true}) {
    LlsaOptions o;
    o.dedupe = dedupe;
    auto plan = llsa_plan(q.view(), k.view(), o);
    ASSERT_TRUE(plan.ok());
    const auto out = run(q, k, v, o);
    const auto kp = pool_levels(k, n, d, B, 2), vp = pool_levels(v, n, d, B, 2);
    auto count = [&](int level, int64_t t) {
      const int64_t region = level == 0 ? 1 : level == 1 ? 16 : 256;
      return std::min(region, n - t * region);
    };
    auto picked = [&](int level, int64_t i, int64_t t) {
      for (int s = 0; s < plan->pick_count(level, 0, 0, i); ++s)
        if (plan->pick(level, 0, 0, i, s) == t) return true;
      return false;
    };
    for (int64_t qb : {0, 100, 256, 257}) {  // 257 is the one-token last block
      std::vector<std::pair<int, int64_t>> keys;  // (level, token)
      for (int s = 0; s < plan->pick_count(1, 0, 0, qb); ++s)
        for (int64_t t = plan->pick(1, 0, 0, qb, s) * 16; t < std::min<int64_t>(n, plan->pick(1, 0, 0, qb, s) * 16 + 16); ++t)
          keys.push_back({0, t});
      for (int s = 0; s < plan->pick_count(2, 0, 0, qb / 16); ++s) {
        const int64_t p = plan->pick(2, 0, 0, qb / 16, s);
        for (int64_t t = p * 16; t < std::min<int64_t>(258, p * 16 + 16); ++t)
          if (!dedupe || !picked(1, qb, t)) keys.push_back({1, t});
      }
      for (int64_t t = 0; t < 17; ++t)
        if (!dedupe || !picked(2, qb / 16, t)) keys.push_back({2, t});
      int64_t expanded = 0;
      for (auto [l, t] : keys) expanded += count(l, t);
      HostArray ke(DType::f32, {1, 1, expanded, d}), ve(DType::f32, {1, 1, expanded, d});
      int64_t row = 0;
      for (auto [l, t] : keys)
        for (int64_t c = 0; c < count(l, t); ++c, ++row)
          for (int64_t e = 0; e < d; ++e) {
            ke.ptr<float>()[row * d + e] = kp[l][t * d + e];
            ve.ptr<float>()[row * d + e] = vp[l][t * d + e];
          }
      const int64_t rows = std::min<int64_t>(16, n - qb * 16);
      HostArray qe(DType::f32, {1, 1, rows, d});
      std::copy(q.ptr<float>() + qb * 16 * d, q.ptr<float>() + (qb * 16 + rows) * d, qe.ptr<float>());
      AttentionOptions ao;
      ao.backend = Backend::cpu_ref;
      auto ref = dense(qe.view(), ke.view(), ve.view(), ao);
      ASSERT_TRUE(ref.ok());
      // 1e-5: the same sums in f32 (fast path) vs f64 over ~6000 expanded keys of O(1) values.
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t e = 0; e < d; ++e)
          ASSERT_NEAR(out.out.ptr<float>()[(qb * 16 + r) * d + e], ref->out.ptr<float>()[r * d + e], 1e-5)
              << "block " << qb << " dedupe " << dedupe;
        ASSERT_NEAR(out.lse.ptr<float>()[qb * 16 + r], ref->lse.ptr<float>()[r], 1e-5);
      }
    }
  }
}

// ---- errors --------------------------------------------------------------------------

TEST(LlsaErrors, BadInputsAreRefusedWithTheirName) {
  auto q = randn({1, 4, 64, 8}, 1), k = randn({1, 2, 64, 8}, 2), v = randn({1, 2, 64, 8}, 3);
  auto k_short = randn({1, 2, 63, 8}, 2), k_heads = randn({1, 3, 64, 8}, 2);
  auto expect_error = [](const Status& s, const std::string& needle) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
  };
  expect_error(llsa_forward(q.view(), k_short.view(), v.view()).status(), "k: llsa is self-attention");
  expect_error(llsa_forward(q.view(), k_heads.view(), v.view()).status(), "heads_q (4) must be a multiple");
  expect_error(llsa_forward(q.view(), k.view(), v.view(), opts(1, 8, -1, true, false)).status(), "block: expected >= 2");
  expect_error(llsa_forward(q.view(), k.view(), v.view(), opts(4, 0, -1, true, false)).status(), "topk: expected >= 1");
  expect_error(llsa_forward(q.view(), k.view(), v.view(), opts(4, 2, 0, true, false)).status(), "levels: expected");
  expect_error(llsa_forward(q.view(), k.view(), v.view(), opts(4, 2, 1, true, false, Backend::cuda)).status(), "backend");
  // A plan built for other inputs, and a corrupted plan.
  auto other = randn({1, 4, 32, 8}, 4);
  auto plan = llsa_plan(other.view(), other.view(), opts(4, 2, -1, true, false));
  ASSERT_TRUE(plan.ok());
  AttentionOutput o;
  o.out = HostArray(DType::f32, {1, 4, 64, 8});
  o.lse = HostArray(DType::f32, {1, 4, 64});
  expect_error(llsa_forward(q.view(), k.view(), v.view(), *plan, o.out.view(), o.lse.view()), "plan: built for");
  auto good = llsa_plan(q.view(), k.view(), opts(4, 2, -1, true, false));
  ASSERT_TRUE(good.ok());
  good->picks[0].ptr<int32_t>()[0] = 1000;
  expect_error(llsa_forward(q.view(), k.view(), v.view(), *good, o.out.view(), o.lse.view(), opts(4, 2, -1, true, false)),
               "plan: level 1 picks");
  HostArray lse_bad(DType::f32, {1, 4, 63});
  auto fresh = llsa_plan(q.view(), k.view(), opts(4, 2, -1, true, false));
  ASSERT_TRUE(fresh.ok());
  expect_error(llsa_forward(q.view(), k.view(), v.view(), *fresh, o.out.view(), lse_bad.view(), opts(4, 2, -1, true, false)),
               "lse: expected shape");
}

TEST(LlsaErrors, NonFiniteInputs) {
  auto q = randn({1, 1, 40, 8}, 1), k = randn({1, 1, 40, 8}, 2), v = randn({1, 1, 40, 8}, 3);
  q.ptr<float>()[17] = std::nanf("");
  LlsaOptions o;
  o.block = 4;
  o.check_finite = true;
  auto r = llsa_forward(q.view(), k.view(), v.view(), o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::non_finite);
  o.check_finite = false;  // NaN scores rank last in selection: no crash, a valid plan
  auto plan = llsa_plan(q.view(), k.view(), o);
  ASSERT_TRUE(plan.ok());
  for (int l = 1; l <= plan->levels; ++l)
    for (int64_t i = 0; i < plan->level_len[l]; ++i)
      for (int s = 0; s < plan->pick_count(l, 0, 0, i); ++s) {
        EXPECT_GE(plan->pick(l, 0, 0, i, s), 0);
        EXPECT_LT(plan->pick(l, 0, 0, i, s), plan->level_len[l]);
      }
}
