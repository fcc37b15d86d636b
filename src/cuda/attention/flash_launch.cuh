// Internal: the flash executor's launches (rung 3 with its consumer schedules, key tiles and
// persistent grid; rung 2 otherwise), shared by attention.cu, which checks a call and picks the
// executor, and the translation units that instantiate them (flash_launch_d*.cu: one a head_dim,
// head_dim 128's masked kernels in their own), so that nvcc compiles the many kernels of the
// ladder in parallel instead of in one file.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "core/backends.h"
#include "cuda/attention/flash_tma_kernel.cuh"
#include "cuda/attention/flash_wgmma_kernel.cuh"
#include "cuda/attention/route.h"
#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"

namespace sparsa::cuda::flash {

using detail::FlashParams;

// The flash executor: rung 3 (flash_tma_kernel.cuh: a TMA producer warp feeding two wgmma consumer
// warpgroups) whenever K and V are read in order, rung 2 (flash_wgmma_kernel.cuh: the same consumers
// copying with cp.async) for in-kernel key permutations and unaligned inputs; bench/RESULTS.md has
// the ladder. 128-row query tiles (a 128-token query block is exactly one CTA) and key tiles of 128
// tokens (64 when the plan's key blocks are at most 64 tokens, so a small block does not pay for a
// half-empty tile).
constexpr int kRows = detail::WgmmaShape<64, 64, 2>::kBM;
constexpr int kStages = 3;  // K/V stages (flash_ladder: 2e over 2a)

// The switches of route.h (process-wide) and what the last launch on this thread took; defined in
// attention.cu.
extern std::atomic<bool> g_use_tma;
extern std::atomic<detail::FlashSchedule> g_schedule;
extern std::atomic<int> g_dense_key_tile;  // rung 3's dense key tile at head_dim 128 without a mask
extern std::atomic<bool> g_persistent;
extern thread_local bool g_last_tma;
extern thread_local detail::FlashSchedule g_last_schedule;
extern thread_local int g_last_key_tile;
extern thread_local bool g_last_persistent;

// The shared-memory limit of a kernel raised to what it launches with (device_facts.h); the
// caller has made `device` current.
template <auto kernel>
Status allow_smem(int device, size_t smem_bytes) {
  return detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem_bytes);
}

// K or V as a [batch, heads_kv, len_kv, D] tensor map read in boxes of [BN rows][64 columns] with
// the 128-byte swizzle (attention.cu); false when the driver refuses the layout.
bool encode_kv_map(CUtensorMap* map, const void* base, const int64_t (&stride)[3], const detail::AttentionArgs& p,
                   int d, int bn, bool bf16, int64_t rows = -1);

// Rung 3 with one of its consumer schedules. The persistent kernels exist for the pingpong and
// overlap schedules at head_dim 128 without a mask (route.h set_flash_persistent, off: measured
// 5-15% slower than the per-item grid, bench/RESULTS.md); a call that asks for one otherwise runs
// the grid of one CTA per work item. g_last_persistent says which ran.
template <class T, int D, int BN, int STAGES, bool MASKED, int SCHEDULE>
Status launch_tma(dim3 grid, const FlashParams& p, const detail::TmaMaps& maps, int device, cudaStream_t stream) {
  using Shape = detail::TmaShape<D, BN, STAGES>;
  constexpr bool kCanPersist =
      D == 128 && !MASKED && (SCHEDULE == detail::kSchedulePingpong || SCHEDULE == detail::kScheduleOverlap);
  g_last_persistent = false;
  if constexpr (kCanPersist) {
    if (g_persistent.load() && p.cu_seqlens_kv == nullptr) {
      constexpr auto kernel = detail::flash_tma_kernel<T, D, BN, STAGES, MASKED, SCHEDULE, true>;
      SPARSA_RETURN_IF_ERROR(allow_smem<kernel>(device, Shape::kSmemBytes));
      int sms = 1;
      SPARSA_RETURN_IF_ERROR(detail::sm_count(device, &sms));
      const int64_t items = static_cast<int64_t>(grid.x) * grid.y * grid.z;
      const dim3 one_wave(static_cast<unsigned>(std::min<int64_t>(items, sms)));  // one CTA per SM fits
      kernel<<<one_wave, Shape::kThreads, Shape::kSmemBytes, stream>>>(p, maps);
      g_last_persistent = true;
      return {};
    }
  }
  constexpr auto kernel = detail::flash_tma_kernel<T, D, BN, STAGES, MASKED, SCHEDULE>;
  SPARSA_RETURN_IF_ERROR(allow_smem<kernel>(device, Shape::kSmemBytes));
  kernel<<<grid, Shape::kThreads, Shape::kSmemBytes, stream>>>(p, maps);
  return {};
}

// Rung 3 (flash_tma_kernel.cuh) when K and V are read in order (no perm_kv) through tensor maps
// the driver accepts (a variable-length batch too, its rows within int coordinates); *launched
// says whether it was. MASKED: the kernels with the per-element mask compiled in (p.mask_kind is
// not none).
template <class T, int D, int BN, bool MASKED>
Status launch_rung3(const FlashParams& p, int device, cudaStream_t stream, bool* launched) {
  // head_dim 256: Q alone is 64 KB, a K+V stage 64 KB at 64-key tiles, so two stages; 176-key
  // tiles: 44 KB a K or V stage, so two.
  constexpr int kDStages = D == 256 || BN > 128 ? 2 : kStages;
  const dim3 grid(static_cast<unsigned>(p.num_q_blocks) * p.tiles_per_q_block, p.heads_q, p.batch);
  detail::TmaMaps maps;
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  const int64_t varlen_rows = p.cu_seqlens_kv != nullptr ? p.kv_rows : -1;
  const bool rows_fit = varlen_rows < 0 || (varlen_rows > 0 && varlen_rows <= 0x7fffffff - BN);
  g_last_tma = g_use_tma.load() && p.perm_kv == nullptr && p.aligned_loads && rows_fit &&
               encode_kv_map(&maps.k, p.k, p.k_stride, p, D, BN, bf16, varlen_rows) &&
               encode_kv_map(&maps.v, p.v, p.v_stride, p, D, BN, bf16, varlen_rows);
  if (g_last_tma) {
    g_last_schedule = varlen_rows < 0 ? g_schedule.load() : detail::FlashSchedule::plain;
    switch (g_last_schedule) {
      case detail::FlashSchedule::plain:
        SPARSA_RETURN_IF_ERROR((launch_tma<T, D, BN, kDStages, MASKED, detail::kSchedulePlain>(grid, p, maps, device,
                                                                                               stream)));
        break;
      case detail::FlashSchedule::pingpong:
        SPARSA_RETURN_IF_ERROR((launch_tma<T, D, BN, kDStages, MASKED, detail::kSchedulePingpong>(grid, p, maps,
                                                                                                  device, stream)));
        break;
      case detail::FlashSchedule::overlap:
        SPARSA_RETURN_IF_ERROR((launch_tma<T, D, BN, kDStages, MASKED, detail::kScheduleOverlap>(grid, p, maps,
                                                                                                 device, stream)));
        break;
      case detail::FlashSchedule::late:
        SPARSA_RETURN_IF_ERROR((launch_tma<T, D, BN, kDStages, MASKED, detail::kScheduleLate>(grid, p, maps, device,
                                                                                              stream)));
        break;
    }
  }
  *launched = g_last_tma;
  if (g_last_tma) g_last_key_tile = BN;
  return {};
}

// Rung 3 when it can read K and V (launch_rung3), rung 2 (flash_wgmma_kernel.cuh) otherwise.
template <class T, int D, int BN, bool MASKED>
Status launch(const FlashParams& p, int device, cudaStream_t stream) {
  bool launched = false;
  SPARSA_RETURN_IF_ERROR((launch_rung3<T, D, BN, MASKED>(p, device, stream, &launched)));
  if (!launched) {
    constexpr int kDStages = D == 256 ? 2 : kStages;
    using Shape = detail::WgmmaShape<D, BN, kDStages>;
    constexpr auto kernel = detail::flash_wgmma_kernel<T, D, BN, kDStages, false, MASKED>;
    const dim3 grid(static_cast<unsigned>(p.num_q_blocks) * p.tiles_per_q_block, p.heads_q, p.batch);
    SPARSA_RETURN_IF_ERROR(allow_smem<kernel>(device, Shape::kSmemBytes));
    kernel<<<grid, Shape::kThreads, Shape::kSmemBytes, stream>>>(p);
    g_last_key_tile = BN;
  }
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

template <class T, int D>
Status launch_tiles(FlashParams p, const BlockIndex* index, int device, cudaStream_t stream) {
  auto ceil_div = [](int64_t x, int64_t y) { return static_cast<int>((x + y - 1) / y); };
  const int key_tile = D == 256 || (index != nullptr && index->block_kv <= 64) ? 64 : 128;
  if (index == nullptr) {  // dense: the same mainloop over every key tile
    p.block_q = kRows;
    p.num_q_blocks = ceil_div(p.len_q, kRows);
    auto key_tiles = [&](int tile) {
      p.block_kv = tile;
      p.num_kv_blocks = ceil_div(p.len_kv, tile);
    };
    // Causal and block-causal: a query tile's keys grow with its position; the longest first.
    p.reverse_tiles = p.mask_kind == detail::kMaskCausal || p.mask_kind == detail::kMaskBlockCausal;
    if constexpr (D == 128) {  // 176-key tiles (route.h): rung 3 only, no mask, no varlen
      if (g_dense_key_tile.load() == 176 && p.mask_kind == detail::kMaskNone && p.cu_seqlens_kv == nullptr) {
        key_tiles(176);
        bool launched = false;
        SPARSA_RETURN_IF_ERROR((launch_rung3<T, D, 176, false>(p, device, stream, &launched)));
        if (launched) {
          SPARSA_CUDA_CHECK_LAUNCH();
          return {};
        }
      }
    }
    key_tiles(key_tile);
  } else {
    p.tiles_per_q_block = ceil_div(p.block_q, kRows);
    p.chunks_per_kv_block = ceil_div(p.block_kv, key_tile);
  }
  if (static_cast<int64_t>(p.num_q_blocks) * p.tiles_per_q_block > 0x7fffffff) {
    return invalid_argument("index.block_q: too many query tiles for one launch");
  }
  if constexpr (D == 256) {  // 64-key tiles only (shared memory)
    return p.mask_kind != detail::kMaskNone ? launch<T, D, 64, true>(p, device, stream)
                                            : launch<T, D, 64, false>(p, device, stream);
  } else {
    if (p.mask_kind != detail::kMaskNone) {
      return key_tile == 64 ? launch<T, D, 64, true>(p, device, stream) : launch<T, D, 128, true>(p, device, stream);
    }
    return key_tile == 64 ? launch<T, D, 64, false>(p, device, stream) : launch<T, D, 128, false>(p, device, stream);
  }
}

// Explicit instantiations: launch_tiles per (dtype, head_dim) in flash_launch_d{64,128,256}.cu, and
// head_dim 128's masked launches in flash_launch_d128_masked.cu.
#define SPARSA_FLASH_LAUNCH_TILES(EXTERN, T, D) \
  EXTERN template Status launch_tiles<T, D>(FlashParams, const BlockIndex*, int, cudaStream_t);
#define SPARSA_FLASH_LAUNCH_MASKED(EXTERN, T, D, BN) \
  EXTERN template Status launch<T, D, BN, true>(const FlashParams&, int, cudaStream_t);
SPARSA_FLASH_LAUNCH_TILES(extern, __nv_bfloat16, 64)
SPARSA_FLASH_LAUNCH_TILES(extern, __half, 64)
SPARSA_FLASH_LAUNCH_TILES(extern, __nv_bfloat16, 128)
SPARSA_FLASH_LAUNCH_TILES(extern, __half, 128)
SPARSA_FLASH_LAUNCH_TILES(extern, __nv_bfloat16, 256)
SPARSA_FLASH_LAUNCH_TILES(extern, __half, 256)
SPARSA_FLASH_LAUNCH_MASKED(extern, __nv_bfloat16, 128, 64)
SPARSA_FLASH_LAUNCH_MASKED(extern, __half, 128, 64)
SPARSA_FLASH_LAUNCH_MASKED(extern, __nv_bfloat16, 128, 128)
SPARSA_FLASH_LAUNCH_MASKED(extern, __half, 128, 128)

}  // namespace sparsa::cuda::flash
