// Internal: the integer sort keys of BA-Att's cuda selector, shared by the kernels
// (ba_att_kernels.cuh) and the host tests (tests/test_ba_att_cuda.cpp), so that the orders they
// encode are checked on any machine. Plain C++ (host and device), no CUDA header.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPARSA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPARSA_HOST_DEVICE inline
#endif

namespace sparsa::cuda::ba_att {

SPARSA_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
SPARSA_HOST_DEVICE float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// Step 1's radix key: ascending keys = ascending segment (batch, head, window), then ascending
// norm. Norms are >= 0 (+0 for a zero row), and the IEEE bits of non-negative floats order as
// their values do; a stable sort of these keys is norm_sort within every segment.
SPARSA_HOST_DEVICE uint64_t norm_key(uint64_t segment, float norm) {
  return (segment << 32) | float_bits(norm);
}

// Step 4's row key: ascending keys = descending logit, ties to the lower index (select_blocks'
// order). -0 becomes +0 first: the CPU compares them equal, so they must tie here too.
SPARSA_HOST_DEVICE uint64_t order_key(float logit, int32_t index) {
  if (logit == 0.0f) logit = 0.0f;
  uint32_t u = float_bits(logit);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending floats -> ascending u
  return (static_cast<uint64_t>(~u) << 32) | static_cast<uint32_t>(index);
}
SPARSA_HOST_DEVICE float logit_of(uint64_t key) {
  const uint32_t u = ~static_cast<uint32_t>(key >> 32);
  return bits_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
SPARSA_HOST_DEVICE int32_t index_of(uint64_t key) { return static_cast<int32_t>(static_cast<uint32_t>(key)); }

// n / divisor for n < 2^31 and 1 <= divisor < 2^31 without a division instruction (Granlund and
// Montgomery, "Division by invariant integers using multiplication", 1994): with l = ceil(log2
// divisor) and m = floor(2^32 (2^l - divisor) / divisor) + 1, n / divisor = (mulhi(m, n) + n) >> l.
// mulhi(m, n) <= n, so the sum stays below 2^32 for n < 2^31. The norm kernel splits flat token
// numbers into (batch * head, token) and tokens into sort windows with it, once per token.
struct FastDiv {
  uint32_t divisor = 1, multiplier = 1, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  SPARSA_HOST_DEVICE uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(multiplier, n);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(multiplier) * n) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

}  // namespace sparsa::cuda::ba_att
