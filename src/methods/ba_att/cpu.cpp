// cpu BA-Att scoring: the fast path of steps 2-3, judged against cpu_ref.
//
// Every variant of the compensated logit is one inner product of a query-block feature
// vector with a key-block feature vector (c = beta * scale^2):
//   none:     a = [scale*Qbar]                                  b = [Kbar]
//   diagonal: a = [scale*Qbar, c*VarQ, c*Qbar^2]                b = [Kbar, Kbar^2 + VarK, VarK]   (Eq. 14)
//   trace:    a = [scale*Qbar, c*vec SigmaQ]                    b = [Kbar, vec SigmaK]           (Eq. 13)
//   exact:    a = [scale*Qbar, c*vec SigmaQ, c*vec(Qbar Qbar')] b = [Kbar, vec(SigmaK + Kbar Kbar'), vec SigmaK]
// (tr(A B) = <A, B>_F for symmetric B; x' S x = <S, x x'>_F.) Block statistics are
// accumulated in f64 (two passes), features stored in f32, and the logits are one
// f32 matrix product [Nq, F] x [F, Nk] per head, threaded over (batch, head, query block).
#include <algorithm>
#include <vector>

#include "core/attention_params.h"
#include "cpu/parallel.h"
#include "methods/ba_att/ba_att_impl.h"

namespace sparsa::ba_att_cpu {

using detail::BaAttParams;

namespace {

int64_t feature_size(const BaAttParams& p) {
  const int64_t d = p.head_dim;
  if (!p.compensate) return d;
  switch (p.compensation) {
    case Compensation::diagonal: return 3 * d;
    case Compensation::trace: return d + d * d;
    case Compensation::exact: return d + 2 * d * d;
  }
  return d;
}

// Mean, variance and (if need_cov) covariance of the permuted tokens [begin, end).
template <class TokenOf>
void block_moments(const Tensor& x, int64_t b, int64_t h, int64_t begin, int64_t end, int64_t d, bool need_cov,
                   TokenOf token, std::vector<float>& rows, std::vector<double>& mean, std::vector<double>& var,
                   std::vector<double>& cov) {
  const int64_t n = end - begin;
  rows.resize(n * d);
  for (int64_t p = begin; p < end; ++p) {
    detail::load_row(x.data, x.dtype, x.offset({b, h, token(p), 0}), d, rows.data() + (p - begin) * d);
  }
  mean.assign(d, 0.0);
  var.assign(d, 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t t = 0; t < d; ++t) mean[t] += rows[r * d + t];
  for (int64_t t = 0; t < d; ++t) mean[t] /= static_cast<double>(n);
  std::vector<double> dev(d);
  if (need_cov) cov.assign(d * d, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t t = 0; t < d; ++t) {
      dev[t] = rows[r * d + t] - mean[t];
      var[t] += dev[t] * dev[t];
    }
    if (need_cov) {
      for (int64_t i = 0; i < d; ++i) {
        const double di = dev[i];
        double* c = cov.data() + i * d;
        for (int64_t j = 0; j < d; ++j) c[j] += di * dev[j];
      }
    }
  }
  for (double& v : var) v /= static_cast<double>(n);
  if (need_cov)
    for (double& c : cov) c /= static_cast<double>(n);
}

}  // namespace

Status scores(const BaAttParams& p) {
  const int64_t d = p.head_dim, F = feature_size(p);
  const int64_t nq = p.num_q_blocks, nk = p.num_kv_blocks;
  const bool need_cov = p.compensate && p.compensation != Compensation::diagonal;
  const double c = static_cast<double>(p.beta) * p.scale * p.scale;
  const int threads = cpu::resolve_threads(p.num_threads);

  // Key-block features, transposed: [batch, heads_kv, F, nk].
  std::vector<float> key_features(static_cast<size_t>(p.batch * p.heads_kv * F * nk));
  cpu::parallel_for(p.batch * p.heads_kv * nk, threads, [&](int64_t item, int) {
    const int64_t kb = item % nk, h_kv = (item / nk) % p.heads_kv, b = item / (nk * p.heads_kv);
    std::vector<float> rows;
    std::vector<double> mean, var, cov;
    const int64_t begin = kb * p.block_kv, end = std::min<int64_t>(begin + p.block_kv, p.len_kv);
    block_moments(p.k, b, h_kv, begin, end, d, need_cov, [&](int64_t pos) { return p.token_kv(b, h_kv, pos); }, rows,
                  mean, var, cov);
    float* f = key_features.data() + (b * p.heads_kv + h_kv) * F * nk;
    auto put = [&](int64_t feature, double x) { f[feature * nk + kb] = static_cast<float>(x); };
    for (int64_t t = 0; t < d; ++t) put(t, mean[t]);
    if (!p.compensate) return;
    switch (p.compensation) {
      case Compensation::diagonal:
        for (int64_t t = 0; t < d; ++t) {
          put(d + t, mean[t] * mean[t] + var[t]);
          put(2 * d + t, var[t]);
        }
        break;
      case Compensation::trace:
        for (int64_t e = 0; e < d * d; ++e) put(d + e, cov[e]);
        break;
      case Compensation::exact:
        for (int64_t i = 0; i < d; ++i)
          for (int64_t j = 0; j < d; ++j) {
            put(d + i * d + j, cov[i * d + j] + mean[i] * mean[j]);
            put(d + d * d + i * d + j, cov[i * d + j]);
          }
        break;
    }
  });

  // Query blocks: features, then one row of logits.
  cpu::parallel_for(p.batch * p.heads_q * nq, threads, [&](int64_t item, int) {
    const int64_t qb = item % nq, h = (item / nq) % p.heads_q, b = item / (nq * p.heads_q);
    const int64_t h_kv = h / p.group();
    std::vector<float> rows;
    std::vector<double> mean, var, cov;
    const int64_t begin = qb * p.block_q, end = std::min<int64_t>(begin + p.block_q, p.len_q);
    block_moments(p.q, b, h, begin, end, d, need_cov, [&](int64_t pos) { return p.token_q(b, h, pos); }, rows, mean,
                  var, cov);
    std::vector<float> a(F);
    for (int64_t t = 0; t < d; ++t) a[t] = static_cast<float>(p.scale * mean[t]);
    if (p.compensate) {
      switch (p.compensation) {
        case Compensation::diagonal:
          for (int64_t t = 0; t < d; ++t) {
            a[d + t] = static_cast<float>(c * var[t]);
            a[2 * d + t] = static_cast<float>(c * mean[t] * mean[t]);
          }
          break;
        case Compensation::trace:
          for (int64_t e = 0; e < d * d; ++e) a[d + e] = static_cast<float>(c * cov[e]);
          break;
        case Compensation::exact:
          for (int64_t i = 0; i < d; ++i)
            for (int64_t j = 0; j < d; ++j) {
              a[d + i * d + j] = static_cast<float>(c * cov[i * d + j]);
              a[d + d * d + i * d + j] = static_cast<float>(c * mean[i] * mean[j]);
            }
          break;
      }
    }
    const float* kf = key_features.data() + (b * p.heads_kv + h_kv) * F * nk;
    float* out = p.logits_row(b, h, qb);
    std::fill(out, out + nk, 0.0f);
    for (int64_t f = 0; f < F; ++f) {  // rank-1 updates: the inner loop over key blocks vectorises
      const float af = a[f];
      if (af == 0.0f) continue;
      const float* kr = kf + f * nk;
      for (int64_t kb = 0; kb < nk; ++kb) out[kb] += af * kr[kb];
    }
  });
  return {};
}

}  // namespace sparsa::ba_att_cpu
