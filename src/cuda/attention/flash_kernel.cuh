// Internal: what every rung of the flash executor shares (FlashParams, the key-tile iterator, the
// token gathers, the online-softmax step, the epilogue) and rung 1 of bench/cuda/flash_ladder.cu:
// one mainloop for dense and block-sparse attention, FlashAttention-2 style (Dao 2023, arXiv
// 2307.08691) on the warp-level tensor cores. The library launches rungs 2 and 3
// (flash_wgmma_kernel.cuh, flash_tma_kernel.cuh); rung 1 stays as the ladder's baseline.
//
// A CTA owns BM = 16 * MT * WARPS query rows of one (batch, query head); each warp owns 16 * MT
// rows and keeps its O accumulator (f32) and its online-softmax state (running max m, running
// sum l, per row) in registers (Q fragments too when QREGS). The CTA walks a list of key tiles of BN tokens:
//   S = Q K^T (mma.sync m16n8k16, f32)  ->  m' = max(m, rowmax S);  P = exp2(S*c - m'*c)
//   l = l * exp2((m - m')c) + rowsum P;  O = O * exp2((m - m')c) + P V     (c = scale * log2 e)
// and ends with O / l and LSE = (m c + log2 l) ln 2 (O = 0, LSE = -inf for a row that saw no key).
// K and V tiles are double-buffered in shared memory with cp.async (the load of tile t+1 is in
// flight while tile t is computed); fragments come from shared memory through ldmatrix (.trans
// for V). Shared rows are XOR-swizzled in 16-byte chunks so ldmatrix is free of bank conflicts.
//
// Hooks, not forks: the only difference between dense and block-sparse is the key
// tile iterator (tile t -> key block indices[t / chunks], chunk t % chunks; dense: tile t) and the
// token gathers (rows read through perm_q / perm_kv when present; O and LSE written back at the
// original positions). Columns past the end of a partial key block are masked to -inf.
//
// Index contents are guarded, not trusted: counts are clamped to [0, capacity], key blocks
// outside [0, num_kv_blocks) and permutation entries outside [0, len) are skipped, so a bad plan
// can give wrong numbers but never reads or writes out of bounds.
#pragma once

#include <cstdint>

#include "cuda/common/mask.cuh"
#include "cuda/common/mma.cuh"

namespace sparsa::cuda::detail {

// What every executor kernel reads of a call: the tensors, their shapes, the scale and the mask
// (MaskArgs, common/mask.cuh; the kernels instantiated with MASKED read it). The flash executor
// (FlashParams) and the split-KV one (SplitKvParams, split_kv_kernel.cuh) add their own fields.
struct AttentionArgs : MaskArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t q_stride[3] = {}, k_stride[3] = {}, v_stride[3] = {}, out_stride[3] = {}, lse_stride[3] = {};
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1, len_q = 0, len_kv = 0;
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  bool aligned_loads = true;  // q/k/v bases and strides allow 16-byte copies
  bool aligned_out = true;    // out base and strides allow 4-byte pair stores
};

struct FlashParams : AttentionArgs {
  // The plan. Dense: counts == nullptr, block_q = BM, block_kv = BN, every key tile visited.
  int block_q = 0, block_kv = 0, num_q_blocks = 0, num_kv_blocks = 0;
  int tiles_per_q_block = 1;   // ceil(block_q / BM)
  int chunks_per_kv_block = 1; // ceil(block_kv / BN)
  const int32_t* counts = nullptr;   // [batch, heads_q, num_q_blocks]
  const int32_t* indices = nullptr;  // [batch, heads_q, num_q_blocks, capacity]
  const int32_t* perm_q = nullptr;   // [batch, heads_q, len_q] or nullptr
  const int32_t* perm_kv = nullptr;  // [batch, heads_kv, len_kv] or nullptr
  int64_t counts_stride[3] = {}, indices_stride[4] = {}, perm_q_stride[3] = {}, perm_kv_stride[3] = {};
  int capacity = 0;
  // The mask hook's view of a key permutation: the original token of each permuted key position
  // ([batch, heads_kv, len_kv], the plan's perm_kv). Kept when K and V are gathered into the
  // plan's order (perm_kv is then null: the kernel reads in order, the mask still needs the
  // original positions); null without a permutation or without a mask.
  const int32_t* key_perm = nullptr;
  int64_t key_perm_stride[3] = {};
  // A variable-length batch (sparsa/attention.h): i32 offsets [batch + 1] in device memory, batch
  // = the number of sequences, len_q / len_kv the longest; sequence b is rows cu_seqlens_q[b] ..
  // of the seq dimension (its batch strides are 0). Null: every sequence has len_q / len_kv.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_kv = nullptr;
  int64_t kv_rows = 0;  // a variable-length batch: K's and V's rows in all (cu_seqlens_kv's last)
  // Query tiles in reverse order (blockIdx.x 0 takes the last tile): a causal-like mask gives the
  // last tiles the most keys, and the scheduler hands out CTAs in blockIdx order, so the longest
  // tiles start first and the short ones fill the tail of the grid.
  bool reverse_tiles = false;
};

template <int D, int WARPS, int BN, int MT>
struct FlashShape {
  static constexpr int kBM = 16 * MT * WARPS;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kSmemBytes = (kBM + 4 * BN) * D * 2;  // Q + 2 stages of (K, V)
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] b16 tile.
template <int D>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * D * 2 + ((chunk ^ (row & 7)) << 4));
}
template <int D>
struct RowSwizzle {  // the layout ldmatrix reads (rung 1)
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) { return swizzle<D>(row, chunk); }
};

// Thread t = threadIdx.x - FIRST (the copying threads are FIRST .. FIRST + THREADS - 1) copies
// 16-byte chunk t % (D/8) of rows t / (D/8) + i * step (step = THREADS / (D/8)) of a [ROWS][D]
// tile; token[i] is the source row (negative: zeros). Layout::offset(row, chunk) places the chunk
// in shared memory.
template <int D, int ROWS, int THREADS, class Layout = RowSwizzle<D>, int FIRST = 0>
struct TileCopy {
  static constexpr int kChunks = D / 8;
  static constexpr int kStep = THREADS / kChunks;
  static constexpr int kRows = ROWS / kStep;  // rows per thread
  static_assert(THREADS % kChunks == 0 && ROWS % kStep == 0, "tile copy must divide evenly");

  static __device__ __forceinline__ int thread() { return static_cast<int>(threadIdx.x) - FIRST; }
  static __device__ __forceinline__ int row(int i) { return thread() / kChunks + i * kStep; }

  // One uniform branch per tile, none per chunk.
  static __device__ __forceinline__ void copy(uint32_t dst, const uint16_t* base, int64_t stride, bool aligned,
                                              const int64_t (&token)[kRows]) {
    const int chunk = thread() % kChunks;
    if (aligned) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const uint16_t* src = base + (token[i] >= 0 ? token[i] : 0) * stride + chunk * 8;
        cp_async_16(dst + Layout::offset(row(i), chunk), src, token[i] >= 0 ? 16 : 0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        uint32_t w[4] = {0, 0, 0, 0};
        if (token[i] >= 0) {
          const uint16_t* src = base + token[i] * stride + chunk * 8;
#pragma unroll
          for (int e = 0; e < 4; ++e) w[e] = uint32_t(src[2 * e]) | (uint32_t(src[2 * e + 1]) << 16);
        }
        asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + Layout::offset(row(i), chunk)), "r"(w[0]),
                     "r"(w[1]), "r"(w[2]), "r"(w[3]));
      }
    }
  }
};

// Source tokens of rows [begin, begin + ROWS) of a permuted sequence: position pos < end is
// token perm[pos] (pos itself without a permutation); anything else, or a permutation entry
// outside [0, len), reads as zeros.
template <class Copy>
__device__ __forceinline__ void gather_tokens(int64_t (&token)[Copy::kRows], int begin, int end, const int32_t* perm,
                                              int64_t perm_stride, int len) {
#pragma unroll
  for (int i = 0; i < Copy::kRows; ++i) {
    const int pos = begin + Copy::row(i);
    int64_t t = pos < end ? pos : -1;
    if (perm != nullptr && t >= 0) {
      t = perm[pos * perm_stride];
      t = t < len ? t : -1;
    }
    token[i] = t;
  }
}

// Dense key tiles of block_kv keys that meet [key_min, key_max) among the first num_kv_blocks:
// tiles [*first, *first + *count). (__host__ __device__: tests/test_cuda_mask_logic.cu.)
__host__ __device__ __forceinline__ void dense_tile_range(int key_min, int key_max, int len_kv, int block_kv,
                                                          int num_kv_blocks, int& first, int& count) {
  first = key_min / block_kv;
  const int hi = key_max < len_kv ? key_max : len_kv;
  int last = (hi + block_kv - 1) / block_kv;
  last = last < num_kv_blocks ? last : num_kv_blocks;
  count = last - first > 0 ? last - first : 0;
}

// The key-tile iterator (the sparsity hook) of query block qb of (b, h): the key positions
// [begin, end) of each tile of BN tokens it visits (end <= begin: a skipped block). Dense: every
// tile; sparse: key block indices[slot], chunk by chunk. Walked incrementally (slot, chunk) to
// keep divisions out of the loop. [key_min, key_max): the keys some row of the CTA may see under
// the mask (the whole range without one): dense visits only the tiles that meet it, sparse
// skips the listed tiles outside it, so fully masked tiles are never computed.
template <int BN>
struct KeyTiles {
  const int32_t* list = nullptr;  // null: dense
  int num_tiles = 0;
  int slot = 0, chunk = 0;
  int key_min = 0, key_max = 0x7fffffff;

  int len_kv = 0;         // this sequence's keys
  int num_kv_blocks = 0;  // its key blocks: key block indices at or past it are skipped

  __device__ __forceinline__ KeyTiles(const FlashParams& p, int b, int h, int qb, int keys, int kmin = 0,
                                      int kmax = 0x7fffffff)
      : key_min(kmin), key_max(kmax), len_kv(keys) {
    num_kv_blocks = min(p.num_kv_blocks, (keys + p.block_kv - 1) / p.block_kv);
    if (p.counts != nullptr) {
      int count = p.counts[b * p.counts_stride[0] + h * p.counts_stride[1] + qb * p.counts_stride[2]];
      count = max(0, min(count, p.capacity));
      list = p.indices + b * p.indices_stride[0] + h * p.indices_stride[1] + qb * p.indices_stride[2];
      num_tiles = count * p.chunks_per_kv_block;
    } else {  // dense: block_kv == BN, one chunk a block; the tiles that meet [kmin, kmax)
      dense_tile_range(kmin, kmax, keys, p.block_kv, num_kv_blocks, slot, num_tiles);
    }
  }

  __device__ __forceinline__ void next(const FlashParams& p, int& begin, int& end) {
    const int kb = list == nullptr ? slot : list[slot * p.indices_stride[3]];
    if (kb < 0 || kb >= num_kv_blocks) {
      begin = end = 0;
    } else {
      begin = kb * p.block_kv + chunk * BN;
      end = min(min((kb + 1) * p.block_kv, len_kv), begin + BN);
      if (end <= key_min || begin >= key_max) begin = end = 0;  // no row of the CTA sees it
    }
    if (++chunk == p.chunks_per_kv_block) chunk = 0, ++slot;
  }
  // The next tile with keys (a padded index entry, a block past the keys, a chunk past its block's
  // end or one no row of the CTA sees are passed over); false when none is left. Rung 3's producer
  // and consumers walk the tiles this way, so empty tiles cost them nothing.
  __device__ __forceinline__ bool next_nonempty(const FlashParams& p, int& begin, int& end) {
    while (walked < num_tiles) {
      ++walked;
      next(p, begin, end);
      if (end > begin) return true;
    }
    return false;
  }
  int walked = 0;  // tiles next_nonempty has passed
};

// ---- the mask hook (sparsa/attention.h states the masks; core/mask.cpp is the host's copy) ----

// The index arithmetic (mask_window, tile_key_range) is common/mask.cuh's.

// The visible key windows of this thread's two accumulator rows (g and g + 8 of its warp's 16).
struct RowWindows {
  int kb[2] = {0, 0}, ke[2] = {0, 0};
};

// The mask hook on one key tile of S whose column n is key position begin + n (keys in order):
// columns outside a row's window become -inf (this thread: rows g, elements 0-1, and g + 8,
// elements 2-3, of each 8-column score tile; columns 2c, 2c + 1). A warp whose rows all see
// the whole tile skips the per-element work.
template <int kNT>
__device__ __forceinline__ void mask_tile(float (&s)[kNT][4], const RowWindows& w, int begin) {
  int lo[2], hi[2];
  bool cut = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lo[r] = w.kb[r] - begin;
    hi[r] = w.ke[r] - begin;
    cut = cut || lo[r] > 0 || hi[r] < 8 * kNT;
  }
  if (!__any_sync(0xffffffffu, cut)) return;
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = n * 8 + 2 * c + (e & 1);
      if (col < lo[e / 2] || col >= hi[e / 2]) s[n][e] = -INFINITY;
    }
}

// The same with permuted keys: column n is key position begin + n, whose original token is
// key_perm[(begin + n) * stride] (columns at or past `valid`, and entries outside [0, len_kv),
// are hidden from every row).
template <int kNT>
__device__ __forceinline__ void mask_tile_permuted(float (&s)[kNT][4], const RowWindows& w, const int32_t* key_perm,
                                                   int64_t stride, int begin, int valid) {
  const int c = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < kNT; ++n)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = n * 8 + 2 * c + half;
      const int key = col < valid ? __ldg(key_perm + (begin + col) * stride) : -1;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (key < w.kb[r] || key >= w.ke[r]) s[n][2 * r + half] = -INFINITY;
    }
}

__device__ __forceinline__ float fast_exp2(float x) {  // MUFU.EX2; -inf -> 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// This CTA's query tile (every rung, one CTA per tile): permuted positions [begin, end) of query
// block qb of (b, h), at most ROWS of them, and the original token of a position (the permutation
// hook: perm_q when present; -1 past the end or for an entry outside [0, len_q)). Positions and
// tokens are local to sequence b; len_q / len_kv are its lengths and q_row0 / kv_row0 its first
// rows in the seq dimension (a variable-length batch; p.len_q, p.len_kv and 0 otherwise).
template <int ROWS>
struct QueryTile {
  int b, h, h_kv, qb, begin, end;
  int len_q, len_kv;
  int64_t q_row0 = 0, kv_row0 = 0;
  const int32_t* perm;

  __device__ __forceinline__ explicit QueryTile(const FlashParams& p) {
    h = blockIdx.y, b = blockIdx.z, h_kv = h / p.group;
    len_q = p.len_q, len_kv = p.len_kv;
    if (p.cu_seqlens_q != nullptr) {
      q_row0 = p.cu_seqlens_q[b], kv_row0 = p.cu_seqlens_kv[b];
      len_q = static_cast<int>(p.cu_seqlens_q[b + 1] - q_row0);
      len_kv = static_cast<int>(p.cu_seqlens_kv[b + 1] - kv_row0);
    }
    const int tile = p.reverse_tiles ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
    qb = tile / p.tiles_per_q_block;
    begin = qb * p.block_q + (tile % p.tiles_per_q_block) * ROWS;
    end = min(min((qb + 1) * p.block_q, len_q), begin + ROWS);
    perm = p.perm_q ? p.perm_q + b * p.perm_q_stride[0] + h * p.perm_q_stride[1] : nullptr;
  }
  // A tile past the end of a partial query block (or of a shorter sequence): the CTA returns.
  __device__ __forceinline__ bool empty() const { return begin >= end; }
  __device__ __forceinline__ int64_t token(const FlashParams& p, int pos) const {
    if (pos >= end) return -1;
    const int64_t t = perm ? perm[pos * p.perm_q_stride[2]] : pos;
    return t >= 0 && t < len_q ? t : -1;
  }
  // Q (THREADS threads, Copy = TileCopy<D, ROWS, ...>) into shared memory at q_smem.
  template <class Copy>
  __device__ __forceinline__ void load(const FlashParams& p, uint32_t q_smem) const {
    const uint16_t* base =
        static_cast<const uint16_t*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] + q_row0 * p.q_stride[2];
    int64_t token[Copy::kRows];
    gather_tokens<Copy>(token, begin, end, perm, p.perm_q_stride[2], len_q);
    Copy::copy(q_smem, base, p.q_stride[2], p.aligned_loads, token);
  }
  // K's or V's rows of this (sequence, kv head): row j of the sequence at base + j * stride[2].
  __device__ __forceinline__ const uint16_t* kv_base(const void* x, const int64_t (&stride)[3]) const {
    return static_cast<const uint16_t*>(x) + b * stride[0] + h_kv * stride[1] + kv_row0 * stride[2];
  }
};

// The sum of x over the 4 lanes of a quad (the threads that share an accumulator row).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// LSE = (m c + log2 l) ln 2 of a row with running max m (raw logits) and sum l; -inf when l = 0.
__device__ __forceinline__ float row_lse(float l, float row_max, float scale_log2) {
  constexpr float kLn2 = 0.69314718055994531f;
  return l > 0.0f ? (row_max * scale_log2 + log2f(l)) * kLn2 : -INFINITY;
}

// This thread's share of row r (0: g, 1: g + 8) of a 16-row accumulator tile: O / l at `out` (two
// columns of each 8-wide tile) and, from lane c == 0, LSE = (m c + log2 l) ln 2 at `lse`; a row
// that saw no key (l = 0) gets O = 0 and LSE = -inf. l is the row's whole sum (quad_sum).
template <class T, int kDT>
__device__ __forceinline__ void store_row(T* out, float* lse, const float (&o)[kDT][4], int r, float l, float row_max,
                                          float scale_log2, bool aligned_out) {
  const int c = threadIdx.x % 4;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int i = 0; i < kDT; ++i) {
    const int col = i * 8 + 2 * c;
    const uint32_t packed = Pair<T>::pack(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
    if (aligned_out) {
      *reinterpret_cast<uint32_t*>(out + col) = packed;
    } else {
      reinterpret_cast<uint16_t*>(out)[col] = static_cast<uint16_t>(packed & 0xffffu);
      reinterpret_cast<uint16_t*>(out)[col + 1] = static_cast<uint16_t>(packed >> 16);
    }
  }
  if (c == 0) *lse = row_lse(l, row_max, scale_log2);
}

// The epilogue of one 16-row accumulator tile whose first row is permuted query position pos0:
// rows pos0 + g and pos0 + g + 8 (g = lane / 4) written at their original token (tile.token, -1:
// none). row_sum is this thread's partial sum.
template <class T, int kDT, int ROWS>
__device__ __forceinline__ void store_tile_rows(const FlashParams& p, const QueryTile<ROWS>& tile, int pos0,
                                                const float (&o)[kDT][4], const float (&row_max)[2],
                                                const float (&row_sum)[2]) {
  const int b = tile.b, h = tile.h, g = threadIdx.x % 32 / 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(row_sum[r]);
    const int64_t token = tile.token(p, pos0 + g + 8 * r);
    if (token < 0) continue;
    const int64_t row = tile.q_row0 + token;
    T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + row * p.out_stride[2];
    float* lse = p.lse + b * p.lse_stride[0] + h * p.lse_stride[1] + row * p.lse_stride[2];
    store_row<T, kDT>(out, lse, o, r, l, row_max[r], p.scale_log2, p.aligned_out);
  }
}

// The same epilogue as a call, not inlined: rung 2's OUTLINED option, kept for the ladder's rung 2g
// only. Inlined into rungs 2 and 3, the epilogue's address arithmetic and LSE (log2f) make ptxas
// report C7515 (wgmma serialised: "non wgmma instructions defining accumulator registers ...
// between start and end of the pipeline stage") for the whole kernel; out of line (O passed
// through the stack, once per CTA) it does not, but the kernel is slower (3.23 vs 2.93 ms at 8K,
// bench/RESULTS.md), so the executor inlines it.
template <class T, int kDT, int ROWS>
__device__ __noinline__ void store_tile_rows_outlined(const FlashParams& p, const QueryTile<ROWS>& tile, int pos0,
                                                      const float (&o)[kDT][4], const float (&row_max)[2],
                                                      const float (&row_sum)[2]) {
  store_tile_rows<T, kDT>(p, tile, pos0, o, row_max, row_sum);
}

// The online softmax of a 16-row tile, in two halves so that a kernel can put the wait for the
// previous P V between them (this thread: rows g, elements 0-1, and g + 8, elements 2-3, of each
// 8-column score tile).
// softmax_scores: columns at or past `valid` are masked to -inf in S (the mask hook; only partial
//   tiles pay for it); m' = max(m, rowmax S); P = exp2(S c - m' c); l = l alpha + rowsum P, where
//   alpha = exp2((m - m') c) (0 on the first tile). emit(n, p) receives the 4 probabilities of
//   score tile n.
template <int kNT, class Emit>
__device__ __forceinline__ void softmax_scores(float (&s)[kNT][4], int valid, float scale_log2, float (&row_max)[2],
                                               float (&row_sum)[2], float (&alpha)[2], Emit&& emit) {
  if (valid < 8 * kNT) {
    const int c = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (n * 8 + 2 * c + (e & 1) >= valid) s[n][e] = -INFINITY;
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int n = 0; n < kNT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    base[r] = mx == -INFINITY ? 0.0f : mx * scale_log2;
    alpha[r] = fast_exp2(row_max[r] * scale_log2 - base[r]);
    row_max[r] = mx;
    row_sum[r] *= alpha[r];
  }
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    float prob[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) prob[e] = fast_exp2(fmaf(s[n][e], scale_log2, -base[e / 2]));
    row_sum[0] += prob[0] + prob[1];
    row_sum[1] += prob[2] + prob[3];
    emit(n, prob);
  }
}

// P of score tile n packed into the mma A fragments: score tiles 2j, 2j+1 are exactly A fragment
// j (no shuffles).
template <class T, int kNT>
__device__ __forceinline__ void pack_probs(int n, const float (&prob)[4], uint32_t (&p_frag)[kNT / 2][4]) {
  p_frag[n / 2][(n % 2) * 2 + 0] = Pair<T>::pack(prob[0], prob[1]);
  p_frag[n / 2][(n % 2) * 2 + 1] = Pair<T>::pack(prob[2], prob[3]);
}

// O *= alpha, only when some row's max moved (alpha is exactly 1 otherwise): after the first
// tiles the running max rarely changes, and the warp skips the multiplies.
template <int kDT>
__device__ __forceinline__ void rescale(float (&o)[kDT][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < kDT; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }
  }
}

// MT: 16-row m-tiles per warp; QREGS: Q's fragments stay in registers (MT = 1 only) instead of
// being reloaded from shared memory per k-step; MINB: CTAs per multiprocessor the register
// allocation must allow (__launch_bounds__).
template <class T, int D, int WARPS, int BN, int MT, bool QREGS, int MINB>
__global__ void __launch_bounds__(32 * WARPS, MINB) flash_forward_kernel(const FlashParams p) {
  static_assert(!QREGS || MT == 1, "Q fragments in registers only with one m-tile per warp");
  using Shape = FlashShape<D, WARPS, BN, MT>;
  constexpr int BM = Shape::kBM, THREADS = Shape::kThreads;
  constexpr int kDT = D / 8;    // 8-wide accumulator tiles along head_dim
  constexpr int kNT = BN / 8;   // 8-wide score tiles along the key tile
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_smem = smem_addr(smem);
  const uint32_t k_smem = q_smem + BM * D * 2;             // 2 stages of BN x D
  const uint32_t v_smem = k_smem + 2 * BN * D * 2;         // 2 stages of BN x D

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const QueryTile<BM> tile(p);
  if (tile.empty()) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv;

  KeyTiles<BN> tiles(p, b, tile.h, tile.qb, tile.len_kv);
  const int num_tiles = tiles.num_tiles;

  // ---- token gathers (the permutation hook) ----
  const int32_t* perm_kv = p.perm_kv ? p.perm_kv + b * p.perm_kv_stride[0] + h_kv * p.perm_kv_stride[1] : nullptr;

  const uint16_t* k_base = tile.kv_base(p.k, p.k_stride);
  const uint16_t* v_base = tile.kv_base(p.v, p.v_stride);

  using KVCopy = TileCopy<D, BN, THREADS>;
  using QCopy = TileCopy<D, BM, THREADS>;
  auto load_kv = [&](int begin, int end, int stage) {
    int64_t token[KVCopy::kRows];
    gather_tokens<KVCopy>(token, begin, end, perm_kv, p.perm_kv_stride[2], tile.len_kv);
    KVCopy::copy(k_smem + stage * BN * D * 2, k_base, p.k_stride[2], p.aligned_loads, token);
    KVCopy::copy(v_smem + stage * BN * D * 2, v_base, p.v_stride[2], p.aligned_loads, token);
  };

  // Prologue: Q and the first key tile in one copy group.
  tile.template load<QCopy>(p, q_smem);
  int load_begin = 0, load_end = 0;
  if (num_tiles > 0) {
    tiles.next(p, load_begin, load_end);
    load_kv(load_begin, load_end, 0);
  }
  cp_async_commit();

  constexpr bool kQInRegs = QREGS;
  float o[MT][kDT][4];
  float row_max[MT][2], row_sum[MT][2];  // rows g and g+8 of each m-tile; max in raw logits,
#pragma unroll                           // sums per thread (reduced over the quad at the end)
  for (int m = 0; m < MT; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.0f;
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[m][i][0] = o[m][i][1] = o[m][i][2] = o[m][i][3] = 0.0f;
  }
  uint32_t q_frag[kQInRegs ? D / 16 : 1][4];
  // A-fragment row address of m-tile m: matrix i = lane/8 covers rows (i%2)*8.., k (i/2)*8..
  auto q_row = [&](int m) { return warp * 16 * MT + m * 16 + (lane / 8 % 2) * 8 + lane % 8; };

  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t & 1;
    const int begin = load_begin, end = load_end;  // of tile t
    if (t + 1 < num_tiles) {
      tiles.next(p, load_begin, load_end);
      load_kv(load_begin, load_end, stage ^ 1);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the newest group (tile t+1) has landed
    __syncthreads();
    if (kQInRegs && t == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(q_frag[kk], q_smem + swizzle<D>(q_row(0), kk * 2 + lane / 16));
    }
    const int valid = end - begin;
    if (valid > 0) {
      const uint32_t ks = k_smem + stage * BN * D * 2, vs = v_smem + stage * BN * D * 2;
      // S = Q K^T. B matrices from K rows: i = lane/8 -> keys (i/2)*8.., d (i%2)*8..
      float s[MT][kNT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < kNT; ++n) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if constexpr (kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[m][e] = q_frag[kk][e];
          } else {
            ldmatrix_x4(qa[m], q_smem + swizzle<D>(q_row(m), kk * 2 + lane / 16));
          }
        }
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t bk[4];
          const int key = np * 16 + (lane / 16) * 8 + lane % 8;
          ldmatrix_x4(bk, ks + swizzle<D>(key, kk * 2 + (lane / 8) % 2));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_16816<T>(s[m][2 * np], qa[m], bk[0], bk[1]);
            mma_16816<T>(s[m][2 * np + 1], qa[m], bk[2], bk[3]);
          }
        }
      }
      uint32_t p_frag[MT][kNT / 2][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        float alpha[2];
        softmax_scores<kNT>(s[m], valid, p.scale_log2, row_max[m], row_sum[m], alpha,
                            [&](int n, const float(&prob)[4]) { pack_probs<T, kNT>(n, prob, p_frag[m]); });
        rescale<kDT>(o[m], alpha);
      }
      // O += P V. B matrices from V rows, transposed: i = lane/8 -> keys (i%2)*8.., d (i/2)*8..
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
          uint32_t bv[4];
          const int key = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
          ldmatrix_x4_trans(bv, vs + swizzle<D>(key, dp * 2 + lane / 16));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_16816<T>(o[m][2 * dp], p_frag[m][kk], bv[0], bv[1]);
            mma_16816<T>(o[m][2 * dp + 1], p_frag[m][kk], bv[2], bv[3]);
          }
        }
      }
    }
    __syncthreads();  // stage t is overwritten by the prefetch of the next iteration
  }
  cp_async_wait<0>();

  // ---- epilogue: O / l, LSE, written at the original query positions ----
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    store_tile_rows<T, kDT>(p, tile, tile.begin + warp * 16 * MT + m * 16, o[m], row_max[m], row_sum[m]);
  }
}

}  // namespace sparsa::cuda::detail
