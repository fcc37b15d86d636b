// The cuda backend of dense and block-sparse attention: checks that every pointer lives on
// the device the tensors name, fills FlashParams and launches the flash executor (the one
// dispatch place for dtype and head_dim).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backends.h"
#include "cuda/attention/flash_tma_kernel.cuh"
#include "cuda/attention/flash_wgmma_kernel.cuh"
#include "cuda/attention/gather_kernel.cuh"
#include "cuda/attention/index_check.h"
#include "cuda/attention/route.h"
#include "cuda/attention/split_kv_kernel.cuh"
#include "cuda/attention/split_kv_tma_kernel.cuh"
#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/common/workspace.h"

namespace sparsa::cuda {

namespace {

using detail::FlashParams;
using detail::SplitKvParams;

// The flash executor: rung 3 (flash_tma_kernel.cuh: a TMA producer warp feeding two wgmma consumer
// warpgroups) whenever K and V are read in order, rung 2 (flash_wgmma_kernel.cuh: the same consumers
// copying with cp.async) for in-kernel key permutations and unaligned inputs; bench/RESULTS.md has
// the ladder. 128-row query tiles (a 128-token query block is exactly one CTA) and key tiles of 128
// tokens (64 when the plan's key blocks are at most 64 tokens, so a small block does not pay for a
// half-empty tile).
constexpr int kRows = detail::WgmmaShape<64, 64, 2>::kBM;
constexpr int kStages = 3;  // K/V stages (flash_ladder: 2e over 2a)
std::atomic<bool> g_use_tma{true};  // route.h: a test and benchmark switch
std::atomic<detail::FlashSchedule> g_schedule{detail::FlashSchedule::overlap};  // route.h: rung 3's schedule
// route.h: the key tile of rung 3's dense calls at head_dim 128 without a mask (128 or 176).
std::atomic<int> g_dense_key_tile{128};

using detail::check_pointer;

// The shared-memory limit of a kernel raised to what it launches with (device_facts.h); the
// caller has made `device` current.
template <auto kernel>
Status allow_smem(int device, size_t smem_bytes) {
  return detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem_bytes);
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against the driver
// library); null when the driver does not have it.
using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;
EncodeTiled tensor_map_encoder() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// K or V as a [batch, heads_kv, len_kv, D] tensor map read in boxes of [BN rows][64 columns] with
// the 128-byte swizzle; false when the driver refuses the layout (the cp.async kernel takes it).
// A variable-length batch (flash executor only) passes rows = all of K's rows and batch = 1: one
// [1, heads_kv, rows, D] tensor, a sequence's tile at its first row plus the tile's (the kernel
// adds kv_row0); its batch stride (0) is never stepped, so any valid one stands in.
bool encode_kv_map(CUtensorMap* map, const void* base, const int64_t (&stride)[3], const detail::AttentionArgs& p,
                   int d, int bn, bool bf16, int64_t rows = -1) {
  const EncodeTiled encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const bool varlen = rows >= 0;
  if (!varlen) rows = p.len_kv;
  const int64_t batch_stride = varlen ? stride[2] : stride[0];
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(p.heads_kv), static_cast<cuuint64_t>(varlen ? 1 : p.batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(stride[2]) * 2, static_cast<cuuint64_t>(stride[1]) * 2,
                                 static_cast<cuuint64_t>(batch_stride) * 2};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(bn), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

thread_local bool g_last_tma = false;
thread_local detail::FlashSchedule g_last_schedule = detail::FlashSchedule::plain;
thread_local int g_last_key_tile = 0;  // of the last flash launch (route.h)

// Rung 3 with one of its consumer schedules.
template <class T, int D, int BN, int STAGES, bool MASKED, int SCHEDULE>
Status launch_tma(dim3 grid, const FlashParams& p, const detail::TmaMaps& maps, int device, cudaStream_t stream) {
  using Shape = detail::TmaShape<D, BN, STAGES>;
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

Status launch_flash(const FlashParams& p, DType dtype, int head_dim, const BlockIndex* index, int device,
                    cudaStream_t stream) {
  const bool bf16 = dtype == DType::bf16;
  if (head_dim == 64) {
    return bf16 ? launch_tiles<__nv_bfloat16, 64>(p, index, device, stream)
                : launch_tiles<__half, 64>(p, index, device, stream);
  }
  if (head_dim == 256) {
    return bf16 ? launch_tiles<__nv_bfloat16, 256>(p, index, device, stream)
                : launch_tiles<__half, 256>(p, index, device, stream);
  }
  return bf16 ? launch_tiles<__nv_bfloat16, 128>(p, index, device, stream)
              : launch_tiles<__half, 128>(p, index, device, stream);
}

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// ---- split-KV prefix executor (split_kv_kernel.cuh) ----
// Dense calls with at most kSplitKvMaxQueries queries and at least kSplitKvMinKeys keys take it:
// there the flash executor's grid is one CTA per query head and its 128-row tiles are mostly empty.
constexpr int kSplitKvMaxQueries = 64, kSplitKvMinKeys = 512;
constexpr int kSplitKvKeyTile = 64, kSplitKvStages = 3;
// Rung 2's K/V stages. Measured at the block-diffusion shape (bench/RESULTS.md): 4 stages (128 KB,
// one CTA per SM, 16 splits) 43.0 / 75.9 us at 32K / 64K keys; 3 stages (two CTAs per SM, 33
// splits) 44.8 / 77.1; 2 stages 44.4-44.5 / 77.4-77.7 (two or three CTAs per SM).
constexpr int kSplitKvTmaStages = 4;
constexpr int kSplitKvMinTilesPerSplit = 8;  // 512 keys
constexpr int kMaxCtasPerSm = 32;  // Hopper's limit: bounds the merge groups of one wave
using detail::kSplitKvMaxSplits;

// How many splits. The kernels stream K+V once (GQA-packed), so the target is HBM: 4.8 TB/s peak
// on the H200, about 4.2 TB/s for a plain device copy. By Little's law that needs ~4 TB/s x ~1-2 us
// of loaded latency = 4-8 MB in flight over the chip, 30-60 KB per SM of its 132. Rung 2 at d 128
// (4 stages of 32 KB K/V, 128 KB of shared memory, one CTA per SM) keeps three tiles, 96 KB, in
// flight per SM; rung 1 (Q 16 KB + 3 stages, 112 KB, two CTAs per SM) two per CTA, 128 KB per SM.
// Either way more CTAs would only add partials to merge. So the grid is exactly one wave of
// resident CTAs: splits = wave / (m-tiles x batch x kv heads), where wave = SMs x CTAs per SM
// (from the occupancy query). At the block-diffusion shape (8 kv heads, one m-tile) rung 2 gets 16
// splits, 128 CTAs (4 SMs idle: bandwidth, not SMs, is the limit), each 32 key tiles (2048 keys,
// 1 MB of K+V) at 32K keys; rung 1 gets 33 splits, 264 CTAs. Never more than a wave: the CTAs of a
// merge group wait for each other (bounded, split_kv_kernel.cuh), and a second wave would leave the
// chip idle during its own tail anyway.
// At least kSplitKvMinTilesPerSplit tiles (512 keys, 256 KB of K+V at d 128) per split keep the
// per-CTA fixed work (16 KB of Q, the 32 KB partial written and read back once) small beside it.
int64_t split_count(int64_t wave, int64_t ctas_per_split, int64_t num_kv_tiles) {
  const int64_t splits = std::min<int64_t>(
      {wave / ctas_per_split, num_kv_tiles / kSplitKvMinTilesPerSplit, int64_t{kSplitKvMaxSplits}});
  return std::max<int64_t>(splits, 1);
}

// Grow-only workspaces per (device, stream) (common/workspace.h): the counters of every merge
// group one wave can have (zeroed when allocated; each call leaves them zero), then the partials;
// and K, V gathered in a plan's key order. The calls of one stream run in order, so a state is
// never used by two calls' kernels at once; its mutex keeps two host threads apart until their
// kernels are queued.
struct StreamState {
  std::mutex mutex;
  int sms = 0;
  detail::StreamBuffer workspace;
  detail::StreamBuffer gathered;  // K and V in a plan's key order (gather_kernel.cuh)
};
detail::PerStream<StreamState> g_states;
// Programmatic dependent launch is asked for until a launch with it fails (then plain launches).
std::atomic<bool> g_split_kv_pdl{true};
std::atomic<unsigned long long> g_merge_wait_ns{detail::kMergeWaitNs};  // route.h: a test hook

size_t counter_bytes(int sms) { return static_cast<size_t>(sms) * kMaxCtasPerSm * sizeof(detail::SplitKvCounters); }

// The route and split count of the last call on this thread (route.h).
thread_local detail::Route g_last_route = detail::Route::none;
thread_local int g_last_splits = 0;
thread_local bool g_last_split_kv_tma = false;
std::atomic<bool> g_use_split_kv_tma{true};  // route.h: a test and benchmark switch

// Sizes the splits and the workspace for `kernel` (rung 1 or 2: the same 64-row m-tiles,
// partials and counters) and launches it with programmatic dependent launch when allowed.
template <auto kernel, class Shape, class... Extra>
Status run_split_kv(SplitKvParams p, StreamState& state, int device, cudaStream_t stream, const Extra&... extra) {
  int ctas_per_sm = 1;
  SPARSA_RETURN_IF_ERROR(detail::resident_ctas(reinterpret_cast<const void*>(kernel), device, Shape::kThreads,
                                               Shape::kSmemBytes, &ctas_per_sm));
  ctas_per_sm = std::min(ctas_per_sm, kMaxCtasPerSm);
  auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  const int64_t m_tiles = ceil_div(p.rows, Shape::kBM);
  const int64_t merge_groups = m_tiles * p.batch * p.heads_kv;  // CTAs of one split
  const int64_t wave = static_cast<int64_t>(state.sms) * ctas_per_sm;
  p.num_splits = static_cast<int>(split_count(wave, merge_groups, p.num_kv_tiles));
  if (p.num_splits > 1) {
    if (merge_groups > static_cast<int64_t>(state.sms) * kMaxCtasPerSm) {
      return {StatusCode::internal, "split-KV: " + std::to_string(merge_groups) + " merge groups exceed the counters"};
    }
    const size_t counters = counter_bytes(state.sms);
    const size_t partials = static_cast<size_t>(merge_groups) * Shape::kBM * p.num_splits;  // rows
    const size_t d = static_cast<size_t>(p.head_dim);
    const size_t bytes = counters + partials * d * sizeof(float) + partials * sizeof(float);
    bool grew = false;
    SPARSA_RETURN_IF_ERROR(state.workspace.reserve(device, stream, bytes, &grew));
    // The only zeroing (calls leave them zero); a failure leaves the buffer to be zeroed next time.
    if (grew) {
      const cudaError_t err = cudaMemsetAsync(state.workspace.data(), 0, counters, stream);
      if (err != cudaSuccess) {
        detail::stream_free(device, state.workspace.data(), stream);
        state.workspace = {};
        SPARSA_CUDA_CHECK(err);
      }
    }
    // Counters first (a fixed region, so a call with another shape finds them zero), then the
    // partial O rows (128-byte aligned: the kernel drops them from L2 by whole lines), then the LSEs.
    p.counters = static_cast<detail::SplitKvCounters*>(state.workspace.data());
    p.part_o = reinterpret_cast<float*>(static_cast<char*>(state.workspace.data()) + counters);
    p.part_lse = p.part_o + partials * d;
  }
  p.merge_wait_ns = g_merge_wait_ns.load(std::memory_order_relaxed);
  g_last_splits = p.num_splits;

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(m_tiles), static_cast<unsigned>(p.num_splits),
                        static_cast<unsigned>(p.batch * p.heads_kv));
  config.blockDim = dim3(Shape::kThreads);
  config.dynamicSmemBytes = Shape::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = g_split_kv_pdl.load(std::memory_order_relaxed) ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, p, extra...);
  if (err != cudaSuccess && config.numAttrs == 1) {  // no dependent launch here: plain launches from now on
    cudaGetLastError();
    g_split_kv_pdl.store(false);
    config.numAttrs = 0;
    err = cudaLaunchKernelEx(&config, kernel, p, extra...);
  }
  SPARSA_CUDA_CHECK(err);
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

// Rung 2 (split_kv_tma_kernel.cuh: wgmma fed by TMA) when the driver accepts tensor maps of K and
// V (16-byte aligned bases and strides); rung 1 (split_kv_kernel.cuh: mma.sync, cp.async) otherwise.
// MASKED: the kernels with the per-element mask compiled in.
template <class T, int D, bool MASKED>
Status launch_split_kv(SplitKvParams p, int device, cudaStream_t stream) {
  StreamState& state = g_states.at(device, stream);
  std::lock_guard<std::mutex> lock(state.mutex);
  SPARSA_RETURN_IF_ERROR(detail::sm_count(device, &state.sms));
  p.head_dim = D;
  detail::TmaMaps maps;
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  g_last_split_kv_tma = g_use_split_kv_tma.load() && p.aligned_loads &&
                        encode_kv_map(&maps.k, p.k, p.k_stride, p, D, kSplitKvKeyTile, bf16) &&
                        encode_kv_map(&maps.v, p.v, p.v_stride, p, D, kSplitKvKeyTile, bf16);
  if (g_last_split_kv_tma) {
    using Shape = detail::SplitKvTmaShape<D, kSplitKvKeyTile, kSplitKvTmaStages>;
    constexpr auto kernel = detail::split_kv_tma_kernel<T, D, kSplitKvKeyTile, kSplitKvTmaStages, MASKED>;
    return run_split_kv<kernel, Shape>(p, state, device, stream, maps);
  }
  using Shape = detail::SplitKvShape<D, kSplitKvKeyTile, kSplitKvStages>;
  constexpr auto kernel = detail::split_kv_kernel<T, D, kSplitKvKeyTile, kSplitKvStages, MASKED>;
  return run_split_kv<kernel, Shape>(p, state, device, stream);
}

bool use_split_kv(const sparsa::detail::AttentionParams& a) {
  return a.index == nullptr && !a.varlen() && a.head_dim <= 128 && a.len_q >= 1 && a.len_q <= kSplitKvMaxQueries &&
         a.len_kv >= kSplitKvMinKeys && a.batch * a.heads_kv <= 65535;
}

Status split_kv(const FlashParams& f, DType dtype, int head_dim, int device, cudaStream_t stream) {
  SplitKvParams p;
  static_cast<detail::AttentionArgs&>(p) = f;  // the tensors, shapes and scale
  p.rows = f.group * f.len_q;
  p.num_kv_tiles = (f.len_kv + kSplitKvKeyTile - 1) / kSplitKvKeyTile;
  const bool bf16 = dtype == DType::bf16;
  if (p.mask_kind != detail::kMaskNone) {
    if (head_dim == 64) {
      return bf16 ? launch_split_kv<__nv_bfloat16, 64, true>(p, device, stream)
                  : launch_split_kv<__half, 64, true>(p, device, stream);
    }
    return bf16 ? launch_split_kv<__nv_bfloat16, 128, true>(p, device, stream)
                : launch_split_kv<__half, 128, true>(p, device, stream);
  }
  if (head_dim == 64) {
    return bf16 ? launch_split_kv<__nv_bfloat16, 64, false>(p, device, stream)
                : launch_split_kv<__half, 64, false>(p, device, stream);
  }
  return bf16 ? launch_split_kv<__nv_bfloat16, 128, false>(p, device, stream)
              : launch_split_kv<__half, 128, false>(p, device, stream);
}

}  // namespace

detail::Route detail::last_dense_route() { return g_last_route; }
bool detail::last_flash_used_tma() { return g_last_tma; }
bool detail::set_flash_tma(bool on) { return g_use_tma.exchange(on); }
detail::FlashSchedule detail::last_flash_schedule() {
  return g_last_tma ? g_last_schedule : detail::FlashSchedule::plain;
}
detail::FlashSchedule detail::set_flash_schedule(detail::FlashSchedule schedule) { return g_schedule.exchange(schedule); }
int detail::set_flash_dense_key_tile(int tile) { return g_dense_key_tile.exchange(tile == 176 ? 176 : 128); }
int detail::last_flash_key_tile() { return g_last_key_tile; }
int detail::last_split_kv_splits() { return g_last_splits; }
bool detail::last_split_kv_used_tma() { return g_last_split_kv_tma; }
bool detail::set_split_kv_tma(bool on) { return g_use_split_kv_tma.exchange(on); }
unsigned long long detail::set_split_kv_merge_wait_ns(unsigned long long ns) { return g_merge_wait_ns.exchange(ns); }
bool detail::split_kv_counters_zero(int device) {
  bool zero = true;
  g_states.for_each([&](int d, cudaStream_t stream, StreamState& state) {
    if (d != device || !zero) return;
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.workspace.data() == nullptr) return;
    std::vector<detail::SplitKvCounters> counters(counter_bytes(state.sms) / sizeof(detail::SplitKvCounters));
    detail::DeviceGuard guard;
    if (!guard.enter(device).ok() ||
        cudaMemcpyAsync(counters.data(), state.workspace.data(), counters.size() * sizeof(detail::SplitKvCounters),
                        cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      cudaGetLastError();
      zero = false;
      return;
    }
    zero = std::all_of(counters.begin(), counters.end(), [](const detail::SplitKvCounters& c) {
      return c.arrive == 0 && c.depart == 0 && c.withdrawn == 0;
    });
  });
  return zero;
}

// Plans with a key permutation over at least kGatherMinKeys keys (and 16-byte-aligned K, V) have K
// and V gathered once into permuted order in a grow-only per-device buffer, so the flash kernel
// reads contiguous tiles (gather_kernel.cuh). Sets *gathered = false and leaves p as it was when
// the shape does not qualify or the buffer cannot be allocated (the kernel then gathers in place). The
// caller keeps `lock` (the stream state's) until the flash kernel is launched, so that another
// host thread's gather cannot be queued between this one and the kernel that reads it.
constexpr int64_t kGatherMinKeys = 1024;

template <int D>
Status gather_kv(FlashParams& p, int device, cudaStream_t stream, std::unique_lock<std::mutex>& lock,
                 bool* gathered) {
  *gathered = false;
  if (p.perm_kv == nullptr || !p.aligned_loads || p.len_kv < kGatherMinKeys || p.cu_seqlens_q != nullptr) return {};
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_kv * p.len_kv;
  const size_t bytes = static_cast<size_t>(rows) * D * 2;
  StreamState& state = g_states.at(device, stream);
  lock = std::unique_lock<std::mutex>(state.mutex);
  if (!state.gathered.reserve(device, stream, 2 * bytes).ok()) return {};  // out of memory: the in-kernel gather
  auto* dst_k = static_cast<uint16_t*>(state.gathered.data());
  uint16_t* dst_v = dst_k + rows * D;
  constexpr int kThreads = 256;
  const int64_t chunks = rows * (D / 8);
  detail::gather_kv_kernel<D><<<static_cast<unsigned>((chunks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint16_t*>(p.k), static_cast<const uint16_t*>(p.v), p.k_stride[0], p.k_stride[1],
      p.k_stride[2], p.v_stride[0], p.v_stride[1], p.v_stride[2], p.perm_kv, p.perm_kv_stride[0],
      p.perm_kv_stride[1], p.perm_kv_stride[2], p.heads_kv, p.len_kv, rows, dst_k, dst_v);
  SPARSA_CUDA_CHECK_LAUNCH();
  p.k = dst_k;
  p.v = dst_v;
  const int64_t strides[3] = {static_cast<int64_t>(p.heads_kv) * p.len_kv * D, static_cast<int64_t>(p.len_kv) * D, D};
  for (int d = 0; d < 3; ++d) p.k_stride[d] = p.v_stride[d] = strides[d];
  p.perm_kv = nullptr;
  *gathered = true;
  return {};
}

// The mask into the kernels' form (common/mask.cuh), or none when it hides no key of this shape (a
// fixed-length batch's) from any query (every window is all of [0, len_kv): windows do not
// decrease along the queries, so the first query's end and the last query's begin decide), e.g. a
// block step whose queries are one whole block at the end of a block-causal sequence: the
// unmasked kernels run.
namespace {
void set_mask(const sparsa::detail::AttentionParams& a, FlashParams* p) {
  const Mask& m = a.mask;
  if (m.is_none() || (!a.varlen() && (a.len_q == 0 || (mask_key_end(m, 0, a.len_q, a.len_kv) == a.len_kv &&
                                                       mask_key_begin(m, a.len_q - 1, a.len_q, a.len_kv) == 0)))) {
    p->mask_kind = detail::kMaskNone;
    return;
  }
  detail::mask_args(m, p);
}
}  // namespace

Status attention(const sparsa::detail::AttentionParams& a) {
  g_last_route = detail::Route::none;
  g_last_tma = false;
  g_last_key_tile = 0;
  g_last_splits = 0;
  g_last_split_kv_tma = false;
  if (a.dtype != DType::bf16 && a.dtype != DType::f16) {
    return unsupported_dtype(std::string("q: the cuda backend takes bf16 or f16, got ") + dtype_name(a.dtype));
  }
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256) {
    return {StatusCode::unsupported,
            "q: head_dim " + std::to_string(a.head_dim) + " is not supported by the cuda backend (64, 128 or 256)"};
  }
  constexpr int64_t kIntMax = 0x7fffffff;
  if (a.len_q > kIntMax / 2 || a.len_kv > kIntMax / 2) {
    return invalid_argument("q: sequence lengths up to 2^30 are supported by the cuda backend, got len_q " +
                            std::to_string(a.len_q) + ", len_kv " + std::to_string(a.len_kv));
  }
  if (a.heads_q > 65535 || a.batch > 65535) {
    return invalid_argument("q: the cuda backend takes at most 65535 heads and 65535 batch entries, got " +
                            std::to_string(a.heads_q) + " heads, batch " + std::to_string(a.batch));
  }
  const int device = a.device_id;
  SPARSA_RETURN_IF_ERROR(detail::check_device_id("q", device));
  detail::DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  SPARSA_RETURN_IF_ERROR(check_pointer("q", a.q, device, a.stream));
  SPARSA_RETURN_IF_ERROR(check_pointer("k", a.k, device, a.stream));
  SPARSA_RETURN_IF_ERROR(check_pointer("v", a.v, device, a.stream));
  SPARSA_RETURN_IF_ERROR(check_pointer("out", a.out, device, a.stream));
  SPARSA_RETURN_IF_ERROR(check_pointer("lse", a.lse, device, a.stream));
  if (a.varlen()) {  // the offsets (their values were read back and checked by the entry point)
    SPARSA_RETURN_IF_ERROR(check_pointer("cu_seqlens_q", a.cu_seqlens_q, device, a.stream));
    SPARSA_RETURN_IF_ERROR(check_pointer("cu_seqlens_kv", a.cu_seqlens_kv, device, a.stream));
  }

  FlashParams p;
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.out = a.out;
  p.lse = a.lse;
  for (int d = 0; d < 3; ++d) {
    p.q_stride[d] = a.q_stride[d];
    p.k_stride[d] = a.k_stride[d];
    p.v_stride[d] = a.v_stride[d];
    p.out_stride[d] = a.out_stride[d];
  }
  p.lse_stride[0] = a.lse_stride[0];
  p.lse_stride[1] = a.lse_stride[1];
  p.lse_stride[2] = a.lse_seq_stride;
  p.batch = static_cast<int>(a.batch);
  p.heads_q = static_cast<int>(a.heads_q);
  p.heads_kv = static_cast<int>(a.heads_kv);
  p.group = static_cast<int>(a.group());
  p.len_q = static_cast<int>(a.len_q);
  p.len_kv = static_cast<int>(a.len_kv);
  p.scale_log2 = a.scale * 1.4426950408889634f;

  set_mask(a, &p);
  p.cu_seqlens_q = a.cu_seqlens_q;  // null unless a variable-length batch (then batch = sequences,
  p.cu_seqlens_kv = a.cu_seqlens_kv;  // len_q / len_kv the longest)
  if (a.varlen() && !a.host_cu_seqlens_kv.empty()) p.kv_rows = a.host_cu_seqlens_kv.back();

  p.aligned_loads = aligned(a.q, 16) && aligned(a.k, 16) && aligned(a.v, 16);
  p.aligned_out = aligned(a.out, 4);
  for (int d = 0; d < 3; ++d) {
    p.aligned_loads = p.aligned_loads && a.q_stride[d] % 8 == 0 && a.k_stride[d] % 8 == 0 && a.v_stride[d] % 8 == 0;
    p.aligned_out = p.aligned_out && a.out_stride[d] % 2 == 0;
  }

  if (a.index != nullptr) {
    const BlockIndex& ix = *a.index;
    SPARSA_RETURN_IF_ERROR(check_pointer("index.counts", ix.counts.data, device, a.stream));
    if (ix.indices.numel() > 0) SPARSA_RETURN_IF_ERROR(check_pointer("index.indices", ix.indices.data, device, a.stream));
    p.block_q = ix.block_q;
    p.block_kv = ix.block_kv;
    p.num_q_blocks = static_cast<int>(ix.num_q_blocks);
    p.num_kv_blocks = static_cast<int>(ix.num_kv_blocks);
    p.counts = static_cast<const int32_t*>(ix.counts.data);
    p.indices = static_cast<const int32_t*>(ix.indices.data);
    p.capacity = static_cast<int>(ix.capacity());
    for (int d = 0; d < 3; ++d) p.counts_stride[d] = ix.counts.strides[d];
    for (int d = 0; d < 4; ++d) p.indices_stride[d] = ix.indices.strides[d];
    if (p.capacity == 0) p.counts = nullptr, p.num_kv_blocks = 0;  // nothing to visit: dense over 0 tiles
    if (ix.perm_q.defined()) {
      SPARSA_RETURN_IF_ERROR(check_pointer("index.perm_q", ix.perm_q.data, device, a.stream));
      p.perm_q = static_cast<const int32_t*>(ix.perm_q.data);
      for (int d = 0; d < 3; ++d) p.perm_q_stride[d] = ix.perm_q.strides[d];
    }
    if (ix.perm_kv.defined()) {
      SPARSA_RETURN_IF_ERROR(check_pointer("index.perm_kv", ix.perm_kv.data, device, a.stream));
      p.perm_kv = static_cast<const int32_t*>(ix.perm_kv.data);
      for (int d = 0; d < 3; ++d) p.perm_kv_stride[d] = ix.perm_kv.strides[d];
      if (p.mask_kind != detail::kMaskNone) {  // the mask needs the keys' original positions
        p.key_perm = p.perm_kv;
        for (int d = 0; d < 3; ++d) p.key_perm_stride[d] = p.perm_kv_stride[d];
      }
    }
  }
  const auto stream = static_cast<cudaStream_t>(a.stream);  // AttentionOptions::stream
  if (a.index != nullptr && a.check_index) {
    SPARSA_RETURN_IF_ERROR(detail::check_index_on_device(*a.index, a.batch, a.heads_q, a.heads_kv, a.len_q, a.len_kv,
                                                         device, stream));
  }
  const int head_dim = static_cast<int>(a.head_dim);
  if (use_split_kv(a)) {
    g_last_route = detail::Route::split_kv;
    return split_kv(p, a.dtype, head_dim, device, stream);
  }
  g_last_route = a.index == nullptr ? detail::Route::flash_dense : detail::Route::flash_block_sparse;
  bool gathered = false;
  std::unique_lock<std::mutex> lock;
  SPARSA_RETURN_IF_ERROR(head_dim == 64    ? gather_kv<64>(p, device, stream, lock, &gathered)
                         : head_dim == 128 ? gather_kv<128>(p, device, stream, lock, &gathered)
                                           : gather_kv<256>(p, device, stream, lock, &gathered));
  if (gathered) g_last_route = detail::Route::flash_block_sparse_gathered;
  return launch_flash(p, a.dtype, head_dim, a.index, device, stream);
}

}  // namespace sparsa::cuda
