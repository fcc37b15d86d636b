// `llsa`: Log-linear Sparse Attention (docs/llsa.md): coarse-to-fine top-K selection over
// a mean-pooled pyramid, then one softmax over the selected fine blocks and the coarse
// levels (KV enrichment). The plan summary lists, for batch 0 / head 0, the key tokens
// each query token keeps at every level.
#include "methods.h"
#include "methods/selectors.h"
#include "params.h"
#include "sparsa/layout.h"
#include "sparsa/llsa.h"
#include "util.h"

namespace sparsa::cli {
namespace {

constexpr int64_t kMaxPlanRowsShown = 64;

}  // namespace

Result<LlsaOptions> llsa_options_from(const MethodInputs& in) {
  const Params& p = in.params;
  SPARSA_RETURN_IF_ERROR(
      check_known_params("llsa", p, {"block", "topk", "levels", "enrich", "dedupe", "layout", "height", "width"}));
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

Result<std::vector<int32_t>> llsa_token_order(const MethodInputs& in) {
  const Params& p = in.params;
  auto name = param_string(p, "layout", "row_major");
  if (!name.ok()) return name.status();
  auto layout = parse_token_layout(*name);
  if (!layout.ok()) return invalid_argument("params: " + layout.status().message());
  const bool sides = p.contains("height") || p.contains("width");
  if (*layout == TokenLayout::row_major && !sides) return std::vector<int32_t>{};
  auto height = param_int(p, "height", 0, 1, int64_t{1} << 30);
  if (!height.ok()) return height.status();
  auto width = param_int(p, "width", 0, 1, int64_t{1} << 30);
  if (!width.ok()) return width.status();
  if (!p.contains("height") || !p.contains("width")) {
    return invalid_argument("params: layout: an image layout needs -P height=H -P width=W (the tokens are an H x W "
                            "image in row-major order)");
  }
  const int64_t n = *height * *width;
  if (in.q.shape[2] != n || in.k.shape[2] != n) {
    return invalid_argument("params: height x width: " + std::to_string(*height) + " x " + std::to_string(*width) +
                            " = " + std::to_string(n) + " tokens, but len_q is " + std::to_string(in.q.shape[2]) +
                            " and len_kv " + std::to_string(in.k.shape[2]) + " (they must all be equal)");
  }
  return layout_permutation(*height, *width, *layout);
}

Status permuted_copy(const Tensor& in, const std::vector<int32_t>& perm, HostArray* out) {
  *out = HostArray(in.dtype, in.shape_vector());
  return permute_tokens(in, perm, out->view());
}

namespace {

Result<MethodOutput> run_llsa(const MethodInputs& given) {
  Result<LlsaOptions> options = llsa_options_from(given);
  if (!options.ok()) return options.status();
  const LlsaOptions& o = *options;
  // An image layout: LLSA runs on the tokens in Z-order / Hilbert order (its pooled blocks are
  // then square patches) and O and LSE come back in the input's row-major order.
  Result<std::vector<int32_t>> order = llsa_token_order(given);
  if (!order.ok()) return order.status();
  MethodInputs in = given;
  HostArray q_perm, k_perm, v_perm;
  if (!order->empty()) {
    SPARSA_RETURN_IF_ERROR(permuted_copy(given.q, *order, &q_perm));
    SPARSA_RETURN_IF_ERROR(permuted_copy(given.k, *order, &k_perm));
    SPARSA_RETURN_IF_ERROR(permuted_copy(given.v, *order, &v_perm));
    in.q = q_perm.view();
    in.k = k_perm.view();
    in.v = v_perm.view();
  }

  const double t0 = now_seconds();
  Result<LlsaPlan> plan = llsa_plan(in.q, in.k, o);
  if (!plan.ok()) return plan.status();
  const double t1 = now_seconds();
  AttentionOutput attention;
  attention.out = HostArray(in.q.dtype, in.q.shape_vector());
  attention.lse = HostArray(DType::f32, {in.q.shape[0], in.q.shape[1], in.q.shape[2]});
  SPARSA_RETURN_IF_ERROR(llsa_forward(in.q, in.k, in.v, *plan, attention.out.view(), attention.lse.view(), o));
  if (!order->empty()) {  // back to row-major: position p of the layout is token order[p]
    const std::vector<int32_t> inverse = inverse_permutation(*order);
    HostArray out_rows;
    SPARSA_RETURN_IF_ERROR(permuted_copy(attention.out.view(), inverse, &out_rows));
    HostArray lse_rows(DType::f32, attention.lse.shape());
    const int64_t rows = in.q.shape[0] * in.q.shape[1], n = in.q.shape[2];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) lse_rows.ptr<float>()[r * n + i] = attention.lse.ptr<float>()[r * n + inverse[i]];
    attention.out = std::move(out_rows);
    attention.lse = std::move(lse_rows);
  }

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
                   "dedupe=false   leave out coarse tokens already attended at a finer level",
                   "layout=row_major  z_order or hilbert with height=H width=W: the tokens are an H x W image "
                   "(row-major); LLSA runs in that order (square pooled patches), O comes back row-major"},
    .run = run_llsa,
    .in_demo = true,
    .demo_params = Params{{"block", 16}, {"topk", 8}},
});

}  // namespace sparsa::cli
