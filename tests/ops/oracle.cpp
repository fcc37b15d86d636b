// The harness's own oracles: f64, plain loops, written from the definitions in
// docs/architecture.md (Contracts) and nothing else (they share no code with src/cpu/ref).
#include <cmath>
#include <limits>

#include "harness.h"

namespace ops {

// For each query row (b, h, i) with visible keys J = {j : mask[b, h, i, j]}:
//   s_j = scale * sum_t q[b,h,i,t] * k[b,h/g,j,t]
//   LSE = log sum_{j in J} exp(s_j)        (-inf for an empty J)
//   O   = sum_{j in J} exp(s_j - LSE) v_j  (0 for an empty J)
// q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; mask: [B, Hq, Lq, Lk] or empty (all visible).
Results oracle_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                         const std::vector<uint8_t>& mask) {
  const int64_t B = q.shape[0], Hq = q.shape[1], Lq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Lk = k.shape[2], group = Hq / Hkv;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  Results r;
  r.o.assign(static_cast<size_t>(B * Hq * Lq * D), 0.0);
  r.lse.assign(static_cast<size_t>(B * Hq * Lq), neg_inf);
  std::vector<double> s(static_cast<size_t>(Lk));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t row = (b * Hq + h) * Lq + i;
        const uint8_t* visible = mask.empty() ? nullptr : mask.data() + row * Lk;
        double max_s = neg_inf;
        for (int64_t j = 0; j < Lk; ++j) {
          if (visible && !visible[j]) continue;
          double dot = 0;
          for (int64_t t = 0; t < D; ++t) {
            dot += decode(q.data, q.dtype, q.offset({b, h, i, t})) * decode(k.data, k.dtype, k.offset({b, hk, j, t}));
          }
          s[j] = scale * dot;
          max_s = std::max(max_s, s[j]);
        }
        if (max_s == neg_inf) continue;  // no visible key: O = 0, LSE = -inf
        double sum = 0;
        for (int64_t j = 0; j < Lk; ++j) {
          if (!visible || visible[j]) sum += std::exp(s[j] - max_s);
        }
        const double lse = max_s + std::log(sum);
        r.lse[row] = lse;
        double* o = r.o.data() + row * D;
        for (int64_t j = 0; j < Lk; ++j) {
          if (visible && !visible[j]) continue;
          const double p = std::exp(s[j] - lse);
          for (int64_t t = 0; t < D; ++t) o[t] += p * decode(v.data, v.dtype, v.offset({b, hk, j, t}));
        }
      }
    }
  }
  return r;
}

// m = max(L1, L2); w1 = exp(L1 - m); w2 = exp(L2 - m)
// O = (w1 O1 + w2 O2) / (w1 + w2); L = m + log(w1 + w2); both -inf: O = 0, L = -inf.
Results oracle_merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2) {
  const int64_t B = o1.shape[0], H = o1.shape[1], L = o1.shape[2], D = o1.shape[3];
  const double neg_inf = -std::numeric_limits<double>::infinity();
  Results r;
  r.o.assign(static_cast<size_t>(B * H * L * D), 0.0);
  r.lse.assign(static_cast<size_t>(B * H * L), neg_inf);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        const int64_t row = (b * H + h) * L + i;
        const double l1 = decode(lse1.data, DType::f32, lse1.offset({b, h, i}));
        const double l2 = decode(lse2.data, DType::f32, lse2.offset({b, h, i}));
        const double m = std::max(l1, l2);
        if (m == neg_inf) continue;
        const double w1 = std::exp(l1 - m), w2 = std::exp(l2 - m);
        r.lse[row] = m + std::log(w1 + w2);
        for (int64_t t = 0; t < D; ++t) {
          const double a = decode(o1.data, o1.dtype, o1.offset({b, h, i, t}));
          const double c = decode(o2.data, o2.dtype, o2.offset({b, h, i, t}));
          // A side with weight 0 contributes nothing (not 0 * its value).
          r.o[row * D + t] = ((w1 > 0 ? w1 * a : 0.0) + (w2 > 0 ? w2 * c : 0.0)) / (w1 + w2);
        }
      }
    }
  }
  return r;
}

}  // namespace ops
