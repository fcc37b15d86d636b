// Internal: the flash executor on Hopper's warpgroup tensor cores (rung 2 of
// bench/cuda/flash_ladder.cu). Same algorithm, hooks and contracts as rung 1 (flash_kernel.cuh:
// the key-tile iterator, the token gathers, the mask, the online-softmax step and the epilogue
// are shared); what changes is how the two products are computed:
//
//   S = Q K^T: wgmma m64n{BN}k16, A = Q and B = K both from shared memory (K-major);
//   O += P V:  wgmma m64n{D}k16, A = P from registers (the S accumulator converted in place),
//              B = V from shared memory read MN-major (no transpose in the copy).
//
// A CTA owns 128 query rows: two warpgroups of 64 rows each, 256 threads, all of which copy Q, K
// and V tiles with cp.async into 128-byte-swizzled shared memory (wgmma.cuh) and compute. K and V
// go through STAGES stages (the executor uses 3; per key tile t, with 2 stages):
//   wait for tile t -> barrier -> issue S_t (async) -> wait for S_t and for P V_{t-1}
//   -> barrier (both warpgroups are done with stage t-1) -> prefetch tile t+1 into that stage
//   -> softmax of S_t -> issue P V_t (async; it overlaps the next iteration's wait and S_{t+1}).
// Measured (bench/cuda/flash_ladder.cu): letting P V lag one tile behind S so that the exponentials
// overlap it (FlashAttention-3's intra-warpgroup pipelining, Shah et al. 2024, arXiv 2407.08608)
// was slower here (290 vs 354 TFLOP/s at 8K), because without a producer warp the copies and two
// CTA barriers per tile sit between the tensor-core bursts either way. Rung 3 (flash_tma_kernel.cuh) adds a
// TMA producer warp with mbarriers; the executor takes it whenever K and V are read in order.
#pragma once

#include <cstdint>

#include "cuda/attention/flash_kernel.cuh"
#include "cuda/common/wgmma.cuh"

namespace sparsa::cuda::detail {

// Query rows per CTA of rungs 2 and 3: two consumer warpgroups x 64 rows.
constexpr int kWgmmaRows = 128;

template <int D, int BN, int STAGES>
struct WgmmaShape {
  static constexpr int kBM = kWgmmaRows;
  static constexpr int kThreads = 256;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kKVBytes = BN * D * 2;  // one stage of K (or V)
  static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + 1024;  // + slack to align the base
};

// The consumer side of rungs 2 and 3 (the one mainloop body; the rungs differ in how the K/V
// stages get filled): this thread's O accumulator and online-softmax state, the wgmma descriptors
// of Q and of the stages, and the two halves of a key-tile step.
// Descriptors. Q: this warpgroup's 64 rows, k16 step kk (4 per 64-column sub-tile, 32 bytes
// apart). K: all BN rows of a stage. V: key rows 16 kk.. of a stage, MN-major, sub-tiles of 64
// head_dim columns BN * 128 bytes apart.
template <class T, int D, int BN>
struct WgmmaConsumer {
  static constexpr int kDT = D / 8;   // 8-wide accumulator tiles along head_dim
  static constexpr int kNT = BN / 8;  // 8-wide score tiles along the key tile
  static constexpr int kKVBytes = BN * D * 2;
  uint32_t q_smem, k_smem, v_smem;
  int warpgroup;  // 0 or 1: query rows 64 * warpgroup .. of the tile
  float o[kDT][4];
  float s[kNT][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // rows g, g + 8 of the warp

  __device__ __forceinline__ WgmmaConsumer(uint32_t q, uint32_t k, uint32_t v, int group)
      : q_smem(q), k_smem(k), v_smem(v), warpgroup(group) {
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < kNT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
  }
  __device__ __forceinline__ float (&o_flat())[kDT * 4] { return reinterpret_cast<float(&)[kDT * 4]>(o); }
  __device__ __forceinline__ float (&s_flat())[kNT * 4] { return reinterpret_cast<float(&)[kNT * 4]>(s); }

  __device__ __forceinline__ uint64_t q_desc(int kk) const {
    return make_desc(q_smem + (kk / 4) * kWgmmaRows * 128 + warpgroup * 64 * 128 + (kk % 4) * 32, 16, 1024);
  }
  __device__ __forceinline__ uint64_t k_desc(int stage, int kk) const {
    return make_desc(k_smem + stage * kKVBytes + (kk / 4) * BN * 128 + (kk % 4) * 32, 16, 1024);
  }
  // col0: the first head_dim column of the product (a multiple of 64; wgmma's N is at most 256,
  // and head_dim 256 runs as two N = 128 products, so that O stays in the accumulator layout of one).
  __device__ __forceinline__ uint64_t v_desc(int stage, int kk, int col0 = 0) const {
    return make_desc(v_smem + stage * kKVBytes + (col0 / 64) * BN * 128 + kk * 16 * 128, BN * 128, 1024);
  }

  // First half: S = Q K^T of the tile in `stage` (skipped for a tile without keys), then the wait
  // for it and for the previous tile's P V; after it, that tile's stage is no longer read.
  __device__ __forceinline__ void scores(int stage, int valid) {
    issue_scores(stage, valid);
    wait_products();
  }
  // scores' two parts (the ping-pong schedule issues between them: flash_tma_kernel.cuh).
  __device__ __forceinline__ void issue_scores(int stage, int valid) {
    if (valid > 0) issue_scores_now(stage);
  }
  // The same without the test (flash_tma_kernel.cuh's overlapped schedule, whose every tile has keys).
  __device__ __forceinline__ void issue_scores_now(int stage) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) Wgmma<T, BN>::template ss<0>(s_flat(), q_desc(kk), k_desc(stage, kk), kk > 0);
    wgmma_commit();
  }
  __device__ __forceinline__ void wait_products() {
    wgmma_wait<0>();
    fence_registers(s_flat());
    fence_registers(o_flat());
  }
  // The same first half with Q's A fragments in registers (the split-KV executor keeps its 64
  // stacked rows there for the whole key range: split_kv_tma_kernel.cuh).
  __device__ __forceinline__ void scores(int stage, int valid, const uint32_t (&q)[D / 16][4]) {
    if (valid > 0) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) Wgmma<T, BN>::template rs<0>(s_flat(), q[kk], k_desc(stage, kk), kk > 0);
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_registers(s_flat());
    fence_registers(o_flat());
  }
  // Second half: the mask hook on S (mask_hook(s): flash_kernel.cuh's mask_tile or
  // mask_tile_permuted; nothing without a mask), the online softmax of S, then O += P V of the
  // tile in `stage`, issued (async).
  __device__ __forceinline__ void accumulate(int stage, int valid, float scale_log2) {
    accumulate(stage, valid, scale_log2, [](float(&)[kNT][4]) {});
  }
  template <class MaskHook>
  __device__ __forceinline__ void accumulate(int stage, int valid, float scale_log2, MaskHook&& mask_hook) {
    uint32_t p_frag[kNT / 2][4];
    probabilities(valid, scale_log2, mask_hook, p_frag);
    multiply_v(stage, valid, p_frag);
  }
  // accumulate's two parts: the mask hook, the online softmax of S into P's A fragments and O
  // rescaled (O must not be in flight); then O += P V issued.
  template <class MaskHook>
  __device__ __forceinline__ void probabilities(int valid, float scale_log2, MaskHook&& mask_hook,
                                                uint32_t (&p_frag)[kNT / 2][4]) {
    if (valid > 0) {
      mask_hook(s);
      float alpha[2];
      softmax_scores<kNT>(s, valid, scale_log2, row_max, row_sum, alpha,
                          [&](int n, const float(&prob)[4]) { pack_probs<T, kNT>(n, prob, p_frag); });
      rescale<kDT>(o, alpha);
    }
  }
  // The overlapped schedule's pieces (flash_tma_kernel.cuh): the softmax of S into
  // probabilities in place (O's rescale deferred: alpha, 1 for a tile without keys), P packed
  // from them once the previous P V no longer reads p_frag, O rescaled before the next P V.
  template <class MaskHook>
  __device__ __forceinline__ void probabilities_in_place(int valid, float scale_log2, MaskHook&& mask_hook,
                                                         float (&alpha)[2]) {
    alpha[0] = alpha[1] = 1.0f;
    if (valid > 0) {
      mask_hook(s);
      softmax_scores<kNT>(s, valid, scale_log2, row_max, row_sum, alpha, [&](int n, const float(&prob)[4]) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = prob[e];
      });
    }
  }
  __device__ __forceinline__ void pack(int valid, uint32_t (&p_frag)[kNT / 2][4]) const {
    if (valid > 0) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) pack_probs<T, kNT>(n, s[n], p_frag);
    }
  }
  __device__ __forceinline__ void rescale_o(const float (&alpha)[2]) { rescale<kDT>(o, alpha); }
  // S complete (the one group committed after it, a P V, may still run).
  __device__ __forceinline__ void wait_scores() {
    wgmma_wait<1>();
    fence_registers(s_flat());
  }
  __device__ __forceinline__ void multiply_v(int stage, int valid, const uint32_t (&p_frag)[kNT / 2][4]) {
    if (valid > 0) multiply_v_now(stage, p_frag);
  }
  __device__ __forceinline__ void multiply_v_now(int stage, const uint32_t (&p_frag)[kNT / 2][4]) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      if constexpr (D <= 128) {
        Wgmma<T, D>::template rs<1>(o_flat(), p_frag[kk], v_desc(stage, kk), 1);
      } else {  // O's columns [128 j, 128 j + 128) are accumulator elements [64 j, 64 j + 64)
#pragma unroll
        for (int j = 0; j < D / 128; ++j) {
          Wgmma<T, 128>::template rs<1>(reinterpret_cast<float(&)[64]>(o_flat()[64 * j]), p_frag[kk],
                                         v_desc(stage, kk, 128 * j), 1);
        }
      }
    }
    wgmma_commit();
  }
  // After the last tile: its P V complete, then O / l and LSE at the original query positions.
  // OUTLINED: the epilogue as a call (store_tile_rows_outlined), not inlined.
  template <bool OUTLINED, int ROWS>
  __device__ __forceinline__ void store(const FlashParams& p, const QueryTile<ROWS>& tile, int warp) {
    wgmma_wait<0>();
    fence_registers(o_flat());
    if constexpr (OUTLINED) {
      store_tile_rows_outlined<T, kDT>(p, tile, tile.begin + warp * 16, o, row_max, row_sum);
    } else {
      store_tile_rows<T, kDT>(p, tile, tile.begin + warp * 16, o, row_max, row_sum);
    }
  }
};

// The CTA's mask state (MASKED kernels): this thread's rows' windows and the key range any row
// of the tile may see. `warp`: this thread's consumer warp (rows 16 warp .. of the tile; < 0 for
// a producer thread, which has no rows). Keys and queries in order: the range is the windows of the
// tile's first and last rows (windows do not decrease along the queries), and the keys every row
// sees (the core) are computed without the hook; with a permutation, every tile is visited and
// masked.
template <int ROWS>
struct CtaMask {
  RowWindows rows;
  int key_min = 0, key_max = 0x7fffffff;
  int core_lo = 0, core_hi = 0;  // tile_key_core; empty with a permutation
  const int32_t* key_perm = nullptr;  // of (b, h_kv); null: keys in order

  CtaMask() = default;  // no mask: every key tile, nothing masked
  __device__ __forceinline__ CtaMask(const FlashParams& p, const QueryTile<ROWS>& tile, int warp)
      : rows(windows(p, tile, warp)) {
    if (p.key_perm != nullptr) {
      key_perm = p.key_perm + tile.b * p.key_perm_stride[0] + tile.h_kv * p.key_perm_stride[1];
    } else if (tile.perm == nullptr) {
      tile_key_range(p, tile.begin, tile.end, tile.len_q, tile.len_kv, key_min, key_max);
      tile_key_core(p, tile.begin, tile.end, tile.len_q, tile.len_kv, core_lo, core_hi);
    }
  }
  // This thread's rows' windows (recomputed where a kernel wants them out of its registers).
  __device__ __forceinline__ static RowWindows windows(const FlashParams& p, const QueryTile<ROWS>& tile, int warp) {
    RowWindows w;
    const int g = threadIdx.x % 32 / 4;
#pragma unroll
    for (int r = 0; r < 2 && warp >= 0; ++r) {  // warp < 0: a producer thread, no rows
      const int64_t token = tile.token(p, tile.begin + warp * 16 + g + 8 * r);
      if (token >= 0) mask_window(p, token, tile.len_q, tile.len_kv, w.kb[r], w.ke[r]);
    }
    return w;
  }
  // Whether every row of the tile sees all of the key tile [begin, end) (CTA-uniform).
  __device__ __forceinline__ bool whole(int begin, int end) const { return begin >= core_lo && end <= core_hi; }
  // The hook on the S tile of key positions [begin, begin + valid), with the rows' windows w.
  template <int kNT>
  __device__ __forceinline__ void apply(const FlashParams& p, const RowWindows& w, float (&s)[kNT][4], int begin,
                                        int valid) const {
    if (key_perm != nullptr) {
      mask_tile_permuted<kNT>(s, w, key_perm, p.key_perm_stride[2], begin, valid);
    } else {
      mask_tile<kNT>(s, w, begin);
    }
  }
  template <int kNT>
  __device__ __forceinline__ void operator()(const FlashParams& p, float (&s)[kNT][4], int begin, int valid) const {
    apply<kNT>(p, rows, s, begin, valid);
  }
};

// STAGES: K/V tiles in shared memory, 2 or 3. With 2, the prefetch of tile t+1 waits for a second
// barrier per tile (both warpgroups done with P V of tile t-1); with 3 it is issued right after the
// first, into the stage of tile t-2.
// MASKED: the kernel applies the per-element mask (AttentionArgs::mask_kind); without it the mask
// code is not compiled in.
template <class T, int D, int BN, int STAGES, bool OUTLINED = false, bool MASKED = false>
__global__ void __launch_bounds__(256, 1) flash_wgmma_kernel(const FlashParams p) {
  static_assert(D % 64 == 0 && BN % 64 == 0 && BN <= 256, "128-byte swizzled tiles of 64 columns");
  static_assert(STAGES == 2 || STAGES == 3, "two or three K/V stages");
  using Shape = WgmmaShape<D, BN, STAGES>;
  constexpr int BM = Shape::kBM, THREADS = Shape::kThreads;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_smem = (smem_addr(smem) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t k_smem = q_smem + Shape::kQBytes;             // STAGES stages
  const uint32_t v_smem = k_smem + STAGES * Shape::kKVBytes;   // STAGES stages

  const QueryTile<BM> tile(p);
  if (tile.empty()) return;
  const int b = tile.b, h_kv = tile.h_kv;
  const CtaMask<BM> mask = MASKED ? CtaMask<BM>(p, tile, threadIdx.x / 32) : CtaMask<BM>{};
  KeyTiles<BN> tiles(p, b, tile.h, tile.qb, tile.len_kv, mask.key_min, mask.key_max);
  const int num_tiles = tiles.num_tiles;

  const int32_t* perm_kv = p.perm_kv ? p.perm_kv + b * p.perm_kv_stride[0] + h_kv * p.perm_kv_stride[1] : nullptr;
  const uint16_t* k_base = tile.kv_base(p.k, p.k_stride);
  const uint16_t* v_base = tile.kv_base(p.v, p.v_stride);
  using KVCopy = TileCopy<D, BN, THREADS, Swizzle128<BN>>;
  auto load_kv = [&](int begin, int end, int stage) {
    int64_t token[KVCopy::kRows];
    gather_tokens<KVCopy>(token, begin, end, perm_kv, p.perm_kv_stride[2], tile.len_kv);
    KVCopy::copy(k_smem + stage * Shape::kKVBytes, k_base, p.k_stride[2], p.aligned_loads, token);
    KVCopy::copy(v_smem + stage * Shape::kKVBytes, v_base, p.v_stride[2], p.aligned_loads, token);
  };

  // Prologue: Q and the first key tile in one copy group.
  tile.template load<TileCopy<D, BM, THREADS, Swizzle128<BM>>>(p, q_smem);
  int cur_begin = 0, cur_end = 0;  // key range of tile t
  if (num_tiles > 0) {
    tiles.next(p, cur_begin, cur_end);
    load_kv(cur_begin, cur_end, 0);
  }
  cp_async_commit();

  WgmmaConsumer<T, D, BN> consumer(q_smem, k_smem, v_smem, threadIdx.x / 128);
  int stage = 0;  // of tile t
  int next_begin = 0, next_end = 0;
  auto prefetch = [&](int t) {  // tile t + 1 into the next stage
    if (t + 1 < num_tiles) {
      tiles.next(p, next_begin, next_end);
      load_kv(next_begin, next_end, stage + 1 == STAGES ? 0 : stage + 1);
    }
    cp_async_commit();
  };
  for (int t = 0; t < num_tiles; ++t) {
    const int valid = cur_end - cur_begin;  // CTA-uniform
    cp_async_wait<0>();  // tile t (and Q) landed
    fence_proxy_async();
    __syncthreads();  // ... for every thread; and every warpgroup waited for P V of tile t - 2
    if constexpr (STAGES == 3) prefetch(t);
    consumer.scores(stage, valid);  // S_t; P V_{t-1} complete
    if constexpr (STAGES == 2) {
      __syncthreads();  // both warpgroups are done with the stage of tile t - 1
      prefetch(t);
    }
    if constexpr (MASKED) {
      consumer.accumulate(stage, valid, p.scale_log2,
                          [&](float(&s)[BN / 8][4]) { mask(p, s, cur_begin, valid); });
    } else {
      consumer.accumulate(stage, valid, p.scale_log2);
    }
    cur_begin = next_begin, cur_end = next_end;
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  consumer.template store<OUTLINED>(p, tile, threadIdx.x / 32);
}

}  // namespace sparsa::cuda::detail
