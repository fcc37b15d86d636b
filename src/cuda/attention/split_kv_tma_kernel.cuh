// Internal: the split-KV prefix executor on Hopper's wgmma, fed by TMA (rung 2 of the split-KV
// executor; rung 1 is split_kv_kernel.cuh's mma.sync kernel, which also keeps inputs TMA cannot
// read: unaligned bases or strides).
//
// Why a second kernel: rung 1 streams K+V at 2.5-3.0 TB/s at 32K-64K keys, not the ~4 TB/s HBM
// gives. Nsight Compute on one call at the block-diffusion shape (32K keys, 264 CTAs of 4 warps, two
// per SM) showed DRAM at 52% of peak and the schedulers issuing in only 35% of cycles, with 2 warps
// each: the warps are latency-bound on their own instruction stream, not waiting for memory. Per
// 64-key tile every warp issues 16 cp.async, reads all of K and V from shared memory through
// ldmatrix (4 warps: each byte read 4 times) and runs 128 dependent mma.sync. Here:
//  - one warpgroup per CTA computes the same 64 stacked rows (GQA packing as in rung 1) with
//    wgmma: S = Q K^T (m64n64k16; A = Q from registers, loaded once from global memory, so no Q
//    tile takes shared memory) and O += P V (m64n{D}k16; A = P from registers); the tensor cores
//    read each K/V byte from shared memory once per CTA, asynchronously;
//  - one thread issues TMA tensor copies (two 64-column boxes per K or V tile) into a STAGES-deep
//    ring of mbarrier-tracked stages: STAGES - 1 tiles in flight while one is computed, and no
//    copy instructions in the other 127 threads.
// Per tile t: wait for `full[t]`; S_t (async) and wait for it and for P V_{t-1}; a CTA barrier
// (every warp is done with the stage of tile t-1); thread 0 refills that stage with tile
// t + STAGES - 1; softmax (flash_kernel.cuh's); P V_t issued, overlapping the next tile's wait.
// The end (partials, fused merge, or the direct write with one split) is split_kv_finish, shared
// with rung 1; so are the split sizes and the workspace.
#pragma once

#include <cstdint>

#include "cuda/attention/flash_tma_kernel.cuh"
#include "cuda/attention/split_kv_kernel.cuh"

namespace sparsa::cuda::detail {

template <int D, int BN, int STAGES>
struct SplitKvTmaShape {
  static constexpr int kThreads = 128, kBM = 64;  // one warpgroup, 64 stacked rows
  static constexpr int kKVBytes = BN * D * 2;     // one stage of K (or of V)
  // K stages, V stages, the `full` barriers, and slack to align the base to 1024 bytes.
  static constexpr int kSmemBytes = 2 * STAGES * kKVBytes + 8 * STAGES + 1024;
};

// MASKED: the per-element mask compiled in (split_kv_kernel.cuh's SplitKvMask).
template <class T, int D, int BN, int STAGES, bool MASKED = false>
__global__ void __launch_bounds__(128) split_kv_tma_kernel(const SplitKvParams p, const __grid_constant__ TmaMaps maps) {
  static_assert(D % 64 == 0 && BN % 64 == 0 && BN <= 128, "128-byte swizzled tiles of 64 columns");
  static_assert(STAGES >= 2, "at least one tile in flight while one is computed");
  using Shape = SplitKvTmaShape<D, BN, STAGES>;
  constexpr int BM = Shape::kBM, kKVBytes = Shape::kKVBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t k_smem = (smem_addr(smem) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t v_smem = k_smem + STAGES * kKVBytes;
  const uint32_t bars = v_smem + STAGES * kKVBytes;  // full[STAGES]
  auto full = [&](int stage) { return bars + 8 * stage; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int row0 = blockIdx.x * BM, split = blockIdx.y;
  const int b = blockIdx.z / p.heads_kv, h_kv = blockIdx.z % p.heads_kv;
  int tile_begin = static_cast<int>(static_cast<int64_t>(split) * p.num_kv_tiles / p.num_splits);
  int num_tiles = static_cast<int>(static_cast<int64_t>(split + 1) * p.num_kv_tiles / p.num_splits) - tile_begin;
  const SplitKvMask<BN> mask = MASKED ? SplitKvMask<BN>(p, row0, warp, tile_begin, num_tiles) : SplitKvMask<BN>{};

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(full(s), 1);  // the issuing thread's arrive.expect_tx
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  grid_dependency_wait();  // before any global memory access: the previous kernel has completed

  auto issue = [&](int t) {  // tile t of this split into stage t % STAGES (thread 0)
    const int stage = t % STAGES, key = (tile_begin + t) * BN;
    mbar_expect_tx(full(stage), 2 * kKVBytes);
#pragma unroll
    for (int sub = 0; sub < D / 64; ++sub) {
      const uint32_t offset = stage * kKVBytes + sub * BN * 128;
      tma_load_4d(k_smem + offset, &maps.k, sub * 64, key, h_kv, b, full(stage));
      tma_load_4d(v_smem + offset, &maps.v, sub * 64, key, h_kv, b, full(stage));
    }
  };

  if (threadIdx.x == 0) {
    for (int t = 0; t < STAGES - 1 && t < num_tiles; ++t) issue(t);
  }

  // Q: this warp's 16 stacked rows as wgmma A fragments (mma.m16n8k16's A layout per k16 step:
  // rows g and g + 8, columns 2c and 2c + 8 of the step); rows past p.rows are zeros.
  uint32_t q[D / 16][4];
  {
    const uint32_t* src[2] = {nullptr, nullptr};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + warp * 16 + g + 8 * r;
      if (row < p.rows) {
        const int h = h_kv * p.group + row / p.len_q, i = row % p.len_q;
        src[r] = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.q) + b * p.q_stride[0] +
                                                   h * p.q_stride[1] + i * p.q_stride[2]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t* s = src[e % 2];
        q[kk][e] = s != nullptr ? __ldg(s + kk * 8 + (e / 2) * 4 + c) : 0u;
      }
    }
  }

  WgmmaConsumer<T, D, BN> consumer(0, k_smem, v_smem, 0);  // Q is in registers: no Q descriptor
  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % STAGES;
    const int valid = min(BN, p.len_kv - (tile_begin + t) * BN);  // rows past len_kv arrive as zeros
    mbar_wait(full(stage), (t / STAGES) & 1);
    consumer.scores(stage, valid, q);  // S_t; P V_{t-1} complete
    __syncthreads();                   // every warp is done with the stage of tile t - 1
    if (threadIdx.x == 0 && t + STAGES - 1 < num_tiles) issue(t + STAGES - 1);
    if constexpr (MASKED) {
      consumer.accumulate(stage, valid, p.scale_log2,
                          [&](float(&s)[BN / 8][4]) { mask_tile<BN / 8>(s, mask.rows, (tile_begin + t) * BN); });
    } else {
      consumer.accumulate(stage, valid, p.scale_log2);
    }
  }
  wgmma_wait<0>();
  fence_registers(consumer.o_flat());
  launch_dependents();  // K/V streamed: the next kernel in the stream may start launching
  __syncthreads();      // every warp's last P V has read its stage: the ring is free for the merge
  split_kv_finish<T, D>(p, smem, consumer.o, consumer.row_max, consumer.row_sum, row0, split, b, h_kv);
}

}  // namespace sparsa::cuda::detail
