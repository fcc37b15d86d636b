// The engine's GEMM with its kernel chosen by timing (gemm "tuned"): y[n, rows] = x[n, cols] · wᵀ
// (+ y), bf16 x and w, f32 compute. For the block step's few rows no one kernel is the fastest on
// every card and shape (bench/RESULTS.md "The block step's GEMMs": sparsa's weight-streaming
// kernel beat cuBLAS on the output projection of an H200 and lost on the others; on an H100 it
// wins on most), so the candidates are the algorithms cuBLASLt's heuristic lists for the product
// (tile shapes, split-K counts) and, where the caller offers it, the weight-streaming kernel
// (skinny_gemm.h); the fastest on this device is taken.
//
// A shape's kernel is chosen once, by timing every candidate on the caller's stream
// (outside a CUDA-graph capture), and kept for the object's life, so a process computes every
// product of that shape with the same algorithm and the same bits. Two processes may choose
// differently where two algorithms time within noise; their products then differ in rounding.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "skinny_gemm.h"

namespace sparsa::dlm {

struct LtShape {
  int64_t n = 0, rows = 0, cols = 0;
  cudaDataType_t y_type = CUDA_R_16BF;  // CUDA_R_16BF or CUDA_R_32F
  bool accumulate = false;              // y += x · wᵀ (f32 y only)
  int align = 256;  // the alignment in bytes (a power of two, at most 256) of x, w and y
  bool skinny = false;  // the weight-streaming kernel is a candidate (tuned() sets it)
  auto key() const { return std::tuple(n, rows, cols, static_cast<int>(y_type), accumulate, align, skinny); }
  bool operator<(const LtShape& o) const { return key() < o.key(); }
};

// One algorithm cuBLASLt's heuristic listed for a shape, with what it says of it; or (skinny) the
// weight-streaming kernel.
struct LtCandidate {
  bool skinny = false;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  float waves = 0;        // the heuristic's CTAs over multiprocessors
  int split_k = 1, tile = 0, id = 0;
  std::string describe() const;
};

class LtGemm {
 public:
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm();

  // The workspace (device memory the caller owns) bounds the algorithms listed.
  cublasStatus_t init(void* workspace, size_t workspace_bytes);

  // Up to `max` algorithms for the shape, in the heuristic's order (its first is its own pick).
  cublasStatus_t candidates(const LtShape& s, int max, std::vector<LtCandidate>* out);

  // One product with the given candidate on `stream`; a skinny candidate runs `skinny` (the same
  // product as the kernel's parameters) and its launch error is CUBLAS_STATUS_EXECUTION_FAILED.
  cublasStatus_t run(const LtShape& s, const LtCandidate& c, void* y, const void* x, const void* w,
                     cudaStream_t stream, const SkinnyGemm* skinny = nullptr);

  // The shape of a product over these pointers (its alignment from their addresses).
  static LtShape shape(int64_t n, int64_t rows, int64_t cols, cudaDataType_t y_type, bool accumulate, const void* y,
                       const void* x, const void* w);

  // One product with the shape's chosen kernel: the first call of a shape outside a capture times
  // every candidate (cuBLASLt's list, then the weight-streaming kernel when `skinny` is given: the
  // same product, which skinny_gemm_supported() takes; each on a scratch output, seven calls after
  // a warm-up, reading the caller's x and w) and keeps the fastest; inside a capture an untimed
  // shape takes the heuristic's pick, and keeps it. The timing synchronises `stream` once per
  // shape. A caller offers `skinny` for a shape on every call or on none.
  cublasStatus_t tuned(const LtShape& s, void* y, const void* x, const void* w, cudaStream_t stream,
                       const SkinnyGemm* skinny = nullptr);

  // The chosen kernel of a shape already run through tuned() (with `skinny` offered or not), or
  // nullptr.
  const LtCandidate* chosen(const LtShape& s, bool skinny_offered = false) const;

 private:
  // A shape's descriptors (made once) and its chosen algorithm (once timed).
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    bool has_choice = false;
    LtCandidate choice;
  };
  static void destroy(Plan& p);
  cublasStatus_t plan(const LtShape& s, Plan** out);
  cublasStatus_t choose(const LtShape& s, Plan& p, const void* x, const void* w, cudaStream_t stream,
                        const SkinnyGemm* skinny);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* scratch_ = nullptr;  // the timing's output, grown to the largest shape timed
  size_t scratch_bytes_ = 0;
  std::map<LtShape, Plan> plans_;
};

}  // namespace sparsa::dlm
