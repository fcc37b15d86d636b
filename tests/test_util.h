// Input builders shared by the unit tests (fixed seeds, so every run sees the same data).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "sparsa/tensor.h"

namespace sparsa_test {

// f32 Gaussian N(0, sigma^2) of the given shape.
inline sparsa::HostArray randn(std::vector<int64_t> shape, uint32_t seed, float sigma = 1.0f) {
  sparsa::HostArray a(sparsa::DType::f32, std::move(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] = nd(rng);
  return a;
}

// Gaussian rows scaled by log-normal factors exp(N(0, norm_sigma^2)): heavy-tailed token
// norms, the structure that norm sorting exploits.
inline sparsa::HostArray heavy_tailed(std::vector<int64_t> shape, uint32_t seed, float norm_sigma) {
  sparsa::HostArray a = randn(shape, seed);
  std::mt19937 rng(seed + 1000);
  std::normal_distribution<float> nd(0.0f, norm_sigma);
  const int64_t d = shape.back();
  for (int64_t r = 0; r < a.numel() / d; ++r) {
    const float f = std::exp(nd(rng));
    for (int64_t t = 0; t < d; ++t) a.ptr<float>()[r * d + t] *= f;
  }
  return a;
}

}  // namespace sparsa_test
