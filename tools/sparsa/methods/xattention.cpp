// `xattention`: the XAttention baseline (antidiagonal scoring, cumulative threshold;
// docs/ba_att.md §2), then the block-sparse executor.
#include <cstdint>

#include "methods.h"
#include "params.h"
#include "methods/selectors.h"
#include "sparsa/xattention.h"
#include "util.h"

namespace sparsa::cli {
namespace {

constexpr int64_t kMaxBlock = 1 << 20;

}  // namespace

Result<XAttentionOptions> xattention_options_from(const MethodInputs& in) {
  const Params& p = in.params;
  SPARSA_RETURN_IF_ERROR(check_known_params(
      "xattention", p, {"block", "stride", "tau", "density", "kappa", "force_first", "force_diagonal", "mask_aware"}));
  XAttentionOptions o;
  auto block = param_int(p, "block", 64, 1, kMaxBlock);
  if (!block.ok()) return block.status();
  o.block_q = o.block_kv = static_cast<int>(*block);
  auto stride = param_int(p, "stride", 8, 1, kMaxBlock);
  if (!stride.ok()) return stride.status();
  o.stride = static_cast<int>(*stride);
  const int given = p.contains("density") + p.contains("kappa") + p.contains("tau");
  if (given > 1) return invalid_argument("params: density, kappa and tau are alternative budgets for xattention; give one");
  if (p.contains("kappa")) {
    auto kappa = param_int(p, "kappa", 1, 1, INT32_MAX);
    if (!kappa.ok()) return kappa.status();
    o.budget = Budget::top_kappa(*kappa);
  } else if (p.contains("density")) {
    auto density = param_real(p, "density", 0.1, 0.0, 1.0, /*min_open=*/true);
    if (!density.ok()) return density.status();
    o.budget = Budget::density(*density);
  } else {
    auto tau = param_real(p, "tau", 0.9, 0.0, 1.0, /*min_open=*/true);
    if (!tau.ok()) return tau.status();
    o.budget = Budget::mass(*tau);
  }
  auto first = param_bool(p, "force_first", true);
  if (!first.ok()) return first.status();
  auto diagonal = param_bool(p, "force_diagonal", true);
  if (!diagonal.ok()) return diagonal.status();
  o.force_first = *first;
  o.force_diagonal = *diagonal;
  o.scale = in.options.scale;
  o.backend = in.options.backend;
  o.num_threads = in.options.num_threads;
  o.check_finite = in.options.check_finite;
  o.mask = in.options.mask;
  auto mask_aware = param_bool(p, "mask_aware", false);
  if (!mask_aware.ok()) return mask_aware.status();
  o.mask_aware = *mask_aware;
  return o;
}

namespace {

Result<MethodOutput> run_xattention(const MethodInputs& in) {
  auto options = xattention_options_from(in);
  if (!options.ok()) return options.status();
  const double t0 = now_seconds();
  auto plan = xattention_plan(in.q, in.k, *options);
  if (!plan.ok()) return plan.status();
  auto out = execute_plan(in, *plan, now_seconds() - t0);
  if (!out.ok()) return out;
  out->plan["stride"] = options->stride;
  out->plan["budget"] = describe(options->budget);
  return out;
}

}  // namespace

SPARSA_REGISTER_METHOD(Method{
    .name = "xattention",
    .summary = "XAttention baseline: antidiagonal scoring with stride S, cumulative threshold, first + diagonal forced",
    .param_help = {"block=64       tokens per block (query and key)",
                   "stride=8       antidiagonal stride S (divides block)",
                   "tau=0.9        keep blocks until this share of the row's mass (or density=F, or kappa=K)",
                   "force_first=true, force_diagonal=true  always keep key block 0 and the diagonal block",
                   "mask_aware=false  the selection sees --mask (softmax over the visible key groups; as ba_att's)"},
    .run = run_xattention,
    .in_demo = true,
    .demo_params = Params{{"block", 64}, {"density", 0.1}},  // matched to ba_att; tau=0.9 keeps most blocks on the workload
    .takes_mask = true,
});

}  // namespace sparsa::cli
