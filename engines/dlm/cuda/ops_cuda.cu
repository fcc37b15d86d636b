// The CUDA backend of the engine: bf16 weights and activations with f32 accumulation, the f32
// residual stream, GEMMs through cuBLAS (bf16 inputs, f32 compute; the residual update is the
// GEMM's own beta = 1 into the f32 residual, the logits an f32-output GEMM) or, as an option,
// those of up to 16 rows through sparsa's weight-streaming kernel (skinny_gemm.cu), and one small
// kernel for each elementwise step. Everything is ordered on one non-blocking stream of the device; the
// only host synchronisations are to_host (the sampler's read-back) and the weight uploads.
//
// RoPE reads a cos/sin table computed on the host in f64 (the CPU backend's formula), grown on
// demand to the largest position seen, so both backends rotate by the same angles.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <list>
#include <string>
#include <vector>

#include "engine.h"
#include "lt_gemm.h"
#include "skinny_gemm.h"

namespace sparsa::dlm {

namespace {

using bf16 = __nv_bfloat16;

// ---- kernels ----------------------------------------------------------------------------------

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The kernels that come right before a GEMM (the norms before q/k/v, gate/up and the head;
// SwiGLU before down) let the GEMM, a programmatic dependent launch, start at once: its CTAs load
// their first weights while this kernel runs, then wait for all of it (griddepcontrol.wait)
// before they read its output. A kernel launched the ordinary way still waits for the whole grid.
__device__ inline void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// One block of kRowThreads per row: x f32 [rows, dim] -> out bf16, weight f32 [dim].
constexpr int kRowThreads = 256;
__global__ void rms_norm_kernel(bf16* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w,
                                int64_t dim, float eps) {
  launch_dependents();
  const float* xr = x + blockIdx.x * dim;
  bf16* o = out + blockIdx.x * dim;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kRowThreads) ss += xr[i] * xr[i];
  __shared__ float partial[kRowThreads / 32];
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < kRowThreads / 32; ++i) total += partial[i];
  const float inv = rsqrtf(total / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kRowThreads) o[i] = __float2bfloat16(xr[i] * inv * w[i]);
}

// One warp per (token, head): the head's head_dim values normalised in place.
__global__ void head_norm_kernel(bf16* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride,
                                 const float* __restrict__ w, float eps) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= n * heads) return;
  bf16* v = x + (warp / heads) * row_stride + (warp % heads) * head_dim;
  float ss = 0.0f;
  for (int64_t i = lane; i < head_dim; i += 32) {
    const float a = __bfloat162float(v[i]);
    ss += a * a;
  }
  const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(head_dim) + eps);
  for (int64_t i = lane; i < head_dim; i += 32) v[i] = __float2bfloat16(__bfloat162float(v[i]) * inv * w[i]);
}

// One thread per (token, head, pair i < head_dim / 2): rotate_half with the table's angle.
__global__ void rope_kernel(bf16* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t pos0,
                            const float2* __restrict__ table) {
  const int64_t half = head_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * heads * half) return;
  const int64_t i = idx % half, h = (idx / half) % heads, t = idx / (half * heads);
  bf16* v = x + t * row_stride + h * head_dim;
  const float2 cs = table[(pos0 + t) * half + i];  // (cos, sin)
  const float a = __bfloat162float(v[i]), b = __bfloat162float(v[i + half]);
  v[i] = __float2bfloat16(a * cs.x - b * cs.y);
  v[i + half] = __float2bfloat16(b * cs.x + a * cs.y);
}

__global__ void swiglu_kernel(bf16* __restrict__ h, const bf16* __restrict__ gu, int64_t n, int64_t hidden) {
  launch_dependents();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * hidden) return;
  const int64_t t = idx / hidden, j = idx % hidden;
  const float g = __bfloat162float(gu[t * 2 * hidden + j]), u = __bfloat162float(gu[t * 2 * hidden + hidden + j]);
  h[idx] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
}

// x[t, col0 + j] += bias[j] for t < n, j < width: dream's q / k / v biases, added to the bf16
// GEMM output (rounded twice, once by the GEMM and once here: within the bf16 bound of its tests).
__global__ void add_bias_kernel(bf16* __restrict__ x, int64_t n, int64_t row_stride, int64_t col0,
                                const float* __restrict__ bias, int64_t width) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * width) return;
  const int64_t t = idx / width, j = idx % width;
  bf16* v = x + t * row_stride + col0 + j;
  *v = __float2bfloat16(__bfloat162float(*v) + bias[j]);
}

__global__ void embed_kernel(float* __restrict__ x, const bf16* __restrict__ table, const int32_t* __restrict__ tokens,
                             int64_t dim) {
  const bf16* row = table + static_cast<int64_t>(tokens[blockIdx.x]) * dim;
  float* o = x + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = __bfloat162float(row[i]);
}

// Uniform in [-scale, scale) from a splitmix64 hash of (seed, index): the same weights for the
// same seed whatever the launch shape.
__global__ void random_kernel(bf16* w, int64_t count, float scale, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    w[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

__global__ void fill_kernel(float* w, int64_t count, float value) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) w[i] = value;
}

// The greedy sampler: one block per logit row. The argmax skips the banned ids (lowest index on
// ties, as the host sampler's strict >), then conf = exp(l[best] - max) / sum exp(l - max) over
// the unbanned entries (= 1 / sum, f32).
constexpr int kMaxBanned = 16;
struct Banned {
  int32_t id[kMaxBanned];
  int count;
};
constexpr int kGreedyThreads = 1024;
__global__ void greedy_kernel(const float* __restrict__ logits, int64_t vocab, Banned banned, int32_t* token,
                              float* confidence) {
  const float* row = logits + blockIdx.x * vocab;
  auto is_banned = [&](int64_t i) {
    for (int b = 0; b < banned.count; ++b)
      if (banned.id[b] == i) return true;
    return false;
  };
  float best = -INFINITY;
  int64_t best_i = -1;
  for (int64_t i = threadIdx.x; i < vocab; i += kGreedyThreads) {
    if (is_banned(i)) continue;
    const float l = row[i];
    if (best_i < 0 || l > best) {
      best = l;
      best_i = i;
    }
  }
  // (value, index) reduction: larger value, then smaller index; an empty lane (index -1) loses.
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t j = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (j >= 0 && (best_i < 0 || v > best || (v == best && j < best_i))) {
      best = v;
      best_i = j;
    }
  }
  __shared__ float vals[kGreedyThreads / 32];
  __shared__ int64_t idxs[kGreedyThreads / 32];
  __shared__ float sums[kGreedyThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    vals[warp] = best;
    idxs[warp] = best_i;
  }
  __syncthreads();
  float m = -INFINITY;
  int64_t m_i = -1;
  for (int w = 0; w < kGreedyThreads / 32; ++w) {
    if (idxs[w] >= 0 && (m_i < 0 || vals[w] > m || (vals[w] == m && idxs[w] < m_i))) {
      m = vals[w];
      m_i = idxs[w];
    }
  }
  float z = 0.0f;
  if (m_i >= 0) {
    for (int64_t i = threadIdx.x; i < vocab; i += kGreedyThreads) {
      if (!is_banned(i)) z += __expf(row[i] - m);
    }
  }
  z = warp_sum(z);
  if (lane == 0) sums[warp] = z;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kGreedyThreads / 32; ++w) total += sums[w];
    token[blockIdx.x] = m_i < 0 ? 0 : static_cast<int32_t>(m_i);
    confidence[blockIdx.x] = m_i < 0 ? 0.0f : 1.0f / total;
  }
}

unsigned blocks_for(int64_t count, int threads) { return static_cast<unsigned>((count + threads - 1) / threads); }

const char* cublas_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

// ---- the backend ------------------------------------------------------------------------------

// The products the weight-streaming kernel takes when the model asks for it (gemm "streaming"):
// chunks of up to 16 rows (SDAR's block step). From 32 rows on, cuBLAS was faster at every 8B
// shape (bench_dlm --rows gemm, bench/RESULTS.md).
constexpr int64_t kEngineSkinnyRows = 16;
// The products whose kernel is chosen by timing (gemm "tuned": cuBLASLt's algorithms, and the
// weight-streaming kernel up to kEngineSkinnyRows): the chunks of denoising steps. Larger products
// are compute-bound tile GEMMs, where cuBLAS's own choice is the fast one.
constexpr int64_t kEngineTunedRows = 64;

class CudaOps final : public Ops {
 public:
  ~CudaOps() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (void* p : owned_) cudaFree(p);
    cudaFree(tokens_);
    cudaFreeHost(tokens_host_);
    cudaFree(rope_table_);
    cudaFree(workspace_);
    cudaFreeHost(staging_);
    cudaFree(picks_device_);
    cudaFreeHost(picks_host_);
    if (handle_ != nullptr) cublasDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaGetLastError();
  }

  Status init(int device, const Config& c, GemmChoice gemm) {
    device_ = device;
    gemm_ = gemm;
    rope_config_ = c.rope;
    head_dim_ = c.head_dim;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
      cudaGetLastError();
      return invalid_argument("backend: cuda:" + std::to_string(device) + " is not a device here (" +
                              std::to_string(count) + " visible)");
    }
    SPARSA_RETURN_IF_ERROR(cuda(cudaSetDevice(device), "cudaSetDevice"));
    SPARSA_RETURN_IF_ERROR(cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    SPARSA_RETURN_IF_ERROR(blas(cublasCreate(&handle_), "cublasCreate"));
    SPARSA_RETURN_IF_ERROR(blas(cublasSetStream(handle_, stream_), "cublasSetStream"));
    // A workspace lets cuBLAS pick its split-K and stream-K kernels (skinny block-step GEMMs).
    constexpr size_t kWorkspace = size_t{64} << 20;
    SPARSA_RETURN_IF_ERROR(cuda(cudaMalloc(&workspace_, kWorkspace), "cudaMalloc (cuBLAS workspace)"));
    SPARSA_RETURN_IF_ERROR(blas(cublasSetWorkspace(handle_, workspace_, kWorkspace), "cublasSetWorkspace"));
    // cuBLASLt shares the workspace: both run on stream_, one product at a time.
    if (gemm_ == GemmChoice::tuned) SPARSA_RETURN_IF_ERROR(blas(lt_.init(workspace_, kWorkspace), "cublasLtCreate"));
    return Status::Ok();
  }

  const char* name() const override { return "cuda"; }
  Device device() const override { return {DeviceType::cuda, device_}; }
  DType act_dtype() const override { return DType::bf16; }
  void* stream() const override { return stream_; }

  Result<Weight> prepare(std::span<const Tensor> parts) override {
    Weight w;
    w.dtype = DType::bf16;
    w.cols = parts[0].ndim == 2 ? parts[0].shape[1] : 1;
    for (const Tensor& t : parts) w.rows += t.shape[0];
    auto* dst = static_cast<bf16*>(device_alloc(w.rows * w.cols * 2));
    if (dst == nullptr) return pending();
    std::vector<uint16_t> converted;
    int64_t row = 0;
    for (const Tensor& t : parts) {
      const int64_t n = t.numel();
      const void* src = t.data;
      if (t.dtype != DType::bf16) {  // f16 / f32 files: rounded to bf16 on the host
        auto c = convert(t, DType::bf16);
        if (!c.ok()) return Status(StatusCode::unsupported_dtype, "weights: expected F32, F16 or BF16");
        converted.assign(c->ptr<uint16_t>(), c->ptr<uint16_t>() + n);
        src = converted.data();
      }
      upload(dst + row * w.cols, src, static_cast<size_t>(n) * 2, "weights");
      row += t.shape[0];
    }
    w.data = dst;
    SPARSA_RETURN_IF_ERROR(check());
    return w;
  }

  Result<Weight> prepare_vector(const Tensor& t) override {
    auto f = convert(t, DType::f32);
    if (!f.ok()) return Status(StatusCode::unsupported_dtype, "weights: expected F32, F16 or BF16");
    Weight w;
    w.dtype = DType::f32;
    w.rows = t.shape[0];
    w.cols = 1;
    void* dst = device_alloc(w.rows * 4);
    if (dst == nullptr) return pending();
    upload(dst, f->data(), static_cast<size_t>(w.rows) * 4, "norm weights");
    w.data = dst;
    SPARSA_RETURN_IF_ERROR(check());
    return w;
  }

  Result<Weight> random(int64_t rows, int64_t cols, double scale, uint64_t seed) override {
    Weight w;
    w.dtype = DType::bf16;
    w.rows = rows;
    w.cols = cols;
    auto* dst = static_cast<bf16*>(device_alloc(rows * cols * 2));
    if (dst == nullptr) return pending();
    random_kernel<<<1024, 256, 0, stream_>>>(dst, rows * cols, static_cast<float>(scale), seed);
    launched("random weights");
    w.data = dst;
    SPARSA_RETURN_IF_ERROR(check());
    return w;
  }

  Result<Weight> constant_vector(int64_t dim, float value) override {
    Weight w;
    w.dtype = DType::f32;
    w.rows = dim;
    w.cols = 1;
    auto* dst = static_cast<float*>(device_alloc(dim * 4));
    if (dst == nullptr) return pending();
    fill_kernel<<<blocks_for(dim, 256), 256, 0, stream_>>>(dst, dim, value);
    launched("norm weights");
    w.data = dst;
    SPARSA_RETURN_IF_ERROR(check());
    return w;
  }

  void* alloc(int64_t elements, DType dtype) override {
    void* p = nullptr;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(elements, 1)) * dtype_size(dtype);
    if (record(cudaMalloc(&p, bytes), "cudaMalloc (activations)")) {
      record(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync");
    }
    return p;
  }
  void free(void* p) override {
    if (p == nullptr) return;
    cudaStreamSynchronize(stream_);
    cudaFree(p);
  }

  void matmul(void* y, const void* x, int64_t n, const Weight& w) override {
    gemm(y, CUDA_R_16BF, x, n, w, 0.0f, "matmul");
  }
  void matmul_add(float* r, const void* x, int64_t n, const Weight& w) override {
    gemm(r, CUDA_R_32F, x, n, w, 1.0f, "matmul_add");
  }
  void matmul_f32(float* y, const void* x, int64_t n, const Weight& w) override {
    gemm(y, CUDA_R_32F, x, n, w, 0.0f, "matmul (logits)");
  }

  void rms_norm(void* out, const float* x, const Weight& weight, int64_t rows, int64_t dim, double eps) override {
    if (rows == 0) return;
    rms_norm_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream_>>>(
        static_cast<bf16*>(out), x, weight.ptr<float>(), dim, static_cast<float>(eps));
    launched("rms_norm");
  }

  void head_norm(void* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, const Weight& weight,
                 double eps) override {
    const int64_t threads = n * heads * 32;
    if (threads == 0) return;
    head_norm_kernel<<<blocks_for(threads, 256), 256, 0, stream_>>>(static_cast<bf16*>(x), n, heads, head_dim,
                                                                     row_stride, weight.ptr<float>(),
                                                                     static_cast<float>(eps));
    launched("head_norm");
  }

  void rope(void* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t pos0,
            const RopeConfig& rope) override {
    if (n == 0) return;
    if (head_dim != head_dim_ || rope.theta != rope_config_.theta || rope.scaling != rope_config_.scaling ||
        rope.factor != rope_config_.factor) {
      fail(Status(StatusCode::internal, "rope: called with another configuration than the model's"));
      return;
    }
    if (!grow_rope_table(pos0 + n)) return;
    const int64_t count = n * heads * (head_dim / 2);
    rope_kernel<<<blocks_for(count, 256), 256, 0, stream_>>>(static_cast<bf16*>(x), n, heads, head_dim, row_stride,
                                                             pos0, static_cast<const float2*>(rope_table_));
    launched("rope");
  }

  bool add_bias(void* x, int64_t n, int64_t row_stride, int64_t col0, const Weight& bias) override {
    const int64_t count = n * bias.rows;
    if (count == 0) return true;
    add_bias_kernel<<<blocks_for(count, 256), 256, 0, stream_>>>(static_cast<bf16*>(x), n, row_stride, col0,
                                                                 bias.ptr<float>(), bias.rows);
    launched("add_bias");
    return true;
  }

  void swiglu(void* h, const void* gu, int64_t n, int64_t hidden) override {
    const int64_t count = n * hidden;
    if (count == 0) return;
    swiglu_kernel<<<blocks_for(count, 256), 256, 0, stream_>>>(static_cast<bf16*>(h), static_cast<const bf16*>(gu),
                                                               n, hidden);
    launched("swiglu");
  }

  // The tokens go through a pinned staging buffer, so that a captured embed's copy reads, at each
  // replay, what stage_tokens() wrote there. Every forward ends in a synchronisation (the sampler's
  // or the logits' read-back), so the staging is free again when the next forward writes it.
  void embed(float* x, const Weight& table, std::span<const int32_t> tokens) override {
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n == 0) return;
    if (n > token_capacity_) {
      cudaStreamSynchronize(stream_);
      cudaFree(tokens_);
      cudaFreeHost(tokens_host_);
      tokens_ = nullptr;
      tokens_host_ = nullptr;
      token_capacity_ = 0;
      if (!record(cudaMalloc(&tokens_, static_cast<size_t>(n) * 4), "cudaMalloc (tokens)") ||
          !record(cudaMallocHost(&tokens_host_, static_cast<size_t>(n) * 4), "cudaMallocHost (tokens)")) {
        return;
      }
      token_capacity_ = n;
    }
    stage_tokens(tokens);
    record(cudaMemcpyAsync(tokens_, tokens_host_, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice, stream_),
           "cudaMemcpyAsync (tokens)");
    embed_kernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(x, table.ptr<bf16>(), tokens_, table.cols);
    launched("embed");
  }

  void stage_tokens(std::span<const int32_t> tokens) override {
    if (static_cast<int64_t>(tokens.size()) <= token_capacity_) {
      std::memcpy(tokens_host_, tokens.data(), tokens.size() * 4);
    }
  }

  bool begin_capture() override {
    return record(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  }
  std::shared_ptr<void> end_capture() override {
    cudaGraph_t graph = nullptr;
    const cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    if (e != cudaSuccess || graph == nullptr) {
      cudaGetLastError();
      if (graph != nullptr) cudaGraphDestroy(graph);
      return nullptr;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t i = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (i != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return std::shared_ptr<void>(exec, [](void* g) { cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g)); });
  }
  void replay(const std::shared_ptr<void>& graph) override {
    record(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph.get()), stream_), "cudaGraphLaunch");
  }

  bool copy_rows(void* dst, const void* src, int64_t rows, int64_t row_bytes, int64_t src_stride) override {
    record(cudaMemcpy2DAsync(dst, static_cast<size_t>(row_bytes), src, static_cast<size_t>(src_stride),
                             static_cast<size_t>(row_bytes), static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                             stream_),
           "cudaMemcpy2DAsync (dual-cache suffix)");
    return true;
  }

  void to_host(float* dst, const float* src, int64_t count) override {
    const size_t bytes = static_cast<size_t>(count) * 4;
    if (bytes > staging_bytes_) {
      cudaFreeHost(staging_);
      staging_ = nullptr;
      staging_bytes_ = 0;
      if (!record(cudaMallocHost(&staging_, bytes), "cudaMallocHost (read-back)")) return;
      staging_bytes_ = bytes;
    }
    record(cudaMemcpyAsync(staging_, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (read-back)");
    if (record(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) std::memcpy(dst, staging_, bytes);
  }

  bool greedy(const float* logits, int64_t rows, int64_t vocab, std::span<const int32_t> banned,
              Pick* picks) override {
    if (banned.size() > kMaxBanned || rows == 0) return false;
    Banned b{};
    b.count = static_cast<int>(banned.size());
    for (size_t i = 0; i < banned.size(); ++i) b.id[i] = banned[i];
    const size_t bytes = static_cast<size_t>(rows) * 8;
    if (bytes > pick_bytes_) {
      cudaStreamSynchronize(stream_);
      cudaFree(picks_device_);
      cudaFreeHost(picks_host_);
      picks_device_ = picks_host_ = nullptr;
      pick_bytes_ = 0;
      if (!record(cudaMalloc(&picks_device_, bytes), "cudaMalloc (picks)") ||
          !record(cudaMallocHost(&picks_host_, bytes), "cudaMallocHost (picks)")) {
        return true;  // the error is check()'s
      }
      pick_bytes_ = bytes;
    }
    auto* tok = static_cast<int32_t*>(picks_device_);
    auto* conf = reinterpret_cast<float*>(tok + rows);
    greedy_kernel<<<static_cast<unsigned>(rows), kGreedyThreads, 0, stream_>>>(logits, vocab, b, tok, conf);
    launched("greedy sampler");
    record(cudaMemcpyAsync(picks_host_, picks_device_, bytes, cudaMemcpyDeviceToHost, stream_),
           "cudaMemcpyAsync (picks)");
    if (!record(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return true;
    const auto* ht = static_cast<const int32_t*>(picks_host_);
    const auto* hc = reinterpret_cast<const float*>(ht + rows);
    for (int64_t i = 0; i < rows; ++i) picks[i] = Pick{ht[i], static_cast<double>(hc[i])};
    return true;
  }

  Status check() override {
    record(cudaGetLastError(), "a kernel launch");
    if (error_code_ == StatusCode::ok) return Status::Ok();
    Status s(error_code_, error_message_);
    error_code_ = StatusCode::ok;
    return s;
  }

 private:
  // y[n, w.rows] = x[n, w.cols] · wᵀ + beta·y. Column-major: Yᵀ (w.rows x n) = Wᵀ·Xᵀ with W stored
  // as a (cols x rows) column-major matrix, so op(A) = T, op(B) = N ("TN", Hopper's fast layout).
  void gemm(void* y, cudaDataType_t y_type, const void* x, int64_t n, const Weight& w, float beta, const char* what) {
    if (n == 0) return;
    SkinnyGemm g;
    g.y = y;
    g.y_f32 = y_type == CUDA_R_32F;
    g.accumulate = beta != 0.0f;
    g.x = x;
    g.w = w.data;
    g.n = n;
    g.rows = w.rows;
    g.cols = w.cols;
    g.overlap_previous = true;  // its weights load while the kernel before it finishes
    if (gemm_ == GemmChoice::streaming && n <= kEngineSkinnyRows && skinny_gemm_supported(g)) {
      record(skinny_gemm(g, stream_), what);
      return;
    }
    if (gemm_ == GemmChoice::tuned && n <= kEngineTunedRows) {
      const LtShape shape = LtGemm::shape(n, w.rows, w.cols, y_type, beta != 0.0f, y, x, w.data);
      const bool offer_skinny = n <= kEngineSkinnyRows && skinny_gemm_supported(g);
      const cublasStatus_t s = lt_.tuned(shape, y, x, w.data, stream_, offer_skinny ? &g : nullptr);
      if (s != CUBLAS_STATUS_NOT_SUPPORTED) {  // no algorithm listed for the shape: cuBLAS below
        (void)blas(s, what);
        return;
      }
    }
    const float alpha = 1.0f;
    (void)blas(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(n),
                      static_cast<int>(w.cols), &alpha, w.data, CUDA_R_16BF, static_cast<int>(w.cols), x, CUDA_R_16BF,
                      static_cast<int>(w.cols), &beta, y, y_type, static_cast<int>(w.rows), CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT),
         what);
  }

  // cos/sin of every position below `positions`, in f64 on the host as the CPU backend computes
  // them (the table is grown by doubling; a sync, rare).
  bool grow_rope_table(int64_t positions) {
    if (positions <= rope_positions_) return true;
    const int64_t cap = std::max<int64_t>(positions, std::max<int64_t>(2 * rope_positions_, 4096));
    const int64_t half = head_dim_ / 2;
    double theta = rope_config_.theta, pos_scale = 1.0;
    if (rope_config_.scaling == "linear") pos_scale = 1.0 / rope_config_.factor;
    if (rope_config_.scaling == "ntk") {
      theta *= std::pow(rope_config_.factor, static_cast<double>(head_dim_) / static_cast<double>(head_dim_ - 2));
    }
    std::vector<float> table(static_cast<size_t>(cap * half * 2));
    for (int64_t p = 0; p < cap; ++p) {
      const double pos = static_cast<double>(p) * pos_scale;
      for (int64_t i = 0; i < half; ++i) {
        const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim_));
        table[(p * half + i) * 2] = static_cast<float>(std::cos(pos * inv_freq));
        table[(p * half + i) * 2 + 1] = static_cast<float>(std::sin(pos * inv_freq));
      }
    }
    cudaStreamSynchronize(stream_);
    cudaFree(rope_table_);
    rope_table_ = nullptr;
    rope_positions_ = 0;
    if (!record(cudaMalloc(&rope_table_, table.size() * 4), "cudaMalloc (rope table)")) return false;
    if (!upload(rope_table_, table.data(), table.size() * 4, "rope table")) return false;
    rope_positions_ = cap;
    return true;
  }

  // Host data into device memory, ordered on the engine's stream and finished on return (the
  // source may go at once). Not cudaMemcpy: from pageable memory it returns once the data is
  // staged, with the last DMA possibly in flight, and on the legacy stream, which the engine's
  // non-blocking stream does not wait for, so a kernel right after could read the old contents
  // of memory a freed model left there (the first request of a model loaded after another read
  // part of a stale RoPE table: bench/RESULTS.md).
  bool upload(void* dst, const void* src, size_t bytes, const char* what) {
    const std::string name = std::string("cudaMemcpyAsync (") + what + ")";
    return record(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), name.c_str()) &&
           record(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  void* device_alloc(int64_t bytes) {
    void* p = nullptr;
    if (!record(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))), "cudaMalloc (weights)")) {
      return nullptr;
    }
    owned_.push_back(p);
    return p;
  }

  Status pending() {
    Status s = check();
    return s.ok() ? Status(StatusCode::internal, "cuda backend: allocation failed") : s;
  }
  void fail(const Status& s) {
    if (error_code_ != StatusCode::ok) return;
    error_code_ = s.code();
    error_message_ = s.message();
  }
  bool record(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    cudaGetLastError();
    fail(Status(e == cudaErrorMemoryAllocation ? StatusCode::out_of_memory : StatusCode::internal,
                std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e)));
    return false;
  }
  Status cuda(cudaError_t e, const char* what) {
    record(e, what);
    return check();
  }
  bool launched(const char* what) { return record(cudaGetLastError(), what); }
  // A cuBLAS failure, kept for check() and returned.
  Status blas(cublasStatus_t s, const char* what) {
    if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
    Status e(s == CUBLAS_STATUS_ALLOC_FAILED ? StatusCode::out_of_memory : StatusCode::internal,
             std::string("cuda backend: ") + what + ": " + cublas_name(s));
    fail(e);
    return e;
  }

  int device_ = 0;
  GemmChoice gemm_ = GemmChoice::cublas;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  LtGemm lt_;
  void* workspace_ = nullptr;
  std::list<void*> owned_;  // weights
  int32_t* tokens_ = nullptr;
  int32_t* tokens_host_ = nullptr;  // pinned staging of the tokens
  int64_t token_capacity_ = 0;
  void* rope_table_ = nullptr;
  int64_t rope_positions_ = 0;
  RopeConfig rope_config_;
  int64_t head_dim_ = 0;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  void *picks_device_ = nullptr, *picks_host_ = nullptr;  // the greedy sampler's tokens and confidences
  size_t pick_bytes_ = 0;
  StatusCode error_code_ = StatusCode::ok;  // the first error since the last check()
  std::string error_message_;
};

}  // namespace

Result<std::unique_ptr<Ops>> make_cuda_ops(int device, const Config& c, GemmChoice gemm) {
  SPARSA_RETURN_IF_ERROR(backend_status(Backend::cuda));
  auto ops = std::make_unique<CudaOps>();
  SPARSA_RETURN_IF_ERROR(ops->init(device, c, gemm));
  return std::unique_ptr<Ops>(std::move(ops));
}

}  // namespace sparsa::dlm
