// The CPU backend of the engine: f32 activations, GEMMs through OpenBLAS (cblas_sgemm; a plain
// loop when the build has no OpenBLAS), plain loops for the elementwise work. bf16/f16 weights are
// converted to f32 once at load; f32 weights stay views of the mapped files (never copied).
#if defined(SPARSA_DLM_CBLAS)
#include <cblas.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <list>

#include "engine.h"

namespace sparsa::dlm {

namespace {

// dst[n] = the tensor as f32 (mapped tensors are contiguous; entries are 2-byte aligned since
// every dtype's size is even and the data section starts 8-aligned, so u16 reads are aligned and
// f32 goes through memcpy).
Status to_f32(const Tensor& t, float* dst) {
  const int64_t n = t.numel();
  if (t.dtype == DType::bf16) {
    const uint16_t* src = t.ptr<const uint16_t>();
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &bits, sizeof(float));
    }
  } else if (t.dtype == DType::f16) {
    const uint16_t* src = t.ptr<const uint16_t>();
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
  } else if (t.dtype == DType::f32) {
    std::memcpy(dst, t.data, sizeof(float) * n);
  } else {
    return Status(StatusCode::unsupported_dtype, "weights: expected F32, F16 or BF16");
  }
  return Status::Ok();
}

class CpuOps final : public Ops {
 public:
  const char* name() const override { return "cpu"; }
  Device device() const override { return {}; }
  DType act_dtype() const override { return DType::f32; }

  Result<Weight> prepare(std::span<const Tensor> parts) override {
    Weight w;  // [rows, cols]
    w.cols = parts[0].ndim == 2 ? parts[0].shape[1] : 1;
    for (const Tensor& t : parts) w.rows += t.shape[0];
    // One f32 part stays a view of the mapping unless the file placed it off 4-byte alignment
    // (possible after an odd-length bf16 entry), which is copied.
    const Tensor& t0 = parts[0];
    if (parts.size() == 1 && t0.dtype == DType::f32 && reinterpret_cast<uintptr_t>(t0.data) % alignof(float) == 0) {
      w.data = t0.data;
      return w;
    }
    HostArray converted(DType::f32, {w.rows, w.cols});
    float* dst = converted.ptr<float>();
    for (const Tensor& t : parts) {
      SPARSA_RETURN_IF_ERROR(to_f32(t, dst));
      dst += t.numel();
    }
    owned_.push_back(std::move(converted));
    w.data = owned_.back().ptr<float>();
    return w;
  }
  Result<Weight> prepare_vector(const Tensor& t) override { return prepare(std::span<const Tensor>(&t, 1)); }

  Result<Weight> random(int64_t rows, int64_t cols, double scale, uint64_t seed) override {
    HostArray a(DType::f32, {rows, cols});
    float* p = a.ptr<float>();
    uint64_t state = seed;
    for (int64_t i = 0; i < rows * cols; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;  // an LCG's top bits
      const double u = static_cast<double>(state >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
      p[i] = static_cast<float>((2 * u - 1) * scale);
    }
    return keep(std::move(a), rows, cols);
  }
  Result<Weight> constant_vector(int64_t dim, float value) override {
    HostArray a(DType::f32, {dim});
    std::fill(a.ptr<float>(), a.ptr<float>() + dim, value);
    return keep(std::move(a), dim, 1);
  }

  void* alloc(int64_t elements, DType dtype) override {
    return std::calloc(static_cast<size_t>(std::max<int64_t>(elements, 1)), dtype_size(dtype));
  }
  void free(void* p) override { std::free(p); }

  void matmul(void* y, const void* x, int64_t n, const Weight& w) override { gemm(f(y), cf(x), n, w, 0.0f); }
  void matmul_add(float* r, const void* x, int64_t n, const Weight& w) override { gemm(r, cf(x), n, w, 1.0f); }
  void matmul_f32(float* y, const void* x, int64_t n, const Weight& w) override { gemm(y, cf(x), n, w, 0.0f); }

  void rms_norm(void* out, const float* x, const Weight& weight, int64_t rows, int64_t dim, double eps) override {
    norm_rows(f(out), x, weight.ptr<float>(), rows, dim, dim, 1, dim, eps);
  }
  void head_norm(void* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, const Weight& weight,
                 double eps) override {
    norm_rows(f(x), f(x), weight.ptr<float>(), n, row_stride, row_stride, heads, head_dim, eps);
  }

  void rope(void* xv, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t pos0,
            const RopeConfig& rope) override {
    float* x = f(xv);
    const int64_t half = head_dim / 2;
    double theta = rope.theta;
    double pos_scale = 1.0;
    if (rope.scaling == "linear") pos_scale = 1.0 / rope.factor;
    if (rope.scaling == "ntk") theta *= std::pow(rope.factor, static_cast<double>(head_dim) / (head_dim - 2));
    std::vector<float> cosv(half), sinv(half);
    for (int64_t t = 0; t < n; ++t) {
      const double pos = static_cast<double>(pos0 + t) * pos_scale;
      for (int64_t i = 0; i < half; ++i) {
        const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
        cosv[i] = static_cast<float>(std::cos(pos * inv_freq));
        sinv[i] = static_cast<float>(std::sin(pos * inv_freq));
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + t * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {  // rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
          const float a = v[i], b = v[i + half];
          v[i] = a * cosv[i] - b * sinv[i];
          v[i + half] = b * cosv[i] + a * sinv[i];
        }
      }
    }
  }

  bool add_bias(void* xv, int64_t n, int64_t row_stride, int64_t col0, const Weight& bias) override {
    float* x = f(xv);
    const float* b = bias.ptr<float>();
    for (int64_t t = 0; t < n; ++t) {
      float* row = x + t * row_stride + col0;
      for (int64_t i = 0; i < bias.rows; ++i) row[i] += b[i];
    }
    return true;
  }

  void swiglu(void* hv, const void* guv, int64_t n, int64_t hidden) override {
    float* h = f(hv);
    const float* gu = cf(guv);
    for (int64_t t = 0; t < n; ++t) {
      const float* gate = gu + t * 2 * hidden;
      const float* up = gate + hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const float g = gate[i];
        h[t * hidden + i] = g / (1.0f + std::exp(-g)) * up[i];
      }
    }
  }

  void embed(float* out, const Weight& table, std::span<const int32_t> tokens) override {
    for (size_t t = 0; t < tokens.size(); ++t) {
      std::memcpy(out + t * table.cols, table.ptr<float>() + static_cast<int64_t>(tokens[t]) * table.cols,
                  sizeof(float) * table.cols);
    }
  }

  void to_host(float* dst, const float* src, int64_t count) override { std::memcpy(dst, src, sizeof(float) * count); }

 private:
  Weight keep(HostArray a, int64_t rows, int64_t cols) {
    owned_.push_back(std::move(a));
    Weight w;
    w.data = owned_.back().data();
    w.rows = rows;
    w.cols = cols;
    return w;
  }
  static float* f(void* p) { return static_cast<float*>(p); }
  static const float* cf(const void* p) { return static_cast<const float*>(p); }

  // y[n, rows] = x[n, cols] · W[rows, cols]ᵀ + beta · y
  static void gemm(float* y, const float* x, int64_t n, const Weight& w, float beta) {
    const float* wd = w.ptr<float>();
#if defined(SPARSA_DLM_CBLAS)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(w.rows),
                static_cast<int>(w.cols), 1.0f, x, static_cast<int>(w.cols), wd, static_cast<int>(w.cols), beta, y,
                static_cast<int>(w.rows));
#else
    // Without OpenBLAS: dot products in 8 interleaved f32 partial sums (vectorisable).
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = x + i * w.cols;
      for (int64_t r = 0; r < w.rows; ++r) {
        const float* wr = wd + r * w.cols;
        float lanes[8] = {};
        int64_t c = 0;
        for (; c + 8 <= w.cols; c += 8)
          for (int j = 0; j < 8; ++j) lanes[j] += xi[c + j] * wr[c + j];
        float sum = 0.0f;
        for (int j = 0; j < 8; ++j) sum += lanes[j];
        for (; c < w.cols; ++c) sum += xi[c] * wr[c];
        y[i * w.rows + r] = beta == 0.0f ? sum : y[i * w.rows + r] + sum;
      }
    }
#endif
  }

  // Row t holds `groups` vectors of `dim` at x + t * x_stride + g * dim; each normalised by its
  // RMS (f64 sum of squares) times weight[dim] into out (same layout with out_stride).
  static void norm_rows(float* out, const float* x, const float* weight, int64_t rows, int64_t x_stride,
                        int64_t out_stride, int64_t groups, int64_t dim, double eps) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* xr = x + r * x_stride + g * dim;
        float* o = out + r * out_stride + g * dim;
        double ss = 0;
        for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
        for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * weight[i];
      }
    }
  }

  std::list<HostArray> owned_;  // converted weights (stable addresses)
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops() { return std::make_unique<CpuOps>(); }

#if !defined(SPARSA_DLM_CUDA)
Result<std::unique_ptr<Ops>> make_cuda_ops(int, const Config&, GemmChoice) {
  return backend_status(Backend::cuda).ok()
             ? Status(StatusCode::unsupported, "backend: this build of the DLM engine has no cuda backend")
             : backend_status(Backend::cuda);
}
#endif

}  // namespace sparsa::dlm
