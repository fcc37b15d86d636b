// Dense attention backward (see dense_backward.h). Per (batch, head): for each chunk of
// 64 keys, walk every tile of 64 queries and
//   P  = exp(scale * Q K^T - lse)         dP = dO V^T         dS = P (dP - rowsum(dO * O))
//   dV += P^T dO     dK += scale dS^T Q   dQ += scale dS K
// with 64-wide inner loops over the key chunk (vectorised with -march=native).
#include "dense_backward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"

namespace sparsa::bench {

namespace {

constexpr int kTile = 64;
constexpr float kLog2e = 1.4426950408889634f;

// 2^x for x <= 0, branch-free (vectorises): nearest integer n plus a degree-7 Taylor
// series of 2^f, |f| <= 1/2 (error below f32 rounding); the library's dense path uses
// the same construction.
inline float exp2_nonpositive(float x) {
  x = std::clamp(x, -126.0f, 0.0f);
  constexpr float kRound = 12582912.0f;
  const float n = (x + kRound) - kRound;
  const float f = x - n;
  constexpr float c1 = 0.6931471805599453f, c2 = 0.2402265069591007f, c3 = 0.05550410866482158f,
                  c4 = 0.009618129107628477f, c5 = 0.0013333558146428443f, c6 = 1.5403530393381608e-4f,
                  c7 = 1.525273380405984e-5f;
  const float poly = 1.0f + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * (c6 + f * c7))))));
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale * poly;
}

// s[r, j] = sum_t x[r, t] * cols[t, j], rows < R, j < kTile; cols is [d, kTile].
void tile_scores(const float* x, int R, int64_t d, const float* cols, float* s) {
  int r = 0;
  for (; r + 4 <= R; r += 4) {
    float a0[kTile] = {}, a1[kTile] = {}, a2[kTile] = {}, a3[kTile] = {};
    const float *x0 = x + r * d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
    for (int64_t t = 0; t < d; ++t) {
      const float* c = cols + t * kTile;
      for (int j = 0; j < kTile; ++j) {
        a0[j] += x0[t] * c[j];
        a1[j] += x1[t] * c[j];
        a2[j] += x2[t] * c[j];
        a3[j] += x3[t] * c[j];
      }
    }
    std::memcpy(s + (r + 0) * kTile, a0, sizeof a0);
    std::memcpy(s + (r + 1) * kTile, a1, sizeof a1);
    std::memcpy(s + (r + 2) * kTile, a2, sizeof a2);
    std::memcpy(s + (r + 3) * kTile, a3, sizeof a3);
  }
  for (; r < R; ++r) {
    float a[kTile] = {};
    for (int64_t t = 0; t < d; ++t)
      for (int j = 0; j < kTile; ++j) a[j] += x[r * d + t] * cols[t * kTile + j];
    std::memcpy(s + r * kTile, a, sizeof a);
  }
}

// acc[i, :] += sum_{r < n_in} w[i, r] * x[r, :] for i < rows_out (w has leading dimension
// ldw): four output rows and 32 columns at a time stay in registers.
void accumulate_rows(const float* w, int64_t ldw, int rows_out, int n_in, const float* x, int64_t d, float* acc) {
  constexpr int kChunk = 32;
  int64_t c0 = 0;
  for (; c0 + kChunk <= d; c0 += kChunk) {
    int i = 0;
    for (; i + 4 <= rows_out; i += 4) {
      float o[4][kChunk];
      for (int a = 0; a < 4; ++a) std::memcpy(o[a], acc + (i + a) * d + c0, sizeof o[a]);
      for (int r = 0; r < n_in; ++r) {
        const float* xr = x + r * d + c0;
        const float w0 = w[(i + 0) * ldw + r], w1 = w[(i + 1) * ldw + r], w2 = w[(i + 2) * ldw + r],
                    w3 = w[(i + 3) * ldw + r];
        for (int c = 0; c < kChunk; ++c) {
          o[0][c] += w0 * xr[c];
          o[1][c] += w1 * xr[c];
          o[2][c] += w2 * xr[c];
          o[3][c] += w3 * xr[c];
        }
      }
      for (int a = 0; a < 4; ++a) std::memcpy(acc + (i + a) * d + c0, o[a], sizeof o[a]);
    }
    for (; i < rows_out; ++i)
      for (int r = 0; r < n_in; ++r)
        for (int c = 0; c < kChunk; ++c) acc[i * d + c0 + c] += w[i * ldw + r] * x[r * d + c0 + c];
  }
  for (int i = 0; i < rows_out; ++i)
    for (int r = 0; r < n_in; ++r)
      for (int64_t c = c0; c < d; ++c) acc[i * d + c] += w[i * ldw + r] * x[r * d + c];
}

}  // namespace

void dense_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                    const float* d_o, float* dq, float* dk, float* dv, int64_t batch, int64_t heads, int64_t n,
                    int64_t d, float scale, int num_threads) {
  cpu::parallel_for(batch * heads, num_threads, [&](int64_t item, int) {
    const float* Q = q + item * n * d;
    const float* K = k + item * n * d;
    const float* V = v + item * n * d;
    const float* O = out + item * n * d;
    const float* dO = d_o + item * n * d;
    const float* LSE = lse + item * n;
    float* dQ = dq + item * n * d;
    float* dK = dk + item * n * d;
    float* dV = dv + item * n * d;
    std::vector<float> delta(n), kt(d * kTile), vt(d * kTile), p(kTile * kTile), ds(kTile * kTile),
        pt(kTile * kTile), dst(kTile * kTile);
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.0f;
      for (int64_t t = 0; t < d; ++t) s += dO[i * d + t] * O[i * d + t];
      delta[i] = s;
    }
    std::fill(dQ, dQ + n * d, 0.0f);
    for (int64_t k0 = 0; k0 < n; k0 += kTile) {
      const int keys = static_cast<int>(std::min<int64_t>(kTile, n - k0));
      std::fill(kt.begin(), kt.end(), 0.0f);
      std::fill(vt.begin(), vt.end(), 0.0f);
      for (int j = 0; j < keys; ++j)
        for (int64_t t = 0; t < d; ++t) {
          kt[t * kTile + j] = K[(k0 + j) * d + t];
          vt[t * kTile + j] = V[(k0 + j) * d + t];
        }
      float* dk_c = dK + k0 * d;
      float* dv_c = dV + k0 * d;
      std::fill(dk_c, dk_c + keys * d, 0.0f);
      std::fill(dv_c, dv_c + keys * d, 0.0f);
      for (int64_t q0 = 0; q0 < n; q0 += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, n - q0));
        tile_scores(Q + q0 * d, rows, d, kt.data(), p.data());
        tile_scores(dO + q0 * d, rows, d, vt.data(), ds.data());
        for (int r = 0; r < rows; ++r) {
          const float l2 = LSE[q0 + r] * kLog2e, dl = delta[q0 + r], s2 = scale * kLog2e;
          for (int j = 0; j < kTile; ++j) {
            const float e = j < keys ? exp2_nonpositive(s2 * p[r * kTile + j] - l2) : 0.0f;
            p[r * kTile + j] = e;
            ds[r * kTile + j] = e * (ds[r * kTile + j] - dl);
          }
        }
        // P^T and scale * dS^T ([key, row]) for dV and dK; scale * dS for dQ.
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < kTile; ++j) {
            ds[r * kTile + j] *= scale;
            pt[j * kTile + r] = p[r * kTile + j];
            dst[j * kTile + r] = ds[r * kTile + j];
          }
        accumulate_rows(pt.data(), kTile, keys, rows, dO + q0 * d, d, dv_c);
        accumulate_rows(dst.data(), kTile, keys, rows, Q + q0 * d, d, dk_c);
        accumulate_rows(ds.data(), kTile, rows, keys, K + k0 * d, d, dQ + q0 * d);
      }
    }
  });
}

}  // namespace sparsa::bench
