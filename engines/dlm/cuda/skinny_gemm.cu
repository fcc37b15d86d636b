// y[n, rows] = x[n, cols] · wᵀ (+ y) for n <= 64: a stream of the weights through tensor cores.
//
// With 16 rows a product reads each weight once and does 32 FLOPs per weight, far below what
// the tensor cores could do per byte: its time is the weight bytes over HBM's bandwidth plus the
// time no loads are in flight (the launch, the first bytes' latency, the tail). The kernel:
//   - a column tile is 8·NG output columns (weight rows): a contiguous run of the weight matrix.
//     The CTA's 8 warps split K into 8 slices of whole 32-wide steps and each warp walks its
//     slice U steps at a time, issuing the U·NG 16-byte weight loads of those steps (past L1)
//     before any arithmetic;
//   - the operands go to mma.m16n8k16 straight from the loads: a lane's 16 bytes of a weight row
//     are eight consecutive k, and x's fragments take the same permutation of k (lane c's
//     physical k 8c..8c+7 stand for logical k {2c, 2c+1, 2c+8, 2c+9} of two MMAs), which a dot
//     product allows; x (small, L2-resident) is read through the read-only cache;
//   - the slices' partial sums are added in shared memory in a fixed order: no atomics, the same
//     bits every run;
//   - persistent CTAs (as many as fit at once) walk the column tiles, loading the next tile's
//     first weights before reducing the current one;
//   - with `overlap_previous`, the launch is a programmatic dependent launch: the CTAs start while
//     the kernel before them still runs, load their first weights, and only then wait for it
//     (griddepcontrol.wait) before reading x or touching y.
// The ladder of versions, with what each taught, is in bench/RESULTS.md.
#include "skinny_gemm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <mutex>

namespace sparsa::dlm {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kWarps = 8;  // K slices per CTA
constexpr int kStep = 32;  // k per pair of MMAs

// 16 bytes of weights, past L1; `prefetch`: with L2's hint to fetch the whole 256-byte block.
template <bool kPrefetch>
__device__ __forceinline__ uint4 load_weights(const bf16* p) {
  uint4 v;
  if constexpr (kPrefetch) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  }
  return v;
}

// Which weight loads carry the 256-byte L2 hint.
enum Hint { kHintNone = 0, kHintAll = 1, kHintFirst = 2 /* the first step of a round: one per 256 bytes of a row at U = 4 */ };

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// MT m16 tiles of rows, NG groups of 8 columns per tile, U steps of 32 k per round of loads.
template <int MT, int NG, int U, int HINT>
__global__ void __launch_bounds__(kWarps * 32) skinny_gemm_kernel(const SkinnyGemm g, const bool prefetch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gi = lane / 4, ci = lane % 4;  // the MMA fragments' row group and k pair
  const int cols = static_cast<int>(g.cols);
  const int steps = (cols + kStep - 1) / kStep;
  const int s_begin = warp * steps / kWarps, s_end = (warp + 1) * steps / kWarps;
  const int64_t tiles = (g.rows + 8 * NG - 1) / (8 * NG);
  const auto* w = static_cast<const bf16*>(g.w);
  const auto* x = static_cast<const bf16*>(g.x);
  const uint4 zero = make_uint4(0, 0, 0, 0);

  // The weights of this lane for one round of U steps from step s of column tile `tile`.
  uint4 wv[U][NG];
  auto load_round = [&](int64_t tile, int s) {
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const int64_t r = tile * 8 * NG + 8 * j + gi;
      const bf16* row = w + (r < g.rows ? r : 0) * g.cols + 8 * ci;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = (s + u) * kStep;
        const bool in = r < g.rows && s + u < s_end && k + 8 * ci < cols;
        const bool hinted = HINT == kHintAll || (HINT == kHintFirst && u == 0);  // constant once unrolled
        wv[u][j] = !in ? zero : hinted ? load_weights<true>(row + k) : load_weights<false>(row + k);
      }
    }
  };

  int64_t tile = blockIdx.x;
  if (tile < tiles) {
    load_round(tile, s_begin);
    // The rest of this warp's slice of its first tile into L2 (one bulk prefetch per weight row),
    // so that the time before the wait streams more than the first round.
    const int64_t r = tile * 8 * NG + lane;
    const int k0 = (s_begin + U) * kStep, k1 = min(s_end * kStep, cols);
    if (prefetch && lane < 8 * NG && r < g.rows && k1 > k0) {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + r * g.cols + k0), "r"((k1 - k0) * 2)
                   : "memory");
    }
  }
  // Everything above reads only the weights; x and y belong to the kernels before this one.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");

  const bf16* xrow[MT][2];  // rows 16t + gi and 16t + 8 + gi, at this lane's 8 k of a step
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
  __shared__ float red[kWarps][NG * 4 * 32];

  for (; tile < tiles; tile += gridDim.x) {
    float acc[MT][NG][4] = {};
    for (int s = s_begin; s < s_end; s += U) {
      if (s > s_begin) load_round(tile, s);
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
    // The next tile's first weights are in flight while this one is reduced.
    if (tile + gridDim.x < tiles) load_round(tile + gridDim.x, s_begin);

    // The 8 slices' partial sums, one m16 tile at a time: warp v's fragment element e of column
    // group j at red[v][(j * 4 + e) * 32 + lane]; each output summed over v = 0..7 in order.
    const int64_t col0 = tile * 8 * NG;
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
        // The accumulator layout of m16n8: e 0/1 row gi, e 2/3 row gi + 8; columns 2c, 2c + 1.
        const int l = idx % 32, e = (idx / 32) % 4, j = idx / 128;
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
}

using Kernel = void (*)(SkinnyGemm, bool);

struct Variant {
  const char* name;
  int ng, unroll, hint;
  bool persistent;  // as many CTAs as fit at once, walking the tiles; else one CTA per tile
  bool prefetch;    // a bulk L2 prefetch of the first tile's slice before the wait
};
// The rungs the benchmark compares (bench_dlm --rows gemm); kDefault is the one the engine runs.
constexpr Variant kVariants[] = {
    {"16 cols/tile, 4 steps in flight, L2 256B hint on every load, persistent", 2, 4, kHintAll, true, false},
    {"16 cols/tile, 4 steps in flight, no L2 hint, persistent", 2, 4, kHintNone, true, false},
    {"16 cols/tile, 8 steps in flight, no L2 hint, persistent", 2, 8, kHintNone, true, false},
    {"16 cols/tile, 4 steps in flight, L2 256B hint on a round's first step, persistent", 2, 4, kHintFirst, true, false},
    {"16 cols/tile, 2 steps in flight, L2 256B hint on every load, persistent", 2, 2, kHintAll, true, false},
    {"16 cols/tile, 4 steps in flight, L2 256B hint on every load, a CTA per tile", 2, 4, kHintAll, false, false},
    {"rung 0 + bulk L2 prefetch of the first tile before the wait", 2, 4, kHintAll, true, true},
};
constexpr int kDefault = 0;
constexpr int kRungs = static_cast<int>(sizeof(kVariants) / sizeof(kVariants[0]));

template <int NG, int U, int HINT>
Kernel kernel_for(int mt) {
  switch (mt) {
    case 1: return skinny_gemm_kernel<1, NG, U, HINT>;
    case 2: return skinny_gemm_kernel<2, NG, U, HINT>;
    case 3: return skinny_gemm_kernel<3, NG, U, HINT>;
    default: return skinny_gemm_kernel<4, NG, U, HINT>;
  }
}

Kernel kernel_for(const Variant& v, int mt) {
  if (v.unroll == 2) return kernel_for<2, 2, kHintAll>(mt);
  if (v.unroll == 8) return kernel_for<2, 8, kHintNone>(mt);
  if (v.hint == kHintNone) return kernel_for<2, 4, kHintNone>(mt);
  if (v.hint == kHintFirst) return kernel_for<2, 4, kHintFirst>(mt);
  return kernel_for<2, 4, kHintAll>(mt);
}

// CTAs of `kernel` resident at once on the current device (multiprocessors x blocks per SM),
// computed once per kernel and device.
int64_t resident_ctas(Kernel kernel) {
  constexpr int kMaxDevices = 64, kMaxKernels = 64;
  static std::mutex mu;
  static Kernel seen[kMaxDevices][kMaxKernels];
  static int64_t count[kMaxDevices][kMaxKernels];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < kMaxKernels; ++i) {
    if (seen[device][i] == kernel) return count[device][i];
    if (seen[device][i] != nullptr) continue;
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, 0) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    seen[device][i] = kernel;
    count[device][i] = int64_t{sms} * std::max(per_sm, 1);
    return count[device][i];
  }
  return 0;
}

}  // namespace

bool skinny_gemm_supported(const SkinnyGemm& g) {
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  return g.n >= 1 && g.n <= kSkinnyMaxRows && g.rows >= 1 && g.rows < (int64_t{1} << 31) && g.cols >= 8 &&
         g.cols % 8 == 0 && g.cols < (int64_t{1} << 31) && aligned(g.x, 16) && aligned(g.w, 16) &&
         aligned(g.y, 4) && (g.y_f32 || !g.accumulate) && g.y != nullptr;
}

int skinny_gemm_variants() { return kRungs; }
const char* skinny_gemm_variant_name(int v) { return v >= 0 && v < kRungs ? kVariants[v].name : "?"; }

cudaError_t skinny_gemm_variant(const SkinnyGemm& g, int variant, cudaStream_t stream) {
  if (!skinny_gemm_supported(g) || variant < 0 || variant >= kRungs) return cudaErrorInvalidValue;
  const Variant& v = kVariants[variant];
  const Kernel kernel = kernel_for(v, static_cast<int>((g.n + 15) / 16));
  const int64_t tiles = (g.rows + 8 * v.ng - 1) / (8 * v.ng);
  int64_t ctas = tiles;
  if (v.persistent) {
    const int64_t resident = resident_ctas(kernel);
    if (resident > 0) ctas = std::min(tiles, resident);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(kWarps * 32);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = overlap;
  config.numAttrs = g.overlap_previous ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, g, v.prefetch);
  if (e != cudaSuccess) cudaGetLastError();
  return e;
}

cudaError_t skinny_gemm(const SkinnyGemm& g, cudaStream_t stream) {
  return skinny_gemm_variant(g, kDefault, stream);
}

}  // namespace sparsa::dlm
