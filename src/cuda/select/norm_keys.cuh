// Internal: step 1 of BA-Att's cuda selector (ba_att_kernels.cuh): token norms and radix sort
// keys, and the permutation from the sorted keys.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/select/ba_att_common.cuh"

namespace sparsa::cuda::ba_att {

// ---- 1. norms and sort keys -----------------------------------------------------------------

constexpr int kNormThreads = 256;
constexpr int kNormTokens = 8;  // vector path: tokens per lane group per step (16-byte loads in flight per lane)

// token g = bh * len + i (g < 2^31: the launcher checks). keys may be null (norms only); norms may
// be null. window: tokens per sort window (len for a global sort); windows_per_row =
// ceil(len / window); index_bits = bits_for(window) (norm_key in ba_att_keys.h).
struct NormArgs {
  int64_t total = 0;     // batch * heads * len
  FastDiv len, heads, window;
  int64_t windows_per_row = 1;
  int index_bits = 0;
  uint64_t* keys = nullptr;
  float* norms = nullptr;
  ErrorWord* err = nullptr;
  int err_slot = 0;
};

template <class T>
__device__ __forceinline__ const T* token_row(const Input<T>& x, const NormArgs& a, uint32_t g) {
  const uint32_t bh = a.len.div(g), i = g - bh * a.len.divisor;
  const uint32_t b = a.heads.div(bh), h = bh - b * a.heads.divisor;
  return x.data + b * x.stride_b + h * x.stride_h + static_cast<int64_t>(i) * x.stride_s;
}

// The norm of token g from its f32 sum of squares, its sort key and the non-finite check.
__device__ __forceinline__ void finish_token(const NormArgs& a, uint32_t g, float sum) {
  const float norm = sqrtf(sum);
  if (!isfinite(norm)) atomicMin(&a.err->first[a.err_slot], static_cast<unsigned long long>(g));
  if (a.norms != nullptr) a.norms[g] = norm;
  if (a.keys != nullptr) {
    const uint32_t bh = a.len.div(g), i = g - bh * a.len.divisor;
    const uint32_t w = a.window.div(i);
    a.keys[g] = norm_key(static_cast<uint64_t>(bh) * a.windows_per_row + w, norm, i - w * a.window.divisor,
                         a.index_bits);
  }
}

__host__ __device__ constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }

// Vector path. kLanes lanes per token (the fewest powers of two covering d / kVector<T> 16-byte
// chunks, at most 32), so a warp holds S = 32 / kLanes tokens side by side and takes kNormTokens
// such groups per step: S * kNormTokens consecutive tokens, every load of the step issued before
// the first sum. A grid of about one wave strides over the tokens.
//
// Why this shape (d = 128 bf16, the 128K benchmark: kLanes 16, 16 tokens = 4 KiB per warp step):
//  - bytes in flight: 8 x 16 B per lane, 4 KiB per warp; at 4 CTAs (32 warps) per SM that is
//    128 KiB per SM, about 4x what Little's law asks at ~4 TB/s and ~1 us of loaded DRAM latency
//    (4e12 B/s * 1e-6 s / 132 SMs = 30 KiB);
//  - instructions per byte: a lane's row pointers come from one (batch * head, token) split per
//    step (the tokens of a step share the row of the first unless a row ends inside it), not one
//    per token; the kLanes partial sums of the kNormTokens tokens are combined by a reduce-scatter
//    (each butterfly level hands half of the remaining token sums to the partner), 8 shuffles per
//    step instead of 8 * log2(kLanes) = 32 for a full butterfly per token; and each token is
//    finished (sqrtf, key, stores) by one lane, all tokens of the step in one pass, instead of
//    kNormTokens passes of 2 active lanes each.
// Summation order, fixed for a given d and dtype: each lane sums its chunks in order (fmaf of each
// element in turn; lanes past the chunks hold +0), then the tree of the reduce-scatter. It is not
// the scalar path's order, but token_norms() (the tests' view) takes the same path as the sort, so
// the sort and the tests see the same f32 norms.
template <class T, int kLanes>
__global__ void __launch_bounds__(kNormThreads) norm_keys_vector_kernel(Input<T> x, NormArgs a) {
  constexpr int V = kVector<T>;
  constexpr int U = kNormTokens;
  constexpr int S = 32 / kLanes;                                  // tokens side by side in a warp
  constexpr int kLevels = log2_of(kLanes);                        // butterfly levels
  constexpr int kHalvings = log2_of(U < kLanes ? U : kLanes);     // levels that halve the sums held
  constexpr int K = U >> kHalvings;                               // token sums per lane at the end
  constexpr int kHolderBits = kLevels - kHalvings;                // lanes holding the same token sum
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "kLanes: a power of two");
  static_assert((U & (U - 1)) == 0, "kNormTokens: a power of two");
  const int lane = threadIdx.x % 32, sub = lane / kLanes, part = lane % kLanes;
  const int chunks = x.d / V;
  const int64_t step = static_cast<int64_t>(S) * U;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t g0 = warp * step; g0 < a.total; g0 += warps * step) {  // warp-uniform
    // Token of group u for this lane: g0 + u * S + sub.
    const uint4* rows[U];
    const int64_t first = g0 + sub;
    if (first < a.total) {
      const uint32_t bh = a.len.div(static_cast<uint32_t>(first));
      const uint32_t i = static_cast<uint32_t>(first) - bh * a.len.divisor;
      if (i + static_cast<uint32_t>((U - 1) * S) < a.len.divisor) {  // the step stays in row bh
        const uint32_t b = a.heads.div(bh), h = bh - b * a.heads.divisor;
        const T* base = x.data + b * x.stride_b + h * x.stride_h + static_cast<int64_t>(i) * x.stride_s;
#pragma unroll
        for (int u = 0; u < U; ++u) rows[u] = reinterpret_cast<const uint4*>(base + u * S * x.stride_s);
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t g = first + u * S;
          rows[u] = g < a.total ? reinterpret_cast<const uint4*>(token_row(x, a, static_cast<uint32_t>(g))) : nullptr;
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) rows[u] = nullptr;
    }
    float sum[U];
#pragma unroll
    for (int u = 0; u < U; ++u) sum[u] = 0.0f;
    for (int c0 = 0; c0 < chunks; c0 += kLanes) {  // warp-uniform; once when d <= 32 * kVector<T>
      const int c = c0 + part;
      uint4 raw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) raw[u] = rows[u] != nullptr && c < chunks ? rows[u][c] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float v = to_float(e[k]);  // zero chunks add +0: fmaf(0, 0, s) == s for s >= +0
          sum[u] = fmaf(v, v, sum[u]);
        }
      }
    }
    // Reduce-scatter over the kLanes lanes of a token group. At level l (partner offset
    // kLanes >> (l + 1)) a lane keeps the upper half of its `held` sums when its offset bit is set,
    // the lower half otherwise, and adds the partner's copy of the half it keeps; once one sum is
    // left the remaining levels are a plain butterfly (a + b == b + a, so both partners agree).
    // After kLevels levels the lane holds the K sums of tokens u = hbits * K + k, hbits = its top
    // kHalvings offset bits.
#pragma unroll
    for (int level = 0; level < kLevels; ++level) {
      const int offset = kLanes >> (level + 1);
      if (level < kHalvings) {
        const bool upper = (part & offset) != 0;
        const int half = U >> (level + 1);
#pragma unroll
        for (int k = 0; k < half; ++k) {
          const float send = upper ? sum[k] : sum[k + half];
          const float keep = upper ? sum[k + half] : sum[k];
          sum[k] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      } else {
        sum[0] += __shfl_xor_sync(0xffffffffu, sum[0], offset);
      }
    }
    if ((part & ((1 << kHolderBits) - 1)) == 0) {  // one lane per held token sum finishes it
      const int hbits = part >> kHolderBits;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t g = g0 + static_cast<int64_t>(hbits * K + k) * S + sub;
        if (g < a.total) finish_token(a, static_cast<uint32_t>(g), sum[k]);
      }
    }
  }
}

// Scalar path (rows not 16-byte aligned, or d not a multiple of kVector<T>): one warp per token,
// element t summed by lane t % 32 in order, then a 32-lane butterfly.
template <class T>
__global__ void __launch_bounds__(kNormThreads) norm_keys_scalar_kernel(Input<T> x, NormArgs a) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (kNormThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= a.total) return;
  const T* row = token_row(x, a, static_cast<uint32_t>(g));
  float sum = 0.0f;
#pragma unroll 4
  for (int t = lane; t < x.d; t += 32) {
    const float v = to_float(row[t]);
    sum = fmaf(v, v, sum);
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) finish_token(a, static_cast<uint32_t>(g), sum);
}

// After the sort: perm[p] = the token at sorted position p of its row. Segments are contiguous
// and in order in the sorted keys, so position p lies in row bh = p / len, window r / window of
// it (r = p - bh * len), and the token is that window's first plus the index the key carries.
// 12 bytes of traffic per token (the keys-only sort saved 4 bytes per token on each of its 5+
// passes and the norm kernel's write of values).
constexpr int kPermThreads = 256;

__global__ void __launch_bounds__(kPermThreads)
    perm_from_keys_kernel(const uint64_t* __restrict__ keys, int32_t* __restrict__ perm, int64_t total, FastDiv len,
                          FastDiv window, int index_bits) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kPermThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kPermThreads + threadIdx.x; p < total; p += stride) {
    const uint32_t g = static_cast<uint32_t>(p);
    const uint32_t r = g - len.div(g) * len.divisor;
    perm[p] = static_cast<int32_t>(window.div(r) * window.divisor + norm_key_index(keys[p], index_bits));
  }
}

}  // namespace sparsa::cuda::ba_att
