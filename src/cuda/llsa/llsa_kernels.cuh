// Internal: the kernels of LLSA on the device (llsa.h gives the semantics; the CPU reference,
// src/methods/llsa/ref.cpp, is the specification). Five steps, each its own kernel:
//   pool_level     the pyramid: level l from level l-1, f32 means of up to B children (the
//                  same child order as the CPU), plus a 16-bit copy of k and v for the tensor
//                  cores;
//   select_level   coarse-to-fine top-K per (head, level-l query token), three rungs (a warp per
//                  token; a warp per token over candidate rows shared by siblings; a thread per
//                  token and part of its candidates): each lane keeps the best K of its share of
//                  the candidates, then K rounds of an arg-max over the lanes merge them (larger
//                  score first, ties to the smaller token, NaN last);
//   forward        one warp per 16 query rows of one fine query block, its own key stream
//                  (KeyStream: the fine blocks, the enrichment candidates, the coarsest level) in
//                  tiles of 16 tokens, double-buffered with cp.async, the online softmax of the
//                  flash executor (flash_kernel.cuh's pieces) with the +log(count) bias;
//   backward_dq    query-major: the forward's stream again, dS K;
//   backward_dkv   key-major: one warp per tile of 16 key tokens of one level, over the query
//                  blocks that visit it (a transposed index sorted by CUB's stable radix sort,
//                  so the order, and the f32 sums, are the same every run); the coarsest level,
//                  visited by every query, is cut into splits summed in a fixed order. No float
//                  atomics anywhere: dQ, dK and dV are bit-for-bit deterministic.
// Then pool_backward spreads each coarse token's gradient to its children, level by level.
//
// Unlike the flash executor's CTA-wide tile list, every warp here walks its own list (a fine
// query block of 16 tokens has its own picks), so buffers are per warp and synchronisation is
// __syncwarp.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/attention/flash_kernel.cuh"
#include "cuda/common/mma.cuh"

namespace sparsa::cuda::llsa {

using detail::fast_exp2;
using detail::mma_16816;
using detail::Pair;
using detail::quad_sum;
using detail::swizzle;

constexpr int kMaxLevels = 16;
constexpr int kMaxTopk = 64;     // the device selection's per-lane lists
constexpr int kTile = 16;        // tokens per key tile and query rows per warp
constexpr int kWarps = 4;        // warps per CTA of the attention kernels
constexpr float kLog2e = 1.4426950408889634f;

// Everything the kernels read of a plan; arrays of level l at index l (level 0: the inputs).
struct Plan {
  int B = 0, K = 0, L = 0;
  bool enrich = true, dedupe = false;
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1, len = 0, d = 0;
  int warps_per_block = 1;  // ceil(B / 16): warps of 16 rows per fine query block
  int level_len[kMaxLevels + 1] = {};
  int region[kMaxLevels + 1] = {};        // B^l, saturated at len
  float log2_full[kMaxLevels + 1] = {};   // log2 of the tokens under a full token of level l (0 at l 0)
  float log2_last[kMaxLevels + 1] = {};   // the same for the level's last token (maybe partial)
  int32_t* picks[kMaxLevels + 1] = {};    // l >= 1: [batch * heads_q, n_l, K]
  int32_t* counts[kMaxLevels + 1] = {};   // l >= 1: [batch * heads_q, n_l]
  const void* k16[kMaxLevels + 1] = {};   // l >= 1: [batch * heads_kv, n_l, d] (T)
  const void* v16[kMaxLevels + 1] = {};

  __host__ __device__ const int32_t* picks_of(int l, int bh, int i) const {
    return picks[l] + (static_cast<int64_t>(bh) * level_len[l] + i) * K;
  }
  __host__ __device__ int count_of(int l, int bh, int i) const {
    return counts[l][static_cast<int64_t>(bh) * level_len[l] + i];
  }
  // Original tokens under token t of level l.
  __device__ int token_count(int l, int t) const { return min(region[l], len - t * region[l]); }
  // The picks a query token of level l keeps: K, or fewer where it has fewer candidates (all n
  // at the top; below, the children of its parent's picks, the level's last block counted by its
  // real size, as the CPU plan counts them).
  __device__ int keep_of(int l, int bh, int parent) const {
    const int n = level_len[l];
    if (l == L) return min(K, n);
    const int32_t* pp = picks_of(l + 1, bh, parent);
    int valid = 0;
    for (int s = 0, c = count_of(l + 1, bh, parent); s < c; ++s) valid += min(B, n - pp[s] * B);
    return min(K, valid);
  }
};

// A [rows, d] view of a 4-d tensor's (b, h) slice.
struct Rows {
  const void* data = nullptr;
  int64_t stride[3] = {};  // batch, head, token (elements)
};

// ---- pooling ----------------------------------------------------------------------------------

// dst[bh, t, c] = mean of src[bh, t*B + u, c], u < children, summed in child order (f32). Level 1
// reads the input (T, strided); later levels read the f32 level below. dst16 (optional): the same
// rounded to T.
template <class T>
__global__ void pool_level(const T* src_in, Rows in, const float* src_f32, int heads, int n_src, int d, int B,
                           float* dst, T* dst16, int n_dst, int64_t total) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int c = static_cast<int>(idx % d);
  const int t = static_cast<int>(idx / d % n_dst);
  const int64_t bh = idx / (static_cast<int64_t>(d) * n_dst);
  const int first = t * B, last = min(first + B, n_src);
  float sum = 0.0f;
  if (src_in != nullptr) {
    const int64_t b = bh / heads, h = bh % heads;
    const T* base = src_in + b * in.stride[0] + h * in.stride[1] + c;
    for (int u = first; u < last; ++u) sum = __fadd_rn(sum, static_cast<float>(base[u * in.stride[2]]));
  } else {
    const float* base = src_f32 + bh * n_src * d + c;
    for (int u = first; u < last; ++u) sum = __fadd_rn(sum, base[static_cast<int64_t>(u) * d]);
  }
  const float mean = __fmul_rn(sum, 1.0f / static_cast<float>(last - first));
  dst[idx] = mean;
  if (dst16 != nullptr) dst16[idx] = static_cast<T>(mean);
}

// pool_level with 8 channels a thread (16-byte loads of the input, 32-byte loads of an f32 level,
// 16-byte stores): the same sums in the same child order, so the same values bit for bit. For d a
// multiple of 8 and level-1 input rows that start on 16 bytes (llsa.cu, aligned16); one thread an
// element moved 2 bytes a load and ran at about half the memory's speed.
template <class T>
__global__ void pool_level_vec(const T* src_in, Rows in, const float* src_f32, int heads, int n_src, int d, int B,
                               float* dst, T* dst16, int n_dst, int64_t chunks) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= chunks) return;
  const int per_row = d / 8;
  const int c = static_cast<int>(idx % per_row) * 8;
  const int t = static_cast<int>(idx / per_row % n_dst);
  const int64_t bh = idx / (static_cast<int64_t>(per_row) * n_dst);
  const int first = t * B, last = min(first + B, n_src);
  float sum[8] = {};
  if (src_in != nullptr) {
    const int64_t b = bh / heads, h = bh % heads;
    const T* base = src_in + b * in.stride[0] + h * in.stride[1] + c;
    for (int u = first; u < last; ++u) {
      const uint4 raw = *reinterpret_cast<const uint4*>(base + u * in.stride[2]);
      const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] = __fadd_rn(sum[e], static_cast<float>(x[e]));
    }
  } else {
    const float* base = src_f32 + bh * n_src * d + c;
    for (int u = first; u < last; ++u) {
      const float4* row = reinterpret_cast<const float4*>(base + static_cast<int64_t>(u) * d);
      const float4 lo = row[0], hi = row[1];
      const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] = __fadd_rn(sum[e], x[e]);
    }
  }
  const float inv = 1.0f / static_cast<float>(last - first);
  float mean[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) mean[e] = __fmul_rn(sum[e], inv);
  float4* out = reinterpret_cast<float4*>(dst + idx * 8);
  out[0] = make_float4(mean[0], mean[1], mean[2], mean[3]);
  out[1] = make_float4(mean[4], mean[5], mean[6], mean[7]);
  if (dst16 != nullptr) {
    uint4 packed;
    T* y = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = static_cast<T>(mean[e]);
    *reinterpret_cast<uint4*>(dst16 + idx * 8) = packed;
  }
}

// ---- selection --------------------------------------------------------------------------------

// (score, token) ordering of the plan: larger score first, ties to the smaller token.
__device__ __forceinline__ bool better(float s, int t, float s2, int t2) { return s > s2 || (s == s2 && t < t2); }

// s continued over columns e .. e + 3 of q · k (k: 16-byte aligned), fmaf in column order.
template <class Q>
__device__ __forceinline__ float score_columns(const Q& q, const float* k, int e, float s) {
  const float4 kv = *reinterpret_cast<const float4*>(k + e);
  s = fmaf(q[e], kv.x, s);
  s = fmaf(q[e + 1], kv.y, s);
  s = fmaf(q[e + 2], kv.z, s);
  return fmaf(q[e + 3], kv.w, s);
}

// A candidate's score: q · k over d floats (16-byte rows), fmaf in column order; NaN ranks last.
__device__ __forceinline__ float candidate_score(const float* q, const float* k, int d) {
  float s = 0.0f;
  for (int e = 0; e < d; e += 4) s = score_columns(q, k, e, s);
  return s != s ? -INFINITY : s;
}

// Candidate c of a query token -> its token: the children of the parent's picks below the top
// level (parent_picks), c itself at the top.
__device__ __forceinline__ int candidate_token(const int32_t* parent_picks, int B, int c) {
  return parent_picks ? parent_picks[c / B] * B + c % B : c;
}

// Candidates c0 .. c0 + rows - 1's f32 key rows (d floats from kbase; zeros for tokens past n)
// staged into ks, rows `stride` floats apart, by every thread of the CTA.
__device__ __forceinline__ void stage_candidates(float* ks, int stride, const float* kbase, int d,
                                                 const int32_t* parent_picks, int B, int n, int c0, int rows) {
  const int v4 = d / 4;
  for (int e = threadIdx.x; e < rows * v4; e += blockDim.x) {
    const int r = e / v4, t = candidate_token(parent_picks, B, c0 + r);
    float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t < n) val = *reinterpret_cast<const float4*>(kbase + static_cast<int64_t>(t) * d + (e % v4) * 4);
    *reinterpret_cast<float4*>(ks + r * stride + (e % v4) * 4) = val;
  }
}

// A lane's best KMAX candidates, sorted (a sorted array with static indices: one bubble pass per
// insertion).
template <int KMAX>
struct LaneBest {
  float s[KMAX];
  int t[KMAX];
  __device__ __forceinline__ LaneBest() {
#pragma unroll
    for (int j = 0; j < KMAX; ++j) s[j] = -INFINITY, t[j] = 0x7fffffff;
  }
  __device__ __forceinline__ void insert(float score, int token) {
    if (!better(score, token, s[KMAX - 1], t[KMAX - 1])) return;
    s[KMAX - 1] = score, t[KMAX - 1] = token;
#pragma unroll
    for (int j = KMAX - 1; j > 0; --j) {
      if (better(s[j], t[j], s[j - 1], t[j - 1])) {
        const float ts = s[j];
        const int tt = t[j];
        s[j] = s[j - 1], t[j] = t[j - 1];
        s[j - 1] = ts, t[j - 1] = tt;
      }
    }
  }
  // The best `keep` of the lists of `width` consecutive lanes (an aligned power-of-two segment of
  // the warp: K rounds of an arg-max over the segment's list heads; the winner shifts its list),
  // written ascending to out[0, keep), -1 up to K, and the count, where `write`. Every lane of
  // the warp calls it with the same keep and width. chosen: the segment's kMaxTopk ints of scratch.
  __device__ __forceinline__ void write_top(int keep, int K, int32_t* out, int32_t* count, int* chosen,
                                            int width = 32, bool write = true) {
    const int part = threadIdx.x % width;
    for (int r = 0; r < keep; ++r) {
      float bs = s[0];
      int bt = t[0];
      int owner = part;
#pragma unroll
      for (int off = width / 2; off > 0; off >>= 1) {
        const float s2 = __shfl_xor_sync(0xffffffffu, bs, off);
        const int t2 = __shfl_xor_sync(0xffffffffu, bt, off);
        const int o2 = __shfl_xor_sync(0xffffffffu, owner, off);
        if (better(s2, t2, bs, bt)) bs = s2, bt = t2, owner = o2;
      }
      if (part == owner) {
#pragma unroll
        for (int j = 0; j + 1 < KMAX; ++j) s[j] = s[j + 1], t[j] = t[j + 1];
        s[KMAX - 1] = -INFINITY, t[KMAX - 1] = 0x7fffffff;
      }
      if (part == 0) chosen[r] = bt;
    }
    __syncwarp();
    if (write) {
      // Ascending: each slot's rank among the chosen tokens (distinct).
      for (int r = part; r < keep; r += width) {
        int rank = 0;
        for (int u = 0; u < keep; ++u) rank += chosen[u] < chosen[r];
        out[rank] = chosen[r];
      }
      for (int r = keep + part; r < K; r += width) out[r] = -1;
      if (part == 0) *count = keep;
    }
    __syncwarp();  // chosen read by every lane before it is written again
  }
};

// One warp per (bh_q, i) of level l: picks[l][bh, i] = the top K of i's candidates (every
// level-L token at l == L; else the children of the parent's level-(l+1) picks), ascending.
// pq, pk: f32 level-l pyramids [bh, n_l, d]. Each lane keeps its best KMAX >= K candidates in
// registers (LaneBest), then K rounds of a warp arg-max over the lanes' heads merge them.
template <int KMAX>
__global__ void __launch_bounds__(128) select_level(const __grid_constant__ Plan p, int l, const float* pq,
                                                    const float* pk) {
  extern __shared__ float q_row[];  // [warps][d], then [warps][kMaxTopk] chosen tokens
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  const int n = p.level_len[l];
  if (item >= static_cast<int64_t>(p.batch) * p.heads_q * n) return;
  const int bh = static_cast<int>(item / n), i = static_cast<int>(item % n);
  const int bh_kv = bh / p.heads_q * p.heads_kv + bh % p.heads_q / p.group;
  float* qs = q_row + warp * p.d;
  for (int c = lane; c < p.d; c += 32) qs[c] = pq[(static_cast<int64_t>(bh) * n + i) * p.d + c];
  __syncwarp();

  // The candidates: [0, total) -> token.
  const int32_t* parent_picks = nullptr;
  int total = n;
  if (l < p.L) {
    const int parent = i / p.B;
    parent_picks = p.picks_of(l + 1, bh, parent);
    total = p.count_of(l + 1, bh, parent) * p.B;
  }
  const int keep = p.keep_of(l, bh, i / p.B);
  LaneBest<KMAX> best;
  const float* kbase = pk + static_cast<int64_t>(bh_kv) * n * p.d;
  for (int c = lane; c < total; c += 32) {
    const int t = candidate_token(parent_picks, p.B, c);
    if (t >= n) continue;
    best.insert(candidate_score(qs, kbase + static_cast<int64_t>(t) * p.d, p.d), t);
  }
  int* chosen = reinterpret_cast<int*>(q_row + (blockDim.x / 32) * p.d) + warp * kMaxTopk;
  best.write_top(keep, p.K, p.picks[l] + (static_cast<int64_t>(bh) * n + i) * p.K,
                 p.counts[l] + static_cast<int64_t>(bh) * n + i, chosen);
}

// Rung 2 of the selection: the query tokens that share their candidates share their key rows.
// At l == L every token's candidates are every level-L token; at l < L the B children of one
// level-(l+1) token all take the children of its picks. One CTA per (bh_q, such group): groups of
// kSelectWarps consecutive tokens at l == L, one parent's B children at l < L (kSelectWarps at a
// time). The candidates' f32 key rows are staged in shared memory kSelectChunk rows at a time and
// read there by every warp (rung 1, select_level, read them from L2 once per query token: the
// B siblings of a parent read the same rows B times). A warp per query token scores its lanes'
// candidates and keeps its lists as select_level does (candidate_score, LaneBest), so the picks
// are the same bit for bit.
constexpr int kSelectWarps = 8;
constexpr int kSelectChunk = 64;

// Shared memory of select_level_shared for head_dim d: the chunk (rows padded by 4 floats: a row's
// 16-byte reads by 8 lanes of one phase fall in distinct banks), the warps' query rows and their
// chosen tokens.
__host__ __device__ constexpr size_t select_shared_bytes(int d) {
  return (static_cast<size_t>(kSelectChunk) * (d + 4) + static_cast<size_t>(kSelectWarps) * d) * sizeof(float) +
         static_cast<size_t>(kSelectWarps) * kMaxTopk * sizeof(int);
}

template <int KMAX>
__global__ void __launch_bounds__(kSelectWarps * 32) select_level_shared(const __grid_constant__ Plan p, int l,
                                                                         const float* pq, const float* pk) {
  extern __shared__ float4 select_smem[];
  const int d = p.d, stride = d + 4;
  float* ks = reinterpret_cast<float*>(select_smem);              // [kSelectChunk][stride]
  float* qs = ks + kSelectChunk * stride + (threadIdx.x / 32) * d;  // this warp's query row
  int* chosen = reinterpret_cast<int*>(ks + kSelectChunk * stride + kSelectWarps * d) + (threadIdx.x / 32) * kMaxTopk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = p.level_len[l];
  const bool top = l == p.L;
  const int groups = top ? (n + kSelectWarps - 1) / kSelectWarps : p.level_len[l + 1];
  const int bh = static_cast<int>(blockIdx.x / groups), g = static_cast<int>(blockIdx.x % groups);
  const int bh_kv = bh / p.heads_q * p.heads_kv + bh % p.heads_q / p.group;
  const int32_t* parent_picks = top ? nullptr : p.picks_of(l + 1, bh, g);
  const int total = top ? n : p.count_of(l + 1, bh, g) * p.B;  // past n: skipped
  const int keep = p.keep_of(l, bh, g);
  const int first = top ? g * kSelectWarps : g * p.B;  // the group's first query token
  const int members = min(top ? kSelectWarps : p.B, n - first);
  const float* kbase = pk + static_cast<int64_t>(bh_kv) * n * d;
  const int v4 = d / 4;
  for (int m0 = 0; m0 < members; m0 += kSelectWarps) {  // the same trip count in every warp
    const int i = first + m0 + warp;
    const bool active = m0 + warp < members;  // warp-uniform
    if (active) {
      for (int c = lane; c < d; c += 32) qs[c] = pq[(static_cast<int64_t>(bh) * n + i) * d + c];
    }
    LaneBest<KMAX> best;
    for (int c0 = 0; c0 < total; c0 += kSelectChunk) {
      const int rows = min(kSelectChunk, total - c0);
      __syncthreads();  // the previous chunk read by every warp; this round's query rows written
      stage_candidates(ks, stride, kbase, d, parent_picks, p.B, n, c0, rows);
      __syncthreads();
      if (!active) continue;
      for (int r = lane; r < rows; r += 32) {
        const int t = candidate_token(parent_picks, p.B, c0 + r);
        if (t < n) best.insert(candidate_score(qs, ks + r * stride, d), t);
      }
    }
    if (!active) continue;
    best.write_top(keep, p.K, p.picks[l] + (static_cast<int64_t>(bh) * n + i) * p.K,
                   p.counts[l] + static_cast<int64_t>(bh) * n + i, chosen);
  }
}

// Rung 3 of the selection: a thread per (query token, part of its candidates), the query row in
// registers (head_dim a template argument). A CTA of kSelectThreads threads takes one group of
// query tokens that share their candidates (one parent's B children at l < L, kSelectTopGroup
// consecutive tokens at l == L): S tokens, P = kSelectThreads / S threads each, the P threads of a
// token in consecutive lanes of one warp. The candidates' f32 key rows are staged in shared memory
// once per CTA (rung 2 staged them once per round of 8 warps) and each row is read by broadcast
// by the threads of every token that share a part; thread `part` scores candidates part,
// part + P, ... with the same fmaf column order as candidate_score, keeps its best KMAX in a
// LaneBest, and K rounds of an arg-max over the P lanes of the token merge them. The picks are
// the same bit for bit (a top-K under a total order does not depend on who scored what). Applies
// with head_dim 64 or 128, K <= 16, and at l < L a block size B dividing kSelectThreads with
// B >= kSelectThreads / 32 (a token's lanes inside one warp); other levels keep rung 2.
constexpr int kSelectThreads = 128;
constexpr int kSelectTopGroup = 16;  // query tokens per CTA at the coarsest level

__host__ __device__ constexpr int select_lanes_chunk(int d) { return d == 64 ? 128 : 64; }  // rows staged at a time
__host__ __device__ constexpr int select_lanes_group(const Plan& p, int l) { return l == p.L ? kSelectTopGroup : p.B; }
__host__ __device__ constexpr size_t select_lanes_bytes(int d, int group, int K) {
  return static_cast<size_t>(select_lanes_chunk(d)) * (d + 4) * sizeof(float) +
         static_cast<size_t>(group) * K * sizeof(int);
}
__host__ __device__ constexpr bool select_lanes_fits(const Plan& p, int l) {
  const int s = select_lanes_group(p, l);
  return (p.d == 64 || p.d == 128) && p.K <= 16 && s >= kSelectThreads / 32 && kSelectThreads % s == 0;
}

// candidate_score with the query in registers (fully unrolled: static indices): the same fmaf chain.
template <int D>
__device__ __forceinline__ float candidate_score_regs(const float (&q)[D], const float* k) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < D; e += 4) s = score_columns(q, k, e, s);
  return s != s ? -INFINITY : s;
}

template <int D, int KMAX>
__global__ void __launch_bounds__(kSelectThreads) select_level_lanes(const __grid_constant__ Plan p, int l,
                                                                     const float* pq, const float* pk) {
  constexpr int kChunk = select_lanes_chunk(D), kStride = D + 4, kV4 = D / 4;
  extern __shared__ float4 select_smem[];
  float* ks = reinterpret_cast<float*>(select_smem);  // [kChunk][kStride]
  const int n = p.level_len[l];
  const bool top = l == p.L;
  const int S = select_lanes_group(p, l), P = kSelectThreads / S;
  const int groups = top ? (n + S - 1) / S : p.level_len[l + 1];
  const int bh = static_cast<int>(blockIdx.x / groups), g = static_cast<int>(blockIdx.x % groups);
  const int bh_kv = bh / p.heads_q * p.heads_kv + bh % p.heads_q / p.group;
  const int32_t* parent_picks = top ? nullptr : p.picks_of(l + 1, bh, g);
  const int total = top ? n : p.count_of(l + 1, bh, g) * p.B;  // past n: skipped
  const int keep = p.keep_of(l, bh, g);
  const int first = g * S, members = min(S, n - first);
  const int m = threadIdx.x / P, part = threadIdx.x % P;
  const bool active = m < members;
  const int i = first + m;

  float q[D];
  if (active) {
    const float4* src = reinterpret_cast<const float4*>(pq + (static_cast<int64_t>(bh) * n + i) * D);
#pragma unroll
    for (int e = 0; e < kV4; ++e) {
      const float4 x = src[e];
      q[4 * e] = x.x, q[4 * e + 1] = x.y, q[4 * e + 2] = x.z, q[4 * e + 3] = x.w;
    }
  }
  const float* kbase = pk + static_cast<int64_t>(bh_kv) * n * D;
  LaneBest<KMAX> best;
  for (int c0 = 0; c0 < total; c0 += kChunk) {
    const int rows = min(kChunk, total - c0);
    __syncthreads();  // the previous chunk read by every thread
    stage_candidates(ks, kStride, kbase, D, parent_picks, p.B, n, c0, rows);
    __syncthreads();
    if (!active) continue;
    for (int r = part; r < rows; r += P) {
      const int t = candidate_token(parent_picks, p.B, c0 + r);
      if (t < n) best.insert(candidate_score_regs<D>(q, ks + r * kStride), t);
    }
  }

  // Merge: K rounds of an arg-max over the token's P lanes (aligned and consecutive).
  best.write_top(keep, p.K, p.picks[l] + (static_cast<int64_t>(bh) * n + i) * p.K,
                 p.counts[l] + static_cast<int64_t>(bh) * n + i,
                 reinterpret_cast<int*>(ks + kChunk * kStride) + m * p.K, P, active);
}

// ---- the key stream of a fine query block -----------------------------------------------------

// A tile: tokens t0 .. t0 + 15 of `level`; bit j of mask: token t0 + j is visited.
struct KeyTile {
  int level, t0;
  uint32_t mask;
};

// Tokens of `level` that query block qb of bh leaves out with dedupe (its level-`level` ancestor's
// picks), cleared from a tile's mask.
__device__ __forceinline__ uint32_t exclude(const Plan& p, int bh, int qb, int level, int t0, uint32_t mask) {
  if (!p.dedupe || level == 0) return mask;
  int a = qb;
  for (int u = 1; u < level; ++u) a /= p.B;
  const int32_t* ex = p.picks_of(level, bh, a);
  const int n = p.count_of(level, bh, a);
  for (int e = 0; e < n; ++e) {
    const int x = ex[e] - t0;
    if (x >= 0 && x < kTile) mask &= ~(1u << x);
  }
  return mask;
}

// The keys query block qb of (bh) visits at levels first..last (llsa.h's executor; for_each_key_run
// on the CPU), as tiles of 16 tokens that never leave a run. Level 0 is the fine blocks, levels
// 1..L-1 the enrichment candidates (children of the level-(l+1) ancestor's picks), level L every
// token. Levels >= 1 depend on qb only through its level-2 ancestor qb / B, so the query blocks of
// one CTA can share that part. with_dedupe: the mask leaves out qb's own dedupe exclusions (a
// shared stream applies each warp's with exclude()). Every lane of a warp walks it in step.
struct KeyStream {
  int bh, qb, last;
  bool with_dedupe;
  int level, slot = 0, count = 0;
  const int32_t* list = nullptr;
  int pos = 0, run_end = 0;

  __device__ KeyStream(const Plan& p, int bh_, int qb_, int first, int last_, bool with_dedupe_)
      : bh(bh_), qb(qb_), last(p.enrich ? last_ : 0), with_dedupe(with_dedupe_), level(first) {
    enter(p);
  }

  // Set up the runs of `level`.
  __device__ void enter(const Plan& p) {
    slot = count = 0;
    pos = run_end = 0;
    if (level > last) return;
    if (level == 0) {
      list = p.picks_of(1, bh, qb);
      count = p.count_of(1, bh, qb);
    } else if (level < p.L) {
      int a = qb;
      for (int u = 0; u < level; ++u) a /= p.B;
      list = p.picks_of(level + 1, bh, a);
      count = p.count_of(level + 1, bh, a);
    } else {
      run_end = p.level_len[level];
    }
  }

  // Up to N next tiles into t; how many.
  template <int N>
  __device__ int next_tiles(const Plan& p, KeyTile (&t)[N]) {
    int n = 0;
    while (n < N && next(p, t[n])) ++n;
    return n;
  }

  __device__ bool next(const Plan& p, KeyTile& tile) {
    while (level <= last) {
      if (pos < run_end) {
        const int t0 = pos;
        pos += kTile;
        const int valid = min(kTile, run_end - t0);
        uint32_t mask = (1u << valid) - 1u;
        if (with_dedupe) mask = exclude(p, bh, qb, level, t0, mask);
        if (mask != 0) {
          tile = {level, t0, mask};
          return true;
        }
        continue;
      }
      if (slot < count) {
        const int g = list[slot++];
        pos = g * p.B;
        run_end = min(pos + p.B, p.level_len[level]);
        continue;
      }
      ++level;
      enter(p);
    }
    return false;
  }
};

// ---- shared pieces of the attention kernels ----------------------------------------------------

// This warp's 16 query rows: fine query block qb of bh, rows [row0, row0 + rows).
struct WarpRows {
  int bh, b, h, h_kv, bh_kv, qb, row0, rows;
  // Item `item` (query block, then 16-row group) of head bh; false when it has no rows.
  __device__ bool make_in(const Plan& p, int bh_, int item) {
    bh = bh_;
    qb = item / p.warps_per_block;
    row0 = qb * p.B + item % p.warps_per_block * kTile;
    rows = min(min(kTile, qb * p.B + p.B - row0), p.len - row0);
    b = bh / p.heads_q, h = bh % p.heads_q, h_kv = h / p.group, bh_kv = b * p.heads_kv + h_kv;
    return qb < p.level_len[1] && rows > 0;
  }
  // Item `item` of all heads, in order.
  __device__ bool make(const Plan& p, int64_t item) {
    const int64_t per_bh = static_cast<int64_t>(p.level_len[1]) * p.warps_per_block;
    if (item / per_bh >= p.batch * p.heads_q) return false;
    return make_in(p, static_cast<int>(item / per_bh), static_cast<int>(item % per_bh));
  }
};

// Copies 16 rows of D b16 values into a swizzled [16][D] tile by the 32 lanes of a warp; row j
// comes from src(j) (nullptr: zeros). aligned: 16-byte copies (cp.async), else element loads.
// `any` is some readable address (cp.async of zero bytes still takes one).
template <int D, class Src>
__device__ __forceinline__ void warp_copy_tile(uint32_t dst, bool aligned, const void* any, Src&& src) {
  constexpr int kChunks = D / 8;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int idx = lane; idx < kTile * kChunks; idx += 32) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const uint16_t* s = src(row);
    if (aligned) {
      detail::cp_async_16(dst + swizzle<D>(row, chunk), s ? static_cast<const void*>(s + chunk * 8) : any, s ? 16 : 0);
    } else {
      uint32_t w[4] = {0, 0, 0, 0};
      if (s) {
#pragma unroll
        for (int e = 0; e < 4; ++e) w[e] = uint32_t(s[chunk * 8 + 2 * e]) | (uint32_t(s[chunk * 8 + 2 * e + 1]) << 16);
      }
      asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + swizzle<D>(row, chunk)), "r"(w[0]),
                   "r"(w[1]), "r"(w[2]), "r"(w[3]));
    }
  }
}

// Row pointer of token t of `level` for kv head bh_kv: level 0 the input, else the 16-bit pyramid.
__device__ __forceinline__ const uint16_t* level_row(const Plan& p, const Rows& in, const void* const* pyr, int level,
                                                     int b, int h_kv, int bh_kv, int t) {
  if (level == 0) {
    return static_cast<const uint16_t*>(in.data) + b * in.stride[0] + h_kv * in.stride[1] + t * in.stride[2];
  }
  return static_cast<const uint16_t*>(pyr[level]) + (static_cast<int64_t>(bh_kv) * p.level_len[level] + t) * p.d;
}

// The logit bias of token t of `level` in raw-logit units (log2(count) / (scale log2 e)).
__device__ __forceinline__ float log2_count(const Plan& p, int level, int t) {
  return t == p.level_len[level] - 1 ? p.log2_last[level] : p.log2_full[level];
}
__device__ __forceinline__ float raw_bias(const Plan& p, int level, int t, float inv_scale_log2) {
  return log2_count(p, level, t) * inv_scale_log2;
}

// This thread's column of element e of score tile n.
__device__ __forceinline__ int score_col(int n, int e) { return n * 8 + 2 * (threadIdx.x % 4) + (e & 1); }

// A operand fragments of a [16][D] tile (rows of the mma's M).
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&f)[D / 16][4], uint32_t tile) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    detail::ldmatrix_x4(f[kk], tile + swizzle<D>((lane / 8 % 2) * 8 + lane % 8, kk * 2 + lane / 16));
}

// S[16][16] += A B^T with A in fragments (16 x D) and B a [16][D] tile (its rows are S's columns).
template <int D, class T>
__device__ __forceinline__ void scores_16(float (&s)[2][4], const uint32_t (&a)[D / 16][4], uint32_t b_tile) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t bk[4];
    detail::ldmatrix_x4(bk, b_tile + swizzle<D>((lane / 16) * 8 + lane % 8, kk * 2 + (lane / 8) % 2));
    mma_16816<T>(s[0], a[kk], bk[0], bk[1]);
    mma_16816<T>(s[1], a[kk], bk[2], bk[3]);
  }
}

// acc[16][D] += P B where P (16 x 16) is one A fragment and B a [16][D] tile (its rows are P's
// columns), read transposed.
template <int D, class T>
__device__ __forceinline__ void accumulate_16(float (&acc)[D / 8][4], const uint32_t (&pf)[4], uint32_t b_tile) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    uint32_t bv[4];
    detail::ldmatrix_x4_trans(bv, b_tile + swizzle<D>(((lane / 8) % 2) * 8 + lane % 8, dp * 2 + lane / 16));
    mma_16816<T>(acc[2 * dp], pf, bv[0], bv[1]);
    mma_16816<T>(acc[2 * dp + 1], pf, bv[2], bv[3]);
  }
}

// Two 16x8 accumulator tiles as one A fragment (16 x 16).
template <class T>
__device__ __forceinline__ void pack_a(uint32_t (&f)[4], const float (&s)[2][4]) {
  f[0] = Pair<T>::pack(s[0][0], s[0][1]);
  f[1] = Pair<T>::pack(s[0][2], s[0][3]);
  f[2] = Pair<T>::pack(s[1][0], s[1][1]);
  f[3] = Pair<T>::pack(s[1][2], s[1][3]);
}

struct AttnArgs {
  Rows q, k, v, o, d_o, dq;
  float* lse = nullptr;            // [batch * heads_q, len] contiguous
  const float* delta = nullptr;    // [batch * heads_q, len]: rowsum(dO * O), the backward
  int64_t lse_stride[3] = {};
  float scale = 1.0f, scale_log2 = 0.0f;
  bool aligned = true;      // q, k, v, d_o bases and token strides allow 16-byte copies
  bool aligned_out = true;  // out allows 4-byte pair stores
  float* dk_pyr[kMaxLevels + 1] = {};  // f32 [batch * heads_kv, n_l, d]: the backward's dK, dV
  float* dv_pyr[kMaxLevels + 1] = {};
  float* dk_split = nullptr;           // [splits][batch * heads_kv, n_L, d]: the coarsest level
  float* dv_split = nullptr;
  int splits = 1;
  const int32_t* visit_begin[kMaxLevels + 1] = {};  // l < L: [batch * heads_kv * n_{l+1}... ] per key group
  const int32_t* visit_end[kMaxLevels + 1] = {};
  const int32_t* visitors[kMaxLevels + 1] = {};     // l < L: bh_q * n_{l+1} + a, sorted by key group
  // The forward: the last level its key streams attend (min with p.L). p.L - 1 when the coarsest
  // level goes through the dense executor instead (llsa.cu, coarse_through_executor).
  int forward_last_level = kMaxLevels;
  // The forward: where set, each row's online softmax starts from that part's state (O in T, LSE
  // in f32, contiguous [batch * heads_q, len] rows: the dense executor's coarsest level) instead
  // of from nothing, so the kernel's output is already the two parts merged.
  const void* init_o = nullptr;
  const float* init_lse = nullptr;
};

__device__ __forceinline__ int64_t row_offset(const Rows& r, int b, int h, int t) {
  return b * r.stride[0] + h * r.stride[1] + static_cast<int64_t>(t) * r.stride[2];
}

// ---- forward ----------------------------------------------------------------------------------

// One online-softmax step of a warp's 16 rows over n <= NSUB key tiles of 16 (tile j: K at
// k_tile(j), V at v_tile(j), tokens tiles[j]): S = Q K^T, masked (-inf off the mask) and raised by
// the log count in raw-logit units; the softmax over the 16 * NSUB columns; O += P V.
// after_scores() runs once S is in registers (the K tiles are free), before_pv() before the first
// read of a V tile (the wide fine loop's copy hooks; no-ops elsewhere).
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

template <class T, int D, int NSUB, class KTile, class VTile, class AfterScores = NoHook, class BeforePv = NoHook>
__device__ __forceinline__ void attend_step(float (&o)[D / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                            const uint32_t (&qf)[D / 16][4], const Plan& p,
                                            const KeyTile (&tiles)[NSUB], int n, KTile k_tile, VTile v_tile,
                                            float scale_log2, AfterScores&& after_scores = {},
                                            BeforePv&& before_pv = {}) {
  const float inv_sl2 = 1.0f / scale_log2;
  float s[2 * NSUB][4];
#pragma unroll
  for (int j = 0; j < NSUB; ++j) {
    float sj[2][4] = {};
    if (j < n) scores_16<D, T>(sj, qf, k_tile(j));
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = score_col(nn, e);
        const bool on = j < n && (tiles[j].mask >> col & 1u);
        s[2 * j + nn][e] = on ? sj[nn][e] + raw_bias(p, tiles[j].level, tiles[j].t0 + col, inv_sl2) : -INFINITY;
      }
  }
  after_scores();
  uint32_t pf[NSUB][4];
  float alpha[2];
  detail::softmax_scores<2 * NSUB>(s, 2 * NSUB * 8, scale_log2, row_max, row_sum, alpha,
                                   [&](int nn, const float(&prob)[4]) { detail::pack_probs<T, 2 * NSUB>(nn, prob, pf); });
  detail::rescale<D / 8>(o, alpha);
  before_pv();
#pragma unroll
  for (int j = 0; j < NSUB; ++j)
    if (j < n) accumulate_16<D, T>(o, pf[j], v_tile(j));
}

// The epilogue of a warp's rows: O / l and the LSE.
template <class T, int D>
__device__ __forceinline__ void store_rows(const AttnArgs& a, const WarpRows& w, const float (&o)[D / 8][4],
                                           const float (&row_max)[2], const float (&row_sum)[2]) {
  const int g = threadIdx.x % 32 / 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(row_sum[r]);
    const int row = g + 8 * r;
    if (row >= w.rows) continue;
    const int t = w.row0 + row;
    T* out = static_cast<T*>(const_cast<void*>(a.o.data)) + row_offset(a.o, w.b, w.h, t);
    float* lse = a.lse + w.b * a.lse_stride[0] + w.h * a.lse_stride[1] + t * a.lse_stride[2];
    detail::store_row<T, D / 8>(out, lse, o, r, l, row_max[r], a.scale_log2, a.aligned_out);
  }
}

// A warp's rows continued from an earlier part's normalised output and LSE (a.init_o, a.init_lse):
// with the row max at LSE / scale in raw-logit units, that part's probabilities sum to 1 and its
// accumulator is its output, which is the state its online softmax would have ended with.
template <class T, int D>
__device__ __forceinline__ void init_rows(const AttnArgs& a, const Plan& p, const WarpRows& w, float (&o)[D / 8][4],
                                          float (&row_max)[2], float (&row_sum)[2]) {
  const int g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row >= w.rows) continue;
    const int64_t at = static_cast<int64_t>(w.bh) * p.len + w.row0 + row;
    const T* src = static_cast<const T*>(a.init_o) + at * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][2 * r] = static_cast<float>(src[i * 8 + 2 * c]);
      o[i][2 * r + 1] = static_cast<float>(src[i * 8 + 2 * c + 1]);
    }
    row_max[r] = a.init_lse[at] / a.scale;
    row_sum[r] = c == 0 ? 1.0f : 0.0f;  // the quad's partial sums add up to the part's 1
  }
}

// ---- the two key loops (the mainloop; the kernels differ only in their step hook) ----------------
//
// warp_loop: a warp walks its own stream one tile of 16 at a time, double-buffered in its own K/V
//   stages (k_s, v_s: 2 tiles each); the caller has issued its row tiles' copies (Q, dO), which land
//   with the first tile: prologue() runs after that first wait (or at the end when there is none).
// cta_loop: the CTA's warps walk one shared stream (the coarse keys) 4 tiles (64 tokens) per stage,
//   each stage loaded once for all warps; active warps run step on it with their own dedupe masks.
// step(tiles, n, k_tile, v_tile): n tiles of 16 keys, K of tile j at k_tile(j), V at v_tile(j).

// Copies key tile tl's K rows (V rows with is_v) for the kv head of `wr` into dst by the lanes of
// a warp; rows outside the tile's mask are zeros. The pyramid's rows (levels >= 1) are always
// 16-byte aligned; the inputs' rows where a.aligned.
template <int D>
__device__ __forceinline__ void copy_key_tile(uint32_t dst, const Plan& p, const AttnArgs& a, const WarpRows& wr,
                                              const KeyTile& tl, bool is_v) {
  warp_copy_tile<D>(dst, a.aligned || tl.level > 0, a.q.data, [&](int r) {
    return (tl.mask >> r & 1u)
               ? level_row(p, is_v ? a.v : a.k, is_v ? p.v16 : p.k16, tl.level, wr.b, wr.h_kv, wr.bh_kv, tl.t0 + r)
               : nullptr;
  });
}

template <int D, class Prologue, class Step>
__device__ __forceinline__ void warp_loop(const Plan& p, const AttnArgs& a, const WarpRows& w, KeyStream& stream,
                                          uint32_t k_s, uint32_t v_s, Prologue&& prologue, Step&& step) {
  constexpr int kTileBytes = kTile * D * 2;
  KeyTile cur[1], nxt[1];
  auto load = [&](const KeyTile& t, int stage) {
    copy_key_tile<D>(k_s + stage * kTileBytes, p, a, w, t, false);
    copy_key_tile<D>(v_s + stage * kTileBytes, p, a, w, t, true);
  };
  bool have = stream.next(p, cur[0]);
  if (have) load(cur[0], 0);
  detail::cp_async_commit();
  bool first = true;
  for (int stage = 0; have; stage ^= 1) {
    const bool more = stream.next(p, nxt[0]);
    if (more) load(nxt[0], stage ^ 1);
    detail::cp_async_commit();
    detail::cp_async_wait<1>();
    __syncwarp();
    if (first) prologue(), first = false;
    step(cur, 1, [&](int) { return k_s + stage * kTileBytes; }, [&](int) { return v_s + stage * kTileBytes; });
    __syncwarp();  // this stage is the next prefetch's target
    cur[0] = nxt[0];
    have = more;
  }
  detail::cp_async_wait<0>();
  __syncwarp();
  if (first) prologue();
}

// warp_loop_wide: the fine blocks in steps of kWide tiles (64 keys: for the forward a quarter of
//   the row max, exponential and rescale rounds of 16-key steps, and four times the independent
//   MMAs a step). One K stage and one V stage of kWide tiles each (single-buffered: double stages
//   would not leave room for the CTAs an SM needs). The caller has issued its row tiles' copies
//   (Q; Q and dO), which land with the first K stage. FORWARD: only K is waited for at the top of
//   a step; the next step's K copies are issued once this step's scores are in registers and its
//   V copies once its P V is done, so each overlaps the other half of the step. dQ: K and V are
//   both waited for (S and dP come first); the next V copies are issued once dS is in registers,
//   the next K copies after dQ += dS K.
//   step(tiles, n, k_tile, v_tile, mid, before_pv): attend_step's and dq_step's signature; mid
//   runs when the first stage is free (K for the forward, V for dQ).
constexpr int kWide = 4;

template <int D, bool FORWARD, class Prologue, class Step>
__device__ __forceinline__ void warp_loop_wide(const Plan& p, const AttnArgs& a, const WarpRows& w,
                                               KeyStream& stream, uint32_t k_s, uint32_t v_s, Prologue&& prologue,
                                               Step&& step) {
  constexpr int kTileBytes = kTile * D * 2;
  KeyTile cur[kWide], nxt[kWide];
  auto load = [&](const KeyTile (&t)[kWide], int n, bool is_v) {
    for (int j = 0; j < n; ++j) copy_key_tile<D>((is_v ? v_s : k_s) + j * kTileBytes, p, a, w, t[j], is_v);
  };
  int n_cur = stream.next_tiles(p, cur);
  load(cur, n_cur, false);
  detail::cp_async_commit();  // group: the row tiles (the caller's) and K
  load(cur, n_cur, true);
  detail::cp_async_commit();  // group: V
  bool first = true;
  while (n_cur > 0) {
    const int n_nxt = stream.next_tiles(p, nxt);
    if constexpr (FORWARD) {
      detail::cp_async_wait<1>();  // the row tiles and this step's K (V may still be in flight)
    } else {
      detail::cp_async_wait<0>();
    }
    __syncwarp();
    if (first) prologue(), first = false;
    step(cur, n_cur, [&](int j) { return k_s + j * kTileBytes; }, [&](int j) { return v_s + j * kTileBytes; },
         [&] {  // the first stage is free: the next step's copies into it
           __syncwarp();
           load(nxt, n_nxt, !FORWARD);
           detail::cp_async_commit();
         },
         [&] {
           if constexpr (FORWARD) {
             detail::cp_async_wait<1>();  // this step's V (the next K may still be in flight)
             __syncwarp();
           }
         });
    __syncwarp();  // the step read the second stage
    load(nxt, n_nxt, FORWARD);
    detail::cp_async_commit();
#pragma unroll
    for (int j = 0; j < kWide; ++j) cur[j] = nxt[j];
    n_cur = n_nxt;
  }
  detail::cp_async_wait<0>();
  __syncwarp();
  if (first) prologue();
}

constexpr int kSharedTiles = 4;  // tiles per stage of the shared loop

template <int D, int WARPS, class Step>
__device__ __forceinline__ void cta_loop(const Plan& p, const AttnArgs& a, const WarpRows& w0, const WarpRows& w,
                                         bool active, KeyStream& stream, uint32_t ck_s, uint32_t cv_s, Step&& step) {
  constexpr int kTileBytes = kTile * D * 2, kSub = kSharedTiles;
  const int warp = threadIdx.x / 32;
  KeyTile cur[kSub], nxt[kSub];
  // Warp w copies K of tile w and V of tile w - kSub of the stage (WARPS = 4: both of tile w).
  auto load_stage = [&](const KeyTile (&t)[kSub], int n, int stage) {
    for (int j = warp; j < 2 * kSub; j += WARPS) {
      const int sub = j % kSub;
      const bool is_v = j >= kSub;
      if (sub >= n) continue;
      copy_key_tile<D>((is_v ? cv_s : ck_s) + (stage * kSub + sub) * kTileBytes, p, a, w0, t[sub], is_v);
    }
  };
  int n_cur = stream.next_tiles(p, cur);
  load_stage(cur, n_cur, 0);
  detail::cp_async_commit();
  for (int stage = 0; n_cur > 0; stage ^= 1) {
    const int n_nxt = stream.next_tiles(p, nxt);
    load_stage(nxt, n_nxt, stage ^ 1);
    detail::cp_async_commit();
    detail::cp_async_wait<1>();
    __syncthreads();
    if (active) {
      KeyTile mine[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        mine[j] = cur[j];
        if (j < n_cur) mine[j].mask = exclude(p, w.bh, w.qb, cur[j].level, cur[j].t0, cur[j].mask);
      }
      step(mine, n_cur, [&](int j) { return ck_s + (stage * kSub + j) * kTileBytes; },
           [&](int j) { return cv_s + (stage * kSub + j) * kTileBytes; });
    }
    __syncthreads();  // this stage is the next prefetch's target
#pragma unroll
    for (int j = 0; j < kSub; ++j) cur[j] = nxt[j];
    n_cur = n_nxt;
  }
  detail::cp_async_wait<0>();
}

// Shared memory of the kernels: per warp `row_tiles` row tiles (Q, dO) and 2 + 2 stage tiles; the
// shared loop's 2 stages of kSharedTiles K and V tiles after them.
__host__ __device__ constexpr int warp_tiles(int row_tiles) { return row_tiles + 4; }
__host__ __device__ constexpr int shared_tiles() { return 4 * kSharedTiles; }

// The forward of one warp's rows. SHARED: the fine blocks alone, then the coarse keys with the
// CTA (rung 2: the CTA's query blocks share their level-2 ancestor, so their keys at levels >= 1
// are the same; grid x = CTAs per head, y = batch * heads_q); else the whole stream alone (rung 1,
// any block size; grid x = every warp of every head, WARPS per CTA). WIDE (with SHARED): the fine
// blocks in 64-key steps (warp_loop_wide), else 16-key steps (warp_loop).
// CTAs per SM the forward's register allocation must allow: with head_dim 64 two 8-warp CTAs (or
// four of 4) fit in shared memory, and uncapped (192 registers, one CTA per SM, 12.5% occupancy) it
// was latency-bound: capped it spills ~100 bytes and runs 1.3x faster (bench/RESULTS.md). dQ holds
// more live state (Q and dO fragments): capped it spilled 200+ bytes and ran 1.4-1.6x slower, so it
// stays uncapped, as does dK/dV (capped: no gain). head_dim 128 is held to one CTA by shared memory.
// WIDE: three 4-warp CTAs an SM (shared memory allows three: wide_tiles).
template <int D, int WARPS>
constexpr int kMinBlocks = D == 64 ? 16 / WARPS : 1;
constexpr int kWideMinBlocks = 3;

// Shared memory of the wide kernels, in tiles: per warp `row_tiles` row tiles (Q; Q and dO) and one
// K and one V stage of kWide tiles; the shared loop's stages reuse the start of it once every
// warp's fine blocks are done.
__host__ __device__ constexpr int wide_warp_tiles(int row_tiles) { return row_tiles + 2 * kWide; }
__host__ __device__ constexpr int wide_tiles(int warps, int row_tiles) {
  return warps * wide_warp_tiles(row_tiles) > shared_tiles() ? warps * wide_warp_tiles(row_tiles) : shared_tiles();
}

template <class T, int D, int WARPS, bool SHARED, bool WIDE = false>
__global__ void __launch_bounds__(32 * WARPS, WIDE ? kWideMinBlocks : kMinBlocks<D, WARPS>)
    forward(const __grid_constant__ Plan p, const __grid_constant__ AttnArgs a) {
  static_assert(!WIDE || SHARED, "the wide fine loop is rung 2's");
  constexpr int kDT = D / 8, kTileBytes = kTile * D * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32;
  WarpRows w, w0;
  bool active;
  if constexpr (SHARED) {
    active = w.make_in(p, blockIdx.y, blockIdx.x * WARPS + warp);
    w0.make_in(p, blockIdx.y, blockIdx.x * WARPS);  // the CTA's first group: its coarse keys are all warps'
  } else {
    active = w.make(p, static_cast<int64_t>(blockIdx.x) * WARPS + warp);
    if (!active) return;
  }
  const uint32_t base = detail::smem_addr(smem);
  constexpr int kWarpTiles = WIDE ? wide_warp_tiles(1) : warp_tiles(1);
  constexpr int kStageTiles = WIDE ? kWide : 2;  // the K area before V
  const uint32_t q_s = base + warp * kWarpTiles * kTileBytes, k_s = q_s + kTileBytes,
                 v_s = k_s + kStageTiles * kTileBytes;
  float o[kDT][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  uint32_t qf[D / 16][4];
  const int last = min(p.L, a.forward_last_level);
  auto step = [&](const auto& tiles, int n, auto k_tile, auto v_tile, auto&&... hooks) {
    attend_step<T, D>(o, row_max, row_sum, qf, p, tiles, n, k_tile, v_tile, a.scale_log2, hooks...);
  };
  if (active && a.init_o != nullptr) init_rows<T, D>(a, p, w, o, row_max, row_sum);
  if (active) {
    const uint16_t* q_base = static_cast<const uint16_t*>(a.q.data) + row_offset(a.q, w.b, w.h, w.row0);
    warp_copy_tile<D>(q_s, a.aligned, a.q.data, [&](int r) { return r < w.rows ? q_base + r * a.q.stride[2] : nullptr; });
    KeyStream own(p, w.bh, w.qb, 0, SHARED ? 0 : last, true);
    if constexpr (WIDE) {
      warp_loop_wide<D, true>(p, a, w, own, k_s, v_s, [&] { load_a<D>(qf, q_s); }, step);
    } else {
      warp_loop<D>(p, a, w, own, k_s, v_s, [&] { load_a<D>(qf, q_s); }, step);
    }
  }
  if constexpr (SHARED) {
    KeyStream coarse(p, w0.bh, w0.qb, 1, last, false);
    uint32_t ck_s = base + WARPS * warp_tiles(1) * kTileBytes;
    if constexpr (WIDE) {
      ck_s = base;
      __syncthreads();  // every warp's fine blocks done: the stages take over their area
    }
    cta_loop<D, WARPS>(p, a, w0, w, active, coarse, ck_s, ck_s + 2 * kSharedTiles * kTileBytes, step);
  }
  if (active) store_rows<T, D>(a, w, o, row_max, row_sum);
}

// x[i] += c for i < n (the dense executor's LSE of the coarsest level raised by log(weight)).
__global__ void add_constant(float* x, int64_t n, float c) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += c;
  }
}

// ---- the coarsest level with its keys resident (the forward's rung 4) ---------------------------
//
// Every query attends to every token of the coarsest level L, so that part is dense attention over
// few keys (256 at 64K, block 16, two levels). coarse_resident loads those keys and values of one
// (batch, kv head) into shared memory once per CTA; its warps then stream 16-row query tiles past
// them, each warp copying its next tile while it computes the current one, in 64-key softmax
// steps made of the row-wise kernels' pieces. Exact where every level-L token stands for the same
// number of tokens (llsa.cu, coarse_path): the +log(count) bias is then one constant, which leaves
// the softmax alone and raises the LSE by log(region), added here. Writes O (T) and the LSE (f32)
// contiguous [batch * heads_q, len] rows: the state the row-wise kernel's other levels start from
// (AttnArgs::init_o, init_lse). Grid: x = CTAs per (batch, q head) sharing its query tiles, y =
// batch * heads_q.
constexpr int kResidentWarps = 8;
constexpr int kResidentStep = 4;  // key tiles per softmax step (64 keys)

// Shared memory: the level's K and V rounded up to whole steps, then two query tiles a warp.
__host__ __device__ constexpr size_t resident_bytes(int d, int n) {
  const int padded = (n + kResidentStep * kTile - 1) / (kResidentStep * kTile) * (kResidentStep * kTile);
  return (2 * static_cast<size_t>(padded) + 2 * kResidentWarps * kTile) * d * 2;
}

template <class T, int D>
__global__ void __launch_bounds__(32 * kResidentWarps, D == 64 ? 2 : 1)
    coarse_resident(const __grid_constant__ Plan p, const __grid_constant__ AttnArgs a, void* out, float* lse,
                    float ln_region) {
  constexpr int kDT = D / 8, kChunks = D / 8, kTileBytes = kTile * D * 2, kStep = kResidentStep * kTile;
  extern __shared__ __align__(128) uint8_t smem[];
  const int n = p.level_len[p.L];
  const int padded = (n + kStep - 1) / kStep * kStep;
  const int bh = blockIdx.y, b = bh / p.heads_q, h = bh % p.heads_q, bh_kv = b * p.heads_kv + h / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t k_s = detail::smem_addr(smem), v_s = k_s + padded * D * 2;
  const uint32_t q_s = v_s + padded * D * 2 + warp * 2 * kTileBytes;

  // The level's rows of this kv head: one swizzled [padded][D] array each (tile j's rows are rows
  // 16 j .. 16 j + 15, the layout the 16-row pieces read); rows past n are zeros.
  const uint16_t* kg = static_cast<const uint16_t*>(p.k16[p.L]) + static_cast<int64_t>(bh_kv) * n * D;
  const uint16_t* vg = static_cast<const uint16_t*>(p.v16[p.L]) + static_cast<int64_t>(bh_kv) * n * D;
  for (int idx = threadIdx.x; idx < padded * kChunks; idx += blockDim.x) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool in = row < n;
    const int64_t at = static_cast<int64_t>(in ? row : 0) * D + chunk * 8;
    detail::cp_async_16(k_s + swizzle<D>(row, chunk), kg + at, in ? 16 : 0);
    detail::cp_async_16(v_s + swizzle<D>(row, chunk), vg + at, in ? 16 : 0);
  }

  const int tiles = (p.len + kTile - 1) / kTile;
  const int stride = gridDim.x * kResidentWarps;
  auto copy_q = [&](int tile, uint32_t dst) {
    const int row0 = tile * kTile, rows = min(kTile, p.len - row0);
    const uint16_t* q0 = static_cast<const uint16_t*>(a.q.data) + row_offset(a.q, b, h, row0);
    warp_copy_tile<D>(dst, a.aligned, a.q.data, [&](int r) { return r < rows ? q0 + r * a.q.stride[2] : nullptr; });
  };
  int tile = blockIdx.x * kResidentWarps + warp;
  if (tile < tiles) copy_q(tile, q_s);
  detail::cp_async_commit();
  detail::cp_async_wait<0>();
  __syncthreads();  // K and V in place; from here each warp runs alone

  const float scale_log2 = a.scale_log2;
  for (int buf = 0; tile < tiles; tile += stride, buf ^= 1) {
    const int next = tile + stride;
    if (next < tiles) copy_q(next, q_s + (buf ^ 1) * kTileBytes);
    detail::cp_async_commit();
    detail::cp_async_wait<1>();  // this tile's rows (the next tile's may still be in flight)
    __syncwarp();
    uint32_t qf[D / 16][4];
    load_a<D>(qf, q_s + buf * kTileBytes);
    float o[kDT][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    for (int key0 = 0; key0 < n; key0 += kStep) {
      float s[2 * kResidentStep][4];
#pragma unroll
      for (int j = 0; j < kResidentStep; ++j) {
        float sj[2][4] = {};
        scores_16<D, T>(sj, qf, k_s + (key0 / kTile + j) * kTileBytes);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[2 * j][e] = sj[0][e], s[2 * j + 1][e] = sj[1][e];
      }
      uint32_t pf[kResidentStep][4];
      float alpha[2];
      detail::softmax_scores<2 * kResidentStep>(
          s, n - key0, scale_log2, row_max, row_sum, alpha,
          [&](int nn, const float(&prob)[4]) { detail::pack_probs<T, 2 * kResidentStep>(nn, prob, pf); });
      detail::rescale<kDT>(o, alpha);
#pragma unroll
      for (int j = 0; j < kResidentStep; ++j) accumulate_16<D, T>(o, pf[j], v_s + (key0 / kTile + j) * kTileBytes);
    }
    // O / l and LSE + log(region), rows [tile * 16, +16) of head bh, contiguous.
    const int g = lane / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[r]);
      const int t = tile * kTile + g + 8 * r;
      if (t >= p.len) continue;
      const int64_t at = static_cast<int64_t>(bh) * p.len + t;
      float row_lse = 0.0f;
      detail::store_row<T, kDT>(static_cast<T*>(out) + at * D, &row_lse, o, r, l, row_max[r], scale_log2, true);
      if (lane % 4 == 0) lse[at] = row_lse + ln_region;
    }
    __syncwarp();  // this buffer is the prefetch target after the next
  }
  detail::cp_async_wait<0>();
}

// ---- backward ---------------------------------------------------------------------------------

// delta[bh, i] = sum_c dO[i, c] O[i, c] (f32), one warp per row.
template <class T>
__global__ void backward_delta(const __grid_constant__ Plan p, const __grid_constant__ AttnArgs a, float* delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= static_cast<int64_t>(p.batch) * p.heads_q * p.len) return;
  const int lane = threadIdx.x % 32;
  const int t = static_cast<int>(row % p.len), bh = static_cast<int>(row / p.len);
  const int b = bh / p.heads_q, h = bh % p.heads_q;
  const T* o = static_cast<const T*>(a.o.data) + row_offset(a.o, b, h, t);
  const T* d_o = static_cast<const T*>(a.d_o.data) + row_offset(a.d_o, b, h, t);
  float s = 0.0f;
  for (int c = lane; c < p.d; c += 32) s += static_cast<float>(o[c]) * static_cast<float>(d_o[c]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) delta[row] = s;
}

// Stores this thread's share (rows g, g + 8 < rows) of a 16 x D f32 accumulator times `mul` as T.
template <class T, int D>
__device__ __forceinline__ void store_acc(T* base, int64_t row_stride, int rows, const float (&acc)[D / 8][4],
                                          float mul) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row >= rows) continue;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int col = i * 8 + 2 * c;
      base[row * row_stride + col] = static_cast<T>(acc[i][2 * r] * mul);
      base[row * row_stride + col + 1] = static_cast<T>(acc[i][2 * r + 1] * mul);
    }
  }
}

// One dQ step of a warp's 16 rows over n <= NSUB key tiles: P = exp2(S c + bias - LSE), dP = dO V^T,
// dS = P (dP - delta), dQ += dS K (scaled at the end).
// With after_v (the wide loop's copy hook): dS of every tile first, after_v() once the V tiles are
// no longer read, then dQ += dS K tile by tile; without (NoHook): tile by tile, dS then dQ, which
// holds one tile's dS in registers instead of NSUB. The same sums in the same order either way.
// The second hook is the forward's and unused here.
template <class T, int D, int NSUB, class KTile, class VTile, class AfterV = NoHook, class Unused = NoHook>
__device__ __forceinline__ void dq_step(float (&dq)[D / 8][4], const uint32_t (&qf)[D / 16][4],
                                        const uint32_t (&dof)[D / 16][4], const float (&lse2)[2],
                                        const float (&delta)[2], const Plan& p, const KeyTile (&tiles)[NSUB], int n,
                                        KTile k_tile, VTile v_tile, float scale_log2, AfterV&& after_v = {},
                                        Unused&& = {}) {
  const float inv_sl2 = 1.0f / scale_log2;
  // dS of tile j (P = exp2(S c + bias - LSE), dP = dO V^T, dS = P (dP - delta)) as an A fragment.
  struct Frag {
    uint32_t x[4];
  };
  auto ds_of = [&](int j) {
    float s[2][4] = {}, dp[2][4] = {};
    scores_16<D, T>(s, qf, k_tile(j));
    scores_16<D, T>(dp, dof, v_tile(j));
#pragma unroll
    for (int nn = 0; nn < 2; ++nn)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = score_col(nn, e);
        const float pr = (tiles[j].mask >> col & 1u)
                             ? fast_exp2(fmaf(s[nn][e] + raw_bias(p, tiles[j].level, tiles[j].t0 + col, inv_sl2),
                                              scale_log2, -lse2[e / 2]))
                             : 0.0f;
        s[nn][e] = pr * (dp[nn][e] - delta[e / 2]);  // dS
      }
    Frag f;
    pack_a<T>(f.x, s);
    return f;
  };
  if constexpr (std::is_same_v<std::decay_t<AfterV>, NoHook>) {
#pragma unroll
    for (int j = 0; j < NSUB; ++j) {
      if (j >= n) continue;
      const Frag f = ds_of(j);
      accumulate_16<D, T>(dq, f.x, k_tile(j));
    }
  } else {
    Frag dsf[NSUB];
#pragma unroll
    for (int j = 0; j < NSUB; ++j)
      if (j < n) dsf[j] = ds_of(j);
    after_v();
#pragma unroll
    for (int j = 0; j < NSUB; ++j)
      if (j < n) accumulate_16<D, T>(dq, dsf[j].x, k_tile(j));
  }
}

// dQ, query-major: each warp's rows over the forward's key stream (the same two loops as the
// forward: SHARED as rung 2, else rung 1; WIDE with SHARED: the fine blocks in 64-key steps,
// warp_loop_wide, the shared loop's stages reusing the warps' area as in the forward).

template <class T, int D, int WARPS, bool SHARED, bool WIDE = false>
__global__ void __launch_bounds__(32 * WARPS) backward_dq(const __grid_constant__ Plan p, const __grid_constant__ AttnArgs a) {
  static_assert(!WIDE || SHARED, "the wide fine loop is rung 2's");
  constexpr int kDT = D / 8, kTileBytes = kTile * D * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WarpRows w, w0;
  bool active;
  if constexpr (SHARED) {
    active = w.make_in(p, blockIdx.y, blockIdx.x * WARPS + warp);
    w0.make_in(p, blockIdx.y, blockIdx.x * WARPS);
  } else {
    active = w.make(p, static_cast<int64_t>(blockIdx.x) * WARPS + warp);
    if (!active) return;
  }
  const uint32_t base = detail::smem_addr(smem);
  constexpr int kWarpTiles = WIDE ? wide_warp_tiles(2) : warp_tiles(2);
  constexpr int kStageTiles = WIDE ? kWide : 2;  // the K area before V
  const uint32_t q_s = base + warp * kWarpTiles * kTileBytes, do_s = q_s + kTileBytes;
  const uint32_t k_s = do_s + kTileBytes, v_s = k_s + kStageTiles * kTileBytes;
  float dq[kDT][4] = {};
  uint32_t qf[D / 16][4], dof[D / 16][4];
  float lse2[2] = {INFINITY, INFINITY}, delta[2] = {0.0f, 0.0f};
  auto step = [&](const auto& tiles, int n, auto k_tile, auto v_tile, auto&&... hooks) {
    dq_step<T, D>(dq, qf, dof, lse2, delta, p, tiles, n, k_tile, v_tile, a.scale_log2, hooks...);
  };
  if (active) {
    const uint16_t* q_base = static_cast<const uint16_t*>(a.q.data) + row_offset(a.q, w.b, w.h, w.row0);
    const uint16_t* do_base = static_cast<const uint16_t*>(a.d_o.data) + row_offset(a.d_o, w.b, w.h, w.row0);
    warp_copy_tile<D>(q_s, a.aligned, a.q.data, [&](int r) { return r < w.rows ? q_base + r * a.q.stride[2] : nullptr; });
    warp_copy_tile<D>(do_s, a.aligned, a.q.data, [&](int r) { return r < w.rows ? do_base + r * a.d_o.stride[2] : nullptr; });
    const int g = lane / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows g, g + 8: LSE in base 2 and delta
      const int row = g + 8 * r, t = w.row0 + row;
      if (row >= w.rows) continue;
      lse2[r] = a.lse[w.b * a.lse_stride[0] + w.h * a.lse_stride[1] + t * a.lse_stride[2]] * kLog2e;
      delta[r] = a.delta[static_cast<int64_t>(w.bh) * p.len + t];
    }
    KeyStream own(p, w.bh, w.qb, 0, SHARED ? 0 : p.L, true);
    auto prologue = [&] { load_a<D>(qf, q_s), load_a<D>(dof, do_s); };
    if constexpr (WIDE) {
      warp_loop_wide<D, false>(p, a, w, own, k_s, v_s, prologue, step);
    } else {
      warp_loop<D>(p, a, w, own, k_s, v_s, prologue, step);
    }
  }
  if constexpr (SHARED) {
    KeyStream coarse(p, w0.bh, w0.qb, 1, p.L, false);
    uint32_t ck_s = base + WARPS * warp_tiles(2) * kTileBytes;
    if constexpr (WIDE) {
      ck_s = base;
      __syncthreads();  // every warp's fine blocks done: the stages take over their area
    }
    cta_loop<D, WARPS>(p, a, w0, w, active, coarse, ck_s, ck_s + 2 * kSharedTiles * kTileBytes, step);
  }
  if (active) {
    T* out = static_cast<T*>(const_cast<void*>(a.dq.data)) + row_offset(a.dq, w.b, w.h, w.row0);
    store_acc<T, D>(out, a.dq.stride[2], w.rows, dq, a.scale);
  }
}

// The query blocks that visit a key tile of `level`, in a fixed order: for level < L the sorted
// visitor entries of its key group (each entry a level-(level+1) query token: its B^level fine
// query blocks); for the coarsest level, every query block of every head of the kv head's group,
// cut into `splits` contiguous parts (this warp takes part `split`).
struct Visitors {
  const int32_t* entry = nullptr;
  int entries = 0, e = 0;
  int qb = 0, qb_end = 0, bh = 0;  // the current entry's fine query blocks [qb, qb_end) of bh
  int sub = 0;                     // row group of the current query block

  __device__ bool next(const Plan& p, int level, int& bh_out, int& qb_out, int& row0, int& rows) {
    while (true) {
      if (qb < qb_end) {
        bh_out = bh, qb_out = qb;
        row0 = qb * p.B + sub * kTile;
        rows = min(min(kTile, qb * p.B + p.B - row0), p.len - row0);
        if (++sub == p.warps_per_block) sub = 0, ++qb;
        if (rows > 0) return true;
        continue;
      }
      if (e >= entries) return false;
      const int v = entry[e++];
      const int n_up = p.level_len[level + 1];
      bh = v / n_up;
      const int a = v % n_up;
      const int span = p.region[level];  // fine query blocks under a level-(level+1) token: B^level
      qb = a * span;
      qb_end = min(qb + span, p.level_len[1]);
      sub = 0;
    }
  }
};

// dK, dV key-major: one warp per (tile of 16 key tokens of one group of `level`, split). Grid x:
// tiles * splits of this level, in kWarps per CTA.
template <class T, int D>
__global__ void __launch_bounds__(32 * kWarps) backward_dkv(const __grid_constant__ Plan p, const __grid_constant__ AttnArgs a, int level,
                                                            int tiles_per_group, int splits) {
  constexpr int kDT = D / 8, kTileBytes = kTile * D * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = p.level_len[level];
  const int groups = (n + p.B - 1) / p.B;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t per_bh = static_cast<int64_t>(groups) * tiles_per_group * splits;
  const int bh_kv = static_cast<int>(item / per_bh);
  if (bh_kv >= p.batch * p.heads_kv) return;
  const int rest = static_cast<int>(item % per_bh);
  const int split = rest % splits, tile_id = rest / splits;
  const int grp = tile_id / tiles_per_group;
  const int t0 = grp * p.B + tile_id % tiles_per_group * kTile;
  const int t_end = min(min(grp * p.B + p.B, n), t0 + kTile);
  const int b = bh_kv / p.heads_kv, h_kv = bh_kv % p.heads_kv;
  // Per warp: K, V, then 2 stages of (Q, dO).
  const uint32_t k_s = detail::smem_addr(smem) + warp * 6 * kTileBytes;
  const uint32_t v_s = k_s + kTileBytes, q_s = v_s + kTileBytes, do_s = q_s + kTileBytes;

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  if (t0 < t_end) {
    const bool k_aligned = a.aligned || level > 0;
    warp_copy_tile<D>(k_s, k_aligned, a.q.data, [&](int r) {
      return t0 + r < t_end ? level_row(p, a.k, p.k16, level, b, h_kv, bh_kv, t0 + r) : nullptr;
    });
    warp_copy_tile<D>(v_s, k_aligned, a.q.data, [&](int r) {
      return t0 + r < t_end ? level_row(p, a.v, p.v16, level, b, h_kv, bh_kv, t0 + r) : nullptr;
    });
    Visitors vis;
    if (level < p.L) {
      const int64_t key = static_cast<int64_t>(bh_kv) * groups + grp;
      vis.entry = a.visitors[level] + a.visit_begin[level][key];
      vis.entries = a.visit_end[level][key] - a.visit_begin[level][key];
    }
    // The coarsest level: every (head of the group, query block), as split `split` of `splits`.
    int all_begin = 0, all_end = 0;
    const int nq = p.level_len[1];
    if (level == p.L) {
      const int64_t total = static_cast<int64_t>(p.group) * nq;
      all_begin = static_cast<int>(total * split / splits);
      all_end = static_cast<int>(total * (split + 1) / splits);
    }
    const int g = lane / 4;
    // This thread's key rows g, g + 8: bias in base 2 (the log count), in range.
    float bias2[2];
    bool key_in[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = t0 + g + 8 * r;
      key_in[r] = t < t_end;
      bias2[r] = key_in[r] ? log2_count(p, level, t) : 0.0f;
    }
    // The visiting row groups, one after another; each group's Q and dO tiles (and its LSE and
    // delta) are fetched while the previous group is computed (double-buffered).
    struct Group {
      int bh, qb, row0, rows;
      float lse2[4], delta[4];  // this thread's query columns 2c, 2c + 1, 8 + 2c, 8 + 2c + 1
    };
    int all = all_begin, sub = 0;
    auto next_group = [&](Group& gr) {
      while (true) {
        if (level < p.L) return vis.next(p, level, gr.bh, gr.qb, gr.row0, gr.rows);
        if (all >= all_end) return false;
        const int hq = all / nq;
        gr.qb = all % nq;
        gr.bh = b * p.heads_q + h_kv * p.group + hq;
        gr.row0 = gr.qb * p.B + sub * kTile;
        gr.rows = min(min(kTile, gr.qb * p.B + p.B - gr.row0), p.len - gr.row0);
        if (++sub == p.warps_per_block) sub = 0, ++all;
        if (gr.rows > 0) return true;
      }
    };
    auto fetch = [&](Group& gr, int stage) {
      const int qb_b = gr.bh / p.heads_q, qb_h = gr.bh % p.heads_q;
      const uint16_t* q_base = static_cast<const uint16_t*>(a.q.data) + row_offset(a.q, qb_b, qb_h, gr.row0);
      const uint16_t* do_base = static_cast<const uint16_t*>(a.d_o.data) + row_offset(a.d_o, qb_b, qb_h, gr.row0);
      const int rows = gr.rows;
      warp_copy_tile<D>(q_s + stage * 2 * kTileBytes, a.aligned, a.q.data,
                        [&](int r) { return r < rows ? q_base + r * a.q.stride[2] : nullptr; });
      warp_copy_tile<D>(do_s + stage * 2 * kTileBytes, a.aligned, a.q.data,
                        [&](int r) { return r < rows ? do_base + r * a.d_o.stride[2] : nullptr; });
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = (j / 2) * 8 + 2 * (lane % 4) + (j & 1);
        const bool ok = col < rows;
        const int t = gr.row0 + col;
        gr.lse2[j] = ok ? a.lse[qb_b * a.lse_stride[0] + qb_h * a.lse_stride[1] + t * a.lse_stride[2]] * kLog2e
                        : INFINITY;
        gr.delta[j] = ok ? a.delta[static_cast<int64_t>(gr.bh) * p.len + t] : 0.0f;
      }
    };
    Group cur, nxt;
    bool have = next_group(cur);
    if (have) fetch(cur, 0);
    detail::cp_async_commit();
    for (int stage = 0; have; stage ^= 1) {
      const bool more = next_group(nxt);
      if (more) fetch(nxt, stage ^ 1);
      detail::cp_async_commit();
      detail::cp_async_wait<1>();
      __syncwarp();
      const uint32_t qt = q_s + stage * 2 * kTileBytes, dot = do_s + stage * 2 * kTileBytes;
      // Key rows this query block leaves out (dedupe: its level-`level` ancestor's picks).
      const uint32_t key_mask = exclude(p, cur.bh, cur.qb, level, t0, 0xffffu);
      uint32_t af[D / 16][4];  // K, then V, as A fragments (reloaded: fewer registers held)
      float st[2][4] = {}, dpt[2][4] = {};
      load_a<D>(af, k_s);
      scores_16<D, T>(st, af, qt);   // S^T [key][query]
      load_a<D>(af, v_s);
      scores_16<D, T>(dpt, af, dot); // dP^T = V dO^T
      float pt[2][4];
#pragma unroll
      for (int nn = 0; nn < 2; ++nn)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kr = e / 2;  // key row g + 8 kr
          const int j = nn * 2 + (e & 1);
          const bool on = key_in[kr] && (key_mask >> (g + 8 * kr) & 1u);
          const float pr = on ? fast_exp2(fmaf(st[nn][e], a.scale_log2, bias2[kr] - cur.lse2[j])) : 0.0f;
          pt[nn][e] = pr;
          st[nn][e] = pr * (dpt[nn][e] - cur.delta[j]);  // dS^T
        }
      uint32_t pf[4], dsf[4];
      pack_a<T>(pf, pt);
      pack_a<T>(dsf, st);
      accumulate_16<D, T>(dv, pf, dot);
      accumulate_16<D, T>(dk, dsf, qt);
      __syncwarp();  // this stage is the next prefetch's target
      cur = nxt;
      have = more;
    }
    detail::cp_async_wait<0>();
  }
  // Out: the level's gradient rows (f32), or this split's partial sums of the coarsest level.
  float* dk_out;
  float* dv_out;
  if (level == p.L && splits > 1) {
    const int64_t stride = static_cast<int64_t>(p.batch) * p.heads_kv * n * p.d;
    dk_out = a.dk_split + split * stride;
    dv_out = a.dv_split + split * stride;
  } else {
    dk_out = a.dk_pyr[level];
    dv_out = a.dv_pyr[level];
  }
  if (t0 >= t_end) return;
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + g + 8 * r;
    if (t >= t_end) continue;
    float* krow = dk_out + (static_cast<int64_t>(bh_kv) * n + t) * p.d;
    float* vrow = dv_out + (static_cast<int64_t>(bh_kv) * n + t) * p.d;
#pragma unroll
    for (int i = 0; i < kDT; ++i) {
      const int col = i * 8 + 2 * c;
      krow[col] = dk[i][2 * r] * a.scale;
      krow[col + 1] = dk[i][2 * r + 1] * a.scale;
      vrow[col] = dv[i][2 * r];
      vrow[col + 1] = dv[i][2 * r + 1];
    }
  }
}

// dst[x] = sum over s < splits of src[s * stride + x], in split order.
__global__ void sum_splits(const float* src, int splits, int64_t stride, float* dst) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= stride) return;
  float s = 0.0f;
  for (int i = 0; i < splits; ++i) s += src[i * stride + x];
  dst[x] = s;
}

// Pooling's backward: grad[l-1][bh, u, c] += grad[l][bh, u / B, c] / children(u / B).
__global__ void pool_backward(const float* coarse, float* fine, int n_fine, int n_coarse, int d, int B, int64_t total) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int c = static_cast<int>(idx % d);
  const int u = static_cast<int>(idx / d % n_fine);
  const int64_t bh = idx / (static_cast<int64_t>(d) * n_fine);
  const int t = u / B;
  const int children = min(B, n_fine - t * B);
  fine[idx] += coarse[(bh * n_coarse + t) * d + c] * (1.0f / static_cast<float>(children));
}

// The level-0 gradient (f32, [bh_kv, len, d]) into the caller's dk or dv (T, strided), with level
// 1's gradient spread to its children on the way (pool_backward of level 1 fused with the store:
// one read of the f32 level and one write of T instead of a read, a write, a read and a write):
// out[t] = fine[t] + coarse[t / B] / children. coarse null: no gradient above level 0. Four
// channels a thread (d % 4 == 0; the f32 levels are 16-byte aligned); vec_store: one 8-byte
// store of the four (an 8-byte aligned base, strides of whole 4-element chunks), else four.
template <class T>
__global__ void store_grad(const float* fine, const float* coarse, Rows dst, int heads, int len, int n_coarse, int d,
                           int B, int64_t rows, bool vec_store) {
  const int chunks = d / 4, per_block = blockDim.x / chunks;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / chunks;
  if (static_cast<int>(threadIdx.x) >= per_block * chunks || row >= rows) return;
  const int c = static_cast<int>(threadIdx.x % chunks) * 4;
  const int t = static_cast<int>(row % len);
  const int64_t bh = row / len;
  float4 x = *reinterpret_cast<const float4*>(fine + row * d + c);
  if (coarse != nullptr) {
    const int u = t / B;
    const float inv = 1.0f / static_cast<float>(min(B, len - u * B));
    const float4 g = *reinterpret_cast<const float4*>(coarse + (bh * n_coarse + u) * d + c);
    x.x = fmaf(g.x, inv, x.x);
    x.y = fmaf(g.y, inv, x.y);
    x.z = fmaf(g.z, inv, x.z);
    x.w = fmaf(g.w, inv, x.w);
  }
  T* out = static_cast<T*>(const_cast<void*>(dst.data)) + (bh / heads) * dst.stride[0] + (bh % heads) * dst.stride[1] +
           static_cast<int64_t>(t) * dst.stride[2] + c;
  if (vec_store) {
    *reinterpret_cast<uint2*>(out) = make_uint2(Pair<T>::pack(x.x, x.y), Pair<T>::pack(x.z, x.w));
  } else {
    out[0] = static_cast<T>(x.x), out[1] = static_cast<T>(x.y), out[2] = static_cast<T>(x.z), out[3] = static_cast<T>(x.w);
  }
}

// The transposed index of level l < L: for every valid pick of picks[l+1] (bh_q, a, slot), the
// key group (bh_kv * groups_l + pick) and the visitor (bh_q * n_{l+1} + a); invalid slots get key
// `sentinel`, sorted last.
__global__ void visit_entries(const __grid_constant__ Plan p, int l, int32_t* keys, int32_t* values, int32_t sentinel, int64_t total) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  const int n_up = p.level_len[l + 1];
  const int slot = static_cast<int>(idx % p.K);
  const int64_t row = idx / p.K;  // bh_q * n_up + a
  const int bh = static_cast<int>(row / n_up);
  const int bh_kv = bh / p.heads_q * p.heads_kv + bh % p.heads_q / p.group;
  const int groups = (p.level_len[l] + p.B - 1) / p.B;
  const bool ok = slot < p.counts[l + 1][row];
  keys[idx] = ok ? bh_kv * groups + p.picks[l + 1][idx] : sentinel;
  values[idx] = static_cast<int32_t>(row);
}

// begin/end of each key's run in the sorted keys (zero-filled before: absent keys have none).
__global__ void visit_ranges(const int32_t* keys, int64_t total, int32_t sentinel, int32_t* begin, int32_t* end) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int32_t k = keys[i];
  if (k == sentinel) return;
  if (i == 0 || keys[i - 1] != k) begin[k] = static_cast<int32_t>(i);
  if (i + 1 == total || keys[i + 1] != k) end[k] = static_cast<int32_t>(i + 1);
}

}  // namespace sparsa::cuda::llsa
