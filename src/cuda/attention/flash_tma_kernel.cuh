// Internal: the flash executor with a TMA producer warp (rung 3 of bench/cuda/flash_ladder.cu).
// The consumers are rung 2's two wgmma warpgroups (flash_wgmma_kernel.cuh: same descriptors,
// softmax, epilogue and hooks); what changes is who moves K and V:
//
//   warpgroup 0 (producer): one thread walks the key tiles and, per tile, waits until the stage is
//     free (mbarrier `empty`), announces the bytes on mbarrier `full` and issues TMA tensor copies
//     (cp.async.bulk.tensor, 64-column boxes with the 128-byte swizzle the wgmma descriptors read);
//     it gives its registers to the consumers (setmaxnreg).
//   warpgroups 1, 2 (consumers, 64 query rows each): wait on `full`, S = Q K^T, softmax, P V, and
//     release the stage of tile t-1 on `empty` once its P V is complete. No CTA-wide barrier in
//     the loop; the copies cost the consumers no instructions.
//
// Tensor maps cover K and V as [batch, heads_kv, len_kv, D] with their strides; rows past len_kv
// arrive as zeros (and are masked like any partial tile). A variable-length batch's maps are
// [1, heads_kv, all rows, D], a sequence's tile at its first row plus the tile's: the box of a
// sequence's partial last tile then reads the next sequence's rows. Their scores are masked like
// any past the end, but P = 0 times a non-finite V is not 0, so the consumers zero those V rows
// in shared memory before P V (only on such tiles; zero_v_rows). Key permutations are not read here: the
// launcher takes this kernel only without perm_kv (long permuted plans have K and V gathered into
// order first, gather_kernel.cuh); Q keeps its cp.async gather (read once per CTA).
// Warp specialisation and TMA as in FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/attention/flash_wgmma_kernel.cuh"

namespace sparsa::cuda::detail {

struct TmaMaps {
  CUtensorMap k;
  CUtensorMap v;
};

template <int D, int BN, int STAGES>
struct TmaShape {
  static constexpr int kBM = kWgmmaRows;
  static constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kKVBytes = BN * D * 2;
  static constexpr int kBarrierBytes = 2 * STAGES * 8;
  static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + kBarrierBytes + 1024;
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// A 4-d TMA tile copy (coordinates innermost first) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Rows [valid, BN) of V's stage `stage` set to zero by the 256 consumer threads (thread t =
// threadIdx.x - 128), then made visible to the wgmma reads (async proxy) of both consumer
// warpgroups. The 128-byte swizzle permutes 16-byte chunks within a row, so row r of a 64-column
// box is bytes [128 r, 128 r + 128) whatever the swizzle. CTA-uniform: both warpgroups call it.
template <int D, int BN, int STAGES>
__device__ __forceinline__ void zero_v_rows(uint32_t v_smem, int stage, int valid) {
  constexpr int kKVBytes = TmaShape<D, BN, STAGES>::kKVBytes;
  const int chunks_per_box = (BN - valid) * 8;  // 16-byte chunks past the valid rows, per box
  for (int i = static_cast<int>(threadIdx.x) - 128; i < chunks_per_box * (D / 64); i += 256) {
    const int sub = i / chunks_per_box, chunk = i % chunks_per_box;
    const uint32_t addr = v_smem + stage * kKVBytes + sub * BN * 128 + valid * 128 + chunk * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
  }
  fence_proxy_async();
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the consumers only
}

// The consumers' schedules (SCHEDULE; the loop below says each): overlap, rung 3's promoted one,
// and the ladder rungs measured beside it (detail::set_flash_schedule).
constexpr int kSchedulePlain = 0, kSchedulePingpong = 1, kScheduleOverlap = 2, kScheduleLate = 3;

// MASKED: as flash_wgmma_kernel's (the per-element mask compiled in). A variable-length batch's
// partial tiles take a barrier of both consumer warpgroups (zero_v_rows) before the tile's turn,
// in every schedule: no product is in flight there, and each warpgroup reaches it after its turn
// of the tile before (so the turns cannot deadlock on it).
template <class T, int D, int BN, int STAGES, bool MASKED = false, int SCHEDULE = kSchedulePlain>
__global__ void __launch_bounds__(384, 1) flash_tma_kernel(const FlashParams p, const __grid_constant__ TmaMaps maps) {
  static_assert(D % 64 == 0 && BN % 16 == 0 && BN <= 256, "128-byte swizzled tiles of 64 columns, k16 steps");
  using Shape = TmaShape<D, BN, STAGES>;
  constexpr int BM = Shape::kBM;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_smem = (smem_addr(smem) + 1023u) & ~1023u;
  const uint32_t k_smem = q_smem + Shape::kQBytes;
  const uint32_t v_smem = k_smem + STAGES * Shape::kKVBytes;
  const uint32_t bars = v_smem + STAGES * Shape::kKVBytes;  // full[STAGES], then empty[STAGES]
  auto full = [&](int stage) { return bars + 8 * stage; };
  auto empty = [&](int stage) { return bars + 8 * (STAGES + stage); };

  const QueryTile<BM> tile(p);
  if (tile.empty()) return;  // the whole CTA, before any barrier

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);  // the producer's arrive.expect_tx; the bytes complete the phase
      mbar_init(empty(s), 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // The consumers' warps are 4..11 (the producer and consumers walk the same tiles: the key range
  // does not depend on the warp).
  const CtaMask<BM> mask = MASKED ? CtaMask<BM>(p, tile, threadIdx.x / 32 - 4) : CtaMask<BM>{};
  KeyTiles<BN> tiles(p, tile.b, tile.h, tile.qb, tile.len_kv, mask.key_min, mask.key_max);
  const bool varlen = p.cu_seqlens_kv != nullptr;

  if (threadIdx.x < 128) {  // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x != 0) return;
    // A variable-length batch: the sequence's first row in the one [1, heads_kv, rows, D] map.
    const int row0 = static_cast<int>(tile.kv_row0), batch = varlen ? 0 : tile.b;
    int begin = 0, end = 0;
    for (int t = 0; tiles.next_nonempty(p, begin, end); ++t) {
      const int stage = t % STAGES, use = t / STAGES;
      if (use > 0) mbar_wait(empty(stage), (use - 1) & 1);
      mbar_expect_tx(full(stage), 2 * Shape::kKVBytes);
#pragma unroll
      for (int sub = 0; sub < D / 64; ++sub) {
        const uint32_t offset = stage * Shape::kKVBytes + sub * BN * 128;
        tma_load_4d(k_smem + offset, &maps.k, sub * 64, row0 + begin, tile.h_kv, batch, full(stage));
        tma_load_4d(v_smem + offset, &maps.v, sub * 64, row0 + begin, tile.h_kv, batch, full(stage));
      }
    }
    return;
  }

  // ---- consumers ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  tile.template load<TileCopy<D, BM, 256, Swizzle128<BM>, 128>>(p, q_smem);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the consumers only

  const int warpgroup = threadIdx.x / 128 - 1;
  WgmmaConsumer<T, D, BN> consumer(q_smem, k_smem, v_smem, warpgroup);
  // plain: per tile, S = Q K^T issued and waited for (with the previous tile's P V), the softmax,
  //   then P V issued; it runs during the next tile's wait and S.
  // pingpong: the two consumer warpgroups take turns at the tensor cores, so that one's softmax
  //   runs while the other's products do. A turn issues P V of the previous tile and S of this
  //   one; warpgroup w waits on named barrier 2 + w to start a turn and arrives on the other's to
  //   end it. Warpgroup 0 goes first (warpgroup 1 arrives on barrier 2 once before its first
  //   turn); both take one turn per key tile and one more (the last P V alone), and warpgroup 1 skips the
  //   arrive after its last turn, so each barrier completes exactly as often as it is waited on.
  // overlap: pingpong, and inside a warpgroup the softmax of S_t runs while P V_{t-1} does: the
  //   turn applies O's deferred rescale, issues S_t, then P V_{t-1}; the warpgroup waits for S_t
  //   alone, computes the probabilities in place, then waits for P V_{t-1} before packing P_t
  //   over P_{t-1}'s registers.
  // late: pingpong's order without the turns (P V_{t-1} issued just before S_t): ptxas serialises
  //   plain's products (C7515) and neither pingpong's nor this order's, which tells the two
  //   effects apart.
  // pingpong and overlap from FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608).
  constexpr bool kTurns = SCHEDULE == kSchedulePingpong || SCHEDULE == kScheduleOverlap;
  constexpr bool kLatePv = SCHEDULE != kSchedulePlain;  // P V of a tile issued in the next iteration
  auto turn_begin = [&] {
    if constexpr (kTurns) asm volatile("bar.sync %0, 256;\n" ::"r"(2 + warpgroup) : "memory");
  };
  auto turn_end = [&] {
    if constexpr (kTurns) asm volatile("bar.arrive %0, 256;\n" ::"r"(3 - warpgroup) : "memory");
  };
  int begin = 0, end = 0;  // the key range of the current tile; valid = end - begin > 0, CTA-uniform
  bool more = tiles.next_nonempty(p, begin, end);
  if (kTurns && more && warpgroup == 1) turn_end();  // warpgroup 0's first turn
  uint32_t p_frag[BN / 16][4];  // late P V: P of the last tile, until the next iteration's P V
  auto mask_hook = [&](float(&s)[BN / 8][4]) {
    if constexpr (MASKED) mask(p, s, begin, end - begin);
  };
  if constexpr (SCHEDULE == kScheduleOverlap) {
    // No branch may skip a product here (ptxas then serialises every wgmma of the kernel, C7514 /
    // C7515): the first tile's turn (S_0 alone) comes before the loops, and every turn of a loop
    // issues both products unconditionally (every tile has keys: empty ones are not walked).
    if (more) {
      float alpha[2];  // the last tile's rescale of O, deferred to its P V
      int t = 0, last_stage = 0;
      // A masked kernel applies the per-element mask only to the tiles some row sees in part,
      // with the rows' windows computed where those tiles are reached, so that the tiles every
      // row sees whole run the unmasked kernel's loop with none of the mask's state in registers
      // (the hook on every tile, the windows live throughout, made the masked kernel 13-28%
      // slower than the unmasked one over the same tiles: bench/RESULTS.md).
      auto masked_hook = [&](const RowWindows& w) {
        return [&p, &mask, &begin, &end, w](float(&s)[BN / 8][4]) {
          if constexpr (MASKED) mask.apply(p, w, s, begin, end - begin);
        };
      };
      auto no_hook = [](float(&)[BN / 8][4]) {};
      const int warp = threadIdx.x / 32 - 4;
      mbar_wait(full(0), 0);
      if (varlen && end - begin < BN) zero_v_rows<D, BN, STAGES>(v_smem, 0, end - begin);
      turn_begin();
      consumer.issue_scores_now(0);
      turn_end();
      consumer.wait_products();
      bool first_whole = true;
      if constexpr (MASKED) first_whole = mask.whole(begin, end);
      if (first_whole) {
        consumer.probabilities_in_place(end - begin, p.scale_log2, no_hook, alpha);
      } else {
        consumer.probabilities_in_place(end - begin, p.scale_log2,
                                        masked_hook(CtaMask<BM>::windows(p, tile, warp)), alpha);
      }
      consumer.pack(end - begin, p_frag);
      // One tile after the first: its turn (S_t, then P V_{t-1}), its softmax with `hook`.
      auto step = [&](auto&& hook) {
        const int stage = ++t % STAGES, use = t / STAGES;
        mbar_wait(full(stage), use & 1);
        if (varlen && end - begin < BN) zero_v_rows<D, BN, STAGES>(v_smem, stage, end - begin);
        turn_begin();
        consumer.rescale_o(alpha);  // O is not in flight (P V_{t-2} was waited for)
        consumer.issue_scores_now(stage);  // S_t first: the wait below is for it alone
        consumer.multiply_v_now(last_stage, p_frag);
        turn_end();
        consumer.wait_scores();  // S_t (P V_{t-1} may still run)
        consumer.probabilities_in_place(end - begin, p.scale_log2, hook, alpha);
        consumer.wait_products();  // P V_{t-1} complete: tile t-1's K and V are read
        if (threadIdx.x % 32 == 0) mbar_arrive(empty(last_stage));
        consumer.pack(end - begin, p_frag);
        last_stage = stage;
      };
      if constexpr (MASKED) {
        // Keys in order: the tiles seen whole are one run (the core is one key range and the tiles
        // ascend), so the walk is tiles in part, whole tiles, tiles in part; any other order is
        // still right (a whole tile in the last loop is masked for nothing).
        bool next = tiles.next_nonempty(p, begin, end);
        if (next && !mask.whole(begin, end)) {
          const RowWindows w = CtaMask<BM>::windows(p, tile, warp);
          do step(masked_hook(w));
          while ((next = tiles.next_nonempty(p, begin, end)) && !mask.whole(begin, end));
        }
        while (next && mask.whole(begin, end)) {
          step(no_hook);
          next = tiles.next_nonempty(p, begin, end);
        }
        if (next) {
          const RowWindows w = CtaMask<BM>::windows(p, tile, warp);
          do step(masked_hook(w));
          while (tiles.next_nonempty(p, begin, end));
        }
      } else {
        while (tiles.next_nonempty(p, begin, end)) step(no_hook);
      }
      turn_begin();  // the last turn: the last tile's P V
      consumer.rescale_o(alpha);
      consumer.multiply_v_now(last_stage, p_frag);
      if (warpgroup == 0) turn_end();
      consumer.wait_products();  // here, not in store (after the branch): ptxas serialises otherwise
    }
  } else {
    int last_stage = 0, last_valid = 0, t = 0;
    for (; more; ++t) {
      const int stage = t % STAGES, use = t / STAGES;
      const int valid = end - begin;
      mbar_wait(full(stage), use & 1);
      if (varlen && valid < BN) zero_v_rows<D, BN, STAGES>(v_smem, stage, valid);
      if constexpr (SCHEDULE == kSchedulePlain) {
        consumer.scores(stage, valid);  // S_t; P V_{t-1} complete
      } else {
        turn_begin();
        if (t > 0) consumer.multiply_v(last_stage, last_valid, p_frag);
        consumer.issue_scores(stage, valid);
        turn_end();
        consumer.wait_products();  // S_t; P V_{t-1} complete
      }
      // tile t-1's K and V are read
      if (t > 0 && threadIdx.x % 32 == 0) mbar_arrive(empty((t - 1) % STAGES));
      if constexpr (SCHEDULE == kSchedulePlain) {
        consumer.accumulate(stage, valid, p.scale_log2, mask_hook);  // P V issued now
      } else {
        consumer.probabilities(valid, p.scale_log2, mask_hook, p_frag);
      }
      last_stage = stage, last_valid = valid;
      more = tiles.next_nonempty(p, begin, end);
    }
    if (kLatePv && t > 0) {  // the last turn: the last tile's P V
      turn_begin();
      consumer.multiply_v(last_stage, last_valid, p_frag);
      if (warpgroup == 0) turn_end();
    }
  }
  consumer.template store<false>(p, tile, threadIdx.x / 32 - 4);
}

}  // namespace sparsa::cuda::detail
