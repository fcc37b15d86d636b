// The engine's GEMM through cuBLASLt with the algorithm chosen by timing (gemm "tuned"):
// y[n, rows] = x[n, cols] · wᵀ (+ y), bf16 x and w, f32 compute. cuBLAS's default choice for the
// block step's few rows leaves HBM's bandwidth unused on the smaller products (the 4096 x 4096
// output projection streams at 2 TB/s, bench/RESULTS.md "The block step's GEMMs"); cuBLASLt's
// heuristic lists other algorithms for the same product (split-K counts, tile shapes), and the
// fastest on this device is taken.
//
// A shape's algorithm is chosen once, by timing every listed algorithm on the caller's stream
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

namespace sparsa::dlm {

struct LtShape {
  int64_t n = 0, rows = 0, cols = 0;
  cudaDataType_t y_type = CUDA_R_16BF;  // CUDA_R_16BF or CUDA_R_32F
  bool accumulate = false;              // y += x · wᵀ (f32 y only)
  int align = 256;  // the alignment in bytes (a power of two, at most 256) of x, w and y
  auto key() const { return std::tuple(n, rows, cols, static_cast<int>(y_type), accumulate, align); }
  bool operator<(const LtShape& o) const { return key() < o.key(); }
};

// One algorithm cuBLASLt's heuristic listed for a shape, with what it says of it.
struct LtCandidate {
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

  // One product with the given algorithm on `stream`.
  cublasStatus_t run(const LtShape& s, const LtCandidate& c, void* y, const void* x, const void* w,
                     cudaStream_t stream);

  // The shape of a product over these pointers (its alignment from their addresses).
  static LtShape shape(int64_t n, int64_t rows, int64_t cols, cudaDataType_t y_type, bool accumulate, const void* y,
                       const void* x, const void* w);

  // One product with the shape's chosen algorithm: the first call of a shape outside a capture
  // times every candidate (each on a scratch output, `reps` calls after one warm-up, reading the
  // caller's x and w) and keeps the fastest; inside a capture an untimed shape takes the
  // heuristic's pick, and keeps it. The timing synchronises `stream` once per shape.
  cublasStatus_t tuned(const LtShape& s, void* y, const void* x, const void* w, cudaStream_t stream);

  // The chosen algorithm of a shape already run through tuned(), or nullptr.
  const LtCandidate* chosen(const LtShape& s) const;

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
  cublasStatus_t choose(const LtShape& s, Plan& p, const void* x, const void* w, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* scratch_ = nullptr;  // the timing's output, grown to the largest shape timed
  size_t scratch_bytes_ = 0;
  std::map<LtShape, Plan> plans_;
};

}  // namespace sparsa::dlm
