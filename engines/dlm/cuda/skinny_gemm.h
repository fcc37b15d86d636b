// The engine's GEMM for few rows: y[n, rows] = x[n, cols] · wᵀ (+ y), bf16 x and w, f32
// accumulation, for the chunks of a denoising step (a block of 16 or 32 tokens), where the
// product is a stream of the weights and cuBLAS's tile kernels leave part of HBM's bandwidth
// unused (docs/dlm.md, "The block step's GEMMs").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sparsa::dlm {

// The most rows the kernel takes (four m16 tiles); more rows go to cuBLAS.
constexpr int64_t kSkinnyMaxRows = 64;

struct SkinnyGemm {
  void* y = nullptr;          // [n, rows] row-major: bf16 (y_f32 false) or f32
  bool y_f32 = false;
  bool accumulate = false;    // y += x · wᵀ (f32 y only); else y = x · wᵀ
  const void* x = nullptr;    // bf16 [n, cols] row-major
  const void* w = nullptr;    // bf16 [rows, cols] row-major
  int64_t n = 0, rows = 0, cols = 0;
  // A programmatic dependent launch: the CTAs start loading weights while the kernel before
  // this one on the stream still runs, and wait for it before reading x or touching y. The
  // weights must not be written by that kernel.
  bool overlap_previous = false;
};

// Whether the kernel takes this product: 1 <= n <= kSkinnyMaxRows, cols a multiple of 8 below
// 2^31, x and w 16-byte aligned, y 4-byte aligned, accumulate only into f32. Callers fall back
// to cuBLAS otherwise.
bool skinny_gemm_supported(const SkinnyGemm& g);

// One launch on `stream` (no synchronisation); the launch's error, cudaErrorInvalidValue (nothing
// launched) for an unsupported product. Deterministic: each output is the sum of eight K slices
// in a fixed order, so the same inputs give the same bits run to run.
cudaError_t skinny_gemm(const SkinnyGemm& g, cudaStream_t stream);

// The kernel's rungs, for the benchmark's per-shape table (bench_dlm --rows gemm): how many, the
// name of each, and one launch of rung `variant` (cudaErrorInvalidValue for an unsupported
// product or rung). skinny_gemm() runs the rung the measurements chose.
int skinny_gemm_variants();
const char* skinny_gemm_variant_name(int variant);
cudaError_t skinny_gemm_variant(const SkinnyGemm& g, int variant, cudaStream_t stream);

}  // namespace sparsa::dlm
