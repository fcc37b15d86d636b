// Helpers shared by the LLSA tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "sparsa/tensor.h"
#include "test_util.h"

namespace llsa_test {

using sparsa_test::randn;

inline double max_abs_diff(const sparsa::HostArray& a, const sparsa::HostArray& b) {
  double m = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, (double)std::abs(a.ptr<float>()[i] - b.ptr<float>()[i]));
  return m;
}

inline double max_abs(const sparsa::HostArray& a) {
  double m = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, (double)std::abs(a.ptr<float>()[i]));
  return m;
}

inline bool all_finite(const sparsa::HostArray& a) {
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!std::isfinite(a.ptr<float>()[i])) return false;
  return true;
}

}  // namespace llsa_test
