// Internal: the register-blocked micro-kernels of the CPU attention mainloop, written with
// GCC/Clang vector extensions so one source compiles to AVX-512 (16 lanes), AVX/AVX2
// (8 lanes) or SSE (4 lanes) from the -march the library is built for.
//
// Layouts (rows = query rows of a tile, in vector lanes; keys = one key chunk):
//   qt  [head_dim][ldq]   the tile's queries transposed, pre-scaled
//   k   [keys][ldk]       key rows
//   st  [keys][ldq]       scores, then probabilities (transposed: rows in lanes)
//   v   [keys][ldv]       value rows
//   acc [head_dim][lda]   output accumulator, transposed
// Everything holds rows in lanes: the online-softmax statistics (max, sum, rescale) of
// kLanes rows are element-wise vector operations with no horizontal reductions, and K
// and V are only ever broadcast one element at a time, so they are read in place
// (any row stride) with no transposition. Both kernels keep a kCols x kRowVecs block
// of accumulators in registers; per step they load kRowVecs vectors and broadcast
// kCols scalars for kCols * kRowVecs FMAs.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace sparsa::cpu::simd {

#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
inline constexpr int kCols = 6, kRowVecs = 4;  // 24 accumulators of 32 registers
#elif defined(__AVX__)
inline constexpr int kLanes = 8;
inline constexpr int kCols = 6, kRowVecs = 2;  // 12 accumulators of 16 registers
#else
inline constexpr int kLanes = 4;
inline constexpr int kCols = 6, kRowVecs = 2;
#endif

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
// x - (+0) is x for every x (unlike x + 0, which turns -0 into +0), so this folds to a
// plain broadcast.
inline Vec splat(float x) { return x - Vec{}; }
inline Vec max(Vec a, Vec b) { return a > b ? a : b; }
// Whether any lane of a comparison result (a < b, ...) is set.
inline bool any(IVec mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask(reinterpret_cast<__m512i>(mask), reinterpret_cast<__m512i>(mask)) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(mask)) != 0;
#else
  uint64_t words[sizeof(IVec) / sizeof(uint64_t)];
  std::memcpy(words, &mask, sizeof mask);
  uint64_t set = 0;
  for (uint64_t w : words) set |= w;
  return set != 0;
#endif
}

// 2^x for x <= 0 (arguments below -126 give 2^-126, effectively 0 against any real
// term). Rounds x to the nearest integer n (1.5*2^23 trick) and evaluates 2^f,
// f in [-0.5, 0.5], by its Taylor series to degree 7: truncation error
// (0.5 ln 2)^8 / 8! < 1e-8, below f32 rounding.
inline Vec exp2_nonpositive(Vec x) {
  const Vec lo = splat(-126.0f), hi = splat(0.0f), round = splat(12582912.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const Vec n = (x + round) - round;
  const Vec f = x - n;
  Vec poly = splat(1.525273380405984e-5f);
  poly = poly * f + 1.5403530393381608e-4f;
  poly = poly * f + 0.0013333558146428443f;
  poly = poly * f + 0.009618129107628477f;
  poly = poly * f + 0.05550410866482158f;
  poly = poly * f + 0.2402265069591007f;
  poly = poly * f + 0.6931471805599453f;
  poly = poly * f + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  return std::bit_cast<Vec>(bits) * poly;
}

// st[j][r] = sum_t k[j][t] * qt[t][r] for J keys and RV * kLanes rows.
template <int J, int RV>
inline void scores_kernel(const float* qt, int64_t ldq, const float* k, int64_t ldk, int64_t head_dim, float* st) {
  Vec acc[J][RV] = {};
  for (int64_t t = 0; t < head_dim; ++t) {
    Vec q[RV];
#pragma GCC unroll 8
    for (int i = 0; i < RV; ++i) q[i] = load(qt + t * ldq + i * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const Vec kj = splat(k[j * ldk + t]);
#pragma GCC unroll 8
      for (int i = 0; i < RV; ++i) acc[j][i] += kj * q[i];
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < RV; ++i) store(st + j * ldq + i * kLanes, acc[j][i]);
}

// acc_t[c][r] = alpha[r] * acc_t[c][r] + sum_{j < keys} v[j][c] * pt[j][r] for C columns
// and RV * kLanes rows (the accumulator is transposed too: rows in lanes).
template <int C, int RV>
inline void pv_kernel(const float* pt, int64_t ldp, const float* v, int64_t ldv, int keys, const float* alpha,
                      float* acc_t, int64_t lda) {
  Vec o[C][RV];
#pragma GCC unroll 8
  for (int i = 0; i < RV; ++i) {
    const Vec a = load(alpha + i * kLanes);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) o[c][i] = load(acc_t + c * lda + i * kLanes) * a;
  }
  for (int j = 0; j < keys; ++j) {
    Vec p[RV];
#pragma GCC unroll 8
    for (int i = 0; i < RV; ++i) p[i] = load(pt + j * ldp + i * kLanes);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const Vec vc = splat(v[j * ldv + c]);
#pragma GCC unroll 8
      for (int i = 0; i < RV; ++i) o[c][i] += vc * p[i];
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int i = 0; i < RV; ++i) store(acc_t + c * lda + i * kLanes, o[c][i]);
}

// Tables of the micro-kernels' instantiations, indexed [J or C - 1][RV - 1], for tails and for callers
// whose block sizes are known only at run time (the attention mainloop, XAttention's estimator).
using ScoresFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);
using PvFn = void (*)(const float*, int64_t, const float*, int64_t, int, const float*, float*, int64_t);

template <int J, int... I>
constexpr std::array<ScoresFn, sizeof...(I)> scores_row(std::integer_sequence<int, I...>) {
  return {&simd::scores_kernel<J, I + 1>...};
}
template <int... J>
constexpr auto scores_table(std::integer_sequence<int, J...>) {
  return std::array{scores_row<J + 1>(std::make_integer_sequence<int, simd::kRowVecs>())...};
}
inline constexpr auto kScoresKernels = scores_table(std::make_integer_sequence<int, simd::kCols>());

template <int C, int... I>
constexpr std::array<PvFn, sizeof...(I)> pv_row(std::integer_sequence<int, I...>) {
  return {&simd::pv_kernel<C, I + 1>...};
}
template <int... C>
constexpr auto pv_table(std::integer_sequence<int, C...>) {
  return std::array{pv_row<C + 1>(std::make_integer_sequence<int, simd::kRowVecs>())...};
}
inline constexpr auto kPvKernels = pv_table(std::make_integer_sequence<int, simd::kCols>());

}  // namespace sparsa::cpu::simd
