// Internal: the split-KV prefix executor, for few queries (len_q <= 64) against a long KV
// (Flash-Decoding: Dao, Haziza, Massa, Sizov 2023, https://pytorch.org/blog/flash-decoding/).
//
// With few queries the flash executor has one CTA per (batch, query head) and leaves the chip
// idle; and the time is the K/V read, not arithmetic. So:
//  - GQA packing: the `group` query heads of one kv head are stacked into the M dimension of
//    one tile (row r of the stack = query r % len_q of head h_kv * group + r / len_q), so every
//    K/V byte is loaded from memory once per 64 stacked rows, not once per query head.
//  - Split-KV: the key tiles of one kv head are dealt to `num_splits` CTAs, split s taking the
//    contiguous tiles [s T / S, (s + 1) T / S) (grid: m-tile, split, batch * heads_kv; the m-tiles
//    of a split run side by side and share K/V through L2). The host picks S so that the grid is
//    exactly one wave of resident CTAs (attention.cu says why). Each CTA runs the same online
//    softmax as the flash executor; with one split it writes O and LSE directly.
//  - Merge, in the same kernel (no second launch). With S > 1 every CTA writes its partial (O
//    normalised by its own sum, f32, and its LSE) to the workspace, rows of one (m-tile,
//    batch * kv head) "merge group" laid out [row][split][D] so that one row's S partials are
//    contiguous; then it arrives on the group's counter (one acq_rel atomic). The partials
//    of a row merge as (the O+LSE contract, docs/architecture.md)
//      LSE = m + log sum_s exp(LSE_s - m),  O = sum_s exp(LSE_s - LSE) O_s     (m = max_s LSE_s)
//    Who merges: the CTA that arrives last knows every partial is visible, and could merge all.
//    Alone it would read all S x 64 partial rows (1 MB at S = 33, d 128) through one SM: at the
//    ~100 GB/s one SM draws from L2 (an estimate, not measured here) ~10 us on the critical path
//    of a ~45 us call. So the CTAs that arrived earlier wait for the count to reach S (they are
//    resident: the grid is one wave), and then split s merges rows [s c, (s + 1) c) of the m-tile
//    (c = ceil(rows / S), about 64 / S rows), all in parallel, with no further atomics. The wait
//    is bounded (merge_wait_ns): a CTA that gives up records its split in the group's orphan list
//    and merges nothing; the last CTA to depart (a third counter; it knows every CTA has arrived)
//    merges the orphans' rows. So the result is the same and nothing hangs even if the CTAs of a
//    group were not all resident at once. Each row is merged by exactly one CTA in a fixed order
//    of splits, so the output does not depend on who merged it. The last CTA out also resets the
//    group's counters to zero for the next call (the workspace is zeroed once, when allocated;
//    no memset per call).
//    After a row is merged its partial lines are dropped from L2 (discard.global.L2): they are
//    dead, and written back (8.6 MB at the prefix shape, 264 CTAs x 32 KB) they would take HBM
//    bandwidth from the next call's K/V stream.
//  - Programmatic dependent launch: the kernel may be launched before the previous kernel in the
//    stream has finished (the host asks for it); it waits for that kernel (griddepcontrol.wait)
//    before touching global memory, and lets the next kernel launch once its own K/V loop is done.
// K/V tiles stream through a STAGES-deep cp.async ring (STAGES - 1 tiles in flight while one is
// computed); Q's fragments stay in registers for the whole key range.
#pragma once

#include <cstdint>

#include "cuda/attention/flash_kernel.cuh"
#include "cuda/common/mma.cuh"

namespace sparsa::cuda::detail {

constexpr int kSplitKvMaxSplits = 256;  // a split index fits the uint8_t orphan entries
// How long a CTA waits for the rest of its merge group before leaving its rows to the last CTA
// out. Resident CTAs of one wave arrive within microseconds of each other (equal work); the bound
// only matters if they are not all resident, and then only delays, never changes, the result.
constexpr unsigned long long kMergeWaitNs = 200'000;

// One merge group's counters, zero between calls (orphan entries past `withdrawn` are unused);
// 128-byte aligned so that groups polling their own counter do not share an L2 line.
struct alignas(128) SplitKvCounters {
  unsigned arrive;     // CTAs whose partial is written
  unsigned depart;     // CTAs done with the counters
  unsigned withdrawn;  // CTAs that stopped waiting; their splits are in orphan[0, withdrawn)
  uint8_t orphan[kSplitKvMaxSplits];
};

struct SplitKvParams : AttentionArgs {
  int head_dim = 0;
  int rows = 0;          // group * len_q: stacked query rows per kv head
  int num_kv_tiles = 0;  // ceil(len_kv / BN)
  int num_splits = 1;    // CTAs per (m-tile, batch, kv head) along the keys, <= kSplitKvMaxSplits
  // Workspace (unused with one split): partials [merge group][64 rows][num_splits] (O rows of
  // head_dim floats; LSE floats) and one SplitKvCounters per merge group (m-tile fastest).
  float* part_o = nullptr;
  float* part_lse = nullptr;
  SplitKvCounters* counters = nullptr;
  unsigned long long merge_wait_ns = kMergeWaitNs;  // the bound on waiting for the merge group
};

template <int D, int BN, int STAGES>
struct SplitKvShape {
  static constexpr int kWarps = 4, kThreads = 128, kBM = 64;  // 4 warps x 16 stacked rows
  static constexpr int kSmemBytes = (kBM + STAGES * 2 * BN) * D * 2;  // Q + STAGES x (K, V)
};


// ---- small wrappers over the PTX the merge and the dependent launch need ----
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned atomic_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// Drops a 128-byte L2 line without writing it back; its contents become undefined.
__device__ __forceinline__ void discard_l2_line(const void* p) {
  asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(p) : "memory");
}

// Merges rows [rl_begin, rl_end) of the m-tile starting at stacked row row0 (merge group
// `merge_group`) from their S partials and writes O and LSE. All 128 threads, in "slots" of D/4
// threads (kSlots = 512 / D of them); thread t owns the 4 columns from 4 * (t % (D/4)). Up to
// kSlots rows are merged side by side (a pass of P rows, kSlots / P slots per row: with S = 33
// splits a CTA merges 2 rows, both in one pass; one after the other they were two L2 round trips
// in series). A slot accumulates the splits s = slot / P + j * (kSlots / P) of its row with its
// own running maximum, kBatch splits' loads in flight at a time; the slots of a row then combine
// through shared memory, rescaled to the common maximum. `scratch`: 4 * 128 + 16 floats.
template <class T, int D>
__device__ void merge_rows(const SplitKvParams& p, float* scratch, int merge_group, int row0, int b, int h_kv,
                           int rl_begin, int rl_end) {
  constexpr int kThreads = 128, kQuads = D / 4, kSlots = kThreads / kQuads, kBM = 64;
  constexpr int kBatch = 24;  // loads in flight per thread: 2 slots x 24 covers S = 33 in one round
  constexpr int kLineFloats = 128 / 4;
  const int S = p.num_splits, quad = threadIdx.x % kQuads, slot = threadIdx.x / kQuads;
  float4* acc_s = reinterpret_cast<float4*>(scratch);  // [kSlots][kQuads]
  float* max_s = scratch + 4 * kThreads;               // [kSlots]
  float* sum_s = max_s + kSlots;                       // [kSlots]
  for (int pass = rl_begin; pass < rl_end; pass += kSlots) {
    const int P = min(kSlots, rl_end - pass), per_row = kSlots / P;
    const int rl = pass + slot % P;  // this slot's row
    const bool active = slot < P * per_row;
    const int64_t first = (static_cast<int64_t>(merge_group) * kBM + rl) * S;  // partial (row, split 0)
    const float* po = p.part_o + first * D;
    const float* pl = p.part_lse + first;
    float run_max = -INFINITY, run_sum = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = slot / P; active && s0 < S; s0 += kBatch * per_row) {
      float l[kBatch];
      float4 x[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = s0 + k * per_row;
        l[k] = s < S ? __ldcg(pl + s) : -INFINITY;
        x[k] = s < S ? __ldcg(reinterpret_cast<const float4*>(po + static_cast<int64_t>(s) * D) + quad)
                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
      float m = run_max;
#pragma unroll
      for (int k = 0; k < kBatch; ++k) m = fmaxf(m, l[k]);
      if (m == -INFINITY) continue;  // no split of this batch saw a key
      const float rescale = expf(run_max - m);  // 0 while run_max is -inf
      run_sum *= rescale;
      acc.x *= rescale, acc.y *= rescale, acc.z *= rescale, acc.w *= rescale;
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const float w = expf(l[k] - m);  // 0 for a split that saw no key, and past S
        run_sum += w;
        acc.x += w * x[k].x, acc.y += w * x[k].y, acc.z += w * x[k].z, acc.w += w * x[k].w;
      }
      run_max = m;
    }
    acc_s[slot * kQuads + quad] = acc;
    if (quad == 0) max_s[slot] = run_max, sum_s[slot] = run_sum;
    __syncthreads();  // every slot's sums are in shared memory, and every load of the pass is done
    if (threadIdx.x < P * kQuads) {  // thread (row r of the pass, quad) combines the slots of row r
      const int r = threadIdx.x / kQuads;
      float m = -INFINITY;
      for (int j = 0; j < per_row; ++j) m = fmaxf(m, max_s[r + j * P]);
      float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float sum = 0.0f;
      if (m != -INFINITY) {
        for (int j = 0; j < per_row; ++j) {  // slots in a fixed order: the result does not depend on timing
          const float f = expf(max_s[r + j * P] - m);  // 0 for a slot that saw no key
          const float4 a = acc_s[(r + j * P) * kQuads + quad];
          sum += f * sum_s[r + j * P];
          o.x += f * a.x, o.y += f * a.y, o.z += f * a.z, o.w += f * a.w;
        }
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int row = row0 + pass + r, h = h_kv * p.group + row / p.len_q, i = row % p.len_q;
      T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
      const int col = quad * 4;
      const uint32_t packed[2] = {Pair<T>::pack(o.x * inv, o.y * inv), Pair<T>::pack(o.z * inv, o.w * inv)};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (p.aligned_out) {
          *reinterpret_cast<uint32_t*>(out + col + 2 * e) = packed[e];
        } else {
          reinterpret_cast<uint16_t*>(out)[col + 2 * e] = static_cast<uint16_t>(packed[e] & 0xffffu);
          reinterpret_cast<uint16_t*>(out)[col + 2 * e + 1] = static_cast<uint16_t>(packed[e] >> 16);
        }
      }
      if (quad == 0) {
        p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
            sum > 0.0f ? m + logf(sum) : -INFINITY;
      }
    }
    // The pass's partial O rows (S * D floats each, 128-byte aligned, consecutive) are dead: drop
    // them from L2 unwritten.
    const float* pass_o = p.part_o + (static_cast<int64_t>(merge_group) * kBM + pass) * S * D;
    for (int line = threadIdx.x; line < P * S * D / kLineFloats; line += kThreads)
      discard_l2_line(pass_o + line * kLineFloats);
    __syncthreads();  // before the next pass overwrites the scratch
  }
}

// The end of a split-KV CTA, shared by both kernels (the same 4 warps x 16 stacked rows and the
// mma.m16n8k16 accumulator layout, which wgmma's m64 layout repeats): with one split, O / l and
// LSE straight to the output; with several, this CTA's partial to the workspace, then the fused
// merge (arrive; wait, bounded, for the group; merge this CTA's rows; depart), as the comment at
// the top of this file says. `smem`: at least (4 * 128 + 80) floats no longer in use.
template <class T, int D>
__device__ void split_kv_finish(const SplitKvParams& p, uint8_t* smem, const float (&o)[D / 8][4],
                                const float (&row_max)[2], const float (&row_sum)[2], int row0, int split, int b,
                                int h_kv) {
  constexpr int BM = 64, THREADS = 128, kDT = D / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const bool warp_active = row0 + warp * 16 < p.rows;
  if (p.num_splits == 1) {  // ---- one split: O / l and LSE straight to the output ----
    if (!warp_active) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[r]);
      const int row = row0 + warp * 16 + g + 8 * r;
      if (row >= p.rows) continue;
      const int h = h_kv * p.group + row / p.len_q, i = row % p.len_q;
      T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
      float* lse = p.lse + b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2];
      store_row<T, kDT>(out, lse, o, r, l, row_max[r], p.scale_log2, p.aligned_out);
    }
    return;
  }

  // ---- several splits: this CTA's partial to the workspace ----
  const int S = p.num_splits;
  const int merge_group = blockIdx.z * gridDim.x + blockIdx.x;
  if (warp_active) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[r]);
      const int rl = warp * 16 + g + 8 * r;
      if (row0 + rl >= p.rows) continue;
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int64_t prow = (static_cast<int64_t>(merge_group) * BM + rl) * S + split;
      float* po = p.part_o + prow * D;
#pragma unroll
      for (int n = 0; n < kDT; ++n)
        *reinterpret_cast<float2*>(po + n * 8 + 2 * c) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      if (c == 0) p.part_lse[prow] = row_lse(l, row_max[r], p.scale_log2);
    }
  }

  // ---- arrive; wait (bounded) for the group; merge this CTA's rows; depart ----
  // Split s merges rows [s chunk, (s + 1) chunk) of the m-tile: about 64 / S rows per CTA.
  SplitKvCounters* counters = p.counters + merge_group;
  float* scratch = reinterpret_cast<float*>(smem);  // the Q and K/V stages are free now
  int* flag = reinterpret_cast<int*>(scratch + 4 * THREADS + 64);
  const int valid_rows = min(BM, p.rows - row0);
  const int chunk = (valid_rows + S - 1) / S;
  auto merge_chunk = [&](int s) {
    merge_rows<T, D>(p, scratch, merge_group, row0, b, h_kv, min(valid_rows, s * chunk), min(valid_rows, (s + 1) * chunk));
  };
  __syncthreads();  // every thread's partial stores happen before thread 0's arrival (a release)
  if (threadIdx.x == 0) {
    // Release: this CTA's partials are visible to whoever acquires the count; acquire: so are
    // those of the CTAs counted before it. One instruction, where a fence in every thread and
    // then an atomic cost two round trips to L2 on the way out of the key loop.
    const unsigned ticket = atomic_add_acq_rel(&counters->arrive, 1u);
    bool ready = ticket + 1 >= static_cast<unsigned>(S);  // the last arrival: every partial is written
    if (!ready) {
      const unsigned long long start = global_timer_ns();
      while (!(ready = load_acquire(&counters->arrive) >= static_cast<unsigned>(S)) &&
             global_timer_ns() - start < p.merge_wait_ns) {
        __nanosleep(256);
      }
    }
    if (!ready) {  // give this CTA's rows to the last CTA out of the group
      const unsigned entry = atomicAdd(&counters->withdrawn, 1u);
      counters->orphan[entry] = static_cast<uint8_t>(split);
    }
    __threadfence();  // ready: acquire, the partials the count stands for are visible to this CTA;
                      // withdrawn: the orphan entry is visible before the departure below
    flag[0] = ready;
  }
  __syncthreads();
  if (flag[0]) merge_chunk(split);
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(&counters->depart, 1u) + 1 == static_cast<unsigned>(S);
    if (last) __threadfence();  // acquire: every CTA's partial and orphan entry is visible
    flag[1] = last ? static_cast<int>(load_acquire(&counters->withdrawn)) : -1;
  }
  __syncthreads();
  const int orphans = flag[1];
  if (orphans >= 0) {  // the last CTA out: merge the rows of the CTAs that stopped waiting, then reset
    for (int k = 0; k < orphans; ++k) merge_chunk(__ldcg(&counters->orphan[k]));
    if (threadIdx.x == 0) {  // no CTA of the group touches the counters any more
      atomicExch(&counters->arrive, 0u);
      atomicExch(&counters->depart, 0u);
      atomicExch(&counters->withdrawn, 0u);
    }
  }
}

// A split's key tiles [*tile_begin, + *num_tiles) of BN keys cut to those some row of the 64-row
// m-tile at stacked row row0 may see under the mask (row r of the stack is query r % len_q;
// windows do not decrease along the queries, so the m-tile's range is the windows of its smallest
// and largest query; a stack that wraps past a head holds every query). __host__ __device__ for
// tests/test_cuda_mask_logic.cu.
__host__ __device__ __forceinline__ void clip_split_tiles(const SplitKvParams& p, int row0, int bn, int& tile_begin,
                                                          int& num_tiles) {
  const int last = (row0 + 64 < p.rows ? row0 + 64 : p.rows) - 1;
  int i_min = 0, i_max = p.len_q - 1;
  if (last - row0 + 1 < p.len_q && row0 % p.len_q <= last % p.len_q) i_min = row0 % p.len_q, i_max = last % p.len_q;
  int key_min, key_max, unused;
  mask_window(p, i_min, p.len_q, p.len_kv, key_min, unused);
  mask_window(p, i_max, p.len_q, p.len_kv, unused, key_max);
  const int lo = key_min / bn, hi = (key_max + bn - 1) / bn;
  const int first = tile_begin > lo ? tile_begin : lo;
  const int end = tile_begin + num_tiles < hi ? tile_begin + num_tiles : hi;
  tile_begin = first;
  num_tiles = end - first > 0 ? end - first : 0;
}

// The mask hook of a split-KV CTA (MASKED kernels): this thread's two stacked rows' windows, and
// the split's tiles clipped (clip_split_tiles). A split left with no tile writes an empty
// partial (LSE -inf), which the merge weighs as 0.
template <int BN>
struct SplitKvMask {
  RowWindows rows;

  SplitKvMask() = default;  // no mask

  __device__ __forceinline__ SplitKvMask(const SplitKvParams& p, int row0, int warp, int& tile_begin,
                                         int& num_tiles) {
    const int g = threadIdx.x % 32 / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + warp * 16 + g + 8 * r;
      if (row < p.rows) mask_window(p, row % p.len_q, p.len_q, p.len_kv, rows.kb[r], rows.ke[r]);
    }
    clip_split_tiles(p, row0, BN, tile_begin, num_tiles);
  }
};

// MASKED: the per-element mask (AttentionArgs::mask_kind) compiled in.
template <class T, int D, int BN, int STAGES, bool MASKED = false>
__global__ void __launch_bounds__(128) split_kv_kernel(const SplitKvParams p) {
  using Shape = SplitKvShape<D, BN, STAGES>;
  constexpr int BM = Shape::kBM, THREADS = Shape::kThreads;
  constexpr int kDT = D / 8, kNT = BN / 8, kChunks = D / 8;
  constexpr uint32_t kTileBytes = BN * D * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  grid_dependency_wait();  // before any global memory access: the previous kernel has completed
  const uint32_t q_smem = smem_addr(smem);
  const uint32_t kv_smem = q_smem + BM * D * 2;  // stage s: K at 2s tiles, V at 2s + 1
  auto k_stage = [&](int s) { return kv_smem + 2 * s * kTileBytes; };
  auto v_stage = [&](int s) { return kv_smem + (2 * s + 1) * kTileBytes; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * BM, split = blockIdx.y;
  const int b = blockIdx.z / p.heads_kv, h_kv = blockIdx.z % p.heads_kv;
  // Split s owns key tiles [s T / S, (s + 1) T / S): sizes differ by at most one tile.
  int tile_begin = static_cast<int>(static_cast<int64_t>(split) * p.num_kv_tiles / p.num_splits);
  int num_tiles = static_cast<int>(static_cast<int64_t>(split + 1) * p.num_kv_tiles / p.num_splits) - tile_begin;
  const SplitKvMask<BN> mask = MASKED ? SplitKvMask<BN>(p, row0, warp, tile_begin, num_tiles) : SplitKvMask<BN>{};

  // ---- Q: the stacked rows of this m-tile (rows past p.rows read as zeros) ----
  const uint16_t* q_all = static_cast<const uint16_t*>(p.q);
  for (int idx = threadIdx.x; idx < BM * kChunks; idx += THREADS) {
    const int r = idx / kChunks, chunk = idx % kChunks, row = row0 + r;
    const uint16_t* src = nullptr;
    if (row < p.rows) {
      const int h = h_kv * p.group + row / p.len_q, i = row % p.len_q;
      src = q_all + b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2] + chunk * 8;
    }
    const uint32_t dst = q_smem + swizzle<D>(r, chunk);
    if (p.aligned_loads) {
      cp_async_16(dst, src != nullptr ? src : q_all, src != nullptr ? 16 : 0);
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
      if (src != nullptr) {
#pragma unroll
        for (int e = 0; e < 4; ++e) w[e] = uint32_t(src[2 * e]) | (uint32_t(src[2 * e + 1]) << 16);
      }
      asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
    }
  }

  // ---- K/V ring ----
  const uint16_t* k_base = static_cast<const uint16_t*>(p.k) + b * p.k_stride[0] + h_kv * p.k_stride[1];
  const uint16_t* v_base = static_cast<const uint16_t*>(p.v) + b * p.v_stride[0] + h_kv * p.v_stride[1];
  using KVCopy = TileCopy<D, BN, THREADS>;
  auto load_tile = [&](int t, int stage) {  // t: tile within this split
    int64_t token[KVCopy::kRows];
    gather_tokens<KVCopy>(token, (tile_begin + t) * BN, p.len_kv, nullptr, 0, p.len_kv);
    KVCopy::copy(k_stage(stage), k_base, p.k_stride[2], p.aligned_loads, token);
    KVCopy::copy(v_stage(stage), v_base, p.v_stride[2], p.aligned_loads, token);
  };
  // Copy group n holds tile n (group 0 also holds Q).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) load_tile(s, s);
    cp_async_commit();
  }

  float o[kDT][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // rows g, g + 8; sums per thread
#pragma unroll
  for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  uint32_t q_frag[D / 16][4];
  const bool warp_active = row0 + warp * 16 < p.rows;  // a warp with no real row only helps load

  for (int t = 0; t < num_tiles; ++t) {
    cp_async_wait<STAGES - 2>();  // group t (tile t) has landed
    __syncthreads();              // ... for every thread; and stage (t - 1) % STAGES is free again
    if (t + STAGES - 1 < num_tiles) load_tile(t + STAGES - 1, (t + STAGES - 1) % STAGES);
    cp_async_commit();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(q_frag[kk], q_smem + swizzle<D>(warp * 16 + (lane / 8 % 2) * 8 + lane % 8, kk * 2 + lane / 16));
    }
    if (!warp_active) continue;
    const int stage = t % STAGES;
    const uint32_t ks = k_stage(stage), vs = v_stage(stage);
    const int valid = min(BN, p.len_kv - (tile_begin + t) * BN);

    // S = Q K^T
    float s[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4];
        const int key = np * 16 + (lane / 16) * 8 + lane % 8;
        ldmatrix_x4(bk, ks + swizzle<D>(key, kk * 2 + (lane / 8) % 2));
        mma_16816<T>(s[2 * np], q_frag[kk], bk[0], bk[1]);
        mma_16816<T>(s[2 * np + 1], q_frag[kk], bk[2], bk[3]);
      }
    }
    // Online softmax, the flash executor's (flash_kernel.cuh); columns past len_kv are masked.
    if constexpr (MASKED) mask_tile<kNT>(s, mask.rows, (tile_begin + t) * BN);
    uint32_t p_frag[kNT / 2][4];
    float alpha[2];
    softmax_scores<kNT>(s, valid, p.scale_log2, row_max, row_sum, alpha,
                        [&](int n, const float(&prob)[4]) { pack_probs<T, kNT>(n, prob, p_frag); });
    rescale<kDT>(o, alpha);
    // O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        uint32_t bv[4];
        const int key = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
        ldmatrix_x4_trans(bv, vs + swizzle<D>(key, dp * 2 + lane / 16));
        mma_16816<T>(o[2 * dp], p_frag[kk], bv[0], bv[1]);
        mma_16816<T>(o[2 * dp + 1], p_frag[kk], bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();
  launch_dependents();  // K/V streamed: the next kernel in the stream may start launching
  split_kv_finish<T, D>(p, smem, o, row_max, row_sum, row0, split, b, h_kv);
}

}  // namespace sparsa::cuda::detail
