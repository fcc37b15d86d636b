// cpu LLSA: the fast CPU path of the forward and backward (semantics: ref.cpp).
//
// Work goes one (batch, kv head) slice at a time. A slice's pyramid is built once:
// every level l padded to whole groups of B tokens, row-major ([n_l, d]: for P·V and
// dS·K) and group-transposed ([groups, d, W], W = B rounded up to 16: for Q·K^T and
// dO·V^T with 16-wide vectors). A visited run of keys never crosses a group
// (for_each_key_run), so each run is one pyramid group plus a [lo, hi) mask folded
// into the logit bias (log2 of the token count, -inf outside). The forward's threads
// take (query head, query block) items dynamically; a block's scores live in a
// per-thread [B, keys-per-query] buffer (never N x N). The backward cuts the items into
// one contiguous chunk per thread, accumulates dK/dV of the pyramid per chunk
// (O(threads * N * d)), sums the chunks in order, then pools them down to level 0.
// Logits are kept in base 2 (q pre-scaled by scale*log2(e)); f32 throughout.
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/attention_params.h"
#include "cpu/parallel.h"
#include "methods/llsa/internal.h"

namespace sparsa::llsa_detail {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kLanes = 16;  // score columns per vector step
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (x below -126 gives about 1e-38, masked by the caller). Rounds x to
// the nearest integer n and evaluates 2^f, |f| <= 1/2, by its degree-7 Taylor series
// (truncation < 1e-8, below f32 rounding); branch-free so loops over it vectorise.
inline float exp2_nonpositive(float x) {
  // max(-126, NaN) is -126 (std::clamp would keep NaN, and casting NaN to int below is
  // undefined): a NaN logit gives ~0 here and its row is caught as not finite by the caller.
  x = std::min(std::max(-126.0f, x), 0.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float n = (x + kRound) - kRound;
  const float f = x - n;
  constexpr float c1 = 0.6931471805599453f, c2 = 0.2402265069591007f, c3 = 0.05550410866482158f,
                  c4 = 0.009618129107628477f, c5 = 0.0013333558146428443f, c6 = 1.5403530393381608e-4f,
                  c7 = 1.525273380405984e-5f;
  const float poly = 1.0f + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * (c6 + f * c7))))));
  return std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23) * poly;
}

struct Segment {
  int level;
  int64_t group;  // aligned group of B tokens at `level`
  int lo, hi;     // visited tokens group*B + [lo, hi)
};

void segments_of(const LlsaPlan& plan, int64_t b, int64_t h, int64_t qb, std::vector<Segment>& segs) {
  segs.clear();
  const int B = plan.block;
  for_each_key_run(plan, b, h, qb, [&](int level, int64_t first, int64_t end) {
    const int64_t g = first / B;
    segs.push_back({level, g, static_cast<int>(first - g * B), static_cast<int>(end - g * B)});
  });
}

// The pyramid of one (batch, kv head) slice.
struct Slice {
  int B = 0, W = 0, L = 0;
  int64_t d = 0;
  std::vector<int64_t> len, groups;
  std::vector<std::vector<float>> k_rows, k_cols, v_rows, v_cols;  // [level][groups*B, d] / [level][groups, d, W]
  std::vector<std::vector<float>> log2_count;                       // [level][groups*B], -inf on padding

  Slice(const LlsaPlan& plan, int64_t head_dim, bool with_v_cols)
      : B(plan.block), W((plan.block + kLanes - 1) / kLanes * kLanes), L(plan.levels), d(head_dim),
        len(plan.level_len), groups(plan.levels + 1), k_rows(L + 1), k_cols(L + 1), v_rows(L + 1),
        v_cols(with_v_cols ? L + 1 : 0), log2_count(L + 1) {
    for (int l = 0; l <= L; ++l) {
      groups[l] = (len[l] + B - 1) / B;
      k_rows[l].resize(groups[l] * B * d);
      v_rows[l].resize(groups[l] * B * d);
      k_cols[l].resize(groups[l] * d * W);
      if (with_v_cols) v_cols[l].resize(groups[l] * d * W);
      log2_count[l].assign(groups[l] * B, kNegInf);
      for (int64_t t = 0; t < len[l]; ++t) log2_count[l][t] = std::log2(static_cast<float>(plan.token_count(l, t)));
    }
  }

  void load(const Tensor& k, const Tensor& v, int64_t b, int64_t h_kv) {
    for (int l = 0; l <= L; ++l) {  // padding rows stay zero
      std::fill(k_rows[l].begin(), k_rows[l].end(), 0.0f);
      std::fill(v_rows[l].begin(), v_rows[l].end(), 0.0f);
    }
    for (int64_t i = 0; i < len[0]; ++i) {
      detail::load_row(k.data, k.dtype, k.offset({b, h_kv, i, 0}), d, k_rows[0].data() + i * d);
      detail::load_row(v.data, v.dtype, v.offset({b, h_kv, i, 0}), d, v_rows[0].data() + i * d);
    }
    for (int l = 1; l <= L; ++l) {
      mean_pool(k_rows[l - 1].data(), len[l - 1], d, B, k_rows[l].data());
      mean_pool(v_rows[l - 1].data(), len[l - 1], d, B, v_rows[l].data());
    }
    for (int l = 0; l <= L; ++l) {
      transpose_groups(k_rows[l], k_cols[l], l);
      if (!v_cols.empty()) transpose_groups(v_rows[l], v_cols[l], l);
    }
  }

  void transpose_groups(const std::vector<float>& rows, std::vector<float>& cols, int l) const {
    std::fill(cols.begin(), cols.end(), 0.0f);
    for (int64_t g = 0; g < groups[l]; ++g)
      for (int j = 0; j < B; ++j)
        for (int64_t t = 0; t < d; ++t) cols[(g * d + t) * W + j] = rows[(g * B + j) * d + t];
  }
};

// s[r, j] = sum_t x[r, t] * cols[t, j] for j < W (W a multiple of 16); rows r < R.
void scores(const float* x, int R, int64_t d, const float* cols, int W, float* s, int64_t lds) {
  for (int c0 = 0; c0 < W; c0 += kLanes) {
    int r = 0;
    for (; r + 4 <= R; r += 4) {
      float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
      const float *x0 = x + r * d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
      for (int64_t t = 0; t < d; ++t) {
        const float* kr = cols + t * W + c0;
        for (int j = 0; j < kLanes; ++j) {
          a0[j] += x0[t] * kr[j];
          a1[j] += x1[t] * kr[j];
          a2[j] += x2[t] * kr[j];
          a3[j] += x3[t] * kr[j];
        }
      }
      std::memcpy(s + (r + 0) * lds + c0, a0, sizeof a0);
      std::memcpy(s + (r + 1) * lds + c0, a1, sizeof a1);
      std::memcpy(s + (r + 2) * lds + c0, a2, sizeof a2);
      std::memcpy(s + (r + 3) * lds + c0, a3, sizeof a3);
    }
    for (; r < R; ++r) {
      float a[kLanes] = {};
      for (int64_t t = 0; t < d; ++t) {
        const float* kr = cols + t * W + c0;
        for (int j = 0; j < kLanes; ++j) a[j] += x[r * d + t] * kr[j];
      }
      std::memcpy(s + r * lds + c0, a, sizeof a);
    }
  }
}

// acc[r, :] += sum_{j in [lo, hi)} p[r, j] * rows[j, :]  (rows: one group, [B, d]).
void accumulate(const float* p, int64_t ldp, int R, int lo, int hi, const float* rows, int64_t d, float* acc) {
  constexpr int kChunk = 32;
  int64_t c0 = 0;
  for (; c0 + kChunk <= d; c0 += kChunk) {
    int r = 0;
    for (; r + 4 <= R; r += 4) {
      float o[4][kChunk];
      for (int i = 0; i < 4; ++i) std::memcpy(o[i], acc + (r + i) * d + c0, sizeof o[i]);
      for (int j = lo; j < hi; ++j) {
        const float* vr = rows + j * d + c0;
        const float p0 = p[(r + 0) * ldp + j], p1 = p[(r + 1) * ldp + j], p2 = p[(r + 2) * ldp + j],
                    p3 = p[(r + 3) * ldp + j];
        for (int c = 0; c < kChunk; ++c) {
          o[0][c] += p0 * vr[c];
          o[1][c] += p1 * vr[c];
          o[2][c] += p2 * vr[c];
          o[3][c] += p3 * vr[c];
        }
      }
      for (int i = 0; i < 4; ++i) std::memcpy(acc + (r + i) * d + c0, o[i], sizeof o[i]);
    }
    for (; r < R; ++r) {
      for (int j = lo; j < hi; ++j) {
        const float pj = p[r * ldp + j];
        for (int c = 0; c < kChunk; ++c) acc[r * d + c0 + c] += pj * rows[j * d + c0 + c];
      }
    }
  }
  for (int r = 0; r < R; ++r)  // columns past the last whole chunk
    for (int j = lo; j < hi; ++j)
      for (int64_t c = c0; c < d; ++c) acc[r * d + c] += p[r * ldp + j] * rows[j * d + c];
}

void store_row(const Tensor& t, int64_t offset, int64_t n, const float* src) {
  if (t.dtype == DType::f32) {
    std::memcpy(t.ptr<float>() + offset, src, n * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) detail::store_element(t.data, t.dtype, offset + i, src[i]);
}

// Per-thread buffers of one query block.
struct BlockScratch {
  std::vector<Segment> segs;
  std::vector<float> s, dp, bias;          // [R, M], [R, M], [M]
  std::vector<float> pt, dst;              // [W, R]: one segment of P and scale*dS, transposed
  std::vector<float> q, qs, o, d_o, acc;   // [B, d]
  std::vector<float> lse2, delta;          // [B]
};

// Fills sc.s with base-2 logits plus bias of the block's rows (sc.qs pre-scaled);
// returns M, the padded number of key columns.
int64_t block_logits(const Slice& sl, BlockScratch& sc, int R) {
  const int64_t M = static_cast<int64_t>(sc.segs.size()) * sl.W;
  sc.s.resize(R * M);
  sc.bias.resize(M);
  for (size_t g = 0; g < sc.segs.size(); ++g) {
    const Segment& seg = sc.segs[g];
    scores(sc.qs.data(), R, sl.d, sl.k_cols[seg.level].data() + seg.group * sl.d * sl.W, sl.W, sc.s.data() + g * sl.W, M);
    float* bias = sc.bias.data() + g * sl.W;
    const float* log2c = sl.log2_count[seg.level].data() + seg.group * sl.B;
    for (int j = 0; j < sl.W; ++j) bias[j] = (j >= seg.lo && j < seg.hi) ? log2c[j] : kNegInf;
  }
  for (int r = 0; r < R; ++r) {
    float* row = sc.s.data() + r * M;
    for (int64_t j = 0; j < M; ++j) row[j] += sc.bias[j];
  }
  return M;
}

}  // namespace

Status cpu_forward(const CpuArgs& a, const LlsaPlan& plan, bool* not_finite) {
  std::atomic<bool> any_not_finite{false};
  const int64_t d = a.q.shape[3], N = plan.len, group = plan.heads_q / plan.heads_kv;
  const int B = plan.block;
  // No more threads (and per-thread buffers) than there are query-block items.
  const int threads = static_cast<int>(
      std::min<int64_t>(cpu::resolve_threads(a.num_threads), std::max<int64_t>(1, group * plan.level_len[1])));
  const float qscale = a.scale * kLog2e;
  Slice sl(plan, d, /*with_v_cols=*/false);
  std::vector<BlockScratch> scratch(threads);
  for (auto& sc : scratch) {
    sc.qs.resize(B * d);
    sc.acc.resize(B * d);
  }
  const int64_t blocks = plan.level_len[1];
  for (int64_t b = 0; b < plan.batch; ++b) {
    for (int64_t h_kv = 0; h_kv < plan.heads_kv; ++h_kv) {
      sl.load(a.k, a.v, b, h_kv);
      cpu::parallel_for(group * blocks, threads, [&](int64_t item, int thread) {
        BlockScratch& sc = scratch[thread];
        const int64_t h = h_kv * group + item / blocks, qb = item % blocks;
        const int R = static_cast<int>(std::min<int64_t>(B, N - qb * B));
        for (int r = 0; r < R; ++r) {
          float* qr = sc.qs.data() + r * d;
          detail::load_row(a.q.data, a.q.dtype, a.q.offset({b, h, qb * B + r, 0}), d, qr);
          for (int64_t t = 0; t < d; ++t) qr[t] *= qscale;
        }
        segments_of(plan, b, h, qb, sc.segs);
        const int64_t M = block_logits(sl, sc, R);
        for (int r = 0; r < R; ++r) {
          float* row = sc.s.data() + r * M;
          float m = kNegInf;
          for (int64_t j = 0; j < M; ++j) m = std::max(m, row[j]);
          float sum = 0.0f;
          for (int64_t j = 0; j < M; ++j) {
            const float e = row[j] == kNegInf ? 0.0f : exp2_nonpositive(row[j] - m);
            row[j] = e;
            sum += e;
          }
          const bool empty = !(sum > 0.0f);
          const float inv = empty ? 0.0f : 1.0f / sum;
          for (int64_t j = 0; j < M; ++j) row[j] *= inv;
          const float lse = empty ? kNegInf : (m + std::log2(sum)) * kLn2;
          // Every row sees the coarsest level, so a row is never empty: an LSE that is not
          // finite means f32 overflowed (or an input is NaN); the caller redoes it in f64.
          if (!std::isfinite(lse)) any_not_finite.store(true, std::memory_order_relaxed);
          a.lse.ptr<float>()[a.lse.offset({b, h, qb * B + r})] = lse;
        }
        std::fill(sc.acc.begin(), sc.acc.begin() + R * d, 0.0f);
        for (size_t g = 0; g < sc.segs.size(); ++g) {
          const Segment& seg = sc.segs[g];
          accumulate(sc.s.data() + g * sl.W, M, R, seg.lo, seg.hi, sl.v_rows[seg.level].data() + seg.group * B * d, d,
                     sc.acc.data());
        }
        for (int r = 0; r < R; ++r) {
          for (int64_t t = 0; t < d; ++t) {
            if (!std::isfinite(sc.acc[r * d + t])) any_not_finite.store(true, std::memory_order_relaxed);
          }
          store_row(a.out, a.out.offset({b, h, qb * B + r, 0}), d, sc.acc.data() + r * d);
        }
      });
    }
  }
  *not_finite = any_not_finite.load();
  return {};
}

Status cpu_backward(const CpuArgs& a, const LlsaPlan& plan) {
  const int64_t d = a.q.shape[3], N = plan.len, group = plan.heads_q / plan.heads_kv;
  const int B = plan.block, L = plan.levels;
  // No more threads (and per-thread buffers) than there are query-block items.
  const int threads = static_cast<int>(
      std::min<int64_t>(cpu::resolve_threads(a.num_threads), std::max<int64_t>(1, group * plan.level_len[1])));
  const float qscale = a.scale * kLog2e;
  Slice sl(plan, d, /*with_v_cols=*/true);
  std::vector<BlockScratch> scratch(threads);
  for (auto& sc : scratch) {
    for (auto* v : {&sc.q, &sc.qs, &sc.o, &sc.d_o, &sc.acc}) v->resize(B * d);
    sc.lse2.resize(B);
    sc.delta.resize(B);
  }
  // Per-thread gradients of the pyramid: [thread][level][groups*B, d].
  std::vector<std::vector<std::vector<float>>> dk_acc(threads), dv_acc(threads);
  for (int t = 0; t < threads; ++t) {
    dk_acc[t].resize(L + 1);
    dv_acc[t].resize(L + 1);
    for (int l = 0; l <= L; ++l) {
      dk_acc[t][l].resize(sl.groups[l] * B * d);
      dv_acc[t][l].resize(sl.groups[l] * B * d);
    }
  }
  const int64_t blocks = plan.level_len[1];
  for (int64_t b = 0; b < plan.batch; ++b) {
    for (int64_t h_kv = 0; h_kv < plan.heads_kv; ++h_kv) {
      sl.load(a.k, a.v, b, h_kv);
      for (int t = 0; t < threads; ++t)
        for (int l = 0; l <= L; ++l) {
          std::fill(dk_acc[t][l].begin(), dk_acc[t][l].end(), 0.0f);
          std::fill(dv_acc[t][l].begin(), dv_acc[t][l].end(), 0.0f);
        }
      // Items (query head, query block) are cut into `threads` contiguous chunks, each with
      // its own gradient pyramid, so the sums do not depend on scheduling: for a given
      // num_threads the backward is deterministic.
      auto process = [&](int64_t item, BlockScratch& sc, std::vector<std::vector<float>>& dk_pyr,
                         std::vector<std::vector<float>>& dv_pyr) {
        const int64_t h = h_kv * group + item / blocks, qb = item % blocks;
        const int R = static_cast<int>(std::min<int64_t>(B, N - qb * B));
        for (int r = 0; r < R; ++r) {
          const int64_t i = qb * B + r;
          detail::load_row(a.q.data, a.q.dtype, a.q.offset({b, h, i, 0}), d, sc.q.data() + r * d);
          detail::load_row(a.out.data, a.out.dtype, a.out.offset({b, h, i, 0}), d, sc.o.data() + r * d);
          detail::load_row(a.d_o.data, a.d_o.dtype, a.d_o.offset({b, h, i, 0}), d, sc.d_o.data() + r * d);
          for (int64_t t = 0; t < d; ++t) sc.qs[r * d + t] = sc.q[r * d + t] * qscale;
          sc.lse2[r] = a.lse.ptr<const float>()[a.lse.offset({b, h, i})] * kLog2e;
          float delta = 0.0f;
          for (int64_t t = 0; t < d; ++t) delta += sc.d_o[r * d + t] * sc.o[r * d + t];
          sc.delta[r] = delta;
        }
        segments_of(plan, b, h, qb, sc.segs);
        const int64_t M = block_logits(sl, sc, R);
        // P = exp(s - lse) (in sc.s); dP = dO · V^T (in sc.dp); dS = P (dP - delta) (in sc.dp).
        sc.dp.resize(R * M);
        for (size_t g = 0; g < sc.segs.size(); ++g) {
          const Segment& seg = sc.segs[g];
          scores(sc.d_o.data(), R, d, sl.v_cols[seg.level].data() + seg.group * d * sl.W, sl.W, sc.dp.data() + g * sl.W, M);
        }
        for (int r = 0; r < R; ++r) {
          float* p = sc.s.data() + r * M;
          float* ds = sc.dp.data() + r * M;
          const bool empty = std::isinf(sc.lse2[r]);  // a row that saw no key has no gradient
          for (int64_t j = 0; j < M; ++j) {
            const float e = (p[j] == kNegInf || empty) ? 0.0f : exp2_nonpositive(std::min(p[j] - sc.lse2[r], 0.0f));
            p[j] = e;
            ds[j] = e * (ds[j] - sc.delta[r]);
          }
        }
        // dQ = scale * dS · K.
        std::fill(sc.acc.begin(), sc.acc.begin() + R * d, 0.0f);
        for (size_t g = 0; g < sc.segs.size(); ++g) {
          const Segment& seg = sc.segs[g];
          accumulate(sc.dp.data() + g * sl.W, M, R, seg.lo, seg.hi, sl.k_rows[seg.level].data() + seg.group * B * d, d,
                     sc.acc.data());
        }
        for (int r = 0; r < R; ++r) {
          for (int64_t t = 0; t < d; ++t) sc.acc[r * d + t] *= a.scale;
          store_row(a.dq, a.dq.offset({b, h, qb * B + r, 0}), d, sc.acc.data() + r * d);
        }
        // dK += scale * dS^T · Q, dV += P^T · dO, into this thread's pyramid gradients:
        // the segment's columns transposed to [key, row] so accumulate() keeps four key
        // rows in registers while it walks the block's query rows.
        sc.pt.resize(sl.W * R);
        sc.dst.resize(sl.W * R);
        for (size_t g = 0; g < sc.segs.size(); ++g) {
          const Segment& seg = sc.segs[g];
          for (int j = seg.lo; j < seg.hi; ++j)
            for (int r = 0; r < R; ++r) {
              const int64_t col = r * M + static_cast<int64_t>(g) * sl.W + j;
              sc.pt[j * R + r] = sc.s[col];
              sc.dst[j * R + r] = a.scale * sc.dp[col];
            }
          const int64_t first_row = (seg.group * B + seg.lo) * d;
          accumulate(sc.dst.data() + seg.lo * R, R, seg.hi - seg.lo, 0, R, sc.q.data(), d,
                     dk_pyr[seg.level].data() + first_row);
          accumulate(sc.pt.data() + seg.lo * R, R, seg.hi - seg.lo, 0, R, sc.d_o.data(), d,
                     dv_pyr[seg.level].data() + first_row);
        }
      };
      const int64_t items = group * blocks;
      cpu::parallel_for(threads, threads, [&](int64_t chunk, int thread) {
        for (int64_t item = chunk * items / threads; item < (chunk + 1) * items / threads; ++item)
          process(item, scratch[thread], dk_acc[chunk], dv_acc[chunk]);
      });
      // Sum the chunks' gradients in chunk order, pool them down to the tokens, store.
      for (int t = 1; t < threads; ++t)
        for (int l = 0; l <= L; ++l)
          for (size_t x = 0; x < dk_acc[0][l].size(); ++x) {
            dk_acc[0][l][x] += dk_acc[t][l][x];
            dv_acc[0][l][x] += dv_acc[t][l][x];
          }
      for (int l = L; l >= 1; --l) {
        mean_pool_backward(dk_acc[0][l].data(), plan.level_len[l - 1], d, B, dk_acc[0][l - 1].data());
        mean_pool_backward(dv_acc[0][l].data(), plan.level_len[l - 1], d, B, dv_acc[0][l - 1].data());
      }
      for (int64_t i = 0; i < N; ++i) {
        store_row(a.dk, a.dk.offset({b, h_kv, i, 0}), d, dk_acc[0][0].data() + i * d);
        store_row(a.dv, a.dv.offset({b, h_kv, i, 0}), d, dv_acc[0][0].data() + i * d);
      }
    }
  }
  return {};
}

}  // namespace sparsa::llsa_detail
