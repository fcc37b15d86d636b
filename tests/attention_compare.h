// Inputs and the cpu-vs-cpu_ref comparison shared by the CPU attention tests.
//
// Tolerances (both backends read the same stored inputs, so input rounding cancels):
//  - f32 outputs: |cpu - ref| <= 1e-5 * max|ref|. cpu accumulates in f32 with an online
//    softmax over key chunks, ref in f64; the f32 error of a length-n sum of O(1) terms
//    grows like sqrt(n) * 2^-24 ~ 2e-6 at n = 1023 (the dot products are up to 256 long,
//    sqrt(256) * 2^-24 ~ 1e-6), leaving a margin of ~5x.
//  - f16/bf16 outputs: both results are rounded to the output dtype once; two values within
//    1e-5 relative of each other may round to neighbouring representable numbers, so one
//    unit in the last place of the output dtype (2^-10 relative for f16, 2^-7 for bf16)
//    is added to the f32 bound.
//  - LSE (always f32): |cpu - ref| <= 1e-5 * max(1, |ref|); infinities must match exactly.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "sparsa/attention.h"

namespace sparsa_test {

// A [b, h, s, d] tensor of normal values in `dtype`, contiguous or as a view of a
// [b, s, h, d] buffer (non-contiguous head and seq strides).
struct Input {
  sparsa::HostArray storage;
  sparsa::Tensor view;
};

inline Input make_input(int64_t b, int64_t h, int64_t s, int64_t d, sparsa::DType dtype, bool strided,
                        std::mt19937& rng) {
  using namespace sparsa;
  std::normal_distribution<float> normal;
  HostArray f32(DType::f32, strided ? std::vector<int64_t>{b, s, h, d} : std::vector<int64_t>{b, h, s, d});
  for (int64_t i = 0; i < f32.numel(); ++i) f32.ptr<float>()[i] = normal(rng);
  Input in{dtype == DType::f32 ? std::move(f32) : convert(f32.view(), dtype).value(), {}};
  in.view = in.storage.view();
  if (strided) {
    in.view.shape[1] = h;
    in.view.shape[2] = s;
    in.view.strides[1] = d;
    in.view.strides[2] = h * d;
  }
  return in;
}

inline double output_tolerance_ulp(sparsa::DType dtype) {
  switch (dtype) {
    case sparsa::DType::f16: return std::ldexp(1.0, -10);
    case sparsa::DType::bf16: return std::ldexp(1.0, -7);
    default: return 0.0;
  }
}

// The number of output and LSE elements of `got` outside the bounds above around `ref`
// (elements in the same order); with `report`, the first few are gtest failures.
inline int64_t count_mismatches(const sparsa::AttentionOutput& ref, const sparsa::AttentionOutput& got,
                                sparsa::DType dtype, const std::string& what, bool report) {
  using namespace sparsa;
  if (ref.out.numel() != got.out.numel() || ref.lse.numel() != got.lse.numel()) {
    if (report) ADD_FAILURE() << what << ": the outputs differ in size";
    return std::max<int64_t>(1, ref.out.numel());
  }
  const Tensor ro = ref.out.view(), go = got.out.view();
  double max_ref = 0;
  for (int64_t i = 0; i < ref.out.numel(); ++i) max_ref = std::max(max_ref, std::abs(load_as_double(ro, i)));
  const double ulp = output_tolerance_ulp(dtype);
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.out.numel(); ++i) {
    const double r = load_as_double(ro, i), g = load_as_double(go, i);
    const double tol = 1e-5 * max_ref + ulp * std::abs(r);
    if (!(std::abs(r - g) <= tol) && bad++ < 5 && report) {
      ADD_FAILURE() << what << ": out[" << i << "] cpu " << g << " vs cpu_ref " << r << " (tol " << tol << ")";
    }
  }
  for (int64_t i = 0; i < ref.lse.numel(); ++i) {
    const float r = ref.lse.ptr<float>()[i], g = got.lse.ptr<float>()[i];
    const bool same_inf = std::isinf(r) && r == g;
    if (!same_inf && !(std::abs(r - g) <= 1e-5 * std::max(1.0f, std::abs(r))) && bad++ < 10 && report) {
      ADD_FAILURE() << what << ": lse[" << i << "] cpu " << g << " vs cpu_ref " << r;
    }
  }
  return bad;
}

// Compares two outputs of the same shape element by element under the bounds above.
inline void expect_close(const sparsa::AttentionOutput& ref, const sparsa::AttentionOutput& got, sparsa::DType dtype,
                         const std::string& what) {
  EXPECT_EQ(count_mismatches(ref, got, dtype, what, true), 0) << what << ": elements out of tolerance";
}

inline sparsa::AttentionOptions with_backend(sparsa::Backend backend, sparsa::Mask mask = {}) {
  sparsa::AttentionOptions options;
  options.backend = backend;
  options.mask = mask;
  return options;
}

}  // namespace sparsa_test
