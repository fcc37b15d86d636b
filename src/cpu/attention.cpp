// cpu attention: the fast CPU path of dense and block-sparse attention.
//
// One mainloop (hooks, not forks: docs/architecture.md): a tile of up to kTileQ query rows walks a sequence of
// key chunks of up to kTileK keys with an online softmax in base 2 (FlashAttention's
// recurrence), f32 accumulation. The two hooks are
//   - which query rows form a tile (dense: consecutive rows; block-sparse: the rows
//     of one query block, read through perm_q), and
//   - which key chunks a tile visits (dense: all keys; block-sparse: the tokens of the
//     listed key blocks, read through perm_kv).
// Work items (batch x head(s) x query tile) are spread over threads dynamically.
//
// Masks (the per-element hook): every mask shows a query one contiguous key range
// [mask_key_begin, mask_key_end) (sparsa/attention.h). A tile takes its rows' ranges once; keys
// outside their union are never put into a chunk (fully masked blocks are skipped, not computed),
// and a chunk that is not visible to every row of the tile has its masked scores set to -inf
// before a softmax update that gives them weight exactly 0 (and keeps rows that have seen no
// visible key yet at m = -inf, l = 0: such a row ends empty, O = 0 and LSE = -inf).
// Variable-length batches run sequence by sequence, each as a fixed-length call.
//
// Per chunk: K and V rows are read in place (f32, consecutive keys) or converted to f32
// once (any dtype, stride or permutation); scores S^T = K Q^T come from a register-blocked
// micro-kernel with query rows in vector lanes; the softmax statistics of kLanes rows are
// vector operations; O^T = alpha * O^T + V^T P^T comes from a second micro-kernel
// (src/cpu/simd.h). Dense tiles serve up to kMaxHeads query heads of a GQA group per chunk.
//
// Ladder (dense f32, N = 4096, d = 128, GFLOP per CPU-second on a 116.9 peak core; details
// and the rungs that lost in bench/RESULTS.md):
//   0  auto-vectorised 4-row kernels, K transposed per chunk          42
//   1  register-blocked micro-kernels (scores: rows in lanes), vector softmax  86-88
//   2  transposed accumulator: K/V only broadcast, read in place       87-94
//   3  key chunks of 128                                               92-94
//   4  K/V chunk shared by the query heads of a GQA group              93-97
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>
#include <new>
#include <utility>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/backends.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"

namespace sparsa::cpu {

using detail::AttentionParams;
using simd::kLanes;
using simd::Vec;

namespace {

constexpr int kTileQ = 64;  // query rows per tile (a multiple of every kernel's row block)
constexpr int kTileK = 128;  // keys per chunk (96 and 128 measured best; 128 = two 64-key blocks)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kTileQ % (simd::kRowVecs * kLanes) == 0);

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// n contiguous elements of a row into f32 (inline conversions; the generic path is the
// out-of-line per-element one).
void load_row_f32(const void* base, DType dtype, int64_t offset, int64_t n, float* dst) {
  if (dtype == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
  } else if (dtype == DType::bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
  } else if (dtype == DType::f16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
  } else {
    detail::load_row(base, dtype, offset, n, dst);
  }
}

// A zero-initialised f32 buffer aligned to a cache line.
struct AlignedFloats {
  std::unique_ptr<float[]> owner;
  float* data = nullptr;
  explicit AlignedFloats(int64_t n) : owner(new float[n + 16]()) {
    data = owner.get() + (16 - reinterpret_cast<uintptr_t>(owner.get()) / sizeof(float) % 16) % 16;
  }
};

constexpr int kMaxHeads = 4;  // query heads of one GQA group that share a key chunk

// The online-softmax state of one query head over a tile.
struct HeadState {
  AlignedFloats qt;     // [d, kTileQ] queries transposed, pre-scaled by scale*log2(e); pad rows 0
  AlignedFloats acc_t;  // [d, kTileQ] output accumulator
  alignas(64) float m[kTileQ], l[kTileQ], alpha[kTileQ];
  explicit HeadState(int64_t d) : qt(d * kTileQ), acc_t(d * kTileQ) {}
};

// The mask of one tile: the key range [lo[r], hi[r]) of each row, and over the rows the least
// and greatest bounds (keys outside [union_lo, union_hi) are masked for every row; a chunk
// inside [all_lo, all_hi) is visible to every row).
struct TileMask {
  bool active = false;  // false: no mask, every key visible
  int64_t lo[kTileQ], hi[kTileQ];
  int64_t union_lo = 0, union_hi = 0, all_lo = 0, all_hi = 0;

  void set(const AttentionParams& p, const int64_t* row_pos, int rows) {
    active = !p.mask.is_none();
    union_lo = 0;
    union_hi = all_hi = p.len_kv;
    all_lo = 0;
    if (!active) return;
    union_lo = p.len_kv;
    union_hi = 0;
    all_hi = p.len_kv;
    for (int r = 0; r < rows; ++r) {
      lo[r] = mask_key_begin(p.mask, row_pos[r], p.len_q, p.len_kv);
      hi[r] = mask_key_end(p.mask, row_pos[r], p.len_q, p.len_kv);
      if (lo[r] >= hi[r]) continue;  // a row that sees no key widens nothing
      union_lo = std::min(union_lo, lo[r]);
      union_hi = std::max(union_hi, hi[r]);
      all_lo = std::max(all_lo, lo[r]);
      all_hi = std::min(all_hi, hi[r]);
    }
    for (int r = 0; r < rows; ++r) {
      if (lo[r] >= hi[r]) all_hi = 0;  // some row sees nothing: no chunk is visible to all
    }
  }
  // Whether original key position j can be visible to some row of the tile.
  bool may_see(int64_t j) const { return !active || (union_lo <= j && j < union_hi); }
};

// Per-thread scratch; allocated once per call, reused by every tile.
struct TileScratch {
  int64_t d;             // head_dim
  std::vector<HeadState> heads;
  AlignedFloats k_copy;  // [kTileK, d] key chunk, when it cannot be read in place
  AlignedFloats v_copy;  // [kTileK, d]
  AlignedFloats st;      // [kTileK, kTileQ] scores, then probabilities (one head at a time)
  AlignedFloats row;     // [d] one query row being loaded
  int64_t key_pos[kTileK];
  TileMask mask;
  // Rows (head g of the tile, row r) whose f32 result is not finite: redone in f64.
  std::vector<std::pair<int, int>> redo;
  std::vector<int64_t> keys;  // the key list of a redone row
  // The current chunk: rows j of K and V at k + j * ldk, v + j * ldv.
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ldk = 0, ldv = 0;

  TileScratch(int64_t head_dim, int max_heads)
      : d(head_dim), k_copy(kTileK * d), v_copy(kTileK * d), st(kTileK * kTileQ), row(d) {
    heads.reserve(max_heads);
    for (int g = 0; g < max_heads; ++g) heads.emplace_back(d);
  }
};

using simd::kPvKernels;
using simd::kScoresKernels;

// S^T[j, r] = <k_j, q_r> (already in base-2 logits) for j < keys, r < rows.
void scores(TileScratch& ts, const HeadState& hs, int rows, int keys) {
  const int row_vecs = static_cast<int>((rows + kLanes - 1) / kLanes);
  for (int i0 = 0; i0 < row_vecs; i0 += simd::kRowVecs) {
    const int in = std::min(simd::kRowVecs, row_vecs - i0);
    for (int j0 = 0; j0 < keys; j0 += simd::kCols) {
      const int jn = std::min(simd::kCols, keys - j0);
      kScoresKernels[jn - 1][in - 1](hs.qt.data + i0 * kLanes, kTileQ, ts.k + j0 * ts.ldk, ts.ldk, ts.d,
                                     ts.st.data + j0 * kTileQ + i0 * kLanes);
    }
  }
}

// Online softmax over one chunk, kLanes rows at a time: new running max m', P = 2^(S - m'),
// alpha = 2^(m - m'), l = alpha * l + sum_j P.
void softmax_update(TileScratch& ts, HeadState& hs, int rows, int keys) {
  for (int i = 0; i < rows; i += kLanes) {
    const Vec m_old = simd::load(hs.m + i);
    Vec m_new = m_old;
    for (int j = 0; j < keys; ++j) m_new = simd::max(m_new, simd::load(ts.st.data + j * kTileQ + i));
    Vec sum = simd::splat(0.0f);
    for (int j = 0; j < keys; ++j) {
      float* s = ts.st.data + j * kTileQ + i;
      const Vec p = simd::exp2_nonpositive(simd::load(s) - m_new);
      simd::store(s, p);
      sum += p;
    }
    const Vec alpha = simd::exp2_nonpositive(m_old - m_new);  // ~0 on the first chunk (m = -inf)
    simd::store(hs.alpha + i, alpha);
    simd::store(hs.l + i, simd::load(hs.l + i) * alpha + sum);
    simd::store(hs.m + i, m_new);
  }
}

// softmax_update for a chunk whose masked scores are -inf: those get P = 0 exactly, and a row
// that has seen no visible key yet keeps m = -inf and l = 0 (the subtraction uses 0 for its m,
// so that -inf - -inf never makes a NaN).
void softmax_update_masked(TileScratch& ts, HeadState& hs, int rows, int keys) {
  const Vec neg_inf = simd::splat(-std::numeric_limits<float>::infinity()), zero = simd::splat(0.0f);
  for (int i = 0; i < rows; i += kLanes) {
    const Vec m_old = simd::load(hs.m + i);
    Vec m_new = m_old;
    for (int j = 0; j < keys; ++j) m_new = simd::max(m_new, simd::load(ts.st.data + j * kTileQ + i));
    const Vec m_sub = m_new == neg_inf ? zero : m_new;
    Vec sum = zero;
    for (int j = 0; j < keys; ++j) {
      float* s = ts.st.data + j * kTileQ + i;
      const Vec x = simd::load(s);
      const Vec p = x == neg_inf ? zero : simd::exp2_nonpositive(x - m_sub);
      simd::store(s, p);
      sum += p;
    }
    const Vec alpha = m_old == neg_inf ? zero : simd::exp2_nonpositive(m_old - m_sub);
    simd::store(hs.alpha + i, alpha);
    simd::store(hs.l + i, simd::load(hs.l + i) * alpha + sum);
    simd::store(hs.m + i, m_new);
  }
}

// Sets the scores of the keys outside each row's range to -inf (rows r < rows; pad rows keep
// their finite scores).
void apply_mask(TileScratch& ts, int rows, int keys) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < keys; ++j) {
    const int64_t key = ts.key_pos[j];
    float* s = ts.st.data + j * kTileQ;
    for (int r = 0; r < rows; ++r) {
      if (key < ts.mask.lo[r] || key >= ts.mask.hi[r]) s[r] = neg_inf;
    }
  }
}

// acc_t[:, r] = alpha[r] * acc_t[:, r] + sum_j P[r, j] * V[j, :].
void accumulate_pv(const TileScratch& ts, HeadState& hs, int rows, int keys) {
  const int row_vecs = static_cast<int>((rows + kLanes - 1) / kLanes);
  for (int i0 = 0; i0 < row_vecs; i0 += simd::kRowVecs) {
    const int in = std::min(simd::kRowVecs, row_vecs - i0);
    for (int64_t c0 = 0; c0 < ts.d; c0 += simd::kCols) {
      const int cn = static_cast<int>(std::min<int64_t>(simd::kCols, ts.d - c0));
      kPvKernels[cn - 1][in - 1](ts.st.data + i0 * kLanes, kTileQ, ts.v + c0, ts.ldv, keys, hs.alpha + i0 * kLanes,
                                 hs.acc_t.data + c0 * kTileQ + i0 * kLanes, kTileQ);
    }
  }
}

// Points ts.k / ts.v at the chunk: in place when the keys are consecutive f32 rows,
// else converted (any dtype, stride or permutation) into the chunk buffers.
void load_chunk(const AttentionParams& p, TileScratch& ts, int64_t b, int64_t h_kv, int keys) {
  bool consecutive = p.dtype == DType::f32;
  for (int j = 1; j < keys && consecutive; ++j) consecutive = ts.key_pos[j] == ts.key_pos[0] + j;
  if (consecutive) {
    ts.k = static_cast<const float*>(p.k) + p.k_off(b, h_kv, ts.key_pos[0]);
    ts.v = static_cast<const float*>(p.v) + p.v_off(b, h_kv, ts.key_pos[0]);
    ts.ldk = p.k_stride[2];
    ts.ldv = p.v_stride[2];
    return;
  }
  for (int j = 0; j < keys; ++j) {
    load_row_f32(p.k, p.dtype, p.k_off(b, h_kv, ts.key_pos[j]), ts.d, ts.k_copy.data + j * ts.d);
    load_row_f32(p.v, p.dtype, p.v_off(b, h_kv, ts.key_pos[j]), ts.d, ts.v_copy.data + j * ts.d);
  }
  ts.k = ts.k_copy.data;
  ts.v = ts.v_copy.data;
  ts.ldk = ts.ldv = ts.d;
}

// The mainloop for one tile: rows at original positions row_pos[0..rows) of query heads
// h0 .. h0 + heads (one GQA group, sharing every key chunk); next_chunk(key_pos) fills
// up to kTileK original key positions and returns how many (0 ends the walk).
template <class NextChunk>
void attend_tile(const AttentionParams& p, TileScratch& ts, int64_t b, int64_t h0, int heads, const int64_t* row_pos,
                 int rows, NextChunk&& next_chunk) {
  const int64_t d = ts.d;
  const int64_t h_kv = h0 / p.group();
  const float qscale = p.scale * kLog2e;  // logits in base 2
  const int rows_v = static_cast<int>(round_up(rows, kLanes));
  for (int g = 0; g < heads; ++g) {
    HeadState& hs = ts.heads[g];
    for (int r = 0; r < rows_v; ++r) {
      if (r < rows) {
        load_row_f32(p.q, p.dtype, p.q_off(b, h0 + g, row_pos[r]), d, ts.row.data);
        for (int64_t t = 0; t < d; ++t) hs.qt.data[t * kTileQ + r] = ts.row.data[t] * qscale;
      } else {
        for (int64_t t = 0; t < d; ++t) hs.qt.data[t * kTileQ + r] = 0.0f;  // pad rows: finite scores
      }
      hs.m[r] = -std::numeric_limits<float>::infinity();
      hs.l[r] = 0.0f;
    }
    std::fill(hs.acc_t.data, hs.acc_t.data + d * kTileQ, 0.0f);
  }

  // keys seen: a row is empty (O = 0, LSE = -inf) when none was, or when the mask hid every
  // one it saw (l = 0: a visible key adds at least 2^-126 to l, the largest adds 1)
  int64_t visited = 0;
  for (int keys = next_chunk(ts.key_pos); keys > 0; keys = next_chunk(ts.key_pos)) {
    visited += keys;
    load_chunk(p, ts, b, h_kv, keys);
    bool masked = false;
    if (ts.mask.active) {
      int64_t first = ts.key_pos[0], last = ts.key_pos[0];
      for (int j = 1; j < keys; ++j) {
        first = std::min(first, ts.key_pos[j]);
        last = std::max(last, ts.key_pos[j]);
      }
      masked = first < ts.mask.all_lo || last >= ts.mask.all_hi;
    }
    for (int g = 0; g < heads; ++g) {
      scores(ts, ts.heads[g], rows, keys);
      if (masked) {
        apply_mask(ts, rows, keys);
        softmax_update_masked(ts, ts.heads[g], rows, keys);
      } else {
        softmax_update(ts, ts.heads[g], rows, keys);
      }
      accumulate_pv(ts, ts.heads[g], rows, keys);
    }
  }

  ts.redo.clear();
  for (int g = 0; g < heads; ++g) {
    const HeadState& hs = ts.heads[g];
    const int64_t h = h0 + g;
    for (int r = 0; r < rows; ++r) {
      const int64_t i = row_pos[r];
      const bool empty = visited == 0 || hs.l[r] == 0.0f;
      const float inv_l = empty ? 0.0f : 1.0f / hs.l[r];
      const float* a = hs.acc_t.data + r;  // column r of [d, kTileQ]
      const float lse = empty ? -std::numeric_limits<float>::infinity() : (hs.m[r] + std::log2(hs.l[r])) * kLn2;
      // Logits or sums beyond f32 (inputs near FLT_MAX, a huge scale) turn into inf - inf =
      // NaN here, and a NaN input must come out NaN, not as an empty row (LSE -inf): such a
      // row is redone in f64 (cpu_ref's row), which gives the reference's answer for both.
      bool finite = empty || std::isfinite(lse);
      for (int64_t t = 0; t < d && finite; ++t) finite = std::isfinite(a[t * kTileQ] * inv_l);
      if (!finite) {
        ts.redo.emplace_back(g, r);
        continue;
      }
      if (p.dtype == DType::f32) {
        float* o = static_cast<float*>(p.out) + p.out_off(b, h, i);
        for (int64_t t = 0; t < d; ++t) o[t] = a[t * kTileQ] * inv_l;
      } else {
        for (int64_t t = 0; t < d; ++t)
          detail::store_element(p.out, p.dtype, p.out_off(b, h, i) + t, a[t * kTileQ] * inv_l);
      }
      p.lse_at(b, h, i) = lse;
    }
  }
}

// The first row whose LSE has no finite f32 value (see cpu_ref::attend_row), over all threads.
struct Overflow {
  std::mutex mutex;
  int64_t b = -1, h = -1, i = -1;
  void note(int64_t b_, int64_t h_, int64_t i_) {
    std::lock_guard<std::mutex> lock(mutex);
    if (b < 0 || std::tie(b_, h_, i_) < std::tie(b, h, i)) std::tie(b, h, i) = std::tie(b_, h_, i_);
  }
};

// Redoes the rows attend_tile left in ts.redo through cpu_ref's f64 row over ts.keys (those of
// ts.keys the row's mask shows).
void redo_rows(const AttentionParams& p, TileScratch& ts, int64_t b, int64_t h0, const int64_t* row_pos,
               Overflow& overflow) {
  std::vector<int64_t> visible;
  for (auto [g, r] : ts.redo) {
    const std::vector<int64_t>* keys = &ts.keys;
    if (ts.mask.active) {
      visible.clear();
      for (int64_t j : ts.keys)
        if (ts.mask.lo[r] <= j && j < ts.mask.hi[r]) visible.push_back(j);
      keys = &visible;
    }
    if (!cpu_ref::attend_row(p, b, h0 + g, row_pos[r], *keys)) overflow.note(b, h0 + g, row_pos[r]);
  }
}

Status fixed_length_attention(const AttentionParams& p);

// A variable-length batch, one sequence at a time (each a fixed-length call over its own
// lengths); a sequence with queries and no keys gets empty rows.
Status varlen_attention(const AttentionParams& p) {
  for (int64_t s = 0; s < p.batch; ++s) {
    BlockIndex sub_index;
    const AttentionParams one = detail::sequence_params(p, s, &sub_index);
    if (one.len_q == 0) continue;
    if (one.len_kv == 0) {
      for (int64_t h = 0; h < one.heads_q; ++h) {
        for (int64_t i = 0; i < one.len_q; ++i) {
          for (int64_t t = 0; t < one.head_dim; ++t) detail::store_element(one.out, one.dtype, one.out_off(0, h, i) + t, 0.0f);
          one.lse_at(0, h, i) = -std::numeric_limits<float>::infinity();
        }
      }
      continue;
    }
    const Status st = fixed_length_attention(one);
    if (!st.ok()) return {st.code(), "sequence " + std::to_string(s) + " of the variable-length batch: " + st.message()};
  }
  return {};
}

Status fixed_length_attention(const AttentionParams& p) {
  const int threads = resolve_threads(p.num_threads);
  // Dense tiles take up to kMaxHeads query heads of a GQA group at once (the same
  // rows and keys); block-sparse plans differ per query head, so they take one.
  const int group_heads = p.index == nullptr ? static_cast<int>(std::min<int64_t>(kMaxHeads, p.group())) : 1;
  std::vector<TileScratch> scratch;
  scratch.reserve(threads);
  for (int t = 0; t < threads; ++t) scratch.emplace_back(p.head_dim, group_heads);
  Overflow overflow;
  auto result = [&]() -> Status {
    if (overflow.b >= 0) return cpu_ref::lse_overflow(p, overflow.b, overflow.h, overflow.i);
    return {};
  };

  if (p.index == nullptr) {
    // Dense: tiles of kTileQ consecutive rows x up to kMaxHeads heads of one group, all
    // keys in consecutive chunks.
    const int64_t tiles = (p.len_q + kTileQ - 1) / kTileQ;
    const int64_t head_sets = p.heads_kv * ((p.group() + group_heads - 1) / group_heads);
    parallel_for(p.batch * head_sets * tiles, threads, [&](int64_t item, int thread) {
      const int64_t tile = item % tiles, set = (item / tiles) % head_sets, b = item / (tiles * head_sets);
      const int64_t sets_per_kv = head_sets / p.heads_kv, h_kv = set / sets_per_kv;
      const int64_t h0 = h_kv * p.group() + (set % sets_per_kv) * group_heads;
      const int heads = static_cast<int>(std::min<int64_t>(group_heads, (h_kv + 1) * p.group() - h0));
      int64_t row_pos[kTileQ];
      const int rows = static_cast<int>(std::min<int64_t>(kTileQ, p.len_q - tile * kTileQ));
      for (int r = 0; r < rows; ++r) row_pos[r] = tile * kTileQ + r;
      TileScratch& ts = scratch[thread];
      ts.mask.set(p, row_pos, rows);
      // Only the keys some row of the tile sees: [union_lo, union_hi) (all keys without a mask).
      int64_t next = ts.mask.union_lo;
      const int64_t end = std::max(ts.mask.union_lo, ts.mask.union_hi);
      attend_tile(p, ts, b, h0, heads, row_pos, rows, [&](int64_t* key_pos) {
        const int n = static_cast<int>(std::min<int64_t>(kTileK, end - next));
        for (int j = 0; j < n; ++j) key_pos[j] = next + j;
        next += n;
        return n;
      });
      if (!ts.redo.empty()) {
        ts.keys.resize(p.len_kv);
        for (int64_t j = 0; j < p.len_kv; ++j) ts.keys[j] = j;
        redo_rows(p, ts, b, h0, row_pos, overflow);
      }
    });
    return result();
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
      TileScratch& ts = scratch[thread];
      ts.mask.set(p, row_pos, rows);
      // Without perm_kv a key block's tokens are consecutive: the part of it outside the tile's
      // union range is skipped whole (a fully masked block costs nothing); with perm_kv each
      // token is tested.
      const bool clip = ts.mask.active && !ix.perm_kv.defined();
      attend_tile(p, ts, b, h, 1, row_pos, rows, [&](int64_t* key_pos) {
        int n = 0;
        while (n < kTileK && slot < count) {
          const int64_t kb = detail::index_block(ix, b, h, qb, slot);
          int64_t block_end = std::min<int64_t>((kb + 1) * ix.block_kv, p.len_kv);
          if (clip) {
            pos = std::max(pos, ts.mask.union_lo);
            block_end = std::min(block_end, ts.mask.union_hi);
          }
          while (n < kTileK && pos < block_end) {
            const int64_t key = detail::perm_kv_at(ix, b, h_kv, pos++);
            if (ts.mask.may_see(key)) key_pos[n++] = key;
          }
          if (pos >= block_end && ++slot < count) pos = detail::index_block(ix, b, h, qb, slot) * int64_t{ix.block_kv};
        }
        return n;
      });
      if (!ts.redo.empty()) {  // the block's keys, as cpu_ref lists them
        ts.keys.clear();
        for (int32_t s = 0; s < count; ++s) {
          const int64_t kb = detail::index_block(ix, b, h, qb, s);
          for (int64_t pk = kb * ix.block_kv; pk < std::min<int64_t>((kb + 1) * ix.block_kv, p.len_kv); ++pk) {
            ts.keys.push_back(detail::perm_kv_at(ix, b, h_kv, pk));
          }
        }
        redo_rows(p, ts, b, h, row_pos, overflow);
      }
    }
  });
  return result();
}

}  // namespace

Status attention(const AttentionParams& p) {
  return p.varlen() ? varlen_attention(p) : fixed_length_attention(p);
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
