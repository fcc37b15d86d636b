// Internal: the kernels of block-diffusion decoding on the device (losa.cu launches them): the
// paged cache's append and page min/max, LoSA's active rows, QUEST's page scores and selection,
// attention of a row over its pages, and intra-block attention merged with the prefix by LSE.
//
// Attention rows are one warp each: lane l holds elements [l * E, (l + 1) * E) of the query, the
// output accumulator and every key / value row it reads (E = D / 32), a row's logit is a warp
// sum. Logits are kept in base 2 (q pre-scaled by scale * log2 e; LSE converted back at the end).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/select/ba_att_common.cuh"
#include "cuda/select/warp_select.cuh"

namespace sparsa::cuda::losa {

using ba_att::to_float;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxBatch = 64;

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// A [batch, heads, rows, D] tensor with strides in elements (the last dimension contiguous).
template <class T>
struct Rows4 {
  T* data;
  int64_t sb, sh, ss;
  __device__ __forceinline__ T* row(int64_t b, int64_t h, int64_t i) const { return data + b * sb + h * sh + i * ss; }
};

// What every step kernel reads: the pool, the sequences of the batch, the shapes.
struct PoolView {
  const void* k;    // [heads_kv, pool_tokens, D]
  const void* v;
  const void* min;  // [heads_kv, pool_pages, D]
  const void* max;
  int64_t pool_tokens, pool_pages;
  int page_size;
  int64_t first_page[kMaxBatch];
  int64_t length[kMaxBatch];
  __device__ __forceinline__ int64_t pages(int b) const { return (length[b] + page_size - 1) / page_size; }
};

// ---- the cache: append, page min/max -----------------------------------------------------------

// k, v [1, heads_kv, n, D] into the pool at tokens [token0, token0 + n) of kv head h (pool rows).
template <class T>
__global__ void append_rows_kernel(Rows4<const T> k, Rows4<const T> v, T* k_pool, T* v_pool, int64_t pool_tokens,
                                   int64_t token0, int64_t n, int64_t heads_kv, int d) {
  const int64_t total = heads_kv * n * d, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t c = e % d, i = (e / d) % n, h = e / (d * n);
    const int64_t dst = (h * pool_tokens + token0 + i) * d + c;
    k_pool[dst] = k.row(0, h, i)[c];
    v_pool[dst] = v.row(0, h, i)[c];
  }
}

// Pages [page0, page0 + gridDim.x) of the sequence (pool page first_page + page), kv head
// blockIdx.y, one thread per element: min / max over the page's tokens below `length`.
template <class T>
__global__ void page_minmax_kernel(const T* k_pool, T* min_pool, T* max_pool, int64_t pool_tokens, int64_t pool_pages,
                                   int64_t first_page, int64_t page0, int64_t length, int page_size, int d) {
  const int64_t page = page0 + blockIdx.x, h = blockIdx.y;
  const int64_t begin = page * page_size, end = min(length, begin + page_size);
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    const T* col = k_pool + (h * pool_tokens + first_page * page_size + begin) * d + c;
    float lo = to_float(col[0]), hi = lo;
    for (int64_t t = 1; t < end - begin; ++t) {
      const float x = to_float(col[t * d]);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    const int64_t at = (h * pool_pages + first_page + page) * d + c;
    min_pool[at] = from_float<T>(lo);
    max_pool[at] = from_float<T>(hi);
  }
}

// ---- LoSA's active rows ------------------------------------------------------------------------

// Per batch entry (blockIdx.x): mse_i = mean over heads and dims of (q_i - q_ref_i)^2 in f64 (a
// warp per row, its lanes over the row's elements, the loads of several heads in flight), then
// the active rows ascending: all rows, those with mse above the threshold (or NaN), or the top
// active_k (NaN first, larger first, ties to the lower row) — sparsa::active_rows' order.
template <class T, int D>
__global__ void active_rows_kernel(Rows4<const T> q, const T* q_ref, int heads_q, int block, bool all_rows,
                                   int active_k, bool use_threshold, double threshold, int32_t* active,
                                   int32_t* counts) {
  constexpr int E = D / 32;
  __shared__ double mse[64];
  const int b = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int32_t* out = active + static_cast<int64_t>(b) * block;
  if (all_rows) {
    for (int i = threadIdx.x; i < block; i += blockDim.x) out[i] = i;
    if (threadIdx.x == 0) counts[b] = block;
    return;
  }
  for (int i = warp; i < block; i += warps) {
    double sum = 0.0;
#pragma unroll 4
    for (int h = 0; h < heads_q; ++h) {
      const T* a = q.row(b, h, i) + lane * E;
      const T* r = q_ref + ((static_cast<int64_t>(b) * heads_q + h) * block + i) * D + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const double diff = static_cast<double>(to_float(a[e])) - to_float(r[e]);
        sum += diff * diff;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) mse[i] = sum / (static_cast<double>(heads_q) * D);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int n = 0;
  if (use_threshold) {
    for (int i = 0; i < block; ++i)
      if (mse[i] > threshold || isnan(mse[i])) out[n++] = i;
    counts[b] = n;
    return;
  }
  // Top active_k by selection (block <= 64): a row is taken when no untaken row ranks before it.
  uint64_t taken = 0;
  const int k = min(active_k, block);
  for (int round = 0; round < k; ++round) {
    int best = -1;
    for (int i = 0; i < block; ++i) {
      if (taken >> i & 1) continue;
      if (best < 0) {
        best = i;
        continue;
      }
      const bool ni = isnan(mse[i]), nb = isnan(mse[best]);
      const bool before = ni != nb ? ni : (!ni && mse[i] > mse[best]);  // ties keep the lower row
      if (before) best = i;
    }
    taken |= uint64_t{1} << best;
  }
  for (int i = 0; i < block; ++i)
    if (taken >> i & 1) out[n++] = i;
  counts[b] = n;
}

// ---- QUEST: page scores, selection ------------------------------------------------------------

// score(q, page) = sum_d max(q_d max_d, q_d min_d) = q+ . max + q- . min (q+ = max(q, 0), q- =
// min(q, 0)). Grid (page tiles of kScorePages, heads_kv, batch); the tile's min and max rows are
// staged in shared memory by coalesced 16-byte loads (rows padded by 16 bytes, so that the
// threads' 16-byte reads of their own rows hit distinct banks), then one thread per page; the
// queries of the kv head's group at the entry's active rows are in shared memory as q+ and q-
// (f32, read by broadcast). Scores [batch, heads_q, block, score_pages] at (b, h, slot, page).
constexpr int kScoreThreads = 128;
constexpr int kScorePages = kScoreThreads;
constexpr int kScoreQueries = 8;  // queries accumulated at once per pass over a page's metadata

template <int D>
__host__ __device__ constexpr int score_row_elems() { return D + 8; }  // a padded metadata row
template <class T, int D>
__host__ __device__ constexpr size_t score_tile_bytes() {
  return static_cast<size_t>(2) * kScorePages * score_row_elems<D>() * sizeof(T);
}

template <class T, int D>
__global__ void __launch_bounds__(kScoreThreads) quest_scores_kernel(PoolView pool, Rows4<const T> q,
                                                                     const int32_t* active, const int32_t* counts,
                                                                     int heads_q, int group, int block,
                                                                     float* scores, int64_t score_pages) {
  extern __shared__ __align__(16) unsigned char score_smem[];
  T* tile_min = reinterpret_cast<T*>(score_smem);                       // [kScorePages][D + 8]
  T* tile_max = tile_min + kScorePages * score_row_elems<D>();
  float* query_smem = reinterpret_cast<float*>(score_smem + score_tile_bytes<T, D>());  // [queries][2][D]
  const int b = blockIdx.z, h_kv = blockIdx.y;
  const int queries = group * counts[b];
  const int64_t pages = pool.pages(b), page0 = static_cast<int64_t>(blockIdx.x) * kScorePages;
  if (page0 >= pages) return;
  const int tile = static_cast<int>(min(static_cast<int64_t>(kScorePages), pages - page0));
  constexpr int kChunks = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks of a row
  const int64_t at = (h_kv * pool.pool_pages + pool.first_page[b] + page0) * D;
  const uint4* src_min = reinterpret_cast<const uint4*>(static_cast<const T*>(pool.min) + at);
  const uint4* src_max = reinterpret_cast<const uint4*>(static_cast<const T*>(pool.max) + at);
#pragma unroll 8
  for (int e = threadIdx.x; e < tile * kChunks; e += blockDim.x) {
    const int row = e / kChunks, chunk = e % kChunks;
    *reinterpret_cast<uint4*>(tile_min + row * score_row_elems<D>() + chunk * 8) = src_min[e];
    *reinterpret_cast<uint4*>(tile_max + row * score_row_elems<D>() + chunk * 8) = src_max[e];
  }
#pragma unroll 8
  for (int e = threadIdx.x; e < queries * D; e += blockDim.x) {
    const int qi = e / D, c = e % D;
    const int g = qi % group, slot = qi / group;
    const float x = to_float(q.row(b, h_kv * group + g, active[b * block + slot])[c]);
    query_smem[(qi * 2) * D + c] = fmaxf(x, 0.0f);
    query_smem[(qi * 2 + 1) * D + c] = fminf(x, 0.0f);
  }
  __syncthreads();
  const int p = threadIdx.x;
  if (p >= tile) return;
  const T* my_min = tile_min + p * score_row_elems<D>();
  const T* my_max = tile_max + p * score_row_elems<D>();
  for (int q0 = 0; q0 < queries; q0 += kScoreQueries) {
    float acc[kScoreQueries] = {};
#pragma unroll 2
    for (int c0 = 0; c0 < D; c0 += 8) {
      const uint4 raw_min = *reinterpret_cast<const uint4*>(my_min + c0);
      const uint4 raw_max = *reinterpret_cast<const uint4*>(my_max + c0);
      const T* mn_t = reinterpret_cast<const T*>(&raw_min);
      const T* mx_t = reinterpret_cast<const T*>(&raw_max);
      float mn[8], mx[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        mn[j] = to_float(mn_t[j]);
        mx[j] = to_float(mx_t[j]);
      }
#pragma unroll
      for (int qq = 0; qq < kScoreQueries; ++qq) {
        // A past-the-end query reads query 0's row (in bounds) and is not written: a predicate,
        // not a break, so that acc stays in registers.
        const int qi = q0 + qq < queries ? q0 + qq : 0;
        const float4* pos = reinterpret_cast<const float4*>(query_smem + (qi * 2) * D + c0);
        const float4* neg = reinterpret_cast<const float4*>(query_smem + (qi * 2 + 1) * D + c0);
        const float4 p0 = pos[0], p1 = pos[1], n0 = neg[0], n1 = neg[1];
        const float qp[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
        const float qn[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[qq] = fmaf(qp[j], mx[j], fmaf(qn[j], mn[j], acc[qq]));
      }
    }
#pragma unroll
    for (int qq = 0; qq < kScoreQueries; ++qq) {
      const int qi = q0 + qq;
      if (qi >= queries) continue;
      const int g = qi % group, slot = qi / group;
      scores[((static_cast<int64_t>(b) * heads_q + h_kv * group + g) * block + slot) * score_pages + page0 + p] =
          acc[qq];
    }
  }
}

// Up to kRoundsMaxKeep pages: `keep` rounds of a warp-wide minimum over the row's 64-bit keys
// (order | page, so every key is distinct), each round's winner marked taken; then the chosen
// pages in ascending order by their ranks. keep x pages / 32 shared-memory reads a lane, no
// atomics: at keep 16 of 4096 pages it beats the radix select (whose match_any histogram passes
// took 120 us for the 128 rows of a 64K step).
constexpr int kRoundsMaxKeep = 32;
__device__ inline void warp_rounds_select(uint64_t* keys, int n, int keep, int32_t* out) {
  const int lane = threadIdx.x % 32;
  int32_t chosen = 0x7fffffff;
  for (int r = 0; r < keep; ++r) {
    uint64_t best = ~0ull;
    for (int j = lane; j < n; j += 32) best = min(best, keys[j]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, offset));
    const int page = static_cast<int>(static_cast<uint32_t>(best));
    __syncwarp();
    if (lane == 0) keys[page] = ~0ull;  // taken
    if (lane == r) chosen = page;
    __syncwarp();
  }
  int rank = 0;
  for (int t = 0; t < keep; ++t) rank += __shfl_sync(0xffffffffu, chosen, t) < chosen;
  if (lane < keep) out[rank] = chosen;
}

// One warp per (batch, head, slot) row, grid-stride: the top `capacity` pages of the row's
// scores, forced pages first (their keys the best there are), NaN scores last, ties to the lower
// page; all pages when the budget covers the prefix; ascending. Dynamic shared memory: per warp,
// 256 bins and 2 * max_pages words (32-bit keys for the radix select, 64-bit for the rounds).
__global__ void quest_select_kernel(PoolView pool, const int32_t* counts, const float* scores, int batch,
                                    int heads_q, int block, int64_t score_pages, int capacity, bool force_first, bool force_last,
                                    int max_pages, int32_t* plan_pages, int32_t* plan_counts) {
  extern __shared__ __align__(16) uint32_t select_smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  uint32_t* hist = select_smem + static_cast<size_t>(warp) * (ba_att::kRadixBins + 2 * ((max_pages + 3) / 4 * 4));
  uint32_t* keys = hist + ba_att::kRadixBins;
  const int64_t rows = static_cast<int64_t>(batch) * heads_q * block;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    const int b = static_cast<int>(row / (heads_q * block)), slot = static_cast<int>(row % block);
    int32_t* out = plan_pages + row * capacity;
    if (slot >= counts[b]) {
      if (lane == 0) plan_counts[row] = 0;
      continue;
    }
    const int n = static_cast<int>(pool.pages(b)), keep = min(capacity, n);
    if (keep == n) {
      for (int j = lane; j < n; j += 32) out[j] = j;
    } else {
      const float* row_scores = scores + row * score_pages;
      const bool rounds = keep <= kRoundsMaxKeep;
      uint64_t* keys64 = reinterpret_cast<uint64_t*>(keys);  // 16-byte aligned: after the 1 KiB of bins
#pragma unroll 8
      for (int j = lane; j < n; j += 32) {
        const bool forced = (force_first && j == 0) || (force_last && j == n - 1);
        const float s = row_scores[j];
        const uint32_t high = forced ? 0u : isnan(s) ? 0xffffffffu : static_cast<uint32_t>(ba_att::order_key(s, j) >> 32);
        if (rounds) {
          keys64[j] = static_cast<uint64_t>(high) << 32 | static_cast<uint32_t>(j);
        } else {
          keys[j] = high;
        }
      }
      __syncwarp();
      if (rounds) {
        warp_rounds_select(keys64, n, keep, out);
      } else {
        ba_att::warp_top_select(keys, hist, n, keep, out);
      }
    }
    if (lane == 0) plan_counts[row] = keep;
    __syncwarp();  // keys and bins are reused by the warp's next row
  }
}

// ---- attention rows ----------------------------------------------------------------------------

// The online-softmax state of one warp's row in base 2: lane elements of the accumulator.
template <int E>
struct RowState {
  float m = -INFINITY, l = 0.0f;
  float acc[E] = {};

  // Keys / values rows [0, n) (n <= kTile) at k + t * k_stride, v + t * v_stride: every load of the
  // tile issued first (one memory round trip for the tile, not one per key), the logits' warp
  // sums, one rescale of the state for the tile.
  static constexpr int kTile = 16;
  template <class T>
  __device__ __forceinline__ void add_tile(const float (&q)[E], const T* k, int64_t k_stride, const T* v,
                                           int64_t v_stride, int n, int lane) {
    T kr[kTile][E], vr[kTile][E];
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t < n) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          kr[t][e] = k[t * k_stride + lane * E + e];
          vr[t][e] = v[t * v_stride + lane * E + e];
        }
      }
    }
    float s[kTile];
    float tile_max = -INFINITY;
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      float x = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) x = fmaf(q[e], to_float(t < n ? kr[t][e] : kr[0][e]), x);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
      s[t] = t < n ? x : -INFINITY;
      tile_max = fmaxf(tile_max, s[t]);
    }
    const float m_new = fmaxf(m, tile_max);
    if (m_new == -INFINITY) return;  // nothing finite yet
    const float correction = exp2f(m - m_new);
    l *= correction;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= correction;
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t < n) {
        const float p = exp2f(s[t] - m_new);
        l += p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(p, to_float(vr[t][e]), acc[e]);
      }
    }
    m = m_new;
  }
  // Folds another state (of disjoint keys) into this one.
  __device__ __forceinline__ void merge(float m2, float l2, const float (&acc2)[E]) {
    const float m_new = fmaxf(m, m2);
    if (m_new == -INFINITY) return;
    const float c1 = exp2f(m - m_new), c2 = exp2f(m2 - m_new);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = acc[e] * c1 + acc2[e] * c2;
    m = m_new;
  }
  // LSE in base 2 (-inf without keys).
  __device__ __forceinline__ float lse2() const { return l > 0.0f ? m + log2f(l) : -INFINITY; }
};

template <class T, int E>
__device__ __forceinline__ void load_query(const T* row, float scale_log2, int lane, float (&q)[E]) {
#pragma unroll
  for (int e = 0; e < E; ++e) q[e] = to_float(row[lane * E + e]) * scale_log2;
}

// Grid (heads_kv, block slots, batch); kPageSplit warps per query head of the group (heads
// looped when the group has more than blockDim.x / 32 / kPageSplit): the active row of the slot
// attends over its plan's pages, each warp over every kPageSplit-th page a tile at a time, the
// warps' states merged in shared memory; O_p (T), L_p and Q_ref of the row are written.
constexpr int kPageSplit = 4;
constexpr int kPagedThreads = 256;  // 2 heads x 4 warps per pass (the tiles' registers allow 256 threads)

template <class T, int D>
__global__ void __launch_bounds__(kPagedThreads) paged_attention_kernel(PoolView pool, Rows4<const T> q, const int32_t* active, const int32_t* counts,
                                       const int32_t* plan_pages, const int32_t* plan_counts, int capacity,
                                       int heads_q, int group, int block, float scale_log2, T* o_p, float* l_p,
                                       T* q_ref) {
  constexpr int E = D / 32;
  __shared__ float part_m[kPagedThreads / 32], part_l[kPagedThreads / 32];
  __shared__ float part_acc[kPagedThreads / 32][D];
  const int h_kv = blockIdx.x, slot = blockIdx.y, b = blockIdx.z;
  if (slot >= counts[b]) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int heads_per_pass = warps / kPageSplit, split = warp % kPageSplit;
  const int r = active[b * block + slot];
  const int64_t length = pool.length[b];
  for (int g0 = 0; g0 < group; g0 += heads_per_pass) {
    const int g = g0 + warp / kPageSplit;
    RowState<E> st;
    float qs[E] = {};
    int h = 0;
    int64_t row = 0;
    if (g < group) {
      h = h_kv * group + g;
      row = (static_cast<int64_t>(b) * heads_q + h) * block;
      load_query<T, E>(q.row(b, h, r), scale_log2, lane, qs);
      const int32_t* pages = plan_pages + (row + slot) * capacity;
      const int n = plan_counts[row + slot];
      // The warp's page ids in registers (lane j holds its j-th and (j + 32)-th), one load.
      int32_t mine[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = split + (lane + 32 * u) * kPageSplit;
        mine[u] = i < n ? pages[i] : 0;
      }
      for (int i = split, c = 0; i < n; i += kPageSplit, ++c) {
        // (c is the same in every lane: the shuffles are uniform.)
        const int32_t page = c < 32   ? __shfl_sync(0xffffffffu, mine[0], c)
                             : c < 64 ? __shfl_sync(0xffffffffu, mine[1], c - 32)
                                      : pages[i];
        const int64_t begin = static_cast<int64_t>(page) * pool.page_size;
        const int tokens = static_cast<int>(min(static_cast<int64_t>(pool.page_size), length - begin));
        const int64_t at = (h_kv * pool.pool_tokens + pool.first_page[b] * pool.page_size + begin) * D;
        const T* k = static_cast<const T*>(pool.k) + at;
        const T* v = static_cast<const T*>(pool.v) + at;
        for (int t0 = 0; t0 < tokens; t0 += RowState<E>::kTile) {
          st.add_tile(qs, k + t0 * D, D, v + t0 * D, D, min(RowState<E>::kTile, tokens - t0), lane);
        }
      }
    }
    if (lane == 0) {
      part_m[warp] = st.m;
      part_l[warp] = st.l;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) part_acc[warp][lane * E + e] = st.acc[e];
    __syncthreads();
    if (split == 0 && g < group) {
      for (int w = warp + 1; w < warp + kPageSplit; ++w) {
        float other[E];
#pragma unroll
        for (int e = 0; e < E; ++e) other[e] = part_acc[w][lane * E + e];
        st.merge(part_m[w], part_l[w], other);
      }
      const float inv = st.l > 0.0f ? 1.0f / st.l : 0.0f;
      const T* q_row = q.row(b, h, r);
      T* o = o_p + (row + r) * D;
      T* qr = q_ref + (row + r) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        o[lane * E + e] = from_float<T>(st.acc[e] * inv);
        qr[lane * E + e] = q_row[lane * E + e];
      }
      if (lane == 0) l_p[row + r] = st.lse2() * kLn2;
    }
    __syncthreads();  // the partial states are reused by the next pass
  }
}

// Grid (heads_q, batch), warps over the block's rows: each row attends over the block's own keys
// (k_block, v_block), merged with its prefix (o_p, l_p; nothing when the entry's prefix is empty)
// by LSE into out and lse; with qref_all, q_ref = q.
template <class T, int D>
__global__ void __launch_bounds__(256) block_merge_kernel(PoolView pool, Rows4<const T> q, Rows4<const T> k_block, Rows4<const T> v_block,
                                   Rows4<T> out, Rows4<float> lse, const T* o_p, const float* l_p, T* q_ref,
                                   int heads_q, int group, int block, float scale_log2, bool qref_all) {
  constexpr int E = D / 32;
  const int h = blockIdx.x, b = blockIdx.y, h_kv = h / group;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const bool has_prefix = pool.length[b] > 0;
  for (int r = warp; r < block; r += warps) {
    const T* q_row = q.row(b, h, r);
    float qs[E];
    load_query<T, E>(q_row, scale_log2, lane, qs);
    RowState<E> st;
    for (int t0 = 0; t0 < block; t0 += RowState<E>::kTile) {
      st.add_tile(qs, k_block.row(b, h_kv, t0), k_block.ss, v_block.row(b, h_kv, t0), v_block.ss,
                  min(RowState<E>::kTile, block - t0), lane);
    }
    const int64_t at = (static_cast<int64_t>(b) * heads_q + h) * block + r;
    float lb = st.lse2(), wb = 1.0f, wp = 0.0f, lp = -INFINITY;
    if (has_prefix) lp = l_p[at] * kLog2e;
    float m = fmaxf(lb, lp), total = lb;
    if (m > -INFINITY) {
      wb = exp2f(lb - m);
      wp = exp2f(lp - m);
      total = m + log2f(wb + wp);
    }
    const float ib = st.l > 0.0f ? wb / (st.l * (wb + wp)) : 0.0f, ip = wp / (wb + wp);
    T* o = out.row(b, h, r);
    const T* op = o_p + at * D;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float prefix = wp > 0.0f ? to_float(op[lane * E + e]) * ip : 0.0f;
      o[lane * E + e] = from_float<T>(st.acc[e] * ib + prefix);
      if (qref_all) q_ref[at * D + lane * E + e] = q_row[lane * E + e];
    }
    if (lane == 0) *lse.row(b, h, r) = total * kLn2;
  }
}

}  // namespace sparsa::cuda::losa
