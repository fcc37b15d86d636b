// Internal: step 4 of BA-Att's cuda selector (ba_att_kernels.cuh): the budget per query-block row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mask.cuh"
#include "cuda/select/ba_att_common.cuh"
#include "cuda/select/warp_select.cuh"

namespace sparsa::cuda::ba_att {

// ---- 5. the budget per query-block row ---------------------------------------------------------

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;

struct SelectArgs {
  const float* logits = nullptr;  // [rows, nk]
  int64_t rows = 0;
  int nk = 0;
  int sort_size = 0;     // power of two >= nk
  bool mass = false;     // else a fixed count
  int keep = 0;          // fixed count (top_kappa / density), in [1, nk]
  double tau = 1.0;      // mass threshold
  int32_t* counts = nullptr;   // [rows]
  int32_t* indices = nullptr;  // [rows, capacity]
  int capacity = 0;
  uint64_t* scratch = nullptr;  // kGlobal: per CTA, sort_size keys then nk flag bytes
  // mask_aware (BaAttOptions::mask_aware; select_kernel only): per row, the key blocks the mask
  // hides are out, the diagonal ones forced, and the budget counts the visible ones, as
  // select_visible_blocks. Rows are [batch, heads, nq] flattened: query block = row % nq.
  bool mask_aware = false;
  detail::MaskArgs mask;
  int nq = 0, block_q = 0, block_kv = 0, len_q = 0, len_kv = 0;
  bool top_kappa = false;  // a fixed budget: kappa = budget (top_kappa) or ceil(budget x visible) (density)
  double budget = 0.0;
};

__host__ __device__ inline size_t select_bytes_per_row(int sort_size, int nk) {
  return static_cast<size_t>(sort_size) * sizeof(uint64_t) + (static_cast<size_t>(nk) + 7) / 8 * 8;
}

// Inclusive sum of v over the warp's lanes in order (Hillis-Steele, 5 shuffles).
template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % 32;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += up;
  }
  return v;
}

// Ascending bitonic sort of keys[0, n), n a power of two, by the whole CTA.
__device__ inline void bitonic_sort(uint64_t* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int partner = i ^ j;
        if (partner > i) {
          const uint64_t a = keys[i], b = keys[partner];
          const bool ascending = (i & k) == 0;
          if ((a > b) == ascending) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Mass budget on the first nk sorted keys: weights w_p = exp(l_p - max_logit) in f64, and keep =
// the smallest k whose prefix sum reaches tau * (sum of all), as select_blocks. l_p is the key's
// own logit, or with `logits` (the row's; forced keys of a mask-aware row carry no logit)
// logits[index_of(key)].
__device__ inline double sorted_logit(const uint64_t* keys, int p, const float* logits) {
  return logits != nullptr ? static_cast<double>(logits[index_of(keys[p])]) : static_cast<double>(logit_of(keys[p]));
}
__device__ inline int mass_keep(const uint64_t* keys, int nk, double tau, double max_logit,
                                const float* logits = nullptr) {
  __shared__ double warp_sums[kSelectWarps];
  __shared__ int first_reaching;
  const int per_thread = (nk + blockDim.x - 1) / blockDim.x;
  const int p_begin = min(nk, static_cast<int>(threadIdx.x) * per_thread), p_end = min(nk, p_begin + per_thread);
  double local = 0.0;
  for (int p = p_begin; p < p_end; ++p) local += exp(sorted_logit(keys, p, logits) - max_logit);
  // Inclusive scan of the per-thread sums over the CTA (threads in order = positions in order).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const double inclusive = warp_inclusive_scan(local);
  if (lane == 31) warp_sums[warp] = inclusive;
  if (threadIdx.x == 0) first_reaching = nk;
  __syncthreads();
  double before = 0.0, total = 0.0;
  for (int w = 0; w < kSelectWarps; ++w) {
    if (w < warp) before += warp_sums[w];
    total += warp_sums[w];
  }
  const double required = tau * total;
  double exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = 0.0;
  double running = before + exclusive;  // the sum of every position before this thread's range
  for (int p = p_begin; p < p_end; ++p) {
    running += exp(sorted_logit(keys, p, logits) - max_logit);
    if (running >= required) {
      atomicMin(&first_reaching, p);
      break;
    }
  }
  __syncthreads();
  const int keep = first_reaching >= nk ? nk : first_reaching + 1;
  __syncthreads();  // first_reaching is reused by the next row
  return keep;
}

// A float's bits as an unsigned number in the floats' order (for atomicMax).
__device__ __forceinline__ uint32_t ordered_bits(float x) {
  const uint32_t u = float_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_bits(uint32_t u) {
  return bits_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// The budget of a mask-aware row (a.mask_aware): its keys sorted as select_visible_blocks visits
// them (forced = diagonal blocks first, by index: their key is the index, below every logit's
// order_key; then the visible ones by descending logit; hidden ones last, ~0), `visible` of them
// visible and `forced` forced; the kept prefix's length.
__device__ inline int mask_aware_keep(const SelectArgs& a, const uint64_t* keys, const float* logits, int visible,
                                      int forced, float max_logit) {
  if (visible == 0) return 0;
  int keep;
  if (a.mass) {
    keep = mass_keep(keys, visible, a.tau, static_cast<double>(max_logit), logits);
  } else {
    const double kappa = a.top_kappa ? a.budget : ceil(a.budget * static_cast<double>(visible) - 1e-9);
    keep = static_cast<int>(kappa < 1.0 ? 1.0 : kappa > visible ? static_cast<double>(visible) : kappa);
  }
  return keep > forced ? keep : forced;
}

// grid-stride over rows. kGlobal: keys and flags in a.scratch (rows of any length); else in
// dynamic shared memory (select_bytes_per_row(sort_size, nk) bytes). kMaskAware: a.mask_aware
// rows (a separate instantiation: the other rows' kernel is unchanged).
template <bool kGlobal, bool kMaskAware = false>
__global__ void __launch_bounds__(kSelectThreads) select_kernel(SelectArgs a) {
  extern __shared__ uint64_t select_smem[];
  __shared__ int warp_counts[kSelectWarps];
  __shared__ int row_visible, row_forced;
  __shared__ uint32_t row_max;
  uint64_t* keys = kGlobal ? a.scratch + blockIdx.x * (select_bytes_per_row(a.sort_size, a.nk) / 8) : select_smem;
  uint8_t* flags = reinterpret_cast<uint8_t*>(keys + a.sort_size);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float* logits = a.logits + row * a.nk;
    if constexpr (!kMaskAware) {
      for (int j = threadIdx.x; j < a.sort_size; j += blockDim.x) keys[j] = j < a.nk ? order_key(logits[j], j) : ~0ull;
    } else {
      if (threadIdx.x == 0) row_visible = 0, row_forced = 0, row_max = 0;
      __syncthreads();
      const int qb = static_cast<int>(row % a.nq);
      int visible = 0, forced = 0;
      uint32_t mx = 0;  // ordered_bits of the largest visible logit (0: below every float)
      for (int j = threadIdx.x; j < a.sort_size; j += blockDim.x) {
        const int v = j < a.nk ? detail::block_visibility(a.mask, qb, j, a.block_q, a.block_kv, a.len_q, a.len_kv) : 0;
        keys[j] = v == 0 ? ~0ull : v == 2 ? static_cast<uint64_t>(j) : order_key(logits[j], j);
        visible += v != 0;
        forced += v == 2;
        if (v != 0) mx = max(mx, ordered_bits(logits[j]));
      }
      atomicAdd(&row_visible, visible);
      atomicAdd(&row_forced, forced);
      atomicMax(&row_max, mx);
    }
    for (int j = threadIdx.x; j < a.nk; j += blockDim.x) flags[j] = 0;
    __syncthreads();
    bitonic_sort(keys, a.sort_size);
    int keep = a.keep;
    if constexpr (kMaskAware) {
      keep = mask_aware_keep(a, keys, logits, row_visible, row_forced, from_ordered_bits(row_max));
    } else if (a.mass) {
      keep = mass_keep(keys, a.nk, a.tau, static_cast<double>(logit_of(keys[0])));
    }
    for (int p = threadIdx.x; p < keep; p += blockDim.x) flags[index_of(keys[p])] = 1;
    __syncthreads();
    // The kept blocks in ascending order: a CTA-wide stream compaction of the flags.
    int32_t* out = a.indices + row * a.capacity;
    int base = 0;
    for (int j0 = 0; j0 < a.nk; j0 += blockDim.x) {
      const int j = j0 + threadIdx.x;
      const bool kept = j < a.nk && flags[j] != 0;
      const unsigned ballot = __ballot_sync(0xffffffffu, kept);
      if (lane == 0) warp_counts[warp] = __popc(ballot);
      __syncthreads();
      int before = 0, total = 0;
      for (int w = 0; w < kSelectWarps; ++w) {
        if (w < warp) before += warp_counts[w];
        total += warp_counts[w];
      }
      const int slot = base + before + __popc(ballot & ((1u << lane) - 1u));
      if (kept && slot < a.capacity) out[slot] = j;
      base += total;
      __syncthreads();
    }
    for (int s = keep + threadIdx.x; s < a.capacity; s += blockDim.x) out[s] = 0;
    if (threadIdx.x == 0) a.counts[row] = keep;
    __syncthreads();
  }
}

// ---- 5b. fixed budgets: radix select of the keep-th key, then a compaction ----------------------

// Rows of fixed budgets (top_kappa, density) need only the `keep` smallest row keys, not their
// order: the high word of order_key (the logit's order; the low word is the index) is resolved 8
// bits at a time from the top, each pass a 256-bin histogram of the keys still tied with the
// keep-th and a scan that picks the bin holding it. The kept set is then every key below the
// prefix found, plus the first `need` (ascending index) of those equal to it: exactly the first
// `keep` keys of the ascending sort, ties to the lower index. Up to kMaxTopBlocks key blocks
// (their high words in shared memory, and per-thread counts packed in 16 bits for one scan).
constexpr int kTopThreads = 256;  // one thread per radix bin
constexpr int kMaxTopBlocks = 8192;
static_assert(kTopThreads == kRadixBins, "the bin scan gives each thread one bin");

// Inclusive sum of `value` over the CTA's threads in order (kTopThreads of them). warp_totals is
// written before the one __syncthreads() inside and read after it: the caller synchronises before
// the next call overwrites it.
__device__ inline int cta_inclusive_scan(int value, int* warp_totals) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = warp_inclusive_scan(value);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  for (int w = 0; w < warp; ++w) inclusive += warp_totals[w];
  return inclusive;
}

// grid-stride over rows, kTopThreads threads, nk * 4 bytes of dynamic shared memory; nk <=
// kMaxTopBlocks, 1 <= keep <= nk, capacity == keep.
__global__ void __launch_bounds__(kTopThreads) select_top_kernel(SelectArgs a) {
  extern __shared__ uint32_t top_keys[];  // [nk] high words of order_key
  __shared__ int hist[kRadixBins];
  __shared__ int warp_totals[kTopThreads / 32];
  __shared__ uint32_t chosen_prefix;
  __shared__ int chosen_need, chosen_done;
  const int nk = a.nk, lane = threadIdx.x % 32;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float* logits = a.logits + row * nk;
    for (int j = threadIdx.x; j < nk; j += kTopThreads) top_keys[j] = static_cast<uint32_t>(order_key(logits[j], j) >> 32);
    // Invariant: the keep-th smallest key matches `prefix` on the bits of `mask`, and is the
    // need-th smallest (1-based) of the keys that do; keep - need keys are below it there.
    uint32_t prefix = 0, mask = 0;
    int need = a.keep;
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[threadIdx.x] = 0;
      __syncthreads();  // the keys are in (first pass), the bins are clear
      for (int j0 = 0; j0 < nk; j0 += kTopThreads) {  // uniform trip count: whole warps meet in match_any
        const int j = j0 + static_cast<int>(threadIdx.x);
        const uint32_t key = j < nk ? top_keys[j] : 0u;
        const bool tied = j < nk && (key & mask) == prefix;
        const uint32_t bin = (key >> shift) & 0xffu;
        // One shared atomic per distinct bin per warp: logits of a row share their top bits.
        const unsigned peers = __match_any_sync(0xffffffffu, tied ? bin : 0xffffffffu);
        if (tied && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
      }
      __syncthreads();
      const int count = hist[threadIdx.x];
      const int inclusive = cta_inclusive_scan(count, warp_totals), exclusive = inclusive - count;
      if (exclusive < need && need <= inclusive) {  // exactly one bin holds the need-th key
        chosen_prefix = prefix | (static_cast<uint32_t>(threadIdx.x) << shift);
        chosen_need = need - exclusive;
        chosen_done = count == need - exclusive;
      }
      __syncthreads();
      prefix = chosen_prefix;
      need = chosen_need;
      mask |= 0xffu << shift;
      if (chosen_done) break;  // the whole bin is kept: lower digits change nothing
    }
    // Compaction in ascending index: each thread a contiguous range; one scan of (below, tied)
    // counts, packed as below | tied << 16 (each at most nk <= 8192). Slot of a kept block = kept
    // blocks before it = (below before) + min(tied before, need).
    const int per_thread = (nk + kTopThreads - 1) / kTopThreads;
    const int begin = min(nk, static_cast<int>(threadIdx.x) * per_thread), end = min(nk, begin + per_thread);
    int below = 0, tied = 0;
    for (int j = begin; j < end; ++j) {
      const uint32_t m = top_keys[j] & mask;
      below += m < prefix;
      tied += m == prefix;
    }
    const int packed = below | (tied << 16);
    const int before = cta_inclusive_scan(packed, warp_totals) - packed;
    int below_rank = before & 0xffff, tied_rank = before >> 16;
    int32_t* out = a.indices + row * a.capacity;
    for (int j = begin; j < end; ++j) {
      const uint32_t m = top_keys[j] & mask;
      if (m < prefix) {
        out[below_rank + min(tied_rank, need)] = j;
        ++below_rank;
      } else if (m == prefix) {
        if (tied_rank < need) out[below_rank + tied_rank] = j;
        ++tied_rank;
      }
    }
    if (threadIdx.x == 0) a.counts[row] = a.keep;
    __syncthreads();  // top_keys and warp_totals are reused by the next row
  }
}

// ---- 5c. fixed budgets on rows of up to kMaxWarpTopBlocks: one warp per row ---------------------
//
// The same radix select and compaction as select_top_kernel, by one warp instead of one CTA: no
// CTA barriers (select_top_kernel has four per radix pass, with 8 warps waiting on the slowest),
// the 256-bin scan as 8 bins per lane plus one warp scan, and the compaction by ballots over 32
// consecutive indices at a time. The 128K benchmark's rows (1024 key blocks, 32768 rows) fit.
// The kept set is a function of the keys alone (the `keep` smallest order keys), so it equals
// select_top_kernel's and select_blocks' bit for bit.
constexpr int kWarpTopWarps = 4;  // rows in flight per CTA
constexpr int kMaxWarpTopBlocks = 2048;

// Dynamic shared memory: per warp, 256 bins then the nk high words of the row keys (nk rounded up
// to 4, so that every warp's bins start 16-byte aligned).
__host__ __device__ inline int warp_top_stride(int nk) { return kRadixBins + (nk + 3) / 4 * 4; }
__host__ __device__ inline size_t warp_top_smem_bytes(int nk) {
  return static_cast<size_t>(kWarpTopWarps) * warp_top_stride(nk) * sizeof(uint32_t);
}

// grid-stride over rows by warp, kWarpTopWarps * 32 threads; nk <= kMaxWarpTopBlocks, 1 <= keep
// <= nk, capacity == keep.
__global__ void __launch_bounds__(kWarpTopWarps * 32) select_top_warp_kernel(SelectArgs a) {
  extern __shared__ __align__(16) uint32_t warp_top_smem[];
  const int nk = a.nk, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t* hist = warp_top_smem + static_cast<size_t>(warp) * warp_top_stride(nk);  // [256]
  uint32_t* keys = hist + kRadixBins;                                                 // [nk]
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpTopWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpTopWarps + warp; row < a.rows; row += warps) {
    const float* logits = a.logits + row * nk;
#pragma unroll 8
    for (int j = lane; j < nk; j += 32) keys[j] = static_cast<uint32_t>(order_key(logits[j], j) >> 32);
    warp_top_select(keys, hist, nk, a.keep, a.indices + row * a.capacity);
    if (lane == 0) a.counts[row] = a.keep;
    __syncwarp();  // keys and bins are reused by the warp's next row
  }
}

}  // namespace sparsa::cuda::ba_att
