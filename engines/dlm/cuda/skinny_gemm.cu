// y[n, rows] = x[n, cols] · wᵀ (+ y) for n <= 64: a stream of the weights through tensor cores.
//
// With 16 or 32 rows a product reads each weight once and does 2n FLOPs per weight, far below
// what the tensor cores could do per byte, so its time is the weight bytes over HBM's bandwidth
// plus whatever keeps the loads from being in flight. The kernel keeps them in flight:
//   - a CTA of 8 warps owns 8·NG output columns (weight rows); its warps split K into 8 slices of
//     whole 32-wide steps, and each warp walks its slice U steps at a time, issuing the U·NG
//     16-byte weight loads of those steps before any arithmetic (streamed past L1);
//   - the operands go to mma.m16n8k16 straight from the loads, with no shared-memory staging:
//     a lane's 16 bytes of a weight row are eight consecutive k, and the same permutation of k is
//     applied to x's fragments (lane c's physical k 8c..8c+7 stand for logical k {2c, 2c+1,
//     2c+8, 2c+9} of two MMAs), which a dot product allows;
//   - x (a few hundred KB at most) is read through the read-only cache, shared by the CTA's warps;
//   - the 8 slices' partial sums are added in shared memory in a fixed order: no atomics, the
//     same bits every run.
#include "skinny_gemm.h"

#include <cuda_bf16.h>

namespace sparsa::dlm {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kWarps = 8;   // K slices per CTA
constexpr int kStep = 32;   // k per pair of MMAs

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

// MT m16 tiles of rows, NG groups of 8 columns per CTA, U steps of 32 k per round of loads.
template <int MT, int NG, int U>
__global__ void __launch_bounds__(kWarps * 32) skinny_gemm_kernel(const SkinnyGemm g) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gi = lane / 4, ci = lane % 4;  // the MMA fragments' row group and k pair
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 8 * NG;
  const int cols = static_cast<int>(g.cols);
  const int steps = (cols + kStep - 1) / kStep;
  const int s_begin = warp * steps / kWarps, s_end = (warp + 1) * steps / kWarps;
  const auto* w = static_cast<const bf16*>(g.w);
  const auto* x = static_cast<const bf16*>(g.x);

  const bf16* wrow[NG];  // this lane's weight row of each column group, at its 8 k of a step
  bool wok[NG];
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    const int64_t r = col0 + 8 * j + gi;
    wok[j] = r < g.rows;
    wrow[j] = w + (wok[j] ? r : 0) * g.cols + 8 * ci;
  }
  const bf16* xrow[MT][2];  // rows 16t + gi and 16t + 8 + gi
  bool xok[MT][2];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = 16 * t + 8 * h + gi;
      xok[t][h] = r < g.n;
      xrow[t][h] = x + (xok[t][h] ? r : 0) * g.cols + 8 * ci;
    }
  }

  float acc[MT][NG][4] = {};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int s = s_begin; s < s_end; s += U) {
    uint4 wv[U][NG];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (s + u) * kStep;
      const bool in = s + u < s_end && k + 8 * ci < cols;
#pragma unroll
      for (int j = 0; j < NG; ++j) wv[u][j] = in && wok[j] ? load_weights(wrow[j] + k) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (s + u) * kStep;
      const bool in = s + u < s_end && k + 8 * ci < cols;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint4 lo = in && xok[t][0] ? __ldg(reinterpret_cast<const uint4*>(xrow[t][0] + k)) : zero;
        const uint4 hi = in && xok[t][1] ? __ldg(reinterpret_cast<const uint4*>(xrow[t][1] + k)) : zero;
#pragma unroll
        for (int j = 0; j < NG; ++j) {
          mma(acc[t][j], lo.x, hi.x, lo.y, hi.y, wv[u][j].x, wv[u][j].y);
          mma(acc[t][j], lo.z, hi.z, lo.w, hi.w, wv[u][j].z, wv[u][j].w);
        }
      }
    }
  }

  // The 8 slices' partial sums, one m16 tile at a time: warp w's fragment element e of column
  // group j at red[w][(j * 4 + e) * 32 + lane]; each output summed over w = 0..7 in order.
  __shared__ float red[kWarps][NG * 4 * 32];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int j = 0; j < NG; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][(j * 4 + e) * 32 + lane] = acc[t][j][e];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < NG * 128; idx += kWarps * 32) {
      float sum = 0.0f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) sum += red[v][idx];
      const int l = idx % 32, e = (idx / 32) % 4, j = idx / 128;
      // The accumulator layout of m16n8: e 0/1 row gi, e 2/3 row gi + 8; columns 2c and 2c + 1.
      const int64_t row = 16 * t + l / 4 + (e >= 2 ? 8 : 0);
      const int64_t col = col0 + 8 * j + 2 * (l % 4) + (e & 1);
      if (row < g.n && col < g.rows) {
        const int64_t i = row * g.rows + col;
        if (g.y_f32) {
          float* y = static_cast<float*>(g.y);
          y[i] = g.accumulate ? y[i] + sum : sum;
        } else {
          static_cast<bf16*>(g.y)[i] = __float2bfloat16(sum);
        }
      }
    }
    __syncthreads();
  }
}

template <int NG, int U>
cudaError_t launch(const SkinnyGemm& g, cudaStream_t stream) {
  const int64_t ctas = (g.rows + 8 * NG - 1) / (8 * NG);
  const dim3 grid(static_cast<unsigned>(ctas)), block(kWarps * 32);
  switch ((g.n + 15) / 16) {
    case 1: skinny_gemm_kernel<1, NG, U><<<grid, block, 0, stream>>>(g); break;
    case 2: skinny_gemm_kernel<2, NG, U><<<grid, block, 0, stream>>>(g); break;
    case 3: skinny_gemm_kernel<3, NG, U><<<grid, block, 0, stream>>>(g); break;
    default: skinny_gemm_kernel<4, NG, U><<<grid, block, 0, stream>>>(g); break;
  }
  return cudaGetLastError();
}

struct Variant {
  const char* name;
  cudaError_t (*run)(const SkinnyGemm&, cudaStream_t);
};
// The rungs the benchmark compares (bench_dlm --gemm-table); kDefault is the one the engine runs.
constexpr Variant kVariants[] = {
    {"16 cols/CTA, 4 steps in flight", launch<2, 4>},
    {"16 cols/CTA, 8 steps in flight", launch<2, 8>},
    {"8 cols/CTA, 8 steps in flight", launch<1, 8>},
    {"32 cols/CTA, 4 steps in flight", launch<4, 4>},
};
constexpr int kDefault = 0;

}  // namespace

bool skinny_gemm_supported(const SkinnyGemm& g) {
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  return g.n >= 1 && g.n <= kSkinnyMaxRows && g.rows >= 1 && g.rows < (int64_t{1} << 31) && g.cols >= 8 &&
         g.cols % 8 == 0 && g.cols < (int64_t{1} << 31) && aligned(g.x, 16) && aligned(g.w, 16) &&
         aligned(g.y, 4) && (g.y_f32 || !g.accumulate) && g.y != nullptr;
}

int skinny_gemm_variants() { return static_cast<int>(sizeof(kVariants) / sizeof(kVariants[0])); }
const char* skinny_gemm_variant_name(int v) { return kVariants[v].name; }

cudaError_t skinny_gemm_variant(const SkinnyGemm& g, int variant, cudaStream_t stream) {
  if (!skinny_gemm_supported(g) || variant < 0 || variant >= skinny_gemm_variants()) return cudaErrorInvalidValue;
  return kVariants[variant].run(g, stream);
}

cudaError_t skinny_gemm(const SkinnyGemm& g, cudaStream_t stream) { return skinny_gemm_variant(g, kDefault, stream); }

}  // namespace sparsa::dlm
