// Internal: the split-KV prefix executor, for few queries (len_q <= 64) against a long KV
// (Flash-Decoding: Dao, Haziza, Massa, Sizov 2023, https://pytorch.org/blog/flash-decoding/).
//
// With few queries the flash executor has one CTA per (batch, query head) and leaves the chip
// idle; and the time is the K/V read, not arithmetic. So:
//  - GQA packing: the `group` query heads of one kv head are stacked into the M dimension of
//    one tile (row r of the stack = query r % len_q of head h_kv * group + r / len_q), so every
//    K/V byte is loaded from memory once per 64 stacked rows, not once per query head.
//  - Split-KV: the key tiles of one kv head are cut into `num_splits` contiguous ranges, one CTA
//    each (grid: m-tile, split, batch * heads_kv; m-tiles of a split run side by side and share
//    K/V through L2). Each CTA runs the same online softmax as the flash executor and writes a
//    partial (O normalised by its own sum, f32) and its LSE.
//  - Merge of partials (O_s normalised by its own sum, LSE_s):
//      LSE = m + log sum_s exp(LSE_s - m),  O = sum_s exp(LSE_s - LSE) O_s     (m = max_s LSE_s)
//    The default: every split writes its partial to global memory and a second launch (one warp
//    per output row) merges them and writes O in the input dtype and LSE; with one split the CTA
//    writes O and LSE directly.
//    Opt-in (set_split_kv_cluster_merge(true)): the `cluster` CTAs of consecutive splits form a
//    thread-block cluster, put their partials in shared memory and each reduces 1/cluster of the
//    rows over distributed shared memory, so one partial per cluster reaches global memory. It is
//    correct (tested) but measured 1.6x slower on the H200 at 32K-128K (bench/RESULTS.md), so it
//    is off; the cause (cluster placement limiting residency, or the cluster-wide barrier) is not
//    yet measured.
// K/V tiles stream through a STAGES-deep cp.async ring (STAGES - 1 tiles in flight while one is
// computed); Q's fragments stay in registers for the whole key range.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/attention/flash_kernel.cuh"
#include "cuda/common/mma.cuh"

namespace sparsa::cuda::detail {

struct SplitKvParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t q_stride[3] = {}, k_stride[3] = {}, v_stride[3] = {}, out_stride[3] = {}, lse_stride[3] = {};
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1, len_q = 0, len_kv = 0;
  float scale_log2 = 0.0f;  // softmax scale * log2(e)

  int rows = 0;             // group * len_q: stacked query rows per kv head
  int num_kv_tiles = 0;     // ceil(len_kv / BN)
  int num_splits = 1;       // CTAs per (m-tile, batch, kv head) along the keys
  int tiles_per_split = 0;  // key tiles per split (the last splits may have fewer, or none)
  int cluster = 1;          // CTAs of consecutive splits merged in one cluster (1, 2, 4 or 8)
  int num_partials = 1;     // num_splits / cluster: partials left for the merge kernel
  // Partials, [num_partials][batch][heads_q][len_q] rows (O rows of head_dim floats); unused with one.
  float* part_o = nullptr;
  float* part_lse = nullptr;

  bool aligned_loads = true;  // q/k/v bases and strides allow 16-byte copies
  bool aligned_out = true;    // out base and strides allow 4-byte pair stores
};

template <int D, int BN, int STAGES>
struct SplitKvShape {
  static constexpr int kWarps = 4, kThreads = 128, kBM = 64;  // 4 warps x 16 stacked rows
  static constexpr int kSmemBytes = (kBM + STAGES * 2 * BN) * D * 2;  // Q + STAGES x (K, V)
};

template <class T, int D, int BN, int STAGES>
__global__ void __launch_bounds__(128) split_kv_kernel(const SplitKvParams p) {
  using Shape = SplitKvShape<D, BN, STAGES>;
  constexpr int BM = Shape::kBM, THREADS = Shape::kThreads;
  constexpr int kDT = D / 8, kNT = BN / 8, kChunks = D / 8;
  constexpr uint32_t kTileBytes = BN * D * 2;
  constexpr float kLn2 = 0.69314718055994531f;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_smem = smem_addr(smem);
  const uint32_t kv_smem = q_smem + BM * D * 2;  // stage s: K at 2s tiles, V at 2s + 1
  auto k_stage = [&](int s) { return kv_smem + 2 * s * kTileBytes; };
  auto v_stage = [&](int s) { return kv_smem + (2 * s + 1) * kTileBytes; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int row0 = blockIdx.x * BM, split = blockIdx.y;
  const int b = blockIdx.z / p.heads_kv, h_kv = blockIdx.z % p.heads_kv;
  const int tile_begin = split * p.tiles_per_split;
  const int num_tiles = max(0, min(tile_begin + p.tiles_per_split, p.num_kv_tiles) - tile_begin);

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
    if (valid < BN) {  // the last tile of the sequence: keys past len_kv see nothing
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (n * 8 + 2 * c + (e & 1) >= valid) s[n][e] = -INFINITY;
    }
    // Online softmax (as in flash_kernel.cuh), rows g (elements 0, 1) and g + 8 (2, 3).
    uint32_t p_frag[kNT / 2][4];
    float alpha[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int n = 0; n < kNT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      base[r] = mx == -INFINITY ? 0.0f : mx * p.scale_log2;
      alpha[r] = fast_exp2(row_max[r] * p.scale_log2 - base[r]);
      row_max[r] = mx;
      row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = fast_exp2(fmaf(s[n][e], p.scale_log2, -base[e / 2]));
      row_sum[0] += s[n][0] + s[n][1];
      row_sum[1] += s[n][2] + s[n][3];
      p_frag[n / 2][(n % 2) * 2 + 0] = Pair<T>::pack(s[n][0], s[n][1]);
      p_frag[n / 2][(n % 2) * 2 + 1] = Pair<T>::pack(s[n][2], s[n][3]);
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < kDT; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
      }
    }
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

  if (p.cluster > 1) {  // ---- merge inside the cluster, over distributed shared memory ----
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    constexpr int kStride = D + 4;  // floats per row of the partial O (padding against bank conflicts)
    float* red_o = reinterpret_cast<float*>(smem + BM * D * 2);  // over the K/V stages: [BM][kStride]
    float* red_lse = red_o + BM * kStride;                         // [BM]
    static_assert(BM * (kStride + 1) * 4 <= STAGES * 2 * BN * D * 2, "the partial fits in the K/V stages");
    __syncthreads();  // every warp is done with the stages
    if (warp_active) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int rl = warp * 16 + g + 8 * r;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int n = 0; n < kDT; ++n)
          *reinterpret_cast<float2*>(red_o + rl * kStride + n * 8 + 2 * c) =
              make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        if (c == 0) red_lse[rl] = l > 0.0f ? (row_max[r] * p.scale_log2 + log2f(l)) * kLn2 : -INFINITY;
      }
    }
    cluster.sync();  // every CTA's partial is visible to the cluster
    const int C = p.cluster, rank = static_cast<int>(cluster.block_rank());
    const int rows_per_rank = BM / C;
    for (int idx = threadIdx.x; idx < rows_per_rank * (D / 4); idx += THREADS) {
      const int rl = rank * rows_per_rank + idx / (D / 4), col = (idx % (D / 4)) * 4, row = row0 + rl;
      if (row >= p.rows) continue;
      float lse_c[8], m = -INFINITY;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        lse_c[k] = k < C ? *cluster.map_shared_rank(red_lse + rl, k) : -INFINITY;
        m = fmaxf(m, lse_c[k]);
      }
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sum = 0.0f;
      if (m != -INFINITY) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          if (k >= C) break;
          const float w = expf(lse_c[k] - m);  // 0 for a split that saw no key
          sum += w;
          const float4 x = *reinterpret_cast<const float4*>(cluster.map_shared_rank(red_o + rl * kStride + col, k));
          acc[0] += w * x.x, acc[1] += w * x.y, acc[2] += w * x.z, acc[3] += w * x.w;
        }
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float lse = sum > 0.0f ? m + logf(sum) : -INFINITY;
      const int h = h_kv * p.group + row / p.len_q, i = row % p.len_q;
      if (p.num_partials == 1) {
        T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const uint32_t packed = Pair<T>::pack(acc[e] * inv, acc[e + 1] * inv);
          if (p.aligned_out) {
            *reinterpret_cast<uint32_t*>(out + col + e) = packed;
          } else {
            reinterpret_cast<uint16_t*>(out)[col + e] = static_cast<uint16_t>(packed & 0xffffu);
            reinterpret_cast<uint16_t*>(out)[col + e + 1] = static_cast<uint16_t>(packed >> 16);
          }
        }
        if (col == 0) p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = lse;
      } else {
        const int64_t prow = (static_cast<int64_t>(split / C) * p.batch + b) * p.heads_q * p.len_q +
                             static_cast<int64_t>(h) * p.len_q + i;
        *reinterpret_cast<float4*>(p.part_o + prow * D + col) =
            make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
        if (col == 0) p.part_lse[prow] = lse;
      }
    }
    cluster.sync();  // no CTA leaves while another still reads its shared memory
    return;
  }

  if (!warp_active) return;

  // ---- epilogue: O / l and LSE, final (one split) or partial ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + warp * 16 + g + 8 * r;
    if (row >= p.rows) continue;
    const int h = h_kv * p.group + row / p.len_q, i = row % p.len_q;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const float lse = l > 0.0f ? (row_max[r] * p.scale_log2 + log2f(l)) * kLn2 : -INFINITY;
    if (p.num_partials == 1) {
      T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
#pragma unroll
      for (int n = 0; n < kDT; ++n) {
        const int col = n * 8 + 2 * c;
        const uint32_t packed = Pair<T>::pack(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        if (p.aligned_out) {
          *reinterpret_cast<uint32_t*>(out + col) = packed;
        } else {
          reinterpret_cast<uint16_t*>(out)[col] = static_cast<uint16_t>(packed & 0xffffu);
          reinterpret_cast<uint16_t*>(out)[col + 1] = static_cast<uint16_t>(packed >> 16);
        }
      }
      if (c == 0) p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = lse;
    } else {
      const int64_t prow = ((static_cast<int64_t>(split) * p.batch + b) * p.heads_q + h) * p.len_q + i;
      float* po = p.part_o + prow * D;
#pragma unroll
      for (int n = 0; n < kDT; ++n)
        *reinterpret_cast<float2*>(po + n * 8 + 2 * c) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      if (c == 0) p.part_lse[prow] = lse;
    }
  }
}

// One warp per output row (batch, head, query): the LSE merge of the splits' partials. Lane l
// holds the weight of split s0 + l of each chunk of 32 and broadcasts it by shuffle, so the
// partial-O loads of a chunk do not wait on each other (8 in flight per lane); two rows per CTA
// spread the merge over the whole chip. The partials were just written and mostly sit in L2.
constexpr int kMergeRowsPerCta = 2;
template <class T, int D>
__global__ void __launch_bounds__(32 * kMergeRowsPerCta) split_kv_merge_kernel(const SplitKvParams p) {
  constexpr int kPerLane = D / 32;  // 4 (D = 128) or 2 (D = 64) contiguous floats per lane
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.len_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerCta + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int i = static_cast<int>(row % p.len_q);
  const int h = static_cast<int>(row / p.len_q % p.heads_q);
  const int b = static_cast<int>(row / p.len_q / p.heads_q);

  float m = -INFINITY;
  for (int s = lane; s < p.num_partials; s += 32) m = fmaxf(m, p.part_lse[s * rows + row]);
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  float acc[kPerLane] = {};
  float sum = 0.0f;  // per lane: the weights of its splits
  if (m != -INFINITY) {
    for (int s0 = 0; s0 < p.num_partials; s0 += 32) {
      const int n = min(32, p.num_partials - s0);
      const float w_lane = lane < n ? expf(p.part_lse[(s0 + lane) * rows + row] - m) : 0.0f;  // 0: no key
      sum += w_lane;
      const float* po = p.part_o + ((s0 * rows) + row) * D + lane * kPerLane;
#pragma unroll 8
      for (int j = 0; j < n; ++j) {
        const float w = __shfl_sync(0xffffffffu, w_lane, j);
        const float* x = po + j * rows * D;
        if constexpr (kPerLane == 4) {
          const float4 v = *reinterpret_cast<const float4*>(x);
          acc[0] += w * v.x, acc[1] += w * v.y, acc[2] += w * v.z, acc[3] += w * v.w;
        } else {
          const float2 v = *reinterpret_cast<const float2*>(x);
          acc[0] += w * v.x, acc[1] += w * v.y;
        }
      }
    }
  }
#pragma unroll
  for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2) {
    const int col = lane * kPerLane + e;
    const uint32_t packed = Pair<T>::pack(acc[e] * inv, acc[e + 1] * inv);
    if (p.aligned_out) {
      *reinterpret_cast<uint32_t*>(out + col) = packed;
    } else {
      reinterpret_cast<uint16_t*>(out)[col] = static_cast<uint16_t>(packed & 0xffffu);
      reinterpret_cast<uint16_t*>(out)[col + 1] = static_cast<uint16_t>(packed >> 16);
    }
  }
  if (lane == 0) {
    p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = sum > 0.0f ? m + logf(sum) : -INFINITY;
  }
}

}  // namespace sparsa::cuda::detail
