// y[n, rows] = x[n, cols] · wᵀ (+ y) for n <= 64: a stream of the weights through tensor cores.
//
// With 16 or 32 rows a product reads each weight once and does 2n FLOPs per weight byte pair,
// far below what the tensor cores could do per byte, so its time is the weight bytes over HBM's
// bandwidth plus whatever keeps the loads from being in flight or the bytes from arriving.
//
// The first version (rung 1 in bench/RESULTS.md) gave each CTA 16 columns and read x from L2 in
// every warp: x then crossed L2 once per 16 columns, as many bytes as the weights at n = 16 and
// twice or four times as many at 32 and 64, and L2's bandwidth, not HBM's, set the time. Now:
//   - a CTA owns WARPS x 16 output columns (weight rows) and one K range; x's rows over that range
//     are staged once into shared memory (padded rows: no bank conflicts), so x crosses L2 once
//     per WARPS x 16 columns;
//   - each warp streams its 16 weight rows over the K range, U steps of 32 k at a time: the U x 2
//     16-byte loads of a batch are issued before any arithmetic (past L1), and the first batch
//     before x is staged;
//   - the operands go to mma.m16n8k16 with no staging of the weights: a lane's 16 bytes of a
//     weight row are eight consecutive k, and x's fragments take the same permutation of k (lane
//     c's physical k 8c..8c+7 stand for logical k {2c, 2c+1, 2c+8, 2c+9} of two MMAs), which a
//     dot product allows;
//   - K is split over CTAs when there are too few column tiles to fill the GPU (or x's range
//     would not fit in shared memory): each split writes f32 partials to the workspace, and the
//     split that finishes last (a counter per column tile) adds them in split order and writes y.
//     No atomics on values: the same bits every run.
#include "skinny_gemm.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace sparsa::dlm {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kStep = 32;               // k per pair of MMAs
constexpr int kSmemBytes = 48 * 1024;   // x's staged range (the default dynamic limit)
constexpr int64_t kMaxCols = int64_t{1} << 22;

__device__ __forceinline__ uint4 load_weights(const bf16* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x's staged row stride in elements for a K range: the range plus 64 bytes when the range is a
// multiple of 128 bytes, so that rows start 64 bytes apart modulo 128 (the 8 lanes of a quarter
// warp, two rows by four 16-byte chunks, then hit eight different bank groups).
__host__ __device__ constexpr int x_stride(int krange) { return krange + ((krange * 2) % 128 == 0 ? 32 : 0); }

struct Launch {
  int mt = 1;            // m16 tiles of rows
  int64_t tiles = 0;     // column tiles (grid x)
  int splits = 1;        // K ranges (grid y)
  int krange = 0;        // k per split, a multiple of kStep
  size_t smem = 0;       // x's staged range
  size_t counter_bytes = 0, partial_bytes = 0;
};

__device__ __forceinline__ void store_out(const SkinnyGemm& g, int64_t row, int64_t col, float v) {
  const int64_t i = row * g.rows + col;
  if (g.y_f32) {
    float* y = static_cast<float*>(g.y);
    y[i] = g.accumulate ? y[i] + v : v;
  } else {
    static_cast<bf16*>(g.y)[i] = __float2bfloat16(v);
  }
}

template <int MT, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32) skinny_gemm_kernel(const SkinnyGemm g, const int krange,
                                                                  const int splits, int* counters, float* partial) {
  constexpr int kCols = WARPS * 16;
  extern __shared__ __align__(16) bf16 xs[];  // [16 * MT][x_stride(krange)]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gi = lane / 4, ci = lane % 4;  // the MMA fragments' row group and k pair
  const int64_t tile = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t col0 = tile * kCols + warp * 16;
  const int cols = static_cast<int>(g.cols);
  const int k_begin = split * krange, k_len = min(cols - k_begin, krange);
  const int steps = (k_len + kStep - 1) / kStep;
  const int stride = x_stride(krange);
  const auto* w = static_cast<const bf16*>(g.w);
  const auto* x = static_cast<const bf16*>(g.x);

  const bf16* wrow[2];  // this lane's weight row in each of the warp's two 8-column groups
  bool wok[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t r = col0 + 8 * j + gi;
    wok[j] = r < g.rows;
    wrow[j] = w + (wok[j] ? r : 0) * g.cols + k_begin + 8 * ci;
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wv[U][2];
  auto load_batch = [&](int s) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (s + u) * kStep;
      const bool in = s + u < steps && k + 8 * ci < k_len;
#pragma unroll
      for (int j = 0; j < 2; ++j) wv[u][j] = in && wok[j] ? load_weights(wrow[j] + k) : zero;
    }
  };
  load_batch(0);

  // x[:, k_begin, + k_len) into shared memory, rows past n and k past the range as zeros.
  {
    const int chunks_per_row = steps * kStep / 8;
    for (int idx = threadIdx.x; idx < 16 * MT * chunks_per_row; idx += WARPS * 32) {
      const int r = idx / chunks_per_row, k = (idx % chunks_per_row) * 8;
      uint4 v = zero;
      if (r < g.n && k < k_len) v = __ldg(reinterpret_cast<const uint4*>(x + r * g.cols + k_begin + k));
      *reinterpret_cast<uint4*>(xs + r * stride + k) = v;
    }
  }
  __syncthreads();

  float acc[MT][2][4] = {};
  for (int s = 0; s < steps; s += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s + u >= steps) break;  // past the staged range (its weights are zeros anyway)
      const bf16* xk = xs + (s + u) * kStep + 8 * ci;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint4 lo = *reinterpret_cast<const uint4*>(xk + (16 * t + gi) * stride);
        const uint4 hi = *reinterpret_cast<const uint4*>(xk + (16 * t + 8 + gi) * stride);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          mma(acc[t][j], lo.x, hi.x, lo.y, hi.y, wv[u][j].x, wv[u][j].y);
          mma(acc[t][j], lo.z, hi.z, lo.w, hi.w, wv[u][j].z, wv[u][j].w);
        }
      }
    }
    if (s + U < steps) load_batch(s + U);
  }

  // The accumulator layout of m16n8: element e of (t, j) is row 16t + gi (+ 8 for e >= 2),
  // column col0 + 8j + 2ci (+ 1 for odd e).
  if (splits == 1) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t row = 16 * t + gi + (e >= 2 ? 8 : 0), col = col0 + 8 * j + 2 * ci + (e & 1);
          if (row < g.n && col < g.rows) store_out(g, row, col, acc[t][j][e]);
        }
      }
    }
    return;
  }
  // Split K: partials [splits][n][rows] after the counters; the last split of this column tile
  // adds them in split order.
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = 16 * t + gi + (e >= 2 ? 8 : 0), col = col0 + 8 * j + 2 * ci + (e & 1);
        if (row < g.n && col < g.rows) partial[(split * g.n + row) * g.rows + col] = acc[t][j][e];
      }
    }
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(&counters[tile], 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < g.n * kCols; idx += WARPS * 32) {
    const int64_t row = idx / kCols, col = tile * kCols + idx % kCols;
    if (col >= g.rows) continue;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += __ldcg(&partial[(s * g.n + row) * g.rows + col]);
    store_out(g, row, col, sum);
  }
  if (threadIdx.x == 0) counters[tile] = 0;  // ready for the next call
}

struct Variant {
  const char* name;
  int warps, unroll, ctas_per_sm;  // ctas_per_sm: the grid the splits aim at, per multiprocessor
};
// The rungs the benchmark compares (bench_dlm --rows gemm); kDefault is the one the engine runs.
constexpr Variant kVariants[] = {
    {"128 cols/CTA, 8 steps in flight, 2 CTAs/SM", 8, 8, 2},
    {"128 cols/CTA, 4 steps in flight, 2 CTAs/SM", 8, 4, 2},
    {"64 cols/CTA, 8 steps in flight, 4 CTAs/SM", 4, 8, 4},
    {"128 cols/CTA, 8 steps in flight, 4 CTAs/SM", 8, 8, 4},
};
constexpr int kDefault = 0;
constexpr int kRungs = static_cast<int>(sizeof(kVariants) / sizeof(kVariants[0]));

int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) !=
                                                     cudaSuccess) {
      cudaGetLastError();
      return 132;
    }
    return n;
  }();
  return count;
}

Launch plan(const SkinnyGemm& g, const Variant& v) {
  Launch l;
  l.mt = static_cast<int>((g.n + 15) / 16);
  const int64_t cols_per_cta = 16 * v.warps;
  l.tiles = (g.rows + cols_per_cta - 1) / cols_per_cta;
  const int steps = static_cast<int>((g.cols + kStep - 1) / kStep);
  // The most steps per split whose x range fits the shared memory budget.
  int fit = 1;
  while (fit < steps && size_t(16 * l.mt) * x_stride((fit + 1) * kStep) * 2 <= kSmemBytes) ++fit;
  const int64_t want_ctas = int64_t{v.ctas_per_sm} * multiprocessors();
  const int want_splits = static_cast<int>(std::clamp<int64_t>((want_ctas + l.tiles - 1) / l.tiles, 1, steps));
  const int per_split = std::min(fit, (steps + want_splits - 1) / want_splits);
  l.krange = per_split * kStep;
  l.splits = (steps + per_split - 1) / per_split;
  l.smem = size_t(16 * l.mt) * x_stride(l.krange) * 2;
  if (l.splits > 1) {
    l.counter_bytes = (static_cast<size_t>(l.tiles) * 4 + 255) / 256 * 256;
    l.partial_bytes = static_cast<size_t>(l.splits) * g.n * g.rows * 4;
  }
  return l;
}

template <int WARPS, int U>
cudaError_t launch_variant(const SkinnyGemm& g, const Launch& l, cudaStream_t stream) {
  auto* counters = static_cast<int*>(g.workspace);
  auto* partial = reinterpret_cast<float*>(static_cast<char*>(g.workspace) + l.counter_bytes);
  const dim3 grid(static_cast<unsigned>(l.tiles), static_cast<unsigned>(l.splits)), block(WARPS * 32);
  switch (l.mt) {
    case 1: skinny_gemm_kernel<1, WARPS, U><<<grid, block, l.smem, stream>>>(g, l.krange, l.splits, counters, partial); break;
    case 2: skinny_gemm_kernel<2, WARPS, U><<<grid, block, l.smem, stream>>>(g, l.krange, l.splits, counters, partial); break;
    case 3: skinny_gemm_kernel<3, WARPS, U><<<grid, block, l.smem, stream>>>(g, l.krange, l.splits, counters, partial); break;
    default: skinny_gemm_kernel<4, WARPS, U><<<grid, block, l.smem, stream>>>(g, l.krange, l.splits, counters, partial); break;
  }
  return cudaGetLastError();
}

int rung(int variant) { return variant < 0 ? kDefault : variant; }

}  // namespace

bool skinny_gemm_supported(const SkinnyGemm& g) {
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  return g.n >= 1 && g.n <= kSkinnyMaxRows && g.rows >= 1 && g.rows < (int64_t{1} << 31) && g.cols >= 8 &&
         g.cols % 8 == 0 && g.cols <= kMaxCols && aligned(g.x, 16) && aligned(g.w, 16) && aligned(g.y, 4) &&
         (g.y_f32 || !g.accumulate) && g.y != nullptr;
}

int skinny_gemm_variants() { return kRungs; }
const char* skinny_gemm_variant_name(int v) { return v >= 0 && v < kRungs ? kVariants[v].name : "?"; }

size_t skinny_gemm_workspace_bytes(const SkinnyGemm& g, int variant) {
  if (!skinny_gemm_supported(g) || rung(variant) >= kRungs) return 0;
  const Launch l = plan(g, kVariants[rung(variant)]);
  return l.counter_bytes + l.partial_bytes;
}

cudaError_t skinny_gemm_variant(const SkinnyGemm& g, int variant, cudaStream_t stream) {
  const int r = rung(variant);
  if (!skinny_gemm_supported(g) || r >= kRungs) return cudaErrorInvalidValue;
  const Variant& v = kVariants[r];
  const Launch l = plan(g, v);
  if (l.counter_bytes + l.partial_bytes > 0 &&
      (g.workspace == nullptr || g.workspace_bytes < l.counter_bytes + l.partial_bytes ||
       reinterpret_cast<uintptr_t>(g.workspace) % 256 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (v.warps == 8 && v.unroll == 8) return launch_variant<8, 8>(g, l, stream);
  if (v.warps == 8 && v.unroll == 4) return launch_variant<8, 4>(g, l, stream);
  return launch_variant<4, 8>(g, l, stream);
}

cudaError_t skinny_gemm(const SkinnyGemm& g, cudaStream_t stream) { return skinny_gemm_variant(g, -1, stream); }

}  // namespace sparsa::dlm
