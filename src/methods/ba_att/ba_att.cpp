// BA-Att public entry points: validate, norm sort (step 1), score (steps 2-3, one of
// two backends), apply the budget per query block (step 4), execute (block_sparse).
#include "sparsa/ba_att.h"

#include <cmath>
#include <limits>
#include <vector>

#include "core/attention_params.h"
#include "core/validate.h"
#include "cpu/parallel.h"
#include "methods/ba_att/ba_att_impl.h"
#include "methods/planned_attention.h"

namespace sparsa {

const char* compensation_name(Compensation c) {
  switch (c) {
    case Compensation::diagonal: return "diagonal";
    case Compensation::exact: return "exact";
    case Compensation::trace: return "trace";
  }
  return "?";
}

Result<Compensation> parse_compensation(const std::string& name) {
  if (name == "diagonal") return Compensation::diagonal;
  if (name == "exact") return Compensation::exact;
  if (name == "trace") return Compensation::trace;
  return invalid_argument("compensation: expected diagonal, exact or trace, got '" + name + "'");
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Status check_options(const BaAttOptions& o, int64_t head_dim) {
  if (o.block_q <= 0) return invalid_argument("block_q: expected a block size > 0 tokens, got " + std::to_string(o.block_q));
  if (o.block_kv <= 0) {
    return invalid_argument("block_kv: expected a block size > 0 tokens, got " + std::to_string(o.block_kv));
  }
  if (o.sort_window < 0) {
    return invalid_argument("sort_window: expected 0 (global sort) or a positive window, got " +
                            std::to_string(o.sort_window));
  }
  if (o.sort_window > 0 && (o.sort_window % o.block_q != 0 || o.sort_window % o.block_kv != 0)) {
    return invalid_argument("sort_window: expected a multiple of block_q (" + std::to_string(o.block_q) +
                            ") and block_kv (" + std::to_string(o.block_kv) + ") so that no block crosses a window, got " +
                            std::to_string(o.sort_window));
  }
  if (!std::isfinite(o.beta)) return invalid_argument("beta: expected a finite number, got " + std::to_string(o.beta));
  if (o.compensation != Compensation::diagonal && o.compensation != Compensation::exact &&
      o.compensation != Compensation::trace) {
    return invalid_argument("compensation: unknown value " + std::to_string(static_cast<int>(o.compensation)));
  }
  const float scale = o.scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return invalid_argument("scale: expected a finite positive number, got " + std::to_string(scale));
  }
  if (o.num_threads < 0 || o.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(o.num_threads));
  }
  if (o.backend != Backend::cpu && o.backend != Backend::cpu_ref && o.backend != Backend::cuda) {
    return invalid_argument("backend: unknown value " + std::to_string(static_cast<int>(o.backend)));
  }
  SPARSA_RETURN_IF_ERROR(validate_mask(o.mask));
  if (o.mask_aware && (o.sort_q || o.sort_k)) {
    return invalid_argument(
        "mask_aware: the selection sees the mask only without the norm sorts (a sort moves tokens across the "
        "mask's blocks); set sort_q and sort_k to false");
  }
  return validate(o.budget);
}

// Step 1 for every (batch, head) of x: f64 norms, then the shared stable sort.
Status sort_by_norm(const char* name, const Tensor& x, int64_t window, int num_threads, HostArray* perm) {
  const int64_t batch = x.shape[0], heads = x.shape[1], len = x.shape[2], d = x.shape[3];
  *perm = HostArray(DType::i32, {batch, heads, len});
  std::vector<Status> errors(batch * heads);
  cpu::parallel_for(batch * heads, num_threads, [&](int64_t item, int) {
    const int64_t b = item / heads, h = item % heads;
    std::vector<double> norms(len);
    for (int64_t i = 0; i < len; ++i) {
      double sum = 0.0;
      for (int64_t t = 0; t < d; ++t) {
        const double v = detail::load_element(x.data, x.dtype, x.offset({b, h, i, t}));
        sum += v * v;
      }
      norms[i] = std::sqrt(sum);
      if (!std::isfinite(norms[i])) {
        errors[item] = {StatusCode::non_finite, std::string(name) + ": token [" + std::to_string(b) + ", " +
                                                    std::to_string(h) + ", " + std::to_string(i) +
                                                    "] has a NaN/Inf norm; cannot sort by norm"};
        return;
      }
    }
    norm_sort(norms.data(), len, window, perm->ptr<int32_t>() + item * len);
  });
  for (const Status& s : errors) SPARSA_RETURN_IF_ERROR(s);
  return {};
}

// The validated params of steps 2-3 (no permutations, no logits buffer yet).
detail::BaAttParams make_params(const Tensor& q, const Tensor& k, const BaAttOptions& options) {
  detail::BaAttParams p;
  p.q = q;
  p.k = k;
  p.batch = q.shape[0];
  p.heads_q = q.shape[1];
  p.len_q = q.shape[2];
  p.head_dim = q.shape[3];
  p.heads_kv = k.shape[1];
  p.len_kv = k.shape[2];
  p.block_q = options.block_q;
  p.block_kv = options.block_kv;
  p.num_q_blocks = ceil_div(p.len_q, p.block_q);
  p.num_kv_blocks = ceil_div(p.len_kv, p.block_kv);
  p.scale = options.scale.value_or(1.0f / std::sqrt(static_cast<float>(p.head_dim)));
  p.compensate = options.compensate;
  p.compensation = options.compensation;
  p.beta = options.beta;
  p.num_threads = options.backend == Backend::cpu_ref ? 1 : options.num_threads;
  return p;
}

ba_att_cuda::Request cuda_request(const Tensor& q, const Tensor& k, const BaAttOptions& options) {
  ba_att_cuda::Request r;
  r.params = make_params(q, k, options);
  r.sort_q = options.sort_q;
  r.sort_k = options.sort_k;
  r.sort_window = options.sort_window;
  r.budget = options.budget;
  r.mask = options.mask;
  r.mask_aware = options.mask_aware;
  r.stream = options.stream;
  return r;
}

}  // namespace

Result<BaAttScores> ba_att_scores(const Tensor& q, const Tensor& k, const BaAttOptions& options) {
  SPARSA_RETURN_IF_ERROR(detail::check_selector_inputs(q, k, options.backend, options.check_finite));
  SPARSA_RETURN_IF_ERROR(check_options(options, q.shape[3]));
  if (options.backend == Backend::cuda) {
    BaAttScores s;
    SPARSA_RETURN_IF_ERROR(ba_att_cuda::scores(cuda_request(q, k, options), &s));
    return s;
  }
  if (options.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k", k));
  }
  detail::BaAttParams p = make_params(q, k, options);

  BaAttScores s;
  s.block_q = p.block_q;
  s.block_kv = p.block_kv;
  s.num_q_blocks = p.num_q_blocks;
  s.num_kv_blocks = p.num_kv_blocks;
  if (options.sort_q) {
    SPARSA_RETURN_IF_ERROR(sort_by_norm("q", q, options.sort_window, p.num_threads, &s.perm_q));
    p.perm_q = s.perm_q.ptr<int32_t>();
  }
  if (options.sort_k) {
    SPARSA_RETURN_IF_ERROR(sort_by_norm("k", k, options.sort_window, p.num_threads, &s.perm_kv));
    p.perm_kv = s.perm_kv.ptr<int32_t>();
  }
  s.logits = HostArray(DType::f32, {p.batch, p.heads_q, p.num_q_blocks, p.num_kv_blocks});
  p.logits = s.logits.ptr<float>();
  SPARSA_RETURN_IF_ERROR(options.backend == Backend::cpu_ref ? ba_att_cpu_ref::scores(p) : ba_att_cpu::scores(p));
  // A NaN/Inf logit would make the block order meaningless: refuse it rather than plan on it.
  const float* l = s.logits.ptr<float>();
  for (int64_t i = 0; i < s.logits.numel(); ++i) {
    if (!std::isfinite(l[i])) {
      const int64_t kb = i % p.num_kv_blocks, qb = (i / p.num_kv_blocks) % p.num_q_blocks,
                    h = (i / (p.num_kv_blocks * p.num_q_blocks)) % p.heads_q,
                    b = i / (p.num_kv_blocks * p.num_q_blocks * p.heads_q);
      return Status(StatusCode::non_finite, "ba_att: block logit [" + std::to_string(b) + ", " + std::to_string(h) +
                                                ", " + std::to_string(qb) + ", " + std::to_string(kb) +
                                                "] is not finite (NaN/Inf or overflow in q or k)");
    }
  }
  return s;
}

Result<BlockIndexBuffer> ba_att_plan(const Tensor& q, const Tensor& k, const BaAttOptions& options) {
  if (options.backend == Backend::cuda) {
    SPARSA_RETURN_IF_ERROR(detail::check_selector_inputs(q, k, options.backend, options.check_finite));
    SPARSA_RETURN_IF_ERROR(check_options(options, q.shape[3]));
    BlockIndexBuffer plan;
    SPARSA_RETURN_IF_ERROR(ba_att_cuda::plan(cuda_request(q, k, options), &plan));
    return plan;
  }
  auto scores = ba_att_scores(q, k, options);
  if (!scores.ok()) return scores.status();
  BaAttScores& s = scores.value();
  const int64_t batch = q.shape[0], heads_q = q.shape[1], nq = s.num_q_blocks, nk = s.num_kv_blocks;
  const int64_t rows = batch * heads_q * nq;
  std::vector<int32_t> kept(rows * nk);
  std::vector<int32_t> counts(rows);
  const int threads = options.backend == Backend::cpu_ref ? 1 : options.num_threads;
  // mask_aware: which key blocks each query block may choose (the same for every batch and head).
  std::vector<BlockVisibility> visibility(options.mask_aware ? nq * nk : 0);
  if (options.mask_aware) {
    for (int64_t qb = 0; qb < nq; ++qb) {
      mask_block_visibility(options.mask, qb, options.block_q, options.block_kv, q.shape[2], k.shape[2],
                            visibility.data() + qb * nk);
    }
  }
  cpu::parallel_for(rows, threads, [&](int64_t r, int) {
    // Step 4 (Alg. 1 lines 9-10): softmax over key blocks; top-kappa by m' equals top-kappa by l'.
    // mask_aware: over the blocks the mask leaves visible, the diagonal ones forced.
    const float* logits = s.logits.ptr<float>() + r * nk;
    std::vector<double> key(nk), weight(nk);
    double max_logit = -std::numeric_limits<double>::infinity();
    const BlockVisibility* vis = options.mask_aware ? visibility.data() + (r % nq) * nk : nullptr;
    for (int64_t j = 0; j < nk; ++j) {
      key[j] = logits[j];
      if (vis == nullptr || vis[j] != BlockVisibility::hidden) max_logit = std::max(max_logit, key[j]);
    }
    for (int64_t j = 0; j < nk; ++j) weight[j] = std::exp(key[j] - max_logit);
    int32_t* out = kept.data() + r * nk;
    counts[r] = static_cast<int32_t>(
        vis != nullptr ? select_visible_blocks(key.data(), weight.data(), nullptr, vis, nk, options.budget, out)
                       : select_blocks(key.data(), weight.data(), nullptr, nk, options.budget, out));
  });
  BlockIndexBuffer plan = BlockIndexBuffer::from_rows(batch, heads_q, q.shape[2], k.shape[2], options.block_q,
                                                      options.block_kv, counts, kept.data(), nk);
  plan.perm_q = std::move(s.perm_q);
  plan.perm_kv = std::move(s.perm_kv);
  return plan;
}

Status ba_att(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
              const BaAttOptions& options) {
  return detail::attention_over_plan(q, k, v, out, lse, options, [&] { return ba_att_plan(q, k, options); });
}

Result<AttentionOutput> ba_att(const Tensor& q, const Tensor& k, const Tensor& v, const BaAttOptions& options) {
  return detail::attention_over_plan(q, k, v, options, [&] { return ba_att_plan(q, k, options); });
}

}  // namespace sparsa
