// Internal: a selector's attention (BA-Att, XAttention): its plan, then the block-sparse executor
// over it. The executor takes the selector's scale, backend, threads, finiteness check, stream and
// mask; the plan is not checked again (the selector has just made it, on this backend). Options:
// any selector's options struct with those fields (BaAttOptions, XAttentionOptions).
#pragma once

#include "core/attention_params.h"
#include "sparsa/attention.h"

namespace sparsa::detail {

template <class Options>
AttentionOptions executor_options(const Options& options) {
  AttentionOptions attention;
  attention.scale = options.scale;
  attention.backend = options.backend;
  attention.num_threads = options.num_threads;
  attention.check_finite = options.check_finite;
  attention.check_index = false;
  attention.stream = options.stream;
  attention.mask = options.mask;
  return attention;
}

// Into out and lse (on the options' backend). make_plan() returns a Result<BlockIndexBuffer>.
template <class Options, class MakePlan>
Status attention_over_plan(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                           const Options& options, MakePlan&& make_plan) {
  auto plan = make_plan();
  if (!plan.ok()) return plan.status();
  return block_sparse(q, k, v, plan->view(), out, lse, executor_options(options));
}

// Host arrays (on the cuda backend: outputs in device memory of q's device, copied back).
template <class Options, class MakePlan>
Result<AttentionOutput> attention_over_plan(const Tensor& q, const Tensor& k, const Tensor& v, const Options& options,
                                            MakePlan&& make_plan) {
  auto plan = make_plan();
  if (!plan.ok()) return plan.status();
  if (options.backend != Backend::cuda) return block_sparse(q, k, v, plan->view(), executor_options(options));
  return device_outputs_to_host(q, options.stream, [&](const Tensor& out, const Tensor& lse) {
    return block_sparse(q, k, v, plan->view(), out, lse, executor_options(options));
  });
}

}  // namespace sparsa::detail
