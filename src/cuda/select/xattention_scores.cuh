// Internal: the block masses of XAttention's cuda selector (sparsa/xattention.h states them; the
// launcher is xattention.cu, the reference src/methods/xattention/xattention.cpp).
//
// One CTA per (batch, query head, query block) row: X[row, :] is that CTA's alone, so it is
// accumulated in a fixed order (deterministic) without atomics. The query block's groups are taken
// kChunkGroups at a time; for each chunk, two passes over the key groups the chunk sees, in tiles
// of 32 (one per lane):
//   pass 1: a[g, c] = scale/S * Qr[g] . Kr[c] (Qr[g] = concat_s Q[gS+S-1-s], Kr[c] = concat_s
//           K[cS+s], rows past the end zero), each group's running max and sum of exp(a - max)
//           over the key groups it sees (per lane, then combined across the warp);
//   pass 2: the same products again, p = exp(a - max) / sum, summed per key block (the warps'
//           column sums added in warp order, then a block's columns in index order) into X.
// The products run in f32 on the CUDA cores from shared-memory slices of kSliceF features:
// warp w holds query groups 2w and 2w + 1 of the chunk, lane c key group c of the tile, so a
// slice's Qr values are broadcasts and its Kr values (stored feature-major, padded) conflict-free.
// Non-finite masses are recorded (lowest flat index) in *err, which the launcher reads back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mask.cuh"
#include "cuda/select/ba_att_common.cuh"

namespace sparsa::cuda::xattention {

using ba_att::Input;
using ba_att::to_float;

constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kRowsPerWarp = 2;
constexpr int kChunkGroups = kScoreWarps * kRowsPerWarp;  // query groups per chunk
constexpr int kTileGroups = 32;                           // key groups per tile: one per lane
constexpr int kSliceF = 64;                               // features per staged slice

template <class T>
struct ScoreArgs {
  Input<T> q, k;
  int heads_q = 0, heads_kv = 0, group = 1;  // query head h reads kv head h / group
  int len_q = 0, len_kv = 0, d = 0, stride = 1;
  int block_q = 0, block_kv = 0, nq = 0, nk = 0;
  int q_groups = 0, k_groups = 0;
  float a_scale = 1.0f;  // scale / stride
  bool mask_aware = false;
  detail::MaskArgs mask;
  float* x = nullptr;                 // [rows, nk]
  unsigned long long* err = nullptr;  // lowest flat index of a non-finite mass; ~0 when none
};

// The key groups [lo, hi) query group g sees (all of them without mask_aware); empty: lo = hi = 0.
// Within a group the windows move forward and the empty ones come first, so the union is the first
// non-empty row's begin to the last row's end.
template <class T>
__device__ inline void visible_groups(const ScoreArgs<T>& a, int g, int& lo, int& hi) {
  if (!a.mask_aware) {
    lo = 0;
    hi = a.k_groups;
    return;
  }
  const int i0 = g * a.stride, i1 = min(a.len_q, (g + 1) * a.stride);
  int begin = 0, end = 0;
  bool found = false;
  for (int i = i0; i < i1 && !found; ++i) {
    int b, e;
    detail::mask_window(a.mask, i, a.len_q, a.len_kv, b, e);
    if (b < e) begin = b, found = true;
  }
  if (found) {
    int b;
    detail::mask_window(a.mask, i1 - 1, a.len_q, a.len_kv, b, end);
  }
  lo = found && begin < end ? begin / a.stride : 0;
  hi = found && begin < end ? (end + a.stride - 1) / a.stride : 0;
}

// (m, s) of a softmax combined with another part's (m2, s2); m = -inf means empty.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = (m == -INFINITY ? 0.0f : s * expf(m - mx)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - mx));
  m = mx;
}

template <class T>
__global__ void __launch_bounds__(kScoreThreads) xattention_scores_kernel(ScoreArgs<T> a) {
  __shared__ float q_slice[kChunkGroups][kSliceF];
  __shared__ float k_slice[kSliceF][kTileGroups + 1];
  __shared__ int group_lo[kChunkGroups], group_hi[kChunkGroups];
  __shared__ float group_max[kChunkGroups], group_sum[kChunkGroups];
  __shared__ float column_part[kScoreWarps][kTileGroups];
  __shared__ float column[kTileGroups];
  __shared__ int chunk_lo, chunk_hi;

  const int64_t row = blockIdx.x;
  const int qb = static_cast<int>(row % a.nq);
  const int64_t bh = row / a.nq;  // batch * heads_q + h
  const int64_t b = bh / a.heads_q, h = bh % a.heads_q;
  const int64_t bh_kv = b * a.heads_kv + h / a.group;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int S = a.stride, F = S * a.d;
  float* x = a.x + row * a.nk;
  for (int kb = threadIdx.x; kb < a.nk; kb += blockDim.x) x[kb] = 0.0f;

  const int groups_q = a.block_q / S, groups_k = a.block_kv / S;
  const int g_begin = qb * groups_q, g_end = min(a.q_groups, g_begin + groups_q);
  for (int g0 = g_begin; g0 < g_end; g0 += kChunkGroups) {
    const int G = min(kChunkGroups, g_end - g0);
    if (threadIdx.x == 0) chunk_lo = a.k_groups, chunk_hi = 0;
    __syncthreads();
    if (threadIdx.x < kChunkGroups) {
      int lo = 0, hi = 0;
      if (static_cast<int>(threadIdx.x) < G) visible_groups(a, g0 + threadIdx.x, lo, hi);
      group_lo[threadIdx.x] = lo;
      group_hi[threadIdx.x] = hi;
      if (lo < hi) {
        atomicMin(&chunk_lo, lo);
        atomicMax(&chunk_hi, hi);
      }
    }
    __syncthreads();
    const int c_begin = chunk_lo / kTileGroups * kTileGroups, c_end = chunk_hi;
    float m[kRowsPerWarp], s[kRowsPerWarp];
    for (int r = 0; r < kRowsPerWarp; ++r) m[r] = -INFINITY, s[r] = 0.0f;

    for (int pass = 0; pass < 2; ++pass) {
      for (int c0 = c_begin; c0 < c_end; c0 += kTileGroups) {
        float acc[kRowsPerWarp] = {};
        for (int f0 = 0; f0 < F; f0 += kSliceF) {
          // Kr[c0 + cc][f0 + ff]: key token (c0 + cc) S + (f0 + ff) / d, feature (f0 + ff) % d.
          for (int e = threadIdx.x; e < kSliceF * kTileGroups; e += blockDim.x) {
            const int ff = e % kSliceF, cc = e / kSliceF, f = f0 + ff, c = c0 + cc;
            const int j = c * S + f / a.d;
            float v = 0.0f;
            if (f < F && c < a.k_groups && j < a.len_kv) v = to_float(a.k.row(bh_kv, j)[f % a.d]);
            k_slice[ff][cc] = v;
          }
          // Qr[g0 + gi][f0 + ff]: query token (g0 + gi) S + S - 1 - (f0 + ff) / d.
          for (int e = threadIdx.x; e < kChunkGroups * kSliceF; e += blockDim.x) {
            const int ff = e % kSliceF, gi = e / kSliceF, f = f0 + ff;
            const int i = (g0 + gi) * S + S - 1 - f / a.d;
            float v = 0.0f;
            if (f < F && gi < G && i < a.len_q) v = to_float(a.q.row(bh, i)[f % a.d]);
            q_slice[gi][ff] = v;
          }
          __syncthreads();
#pragma unroll 8
          for (int ff = 0; ff < kSliceF; ++ff) {
            const float kv = k_slice[ff][lane];
#pragma unroll
            for (int r = 0; r < kRowsPerWarp; ++r) acc[r] = fmaf(q_slice[warp * kRowsPerWarp + r][ff], kv, acc[r]);
          }
          __syncthreads();
        }
        const int c = c0 + lane;
        float p_sum = 0.0f;
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const int gi = warp * kRowsPerWarp + r;
          if (gi >= G || c < group_lo[gi] || c >= group_hi[gi]) continue;
          const float logit = acc[r] * a.a_scale;
          if (pass == 0) {
            combine(m[r], s[r], logit, 1.0f);
          } else {
            p_sum += expf(logit - group_max[gi]) / group_sum[gi];
          }
        }
        if (pass == 1) {
          column_part[warp][lane] = p_sum;
          __syncthreads();
          if (threadIdx.x < kTileGroups) {
            float v = 0.0f;
            for (int w = 0; w < kScoreWarps; ++w) v += column_part[w][threadIdx.x];
            column[threadIdx.x] = v;
          }
          __syncthreads();
          // The key blocks the tile overlaps, a thread each: its columns in index order.
          const int kb0 = c0 / groups_k, kb1 = min(a.nk, (c0 + kTileGroups + groups_k - 1) / groups_k);
          for (int kb = kb0 + static_cast<int>(threadIdx.x); kb < kb1; kb += blockDim.x) {
            const int cb = max(c0, kb * groups_k) - c0, ce = min(c0 + kTileGroups, (kb + 1) * groups_k) - c0;
            float v = 0.0f;
            for (int cc = cb; cc < ce; ++cc) v += column[cc];
            x[kb] += v;
          }
          __syncthreads();
        }
      }
      if (pass == 0) {  // each group's (max, sum) over the lanes
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          for (int offset = 16; offset > 0; offset >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[r], offset);
            const float s2 = __shfl_xor_sync(0xffffffffu, s[r], offset);
            combine(m[r], s[r], m2, s2);
          }
          if (lane == 0) group_max[warp * kRowsPerWarp + r] = m[r], group_sum[warp * kRowsPerWarp + r] = s[r];
        }
        __syncthreads();
      }
    }
  }
  __syncthreads();
  for (int kb = threadIdx.x; kb < a.nk; kb += blockDim.x) {
    if (!isfinite(x[kb])) atomicMin(a.err, static_cast<unsigned long long>(row * a.nk + kb));
  }
}

}  // namespace sparsa::cuda::xattention
