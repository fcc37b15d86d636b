// XAttention selector (sparsa/xattention.h has the semantics).
//
// cpu_ref scores each (query group, key group) tile by its antidiagonal directly, f64.
// cpu uses the equivalent reshaped product: Qr[g] = concat_s Q[gS+S-1-s], Kr[c] =
// concat_s K[cS+s] (zero rows past the end), a[g, c] = scale/S * Qr[g] . Kr[c], an f32
// [Lq/S, S d] x [S d, Lk/S] product threaded over (batch, head, query block).
#include "sparsa/xattention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "core/attention_params.h"
#include "core/validate.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "methods/planned_attention.h"
#include "methods/xattention/xattention_impl.h"

namespace sparsa {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct XProblem {
  Tensor q, k;
  int64_t batch, heads_q, heads_kv, len_q, len_kv, d;
  int block_q, block_kv, stride;
  int64_t nq, nk, q_groups, k_groups;
  float scale;
  int num_threads;
  Mask mask;
  bool mask_aware = false;
  int64_t group() const { return heads_q / heads_kv; }
  // The key groups [*lo, *hi) query group g's softmax runs over: all of them, or with mask_aware
  // those holding a key some query of the group sees (each query sees one interval, and the
  // intervals move forward with the query, so their union is one interval). Empty: none.
  void visible_groups(int64_t g, int64_t* lo, int64_t* hi) const {
    if (!mask_aware) {
      *lo = 0;
      *hi = k_groups;
      return;
    }
    int64_t begin = len_kv, end = 0;
    for (int64_t i = g * stride; i < std::min(len_q, (g + 1) * stride); ++i) {
      const int64_t b = mask_key_begin(mask, i, len_q, len_kv), e = mask_key_end(mask, i, len_q, len_kv);
      if (b >= e) continue;
      begin = std::min(begin, b);
      end = std::max(end, e);
    }
    *lo = begin < end ? begin / stride : 0;
    *hi = begin < end ? ceil_div(end, stride) : 0;
  }
};

Status make_problem(const Tensor& q, const Tensor& k, const XAttentionOptions& o, XProblem* p) {
  SPARSA_RETURN_IF_ERROR(detail::check_selector_inputs(q, k, o.backend, o.check_finite));
  if (o.stride <= 0) return invalid_argument("stride: expected >= 1, got " + std::to_string(o.stride));
  if (o.block_q <= 0) return invalid_argument("block_q: expected a block size > 0 tokens, got " + std::to_string(o.block_q));
  if (o.block_kv <= 0) {
    return invalid_argument("block_kv: expected a block size > 0 tokens, got " + std::to_string(o.block_kv));
  }
  if (o.block_q % o.stride != 0 || o.block_kv % o.stride != 0) {
    return invalid_argument("stride: expected a divisor of block_q (" + std::to_string(o.block_q) + ") and block_kv (" +
                            std::to_string(o.block_kv) + "), got " + std::to_string(o.stride));
  }
  SPARSA_RETURN_IF_ERROR(validate(o.budget));
  SPARSA_RETURN_IF_ERROR(validate_mask(o.mask));
  if (o.backend != Backend::cpu && o.backend != Backend::cpu_ref && o.backend != Backend::cuda) {
    return {StatusCode::unsupported, std::string("backend: xattention has no ") + backend_name(o.backend) +
                                         " selector; use cpu, cpu_ref or cuda"};
  }
  if (o.num_threads < 0 || o.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(o.num_threads));
  }
  p->scale = o.scale.value_or(1.0f / std::sqrt(static_cast<float>(q.shape[3])));
  if (!std::isfinite(p->scale) || p->scale <= 0) return invalid_argument("scale: expected a finite positive number");
  if (o.check_finite) {  // host memory here (check_selector_inputs refuses it on cuda)
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k", k));
  }
  p->q = q;
  p->k = k;
  p->batch = q.shape[0];
  p->heads_q = q.shape[1];
  p->len_q = q.shape[2];
  p->d = q.shape[3];
  p->heads_kv = k.shape[1];
  p->len_kv = k.shape[2];
  p->block_q = o.block_q;
  p->block_kv = o.block_kv;
  p->stride = o.stride;
  p->nq = ceil_div(p->len_q, o.block_q);
  p->nk = ceil_div(p->len_kv, o.block_kv);
  p->q_groups = ceil_div(p->len_q, o.stride);
  p->k_groups = ceil_div(p->len_kv, o.stride);
  p->num_threads = o.backend == Backend::cpu_ref ? 1 : o.num_threads;
  p->mask = o.mask;
  p->mask_aware = o.mask_aware;
  return {};
}

// Softmax of a query group's row of antidiagonal scores over the key groups [lo, hi) it sees (the
// only ones scored), added into the block masses of its query block.
// a[lo, hi) is overwritten with the exponentials (each computed once).
void add_row_masses(const XProblem& p, int64_t lo, int64_t hi, double* a, double* block_mass) {
  double max_a = -std::numeric_limits<double>::infinity();
  for (int64_t c = lo; c < hi; ++c) max_a = std::max(max_a, a[c]);
  double sum = 0;
  for (int64_t c = lo; c < hi; ++c) sum += (a[c] = std::exp(a[c] - max_a));
  const int64_t groups_per_block = p.block_kv / p.stride;
  for (int64_t c = lo; c < hi; ++c) block_mass[c / groups_per_block] += a[c] / sum;
}

void scores_ref(const XProblem& p, float* out) {
  const int64_t S = p.stride, d = p.d, groups_per_qblock = p.block_q / S;
  std::vector<double> a(p.k_groups), mass(p.nk);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t h_kv = h / p.group();
      for (int64_t qb = 0; qb < p.nq; ++qb) {
        std::fill(mass.begin(), mass.end(), 0.0);
        for (int64_t g = qb * groups_per_qblock; g < std::min(p.q_groups, (qb + 1) * groups_per_qblock); ++g) {
          int64_t lo = 0, hi = 0;
          p.visible_groups(g, &lo, &hi);
          for (int64_t c = lo; c < hi; ++c) {
            double sum = 0;
            for (int64_t s = 0; s < S; ++s) {  // the antidiagonal of tile (g, c)
              const int64_t i = g * S + S - 1 - s, j = c * S + s;
              if (i >= p.len_q || j >= p.len_kv) continue;
              for (int64_t t = 0; t < d; ++t) {
                sum += static_cast<double>(detail::load_element(p.q.data, p.q.dtype, p.q.offset({b, h, i, t}))) *
                       detail::load_element(p.k.data, p.k.dtype, p.k.offset({b, h_kv, j, t}));
              }
            }
            a[c] = sum * p.scale / static_cast<double>(S);
          }
          add_row_masses(p, lo, hi, a.data(), mass.data());
        }
        float* row = out + ((b * p.heads_q + h) * p.nq + qb) * p.nk;
        for (int64_t kb = 0; kb < p.nk; ++kb) row[kb] = static_cast<float>(mass[kb]);
      }
    }
  }
}

void scores_fast(const XProblem& p, float* out) {
  const int64_t S = p.stride, d = p.d, F = S * d, nkg = p.k_groups, groups_per_qblock = p.block_q / S;
  // Kr transposed per kv head: [batch, heads_kv, F, ldk], key groups padded with zeros to whole
  // vector blocks (kW of them) so that the product runs on full register tiles.
  constexpr int64_t kW = cpu::simd::kRowVecs * cpu::simd::kLanes;
  const int64_t ldk = ceil_div(nkg, kW) * kW;
  std::vector<float> krt(static_cast<size_t>(p.batch * p.heads_kv * F * ldk), 0.0f);
  cpu::parallel_for(p.batch * p.heads_kv, p.num_threads, [&](int64_t item, int) {
    const int64_t b = item / p.heads_kv, h_kv = item % p.heads_kv;
    float* base = krt.data() + item * F * ldk;
    std::vector<float> row(d);
    for (int64_t j = 0; j < p.len_kv; ++j) {
      detail::load_row(p.k.data, p.k.dtype, p.k.offset({b, h_kv, j, 0}), d, row.data());
      const int64_t c = j / S, s = j % S;
      for (int64_t t = 0; t < d; ++t) base[(s * d + t) * ldk + c] = row[t];
    }
  });
  // One work item per (batch, head, query block): its G query groups (Qr[g] = concat_s
  // Q[gS + S-1-s]) against the key groups any of them sees, as a [G, F] x [F, ldk] product on
  // register tiles of kCols groups x kW key groups; a group's sums run over f in order. Each
  // group's softmax then runs over its own visible range.
  cpu::parallel_for(p.batch * p.heads_q * p.nq, p.num_threads, [&](int64_t item, int) {
    const int64_t qb = item % p.nq, h = (item / p.nq) % p.heads_q, b = item / (p.nq * p.heads_q);
    const float* kr = krt.data() + (b * p.heads_kv + h / p.group()) * F * ldk;
    const int64_t g0 = qb * groups_per_qblock, G = std::min(p.q_groups, g0 + groups_per_qblock) - g0;
    std::vector<float> qr(G * F), acc(G * ldk);
    std::vector<int64_t> lo(G), hi(G);
    std::vector<double> a(nkg), mass(p.nk, 0.0);
    const float a_scale = p.scale / static_cast<float>(S);
    int64_t union_lo = nkg, union_hi = 0;
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t g = g0 + gi;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t i = g * S + S - 1 - s;
        float* dst = qr.data() + gi * F + s * d;
        if (i < p.len_q) {
          detail::load_row(p.q.data, p.q.dtype, p.q.offset({b, h, i, 0}), d, dst);
        } else {
          std::fill(dst, dst + d, 0.0f);
        }
      }
      p.visible_groups(g, &lo[gi], &hi[gi]);  // the key groups the group sees: the only ones used
      if (lo[gi] < hi[gi]) union_lo = std::min(union_lo, lo[gi]), union_hi = std::max(union_hi, hi[gi]);
    }
    for (int64_t c0 = union_lo / kW * kW; c0 < union_hi; c0 += kW) {
      for (int64_t j0 = 0; j0 < G; j0 += cpu::simd::kCols) {
        const int J = static_cast<int>(std::min<int64_t>(cpu::simd::kCols, G - j0));
        // acc[j][c] = sum_f qr[j][f] kr[f][c] for J groups x kW key groups (the mainloop's kernel)
        cpu::simd::kScoresKernels[J - 1][cpu::simd::kRowVecs - 1](kr + c0, ldk, qr.data() + j0 * F, F, F,
                                                                  acc.data() + j0 * ldk + c0);
      }
    }
    for (int64_t gi = 0; gi < G; ++gi) {
      const float* row = acc.data() + gi * ldk;
      for (int64_t c = lo[gi]; c < hi[gi]; ++c) a[c] = row[c] * a_scale;
      add_row_masses(p, lo[gi], hi[gi], a.data(), mass.data());
    }
    float* row = out + ((b * p.heads_q + h) * p.nq + qb) * p.nk;
    for (int64_t kb = 0; kb < p.nk; ++kb) row[kb] = static_cast<float>(mass[kb]);
  });
}

xattention_cuda::Request cuda_request(const XProblem& p, const XAttentionOptions& o) {
  xattention_cuda::Request r;
  r.q = p.q;
  r.k = p.k;
  r.batch = p.batch;
  r.heads_q = p.heads_q;
  r.heads_kv = p.heads_kv;
  r.len_q = p.len_q;
  r.len_kv = p.len_kv;
  r.head_dim = p.d;
  r.block_q = p.block_q;
  r.block_kv = p.block_kv;
  r.stride = p.stride;
  r.num_q_blocks = p.nq;
  r.num_kv_blocks = p.nk;
  r.scale = p.scale;
  r.budget = o.budget;
  r.force_first = o.force_first;
  r.force_diagonal = o.force_diagonal;
  r.mask = o.mask;
  r.mask_aware = o.mask_aware;
  r.stream = o.stream;
  return r;
}

}  // namespace

Result<HostArray> xattention_scores(const Tensor& q, const Tensor& k, const XAttentionOptions& options) {
  XProblem p;
  SPARSA_RETURN_IF_ERROR(make_problem(q, k, options, &p));
  if (options.backend == Backend::cuda) {
    HostArray x;
    SPARSA_RETURN_IF_ERROR(xattention_cuda::scores(cuda_request(p, options), &x));
    return x;
  }
  HostArray out(DType::f32, {p.batch, p.heads_q, p.nq, p.nk});
  if (options.backend == Backend::cpu_ref) {
    scores_ref(p, out.ptr<float>());
  } else {
    scores_fast(p, out.ptr<float>());
  }
  const float* x = out.ptr<float>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    if (!std::isfinite(x[i])) {
      return Status(StatusCode::non_finite, "xattention: block mass " + std::to_string(i) +
                                                " is not finite (NaN/Inf or overflow in q or k)");
    }
  }
  return out;
}

Result<BlockIndexBuffer> xattention_plan(const Tensor& q, const Tensor& k, const XAttentionOptions& options) {
  if (options.backend == Backend::cuda) {
    XProblem p;
    SPARSA_RETURN_IF_ERROR(make_problem(q, k, options, &p));
    BlockIndexBuffer plan;
    SPARSA_RETURN_IF_ERROR(xattention_cuda::plan(cuda_request(p, options), &plan));
    return plan;
  }
  auto scores = xattention_scores(q, k, options);
  if (!scores.ok()) return scores.status();
  const int64_t batch = q.shape[0], heads_q = q.shape[1];
  const int64_t nq = ceil_div(q.shape[2], options.block_q), nk = ceil_div(k.shape[2], options.block_kv);
  const int64_t rows = batch * heads_q * nq;
  std::vector<int32_t> kept(rows * nk), counts(rows);
  // mask_aware: which key blocks each query block may choose (the same for every batch and head).
  std::vector<BlockVisibility> visibility(options.mask_aware ? nq * nk : 0);
  for (int64_t qb = 0; options.mask_aware && qb < nq; ++qb) {
    mask_block_visibility(options.mask, qb, options.block_q, options.block_kv, q.shape[2], k.shape[2],
                          visibility.data() + qb * nk);
  }
  cpu::parallel_for(rows, options.backend == Backend::cpu_ref ? 1 : options.num_threads, [&](int64_t r, int) {
    const int64_t qb = r % nq;
    const float* x = scores->ptr<float>() + r * nk;
    std::vector<double> mass(x, x + nk);
    std::unique_ptr<bool[]> forced(new bool[nk]());
    if (options.force_first) forced[0] = true;
    const int64_t diagonal = qb + nk - nq;  // XAttention aligns the diagonal to the end of the keys
    if (options.force_diagonal && diagonal >= 0 && diagonal < nk) forced[diagonal] = true;
    int32_t* out = kept.data() + r * nk;
    counts[r] = static_cast<int32_t>(
        options.mask_aware
            ? select_visible_blocks(mass.data(), mass.data(), forced.get(), visibility.data() + qb * nk, nk,
                                    options.budget, out)
            : select_blocks(mass.data(), mass.data(), forced.get(), nk, options.budget, out));
  });
  BlockIndexBuffer plan = BlockIndexBuffer::from_rows(batch, heads_q, q.shape[2], k.shape[2], options.block_q,
                                                      options.block_kv, counts, kept.data(), nk);
  return plan;
}

Status xattention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                  const XAttentionOptions& options) {
  return detail::attention_over_plan(q, k, v, out, lse, options, [&] { return xattention_plan(q, k, options); });
}

Result<AttentionOutput> xattention(const Tensor& q, const Tensor& k, const Tensor& v, const XAttentionOptions& options) {
  return detail::attention_over_plan(q, k, v, options, [&] { return xattention_plan(q, k, options); });
}

}  // namespace sparsa
