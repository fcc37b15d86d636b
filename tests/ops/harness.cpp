// Harness plumbing: randomness, strided layouts, guarded outputs, comparison, bounds.
#include "harness.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numbers>

namespace ops {

// ---- Rng ----
uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
int64_t Rng::below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
int64_t Rng::range(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }
double Rng::normal() {
  const double u1 = 1.0 - uniform(), u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

// ---- layouts ----
const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::bhsd: return "bhsd";
    case Layout::bshd: return "bshd";
    case Layout::pad: return "pad";
  }
  return "?";
}

std::vector<int64_t> layout_strides(Layout layout, const std::vector<int64_t>& shape) {
  const int64_t h = shape[1], s = shape[2];
  if (shape.size() == 4) {
    const int64_t d = shape[3];
    switch (layout) {
      case Layout::bhsd: return {h * s * d, s * d, d, 1};
      case Layout::bshd: return {s * h * d, d, h * d, 1};
      case Layout::pad: {
        const int64_t row = d + 3, head = s * row + 5;  // odd paddings: rows lose alignment
        return {h * head + 7, head, row, 1};
      }
    }
  }
  switch (layout) {  // [b, h, s]
    case Layout::bhsd: return {h * s, s, 1};
    case Layout::bshd: return {s * h, 1, h};
    case Layout::pad: {
      const int64_t head = 2 * s + 3;
      return {h * head + 5, head, 2};
    }
  }
  return {};
}

int64_t layout_span(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t span = 1;
  for (size_t d = 0; d < shape.size(); ++d) span += (shape[d] - 1) * strides[d];
  return span;
}

static Tensor make_view(void* data, DType dtype, const std::vector<int64_t>& shape,
                        const std::vector<int64_t>& strides) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = shape[d];
    t.strides[d] = strides[d];
  }
  return t;
}

// Offset (elements) of logical row-major element `flat` of a view.
static int64_t flat_offset(const Tensor& t, int64_t flat) {
  int64_t off = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    off += (flat % t.shape[d]) * t.strides[d];
    flat /= t.shape[d];
  }
  return off;
}

static int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// ---- element codes ----
static double decode_half(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  double x;
  if (exponent == 0) {
    x = std::ldexp(mantissa, -24);  // subnormal
  } else if (exponent == 31) {
    x = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    x = std::ldexp(mantissa + 1024, exponent - 25);
  }
  return sign ? -x : x;
}

double decode(const void* base, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[offset];
    case DType::f16: return decode_half(static_cast<const uint16_t*>(base)[offset]);
    case DType::bf16: {
      const uint32_t bits = uint32_t{static_cast<const uint16_t*>(base)[offset]} << 16;
      return std::bit_cast<float>(bits);
    }
    case DType::i32: return static_cast<const int32_t*>(base)[offset];
  }
  return std::numeric_limits<double>::quiet_NaN();
}

double half_ulp(DType dtype) {
  switch (dtype) {
    case DType::f16: return 0x1.0p-11;
    case DType::bf16: return 0x1.0p-8;
    default: return 0x1.0p-24;
  }
}

static void encode(void* base, DType dtype, int64_t offset, float x) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[offset] = x; break;
    case DType::f16: static_cast<uint16_t*>(base)[offset] = sparsa::float_to_half(x); break;
    case DType::bf16: static_cast<uint16_t*>(base)[offset] = sparsa::float_to_bf16(x); break;
    case DType::i32: static_cast<int32_t*>(base)[offset] = static_cast<int32_t>(x); break;
  }
}

// ---- inputs ----
HostTensor make_tensor(DType dtype, const std::vector<int64_t>& shape, Layout layout, const std::vector<float>& values) {
  HostTensor t;
  t.shape = shape;
  const std::vector<int64_t> strides = layout_strides(layout, shape);
  const int64_t span = layout_span(shape, strides);
  const size_t esize = sparsa::dtype_size(dtype);
  t.bytes.resize(static_cast<size_t>(span) * esize);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < span; ++i) encode(t.bytes.data(), dtype, i, nan);  // gaps read as NaN
  t.view = make_view(t.bytes.data(), dtype, shape, strides);
  for (int64_t i = 0; i < numel(shape); ++i) encode(t.bytes.data(), dtype, flat_offset(t.view, i), values[i]);
  return t;
}

std::vector<float> normal_values(Rng& rng, int64_t n, double amplitude) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(amplitude * rng.normal());
  return v;
}

// ---- guarded outputs ----
static constexpr size_t kGuardBytes = 64;
static uint8_t sentinel(size_t i) { return static_cast<uint8_t>(0xA7 + 59 * i); }
// Pre-fill of elements: a NaN payload (bits of the storage dtype) no backend writes.
static uint32_t unwritten_bits(DType dtype) {
  switch (dtype) {
    case DType::f32: return 0x7FC5A5A5u;
    case DType::f16: return 0x7E5Au;
    case DType::bf16: return 0x7FDAu;
    case DType::i32: return 0x7FC5A5A5u;
  }
  return 0;
}

GuardedOutput::GuardedOutput(DType dtype, const std::vector<int64_t>& shape, Layout layout) : shape_(shape) {
  const std::vector<int64_t> strides = layout_strides(layout, shape);
  const size_t esize = sparsa::dtype_size(dtype);
  const size_t span_bytes = static_cast<size_t>(layout_span(shape, strides)) * esize;
  guard_ = kGuardBytes;
  bytes_.resize(span_bytes + 2 * guard_);
  is_element_.assign(bytes_.size(), 0);
  for (size_t i = 0; i < bytes_.size(); ++i) bytes_[i] = std::byte{sentinel(i)};
  view_ = make_view(bytes_.data() + guard_, dtype, shape, strides);
  const uint32_t bits = unwritten_bits(dtype);
  for (int64_t i = 0; i < numel(shape); ++i) {
    const size_t at = guard_ + static_cast<size_t>(flat_offset(view_, i)) * esize;
    std::memcpy(bytes_.data() + at, &bits, esize);  // little-endian: the low bytes
    std::memset(is_element_.data() + at, 1, esize);
  }
}

std::string GuardedOutput::check(const char* what) const {
  for (size_t i = 0; i < bytes_.size(); ++i) {
    if (!is_element_[i] && bytes_[i] != std::byte{sentinel(i)}) {
      const long long rel = static_cast<long long>(i) - static_cast<long long>(guard_);
      return std::string(what) + ": byte " + std::to_string(rel) +
             " (relative to data) outside the output's elements was overwritten";
    }
  }
  const size_t esize = sparsa::dtype_size(view_.dtype);
  const uint32_t bits = unwritten_bits(view_.dtype);
  for (int64_t i = 0; i < numel(shape_); ++i) {
    uint32_t got = 0;
    std::memcpy(&got, bytes_.data() + guard_ + static_cast<size_t>(flat_offset(view_, i)) * esize, esize);
    if (got == bits) {
      std::string index;
      for (int64_t d = static_cast<int64_t>(shape_.size()) - 1, rest = i; d >= 0; rest /= shape_[d], --d) {
        index = std::to_string(rest % shape_[d]) + (index.empty() ? "" : ",") + index;
      }
      return std::string(what) + ": element [" + index + "] was never written";
    }
  }
  return "";
}

std::vector<double> GuardedOutput::values() const {
  std::vector<double> v(static_cast<size_t>(numel(shape_)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = decode(view_.data, view_.dtype, flat_offset(view_, static_cast<int64_t>(i)));
  return v;
}

// ---- bounds ----
// The f32 term: a backend that accumulates in f32 against the f64 reference. A logit
// s = scale*<q,k> carries a rounding error of a few ulp * sqrt(d) relative to its size,
// i.e. ~1e-7 absolute for |s| ~ 1; the softmax weights inherit that error and O, a
// convex combination of V rows, adds ~ulp*sqrt(L_k) relative to max|V| (~2e-6 at
// L_k = 1024). 1e-5 relative to max|O| (and to max(1, |LSE|) for LSE) leaves a few-fold
// margin for logits up to |s| ~ 16 (unit-normal inputs at the default scale) and is still
// ~100x tighter than any indexing or masking bug. Beyond that the logit error grows in
// proportion to |s| (a custom scale of 4 at d = 64 gives |s| ~ 100), so the O term
// scales with the case's bound on |s|.
static constexpr double kF32Term = 1e-5;
static constexpr double kLogitsCoveredByF32Term = 16;

// f16/bf16: both backends read the same rounded inputs and compute in >= f32, but O is
// stored in the input dtype: each rounding moves it by up to a half-ulp relative
// (2^-11 f16, 2^-8 bf16), and two results that each round may land on neighbouring
// values. So the O bound grows by sides * roundings * half_ulp; LSE is f32 always.
Bound bound(DType out_dtype, int roundings, int sides, double logit_bound) {
  const double f32_term = kF32Term * std::max(1.0, logit_bound / kLogitsCoveredByF32Term);
  return {f32_term + sides * roundings * half_ulp(out_dtype), kF32Term};
}

// ---- comparison ----
static std::string where(const Shape& s, int64_t row) {
  const int64_t i = row % s.len, h = (row / s.len) % s.heads, b = row / (s.len * s.heads);
  return "[b=" + std::to_string(b) + ",h=" + std::to_string(h) + ",i=" + std::to_string(i) + "]";
}

static std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

std::string compare(const Shape& s, const Results& want, const Results& got, const Bound& b, double* o_err,
                    double* lse_err) {
  const int64_t rows = s.batch * s.heads * s.len, d = s.head_dim;
  *o_err = 0;
  *lse_err = 0;
  double max_abs = 0;
  for (double w : want.o) {
    if (std::isnan(w)) return "reference O holds NaN";
    max_abs = std::max(max_abs, std::abs(w));
  }
  const double o_scale = max_abs > 0 ? max_abs : 1.0;
  std::string worst_o;
  for (int64_t r = 0; r < rows; ++r) {
    const double wl = want.lse[r], gl = got.lse[r];
    if (std::isnan(wl)) return "reference LSE is NaN at " + where(s, r);
    if (std::isnan(gl)) return "LSE is NaN at " + where(s, r) + " (want " + num(wl) + ")";
    const bool empty = wl == -std::numeric_limits<double>::infinity();
    if (empty) {
      if (gl != wl) return "LSE at " + where(s, r) + " is " + num(gl) + ", want -inf (the query sees no key)";
    } else {
      if (!std::isfinite(gl)) return "LSE at " + where(s, r) + " is " + num(gl) + ", want " + num(wl);
      const double e = std::abs(gl - wl) / std::max(1.0, std::abs(wl));
      *lse_err = std::max(*lse_err, e);
      if (e > b.lse) {
        return "LSE error " + num(e) + " > bound " + num(b.lse) + " at " + where(s, r) + ": got " + num(gl) +
               ", want " + num(wl);
      }
    }
    for (int64_t t = 0; t < d; ++t) {
      const double w = want.o[r * d + t], g = got.o[r * d + t];
      auto at = [&] {
        const std::string row = where(s, r);
        return row.substr(0, row.size() - 1) + ",t=" + std::to_string(t) + "]";
      };
      if (std::isnan(g)) return "O is NaN at " + at() + " (want " + num(w) + ")";
      if (empty && (w != 0.0 || g != 0.0)) {
        return "O at " + at() + " is " + num(g) + " (reference " + num(w) + "), want exactly 0 (the query sees no key)";
      }
      const double e = std::abs(g - w) / o_scale;
      if (!(e <= b.o)) {
        return "O error " + num(e) + " (relative to max|O| = " + num(max_abs) + ") > bound " + num(b.o) + " at " + at() +
               ": got " + num(g) + ", want " + num(w);
      }
      *o_err = std::max(*o_err, e);
    }
  }
  return "";
}

}  // namespace ops
