// Internal: one warp's fixed-count radix selection of a row of order keys, shared by BA-Att's
// step 4 (select_blocks.cuh) and QUEST's page selection (src/cuda/losa/). Device functions only:
// a header that defines no kernel, so that any number of .cu files may include it (a __global__
// function defined in a header included by two .cu files is defined twice in the library).
#pragma once

#include <cstdint>

namespace sparsa::cuda::ba_att {

constexpr int kRadixBins = 256;

// One warp's fixed-count selection of one row whose keys (the high words of the row's order keys,
// ascending = best first; the low word, the index, is the position j) are in keys[0, nk): the
// `keep` smallest, ties to the lower index, written to out[0, keep) ascending. hist: 256 words of
// the warp's own shared memory. Used by select_top_warp_kernel and by QUEST's page selection of
// larger budgets (src/cuda/losa/), which builds its keys from page scores.
__device__ inline void warp_top_select(const uint32_t* keys, uint32_t* hist, int nk, int keep, int32_t* out) {
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1u;
  // Invariant (as select_top_kernel): the keep-th smallest key matches `prefix` on the bits of
  // `mask` and is the need-th smallest (1-based) of the keys that do; keep - need keys are below.
  uint32_t prefix = 0, mask = 0;
  int need = keep;
  for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
    for (int b = 0; b < kRadixBins / 32; ++b) hist[lane + 32 * b] = 0;
    __syncwarp();  // the keys are in (first pass), the bins are clear
    for (int j0 = 0; j0 < nk; j0 += 32) {  // uniform trip count: the whole warp meets in match_any
      const int j = j0 + lane;
      const uint32_t key = j < nk ? keys[j] : 0u;
      const bool tied = j < nk && (key & mask) == prefix;
      const uint32_t bin = (key >> shift) & 0xffu;
      const unsigned peers = __match_any_sync(0xffffffffu, tied ? bin : 0xffffffffu);
      if (tied && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
    __syncwarp();
    // Lane l owns bins 8l .. 8l + 7 (two 16-byte loads: one contiguous 1 KiB read per warp, no
    // bank conflicts): their counts, then the exclusive count before bin 8l.
    static_assert(kRadixBins / 32 == 8, "two 16-byte loads of bins per lane");
    const uint4 lo = *reinterpret_cast<const uint4*>(hist + lane * 8);
    const uint4 hi = *reinterpret_cast<const uint4*>(hist + lane * 8 + 4);
    const int count[8] = {static_cast<int>(lo.x), static_cast<int>(lo.y), static_cast<int>(lo.z),
                          static_cast<int>(lo.w), static_cast<int>(hi.x), static_cast<int>(hi.y),
                          static_cast<int>(hi.z), static_cast<int>(hi.w)};
    int lane_total = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) lane_total += count[b];
    int inclusive = lane_total;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    int before = inclusive - lane_total;
    int chosen_bin = -1, chosen_need = 0, chosen_done = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      if (before < need && need <= before + count[b]) {  // exactly one bin of the warp holds it
        chosen_bin = lane * 8 + b;
        chosen_need = need - before;
        chosen_done = count[b] == chosen_need;
      }
      before += count[b];
    }
    const int owner = __ffs(__ballot_sync(0xffffffffu, chosen_bin >= 0)) - 1;
    chosen_bin = __shfl_sync(0xffffffffu, chosen_bin, owner);
    need = __shfl_sync(0xffffffffu, chosen_need, owner);
    chosen_done = __shfl_sync(0xffffffffu, chosen_done, owner);
    prefix |= static_cast<uint32_t>(chosen_bin) << shift;
    mask |= 0xffu << shift;
    __syncwarp();  // every lane has read the bins before the next pass clears them
    if (chosen_done) break;  // the whole bin is kept: lower digits change nothing
  }
  // Compaction in ascending index, 32 indices at a time: every key below the prefix, and the
  // first `need` (ascending index) of those equal to it; slot = kept keys before it.
  int written = 0, tied_seen = 0;
  for (int j0 = 0; j0 < nk; j0 += 32) {
    const int j = j0 + lane;
    const uint32_t m = j < nk ? keys[j] & mask : 0u;
    const bool below = j < nk && m < prefix;
    const bool tied = j < nk && m == prefix;
    const unsigned tied_ballot = __ballot_sync(0xffffffffu, tied);
    const bool kept = below || (tied && tied_seen + __popc(tied_ballot & lanes_below) < need);
    const unsigned kept_ballot = __ballot_sync(0xffffffffu, kept);
    if (kept) out[written + __popc(kept_ballot & lanes_below)] = j;
    written += __popc(kept_ballot);
    tied_seen += __popc(tied_ballot);
  }
}

}  // namespace sparsa::cuda::ba_att
