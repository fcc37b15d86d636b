// Public entry points of LLSA: validate, build or check the plan, dispatch to cpu_ref
// (f64, the specification) or cpu (the fast path).
#include "sparsa/llsa.h"

#include <cmath>
#include <limits>

#include "core/attention_params.h"
#include "core/validate.h"
#include "methods/llsa/internal.h"

namespace sparsa {

namespace {

using detail::check_attention_tensor;

constexpr int kMaxLevels = 16;

Status check_options(const LlsaOptions& o) {
  if (o.block < 2) return invalid_argument("block: expected >= 2, got " + std::to_string(o.block));
  if (o.block > 4096) return invalid_argument("block: expected <= 4096, got " + std::to_string(o.block));
  if (o.topk < 1) return invalid_argument("topk: expected >= 1, got " + std::to_string(o.topk));
  if (o.levels != -1 && (o.levels < 1 || o.levels > kMaxLevels)) {
    return invalid_argument("levels: expected -1 (automatic) or 1.." + std::to_string(kMaxLevels) + ", got " +
                            std::to_string(o.levels));
  }
  if (o.num_threads < 0 || o.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(o.num_threads));
  }
  if (o.scale && (!std::isfinite(*o.scale) || *o.scale <= 0.0f)) {
    return invalid_argument("scale: expected a finite positive number, got " + std::to_string(*o.scale));
  }
  SPARSA_RETURN_IF_ERROR(backend_status(o.backend));
  if (o.backend == Backend::cuda && o.check_finite) {
    return {StatusCode::unsupported, "check_finite: not available on the cuda backend (scan on the host first)"};
  }
  return {};
}

// Where every tensor of a call must be: q's CUDA device on the cuda backend, else the host.
Device home(const Tensor& q, const LlsaOptions& o) { return o.backend == Backend::cuda ? q.device : Device{}; }

// q [batch, heads_q, len, d]; k (and v when given) [batch, heads_kv, len, d].
Status check_inputs(const Tensor& q, const Tensor& k, const Tensor* v, const LlsaOptions& o) {
  SPARSA_RETURN_IF_ERROR(check_options(o));
  const Device host = home(q, o);
  if (o.backend == Backend::cuda && q.device.type != DeviceType::cuda) {
    return invalid_argument("q: the cuda backend expected a tensor on a cuda device, got " + device_name(q.device));
  }
  SPARSA_RETURN_IF_ERROR(detail::check_query_key(q, k, host));
  if (v) SPARSA_RETURN_IF_ERROR(check_attention_tensor("v", *v, host));
  if (k.shape[2] != q.shape[2]) {
    return invalid_argument("k: llsa is self-attention, expected len " + std::to_string(q.shape[2]) +
                            " (as q), got " + std::to_string(k.shape[2]));
  }
  if (q.shape[2] > (int64_t{1} << 31) - 1) return invalid_argument("q: len above 2^31 - 1 is not supported");
  if (v) {
    if (v->dtype != q.dtype) {
      return unsupported_dtype(std::string("v: dtype ") + dtype_name(v->dtype) + " differs from q's " + dtype_name(q.dtype));
    }
    for (int d = 0; d < 4; ++d) {
      if (v->shape[d] != k.shape[d]) {
        return invalid_argument("v: expected shape " + k.shape_string() + " (as k), got " + v->shape_string());
      }
    }
  }
  if (o.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k", k));
    if (v) SPARSA_RETURN_IF_ERROR(detail::check_finite("v", *v));
  }
  return {};
}

// An output or side tensor of exactly `like`'s shape, a float dtype, on `like`'s device, with
// a contiguous last dimension.
Status check_like(const char* name, const Tensor& t, const Tensor& like) {
  SPARSA_RETURN_IF_ERROR(check_attention_tensor(name, t, like.device));
  for (int d = 0; d < 4; ++d) {
    if (t.shape[d] != like.shape[d]) {
      return invalid_argument(std::string(name) + ": expected shape " + like.shape_string() + ", got " + t.shape_string());
    }
  }
  return {};
}

Status check_lse(const Tensor& lse, const Tensor& q) {
  SPARSA_RETURN_IF_ERROR(detail::check_shape("lse", lse, {q.shape[0], q.shape[1], q.shape[2]}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("lse", lse, DType::f32));
  if (lse.data == nullptr) return invalid_argument("lse: is missing (null data)");
  if (!(lse.device == q.device)) {
    return invalid_argument("lse: expected a tensor on " + device_name(q.device) + ", got " + device_name(lse.device));
  }
  return {};
}

// The plan drives every index the executors compute: check it fully.
Status check_plan(const LlsaPlan& plan, const Tensor& q, const Tensor& k) {
  const std::string what = "plan: ";
  if (plan.block < 2 || plan.topk < 1 || plan.levels < 1 || plan.levels > kMaxLevels) {
    return invalid_argument(what + "block/topk/levels out of range (" + std::to_string(plan.block) + "/" +
                            std::to_string(plan.topk) + "/" + std::to_string(plan.levels) + ")");
  }
  if (plan.batch != q.shape[0] || plan.heads_q != q.shape[1] || plan.heads_kv != k.shape[1] || plan.len != q.shape[2]) {
    return invalid_argument(what + "built for batch " + std::to_string(plan.batch) + ", heads " +
                            std::to_string(plan.heads_q) + "/" + std::to_string(plan.heads_kv) + ", len " +
                            std::to_string(plan.len) + "; q is " + q.shape_string() + ", k is " + k.shape_string());
  }
  if (plan.level_len != llsa_detail::level_lengths(plan.len, plan.block, plan.levels)) {
    return invalid_argument(what + "level lengths do not match len, block and levels");
  }
  if (static_cast<int>(plan.picks.size()) != plan.levels || static_cast<int>(plan.pick_counts.size()) != plan.levels) {
    return invalid_argument(what + "expected " + std::to_string(plan.levels) + " levels of picks");
  }
  for (int l = 1; l <= plan.levels; ++l) {
    const int64_t n = plan.level_len[l];
    const HostArray& picks = plan.picks[l - 1];
    const HostArray& counts = plan.pick_counts[l - 1];
    if (picks.dtype() != DType::i32 || picks.shape() != std::vector<int64_t>{plan.batch, plan.heads_q, n, plan.topk} ||
        counts.dtype() != DType::i32 || counts.shape() != std::vector<int64_t>{plan.batch, plan.heads_q, n}) {
      return invalid_argument(what + "level " + std::to_string(l) + " picks have the wrong shape or dtype");
    }
    for (int64_t r = 0; r < counts.numel(); ++r) {
      const int32_t c = counts.ptr<int32_t>()[r];
      if (c < 0 || c > plan.topk) {
        return invalid_argument(what + "level " + std::to_string(l) + " count " + std::to_string(c) +
                                " outside [0, topk]");
      }
      const int32_t* row = picks.ptr<int32_t>() + r * plan.topk;
      for (int s = 0; s < c; ++s) {
        if (row[s] < 0 || row[s] >= n || (s > 0 && row[s] <= row[s - 1])) {
          return invalid_argument(what + "level " + std::to_string(l) + " picks must be ascending in [0, " +
                                  std::to_string(n) + "), got " + std::to_string(row[s]));
        }
      }
    }
  }
  return {};
}

int resolve_levels(int64_t len, const LlsaOptions& o) {
  return o.levels > 0 ? o.levels : llsa_auto_levels(len, o.block);
}

float resolve_scale(const Tensor& q, const LlsaOptions& o) {
  return o.scale.value_or(1.0f / std::sqrt(static_cast<float>(q.shape[3])));
}

// Contiguous f64 copy of a 4-d tensor (cpu_ref).
std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out(t.numel());
  const int64_t d = t.shape[3];
  std::vector<float> row(d);
  int64_t n = 0;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t i = 0; i < t.shape[2]; ++i) {
        detail::load_row(t.data, t.dtype, t.offset({a, b, i, 0}), d, row.data());
        for (int64_t c = 0; c < d; ++c) out[n++] = row[c];
      }
  return out;
}

void from_double(const std::vector<double>& src, const Tensor& t) {
  const int64_t d = t.shape[3];
  int64_t n = 0;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t i = 0; i < t.shape[2]; ++i)
        for (int64_t c = 0; c < d; ++c)
          detail::store_element(t.data, t.dtype, t.offset({a, b, i, c}), static_cast<float>(src[n++]));
}

void lse_from_double(const std::vector<double>& src, const Tensor& lse) {
  int64_t n = 0;
  for (int64_t a = 0; a < lse.shape[0]; ++a)
    for (int64_t b = 0; b < lse.shape[1]; ++b)
      for (int64_t i = 0; i < lse.shape[2]; ++i) lse.ptr<float>()[lse.offset({a, b, i})] = static_cast<float>(src[n++]);
}

std::vector<double> lse_to_double(const Tensor& lse) {
  std::vector<double> out(lse.numel());
  int64_t n = 0;
  for (int64_t a = 0; a < lse.shape[0]; ++a)
    for (int64_t b = 0; b < lse.shape[1]; ++b)
      for (int64_t i = 0; i < lse.shape[2]; ++i) out[n++] = lse.ptr<const float>()[lse.offset({a, b, i})];
  return out;
}

llsa_detail::RefShape ref_shape(const Tensor& q, const Tensor& k, float scale) {
  return {q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], static_cast<double>(scale)};
}

}  // namespace

Result<LlsaPlan> llsa_plan(const Tensor& q, const Tensor& k, const LlsaOptions& options) {
  SPARSA_RETURN_IF_ERROR(check_inputs(q, k, nullptr, options));
  const int levels = resolve_levels(q.shape[2], options);
  if (options.backend == Backend::cuda) {
    SPARSA_RETURN_IF_ERROR(llsa_cuda::check(q, k, levels, options));
    LlsaPlan plan;
    SPARSA_RETURN_IF_ERROR(llsa_cuda::plan(q, k, options, levels, &plan));
    return plan;
  }
  return llsa_detail::build_plan(q, k, options, levels);
}

namespace {

// The cuda call of validated tensors; with a plan, the plan's shape decides (as on the host).
llsa_cuda::Call cuda_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const LlsaPlan* plan, const LlsaOptions& options) {
  llsa_cuda::Call c;
  c.q = q, c.k = k, c.v = v, c.out = out, c.lse = lse;
  c.scale = resolve_scale(q, options);
  c.options = options;
  c.levels = resolve_levels(q.shape[2], options);
  if (plan) {
    c.options.block = plan->block;
    c.options.topk = plan->topk;
    c.options.enrich = plan->enrich;
    c.options.dedupe = plan->dedupe;
    c.levels = plan->levels;
  }
  return c;
}

}  // namespace

Status llsa_forward(const Tensor& q, const Tensor& k, const Tensor& v, const LlsaPlan& plan, const Tensor& out,
                    const Tensor& lse, const LlsaOptions& options) {
  SPARSA_RETURN_IF_ERROR(check_inputs(q, k, &v, options));
  SPARSA_RETURN_IF_ERROR(check_plan(plan, q, k));
  SPARSA_RETURN_IF_ERROR(check_like("out", out, q));
  if (out.dtype != q.dtype) return unsupported_dtype(std::string("out: expected dtype ") + dtype_name(q.dtype) + ", got " + dtype_name(out.dtype));
  SPARSA_RETURN_IF_ERROR(check_lse(lse, q));
  SPARSA_RETURN_IF_ERROR(detail::check_outputs("out", out, "lse", lse));
  if (options.backend == Backend::cuda) {
    const llsa_cuda::Call c = cuda_call(q, k, v, out, lse, &plan, options);
    SPARSA_RETURN_IF_ERROR(llsa_cuda::check(q, k, c.levels, c.options));
    return llsa_cuda::forward(c, &plan);
  }
  const float scale = resolve_scale(q, options);
  // The reference in f64: cpu_ref's path, and the cpu path's answer when f32 overflowed.
  auto reference = [&]() -> Status {
    const auto qd = to_double(q), kd = to_double(k), vd = to_double(v);
    std::vector<double> od(q.numel()), ld(q.numel() / q.shape[3]);
    llsa_detail::ref_forward(ref_shape(q, k, scale), plan, qd.data(), kd.data(), vd.data(), od.data(), ld.data());
    from_double(od, out);
    lse_from_double(ld, lse);
    // f64 holds every logit of finite f32 inputs; an LSE beyond f32 has no finite answer.
    for (size_t n = 0; n < ld.size(); ++n) {
      if (ld[n] > static_cast<double>(std::numeric_limits<float>::max())) {
        const int64_t len = q.shape[2], heads = q.shape[1];
        const int64_t i = static_cast<int64_t>(n) % len, h = static_cast<int64_t>(n) / len % heads,
                      b = static_cast<int64_t>(n) / (len * heads);
        return {StatusCode::non_finite,
                "lse[" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(i) +
                    "]: the log-sum-exp of the scaled logits exceeds the f32 range (3.4e38): the logits overflow; "
                    "lower the scale or the magnitude of q and k"};
      }
    }
    return {};
  };
  if (options.backend == Backend::cpu_ref) return reference();
  llsa_detail::CpuArgs args;
  args.q = q, args.k = k, args.v = v, args.out = out, args.lse = lse;
  args.scale = scale;
  args.num_threads = options.num_threads;
  bool not_finite = false;
  SPARSA_RETURN_IF_ERROR(llsa_detail::cpu_forward(args, plan, &not_finite));
  if (not_finite) return reference();
  return {};
}

Status llsa_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const LlsaOptions& options) {
  if (options.backend != Backend::cuda) {
    Result<LlsaPlan> plan = llsa_plan(q, k, options);
    if (!plan.ok()) return plan.status();
    return llsa_forward(q, k, v, *plan, out, lse, options);
  }
  SPARSA_RETURN_IF_ERROR(check_inputs(q, k, &v, options));
  SPARSA_RETURN_IF_ERROR(check_like("out", out, q));
  if (out.dtype != q.dtype) return unsupported_dtype(std::string("out: expected dtype ") + dtype_name(q.dtype) + ", got " + dtype_name(out.dtype));
  SPARSA_RETURN_IF_ERROR(check_lse(lse, q));
  SPARSA_RETURN_IF_ERROR(detail::check_outputs("out", out, "lse", lse));
  const llsa_cuda::Call c = cuda_call(q, k, v, out, lse, nullptr, options);
  SPARSA_RETURN_IF_ERROR(llsa_cuda::check(q, k, c.levels, c.options));
  return llsa_cuda::forward(c, nullptr);
}

Result<AttentionOutput> llsa_forward(const Tensor& q, const Tensor& k, const Tensor& v, const LlsaOptions& options) {
  if (options.backend == Backend::cuda) {
    return invalid_argument("backend: the allocating llsa_forward returns host arrays; on cuda pass out and lse "
                            "(device tensors) to the other form");
  }
  Result<LlsaPlan> plan = llsa_plan(q, k, options);
  if (!plan.ok()) return plan.status();
  AttentionOutput o;
  o.out = HostArray(q.dtype, {q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
  o.lse = HostArray(DType::f32, {q.shape[0], q.shape[1], q.shape[2]});
  SPARSA_RETURN_IF_ERROR(llsa_forward(q, k, v, *plan, o.out.view(), o.lse.view(), options));
  return o;
}

namespace {

Status check_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                      const Tensor& d_o, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const LlsaOptions& options) {
  SPARSA_RETURN_IF_ERROR(check_inputs(q, k, &v, options));
  SPARSA_RETURN_IF_ERROR(check_like("out", out, q));
  SPARSA_RETURN_IF_ERROR(check_lse(lse, q));
  SPARSA_RETURN_IF_ERROR(check_like("d_o", d_o, q));
  SPARSA_RETURN_IF_ERROR(check_like("dq", dq, q));
  SPARSA_RETURN_IF_ERROR(check_like("dk", dk, k));
  SPARSA_RETURN_IF_ERROR(check_like("dv", dv, k));
  for (auto [name, t] : {std::pair{"dq", &dq}, std::pair{"dk", &dk}, std::pair{"dv", &dv}}) {
    SPARSA_RETURN_IF_ERROR(detail::check_no_self_overlap(name, *t));
  }
  SPARSA_RETURN_IF_ERROR(detail::check_disjoint("dk", dk, "dq", dq));
  SPARSA_RETURN_IF_ERROR(detail::check_disjoint("dv", dv, "dq", dq));
  SPARSA_RETURN_IF_ERROR(detail::check_disjoint("dv", dv, "dk", dk));
  if (options.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("d_o", d_o));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("out", out));
  }
  if (options.backend == Backend::cuda) {
    for (auto [name, t] : {std::pair{"out", &out}, std::pair{"d_o", &d_o}, std::pair{"dq", &dq}, std::pair{"dk", &dk},
                           std::pair{"dv", &dv}}) {
      if (t->dtype != q.dtype) {
        return unsupported_dtype(std::string(name) + ": the cuda backend expected dtype " + dtype_name(q.dtype) +
                                 " (as q), got " + dtype_name(t->dtype));
      }
    }
  }
  return {};
}

llsa_cuda::Call cuda_backward_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& lse, const Tensor& d_o, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv, const LlsaPlan* plan, const LlsaOptions& options) {
  llsa_cuda::Call c = cuda_call(q, k, v, out, lse, plan, options);
  c.d_o = d_o, c.dq = dq, c.dk = dk, c.dv = dv;
  return c;
}

}  // namespace

Status llsa_backward(const Tensor& q, const Tensor& k, const Tensor& v, const LlsaPlan& plan, const Tensor& out,
                     const Tensor& lse, const Tensor& d_o, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                     const LlsaOptions& options) {
  SPARSA_RETURN_IF_ERROR(check_backward(q, k, v, out, lse, d_o, dq, dk, dv, options));
  SPARSA_RETURN_IF_ERROR(check_plan(plan, q, k));
  if (options.backend == Backend::cuda) {
    const llsa_cuda::Call c = cuda_backward_call(q, k, v, out, lse, d_o, dq, dk, dv, &plan, options);
    SPARSA_RETURN_IF_ERROR(llsa_cuda::check(q, k, c.levels, c.options));
    return llsa_cuda::backward(c, &plan);
  }
  const float scale = resolve_scale(q, options);
  if (options.backend == Backend::cpu_ref) {
    const auto qd = to_double(q), kd = to_double(k), vd = to_double(v), od = to_double(out), dod = to_double(d_o);
    const auto ld = lse_to_double(lse);
    std::vector<double> dqd(q.numel()), dkd(k.numel()), dvd(k.numel());
    llsa_detail::ref_backward(ref_shape(q, k, scale), plan, qd.data(), kd.data(), vd.data(), od.data(), ld.data(),
                              dod.data(), dqd.data(), dkd.data(), dvd.data());
    from_double(dqd, dq);
    from_double(dkd, dk);
    from_double(dvd, dv);
    return {};
  }
  llsa_detail::CpuArgs args;
  args.q = q, args.k = k, args.v = v, args.out = out, args.lse = lse, args.d_o = d_o;
  args.dq = dq, args.dk = dk, args.dv = dv;
  args.scale = scale;
  args.num_threads = options.num_threads;
  return llsa_detail::cpu_backward(args, plan);
}

Status llsa_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     const Tensor& d_o, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                     const LlsaOptions& options) {
  if (options.backend == Backend::cuda) {
    SPARSA_RETURN_IF_ERROR(check_backward(q, k, v, out, lse, d_o, dq, dk, dv, options));
    const llsa_cuda::Call c = cuda_backward_call(q, k, v, out, lse, d_o, dq, dk, dv, nullptr, options);
    SPARSA_RETURN_IF_ERROR(llsa_cuda::check(q, k, c.levels, c.options));
    return llsa_cuda::backward(c, nullptr);
  }
  Result<LlsaPlan> plan = llsa_plan(q, k, options);
  if (!plan.ok()) return plan.status();
  return llsa_backward(q, k, v, *plan, out, lse, d_o, dq, dk, dv, options);
}

}  // namespace sparsa
