// `llsa`: Log-linear Sparse Attention (docs/llsa.md): coarse-to-fine top-K selection over
// a mean-pooled pyramid, then one softmax over the selected fine blocks and the coarse
// levels (KV enrichment). The plan summary lists, for batch 0 / head 0, the key tokens
// each query token keeps at every level.
#include "methods.h"
#include "methods/selectors.h"
#include "params.h"
#include "sparsa/llsa.h"
#include "util.h"

namespace sparsa::cli {
namespace {

constexpr int64_t kMaxPlanRowsShown = 64;

}  // namespace

Result<LlsaOptions> llsa_options_from(const MethodInputs& in) {
  const Params& p = in.params;
  SPARSA_RETURN_IF_ERROR(check_known_params("llsa", p, {"block", "topk", "levels", "enrich", "dedupe"}));
  auto block = param_int(p, "block", 16, 2, 4096);
  if (!block.ok()) return block.status();
  auto topk = param_int(p, "topk", 8, 1, 1 << 20);
  if (!topk.ok()) return topk.status();
  auto levels = param_int(p, "levels", -1, -1, 16);
  if (!levels.ok()) return levels.status();
  if (*levels == 0) return invalid_argument("params: levels: expected -1 (automatic) or 1..16, got 0");
  auto enrich = param_bool(p, "enrich", true);
  if (!enrich.ok()) return enrich.status();
  auto dedupe = param_bool(p, "dedupe", false);
  if (!dedupe.ok()) return dedupe.status();

  LlsaOptions o;
  o.block = static_cast<int>(*block);
  o.topk = static_cast<int>(*topk);
  o.levels = static_cast<int>(*levels);
  o.enrich = *enrich;
  o.dedupe = *dedupe;
  o.scale = in.options.scale;
  o.backend = in.options.backend;
  o.num_threads = in.options.num_threads;
  o.check_finite = in.options.check_finite;
  return o;
}

namespace {

Result<MethodOutput> run_llsa(const MethodInputs& in) {
  Result<LlsaOptions> options = llsa_options_from(in);
  if (!options.ok()) return options.status();
  const LlsaOptions& o = *options;

  const double t0 = now_seconds();
  Result<LlsaPlan> plan = llsa_plan(in.q, in.k, o);
  if (!plan.ok()) return plan.status();
  const double t1 = now_seconds();
  AttentionOutput attention;
  attention.out = HostArray(in.q.dtype, in.q.shape_vector());
  attention.lse = HostArray(DType::f32, {in.q.shape[0], in.q.shape[1], in.q.shape[2]});
  SPARSA_RETURN_IF_ERROR(llsa_forward(in.q, in.k, in.v, *plan, attention.out.view(), attention.lse.view(), o));

  MethodOutput output;
  output.attention = std::move(attention);
  const double keys = plan->mean_keys_per_query();
  // Keys visited per query over the sequence length (coarse tokens count once each).
  output.density = std::min(1.0, keys / static_cast<double>(plan->len));
  output.select_seconds = t1 - t0;
  nlohmann::json summary;
  summary["block"] = plan->block;
  summary["topk"] = plan->topk;
  summary["levels"] = plan->levels;
  summary["enrich"] = plan->enrich;
  summary["dedupe"] = plan->dedupe;
  summary["level_len"] = plan->level_len;
  summary["keys_per_query"] = keys;
  nlohmann::json picks = nlohmann::json::object();
  for (int l = plan->levels; l >= 1; --l) {
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t i = 0; i < std::min(kMaxPlanRowsShown, plan->level_len[l]); ++i) {
      nlohmann::json row = nlohmann::json::array();
      for (int s = 0; s < plan->pick_count(l, 0, 0, i); ++s) row.push_back(plan->pick(l, 0, 0, i, s));
      rows.push_back(std::move(row));
    }
    picks["level_" + std::to_string(l)] = std::move(rows);
  }
  summary["picks_batch0_head0"] = std::move(picks);
  summary["text"] = plan->to_string(0, 0, kMaxPlanRowsShown);
  output.plan = std::move(summary);
  return output;
}

}  // namespace

SPARSA_REGISTER_METHOD(Method{
    .name = "llsa",
    .summary = "log-linear sparse attention: coarse-to-fine top-K over a pooled pyramid with KV enrichment",
    .param_help = {"block=16       tokens pooled per coarse token (also the fine block size)",
                   "topk=8         picks per query token at every level",
                   "levels=-1      pyramid levels L; -1 = floor(log_block N) - 1, at least 1",
                   "enrich=true    attend to the coarse levels too (KV enrichment)",
                   "dedupe=false   leave out coarse tokens already attended at a finer level"},
    .run = run_llsa,
    .in_demo = true,
    .demo_params = Params{{"block", 16}, {"topk", 8}},
});

}  // namespace sparsa::cli
