// cpu attention: the fast CPU path of dense and block-sparse attention.
//
// One mainloop (STYLE.md 5): a tile of up to kTileQ query rows walks a sequence of
// key chunks of up to kTileK keys with an online softmax in base 2 (FlashAttention's
// recurrence), f32 accumulation. The two hooks are
//   - which query rows form a tile (dense: consecutive rows; block-sparse: the rows
//     of one query block, read through perm_q), and
//   - which key chunks a tile visits (dense: all keys; block-sparse: the tokens of the
//     listed key blocks, read through perm_kv).
// Work items (batch x head x query tile) are spread over threads dynamically.
// Inner loops have compile-time trip counts over the key chunk so the compiler
// vectorises them (AVX2/AVX-512 with -march=native).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/backends.h"
#include "cpu/parallel.h"

namespace sparsa::cpu {

using detail::AttentionParams;

namespace {

constexpr int kTileQ = 64;  // query rows per tile
constexpr int kTileK = 64;  // keys per chunk
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x for x <= 0 (arguments below -126 give 0). Rounds x to the nearest integer n
// (1.5*2^23 trick, vectorisable) and evaluates 2^f, f in [-0.5, 0.5], by its Taylor
// series to degree 7: truncation error (0.5 ln 2)^8 / 8! < 1e-8, below f32 rounding.
inline float exp2_nonpositive(float x) {
  x = std::clamp(x, -126.0f, 0.0f);
  constexpr float kRound = 12582912.0f;
  const float n = (x + kRound) - kRound;
  const float f = x - n;
  constexpr float c1 = 0.6931471805599453f, c2 = 0.2402265069591007f, c3 = 0.05550410866482158f,
                  c4 = 0.009618129107628477f, c5 = 0.0013333558146428443f, c6 = 1.5403530393381608e-4f,
                  c7 = 1.525273380405984e-5f;
  const float poly = 1.0f + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * (c6 + f * c7))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return std::bit_cast<float>(bits) * poly;
}

// Per-thread scratch for one tile.
struct TileScratch {
  std::vector<float> q;    // [kTileQ, d], pre-scaled by scale*log2(e)
  std::vector<float> kt;   // [d, kTileK], the key chunk transposed
  std::vector<float> v;    // [kTileK, d]
  std::vector<float> s;    // [kTileQ, kTileK] logits, then probabilities
  std::vector<float> acc;  // [kTileQ, d]
  float m[kTileQ], l[kTileQ], alpha[kTileQ];
  int64_t key_pos[kTileK];

  explicit TileScratch(int64_t d)
      : q(kTileQ * d), kt(d * kTileK), v(kTileK * d), s(kTileQ * kTileK), acc(kTileQ * d) {}
};

// S[r, j] = sum_t Q[r, t] * Kt[t, j] for the tile's rows; four rows at a time so each
// loaded key vector feeds four FMAs.
void scores(const float* q, const float* kt, float* s, int rows, int64_t d) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    float a0[kTileK] = {}, a1[kTileK] = {}, a2[kTileK] = {}, a3[kTileK] = {};
    const float *q0 = q + r * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
    for (int64_t t = 0; t < d; ++t) {
      const float* kr = kt + t * kTileK;
      const float x0 = q0[t], x1 = q1[t], x2 = q2[t], x3 = q3[t];
      for (int j = 0; j < kTileK; ++j) {
        a0[j] += x0 * kr[j];
        a1[j] += x1 * kr[j];
        a2[j] += x2 * kr[j];
        a3[j] += x3 * kr[j];
      }
    }
    std::memcpy(s + (r + 0) * kTileK, a0, sizeof a0);
    std::memcpy(s + (r + 1) * kTileK, a1, sizeof a1);
    std::memcpy(s + (r + 2) * kTileK, a2, sizeof a2);
    std::memcpy(s + (r + 3) * kTileK, a3, sizeof a3);
  }
  for (; r < rows; ++r) {
    float a[kTileK] = {};
    const float* qr = q + r * d;
    for (int64_t t = 0; t < d; ++t) {
      const float* kr = kt + t * kTileK;
      for (int j = 0; j < kTileK; ++j) a[j] += qr[t] * kr[j];
    }
    std::memcpy(s + r * kTileK, a, sizeof a);
  }
}

// acc[r, :] = alpha[r] * acc[r, :] + sum_j P[r, j] * V[j, :], in column chunks of 32
// and four rows at a time (16 vector accumulators with AVX-512).
void accumulate_pv(const float* p, const float* v, const float* alpha, float* acc, int rows, int keys, int64_t d) {
  constexpr int kChunk = 32;
  int64_t c0 = 0;
  for (; c0 + kChunk <= d; c0 += kChunk) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      float o[4][kChunk];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < kChunk; ++c) o[i][c] = acc[(r + i) * d + c0 + c] * alpha[r + i];
      for (int j = 0; j < keys; ++j) {
        const float* vr = v + j * d + c0;
        const float p0 = p[(r + 0) * kTileK + j], p1 = p[(r + 1) * kTileK + j], p2 = p[(r + 2) * kTileK + j],
                    p3 = p[(r + 3) * kTileK + j];
        for (int c = 0; c < kChunk; ++c) {
          o[0][c] += p0 * vr[c];
          o[1][c] += p1 * vr[c];
          o[2][c] += p2 * vr[c];
          o[3][c] += p3 * vr[c];
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < kChunk; ++c) acc[(r + i) * d + c0 + c] = o[i][c];
    }
    for (; r < rows; ++r) {
      float o[kChunk];
      for (int c = 0; c < kChunk; ++c) o[c] = acc[r * d + c0 + c] * alpha[r];
      for (int j = 0; j < keys; ++j) {
        const float pj = p[r * kTileK + j];
        for (int c = 0; c < kChunk; ++c) o[c] += pj * v[j * d + c0 + c];
      }
      for (int c = 0; c < kChunk; ++c) acc[r * d + c0 + c] = o[c];
    }
  }
  for (int r = 0; r < rows; ++r) {  // remaining columns (head_dim not a multiple of 32)
    for (int64_t c = c0; c < d; ++c) {
      float o = acc[r * d + c] * alpha[r];
      for (int j = 0; j < keys; ++j) o += p[r * kTileK + j] * v[j * d + c];
      acc[r * d + c] = o;
    }
  }
}

// The mainloop for one tile: rows at original positions row_pos[0..rows) of (b, h);
// next_chunk(key_pos) fills up to kTileK original key positions and returns how many
// (0 ends the walk).
template <class NextChunk>
void attend_tile(const AttentionParams& p, TileScratch& ts, int64_t b, int64_t h, const int64_t* row_pos, int rows,
                 NextChunk&& next_chunk) {
  const int64_t d = p.head_dim;
  const int64_t h_kv = h / p.group();
  const float qscale = p.scale * kLog2e;  // logits in base 2
  for (int r = 0; r < rows; ++r) {
    float* qr = ts.q.data() + r * d;
    detail::load_row(p.q, p.dtype, p.q_off(b, h, row_pos[r]), d, qr);
    for (int64_t t = 0; t < d; ++t) qr[t] *= qscale;
    ts.m[r] = -std::numeric_limits<float>::infinity();
    ts.l[r] = 0.0f;
  }
  std::fill(ts.acc.begin(), ts.acc.begin() + rows * d, 0.0f);

  std::vector<float> row(d);
  for (int keys = next_chunk(ts.key_pos); keys > 0; keys = next_chunk(ts.key_pos)) {
    // Load the chunk: K transposed (padding columns zero), V row-major.
    for (int j = 0; j < keys; ++j) {
      detail::load_row(p.k, p.dtype, p.k_off(b, h_kv, ts.key_pos[j]), d, row.data());
      for (int64_t t = 0; t < d; ++t) ts.kt[t * kTileK + j] = row[t];
      detail::load_row(p.v, p.dtype, p.v_off(b, h_kv, ts.key_pos[j]), d, ts.v.data() + j * d);
    }
    for (int j = keys; j < kTileK; ++j)
      for (int64_t t = 0; t < d; ++t) ts.kt[t * kTileK + j] = 0.0f;

    scores(ts.q.data(), ts.kt.data(), ts.s.data(), rows, d);

    // Online softmax update (base 2).
    for (int r = 0; r < rows; ++r) {
      float* sr = ts.s.data() + r * kTileK;
      float chunk_max = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < keys; ++j) chunk_max = std::max(chunk_max, sr[j]);
      const float m_new = std::max(ts.m[r], chunk_max);
      float sum = 0.0f;
      for (int j = 0; j < kTileK; ++j) {
        const float e = exp2_nonpositive(sr[j] - m_new);
        sr[j] = j < keys ? e : 0.0f;
        sum += sr[j];
      }
      ts.alpha[r] = exp2_nonpositive(ts.m[r] - m_new);  // 0 on the first chunk (m = -inf)
      ts.l[r] = ts.l[r] * ts.alpha[r] + sum;
      ts.m[r] = m_new;
    }
    accumulate_pv(ts.s.data(), ts.v.data(), ts.alpha, ts.acc.data(), rows, keys, d);
  }

  for (int r = 0; r < rows; ++r) {
    const int64_t i = row_pos[r];
    const bool empty = ts.l[r] == 0.0f;
    const float inv_l = empty ? 0.0f : 1.0f / ts.l[r];
    if (p.dtype == DType::f32) {
      float* o = static_cast<float*>(p.out) + p.out_off(b, h, i);
      for (int64_t t = 0; t < d; ++t) o[t] = ts.acc[r * d + t] * inv_l;
    } else {
      for (int64_t t = 0; t < d; ++t) detail::store_element(p.out, p.dtype, p.out_off(b, h, i) + t, ts.acc[r * d + t] * inv_l);
    }
    p.lse_at(b, h, i) = empty ? -std::numeric_limits<float>::infinity() : (ts.m[r] + std::log2(ts.l[r])) * kLn2;
  }
}

}  // namespace

Status attention(const AttentionParams& p) {
  const int threads = resolve_threads(p.num_threads);
  std::vector<TileScratch> scratch;
  scratch.reserve(threads);
  for (int t = 0; t < threads; ++t) scratch.emplace_back(p.head_dim);

  if (p.index == nullptr) {
    // Dense: tiles of kTileQ consecutive rows, all keys in consecutive chunks.
    const int64_t tiles = (p.len_q + kTileQ - 1) / kTileQ;
    parallel_for(p.batch * p.heads_q * tiles, threads, [&](int64_t item, int thread) {
      const int64_t tile = item % tiles, h = (item / tiles) % p.heads_q, b = item / (tiles * p.heads_q);
      int64_t row_pos[kTileQ];
      const int rows = static_cast<int>(std::min<int64_t>(kTileQ, p.len_q - tile * kTileQ));
      for (int r = 0; r < rows; ++r) row_pos[r] = tile * kTileQ + r;
      int64_t next = 0;
      attend_tile(p, scratch[thread], b, h, row_pos, rows, [&](int64_t* key_pos) {
        const int n = static_cast<int>(std::min<int64_t>(kTileK, p.len_kv - next));
        for (int j = 0; j < n; ++j) key_pos[j] = next + j;
        next += n;
        return n;
      });
    });
    return {};
  }

  // Block-sparse: one work item per (b, h, query block); a block larger than kTileQ
  // is walked in sub-tiles that each visit the block's key list.
  const BlockIndex& ix = *p.index;
  parallel_for(p.batch * p.heads_q * ix.num_q_blocks, threads, [&](int64_t item, int thread) {
    const int64_t qb = item % ix.num_q_blocks, h = (item / ix.num_q_blocks) % p.heads_q,
                  b = item / (ix.num_q_blocks * p.heads_q);
    const int64_t h_kv = h / p.group();
    const int64_t q_begin = qb * ix.block_q, q_end = std::min<int64_t>(q_begin + ix.block_q, p.len_q);
    const int32_t count = detail::index_count(ix, b, h, qb);
    for (int64_t t0 = q_begin; t0 < q_end; t0 += kTileQ) {
      int64_t row_pos[kTileQ];
      const int rows = static_cast<int>(std::min<int64_t>(kTileQ, q_end - t0));
      for (int r = 0; r < rows; ++r) row_pos[r] = detail::perm_q_at(ix, b, h, t0 + r);
      int32_t slot = 0;
      int64_t pos = count > 0 ? detail::index_block(ix, b, h, qb, 0) * int64_t{ix.block_kv} : 0;
      attend_tile(p, scratch[thread], b, h, row_pos, rows, [&](int64_t* key_pos) {
        int n = 0;
        while (n < kTileK && slot < count) {
          const int64_t kb = detail::index_block(ix, b, h, qb, slot);
          const int64_t block_end = std::min<int64_t>((kb + 1) * ix.block_kv, p.len_kv);
          while (n < kTileK && pos < block_end) key_pos[n++] = detail::perm_kv_at(ix, b, h_kv, pos++);
          if (pos >= block_end && ++slot < count) pos = detail::index_block(ix, b, h, qb, slot) * int64_t{ix.block_kv};
        }
        return n;
      });
    }
  });
  return {};
}

Status merge(const detail::MergeParams& p) {
  const Tensor& o1 = p.o1;
  const int64_t B = o1.shape[0], H = o1.shape[1], L = o1.shape[2], D = o1.shape[3];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> a(D), c(D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        const float l1 = p.lse1.ptr<const float>()[p.lse1.offset({b, h, i})];
        const float l2 = p.lse2.ptr<const float>()[p.lse2.offset({b, h, i})];
        const float m = std::max(l1, l2);
        float w1 = 0.0f, w2 = 0.0f, l = neg_inf;
        if (m != neg_inf) {
          w1 = std::exp(l1 - m);
          w2 = std::exp(l2 - m);
          l = m + std::log(w1 + w2);
          const float inv = 1.0f / (w1 + w2);
          w1 *= inv;
          w2 *= inv;
        }
        detail::load_row(o1.data, o1.dtype, o1.offset({b, h, i, 0}), D, a.data());
        detail::load_row(p.o2.data, p.o2.dtype, p.o2.offset({b, h, i, 0}), D, c.data());
        // A side of weight 0 (L = -inf) contributes nothing, even if its O is not finite.
        for (int64_t t = 0; t < D; ++t) a[t] = (w1 > 0.0f ? w1 * a[t] : 0.0f) + (w2 > 0.0f ? w2 * c[t] : 0.0f);
        for (int64_t t = 0; t < D; ++t) detail::store_element(p.out.data, p.out.dtype, p.out.offset({b, h, i, t}), a[t]);
        p.lse.ptr<float>()[p.lse.offset({b, h, i})] = l;
      }
    }
  }
  return {};
}

}  // namespace sparsa::cpu
