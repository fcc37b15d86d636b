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

// Step 1's radix key, the token's own number included so that a keys-only sort gives the
// permutation (8 bytes moved per token and pass instead of 8 + 4 for key-value pairs):
//
//   key = segment << (31 + index_bits) | (norm bits & 0x7fffffff) << index_bits | index
//
// segment = (batch * heads + head) * windows + window, index = the token's place in its window,
// index_bits = bit_width(window - 1). Norms are >= 0 (+0 for a zero row), so their sign bit is 0
// and the other 31 bits order as their values do (a NaN norm is an error the caller reports; its
// masked bits keep it inside its segment). Ascending keys = ascending segment, then ascending
// norm, then ascending index: a sort of the bits [index_bits, index_bits + 31 + segment_bits) that
// is stable (tokens enter in index order) is norm_sort within every segment, and so is any sort
// of the whole keys. Fits 64 bits: with bh * len < 2^31 and window <= len,
// 2^(segment_bits - 1) * 2^(index_bits - 1) < bh * windows * window < 2 * bh * len < 2^32, so
// segment_bits + index_bits <= 33.
SPARSA_HOST_DEVICE uint64_t norm_key(uint64_t segment, float norm, uint32_t index, int index_bits) {
  return (segment << (31 + index_bits)) | (static_cast<uint64_t>(float_bits(norm) & 0x7fffffffu) << index_bits) |
         index;
}
SPARSA_HOST_DEVICE uint32_t norm_key_index(uint64_t key, int index_bits) {
  return static_cast<uint32_t>(key & ((uint64_t{1} << index_bits) - 1));
}
// bit_width(n - 1): bits of the numbers 0 .. n - 1 (0 for n = 1).
SPARSA_HOST_DEVICE int bits_for(uint64_t n) {
  int b = 0;
  while (b < 64 && (uint64_t{1} << b) < n) ++b;
  return b;
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
