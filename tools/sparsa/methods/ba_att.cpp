// `ba_att`: Block Approximate Sparse Attention (docs/ba_att.md) — the norm-sorted,
// covariance-compensated mean-pool selector, then the block-sparse executor.
#include <cstdint>

#include "methods.h"
#include "params.h"
#include "methods/selectors.h"
#include "sparsa/ba_att.h"
#include "util.h"

namespace sparsa::cli {
namespace {

constexpr int64_t kMaxBlock = 1 << 20;

// One budget from density= / kappa= / tau= (at most one; density 0.1 by default).
Result<Budget> budget_param(const std::string& method, const Params& p, double default_density) {
  const int given = p.contains("density") + p.contains("kappa") + p.contains("tau");
  if (given > 1) {
    return invalid_argument("params: density, kappa and tau are alternative budgets for " + method + "; give one");
  }
  if (p.contains("kappa")) {
    auto kappa = param_int(p, "kappa", 1, 1, INT32_MAX);
    if (!kappa.ok()) return kappa.status();
    return Budget::top_kappa(*kappa);
  }
  if (p.contains("tau")) {
    auto tau = param_real(p, "tau", 0.9, 0.0, 1.0, /*min_open=*/true);
    if (!tau.ok()) return tau.status();
    return Budget::mass(*tau);
  }
  auto density = param_real(p, "density", default_density, 0.0, 1.0, /*min_open=*/true);
  if (!density.ok()) return density.status();
  return Budget::density(*density);
}

Result<std::pair<int, int>> block_params(const Params& p, int fallback) {
  if (p.contains("block") && (p.contains("block_q") || p.contains("block_kv"))) {
    return invalid_argument("params: block sets both block_q and block_kv; give either block or block_q/block_kv");
  }
  auto block = param_int(p, "block", fallback, 1, kMaxBlock);
  if (!block.ok()) return block.status();
  auto block_q = param_int(p, "block_q", *block, 1, kMaxBlock);
  if (!block_q.ok()) return block_q.status();
  auto block_kv = param_int(p, "block_kv", *block, 1, kMaxBlock);
  if (!block_kv.ok()) return block_kv.status();
  return std::pair<int, int>{static_cast<int>(*block_q), static_cast<int>(*block_kv)};
}

}  // namespace

Result<BaAttOptions> ba_att_options_from(const std::string& method, const MethodInputs& in) {
  Params p = in.params;
  if (method == "mean_pool") {
    SPARSA_RETURN_IF_ERROR(
        check_known_params(method, p, {"block", "block_q", "block_kv", "density", "kappa", "tau", "mask_aware"}));
    p["sort"] = false;
    p["compensate"] = false;
  }
  SPARSA_RETURN_IF_ERROR(check_known_params(method, p,
                                            {"block", "block_q", "block_kv", "density", "kappa", "tau", "sort",
                                             "sort_q", "sort_k", "window", "compensate", "compensation", "beta",
                                             "mask_aware"}));
  BaAttOptions o;
  auto blocks = block_params(p, 64);
  if (!blocks.ok()) return blocks.status();
  o.block_q = blocks->first;
  o.block_kv = blocks->second;
  auto budget = budget_param(method, p, 0.1);
  if (!budget.ok()) return budget.status();
  o.budget = *budget;
  if (p.contains("sort") && (p.contains("sort_q") || p.contains("sort_k"))) {
    return invalid_argument("params: sort sets both sort_q and sort_k; give either sort or sort_q/sort_k");
  }
  auto sort = param_bool(p, "sort", true);
  if (!sort.ok()) return sort.status();
  auto sort_q = param_bool(p, "sort_q", *sort);
  if (!sort_q.ok()) return sort_q.status();
  auto sort_k = param_bool(p, "sort_k", *sort);
  if (!sort_k.ok()) return sort_k.status();
  o.sort_q = *sort_q;
  o.sort_k = *sort_k;
  auto window = param_int(p, "window", 0, 0, INT64_MAX);
  if (!window.ok()) return window.status();
  o.sort_window = *window;
  auto compensate = param_bool(p, "compensate", true);
  if (!compensate.ok()) return compensate.status();
  o.compensate = *compensate;
  auto kind = param_string(p, "compensation", "diagonal");
  if (!kind.ok()) return kind.status();
  auto compensation = parse_compensation(*kind);
  if (!compensation.ok()) return invalid_argument("params: " + compensation.status().message());
  o.compensation = *compensation;
  auto beta = param_real(p, "beta", 1.0, -1e6, 1e6);
  if (!beta.ok()) return beta.status();
  o.beta = static_cast<float>(*beta);
  o.scale = in.options.scale;
  o.backend = in.options.backend;
  o.num_threads = in.options.num_threads;
  o.check_finite = in.options.check_finite;
  o.mask = in.options.mask;
  auto mask_aware = param_bool(p, "mask_aware", false);
  if (!mask_aware.ok()) return mask_aware.status();
  o.mask_aware = *mask_aware;
  if (o.mask_aware && (o.sort_q || o.sort_k)) {
    return invalid_argument("params: mask_aware needs sort=false (a norm sort moves tokens across the mask's blocks)");
  }
  return o;
}

Result<MethodOutput> execute_plan(const MethodInputs& in, const BlockIndexBuffer& plan, double select_seconds) {
  auto attention = block_sparse(in.q, in.k, in.v, plan.view(), in.options);
  if (!attention.ok()) return attention.status();
  MethodOutput out;
  out.attention = std::move(attention).value();
  out.density = block_index_density(plan.view(), in.q.shape[2], in.k.shape[2]);
  out.select_seconds = select_seconds;
  out.plan["block_q"] = plan.block_q;
  out.plan["block_kv"] = plan.block_kv;
  out.plan["num_q_blocks"] = plan.num_q_blocks;
  out.plan["num_kv_blocks"] = plan.num_kv_blocks;
  out.plan["capacity"] = plan.indices.shape().size() == 4 ? plan.indices.shape()[3] : 0;
  out.plan["density"] = out.density;
  out.plan["perm_q"] = !plan.perm_q.empty();
  out.plan["perm_kv"] = !plan.perm_kv.empty();
  return out;
}

namespace {

Result<MethodOutput> run_selector(const std::string& method, const MethodInputs& in) {
  auto options = ba_att_options_from(method, in);
  if (!options.ok()) return options.status();
  const double t0 = now_seconds();
  auto plan = ba_att_plan(in.q, in.k, *options);
  if (!plan.ok()) return plan.status();
  auto out = execute_plan(in, *plan, now_seconds() - t0);
  if (!out.ok()) return out;
  out->plan["budget"] = describe(options->budget);
  out->plan["compensation"] = options->compensate ? compensation_name(options->compensation) : "off";
  out->plan["beta"] = options->beta;
  out->plan["sort_window"] = options->sort_window;
  return out;
}

Result<MethodOutput> run_ba_att(const MethodInputs& in) { return run_selector("ba_att", in); }
Result<MethodOutput> run_mean_pool(const MethodInputs& in) { return run_selector("mean_pool", in); }

}  // namespace

SPARSA_REGISTER_METHOD(Method{
    .name = "ba_att",
    .summary = "BA-Att: norm-sorted, covariance-compensated mean-pool block selector + block-sparse executor",
    .param_help = {"block=64       tokens per block (sets block_q and block_kv)",
                   "density=0.1    fraction of key blocks kept per query block (or kappa=K, or tau=T)",
                   "kappa=K        keep the K best key blocks per query block",
                   "tau=T          keep the fewest key blocks reaching softmax mass T of the row",
                   "sort=true      norm-sort Q and K (or sort_q / sort_k separately)",
                   "window=0       sort within windows of this many tokens (0: global)",
                   "compensate=true  add beta * Delta to the block logits",
                   "compensation=diagonal  diagonal (Eq. 14), exact, or trace (Eq. 13)",
                   "beta=1         compensation weight",
                   "mask_aware=false  the selection sees --mask: hidden key blocks never chosen, cut ones kept, the "
                   "budget over the visible ones (needs sort=false)"},
    .run = run_ba_att,
    .in_demo = true,
    .demo_params = Params{{"block", 64}, {"density", 0.1}},
    .takes_mask = true,
});

}  // namespace sparsa::cli

namespace sparsa::cli {
SPARSA_REGISTER_METHOD(Method{
    .name = "mean_pool",
    .summary = "plain mean-pool top-k (ba_att without sorting or compensation), the baseline of the sorting ablation",
    .param_help = {"block=64       tokens per block (sets block_q and block_kv)",
                   "density=0.1    fraction of key blocks kept per query block (or kappa=K, or tau=T)",
                   "mask_aware=false  the selection sees --mask (as ba_att's)"},
    .run = run_mean_pool,
    .in_demo = false,
    .demo_params = Params{{"block", 64}, {"density", 0.1}},
    .takes_mask = true,
});
}  // namespace sparsa::cli
