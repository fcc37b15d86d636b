// flash_ladder — the kernel ladder of the flash executor: each rung, a checker
// against rung 0, and a timer. Only the winner is promoted into src/cuda/attention/.
//
// Shape: bf16, batch 1, 32 heads, head_dim 128, non-causal, dense; FLOPs = 4 * H * N^2 * D.
// Timer: CUDA events, 3 warm-ups, median of 10 (N = 32K) or 30 (N = 8K). Inputs 96 MB (8K) and
// 768 MB (32K) of q, k, v: well over the 60 MB L2. Ceiling: 790 TFLOP/s (bf16 GEMM measured on
// this H200 kind), and about 648 TFLOP/s for mma.sync m16n8k16.
//
// Rung 0: one thread per query row, f32 online softmax, no tensor cores. The checker's oracle.
// Rung 1: FA2-style: mma.sync m16n8k16 (bf16 in, f32 accumulate), K/V tiles double-buffered with
//         cp.async, ldmatrix (.trans for V), XOR-swizzled rows, online softmax in registers.
//         Variants: warps per CTA (w), query rows per warp (r = 16 x m-tiles), key-tile width (BN),
//         Q fragments kept in registers (Qreg) or reloaded from shared memory, min CTAs per SM.
//
// Measured on one H200 (nvidia-h200 kind, clocks not locked), scripts/gpu-check, dense, TFLOP/s at
// N = 8K / 32K (run order; each line is one run of this file):
//   rung 0 scalar f32 ........................................ 4.3 (8K)
//   rung 1, first cut (per-chunk branchy copies, exp2f):
//     4w x16r BN64 133 / 138   8w x16r BN64 171 / 179   4w x32r BN64 135 / 142
//     4w x32r BN32 181 / 187   8w x32r BN64 207 / 214
//     ncu (8w x16r): 9.2 issued instructions per mma, IPC 1.64, 2 warps per scheduler, 59% of
//     cycles with no eligible warp; the cp.async address/branch code per 16-byte chunk dominated.
//   rung 1, copies with one uniform branch per tile, incremental key-tile walk, ex2.approx.ftz:
//     1a 4w x16r BN64 Qreg 241 / 254        1b 8w x16r BN64 Qreg 258 / 268
//     1c 8w x16r BN64 Qsmem 2 CTAs 262 / 273   1d 4w x16r BN32 Qreg 3 CTAs 225 / 235
//     1e 4w x32r BN32 279 / 287              1f 4w x32r BN64 296 / 305
//     1g 8w x32r BN64 310 / 315              1h 8w x32r BN32 274 / 279
//     ncu: 1b 6.2 instructions per mma, IPC 1.68; 1c (16 warps/SM) IPC 1.97 but more instructions.
//   rung 1, + O rescaled only when a row max moved (no change beyond run-to-run noise):
//     1a 241 / 254   1b 255 / 264   1c 260 / 271   1d 221 / 231
//     1e 276 / 286   1f 302 / 310   1g 309 / 316   1h 261 / 266
//   The same run's side-by-side numbers (cuDNN, FA2, Flex) are in bench/RESULTS.md.
// Rung 2 (flash_wgmma_kernel.cuh): wgmma m64nNk16 (SS for Q K^T, RS for P V with P from the S
//   accumulator), two consumer warpgroups of 64 rows, all threads copy K/V with cp.async into
//   128-byte-swizzled stages; variants: key-tile width, 2 or 3 stages. Measured 2026-11-30:
//     2a BN128 2 stages 354-358 / 369-372   2e BN128 3 stages 364 / 367   BN64 3 stages 311 / 322
//   2g (2e with its epilogue as a call: no ptxas C7515), measured later: 340 / 378 against 2e's
//     373-375 / 385-389 in the same runs — slower, so the executor keeps the epilogue inlined.
//   (and, since removed: P V waited in its own tile 316 / 333; P V lagging one tile behind S,
//   FlashAttention-3's intra-warpgroup overlap, 290 / 304 — slower: the copies and barriers still
//   sit between the tensor-core bursts).
// Rung 3 (flash_tma_kernel.cuh): 2e's consumers fed by a TMA producer warp over an mbarrier ring;
//   it needs tensor maps, so it is measured through the library (bench_attention.py): 502 / 510.
// Rung 3's consumer schedules (flash_tma_kernel.cuh, detail::set_flash_schedule; timed side by
//   side by bench_attention.py, scripts/gpu-check --flash): 3 plain; 3b
//   pingpong, the consumer warpgroups taking turns at the tensor cores (named barriers), so that
//   one's softmax runs under the other's products; 3c overlap, 3b plus each warpgroup's softmax
//   of S_t under its own P V_{t-1} (the intra-warpgroup overlap again, now with a producer warp
//   and no CTA barrier in the loop, which is what rung 2's attempt lacked); 3d late, 3b's order of
//   the products (P V_{t-1} issued just before S_t) without the turns. ptxas reports C7515
//   (wgmma serialised) for every plain rung-3 kernel and for none of 3b, 3c, 3d. Measured (H100,
//   bench/RESULTS.md, 2026-12-05): of 3's time, 3b 0.964 / 0.916 dense and 0.914 / 0.925
//   block-sparse at 8K / 32K; 3c 1.19 / 1.10 and 1.12 / 1.29 (slower); 3d 0.949 / 0.919 and
//   0.989 / 1.029 (the order of the products helps dense only; the turns help both).
//   3c's slowness was ptxas's: C7514 / C7515 (every wgmma of the kernel serialised) because a
//   branch skipped a product (tiles without keys, the first tile's missing P V) while another
//   group was in flight. Fixed (2026-12-05): tiles without keys are not walked by producer or
//   consumers, 3c peels its first tile and issues both products of a turn unconditionally, and
//   waits for its last P V before the epilogue. Then (H100, same run): 3c 0.827 / 0.803 of 3's
//   time dense (0.924x / 0.988x cuDNN), 0.815 / 0.941 block-sparse; BA-Att at 128K, 10%, 8.53x
//   cuDNN against 3b's 7.92x. 3e: 176-key tiles (FlashAttention-3's tile for dense d 128,
//   two stages): 3b 0.839x / 0.901x cuDNN, 3d 0.861x / 0.913x, 3c 0.730x / 0.797x (the
//   profile: 3c at 176 stalls on long scoreboard, 2.7 cycles per instruction against 0.5).
// Promoted: rung 3 with schedule 3c and 128-key tiles when K and V are read in order, rung 2
//   otherwise (attention.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/attention/flash_wgmma_kernel.cuh"

using sparsa::cuda::detail::FlashParams;
using sparsa::cuda::detail::FlashShape;
using sparsa::cuda::detail::flash_forward_kernel;
using sparsa::cuda::detail::flash_wgmma_kernel;
using sparsa::cuda::detail::WgmmaShape;

#define CHECK(expr)                                                                            \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// Deterministic pseudo-random normal-ish values (sum of uniforms), written as bf16.
__global__ void fill_random(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    float s = 0;
    for (int r = 0; r < 4; ++r) {
      h ^= h >> 16;
      h *= 0x7feb352du;
      h ^= h >> 15;
      h *= 0x846ca68bu;
      h ^= h >> 16;
      s += (h & 0xffffff) / float(0x1000000);
    }
    x[i] = __float2bfloat16((s - 2.0f) * 1.7320508f);
  }
}

// Rung 0: one thread per (head, query row); f32 math, online softmax. [H, N, D] contiguous.
template <int D>
__global__ void rung0_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                             float* out, int heads, int n, float scale) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= int64_t(heads) * n) return;
  const int64_t h = row / n;
  float qr[D], o[D];
  for (int t = 0; t < D; ++t) qr[t] = __bfloat162float(q[row * D + t]) * scale, o[t] = 0;
  float m = -INFINITY, l = 0;
  for (int j = 0; j < n; ++j) {
    const __nv_bfloat16* kj = k + (h * n + j) * D;
    float s = 0;
    for (int t = 0; t < D; ++t) s += qr[t] * __bfloat162float(kj[t]);
    const float m2 = fmaxf(m, s), a = __expf(m - m2), p = __expf(s - m2);
    l = l * a + p;
    const __nv_bfloat16* vj = v + (h * n + j) * D;
    for (int t = 0; t < D; ++t) o[t] = o[t] * a + p * __bfloat162float(vj[t]);
    m = m2;
  }
  for (int t = 0; t < D; ++t) out[row * D + t] = o[t] / l;
}

FlashParams dense_params(const void* q, const void* k, const void* v, void* out, float* lse, int heads, int n,
                         int d, int bm, int bn) {
  FlashParams p;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  const int64_t s[3] = {int64_t(heads) * n * d, int64_t(n) * d, d};
  for (int i = 0; i < 3; ++i) p.q_stride[i] = p.k_stride[i] = p.v_stride[i] = p.out_stride[i] = s[i];
  p.lse_stride[0] = int64_t(heads) * n, p.lse_stride[1] = n, p.lse_stride[2] = 1;
  p.batch = 1, p.heads_q = p.heads_kv = heads, p.group = 1, p.len_q = p.len_kv = n;
  p.scale_log2 = 1.4426950408889634f / std::sqrt(float(d));
  p.block_q = bm, p.block_kv = bn, p.num_q_blocks = (n + bm - 1) / bm, p.num_kv_blocks = (n + bn - 1) / bn;
  return p;
}

template <int WARPS, int BN, int MT, bool QREGS, int MINB>
void launch_rung1(const FlashParams& p) {
  using Shape = FlashShape<128, WARPS, BN, MT>;
  auto kernel = flash_forward_kernel<__nv_bfloat16, 128, WARPS, BN, MT, QREGS, MINB>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes));
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  kernel<<<dim3(p.num_q_blocks, p.heads_q, 1), Shape::kThreads, Shape::kSmemBytes>>>(p);
  CHECK(cudaGetLastError());
}

template <int BN, int STAGES, bool OUTLINED = false>
void launch_rung2(const FlashParams& p) {
  using Shape = WgmmaShape<128, BN, STAGES>;
  auto kernel = flash_wgmma_kernel<__nv_bfloat16, 128, BN, STAGES, OUTLINED>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes));
  kernel<<<dim3(p.num_q_blocks, p.heads_q, 1), Shape::kThreads, Shape::kSmemBytes>>>(p);
  CHECK(cudaGetLastError());
}

template <class F>
float median_ms(F&& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Variant {
  const char* name;
  int bm, bn;
  void (*launch)(const FlashParams&);
};

int main(int argc, char** argv) {
  constexpr int D = 128;
  const bool profile = argc > 1 && std::string(argv[1]) == "--profile";  // one launch per variant at 8K
  const Variant variants[] = {
      {"1a 4w x16r BN64 Qreg", 64, 64, launch_rung1<4, 64, 1, true, 1>},
      {"1b 8w x16r BN64 Qreg", 128, 64, launch_rung1<8, 64, 1, true, 1>},
      {"1c 8w x16r BN64 Qsmem 2cta", 128, 64, launch_rung1<8, 64, 1, false, 2>},
      {"1d 4w x16r BN32 Qreg 3cta", 64, 32, launch_rung1<4, 32, 1, true, 3>},
      {"1e 4w x32r BN32", 128, 32, launch_rung1<4, 32, 2, false, 1>},
      {"1f 4w x32r BN64", 128, 64, launch_rung1<4, 64, 2, false, 1>},
      {"1g 8w x32r BN64", 256, 64, launch_rung1<8, 64, 2, false, 1>},
      {"1h 8w x32r BN32", 256, 32, launch_rung1<8, 32, 2, false, 1>},
      {"2a wgmma BN128 2 stages", 128, 128, launch_rung2<128, 2>},
      {"2e wgmma BN128 3 stages", 128, 128, launch_rung2<128, 3>},
      {"2g 2e, epilogue as a call", 128, 128, launch_rung2<128, 3, true>},
      {"2f wgmma BN64 3 stages", 128, 64, launch_rung2<64, 3>},
  };
  // Check every variant against rung 0 (4 heads, N = 1000: partial tiles on both sides).
  if (!profile) {
    const int H = 4, N = 1000;
    const int64_t n = int64_t(H) * N * D;
    __nv_bfloat16 *q, *k, *v, *o;
    float *ref, *lse;
    CHECK(cudaMalloc(&q, n * 2));
    CHECK(cudaMalloc(&k, n * 2));
    CHECK(cudaMalloc(&v, n * 2));
    CHECK(cudaMalloc(&o, n * 2));
    CHECK(cudaMalloc(&ref, n * 4));
    CHECK(cudaMalloc(&lse, int64_t(H) * N * 4));
    fill_random<<<256, 256>>>(q, n, 1);
    fill_random<<<256, 256>>>(k, n, 2);
    fill_random<<<256, 256>>>(v, n, 3);
    rung0_kernel<D><<<(H * N + 127) / 128, 128>>>(q, k, v, ref, H, N, 1.0f / std::sqrt(float(D)));
    CHECK(cudaGetLastError());
    std::vector<float> r(n);
    std::vector<__nv_bfloat16> out(n);
    CHECK(cudaMemcpy(r.data(), ref, n * 4, cudaMemcpyDeviceToHost));
    for (const Variant& var : variants) {
      CHECK(cudaMemset(o, 0xff, n * 2));
      var.launch(dense_params(q, k, v, o, lse, H, N, D, var.bm, var.bn));
      CHECK(cudaMemcpy(out.data(), o, n * 2, cudaMemcpyDeviceToHost));
      double e = 0, s = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double x = __bfloat162float(out[i]);
        e += (x - r[i]) * (x - r[i]);
        s += double(r[i]) * r[i];
      }
      const double rel = std::sqrt(e / s);
      std::printf("check %-28s rel L2 vs rung 0: %.2e %s\n", var.name, rel, rel < 1e-2 ? "ok" : "FAIL");
      if (!(rel < 1e-2)) return 1;
    }
    for (void* p : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)ref, (void*)lse}) CHECK(cudaFree(p));
  }
  std::printf("\n%-28s %8s %10s %10s\n", "kernel", "N", "ms", "TFLOP/s");
  for (int N : {8192, 32768}) {
    if (profile && N != 8192) break;
    const int H = 32;
    const int64_t n = int64_t(H) * N * D;
    __nv_bfloat16 *q, *k, *v, *o;
    float* lse;
    CHECK(cudaMalloc(&q, n * 2));
    CHECK(cudaMalloc(&k, n * 2));
    CHECK(cudaMalloc(&v, n * 2));
    CHECK(cudaMalloc(&o, n * 2));
    CHECK(cudaMalloc(&lse, int64_t(H) * N * 4));
    fill_random<<<1024, 256>>>(q, n, 4);
    fill_random<<<1024, 256>>>(k, n, 5);
    fill_random<<<1024, 256>>>(v, n, 6);
    const double flops = 4.0 * H * double(N) * N * D;
    for (const Variant& var : variants) {
      const FlashParams p = dense_params(q, k, v, o, lse, H, N, D, var.bm, var.bn);
      if (profile) {
        var.launch(p);
        CHECK(cudaDeviceSynchronize());
        continue;
      }
      const float ms = median_ms([&] { var.launch(p); }, N > 8192 ? 10 : 30);
      std::printf("%-28s %8d %10.3f %10.1f\n", var.name, N, ms, flops / ms / 1e9);
    }
    if (N == 8192 && !profile) {  // rung 0 once, at 8K only (it is ~100x slower)
      float* ref;
      CHECK(cudaMalloc(&ref, n * 4));
      const float ms = median_ms(
          [&] { rung0_kernel<D><<<(H * N + 127) / 128, 128>>>(q, k, v, ref, H, N, 0.088388f); }, 1);
      std::printf("%-28s %8d %10.3f %10.1f\n", "rung0 scalar f32", N, ms, flops / ms / 1e9);
      CHECK(cudaFree(ref));
    }
    for (void* p : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse}) CHECK(cudaFree(p));
  }
  return 0;
}
