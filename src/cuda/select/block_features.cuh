// Internal: step 2 of BA-Att's cuda selector (ba_att_kernels.cuh): block statistics as feature
// vectors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/select/ba_att_common.cuh"

namespace sparsa::cuda::ba_att {

// ---- 3. block statistics as feature vectors ----------------------------------------------------

enum FeatureKind : int { kPlain = 0, kDiagonal = 1, kTrace = 2, kExact = 3 };

// F per kind: d, 3d, d + d^2, d + 2 d^2 (cpu.cpp's header has the derivation).
__host__ __device__ inline int64_t feature_size(int kind, int64_t d) {
  switch (kind) {
    case kDiagonal: return 3 * d;
    case kTrace: return d + d * d;
    case kExact: return d + 2 * d * d;
    default: return d;
  }
}

struct FeatureArgs {
  int kind = kPlain;
  int64_t F = 0;
  float scale = 1.0f;  // query side: the logit scale
  float c = 0.0f;      // query side: beta * scale^2
  int block = 0;       // tokens per block
  int num_blocks = 0;
  const int32_t* perm = nullptr;  // [bh, len] or null (identity)
  float* features = nullptr;      // out: [bh, num_blocks, F]
  int64_t items = 0;              // batch * heads * num_blocks (block_stats_kernel)
  FastDiv blocks_div;             // num_blocks (block_stats_kernel)
};

constexpr int kFeatureThreads = 128;
constexpr int kCovTokens = 8;  // tokens staged in shared memory per covariance step
constexpr int kCovRegs = 8;    // covariance entries per thread per pass

// Dynamic shared memory of block_features_kernel: mean and var [d] each, then kCovTokens
// deviation rows (exact / trace).
__host__ __device__ inline size_t feature_smem_bytes(int kind, int d) {
  const bool cov = kind == kTrace || kind == kExact;
  return static_cast<size_t>(2 + (cov ? kCovTokens : 0)) * d * sizeof(float);
}

// One feature vector from a block's f32 mean m and population variance v of dimension t (plain
// and diagonal; cpu.cpp's header has the derivation). Query side: a = [scale*m, c*v, c*m^2];
// key side: b = [m, m^2 + v, v].
template <bool kQuery>
__device__ __forceinline__ void write_mean_var(float* f, const FeatureArgs& a, int d, int t, float m, float v) {
  if (kQuery) {
    f[t] = a.scale * m;
    if (a.kind == kDiagonal) {
      f[d + t] = a.c * v;
      f[2 * d + t] = a.c * m * m;
    }
  } else {
    f[t] = m;
    if (a.kind == kDiagonal) {
      f[d + t] = fmaf(m, m, v);
      f[2 * d + t] = v;
    }
  }
}

// The general path (any layout, every kind): grid (num_blocks, batch * heads), one CTA per block,
// thread t owns dimensions t, t + 128, ...; f32 mean and population variance in two passes over
// global memory (as cpu.cpp), and for exact / trace the covariance. Query side: a = [scale*mean,
// c*var, c*mean^2] (diagonal), [scale*mean, c*vec cov] (trace), [scale*mean, c*vec cov,
// c*vec(mean mean')] (exact). Key side: b = [mean, mean^2 + var, var], [mean, vec cov],
// [mean, vec(cov + mean mean'), vec cov]. Plain and diagonal inputs with 16-byte rows take
// block_stats_kernel below instead (the 128K benchmark's path).
template <class T, bool kQuery>
__global__ void __launch_bounds__(kFeatureThreads) block_features_kernel(Input<T> x, FeatureArgs a) {
  extern __shared__ __align__(16) float smem[];
  const int d = x.d;
  float* mean = smem;           // [d]
  float* var = smem + d;        // [d]
  float* dev = smem + 2 * d;    // [kCovTokens, d] deviations (exact / trace)
  const int blk = blockIdx.x;
  const int64_t bh = blockIdx.y;
  const int begin = blk * a.block;
  const int n = min(a.block, x.len - begin);
  const int32_t* perm = a.perm != nullptr ? a.perm + bh * x.len : nullptr;
  auto token = [&](int p) -> int64_t { return perm != nullptr ? perm[p] : p; };
  const float inv_n = 1.0f / static_cast<float>(n);

  for (int t = threadIdx.x; t < d; t += blockDim.x) {
    float sum = 0.0f;
#pragma unroll 4
    for (int p = begin; p < begin + n; ++p) sum += to_float(x.row(bh, token(p))[t]);
    const float m = sum / static_cast<float>(n);
    float sq = 0.0f;
#pragma unroll 4
    for (int p = begin; p < begin + n; ++p) {
      const float dv = to_float(x.row(bh, token(p))[t]) - m;
      sq = fmaf(dv, dv, sq);
    }
    mean[t] = m;
    var[t] = sq * inv_n;
  }
  __syncthreads();

  float* f = a.features + (bh * a.num_blocks + blk) * a.F;
  for (int t = threadIdx.x; t < d; t += blockDim.x) write_mean_var<kQuery>(f, a, d, t, mean[t], var[t]);
  if (a.kind != kTrace && a.kind != kExact) return;

  // Covariance entries e = i * d + j, kCovRegs per thread per pass, over tokens staged kCovTokens
  // at a time as deviations from the mean (the two-pass form of cpu.cpp).
  const int64_t dd = static_cast<int64_t>(d) * d;
  for (int64_t e0 = 0; e0 < dd; e0 += static_cast<int64_t>(blockDim.x) * kCovRegs) {
    float acc[kCovRegs] = {};
    for (int p0 = begin; p0 < begin + n; p0 += kCovTokens) {
      const int count = min(kCovTokens, begin + n - p0);
      __syncthreads();
      for (int idx = threadIdx.x; idx < count * d; idx += blockDim.x) {
        const int pp = idx / d, t = idx % d;
        dev[pp * d + t] = to_float(x.row(bh, token(p0 + pp))[t]) - mean[t];
      }
      __syncthreads();
      for (int pp = 0; pp < count; ++pp) {
#pragma unroll
        for (int r = 0; r < kCovRegs; ++r) {
          const int64_t e = e0 + static_cast<int64_t>(r) * blockDim.x + threadIdx.x;
          if (e < dd) acc[r] = fmaf(dev[pp * d + e / d], dev[pp * d + e % d], acc[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kCovRegs; ++r) {
      const int64_t e = e0 + static_cast<int64_t>(r) * blockDim.x + threadIdx.x;
      if (e >= dd) continue;
      const float cov = acc[r] * inv_n;
      const float mm = mean[e / d] * mean[e % d];
      if (kQuery) {
        f[d + e] = a.c * cov;
        if (a.kind == kExact) f[d + dd + e] = a.c * mm;
      } else if (a.kind == kExact) {
        f[d + e] = cov + mm;
        f[d + dd + e] = cov;
      } else {
        f[d + e] = cov;
      }
    }
  }
}

// ---- 3b. plain / diagonal statistics of 16-byte rows: a persistent, double-buffered gather ------
//
// The 128K benchmark's path (d = 128 bf16, blocks of 128 tokens, gathered through the sort's
// permutation): 32 KiB of rows per block, one 256-byte row per token. Each CTA walks the items
// (batch * head, block) item = blockIdx.x, + gridDim.x, ... with two stages of shared memory: while
// it reduces the rows of one item, the rows of the next are in flight (cp.async, no registers
// held), and the permutation entries of the one after that are in flight into registers, so a
// CTA never waits on the dependent perm -> row chain. Bytes in flight per SM: 32-64 KiB per CTA,
// 3 CTAs of 73.5 KiB shared memory per SM (d = 128 bf16) -> 96-192 KiB, against ~30 KiB that
// ~4 TB/s needs at ~1 us of loaded latency (more for gathered 256-byte rows, which open more DRAM
// pages than a stream). The reduction reads shared memory with 16-byte loads (thread (c, g):
// chunk c of d / kVector<T>, rows g, g + G, ..., G = kStatThreads / chunks), so each element
// costs one conversion and one add per pass: 2 x 16384 elements per 32 KiB block, a few hundred
// cycles of an SM against the ~2000 cycles its share of DRAM bandwidth needs for 32 KiB.
//
// Numerics: f32 mean, then the f32 population variance from the deviations (two passes, as
// cpu.cpp and block_features_kernel; the second pass reads shared memory, not DRAM). Each thread
// sums its rows in order, then the G partial sums are added in group order: a different but fixed
// order, within the same (n - 1) 2^-24 sum|x| bound as any order of n terms.
constexpr int kStatThreads = 256;
constexpr size_t kMaxStagedBytes = 64 * 1024;  // one stage (a block's rows) at most this
constexpr int kStatPermRegs = 4;  // permutation entries per thread prefetched: blocks up to 1024 tokens

struct StatLayout {
  size_t stage_bytes = 0;  // rows of one item: n_max * d * elem, 16-byte multiple
  size_t perm_bytes = 0;   // permutation entries of one item: n_max * 4, 16-byte multiple
  int groups = 0;          // G = kStatThreads / chunks
  size_t bytes = 0;        // 2 stages, 2 perm buffers, partial sums [G, d], means [d]
};

// n_max = min(block, len); d a multiple of the vector width, d / vector <= kStatThreads.
__host__ __device__ inline StatLayout stat_layout(int d, int n_max, int elem_bytes) {
  StatLayout l;
  l.stage_bytes = (static_cast<size_t>(n_max) * d * elem_bytes + 15) / 16 * 16;
  l.perm_bytes = (static_cast<size_t>(n_max) * 4 + 15) / 16 * 16;
  l.groups = kStatThreads / (d / (16 / elem_bytes));
  l.bytes = 2 * l.stage_bytes + 2 * l.perm_bytes + (static_cast<size_t>(l.groups) + 1) * d * sizeof(float);
  return l;
}

// V (4 or 8) partial sums as 16-byte stores: a warp writes one contiguous run, no bank conflicts.
template <int V>
__device__ __forceinline__ void store_partial(float* dst, const float (&acc)[V]) {
  static_assert(V % 4 == 0, "whole float4s");
#pragma unroll
  for (int k = 0; k < V; k += 4) *reinterpret_cast<float4*>(dst + k) = make_float4(acc[k], acc[k + 1], acc[k + 2], acc[k + 3]);
}

// grid: up to one wave of CTAs (items = batch * heads * num_blocks); dynamic shared memory
// stat_layout(d, n_max, sizeof(T)).bytes; a.kind plain or diagonal; n_max <= kStatThreads *
// kStatPermRegs.
template <class T, bool kQuery>
__global__ void __launch_bounds__(kStatThreads) block_stats_kernel(Input<T> x, FeatureArgs a, int n_max) {
  extern __shared__ __align__(16) unsigned char stat_smem[];
  constexpr int V = kVector<T>;
  const int d = x.d, chunks = d / V;
  const StatLayout layout = stat_layout(d, n_max, static_cast<int>(sizeof(T)));
  const int G = layout.groups;
  // Stage buf (the rows of one item) and its permutation entries (pointers computed, not indexed
  // from an array: a runtime index into a local array would put it on the stack).
  auto stage = [&](int buf) { return reinterpret_cast<T*>(stat_smem + buf * layout.stage_bytes); };
  auto perm_s = [&](int buf) {
    return reinterpret_cast<int32_t*>(stat_smem + 2 * layout.stage_bytes + buf * layout.perm_bytes);
  };
  float* partial = reinterpret_cast<float*>(stat_smem + 2 * layout.stage_bytes + 2 * layout.perm_bytes);  // [G, d]
  float* mean = partial + static_cast<size_t>(G) * d;                                                     // [d]
  const int c = threadIdx.x % chunks, g = threadIdx.x / chunks;
  const bool worker = g < G;  // threads past G * chunks only help with the permutation and the sums
  const int64_t total = a.items;

  // Item it = bh * num_blocks + block (it < 2^31: the launcher checks).
  auto item_of = [&](int64_t it, int64_t* bh, int* begin, int* n) {
    const uint32_t q = a.blocks_div.div(static_cast<uint32_t>(it));
    *bh = q;
    *begin = static_cast<int>(static_cast<uint32_t>(it) - q * a.blocks_div.divisor) * a.block;
    *n = min(a.block, x.len - *begin);
  };
  // Permutation entries of item it (positions begin .. begin + n - 1 of row bh) into registers.
  auto load_perm = [&](int64_t it, int32_t (&held)[kStatPermRegs]) {
    int64_t bh;
    int begin, n;
    item_of(it, &bh, &begin, &n);
#pragma unroll
    for (int r = 0; r < kStatPermRegs; ++r) {
      const int p = static_cast<int>(threadIdx.x) + r * kStatThreads;
      held[r] = p < n ? (a.perm != nullptr ? a.perm[bh * x.len + begin + p] : begin + p) : 0;
    }
  };
  auto store_perm = [&](int buf, const int32_t (&held)[kStatPermRegs]) {
#pragma unroll
    for (int r = 0; r < kStatPermRegs; ++r) {
      const int p = static_cast<int>(threadIdx.x) + r * kStatThreads;
      if (p < n_max) perm_s(buf)[p] = held[r];
    }
  };
  // cp.async of item it's rows into stage buf: thread (c, g) copies chunk c of rows g, g + G, ...,
  // exactly the chunks it reduces later.
  auto issue_rows = [&](int64_t it, int buf) {
    int64_t bh;
    int begin, n;
    item_of(it, &bh, &begin, &n);
    if (!worker) return;
    const uint32_t b = static_cast<uint32_t>(bh) / static_cast<uint32_t>(x.heads);
    const uint32_t h = static_cast<uint32_t>(bh) - b * static_cast<uint32_t>(x.heads);
    const T* base = x.data + b * x.stride_b + h * x.stride_h + c * V;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage(buf))) +
                         static_cast<uint32_t>(c * V * sizeof(T));
#pragma unroll 4
    for (int p = g; p < n; p += G) {
      cuda::detail::cp_async_16(dst + static_cast<uint32_t>(p * d * sizeof(T)),
                                base + static_cast<int64_t>(perm_s(buf)[p]) * x.stride_s, 16);
    }
  };

  int64_t item = blockIdx.x;
  if (item >= total) return;
  {
    int32_t held[kStatPermRegs];
    load_perm(item, held);
    store_perm(0, held);
    if (item + gridDim.x < total) {
      load_perm(item + gridDim.x, held);
      store_perm(1, held);
    }
  }
  __syncthreads();
  issue_rows(item, 0);
  cuda::detail::cp_async_commit();
  for (int iter = 0; item < total; ++iter, item += gridDim.x) {
    const int buf = iter & 1;
    const int64_t next = item + gridDim.x, after = next + gridDim.x;
    if (next < total) issue_rows(next, buf ^ 1);  // perm_s(buf ^ 1) was stored before the last barrier
    cuda::detail::cp_async_commit();              // (an empty group when there is no next item)
    int32_t held[kStatPermRegs] = {};
    if (after < total) load_perm(after, held);    // in flight during the reduction below
    cuda::detail::cp_async_wait<1>();             // this thread's copies of `item` have landed

    int64_t bh;
    int begin, n;
    item_of(item, &bh, &begin, &n);
    const float inv_n = 1.0f / static_cast<float>(n);
    const T* rows = stage(buf);
    // Pass 1: sums. Thread (c, g) reads only the chunks it copied, so no barrier is needed first.
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    if (worker) {
#pragma unroll 4
      for (int p = g; p < n; p += G) {
        const uint4 raw = *reinterpret_cast<const uint4*>(rows + p * d + c * V);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_float(e[k]);
      }
      store_partial(partial + g * d + c * V, acc);
    }
    __syncthreads();
    for (int t = threadIdx.x; t < d; t += kStatThreads) {
      float sum = 0.0f;
#pragma unroll 4
      for (int gg = 0; gg < G; ++gg) sum += partial[gg * d + t];
      mean[t] = sum / static_cast<float>(n);
    }
    __syncthreads();
    // Pass 2: squared deviations from the mean.
    if (worker) {
      float mv[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        mv[k] = mean[c * V + k];
        acc[k] = 0.0f;
      }
#pragma unroll 4
      for (int p = g; p < n; p += G) {
        const uint4 raw = *reinterpret_cast<const uint4*>(rows + p * d + c * V);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float dv = to_float(e[k]) - mv[k];
          acc[k] = fmaf(dv, dv, acc[k]);
        }
      }
      store_partial(partial + g * d + c * V, acc);
    }
    __syncthreads();
    float* f = a.features + (bh * a.num_blocks + begin / a.block) * a.F;
    for (int t = threadIdx.x; t < d; t += kStatThreads) {
      float sq = 0.0f;
#pragma unroll 4
      for (int gg = 0; gg < G; ++gg) sq += partial[gg * d + t];
      write_mean_var<kQuery>(f, a, d, t, mean[t], sq * inv_n);
    }
    // perm_s(buf) last fed issue_rows(item) an iteration ago; stage(buf) and partial are free
    // after this barrier, which also publishes the entries of `after` for the next iteration.
    if (after < total) store_perm(buf, held);
    __syncthreads();
  }
}

}  // namespace sparsa::cuda::ba_att
