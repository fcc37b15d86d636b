// The CPU backend of the engine: f32 activations, GEMMs through OpenBLAS (cblas_sgemm; a plain
// loop when the build has no OpenBLAS), plain loops for the elementwise work. bf16/f16 weights are
// converted to f32 once at load; f32 weights stay views of the mapped files (never copied).
#if defined(SPARSA_DLM_CBLAS)
#include <cblas.h>
#endif

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <list>

#include "engine.h"

namespace sparsa::dlm {

namespace {

class CpuOps final : public Ops {
 public:
  const char* name() const override { return "cpu"; }
  Device device() const override { return {}; }

  Result<Weight> prepare(const Tensor& t) override {
    Weight w;  // [rows, cols]; a norm's weight [dim] is [dim, 1]
    w.rows = t.shape[0];
    w.cols = t.ndim == 2 ? t.shape[1] : 1;
    // f32 stays a view of the mapping unless the file placed it off 4-byte alignment (possible
    // after an odd-length bf16 entry), which is copied.
    if (t.dtype == DType::f32 && reinterpret_cast<uintptr_t>(t.data) % alignof(float) == 0) {
      w.data = t.ptr<const float>();
      return w;
    }
    // Mapped tensors are contiguous; entries are 2-byte aligned (every dtype's size is even and
    // the data section starts 8-aligned), so u16 reads are aligned and f32 goes through memcpy.
    HostArray converted(DType::f32, t.shape_vector());
    float* dst = converted.ptr<float>();
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
    owned_.push_back(std::move(converted));
    w.data = owned_.back().ptr<float>();
    return w;
  }

  float* alloc(int64_t floats) override {
    return static_cast<float*>(std::calloc(static_cast<size_t>(std::max<int64_t>(floats, 1)), sizeof(float)));
  }
  void free(float* p) override { std::free(p); }

  void matmul(float* y, const float* x, int64_t n, const Weight& w) override {
    // y[n, rows] = x[n, cols] · W[rows, cols]ᵀ
#if defined(SPARSA_DLM_CBLAS)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(w.rows),
                static_cast<int>(w.cols), 1.0f, x, static_cast<int>(w.cols), w.data, static_cast<int>(w.cols), 0.0f, y,
                static_cast<int>(w.rows));
#else
    // Without OpenBLAS: dot products in 8 interleaved f32 partial sums (vectorisable).
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = x + i * w.cols;
      for (int64_t r = 0; r < w.rows; ++r) {
        const float* wr = w.data + r * w.cols;
        float lanes[8] = {};
        int64_t c = 0;
        for (; c + 8 <= w.cols; c += 8)
          for (int j = 0; j < 8; ++j) lanes[j] += xi[c + j] * wr[c + j];
        float sum = 0.0f;
        for (int j = 0; j < 8; ++j) sum += lanes[j];
        for (; c < w.cols; ++c) sum += xi[c] * wr[c];
        y[i * w.rows + r] = sum;
      }
    }
#endif
  }

  void rms_norm(float* out, const float* x, const Weight& weight, int64_t rows, int64_t dim, double eps) override {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * dim;
      float* o = out + r * dim;
      double ss = 0;
      for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * weight.data[i];
    }
  }

  void rope(float* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const RopeConfig& rope) override {
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
        float* v = x + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {  // rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
          const float a = v[i], b = v[i + half];
          v[i] = a * cosv[i] - b * sinv[i];
          v[i + half] = b * cosv[i] + a * sinv[i];
        }
      }
    }
  }

  void swiglu(float* gate, const float* up, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  }

  void add(float* x, const float* y, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) x[i] += y[i];
  }

  void embed(float* out, const Weight& table, std::span<const int32_t> tokens) override {
    for (size_t t = 0; t < tokens.size(); ++t) {
      std::memcpy(out + t * table.cols, table.data + static_cast<int64_t>(tokens[t]) * table.cols,
                  sizeof(float) * table.cols);
    }
  }

  void to_host(float* dst, const float* src, int64_t count) override { std::memcpy(dst, src, sizeof(float) * count); }

 private:
  std::list<HostArray> owned_;  // converted weights (stable addresses)
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops() { return std::make_unique<CpuOps>(); }

}  // namespace sparsa::dlm
