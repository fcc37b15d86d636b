// Oracle block mass (Eq. 3) and the selector metrics.
//
// cpu_ref: per query row, every logit in f64, the exact log-sum-exp, then
//   mass[qb(i), kb(j)] += exp(s_ij - lse_i) / |I(qb)|
// where qb(i) / kb(j) are the blocks of the permuted positions of tokens i and j.
// cpu: the same sums with tiles of up to 64 query rows (one query block at a time) and
// chunks of 64 keys, f32 logits, two passes over the keys (log-sum-exp, then masses),
// threads over (batch, head, query block).
#include "sparsa/oracle.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/attention_params.h"
#include "core/validate.h"
#include "cpu/parallel.h"

namespace sparsa {

BlockPartition partition_of(const BlockIndex& plan) {
  BlockPartition p;
  p.block_q = plan.block_q;
  p.block_kv = plan.block_kv;
  p.perm_q = plan.perm_q;
  p.perm_kv = plan.perm_kv;
  return p;
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Status check_perm(const char* name, const Tensor& perm, int64_t batch, int64_t heads, int64_t len) {
  if (!perm.defined()) return {};
  SPARSA_RETURN_IF_ERROR(detail::check_shape(name, perm, {batch, heads, len}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype(name, perm, DType::i32));
  std::vector<char> seen(len);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t p = 0; p < len; ++p) {
        const int32_t t = perm.ptr<const int32_t>()[perm.offset({b, h, p})];
        if (t < 0 || t >= len || seen[t]) {
          return invalid_argument(std::string(name) + ": row [" + std::to_string(b) + ", " + std::to_string(h) +
                                  "] is not a permutation of 0.." + std::to_string(len - 1) + " (entry " +
                                  std::to_string(p) + " is " + std::to_string(t) + ")");
        }
        seen[t] = 1;
      }
    }
  }
  return {};
}

struct Problem {
  Tensor q, k;
  int64_t batch, heads_q, heads_kv, len_q, len_kv, d;
  int block_q, block_kv;
  int64_t nq, nk;
  float scale;
  int num_threads;
  std::vector<int32_t> block_of_q;  // [batch, heads_q, len_q]: query block of original token i
  std::vector<int32_t> block_of_k;  // [batch, heads_kv, len_kv]
  std::vector<int32_t> rows_of_q;   // [batch, heads_q, len_q]: original tokens in permuted order
  int64_t group() const { return heads_q / heads_kv; }
  int64_t block_rows(int64_t qb) const { return std::min<int64_t>(block_q, len_q - qb * block_q); }
};

Status make_problem(const Tensor& q, const Tensor& k, const BlockPartition& part, const OracleOptions& o,
                    Problem* p) {
  const Device host{};
  SPARSA_RETURN_IF_ERROR(detail::check_query_key(q, k, host));
  if (part.block_q <= 0) return invalid_argument("partition.block_q: expected > 0, got " + std::to_string(part.block_q));
  if (part.block_kv <= 0) {
    return invalid_argument("partition.block_kv: expected > 0, got " + std::to_string(part.block_kv));
  }
  if (o.backend != Backend::cpu && o.backend != Backend::cpu_ref) {
    return {StatusCode::unsupported, std::string("backend: the oracle runs on cpu or cpu_ref, got ") +
                                         backend_name(o.backend)};
  }
  if (o.num_threads < 0 || o.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(o.num_threads));
  }
  p->q = q;
  p->k = k;
  p->batch = q.shape[0];
  p->heads_q = q.shape[1];
  p->len_q = q.shape[2];
  p->d = q.shape[3];
  p->heads_kv = k.shape[1];
  p->len_kv = k.shape[2];
  SPARSA_RETURN_IF_ERROR(check_perm("partition.perm_q", part.perm_q, p->batch, p->heads_q, p->len_q));
  SPARSA_RETURN_IF_ERROR(check_perm("partition.perm_kv", part.perm_kv, p->batch, p->heads_kv, p->len_kv));
  p->block_q = part.block_q;
  p->block_kv = part.block_kv;
  p->nq = ceil_div(p->len_q, part.block_q);
  p->nk = ceil_div(p->len_kv, part.block_kv);
  p->scale = o.scale.value_or(1.0f / std::sqrt(static_cast<float>(p->d)));
  if (!std::isfinite(p->scale) || p->scale <= 0) return invalid_argument("scale: expected a finite positive number");
  p->num_threads = o.backend == Backend::cpu_ref ? 1 : o.num_threads;
  p->block_of_q.resize(p->batch * p->heads_q * p->len_q);
  p->rows_of_q.resize(p->block_of_q.size());
  for (int64_t b = 0; b < p->batch; ++b)
    for (int64_t h = 0; h < p->heads_q; ++h)
      for (int64_t pos = 0; pos < p->len_q; ++pos) {
        const int64_t tok = part.perm_q.defined() ? part.perm_q.ptr<const int32_t>()[part.perm_q.offset({b, h, pos})] : pos;
        const int64_t base = (b * p->heads_q + h) * p->len_q;
        p->block_of_q[base + tok] = static_cast<int32_t>(pos / part.block_q);
        p->rows_of_q[base + pos] = static_cast<int32_t>(tok);
      }
  p->block_of_k.resize(p->batch * p->heads_kv * p->len_kv);
  for (int64_t b = 0; b < p->batch; ++b)
    for (int64_t h = 0; h < p->heads_kv; ++h)
      for (int64_t pos = 0; pos < p->len_kv; ++pos) {
        const int64_t tok =
            part.perm_kv.defined() ? part.perm_kv.ptr<const int32_t>()[part.perm_kv.offset({b, h, pos})] : pos;
        p->block_of_k[(b * p->heads_kv + h) * p->len_kv + tok] = static_cast<int32_t>(pos / part.block_kv);
      }
  return {};
}

OracleBlocks allocate(const Problem& p) {
  OracleBlocks o;
  o.block_q = p.block_q;
  o.block_kv = p.block_kv;
  o.num_q_blocks = p.nq;
  o.num_kv_blocks = p.nk;
  o.mass = HostArray(DType::f32, {p.batch, p.heads_q, p.nq, p.nk});
  o.logit_max = HostArray(DType::f32, {p.batch, p.heads_q, p.nq, p.nk});
  o.logit_min = HostArray(DType::f32, {p.batch, p.heads_q, p.nq, p.nk});
  return o;
}

// The specification.
void oracle_ref(const Problem& p, OracleBlocks& o) {
  const int64_t d = p.d, nk = p.nk;
  std::vector<double> mass(p.nq * nk), lmax(p.nq * nk), lmin(p.nq * nk), qrow(d), logits(p.len_kv);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t h_kv = h / p.group();
      std::fill(mass.begin(), mass.end(), 0.0);
      std::fill(lmax.begin(), lmax.end(), -std::numeric_limits<double>::infinity());
      std::fill(lmin.begin(), lmin.end(), std::numeric_limits<double>::infinity());
      for (int64_t i = 0; i < p.len_q; ++i) {
        for (int64_t t = 0; t < d; ++t) qrow[t] = detail::load_element(p.q.data, p.q.dtype, p.q.offset({b, h, i, t}));
        double max_logit = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < p.len_kv; ++j) {
          double dot = 0.0;
          for (int64_t t = 0; t < d; ++t) dot += qrow[t] * detail::load_element(p.k.data, p.k.dtype, p.k.offset({b, h_kv, j, t}));
          logits[j] = p.scale * dot;
          max_logit = std::max(max_logit, logits[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < p.len_kv; ++j) sum += std::exp(logits[j] - max_logit);
        const double lse = max_logit + std::log(sum);
        const int64_t qb = p.block_of_q[(b * p.heads_q + h) * p.len_q + i];
        for (int64_t j = 0; j < p.len_kv; ++j) {
          const int64_t cell = qb * nk + p.block_of_k[(b * p.heads_kv + h_kv) * p.len_kv + j];
          mass[cell] += std::exp(logits[j] - lse) / static_cast<double>(p.block_rows(qb));
          lmax[cell] = std::max(lmax[cell], logits[j]);
          lmin[cell] = std::min(lmin[cell], logits[j]);
        }
      }
      const int64_t base = (b * p.heads_q + h) * p.nq * nk;
      for (int64_t c = 0; c < p.nq * nk; ++c) {
        o.mass.ptr<float>()[base + c] = static_cast<float>(mass[c]);
        o.logit_max.ptr<float>()[base + c] = static_cast<float>(lmax[c]);
        o.logit_min.ptr<float>()[base + c] = static_cast<float>(lmin[c]);
      }
    }
  }
}

constexpr int kRows = 64;  // query rows per tile
constexpr int kKeys = 64;  // keys per chunk
constexpr float kLog2e = 1.4426950408889634f;

// 2^x for x <= 0 (below -126 gives 0): round to n, 2^f on [-0.5, 0.5] by a degree-7 Taylor
// polynomial (truncation < 1e-8, under f32 rounding), scaled by 2^n through the exponent bits.
inline float exp2_neg(float x) {
  x = std::clamp(x, -126.0f, 0.0f);
  const float n = (x + 12582912.0f) - 12582912.0f;
  const float f = x - n;
  const float poly =
      1.0f + f * (0.6931471805599453f +
                  f * (0.2402265069591007f +
                       f * (0.05550410866482158f +
                            f * (0.009618129107628477f +
                                 f * (0.0013333558146428443f + f * (1.5403530393381608e-4f + f * 1.525273380405984e-5f))))));
  return std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23) * poly;
}

// s[r, j] = q[r, :] . kt[:, j] for rows r < rows (base-2 logits when q is pre-scaled).
void tile_scores(const float* q, const float* kt, float* s, int rows, int64_t d) {
  for (int r = 0; r < rows; ++r) {
    float acc[kKeys] = {};
    const float* qr = q + r * d;
    for (int64_t t = 0; t < d; ++t) {
      const float x = qr[t];
      const float* kr = kt + t * kKeys;
      for (int j = 0; j < kKeys; ++j) acc[j] += x * kr[j];
    }
    std::memcpy(s + r * kKeys, acc, sizeof acc);
  }
}

void oracle_fast(const Problem& p, OracleBlocks& o) {
  const int64_t d = p.d, nk = p.nk;
  const float qscale = p.scale * kLog2e;
  cpu::parallel_for(p.batch * p.heads_q * p.nq, p.num_threads, [&](int64_t item, int) {
    const int64_t qb = item % p.nq, h = (item / p.nq) % p.heads_q, b = item / (p.nq * p.heads_q);
    const int64_t h_kv = h / p.group();
    const int32_t* kblock = p.block_of_k.data() + (b * p.heads_kv + h_kv) * p.len_kv;
    const int32_t* rows_of = p.rows_of_q.data() + (b * p.heads_q + h) * p.len_q;
    std::vector<double> mass(nk, 0.0);
    std::vector<float> lmax(nk, -std::numeric_limits<float>::infinity()), lmin(nk, std::numeric_limits<float>::infinity());
    std::vector<float> q(kRows * d), kt(d * kKeys), s(kRows * kKeys), row(d);
    float m[kRows], l[kRows];
    const int64_t begin = qb * p.block_q, end = begin + p.block_rows(qb);
    for (int64_t t0 = begin; t0 < end; t0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, end - t0));
      for (int r = 0; r < rows; ++r) {
        detail::load_row(p.q.data, p.q.dtype, p.q.offset({b, h, rows_of[t0 + r], 0}), d, q.data() + r * d);
        for (int64_t t = 0; t < d; ++t) q[r * d + t] *= qscale;
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
      }
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j0 = 0; j0 < p.len_kv; j0 += kKeys) {
          const int keys = static_cast<int>(std::min<int64_t>(kKeys, p.len_kv - j0));
          for (int j = 0; j < keys; ++j) {
            detail::load_row(p.k.data, p.k.dtype, p.k.offset({b, h_kv, j0 + j, 0}), d, row.data());
            for (int64_t t = 0; t < d; ++t) kt[t * kKeys + j] = row[t];
          }
          for (int j = keys; j < kKeys; ++j)
            for (int64_t t = 0; t < d; ++t) kt[t * kKeys + j] = 0.0f;
          tile_scores(q.data(), kt.data(), s.data(), rows, d);
          if (pass == 0) {  // online log-sum-exp in base 2
            for (int r = 0; r < rows; ++r) {
              const float* sr = s.data() + r * kKeys;
              float cmax = -std::numeric_limits<float>::infinity();
              for (int j = 0; j < keys; ++j) cmax = std::max(cmax, sr[j]);
              const float mn = std::max(m[r], cmax);
              float sum = 0.0f;
              for (int j = 0; j < keys; ++j) sum += exp2_neg(sr[j] - mn);
              l[r] = l[r] * exp2_neg(m[r] - mn) + sum;
              m[r] = mn;
            }
            continue;
          }
          float colsum[kKeys] = {}, colmax[kKeys], colmin[kKeys];
          std::fill(colmax, colmax + kKeys, -std::numeric_limits<float>::infinity());
          std::fill(colmin, colmin + kKeys, std::numeric_limits<float>::infinity());
          for (int r = 0; r < rows; ++r) {
            const float* sr = s.data() + r * kKeys;
            const float lse2 = m[r] + std::log2(l[r]);
            for (int j = 0; j < kKeys; ++j) {
              colsum[j] += exp2_neg(sr[j] - lse2);
              colmax[j] = std::max(colmax[j], sr[j]);
              colmin[j] = std::min(colmin[j], sr[j]);
            }
          }
          for (int j = 0; j < keys; ++j) {
            const int32_t kb = kblock[j0 + j];
            mass[kb] += colsum[j];
            lmax[kb] = std::max(lmax[kb], colmax[j]);
            lmin[kb] = std::min(lmin[kb], colmin[j]);
          }
        }
      }
    }
    const int64_t base = ((b * p.heads_q + h) * p.nq + qb) * nk;
    const double inv_rows = 1.0 / static_cast<double>(end - begin);
    for (int64_t kb = 0; kb < nk; ++kb) {
      o.mass.ptr<float>()[base + kb] = static_cast<float>(mass[kb] * inv_rows);
      o.logit_max.ptr<float>()[base + kb] = lmax[kb] / kLog2e;  // back from base 2
      o.logit_min.ptr<float>()[base + kb] = lmin[kb] / kLog2e;
    }
  });
}

double sum_sq(const Tensor& t, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = load_as_double(t, i);
    s += x * x;
  }
  return s;
}

}  // namespace

Result<OracleBlocks> oracle_blocks(const Tensor& q, const Tensor& k, const BlockPartition& partition,
                                   const OracleOptions& options) {
  Problem p;
  SPARSA_RETURN_IF_ERROR(make_problem(q, k, partition, options, &p));
  OracleBlocks o = allocate(p);
  if (options.backend == Backend::cpu_ref) {
    oracle_ref(p, o);
  } else {
    oracle_fast(p, o);
  }
  return o;
}

Result<double> mass_recall(const BlockIndex& plan, const OracleBlocks& oracle) {
  if (plan.block_q != oracle.block_q || plan.block_kv != oracle.block_kv ||
      plan.num_q_blocks != oracle.num_q_blocks || plan.num_kv_blocks != oracle.num_kv_blocks) {
    return invalid_argument("plan: blocks " + std::to_string(plan.block_q) + "x" + std::to_string(plan.block_kv) + " (" +
                            std::to_string(plan.num_q_blocks) + "x" + std::to_string(plan.num_kv_blocks) +
                            ") differ from the oracle's " + std::to_string(oracle.block_q) + "x" +
                            std::to_string(oracle.block_kv) + " (" + std::to_string(oracle.num_q_blocks) + "x" +
                            std::to_string(oracle.num_kv_blocks) + "); compute the oracle on the plan's partition");
  }
  const auto& shape = oracle.mass.shape();
  if (plan.counts.ndim != 3 || plan.counts.shape[0] != shape[0] || plan.counts.shape[1] != shape[1]) {
    return invalid_argument("plan.counts: expected [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) +
                            ", " + std::to_string(shape[2]) + "], got " + plan.counts.shape_string());
  }
  const int64_t nk = oracle.num_kv_blocks;
  double total = 0;
  int64_t rows = 0;
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t qb = 0; qb < oracle.num_q_blocks; ++qb, ++rows) {
        const float* m = oracle.mass.ptr<float>() + rows * nk;
        const int32_t count = detail::index_count(plan, b, h, qb);
        if (count < 0 || count > plan.capacity()) return invalid_argument("plan.counts: out of range");
        for (int32_t s = 0; s < count; ++s) {
          const int32_t kb = detail::index_block(plan, b, h, qb, s);
          if (kb < 0 || kb >= nk) return invalid_argument("plan.indices: key block out of range");
          total += m[kb];
        }
      }
  return rows ? total / static_cast<double>(rows) : 0.0;
}

Result<double> mass_recall_from_lse(const Tensor& lse_plan, const Tensor& lse_dense) {
  if (lse_plan.dtype != DType::f32 || lse_dense.dtype != DType::f32 || lse_plan.ndim != 3 ||
      lse_plan.shape_vector() != lse_dense.shape_vector()) {
    return invalid_argument("lse_plan: expected f32 [batch, heads, len_q] equal in shape to lse_dense " +
                            lse_dense.shape_string() + ", got " + lse_plan.shape_string());
  }
  const int64_t n = lse_plan.numel();
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += std::exp(load_as_double(lse_plan, i) - load_as_double(lse_dense, i));
  return n ? total / static_cast<double>(n) : 0.0;
}

Result<double> relative_error(const Tensor& out, const Tensor& reference) {
  if (out.shape_vector() != reference.shape_vector()) {
    return invalid_argument("out: expected the shape of reference " + reference.shape_string() + ", got " +
                            out.shape_string());
  }
  const int64_t n = out.numel();
  double diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = load_as_double(out, i) - load_as_double(reference, i);
    diff += e * e;
  }
  const double ref = sum_sq(reference, n);
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

double pearson(const double* x, const double* y, int64_t n) {
  if (n < 2) return std::numeric_limits<double>::quiet_NaN();
  double mx = 0, my = 0;
  for (int64_t i = 0; i < n; ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= n;
  my /= n;
  double sxy = 0, sxx = 0, syy = 0;
  for (int64_t i = 0; i < n; ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  if (sxx <= 0 || syy <= 0) return std::numeric_limits<double>::quiet_NaN();
  return sxy / std::sqrt(sxx * syy);
}

Result<DeviationBound> deviation_bound(const Tensor& q, const Tensor& k, const BlockPartition& partition,
                                       const OracleBlocks& oracle, const OracleOptions& options) {
  Problem p;
  SPARSA_RETURN_IF_ERROR(make_problem(q, k, partition, options, &p));
  if (oracle.block_q != p.block_q || oracle.block_kv != p.block_kv || oracle.num_q_blocks != p.nq ||
      oracle.num_kv_blocks != p.nk || oracle.mass.shape() != std::vector<int64_t>{p.batch, p.heads_q, p.nq, p.nk}) {
    return invalid_argument("oracle: computed on a different partition or shape than q, k and partition");
  }
  const int64_t d = p.d, nq = p.nq, nk = p.nk;
  // Eq. 7 per block: mean, radius R (max distance to the mean), max norm M.
  struct Block {
    std::vector<double> mean;
    double radius = 0, max_norm = 0;
  };
  auto stats = [&](const Tensor& x, int64_t b, int64_t h, const std::vector<int64_t>& tokens) {
    Block s;
    s.mean.assign(d, 0.0);
    for (int64_t tok : tokens)
      for (int64_t t = 0; t < d; ++t) s.mean[t] += detail::load_element(x.data, x.dtype, x.offset({b, h, tok, t}));
    for (double& m : s.mean) m /= static_cast<double>(tokens.size());
    for (int64_t tok : tokens) {
      double r2 = 0, n2 = 0;
      for (int64_t t = 0; t < d; ++t) {
        const double v = detail::load_element(x.data, x.dtype, x.offset({b, h, tok, t}));
        r2 += (v - s.mean[t]) * (v - s.mean[t]);
        n2 += v * v;
      }
      s.radius = std::max(s.radius, std::sqrt(r2));
      s.max_norm = std::max(s.max_norm, std::sqrt(n2));
    }
    return s;
  };
  DeviationBound out;
  out.bound = HostArray(DType::f32, {p.batch, p.heads_q, nq, nk});
  out.deviation = HostArray(DType::f32, {p.batch, p.heads_q, nq, nk});
  std::vector<double> all_u, all_dev;
  all_u.reserve(p.batch * p.heads_q * nq * nk);
  all_dev.reserve(all_u.capacity());
  double sum_u = 0, sum_dev = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h_kv = 0; h_kv < p.heads_kv; ++h_kv) {
      std::vector<Block> kblocks(nk);
      {
        std::vector<std::vector<int64_t>> members(nk);
        const int32_t* kb_of = p.block_of_k.data() + (b * p.heads_kv + h_kv) * p.len_kv;
        for (int64_t j = 0; j < p.len_kv; ++j) members[kb_of[j]].push_back(j);
        for (int64_t kb = 0; kb < nk; ++kb) kblocks[kb] = stats(k, b, h_kv, members[kb]);
      }
      for (int64_t h = h_kv * p.group(); h < (h_kv + 1) * p.group(); ++h) {
        std::vector<std::vector<int64_t>> members(nq);
        const int32_t* qb_of = p.block_of_q.data() + (b * p.heads_q + h) * p.len_q;
        for (int64_t i = 0; i < p.len_q; ++i) members[qb_of[i]].push_back(i);
        std::vector<double> head_u, head_dev;
        for (int64_t qb = 0; qb < nq; ++qb) {
          const Block qs = stats(q, b, h, members[qb]);
          for (int64_t kb = 0; kb < nk; ++kb) {
            const Block& ks = kblocks[kb];
            double block_logit = 0;
            for (int64_t t = 0; t < d; ++t) block_logit += qs.mean[t] * ks.mean[t];
            block_logit *= p.scale;
            const int64_t cell = ((b * p.heads_q + h) * nq + qb) * nk + kb;
            const double u = p.scale * (qs.radius * ks.max_norm + qs.max_norm * ks.radius + qs.radius * ks.radius);
            const double dev = std::max(oracle.logit_max.ptr<float>()[cell] - block_logit,
                                        block_logit - oracle.logit_min.ptr<float>()[cell]);
            out.bound.ptr<float>()[cell] = static_cast<float>(u);
            out.deviation.ptr<float>()[cell] = static_cast<float>(dev);
            // f32 logits in the oracle: allow a relative 1e-4 of the logit scale.
            const double slack = 1e-4 * (1.0 + std::abs(block_logit) + u);
            if (dev > u + slack) ++out.violations;
            head_u.push_back(u);
            head_dev.push_back(dev);
            sum_u += u;
            sum_dev += dev;
          }
        }
        out.pearson_per_head.push_back(pearson(head_u.data(), head_dev.data(), static_cast<int64_t>(head_u.size())));
        all_u.insert(all_u.end(), head_u.begin(), head_u.end());
        all_dev.insert(all_dev.end(), head_dev.begin(), head_dev.end());
      }
    }
  }
  // pearson_per_head was filled in kv-head-major order, which is also query-head order
  // (heads h_kv*group .. (h_kv+1)*group-1 per kv head, kv heads ascending) for each batch.
  out.pearson_overall = pearson(all_u.data(), all_dev.data(), static_cast<int64_t>(all_u.size()));
  const double n = static_cast<double>(all_u.size());
  out.mean_bound = n ? sum_u / n : 0;
  out.mean_deviation = n ? sum_dev / n : 0;
  return out;
}

}  // namespace sparsa
