// Internal: the kernels of BA-Att's cuda selector (Algorithm 1 of the BA-Att paper, steps 1-4;
// docs/ba_att.md). The launcher is ba_att.cu; the CPU reference is src/methods/ba_att/cpu_ref.cpp.
//
//   1. norm_keys_*_kernel    a few lanes per token: ||x||_2 in f32, and the 64-bit radix key
//                            (segment | norm bits | index in the window, norm_key) that makes one
//                            stable keys-only cub::DeviceRadixSort of all tokens equal to a stable
//                            per-(batch, head, window) sort by norm (norms are >= 0, so their
//                            IEEE bits order as the values do);
//   2. (cub::DeviceRadixSort::SortKeys, in the launcher), then perm_from_keys_kernel;
//   3. block_features_kernel one CTA per (batch, head, block) of permuted tokens: f32 mean and
//                            population variance (two passes, as cpu.cpp) and, for exact / trace,
//                            the covariance; written as the feature vector of cpu.cpp's header, so
//                            that every compensated logit is one inner product;
//   4. block_logits_*kernel  per (batch, query head): logits = A [nq, F] x B [nk, F]', an f32 SIMT
//                            product in 128x128 tiles (F % 4 == 0) or 64x64 tiles (GQA: query
//                            head h reads kv head h / group);
//   5. select_top_warp_kernel fixed budgets (kappa, density), rows of up to 2048 key blocks: one
//                            warp per query-block row, a radix select of the kappa-th (logit desc,
//                            index asc) key and a compaction of the kept indices, ascending;
//      select_top_kernel     the same for rows of up to 8192 key blocks, one CTA per row;
//      select_kernel         mass budgets (and rows over kMaxTopBlocks): a bitonic sort of those
//                            keys, the f64 cumulative mass, then the kept indices ascending.
// Non-finite norms and logits are recorded (lowest flat index) in an ErrorWord that the launcher
// reads back once at the end and turns into a Status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma.cuh"
#include "cuda/select/ba_att_keys.h"

namespace sparsa::cuda::ba_att {

// The first (lowest flat index) offending item per kind; ~0 (memset 0xff) when none.
struct ErrorWord {
  unsigned long long first[3];
};
enum ErrorSlot { kErrQNorm = 0, kErrKNorm = 1, kErrLogit = 2 };

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// A [batch, heads, len, d] input; strides in elements for (batch, head, seq), d contiguous.
template <class T>
struct Input {
  const T* data;
  int64_t stride_b, stride_h, stride_s;
  int heads, len, d;
  // Row `token` of (batch, head) bh = batch * heads + head.
  __device__ __forceinline__ const T* row(int64_t bh, int64_t token) const {
    return data + (bh / heads) * stride_b + (bh % heads) * stride_h + token * stride_s;
  }
};

// ---- 1. norms and sort keys -----------------------------------------------------------------

constexpr int kNormThreads = 256;
constexpr int kNormTokens = 8;  // vector path: tokens per lane group per step (16-byte loads in flight per lane)

// 16-byte loads of a row: kVector<T> elements each. The launcher takes the vector path when d is a
// multiple of it and every row starts 16-byte aligned (vector_rows() in ba_att.cu).
template <class T> constexpr int kVector = 16 / static_cast<int>(sizeof(T));

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

// ---- 4. block logits: a batched NT product of feature matrices -----------------------------------

constexpr int kTile = 64, kTileK = 16, kLogitThreads = 256;

// grid (ceil(nk / 64), ceil(nq / 64), batch * heads_q); logits [batch * heads_q, nq, nk]. Each
// thread computes a 4x4 patch (rows 4*ty.., columns 4*tx..), reading its operands from shared
// memory as float4; F % 4 == 0 (every kind when d % 4 == 0) loads the tiles as float4 too.
__global__ void __launch_bounds__(kLogitThreads)
    block_logits_kernel(const float* __restrict__ query_features, const float* __restrict__ key_features,
                        float* __restrict__ logits, int nq, int nk, int64_t F, int heads_q, int group, int heads_kv,
                        ErrorWord* err) {
  __shared__ __align__(16) float a_tile[kTileK][kTile + 4];
  __shared__ __align__(16) float b_tile[kTileK][kTile + 4];
  const int64_t z = blockIdx.z;
  const int64_t zk = (z / heads_q) * heads_kv + (z % heads_q) / group;
  const float* A = query_features + z * nq * F;
  const float* B = key_features + zk * nk * F;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int load_row = threadIdx.x / 4, load_col = (threadIdx.x % 4) * 4;
  const int ra = row0 + load_row, rb = col0 + load_row;
  const bool vector_loads = F % 4 == 0;
  float acc[4][4] = {};
  for (int64_t f0 = 0; f0 < F; f0 += kTileK) {
    float av[4] = {}, bv[4] = {};
    if (vector_loads) {  // f0 + load_col < F implies all four are in range
      if (f0 + load_col < F) {
        if (ra < nq) {
          const float4 x = *reinterpret_cast<const float4*>(A + ra * F + f0 + load_col);
          av[0] = x.x, av[1] = x.y, av[2] = x.z, av[3] = x.w;
        }
        if (rb < nk) {
          const float4 x = *reinterpret_cast<const float4*>(B + rb * F + f0 + load_col);
          bv[0] = x.x, bv[1] = x.y, bv[2] = x.z, bv[3] = x.w;
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const bool in_f = f0 + load_col + u < F;
        av[u] = ra < nq && in_f ? A[ra * F + f0 + load_col + u] : 0.0f;
        bv[u] = rb < nk && in_f ? B[rb * F + f0 + load_col + u] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      a_tile[load_col + u][load_row] = av[u];
      b_tile[load_col + u][load_row] = bv[u];
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      const float4 a4 = *reinterpret_cast<const float4*>(&a_tile[kk][4 * ty]);
      const float4 b4 = *reinterpret_cast<const float4*>(&b_tile[kk][4 * tx]);
      const float a[4] = {a4.x, a4.y, a4.z, a4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + 4 * ty + i;
    if (r >= nq) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = col0 + 4 * tx + j;
      if (c >= nk) continue;
      const int64_t flat = (z * nq + r) * nk + c;
      if (!isfinite(acc[i][j])) atomicMin(&err->first[kErrLogit], static_cast<unsigned long long>(flat));
      logits[flat] = acc[i][j];
    }
  }
}

// F % 4 == 0 (every kind when d % 4 == 0): 128x128 tiles, 8x8 outputs per thread (rows 4 ty..
// and 64 + 4 ty.., columns 4 tx.. and 64 + 4 tx..), k in steps of 8 through two shared buffers: the
// next step's float4s are loaded into registers while this step's are multiplied, one barrier a
// step. Every logit is still fmaf over k = 0, 1, ..., F - 1 in order (zero-padded past F), the
// order of block_logits_kernel: the two give the same values (a zero logit may differ in sign,
// which order_key and the budgets ignore).
constexpr int kBigTile = 128, kBigTileK = 8, kBigLogitThreads = 256;

__global__ void __launch_bounds__(kBigLogitThreads, 2)
    block_logits_big_kernel(const float* __restrict__ query_features, const float* __restrict__ key_features,
                            float* __restrict__ logits, int nq, int nk, int64_t F, int heads_q, int group,
                            int heads_kv, ErrorWord* err) {
  __shared__ __align__(16) float a_tile[2][kBigTileK][kBigTile + 4];
  __shared__ __align__(16) float b_tile[2][kBigTileK][kBigTile + 4];
  const int64_t z = blockIdx.z;
  const int64_t zk = (z / heads_q) * heads_kv + (z % heads_q) / group;
  const float* A = query_features + z * nq * F;
  const float* B = key_features + zk * nk * F;
  const int row0 = blockIdx.y * kBigTile, col0 = blockIdx.x * kBigTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  // Loads: thread t brings row t / 2, k (t % 2) * 4 .. + 3 of both tiles.
  const int load_row = threadIdx.x / 2, load_k = (threadIdx.x % 2) * 4;
  const bool a_in = row0 + load_row < nq, b_in = col0 + load_row < nk;
  const float* a_src = A + static_cast<int64_t>(row0 + load_row) * F + load_k;
  const float* b_src = B + static_cast<int64_t>(col0 + load_row) * F + load_k;
  auto load = [&](int64_t f0, float4& av, float4& bv) {
    const bool in_f = f0 + load_k < F;  // F % 4 == 0: all four or none
    av = a_in && in_f ? *reinterpret_cast<const float4*>(a_src + f0) : make_float4(0.f, 0.f, 0.f, 0.f);
    bv = b_in && in_f ? *reinterpret_cast<const float4*>(b_src + f0) : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  auto store = [&](int buf, const float4& av, const float4& bv) {
    a_tile[buf][load_k + 0][load_row] = av.x;
    a_tile[buf][load_k + 1][load_row] = av.y;
    a_tile[buf][load_k + 2][load_row] = av.z;
    a_tile[buf][load_k + 3][load_row] = av.w;
    b_tile[buf][load_k + 0][load_row] = bv.x;
    b_tile[buf][load_k + 1][load_row] = bv.y;
    b_tile[buf][load_k + 2][load_row] = bv.z;
    b_tile[buf][load_k + 3][load_row] = bv.w;
  };
  float acc[8][8] = {};
  float4 av, bv;
  load(0, av, bv);
  store(0, av, bv);
  __syncthreads();
  const int64_t steps = (F + kBigTileK - 1) / kBigTileK;
  for (int64_t step = 0; step < steps; ++step) {
    const int buf = static_cast<int>(step & 1);
    const bool more = step + 1 < steps;
    if (more) load((step + 1) * kBigTileK, av, bv);
#pragma unroll
    for (int kk = 0; kk < kBigTileK; ++kk) {
      const float4 a0 = *reinterpret_cast<const float4*>(&a_tile[buf][kk][4 * ty]);
      const float4 a1 = *reinterpret_cast<const float4*>(&a_tile[buf][kk][64 + 4 * ty]);
      const float4 b0 = *reinterpret_cast<const float4*>(&b_tile[buf][kk][4 * tx]);
      const float4 b1 = *reinterpret_cast<const float4*>(&b_tile[buf][kk][64 + 4 * tx]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    if (more) store(buf ^ 1, av, bv);  // buf ^ 1 was last read in the previous step, before its barrier
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = row0 + (i < 4 ? 4 * ty + i : 64 + 4 * ty + i - 4);
    if (r >= nq) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = col0 + (j < 4 ? 4 * tx + j : 64 + 4 * tx + j - 4);
      if (c >= nk) continue;
      const int64_t flat = (z * nq + r) * nk + c;
      if (!isfinite(acc[i][j])) atomicMin(&err->first[kErrLogit], static_cast<unsigned long long>(flat));
      logits[flat] = acc[i][j];
    }
  }
}

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
};

__host__ __device__ inline size_t select_bytes_per_row(int sort_size, int nk) {
  return static_cast<size_t>(sort_size) * sizeof(uint64_t) + (static_cast<size_t>(nk) + 7) / 8 * 8;
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

// Mass budget on the sorted keys: weights w_p = exp(l_p - l_0) (l_0 the maximum) in f64, and
// keep = the smallest k whose prefix sum reaches tau * (sum of all), as select_blocks.
__device__ inline int mass_keep(const uint64_t* keys, int nk, double tau) {
  __shared__ double warp_sums[kSelectWarps];
  __shared__ int first_reaching;
  const int per_thread = (nk + blockDim.x - 1) / blockDim.x;
  const int p_begin = min(nk, static_cast<int>(threadIdx.x) * per_thread), p_end = min(nk, p_begin + per_thread);
  const double max_logit = logit_of(keys[0]);
  double local = 0.0;
  for (int p = p_begin; p < p_end; ++p) local += exp(static_cast<double>(logit_of(keys[p])) - max_logit);
  // Inclusive scan of the per-thread sums over the CTA (threads in order = positions in order).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double inclusive = local;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const double up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
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
    running += exp(static_cast<double>(logit_of(keys[p])) - max_logit);
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

// grid-stride over rows. kGlobal: keys and flags in a.scratch (rows of any length); else in
// dynamic shared memory (select_bytes_per_row(sort_size, nk) bytes).
template <bool kGlobal>
__global__ void __launch_bounds__(kSelectThreads) select_kernel(SelectArgs a) {
  extern __shared__ uint64_t select_smem[];
  __shared__ int warp_counts[kSelectWarps];
  uint64_t* keys = kGlobal ? a.scratch + blockIdx.x * (select_bytes_per_row(a.sort_size, a.nk) / 8) : select_smem;
  uint8_t* flags = reinterpret_cast<uint8_t*>(keys + a.sort_size);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float* logits = a.logits + row * a.nk;
    for (int j = threadIdx.x; j < a.sort_size; j += blockDim.x) keys[j] = j < a.nk ? order_key(logits[j], j) : ~0ull;
    for (int j = threadIdx.x; j < a.nk; j += blockDim.x) flags[j] = 0;
    __syncthreads();
    bitonic_sort(keys, a.sort_size);
    const int keep = a.mass ? mass_keep(keys, a.nk, a.tau) : a.keep;
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
constexpr int kRadixBins = 256;
constexpr int kMaxTopBlocks = 8192;
static_assert(kTopThreads == kRadixBins, "the bin scan gives each thread one bin");

// Inclusive sum of `value` over the CTA's threads in order (kTopThreads of them). warp_totals is
// written before the one __syncthreads() inside and read after it: the caller synchronises before
// the next call overwrites it.
__device__ inline int cta_inclusive_scan(int value, int* warp_totals) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
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
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpTopWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpTopWarps + warp; row < a.rows; row += warps) {
    const float* logits = a.logits + row * nk;
#pragma unroll 8
    for (int j = lane; j < nk; j += 32) keys[j] = static_cast<uint32_t>(order_key(logits[j], j) >> 32);
    // Invariant (as select_top_kernel): the keep-th smallest key matches `prefix` on the bits of
    // `mask` and is the need-th smallest (1-based) of the keys that do; keep - need keys are below.
    uint32_t prefix = 0, mask = 0;
    int need = a.keep;
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
    // first `need` (ascending index) of those equal to it; slot = kept blocks before it.
    int32_t* out = a.indices + row * a.capacity;
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
    if (lane == 0) a.counts[row] = a.keep;
    __syncwarp();  // keys and bins are reused by the warp's next row
  }
}

}  // namespace sparsa::cuda::ba_att
