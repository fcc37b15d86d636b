// The engine's GEMM with a timed choice of kernel: cuBLASLt's algorithms and sparsa's
// weight-streaming kernel (lt_gemm.h).
#include "lt_gemm.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace sparsa::dlm {

namespace {

#define SPARSA_LT_TRY(expr)                                       \
  do {                                                            \
    const cublasStatus_t lt_status_ = (expr);                     \
    if (lt_status_ != CUBLAS_STATUS_SUCCESS) return lt_status_;   \
  } while (0)

// The algorithms listed per shape, and the timed calls of each.
constexpr int kMaxCandidates = 16;
constexpr int kTimedCalls = 7;
// A candidate within this fraction of the fastest counts as tied with it, and of tied candidates
// the heuristic's earliest is taken: the choice moves between processes only where timings
// differ by more than their noise.
constexpr double kTie = 0.03;

int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && a % static_cast<uintptr_t>(al) != 0) al /= 2;
  return al;
}

int32_t config_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  int32_t v = 0;  // the attributes read here are 32-bit integers
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return -1;
  return v;
}

cublasStatus_t cuda_status(cudaError_t e) {
  if (e == cudaSuccess) return CUBLAS_STATUS_SUCCESS;
  cudaGetLastError();
  return e == cudaErrorMemoryAllocation ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace

std::string LtCandidate::describe() const {
  if (skinny) return "sparsa weight-streaming kernel";
  return "algo " + std::to_string(id) + " tile " + std::to_string(tile) + " split-K " + std::to_string(split_k) +
         " waves " + std::to_string(waves).substr(0, 4);
}

void LtGemm::destroy(Plan& p) {
  if (p.op != nullptr) cublasLtMatmulDescDestroy(p.op);
  for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c}) {
    if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
  }
  p = Plan{};
}

LtGemm::~LtGemm() {
  for (auto& [shape, p] : plans_) destroy(p);
  cudaFree(scratch_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
  cudaGetLastError();
}

cublasStatus_t LtGemm::init(void* workspace, size_t workspace_bytes) {
  workspace_ = workspace;
  workspace_bytes_ = workspace_bytes;
  return cublasLtCreate(&handle_);
}

LtShape LtGemm::shape(int64_t n, int64_t rows, int64_t cols, cudaDataType_t y_type, bool accumulate, const void* y,
                      const void* x, const void* w) {
  LtShape s;
  s.n = n;
  s.rows = rows;
  s.cols = cols;
  s.y_type = y_type;
  s.accumulate = accumulate;
  s.align = std::min({alignment_of(y), alignment_of(x), alignment_of(w)});
  return s;
}

// y (rows x n, column-major) = op(A) · B with A the weights stored as a (cols x rows) column-major
// matrix, op(A) = Aᵀ, and B = x as (cols x n): "TN", the layout cublasGemmEx runs in the engine.
cublasStatus_t LtGemm::plan(const LtShape& s, Plan** out) {
  auto it = plans_.find(s);
  if (it == plans_.end()) {
    Plan p;
    cublasStatus_t st = cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, s.cols, s.rows, s.cols);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, s.cols, s.n, s.cols);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&p.c, s.y_type, s.rows, s.n, s.rows);
    if (st != CUBLAS_STATUS_SUCCESS) {
      destroy(p);
      return st;
    }
    it = plans_.emplace(s, p).first;
  }
  *out = &it->second;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LtGemm::candidates(const LtShape& s, int max, std::vector<LtCandidate>* out) {
  out->clear();
  Plan* p = nullptr;
  SPARSA_LT_TRY(plan(s, &p));
  cublasLtMatmulPreference_t pref = nullptr;
  SPARSA_LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  const uint32_t align = static_cast<uint32_t>(s.align);
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
  }
  // Split-K parts are summed in f32 (the compute type) for a 16-bit y: the in-place and
  // output-type reductions would round each part to bf16 first. An f32 y allows every scheme.
  const uint32_t reductions = s.y_type == CUDA_R_32F ? CUBLASLT_REDUCTION_SCHEME_MASK : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                              sizeof(reductions));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> found(static_cast<size_t>(std::max(max, 1)));
  int count = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->c, p->c, pref, max, found.data(), &count);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  for (int i = 0; i < count; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    LtCandidate c;
    c.algo = found[i].algo;
    c.workspace = found[i].workspaceSize;
    c.waves = found[i].wavesCount;
    c.id = config_value(c.algo, CUBLASLT_ALGO_CONFIG_ID);
    c.tile = config_value(c.algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
    c.split_k = std::max(config_value(c.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), 1);
    out->push_back(c);
  }
  return out->empty() ? CUBLAS_STATUS_NOT_SUPPORTED : CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LtGemm::run(const LtShape& s, const LtCandidate& c, void* y, const void* x, const void* w,
                           cudaStream_t stream, const SkinnyGemm* skinny) {
  if (c.skinny) {
    if (skinny == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    SkinnyGemm g = *skinny;
    g.y = y;
    g.x = x;
    g.w = w;
    return skinny_gemm(g, stream) == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
  }
  Plan* p = nullptr;
  SPARSA_LT_TRY(plan(s, &p));
  const float alpha = 1.0f, beta = s.accumulate ? 1.0f : 0.0f;
  return cublasLtMatmul(handle_, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y, p->c, &c.algo, workspace_,
                        workspace_bytes_, stream);
}

// Times every candidate on the stream, each call after a write of twice the L2's size so that
// the weights stream from HBM as they do in a step (where every product's weights are new).
cublasStatus_t LtGemm::choose(const LtShape& s, Plan& p, const void* x, const void* w, cudaStream_t stream,
                              const SkinnyGemm* skinny) {
  std::vector<LtCandidate> list;
  const cublasStatus_t listed = candidates(s, kMaxCandidates, &list);
  if (listed != CUBLAS_STATUS_SUCCESS && listed != CUBLAS_STATUS_NOT_SUPPORTED) return listed;
  if (skinny != nullptr) {
    LtCandidate c;
    c.skinny = true;
    list.push_back(c);
  }
  if (list.empty()) return CUBLAS_STATUS_NOT_SUPPORTED;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SPARSA_LT_TRY(cuda_status(cudaStreamIsCapturing(stream, &capture)));
  if (capture != cudaStreamCaptureStatusNone || list.size() == 1) {
    p.choice = list.front();
    p.has_choice = true;
    return CUBLAS_STATUS_SUCCESS;
  }
  const size_t y_bytes = static_cast<size_t>(s.n * s.rows) * (s.y_type == CUDA_R_32F ? 4 : 2);
  if (y_bytes > scratch_bytes_) {
    SPARSA_LT_TRY(cuda_status(cudaStreamSynchronize(stream)));
    cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    SPARSA_LT_TRY(cuda_status(cudaMalloc(&scratch_, y_bytes)));
    scratch_bytes_ = y_bytes;
  }
  SPARSA_LT_TRY(cuda_status(cudaMemsetAsync(scratch_, 0, y_bytes, stream)));
  int device = 0, l2 = 0;
  SPARSA_LT_TRY(cuda_status(cudaGetDevice(&device)));
  SPARSA_LT_TRY(cuda_status(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device)));
  const size_t flush_bytes = std::max<size_t>(size_t{2} * static_cast<size_t>(l2), size_t{1} << 20);
  void* flush = nullptr;
  SPARSA_LT_TRY(cuda_status(cudaMalloc(&flush, flush_bytes)));
  cudaEvent_t events[2 * kTimedCalls] = {};
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  for (auto& e : events) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cuda_status(cudaEventCreate(&e));
  }
  std::vector<double> times(list.size(), std::numeric_limits<double>::infinity());
  for (size_t i = 0; i < list.size() && st == CUBLAS_STATUS_SUCCESS; ++i) {
    if (run(s, list[i], scratch_, x, w, stream, skinny) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; one that fails is not a choice
    float ms[kTimedCalls] = {};
    for (int r = 0; r < kTimedCalls && st == CUBLAS_STATUS_SUCCESS; ++r) {
      st = cuda_status(cudaMemsetAsync(flush, r, flush_bytes, stream));
      if (st == CUBLAS_STATUS_SUCCESS) st = cuda_status(cudaEventRecord(events[2 * r], stream));
      if (st == CUBLAS_STATUS_SUCCESS) st = run(s, list[i], scratch_, x, w, stream, skinny);
      if (st == CUBLAS_STATUS_SUCCESS) st = cuda_status(cudaEventRecord(events[2 * r + 1], stream));
    }
    if (st == CUBLAS_STATUS_SUCCESS) st = cuda_status(cudaEventSynchronize(events[2 * kTimedCalls - 1]));
    for (int r = 0; r < kTimedCalls && st == CUBLAS_STATUS_SUCCESS; ++r) {
      st = cuda_status(cudaEventElapsedTime(&ms[r], events[2 * r], events[2 * r + 1]));
    }
    if (st != CUBLAS_STATUS_SUCCESS) break;
    std::sort(ms, ms + kTimedCalls);
    times[i] = ms[kTimedCalls / 2];
  }
  for (auto& e : events) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  cudaFree(flush);  // after the stream's work: cudaFree synchronises the device
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const double best = *std::min_element(times.begin(), times.end());
  if (!(best < std::numeric_limits<double>::infinity())) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (size_t i = 0; i < list.size(); ++i) {
    if (times[i] <= best * (1.0 + kTie)) {
      p.choice = list[i];
      break;
    }
  }
  p.has_choice = true;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LtGemm::tuned(const LtShape& s, void* y, const void* x, const void* w, cudaStream_t stream,
                             const SkinnyGemm* skinny) {
  LtShape key = s;
  key.skinny = skinny != nullptr;
  Plan* p = nullptr;
  SPARSA_LT_TRY(plan(key, &p));
  if (!p->has_choice) SPARSA_LT_TRY(choose(key, *p, x, w, stream, skinny));
  return run(key, p->choice, y, x, w, stream, skinny);
}

const LtCandidate* LtGemm::chosen(const LtShape& s, bool skinny_offered) const {
  LtShape key = s;
  key.skinny = skinny_offered;
  const auto it = plans_.find(key);
  return it != plans_.end() && it->second.has_choice ? &it->second.choice : nullptr;
}

}  // namespace sparsa::dlm
