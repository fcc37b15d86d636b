// `quest`: QUEST page selection and attention over the selected pages (sparsa/quest.h).
// Every key is prefix (no mask): k and v are paged (16 tokens), each (head, query row)
// keeps its top budget/16 pages by sum_d max(q_d * max_d, q_d * min_d).
#include "methods.h"
#include "params.h"
#include "util.h"
#include "sparsa/quest.h"

namespace sparsa::cli {
namespace {

Result<MethodOutput> run_quest(const MethodInputs& in) {
  const Params& p = in.params;
  SPARSA_RETURN_IF_ERROR(
      check_known_params("quest", p, {"budget", "selector", "force_first", "force_last", "group", "union"}));
  PageSelectOptions select;
  auto budget = param_int(p, "budget", 256, 16, int64_t{1} << 40);
  if (!budget.ok()) return budget.status();
  select.budget = *budget;
  auto selector = param_string(p, "selector", "quest");
  if (!selector.ok()) return selector.status();
  auto parsed = parse_page_selector(*selector);
  if (!parsed.ok()) return invalid_argument("params: " + parsed.status().message());
  select.selector = *parsed;
  auto first = param_bool(p, "force_first", false);
  if (!first.ok()) return first.status();
  select.force_first = *first;
  auto last = param_bool(p, "force_last", true);
  if (!last.ok()) return last.status();
  select.force_last = *last;
  auto group = param_string(p, "group", "per_head");
  if (!group.ok()) return group.status();
  if (*group != "per_head" && *group != "shared") {
    return invalid_argument("params: group: expected per_head or shared, got '" + *group + "'");
  }
  select.group = *group == "shared" ? GroupPolicy::shared : GroupPolicy::per_head;
  if (Status s = validate(select, 16); !s.ok()) return invalid_argument("params: " + s.message());
  PagedAttentionOptions options;
  options.attention = in.options;
  auto attend_union = param_bool(p, "union", false);
  if (!attend_union.ok()) return attend_union.status();
  options.attend_union = *attend_union;

  const double t0 = now_seconds();
  auto result = quest_attention(in.q, in.k, in.v, select, options);
  const double t1 = now_seconds();
  if (!result.ok()) return result.status();
  MethodOutput output;
  output.attention = std::move(result->attention);
  output.density = result->density;
  output.select_seconds = result->select_seconds;
  output.plan = nlohmann::json{{"budget", select.budget},
                               {"selector", page_selector_name(select.selector)},
                               {"group", *group},
                               {"pages_loaded", result->pages_loaded},
                               {"density", result->density},
                               {"seconds", t1 - t0}};
  return output;
}

}  // namespace

SPARSA_REGISTER_METHOD(Method{
    .name = "quest",
    .summary = "QUEST: per-query top pages (16 tokens) by the min/max upper bound of q.k, over a paged KV",
    .param_help = {"budget=256     tokens per query, a multiple of 16 (budget/16 pages)",
                   "selector=quest quest (min/max bound) or pooled (page-mean key)",
                   "force_first=false, force_last=true  always keep the first / last page",
                   "group=per_head per_head (the kv head loads the union) or shared (one list per GQA group)",
                   "union=false    rows attend every page their kv head loaded"},
    .run = run_quest,
    .in_demo = true,
    .demo_params = Params{{"budget", 512}},
});

}  // namespace sparsa::cli
