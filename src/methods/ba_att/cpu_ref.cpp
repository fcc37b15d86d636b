// cpu_ref BA-Att scoring: the specification of steps 2-3 of Algorithm 1.
//
// For each query block I (permuted positions [qb*Bq, min((qb+1)*Bq, Lq))) and key block J:
//   Qbar = mean_{i in I} Q_i, VarQ_t = mean_{i in I} (Q_it - Qbar_t)^2,
//   SigmaQ = mean_{i in I} (Q_i - Qbar)(Q_i - Qbar)'   (population statistics; same for K)
//   l      = scale * Qbar . Kbar                                              (Eq. 2)
//   Delta  = scale^2 * sum_t (VarQ_t Kbar_t^2 + VarK_t Qbar_t^2 + VarQ_t VarK_t)  (Eq. 14, diagonal)
//          | scale^2 * (Kbar' SigmaQ Kbar + Qbar' SigmaK Qbar + tr(SigmaQ SigmaK))  (exact)
//          | scale^2 * tr(SigmaQ SigmaK)                                      (Eq. 13, trace)
//   l'     = l + beta * Delta  (l when compensation is off)
// Plain loops, f64 throughout, f32 only when the logit is stored.
#include <vector>

#include "core/attention_params.h"
#include "methods/ba_att/ba_att_impl.h"

namespace sparsa::ba_att_cpu_ref {

using detail::BaAttParams;

namespace {

struct BlockStats {
  std::vector<double> mean;  // [d]
  std::vector<double> var;   // [d]
  std::vector<double> cov;   // [d, d] (only for exact / trace)
};

// Statistics of the tokens at permuted positions [begin, end) of one (batch, head) of x.
// token(p) maps a permuted position to the original token.
template <class TokenOf>
BlockStats block_stats(const Tensor& x, int64_t b, int64_t h, int64_t begin, int64_t end, int64_t d, bool need_cov,
                       TokenOf token) {
  BlockStats s;
  s.mean.assign(d, 0.0);
  s.var.assign(d, 0.0);
  if (need_cov) s.cov.assign(d * d, 0.0);
  const double n = static_cast<double>(end - begin);
  std::vector<double> row(d);
  for (int64_t p = begin; p < end; ++p) {
    for (int64_t t = 0; t < d; ++t) s.mean[t] += detail::load_element(x.data, x.dtype, x.offset({b, h, token(p), t}));
  }
  for (int64_t t = 0; t < d; ++t) s.mean[t] /= n;
  for (int64_t p = begin; p < end; ++p) {
    for (int64_t t = 0; t < d; ++t) {
      row[t] = detail::load_element(x.data, x.dtype, x.offset({b, h, token(p), t})) - s.mean[t];
    }
    for (int64_t t = 0; t < d; ++t) s.var[t] += row[t] * row[t];
    if (need_cov) {
      for (int64_t r = 0; r < d; ++r)
        for (int64_t c = 0; c < d; ++c) s.cov[r * d + c] += row[r] * row[c];
    }
  }
  for (double& x2 : s.var) x2 /= n;
  for (double& c : s.cov) c /= n;
  return s;
}

double compensation(const BaAttParams& p, const BlockStats& qs, const BlockStats& ks) {
  const int64_t d = p.head_dim;
  const double scale2 = static_cast<double>(p.scale) * p.scale;
  double delta = 0.0;
  switch (p.compensation) {
    case Compensation::diagonal:
      for (int64_t t = 0; t < d; ++t) {
        delta += qs.var[t] * ks.mean[t] * ks.mean[t] + ks.var[t] * qs.mean[t] * qs.mean[t] + qs.var[t] * ks.var[t];
      }
      break;
    case Compensation::exact:
      for (int64_t r = 0; r < d; ++r) {
        for (int64_t c = 0; c < d; ++c) {
          delta += ks.mean[r] * qs.cov[r * d + c] * ks.mean[c] + qs.mean[r] * ks.cov[r * d + c] * qs.mean[c] +
                   qs.cov[r * d + c] * ks.cov[c * d + r];
        }
      }
      break;
    case Compensation::trace:
      for (int64_t r = 0; r < d; ++r)
        for (int64_t c = 0; c < d; ++c) delta += qs.cov[r * d + c] * ks.cov[c * d + r];
      break;
  }
  return scale2 * delta;
}

}  // namespace

Status scores(const BaAttParams& p) {
  const int64_t d = p.head_dim;
  const bool need_cov = p.compensate && p.compensation != Compensation::diagonal;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h_kv = 0; h_kv < p.heads_kv; ++h_kv) {
      std::vector<BlockStats> key_blocks;  // [num_kv_blocks]
      for (int64_t kb = 0; kb < p.num_kv_blocks; ++kb) {
        const int64_t begin = kb * p.block_kv, end = std::min<int64_t>(begin + p.block_kv, p.len_kv);
        key_blocks.push_back(block_stats(p.k, b, h_kv, begin, end, d, need_cov,
                                         [&](int64_t pos) { return p.token_kv(b, h_kv, pos); }));
      }
      for (int64_t h = h_kv * p.group(); h < (h_kv + 1) * p.group(); ++h) {
        for (int64_t qb = 0; qb < p.num_q_blocks; ++qb) {
          const int64_t begin = qb * p.block_q, end = std::min<int64_t>(begin + p.block_q, p.len_q);
          const BlockStats qs =
              block_stats(p.q, b, h, begin, end, d, need_cov, [&](int64_t pos) { return p.token_q(b, h, pos); });
          float* row = p.logits_row(b, h, qb);
          for (int64_t kb = 0; kb < p.num_kv_blocks; ++kb) {
            const BlockStats& ks = key_blocks[kb];
            double logit = 0.0;
            for (int64_t t = 0; t < d; ++t) logit += qs.mean[t] * ks.mean[t];
            logit *= p.scale;
            if (p.compensate) logit += static_cast<double>(p.beta) * compensation(p, qs, ks);
            row[kb] = static_cast<float>(logit);
          }
        }
      }
    }
  }
  return {};
}

}  // namespace sparsa::ba_att_cpu_ref
