// Internal: the kernels of block-diffusion decoding on the device (losa.cu launches them): the
// paged cache's append and page min/max, LoSA's query change per row, QUEST's page scores with
// each tile's best pages, and one kernel that picks a row's pages, attends over them and merges
// with intra-block attention by LSE. A sparse step is three launches (row mse, candidates, rows);
// with attend_union four (the rows kernel writes the plans, union_rows_kernel attends over each
// kv head's union). The reuse method's later steps: row mse, choose_rows_kernel, the split-KV
// executor for every row into scratch, adopt_rows_kernel, block_merge_kernel.
//
// Attention rows are one warp each: lane l holds elements [l * E, (l + 1) * E) of the query, the
// output accumulator and every key / value row it reads (E = D / 32), a row's logit is a warp
// sum. Logits are kept in base 2 (q pre-scaled by scale * log2 e; LSE converted back at the end).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma.cuh"
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

// Programmatic dependent launch (sm_90): a kernel launched as a dependent of the stream's
// previous kernel may start once every CTA of that one has called launch_dependents (each of ours
// does so first), and waits (wait_for_previous) before it reads what that kernel writes; a kernel
// launched plainly passes through the wait. losa.cu says which launches are dependent.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_for_previous() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

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

// Grid (block rows, batch), kMseWarps warps over the query heads: mse of row i of entry b = mean
// over heads and dims of (q_i - q_ref_i)^2, summed in f64 in a fixed order (lanes, then warps).
constexpr int kMseWarps = 8;  // 8 warps: a step's 32 heads are one load round per warp
template <class T, int D>
__global__ void __launch_bounds__(kMseWarps * 32) row_mse_kernel(Rows4<const T> q, const T* q_ref, int heads_q,
                                                                   int block, double* mse) {
  constexpr int E = D / 32;
  __shared__ double part[kMseWarps];
  launch_dependents();  // the candidates kernel may start its tile copies
  const int i = blockIdx.x, b = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double sum = 0.0;
#pragma unroll 4
  for (int h = warp; h < heads_q; h += kMseWarps) {
    const T* a = q.row(b, h, i) + lane * E;
    const T* r = q_ref + ((static_cast<int64_t>(b) * heads_q + h) * block + i) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const double diff = static_cast<double>(to_float(a[e])) - to_float(r[e]);
      sum += diff * diff;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) part[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kMseWarps; ++w) total += part[w];
    mse[static_cast<int64_t>(b) * block + i] = total / (static_cast<double>(heads_q) * D);
  }
}

// Which rows of a step are active: all of them, those whose mse is above the threshold (or NaN),
// or the top active_k (NaN first, larger first, ties to the lower row) — sparsa::active_rows'
// order.
struct ActiveRule {
  const double* mse;  // [batch, block]; unread when all_rows
  bool all_rows;
  int active_k;
  bool use_threshold;
  double threshold;
};

// One warp: the active rows of an entry ascending into rows[0, count), count into rows[64]
// (block <= 64), from its rows' mse (load_mse). Top active_k by rank: lane l ranks rows l and l + 32 against every row (NaN
// first, larger first, ties to the lower row; a total order, so the top k are the rows of rank
// below k, the serial selection's rows).
// The lane's two rows' mse (rows lane and lane + 32 of entry b; zero past the block or when
// every row is taken), loaded apart from choose_active so that a kernel can issue them first.
__device__ inline void load_mse(const ActiveRule& rule, int b, int block, double (&mine)[2]) {
  const int lane = threadIdx.x % 32;
  const double* mse = rule.mse + static_cast<int64_t>(b) * block;
#pragma unroll
  for (int i = 0; i < 2; ++i) mine[i] = !rule.all_rows && lane + 32 * i < block ? mse[lane + 32 * i] : 0.0;
}
__device__ inline void choose_active(const ActiveRule& rule, int block, const double (&mine)[2], int32_t* rows) {
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1u;
  bool take[2];
  if (rule.all_rows) {
    take[0] = lane < block;
    take[1] = lane + 32 < block;
  } else {
    if (rule.use_threshold) {
#pragma unroll
      for (int i = 0; i < 2; ++i) take[i] = lane + 32 * i < block && (mine[i] > rule.threshold || isnan(mine[i]));
    } else {
      int rank[2] = {0, 0};
      for (int j = 0; j < block; ++j) {
        const double other = __shfl_sync(0xffffffffu, j < 32 ? mine[0] : mine[1], j % 32);
        const bool nj = isnan(other);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int row = lane + 32 * i;
          const bool ni = isnan(mine[i]);
          const bool before = nj != ni ? nj : (nj ? j < row : (other > mine[i] || (other == mine[i] && j < row)));
          rank[i] += before;
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) take[i] = lane + 32 * i < block && rank[i] < rule.active_k;
    }
  }
  const unsigned low = __ballot_sync(0xffffffffu, take[0]), high = __ballot_sync(0xffffffffu, take[1]);
  if (take[0]) rows[__popc(low & lanes_below)] = lane;
  if (take[1]) rows[__popc(low) + __popc(high & lanes_below)] = lane + 32;
  if (lane == 0) rows[64] = __popc(low) + __popc(high);
}

// Grid (batch): every row active (a block's first step, and dense steps).
__global__ void all_rows_kernel(int block, int32_t* active, int32_t* counts) {
  for (int i = threadIdx.x; i < block; i += blockDim.x) active[static_cast<int64_t>(blockIdx.x) * block + i] = i;
  if (threadIdx.x == 0) counts[blockIdx.x] = block;
}

// Grid (batch), one warp: the entry's active rows from its rows' mse (the reuse method's later
// steps, whose active rows attend densely: no candidates kernel chooses them).
__global__ void __launch_bounds__(32) choose_rows_kernel(ActiveRule rule, int block, int32_t* active, int32_t* counts) {
  __shared__ int32_t rows[65];
  const int b = blockIdx.x;
  double mse[2];
  load_mse(rule, b, block, mse);
  choose_active(rule, block, mse, rows);
  __syncwarp();
  const int count = rows[64];
  for (int i = threadIdx.x; i < count; i += 32) active[static_cast<int64_t>(b) * block + i] = rows[i];
  if (threadIdx.x == 0) counts[b] = count;
}

// ---- QUEST: page scores and each tile's candidates ---------------------------------------------

// score(q, page) = sum_d max(q_d max_d, q_d min_d) = q+ . max + q- . min (q+ = max(q, 0), q- =
// min(q, 0)). A page's order key: the high word ranks it (0 for a forced page, the best there
// is; the score's order by ba_att::order_key; all ones for NaN, the worst), the low word is the
// page, so every key is distinct and the smallest `keep` keys are the row's selection.
//
// Grid (page tiles of kScorePages, heads_kv x query chunks, batch), kScoreWarps warps. Every CTA
// first chooses the entry's active rows from the rows' mse (the CTA at tile 0, kv head 0, chunk 0
// writes them out). The queries of a kv head are its group's heads at the entry's active rows,
// slot-major (query qi = slot * group + g); a CTA scores kChunkQueries (one m16 tile) of them.
// The scores are one tensor-core product, [q+ | q-] (16 x 2D) times [max | min]^T (2D x pages):
// q+ and q- of a 16-bit query are exact in its own type, so is every product, and the sums are
// f32 (in the tensor cores' order, not the CPU's: scores a few ulps apart may order differently,
// the "ties aside" of the contract). The tile's min and max rows are copied to shared memory
// (cp.async, each row's 16-byte chunks swizzled, chunk c of page p at c ^ (p % 8): ldmatrix's
// eight row reads hit distinct banks without padding); warp w scores pages [16w, 16w + 16). The
// keys go to shared memory (over the tile, which the product no longer needs: with the keys
// apart the kernel would not fit three CTAs an SM) and a warp per query keeps the
// tile's `keep_tile` smallest, written ascending by page (padded with all-ones keys) to
// candidates [batch, heads_q, block slots, tiles, keep_tile]: the row's selection is the `keep`
// smallest of its candidates. Nothing is scored when the budget covers the entry's prefix (every
// page is taken).
constexpr int kScorePages = 128;
constexpr int kScoreWarps = kScorePages / 16;  // 16 pages (two n8 tiles) a warp
constexpr int kScoreThreads = kScoreWarps * 32;
constexpr int kChunkQueries = 16;              // one m16 tile of queries a CTA

template <int D>
__host__ __device__ constexpr int query_row_elems() { return 2 * D + 8; }  // q+ | q- | pad
template <class T, int D>
__host__ __device__ constexpr size_t score_tile_bytes() {
  return static_cast<size_t>(2) * kScorePages * D * sizeof(T);
}
template <class T, int D>
__host__ __device__ constexpr size_t score_query_bytes() {
  return static_cast<size_t>(kChunkQueries) * query_row_elems<D>() * sizeof(T);
}
constexpr size_t kScoreKeyBytes = static_cast<size_t>(kChunkQueries) * kScorePages * sizeof(uint64_t);
constexpr size_t kScoreRowBytes = 80 * sizeof(int32_t);  // the active rows (up to 64) and their count, padded
// The candidates kernel's dynamic shared memory: the tile (later the keys), the queries, the rows.
template <class T, int D>
__host__ __device__ constexpr size_t candidates_smem_bytes() {
  static_assert(kScoreKeyBytes <= score_tile_bytes<T, D>(), "the keys fit in the tile's place");
  return score_tile_bytes<T, D>() + score_query_bytes<T, D>() + kScoreRowBytes;
}
// The candidates kernel's CTAs an SM (three at D 128 in 16 bits: 72.6 KB each).
constexpr int kScoreCtasPerSm = 3;
// Element offset of 16-byte chunk c of page row p in a swizzled tile of D-element rows.
template <int D>
__device__ __forceinline__ int tile_at(int p, int c) {
  return p * D + ((c ^ (p % 8)) * 8);
}
// Every byte of shared memory these kernels use is dynamic (a static array on top of a dynamic
// size at the 48 KiB default limit is a launch error).

__device__ __forceinline__ uint64_t page_key(float score, int32_t page, bool forced) {
  const uint32_t high = forced ? 0u : isnan(score) ? 0xffffffffu : static_cast<uint32_t>(ba_att::order_key(score, page) >> 32);
  return static_cast<uint64_t>(high) << 32 | static_cast<uint32_t>(page);
}

// One warp, Q rows of keys at once: the `keep` smallest of keys[q][0, n) (n <= kScorePages),
// written ascending by position to out[q], then all-ones keys up to out[q][keep). Every key when
// keep >= n. Each lane sorts its kScorePages / 32 keys of a row (positions lane + 32 i), each
// with its slot i; a round's minimum is two warp reductions (the high words, then the low words
// of the lanes at that high word) and the lane holding it marks that slot taken and steps to its
// next key; the Q rows' rounds interleave (independent chains of reductions). A taken key's place
// in out is the count of taken keys at lower positions (a ballot per slot). Every caller's keys
// ascend by low word with position (pages, or indices into the candidates), so out ascends by
// low word too. Keys must be distinct but for all-ones padding past the real keys, which a round
// never reaches when keep < n real keys are there.
template <int Q>
__device__ inline void tile_top(const uint64_t* const (&keys)[Q], int n, int keep, uint64_t* const (&out)[Q]) {
  constexpr int kPer = kScorePages / 32;
  static_assert(kPer == 4, "a lane sorts four keys");
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1u;
  uint64_t mine[Q][kPer];
#pragma unroll
  for (int q = 0; q < Q; ++q)
#pragma unroll
    for (int i = 0; i < kPer; ++i) mine[q][i] = lane + 32 * i < n ? keys[q][lane + 32 * i] : ~0ull;
  if (keep >= n) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      int written = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const bool kept = lane + 32 * i < n;
        const unsigned ballot = __ballot_sync(0xffffffffu, kept);
        if (kept) out[q][written + __popc(ballot & lanes_below)] = mine[q][i];
        written += __popc(ballot);
      }
      for (int j = written + lane; j < keep; j += 32) out[q][j] = ~0ull;
    }
    return;
  }
  // The lane's keys sorted, their slots packed two bits each in the same order.
  uint32_t slots[Q], taken[Q];
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    uint32_t at[kPer] = {0, 1, 2, 3};
    auto order = [&](int a, int b) {
      const bool swap = mine[q][b] < mine[q][a];
      const uint64_t lo = swap ? mine[q][b] : mine[q][a], hi = swap ? mine[q][a] : mine[q][b];
      const uint32_t slo = swap ? at[b] : at[a], shi = swap ? at[a] : at[b];
      mine[q][a] = lo;
      mine[q][b] = hi;
      at[a] = slo;
      at[b] = shi;
    };
    order(0, 1);
    order(2, 3);
    order(0, 2);
    order(1, 3);
    order(1, 2);
    slots[q] = at[0] | at[1] << 2 | at[2] << 4 | at[3] << 6;
    taken[q] = 0;
  }
  for (int r = 0; r < keep; ++r) {
    uint32_t head_hi[Q], hi[Q], lo[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      head_hi[q] = static_cast<uint32_t>(mine[q][0] >> 32);
      hi[q] = __reduce_min_sync(0xffffffffu, head_hi[q]);
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      lo[q] = __reduce_min_sync(0xffffffffu, head_hi[q] == hi[q] ? static_cast<uint32_t>(mine[q][0]) : 0xffffffffu);
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (mine[q][0] == (static_cast<uint64_t>(hi[q]) << 32 | lo[q])) {
        taken[q] |= 1u << (slots[q] & 3u);
        slots[q] >>= 2;
        mine[q][0] = mine[q][1];
        mine[q][1] = mine[q][2];
        mine[q][2] = mine[q][3];
        mine[q][3] = ~0ull;
      }
    }
  }
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    int before = 0;  // taken keys at lower slots' positions
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const bool mine_taken = taken[q] >> i & 1u;
      const unsigned ballot = __ballot_sync(0xffffffffu, mine_taken);
      if (mine_taken) out[q][before + __popc(ballot & lanes_below)] = keys[q][lane + 32 * i];
      before += __popc(ballot);
    }
  }
}

// One row of keys.
__device__ inline void tile_top(const uint64_t* keys, int n, int keep, uint64_t* out) {
  const uint64_t* const in[1] = {keys};
  uint64_t* const to[1] = {out};
  tile_top<1>(in, n, keep, to);
}

template <class T, int D>
__global__ void __launch_bounds__(kScoreThreads, kScoreCtasPerSm) quest_candidates_kernel(
    PoolView pool, Rows4<const T> q, bool q_vec, ActiveRule rule, int32_t* active, int32_t* counts, int heads_q,
    int group, int block, int chunks, int capacity, int keep_tile, int64_t tiles, bool force_first, bool force_last,
    uint64_t* candidates) {
  using cuda::detail::ldmatrix_x4;
  using cuda::detail::mma_16816;
  using cuda::detail::smem_addr;
  extern __shared__ __align__(16) unsigned char score_smem[];
  constexpr int kQRow = query_row_elems<D>();
  T* tile_min = reinterpret_cast<T*>(score_smem);  // [kScorePages][D], swizzled (tile_at)
  T* tile_max = tile_min + kScorePages * D;
  uint64_t* keys = reinterpret_cast<uint64_t*>(score_smem);  // [16][kScorePages], once the product is done
  T* query_smem = reinterpret_cast<T*>(score_smem + score_tile_bytes<T, D>());  // [16][2D + 8]
  int32_t* rows = reinterpret_cast<int32_t*>(score_smem + score_tile_bytes<T, D>() + score_query_bytes<T, D>());  // [64], count
  const int b = blockIdx.z, h_kv = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t pages = pool.pages(b), page0 = static_cast<int64_t>(blockIdx.x) * kScorePages;
  const bool scoring = page0 < pages && capacity < pages;  // (uniform in the CTA)
  const int tile = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(kScorePages), pages - page0)));
  constexpr int kChunks = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks of a row
  launch_dependents();  // the rows kernel may start (it waits for this one before reading)
  double mse[2];  // warp 0's loads first: behind the tile's copies they would wait for the whole tile
  if (warp == 0) {
    wait_for_previous();  // the row-change kernel's mse (q and the pool were written before it)
    load_mse(rule, b, block, mse);
  }
  if (scoring) {  // the tile's copy starts before the rows are chosen
    const int64_t at = (h_kv * pool.pool_pages + pool.first_page[b] + page0) * D;
    const T* src_min = static_cast<const T*>(pool.min) + at;
    const T* src_max = static_cast<const T*>(pool.max) + at;
    for (int e = threadIdx.x; e < tile * kChunks; e += blockDim.x) {
      const int row = e / kChunks, c = e % kChunks;
      cuda::detail::cp_async_16(smem_addr(tile_min + tile_at<D>(row, c)), src_min + e * 8, 16);
      cuda::detail::cp_async_16(smem_addr(tile_max + tile_at<D>(row, c)), src_max + e * 8, 16);
    }
    cuda::detail::cp_async_commit();
  }
  if (warp == 0) choose_active(rule, block, mse, rows);
  __syncthreads();
  const int row_count = rows[64];
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    for (int i = threadIdx.x; i < row_count; i += blockDim.x) active[static_cast<int64_t>(b) * block + i] = rows[i];
    if (threadIdx.x == 0) counts[b] = row_count;
  }
  const int q_begin = chunk * kChunkQueries, queries = min(kChunkQueries, group * row_count - q_begin);
  if (!scoring || queries <= 0) {
    cuda::detail::cp_async_wait<0>();  // nothing left in flight at exit
    return;
  }
  // q+ and q- of the chunk's queries (rows past them zero).
  // Every load first, into registers (the stores to shared memory could alias q for the
  // compiler, which would otherwise keep each load behind the previous store).
  if (q_vec) {  // 16-byte rows of q: one vector of 8 elements a thread (its loads queue behind the tile's)
    constexpr int kVecs = kChunkQueries * D / 8;
    static_assert(kVecs <= kScoreThreads, "one vector a thread at most");
    if (threadIdx.x < kVecs) {
      const int lq = threadIdx.x / (D / 8), c = threadIdx.x % (D / 8) * 8, qi = q_begin + lq;
      union {
        uint4 u;
        T e[8];
      } in, pos, neg;
      in.u = lq < queries ? *reinterpret_cast<const uint4*>(q.row(b, h_kv * group + qi % group, rows[qi / group]) + c)
                          : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        pos.e[e] = from_float<T>(fmaxf(to_float(in.e[e]), 0.0f));
        neg.e[e] = from_float<T>(fminf(to_float(in.e[e]), 0.0f));
      }
      *reinterpret_cast<uint4*>(query_smem + lq * kQRow + c) = pos.u;
      *reinterpret_cast<uint4*>(query_smem + lq * kQRow + D + c) = neg.u;
    }
  } else {
    static_assert(kChunkQueries * D % kScoreThreads == 0, "whole rounds of query elements");
    constexpr int kPerThread = kChunkQueries * D / kScoreThreads;
    float x[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int e = threadIdx.x + i * kScoreThreads, lq = e / D, c = e % D, qi = q_begin + lq;
      x[i] = lq < queries ? to_float(q.row(b, h_kv * group + qi % group, rows[qi / group])[c]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int e = threadIdx.x + i * kScoreThreads, lq = e / D, c = e % D;
      query_smem[lq * kQRow + c] = from_float<T>(fmaxf(x[i], 0.0f));
      query_smem[lq * kQRow + D + c] = from_float<T>(fminf(x[i], 0.0f));
    }
  }
  cuda::detail::cp_async_wait<0>();
  __syncthreads();
  // Warp w: pages [16w, 16w + 16) as two n8 tiles, k over [q+ | q-] against [max | min].
  float acc[2][4] = {};
  const int m = lane / 8, r8 = lane % 8;  // ldmatrix: lane l gives row l % 8 of matrix l / 8
  const T* a_row = query_smem + ((m % 2) * 8 + r8) * kQRow + (m / 2) * 8;
  const int b_page = warp * 16 + (m / 2) * 8 + r8, b_chunk = m % 2;
#pragma unroll
  for (int kk = 0; kk < 2 * D / 16; ++kk) {
    uint32_t a[4], bf[4];
    ldmatrix_x4(a, smem_addr(a_row + kk * 16));
    const T* meta = kk < D / 16 ? tile_max : tile_min;
    ldmatrix_x4(bf, smem_addr(meta + tile_at<D>(b_page, (kk % (D / 16)) * 2 + b_chunk)));
    mma_16816<T>(acc[0], a, bf[0], bf[1]);
    mma_16816<T>(acc[1], a, bf[2], bf[3]);
  }
  __syncthreads();  // every warp is done with the tile: the keys take its place
  // Lane (g, c) holds queries g and g + 8 at pages 16w + 8t + 2c + {0, 1}.
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int lq = g + (j / 2) * 8, p = warp * 16 + t * 8 + 2 * c + j % 2;
      const int32_t page = static_cast<int32_t>(page0 + p);
      const bool forced = (force_first && page == 0) || (force_last && page == pages - 1);
      keys[lq * kScorePages + p] = p < tile ? page_key(acc[t][j], page, forced) : ~0ull;
    }
  }
  __syncthreads();
  // Warp w: queries w and w + kScoreWarps, their selection rounds interleaved.
  static_assert(kChunkQueries == 2 * kScoreWarps, "two queries a warp");
  auto candidates_of = [&](int lq) {
    const int qi = q_begin + lq, gq = qi % group, slot = qi / group;
    const int64_t row = (static_cast<int64_t>(b) * heads_q + h_kv * group + gq) * block + slot;
    return candidates + (row * tiles + blockIdx.x) * keep_tile;
  };
  if (warp + kScoreWarps < queries) {
    const uint64_t* const in[2] = {keys + warp * kScorePages, keys + (warp + kScoreWarps) * kScorePages};
    uint64_t* const to[2] = {candidates_of(warp), candidates_of(warp + kScoreWarps)};
    tile_top<2>(in, tile, keep_tile, to);
  } else if (warp < queries) {
    tile_top(keys + warp * kScorePages, tile, keep_tile, candidates_of(warp));
  }
}

// Up to kRoundsMaxKeep pages, a CTA's selection of a row's `keep` smallest candidates (the keys
// re-indexed by position, so every key is distinct and ties go to the lower position = the lower
// page): the keys in slices of kScorePages, each slice's `keep` smallest kept by one warp's
// tile_top (keys in registers, `keep` rounds of a warp minimum), level after level (each level
// counting only the real keys the last one kept) until one slice is left, whose `keep` smallest
// warp 0 writes ascending by position (slices keep their keys in position order, so the order
// survives every level). keys: [n] then scratch of rows_select_bytes; returns (to warp 0) where
// the chosen keys are.
constexpr int kRoundsMaxKeep = 32;
__device__ inline const uint64_t* cta_rounds_select(uint64_t* keys, uint64_t* scratch, int n, int keep, int warps) {
  const int warp = threadIdx.x / 32;
  uint64_t *src = keys, *dst = scratch;
  while (n > kScorePages) {
    const int slices = (n + kScorePages - 1) / kScorePages;
    for (int s = warp; s < slices; s += warps) tile_top(src + s * kScorePages, min(kScorePages, n - s * kScorePages), keep, dst + s * keep);
    __syncthreads();
    // Every slice but the last holds kScorePages > keep keys and gives keep; the last gives
    // min(keep, its keys) and pads the rest of its keep slots with all-ones keys, which the next
    // level must not count: tile_top takes distinct keys only.
    n = (slices - 1) * keep + min(keep, n - (slices - 1) * kScorePages);
    uint64_t* t = src;
    src = dst;
    dst = t;
  }
  if (warp == 0) tile_top(src, n, keep, dst);
  return dst;
}

// Dynamic shared memory of sparse_rows_kernel's selection for nc candidates: the keys and the
// first level's survivors (the rounds), or the radix bins and 32-bit keys.
__host__ __device__ constexpr size_t rows_select_bytes(int64_t nc, int keep) {
  return keep <= kRoundsMaxKeep ? static_cast<size_t>(nc + (nc + kScorePages - 1) / kScorePages * keep) * 8
                                : ba_att::kRadixBins * 4 + static_cast<size_t>(nc) * 4;
}

// ---- attention rows ----------------------------------------------------------------------------

// The online-softmax state of one warp's row in base 2: lane elements of the accumulator; keys
// and values a Tile of 8 rows at a time (two tiles in flight keep the sparse rows kernel at two
// CTAs an SM; add sums the tile's logits together).
template <int E, int Tile = 8>
struct RowState {
  float m = -INFINITY, l = 0.0f;
  float acc[E] = {};

  static constexpr int kTile = Tile;
  // A lane's E elements of a key or value row (16-bit), two to a 32-bit word. With Aligned (every
  // row's slice at lane * E starts on E * 2 bytes, as the pool's pages do) one vector load;
  // a caller's block rows may have any strides.
  static_assert(E % 2 == 0 && E <= 8, "E: an even count of at most 8 elements");
  template <class T>
  struct Slice {
    static_assert(sizeof(T) == 2, "T: a 16-bit type");
    uint32_t w[E / 2];
  };
  template <class T>
  __device__ __forceinline__ static uint32_t bits(T x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __bfloat16_as_ushort(x);
    } else {
      return __half_as_ushort(x);
    }
  }
  template <bool Aligned, class T>
  __device__ __forceinline__ static void load_slice(Slice<T>& s, const T* p) {
    if constexpr (Aligned && E == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      s.w[0] = u.x;
      s.w[1] = u.y;
    } else if constexpr (Aligned && E == 2) {
      s.w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
#pragma unroll
      for (int i = 0; i < E / 2; ++i) s.w[i] = bits(p[2 * i]) | bits(p[2 * i + 1]) << 16;
    }
  }
  // Element e as f32 (bf16 by a shift or a mask of its word).
  template <class T>
  __device__ __forceinline__ static float elem(const Slice<T>& s, int e) {
    const uint32_t w = s.w[e / 2];
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(e % 2 ? (w & 0xffff0000u) : (w << 16));
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? w >> 16 : w & 0xffffu)));
    }
  }
  // A tile of keys and values in registers, loaded but not yet added.
  template <class T>
  struct Loaded {
    Slice<T> k[kTile], v[kTile];
    int n = 0;
  };
  // Issues the loads of keys / values rows [0, n) (n <= kTile) at k + t * k_stride, v + t *
  // v_stride (one memory round trip for the tile, not one per key).
  template <bool Aligned = false, class T>
  __device__ __forceinline__ static void load(Loaded<T>& tile, const T* k, int64_t k_stride, const T* v,
                                              int64_t v_stride, int n, int lane) {
    tile.n = n;
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t < n) {
        load_slice<Aligned>(tile.k[t], k + t * k_stride + lane * E);
        load_slice<Aligned>(tile.v[t], v + t * v_stride + lane * E);
      }
    }
  }
  // Adds a loaded tile: the logits' warp sums, one rescale of the state for the tile. A tile of 8
  // keys sums its 8 logits together: three exchange rounds leave lane l with half, a quarter,
  // then an eighth of the keys (key 4 b4 + 2 b3 + b2 from the lane's bits 4, 3, 2), two more
  // finish each key's sum in its group of four lanes (9 shuffles, not 40); each lane takes the
  // exponential of its key and the weights are broadcast key by key.
  template <class T>
  __device__ __forceinline__ void add(const float (&q)[E], const Loaded<T>& tile) {
    static_assert(kTile == 8, "the logits are summed eight keys together");
    const int n = tile.n, lane = threadIdx.x % 32;
    float x[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      x[t] = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) x[t] = fmaf(q[e], t < n ? elem(tile.k[t], e) : 0.0f, x[t]);
    }
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
    float y[4], z[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      y[i] = (b4 ? x[i + 4] : x[i]) + __shfl_xor_sync(0xffffffffu, b4 ? x[i] : x[i + 4], 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      z[i] = (b3 ? y[i + 2] : y[i]) + __shfl_xor_sync(0xffffffffu, b3 ? y[i] : y[i + 2], 8);
    }
    float w = (b2 ? z[1] : z[0]) + __shfl_xor_sync(0xffffffffu, b2 ? z[0] : z[1], 4);
    w += __shfl_xor_sync(0xffffffffu, w, 2);
    w += __shfl_xor_sync(0xffffffffu, w, 1);
    const int key = (b4 ? 4 : 0) + (b3 ? 2 : 0) + (b2 ? 1 : 0);
    const float s_mine = key < n ? w : -INFINITY;
    float tile_max = fmaxf(s_mine, __shfl_xor_sync(0xffffffffu, s_mine, 4));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 8));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 16));
    const float m_new = fmaxf(m, tile_max);
    if (m_new == -INFINITY) return;  // nothing finite yet
    const float correction = exp2f(m - m_new), p_mine = exp2f(s_mine - m_new);
    l *= correction;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= correction;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const float p = __shfl_sync(0xffffffffu, p_mine, (t & 4) * 4 + (t & 2) * 4 + (t & 1) * 4);
      if (t < n) {
        l += p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(p, elem(tile.v[t], e), acc[e]);
      }
    }
    m = m_new;
  }
  template <bool Aligned = false, class T>
  __device__ __forceinline__ void add_tile(const float (&q)[E], const T* k, int64_t k_stride, const T* v,
                                           int64_t v_stride, int n, int lane) {
    Loaded<T> tile;
    load<Aligned>(tile, k, k_stride, v, v_stride, n, lane);
    add(q, tile);
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

// One warp: row r of head h of entry b over the block's own keys (k_block, v_block); qs its
// query pre-scaled (load_query).
template <class T, int D, int Tile>
__device__ __forceinline__ RowState<D / 32, Tile> block_state(const float (&qs)[D / 32], const Rows4<const T>& k_block,
                                                             const Rows4<const T>& v_block, int block, int b,
                                                             int h_kv, int lane) {
  RowState<D / 32, Tile> st;
  for (int t0 = 0; t0 < block; t0 += Tile) {
    st.add_tile(qs, k_block.row(b, h_kv, t0), k_block.ss, v_block.row(b, h_kv, t0), v_block.ss,
                min(Tile, block - t0), lane);
  }
  return st;
}

// One warp: a row's output and LSE, its block state `st` merged by LSE with its prefix (LSE lp in
// base 2, -inf without one; prefix(e) the lane's element e of O_p, read only when it weighs).
template <class T, int E, int Tile, class Prefix>
__device__ __forceinline__ void merge_out(const RowState<E, Tile>& st, float lp, Prefix prefix, T* o, float* lse_out,
                                          int lane) {
  float lb = st.lse2(), wb = 1.0f, wp = 0.0f;
  float m = fmaxf(lb, lp), total = lb;
  if (m > -INFINITY) {
    wb = exp2f(lb - m);
    wp = exp2f(lp - m);
    total = m + log2f(wb + wp);
  }
  const float ib = st.l > 0.0f ? wb / (st.l * (wb + wp)) : 0.0f, ip = wp / (wb + wp);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float pre = wp > 0.0f ? prefix(e) * ip : 0.0f;
    o[lane * E + e] = from_float<T>(st.acc[e] * ib + pre);
  }
  if (lane == 0) *lse_out = total * kLn2;
}

// One warp: row r of head h of entry b attends over the block's own keys, merged with its prefix
// (o_p, l_p; nothing when the entry's prefix is empty) by LSE into out and lse; with qref_all,
// q_ref = q.
template <class T, int D, int Tile>
__device__ __forceinline__ void merge_block_row(const PoolView& pool, const Rows4<const T>& q,
                                                const Rows4<const T>& k_block, const Rows4<const T>& v_block,
                                                const Rows4<T>& out, const Rows4<float>& lse, const T* o_p,
                                                const float* l_p, T* q_ref, int heads_q, int group, int block,
                                                float scale_log2, bool qref_all, int b, int h, int r, int lane) {
  constexpr int E = D / 32;
  const T* q_row = q.row(b, h, r);
  float qs[E];
  load_query<T, E>(q_row, scale_log2, lane, qs);
  const RowState<E, Tile> st = block_state<T, D, Tile>(qs, k_block, v_block, block, b, h / group, lane);
  const int64_t at = (static_cast<int64_t>(b) * heads_q + h) * block + r;
  const float lp = pool.length[b] > 0 ? l_p[at] * kLog2e : -INFINITY;
  const T* op = o_p + at * D + lane * E;
  merge_out<T, E, Tile>(st, lp, [&](int e) { return to_float(op[e]); }, out.row(b, h, r), lse.row(b, h, r), lane);
  if (qref_all) {
#pragma unroll
    for (int e = 0; e < E; ++e) q_ref[at * D + lane * E + e] = q_row[lane * E + e];
  }
}

// Grid (heads_q, batch, row groups of kMergeWarps), a warp per row: merge_block_row (the dense
// steps' last launch, after the split-KV executor wrote o_p and l_p; the reuse method's later
// steps', after adopt_rows_kernel, without qref_all).
constexpr int kMergeWarps = 4;
template <class T, int D>
__global__ void __launch_bounds__(kMergeWarps * 32) block_merge_kernel(PoolView pool, Rows4<const T> q, Rows4<const T> k_block, Rows4<const T> v_block,
                                   Rows4<T> out, Rows4<float> lse, const T* o_p, const float* l_p, T* q_ref,
                                   int heads_q, int group, int block, float scale_log2, bool qref_all) {
  const int r = blockIdx.z * kMergeWarps + threadIdx.x / 32;
  if (r >= block) return;
  merge_block_row<T, D, 8>(pool, q, k_block, v_block, out, lse, o_p, l_p, q_ref, heads_q, group, block, scale_log2,
                           qref_all, blockIdx.y, blockIdx.x, r, threadIdx.x % 32);
}

// The sparse steps' last launch. Grid (heads_q, max_rows + stable CTAs, batch), kRowWarps warps:
// the CTA at y < max_rows (the most rows the rule can make active) takes the entry's active row
// of slot y (none past the entry's count: it zeroes that slot's plan count), the CTAs after
// them kRowWarps stable rows each, a warp a row (the long CTAs start first; no CTA is launched
// for rows the rule can never leave stable). An active row r of head h: its
// `keep` pages picked from its candidates by the CTA (cta_rounds_select up to kRoundsMaxKeep,
// warp 0's radix select above; every page when the budget covers the prefix) into the plan,
// ascending; each warp attends over every kRowWarps-th of the block's keys (before the
// selection) and every kRowWarps-th page a tile at a time, prefix and block states merged apart
// in shared memory; O_p (T), L_p and Q_ref are written, and warp 0 merges the block's state with
// them (merge_out; a stable row's warp: merge_block_row with its kept O_p and
// L_p). The first stable CTA zeroes the plan counts of the slots from max_rows on.
// With ATTEND false (attend_union) the kernel only writes the plans and their counts: its slot
// CTAs stop once the plan is written and its stable CTAs do no more than the zeroing;
// union_rows_kernel then attends.
constexpr int kRowWarps = 8;
// The rows kernel's CTAs for stable rows: enough for every row the rule can leave stable
// (block - min_rows; min_rows: the fewest it makes active).
__host__ __device__ constexpr int rows_stable_ctas(int block, int min_rows) {
  return (block - min_rows + kRowWarps - 1) / kRowWarps;
}
// Dynamic shared memory of sparse_rows_kernel before its selection's: the warps' prefix and block
// states, rounded up to 16 bytes (the plan and the selection after them are read with 16-byte
// loads).
template <int D>
__host__ __device__ constexpr size_t rows_state_bytes() {
  return ((static_cast<size_t>(2 * kRowWarps) * D + 4 * kRowWarps) * sizeof(float) + 15) / 16 * 16;
}
// Then the row's plan, read back by the attending warps from shared memory when it has at most
// kPlanSmemPages pages (from the plan in global memory above; every page when the budget covers
// the prefix needs no plan). plan_slots: the host's bound on a row's pages, min(capacity, the
// batch's longest prefix in pages).
constexpr int kPlanSmemPages = 2048;
__host__ __device__ constexpr int rows_plan_smem_pages(int64_t plan_slots) {
  return static_cast<int>(plan_slots < kPlanSmemPages ? plan_slots : kPlanSmemPages);
}
__host__ __device__ constexpr size_t rows_plan_bytes(int64_t plan_slots) {
  return (static_cast<size_t>(rows_plan_smem_pages(plan_slots)) * 4 + 15) / 16 * 16;
}

// A CTA of stable rows (the rows kernels' CTAs at y >= max_rows): warp w takes the ((y -
// max_rows) * kRowWarps + w)-th row the entry's active rows leave, if there is one, and merges its
// block state with its kept O_p and L_p (merge_block_row).
template <class T, int D>
__device__ __forceinline__ void stable_rows(const PoolView& pool, const Rows4<const T>& q, const Rows4<const T>& k_block,
                                            const Rows4<const T>& v_block, const Rows4<T>& out,
                                            const Rows4<float>& lse, const int32_t* active, int count, const T* o_p,
                                            const float* l_p, T* q_ref, int heads_q, int group, int block,
                                            int max_rows, float scale_log2, int b, int h, int y) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int want = (y - max_rows) * kRowWarps + warp;
  if (want >= block - count) return;
  uint64_t taken = 0;  // (block <= 64)
  for (int s = 0; s < count; ++s) taken |= uint64_t{1} << active[static_cast<int64_t>(b) * block + s];
  int r = 0;
  for (int i = 0, left = want; i < block; ++i) {
    if (taken >> i & 1) continue;
    if (left-- == 0) {
      r = i;
      break;
    }
  }
  merge_block_row<T, D, 8>(pool, q, k_block, v_block, out, lse, o_p, l_p, q_ref, heads_q, group, block, scale_log2,
                           /*qref_all=*/false, b, h, r, lane);
}

// The shared memory of an active row's CTA: the warps' prefix and block states (rows_state_bytes).
template <int D>
struct RowShared {
  float (*part_acc)[D];
  float (*block_acc)[D];
  float *part_m, *part_l, *block_m, *block_l;
  __device__ explicit RowShared(unsigned char* smem) {
    part_acc = reinterpret_cast<float(*)[D]>(smem);
    block_acc = part_acc + kRowWarps;
    part_m = block_acc[kRowWarps];
    part_l = part_m + kRowWarps;
    block_m = part_l + kRowWarps;
    block_l = block_m + kRowWarps;
  }
};

// One active row's CTA, once its pages are known: warp w attends over pages page_of(w),
// page_of(w + kRowWarps), ... of the `pages` the row attends (pool pages of entry b, relative to
// its first page) in tiles of 8 keys, each lane's slice one vector load, the next tile's loads
// issued before the current one is added; the warps' prefix states and their block states (blk,
// over the block's own keys) are merged by warp 0, which writes O_p (T), L_p and Q_ref of row r
// and its output: the block state merged with the O_p and L_p as stored (what a stable row reads
// back on the next step).
template <class T, int D, class PageOf>
__device__ __forceinline__ void attend_active_row(const PoolView& pool, const Rows4<const T>& q, const Rows4<T>& out,
                                                  const Rows4<float>& lse, const RowShared<D>& sh,
                                                  const float (&qs)[D / 32], RowState<D / 32, 8>& blk, int pages,
                                                  PageOf&& page_of, int b, int h, int h_kv, int r, int64_t base,
                                                  T* o_p, float* l_p, T* q_ref) {
  constexpr int E = D / 32, kTile = 8;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  RowState<E, kTile> st;
  const int64_t length = pool.length[b];
  const int tiles_per_page = (pool.page_size + kTile - 1) / kTile;
  const int warp_pages = pages > warp ? (pages - warp + kRowWarps - 1) / kRowWarps : 0;
  const int warp_tiles = warp_pages * tiles_per_page;
  const T* pool_k = static_cast<const T*>(pool.k) + (h_kv * pool.pool_tokens + pool.first_page[b] * pool.page_size) * D;
  const T* pool_v = static_cast<const T*>(pool.v) + (h_kv * pool.pool_tokens + pool.first_page[b] * pool.page_size) * D;
  auto load_tile = [&](typename RowState<E, kTile>::template Loaded<T>& tile, int j) {
    const int i = warp + (j / tiles_per_page) * kRowWarps, t0 = (j % tiles_per_page) * kTile;
    const int64_t begin = static_cast<int64_t>(page_of(i)) * pool.page_size + t0;
    const int n = static_cast<int>(min(static_cast<int64_t>(min(kTile, pool.page_size - t0)), length - begin));
    RowState<E, kTile>::template load</*Aligned=*/true>(tile, pool_k + begin * D, D, pool_v + begin * D, D, n, lane);
  };
  typename RowState<E, kTile>::template Loaded<T> even, odd;  // two buffers, named (not indexed)
  if (warp_tiles > 0) load_tile(even, 0);
  for (int j = 0; j < warp_tiles; j += 2) {
    if (j + 1 < warp_tiles) load_tile(odd, j + 1);
    st.add(qs, even);
    if (j + 1 < warp_tiles) {
      if (j + 2 < warp_tiles) load_tile(even, j + 2);
      st.add(qs, odd);
    }
  }
  if (lane == 0) {
    sh.part_m[warp] = st.m;
    sh.part_l[warp] = st.l;
    sh.block_m[warp] = blk.m;
    sh.block_l[warp] = blk.l;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
    sh.part_acc[warp][lane * E + e] = st.acc[e];
    sh.block_acc[warp][lane * E + e] = blk.acc[e];
  }
  __syncthreads();
  if (warp != 0) return;
  for (int w = 1; w < kRowWarps; ++w) {
    float other[E], other_block[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      other[e] = sh.part_acc[w][lane * E + e];
      other_block[e] = sh.block_acc[w][lane * E + e];
    }
    st.merge(sh.part_m[w], sh.part_l[w], other);
    blk.merge(sh.block_m[w], sh.block_l[w], other_block);
  }
  const float inv = st.l > 0.0f ? 1.0f / st.l : 0.0f;
  const T* q_row = q.row(b, h, r);
  T* o = o_p + (base + r) * D;
  T* qr = q_ref + (base + r) * D;
  float prefix[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const T stored = from_float<T>(st.acc[e] * inv);
    o[lane * E + e] = stored;
    prefix[e] = to_float(stored);
    qr[lane * E + e] = q_row[lane * E + e];
  }
  const float l_stored = st.lse2() * kLn2;
  if (lane == 0) l_p[base + r] = l_stored;
  merge_out<T, E, 8>(blk, length > 0 ? l_stored * kLog2e : -INFINITY, [&](int e) { return prefix[e]; },
                     out.row(b, h, r), lse.row(b, h, r), lane);
}

// The block's own keys for an active row's CTA, every kRowWarps-th to warp w (one tile: block <=
// 64).
template <class T, int D>
__device__ __forceinline__ RowState<D / 32, 8> active_block_state(const float (&qs)[D / 32],
                                                                  const Rows4<const T>& k_block,
                                                                  const Rows4<const T>& v_block, int block, int b,
                                                                  int h_kv) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  RowState<D / 32, 8> blk;
  static_assert(kRowWarps * 8 >= 64, "a block of up to 64 keys is one tile a warp");
  if (warp < block) {
    blk.add_tile(qs, k_block.row(b, h_kv, warp), k_block.ss * kRowWarps, v_block.row(b, h_kv, warp),
                 v_block.ss * kRowWarps, (block - warp + kRowWarps - 1) / kRowWarps, lane);
  }
  return blk;
}

template <class T, int D, bool ATTEND = true>
__global__ void __launch_bounds__(kRowWarps * 32, 2) sparse_rows_kernel(
    PoolView pool, Rows4<const T> q, Rows4<const T> k_block, Rows4<const T> v_block, Rows4<T> out,
    Rows4<float> lse, const int32_t* active, const int32_t* counts, const uint64_t* candidates, int64_t tiles,
    int keep_tile, int capacity, int plan_slots, int32_t* plan_pages, int32_t* plan_counts, int heads_q, int group,
    int block, int max_rows, float scale_log2, T* o_p, float* l_p, T* q_ref) {
  constexpr int E = D / 32;
  extern __shared__ __align__(16) unsigned char row_smem[];
  const RowShared<D> sh(row_smem);
  int32_t* plan_smem = reinterpret_cast<int32_t*>(row_smem + rows_state_bytes<D>());  // the row's plan, read back
  uint64_t* rows_smem = reinterpret_cast<uint64_t*>(row_smem + rows_state_bytes<D>() + rows_plan_bytes(plan_slots));  // the selection
  const int h = blockIdx.x, y = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t base = (static_cast<int64_t>(b) * heads_q + h) * block;
  wait_for_previous();  // the candidates kernel's active rows, counts and candidates
  // Loads in flight together before any is used: the active rows' count, the row of slot y, and
  // (when the rounds select) slot y's candidates, re-indexed by position into shared memory
  // (candidates are ascending by page, so ties go to the lower page). The candidates of a slot
  // past the count are stale and unused.
  const int count = counts[b];
  const bool slot_cta = y < max_rows;
  const int slot_row = slot_cta ? active[static_cast<int64_t>(b) * block + y] : 0;
  const int n = static_cast<int>(pool.pages(b)), keep = min(capacity, n);
  const bool every_page = keep == n, rounds = !every_page && keep <= kRoundsMaxKeep;
  const int nc = (n + kScorePages - 1) / kScorePages * keep_tile;  // the entry's tiles only
  const uint64_t* cand = candidates + (base + y) * tiles * keep_tile;
  if (rounds && slot_cta) {
#pragma unroll 4
    for (int j = threadIdx.x; j < nc; j += blockDim.x) {
      rows_smem[j] = (cand[j] & 0xffffffff00000000ull) | static_cast<uint32_t>(j);
    }
  }
  if (slot_cta && y >= count) {
    if (threadIdx.x == 0) plan_counts[base + y] = 0;
    return;
  }
  if (!slot_cta) {
    if (y == max_rows) {
      for (int j = max_rows + static_cast<int>(threadIdx.x); j < block; j += blockDim.x) plan_counts[base + j] = 0;
    }
    if constexpr (ATTEND) {
      stable_rows<T, D>(pool, q, k_block, v_block, out, lse, active, count, o_p, l_p, q_ref, heads_q, group, block,
                        max_rows, scale_log2, b, h, y);
    }
    return;
  }
  const int r = slot_row, slot = y;
  float qs[E];
  const int h_kv = h / group;
  // The block's own keys while the candidates load: no warp waits on them after the pages.
  RowState<E, 8> blk;
  if constexpr (ATTEND) {
    load_query<T, E>(q.row(b, h, r), scale_log2, lane, qs);
    blk = active_block_state<T, D>(qs, k_block, v_block, block, b, h_kv);
  }
  int32_t* plan = plan_pages + (base + slot) * capacity;
  const bool plan_in_smem = ATTEND && !every_page && keep <= rows_plan_smem_pages(plan_slots);
  int32_t* plan_copy = plan_in_smem ? plan_smem : plan;  // where the chosen pages are also written
  if (every_page) {
    for (int j = threadIdx.x; j < n; j += blockDim.x) plan[j] = j;
  } else {
    if (rounds) {
      __syncthreads();  // the candidates are in
      const uint64_t* chosen = cta_rounds_select(rows_smem, rows_smem + nc, nc, keep, kRowWarps);
      if (warp == 0) {
        __syncwarp();
        for (int j = lane; j < keep; j += 32) {
          plan[j] = plan_copy[j] = static_cast<int32_t>(static_cast<uint32_t>(cand[static_cast<uint32_t>(chosen[j])]));
        }
      }
    } else if (warp == 0) {
      uint32_t* hist = reinterpret_cast<uint32_t*>(rows_smem);
      uint32_t* keys = hist + ba_att::kRadixBins;
      for (int j = lane; j < nc; j += 32) keys[j] = static_cast<uint32_t>(cand[j] >> 32);
      __syncwarp();
      ba_att::warp_top_select(keys, hist, nc, keep, plan);
      __syncwarp();
      for (int j = lane; j < keep; j += 32) plan[j] = plan_copy[j] = static_cast<int32_t>(static_cast<uint32_t>(cand[plan[j]]));
    }
  }
  if (threadIdx.x == 0) plan_counts[base + slot] = keep;
  if constexpr (ATTEND) {
    __syncthreads();  // the plan is written
    attend_active_row<T, D>(pool, q, out, lse, sh, qs, blk, keep,
                            [&](int i) { return every_page ? i : plan_copy[i]; }, b, h, h_kv, r, base, o_p, l_p,
                            q_ref);
  }
}

// ---- attend_union: every active row over its kv head's union ----------------------------------

// Dynamic shared memory of union_rows_kernel over a longest prefix of max_pages pages: the states,
// then the union as a bitmap of the pages and, per 32-bit word, the set bits of the words before it
// (one more entry: the union's size).
__host__ __device__ constexpr int64_t union_words(int64_t max_pages) { return (max_pages + 31) / 32; }
template <int D>
__host__ __device__ constexpr size_t union_smem_bytes(int64_t max_pages) {
  return rows_state_bytes<D>() + static_cast<size_t>(2 * union_words(max_pages) + 1) * sizeof(uint32_t);
}

// The attend_union steps' last launch, after sparse_rows_kernel<T, D, false> wrote every (head,
// active slot)'s plan. Grid and stable CTAs as sparse_rows_kernel's. An active row's CTA gathers
// the plans of its kv head's query heads (the group) at every active slot of the entry into a
// bitmap of the entry's pages (shared-memory atomics: the same bits whatever the order), counts
// each word's set bits before it (warp 0, a scan), and attends over the union ascending by page:
// union index u is the page of rank u - before[w] in the word w that holds it (a binary search
// over the counts), warp w taking indices w, w + kRowWarps, ... as sparse_rows_kernel takes its
// plan's pages. CPU: paged_attention with attend_union, over the union its page_union gives.
template <class T, int D>
__global__ void __launch_bounds__(kRowWarps * 32, 2) union_rows_kernel(
    PoolView pool, Rows4<const T> q, Rows4<const T> k_block, Rows4<const T> v_block, Rows4<T> out,
    Rows4<float> lse, const int32_t* active, const int32_t* counts, int capacity, const int32_t* plan_pages,
    const int32_t* plan_counts, int heads_q, int group, int block, int max_rows, float scale_log2, T* o_p, float* l_p,
    T* q_ref) {
  constexpr int E = D / 32;
  extern __shared__ __align__(16) unsigned char row_smem[];
  const RowShared<D> sh(row_smem);
  const int h = blockIdx.x, y = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t base = (static_cast<int64_t>(b) * heads_q + h) * block;
  const int count = counts[b];
  if (y >= max_rows) {
    stable_rows<T, D>(pool, q, k_block, v_block, out, lse, active, count, o_p, l_p, q_ref, heads_q, group, block,
                      max_rows, scale_log2, b, h, y);
    return;
  }
  if (y >= count) return;
  const int r = active[static_cast<int64_t>(b) * block + y], h_kv = h / group;
  float qs[E];
  load_query<T, E>(q.row(b, h, r), scale_log2, lane, qs);
  RowState<E, 8> blk = active_block_state<T, D>(qs, k_block, v_block, block, b, h_kv);
  const int n = static_cast<int>(pool.pages(b)), words = static_cast<int>(union_words(n));
  uint32_t* bits = reinterpret_cast<uint32_t*>(row_smem + rows_state_bytes<D>());
  uint32_t* before = bits + words;  // [words + 1]
  for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
  __syncthreads();
  // The group's plans at the active slots: (g, slot, j) flat over the CTA.
  const int64_t group_base = (static_cast<int64_t>(b) * heads_q + h_kv * group) * block;
  const int64_t per_head = static_cast<int64_t>(count) * capacity;
  for (int64_t idx = threadIdx.x; idx < group * per_head; idx += blockDim.x) {
    const int64_t g = idx / per_head, slot = idx % per_head / capacity, j = idx % capacity;
    const int64_t row = group_base + g * block + slot;
    if (j < plan_counts[row]) {
      const int page = plan_pages[row * capacity + j];
      atomicOr(&bits[page >> 5], 1u << (page & 31));
    }
  }
  __syncthreads();
  if (warp == 0) {
    uint32_t running = 0;
    for (int w0 = 0; w0 < words; w0 += 32) {
      const int w = w0 + lane;
      const uint32_t c = w < words ? __popc(bits[w]) : 0u;
      uint32_t incl = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
      }
      if (w < words) before[w] = running + incl - c;
      running += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) before[words] = running;
  }
  __syncthreads();
  const int pages = static_cast<int>(before[words]);
  auto page_of = [&](int u) {
    int lo = 0, hi = words - 1;  // the last word with before[w] <= u holds union index u
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (static_cast<int>(before[mid]) <= u) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    uint32_t word = bits[lo];
    for (int k = u - static_cast<int>(before[lo]); k > 0; --k) word &= word - 1u;  // drop the lower set bits
    return lo * 32 + __ffs(static_cast<int>(word)) - 1;
  };
  attend_active_row<T, D>(pool, q, out, lse, sh, qs, blk, pages, page_of, b, h, h_kv, r, base, o_p, l_p, q_ref);
}

// ---- reuse: the active rows' dense prefix adopted --------------------------------------------

// Grid (heads_q, max_rows, batch), one warp: the reuse method's active row of slot y (none past
// the entry's count) takes its dense prefix output and LSE (o_new, l_new: the split-KV executor's,
// every row of the block) as its O_p and L_p, and Q_ref = q; stable rows are not touched. Then
// block_merge_kernel merges every row with its (O_p, L_p).
template <class T, int D>
__global__ void __launch_bounds__(32) adopt_rows_kernel(Rows4<const T> q, const int32_t* active, const int32_t* counts,
                                                        const T* o_new, const float* l_new, int heads_q, int block,
                                                        T* o_p, float* l_p, T* q_ref) {
  constexpr int E = D / 32;
  const int h = blockIdx.x, y = blockIdx.y, b = blockIdx.z, lane = threadIdx.x;
  if (y >= counts[b]) return;
  const int r = active[static_cast<int64_t>(b) * block + y];
  const int64_t at = (static_cast<int64_t>(b) * heads_q + h) * block + r;
  const T* q_row = q.row(b, h, r);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    o_p[at * D + lane * E + e] = o_new[at * D + lane * E + e];
    q_ref[at * D + lane * E + e] = q_row[lane * E + e];
  }
  if (lane == 0) l_p[at] = l_new[at];
}

}  // namespace sparsa::cuda::losa
