// `sparsa plan`: build a block selector's plan (ba_att, mean_pool, xattention, llsa) on
// tensors from files or on the generated workload, print a summary, and dump the plan
// as JSON and the block mask of one (batch, head) as an SVG picture.
#include <fstream>
#include <iostream>
#include <memory>

#include "cmd_selectors.h"
#include "common.h"
#include "index_file.h"
#include "file_layout.h"
#include "methods/selectors.h"
#include "sparsa/io.h"
#include "sparsa/workload.h"
#include "svg.h"
#include "util.h"

namespace sparsa::cli {
namespace {


struct PlanOptions {
  std::string method = "ba_att", q, k, json_path, svg_path, index_path, backend = "cpu", layout = "bhsd",
              mask = "none";
  std::vector<std::string> params;
  long long length = 4096;
  int heads = 8, kv_heads = 2, head_dim = 64, threads = 0, head = 0, batch = 0;
  std::uint64_t seed = 0;
};

// The kept blocks of one (batch, head) as a grid: rows are query blocks, columns key
// blocks, a filled cell is a visited pair. A plan with perm_q / perm_kv (BA-Att's norm sort)
// forms its blocks over sorted tokens, so block i is not tokens [i*B, (i+1)*B): the axes
// and a note below the grid say which order each axis is in.
std::string mask_svg(const BlockIndexBuffer& plan, int64_t batch, int64_t head, const std::string& title) {
  const int64_t nq = plan.num_q_blocks, nk = plan.num_kv_blocks, heads = plan.counts.shape()[1];
  const double cell = std::max(1.0, std::min(12.0, 640.0 / static_cast<double>(std::max(nq, nk))));
  const double left = 40, top = 40, width = cell * nk, height = cell * nq;
  const bool sorted_q = !plan.perm_q.empty(), sorted_kv = !plan.perm_kv.empty();
  const char* kv_order = sorted_kv ? "norm-sorted order" : "token order";
  const char* q_order = sorted_q ? "norm-sorted order" : "token order";
  std::string s = format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\">\n",
                         std::max(left + width + 20, 560.0), top + height + (sorted_q || sorted_kv ? 50 : 30));
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s += format("<text x=\"%.0f\" y=\"20\" font-family=\"sans-serif\" font-size=\"13\">", left) + title + "</text>\n";
  s += format("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#f4f4f4\" stroke=\"#999\"/>\n", left, top,
              width, height);
  const int64_t cap = plan.indices.shape()[3];
  for (int64_t qb = 0; qb < nq; ++qb) {
    const int64_t row = (batch * heads + head) * nq + qb;
    const int32_t count = plan.counts.ptr<int32_t>()[row];
    for (int32_t slot = 0; slot < count; ++slot) {
      const int32_t kb = plan.indices.ptr<int32_t>()[row * cap + slot];
      s += format("<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"#1f4e9c\"/>\n", left + kb * cell,
                  top + qb * cell, cell, cell);
    }
  }
  s += format("<text x=\"%.0f\" y=\"%.0f\" font-family=\"sans-serif\" font-size=\"11\">key blocks (%lld, %s) &#8594;</text>\n",
              left, top + height + 18, static_cast<long long>(nk), kv_order);
  s += format("<text x=\"12\" y=\"%.0f\" font-family=\"sans-serif\" font-size=\"11\" transform=\"rotate(-90 12 %.0f)\">"
              "query blocks (%lld, %s) &#8594;</text>\n",
              top + height, top + height, static_cast<long long>(nq), q_order);
  if (sorted_q || sorted_kv) {
    s += format("<text x=\"%.0f\" y=\"%.0f\" font-family=\"sans-serif\" font-size=\"11\">blocks group tokens sorted "
                "by norm (perm_q / perm_kv), not consecutive positions: block i is the i-th group of the sort</text>\n",
                left, top + height + 36);
  }
  return s + "</svg>\n";
}

nlohmann::json plan_json(const BlockIndexBuffer& plan, const std::string& method, const Params& params) {
  nlohmann::json j;
  j["method"] = method;
  j["params"] = params;
  j["block_q"] = plan.block_q;
  j["block_kv"] = plan.block_kv;
  j["num_q_blocks"] = plan.num_q_blocks;
  j["num_kv_blocks"] = plan.num_kv_blocks;
  const auto& shape = plan.counts.shape();
  j["shape"] = {shape[0], shape[1], shape[2]};
  const int64_t cap = plan.indices.shape()[3];
  nlohmann::json rows = nlohmann::json::array();  // [batch][head][query block] -> kept key blocks
  for (int64_t b = 0; b < shape[0]; ++b) {
    nlohmann::json heads = nlohmann::json::array();
    for (int64_t h = 0; h < shape[1]; ++h) {
      nlohmann::json blocks = nlohmann::json::array();
      for (int64_t qb = 0; qb < shape[2]; ++qb) {
        const int64_t row = (b * shape[1] + h) * shape[2] + qb;
        const int32_t* ix = plan.indices.ptr<int32_t>() + row * cap;
        blocks.push_back(std::vector<int32_t>(ix, ix + plan.counts.ptr<int32_t>()[row]));
      }
      heads.push_back(std::move(blocks));
    }
    rows.push_back(std::move(heads));
  }
  j["indices"] = std::move(rows);
  auto perm = [](const HostArray& p) -> nlohmann::json {
    if (p.empty()) return nullptr;
    return std::vector<int32_t>(p.ptr<int32_t>(), p.ptr<int32_t>() + p.numel());  // flat [batch, heads, len]
  };
  j["perm_q"] = perm(plan.perm_q);
  j["perm_kv"] = perm(plan.perm_kv);
  return j;
}

Outcome run_plan(const PlanOptions& o) {
  if (o.method != "ba_att" && o.method != "mean_pool" && o.method != "xattention" && o.method != "llsa") {
    return usage_error(
        invalid_argument("--method: plan supports ba_att, mean_pool, xattention and llsa, got '" + o.method + "'"));
  }
  Result<Params> params = parse_params(o.params);
  if (!params.ok()) return usage_error(params.status());
  Result<Backend> backend = parse_backend_flag(o.backend);
  if (!backend.ok()) return usage_error(backend.status());
  Result<FileLayout> layout = parse_layout(o.layout);
  if (!layout.ok()) return usage_error(layout.status());
  Result<Mask> mask = parse_mask(o.mask, "--mask");
  if (!mask.ok()) return usage_error(mask.status());
  if (!mask->is_none() && o.method == "llsa") {
    return usage_error(invalid_argument("--mask: only ba_att, mean_pool and xattention plans see a mask (with -P "
                                        "mask_aware=true), not llsa"));
  }
  if (o.threads < 0 || o.threads > kMaxThreads) return usage_error(invalid_argument("--threads: expected 0.." + std::to_string(kMaxThreads)));
  if (o.q.empty() != o.k.empty()) return usage_error(invalid_argument("--q and --k: give both or neither (neither: the generated workload)"));
  if (!o.svg_path.empty()) {
    Status s = check_output_path("--svg", o.svg_path, {".svg"});
    if (!s.ok()) return usage_error(s);
  }
  if (!o.index_path.empty()) {
    Status s = check_output_path("--index", o.index_path, {".safetensors"});
    if (!s.ok()) return usage_error(s);
  }
  if (!o.json_path.empty() && o.json_path != "-") {
    Status s = check_output_path("--json", o.json_path, {".json"});
    if (!s.ok()) return usage_error(s);
  }
  const WorkloadConfig c = workload_of(o.seed, o.heads, o.kv_heads, o.length, o.head_dim);
  InputTensors inputs;
  if (Outcome loaded = load_inputs_or_workload(o.q, o.k, nullptr, c, &inputs); loaded.exit_code != 0) return loaded;
  const HostArray &q = inputs.q, &k = inputs.k;
  const std::string& source = inputs.source;
  MethodInputs in;
  in.q = swap_layout(q.view(), *layout);
  in.k = swap_layout(k.view(), *layout);
  in.options.backend = *backend;
  in.options.num_threads = o.threads;
  in.options.mask = *mask;
  in.params = *params;
  const double t0 = now_seconds();
  Result<BlockIndexBuffer> plan = Status{};
  std::string llsa_text;  // llsa: the level-by-level printout of (batch, head)
  nlohmann::json llsa_summary;
  if (o.method == "llsa") {
    // The fine level of LLSA's plan is a BlockIndex (query blocks -> key blocks); the
    // coarse levels it also attends to (KV enrichment) are listed in the printout.
    auto options = llsa_options_from(in);
    if (!options.ok()) return method_error(options.status());
    // An image layout (-P layout=z_order ...): the plan is over the tokens in that order.
    auto order = llsa_token_order(in);
    if (!order.ok()) return method_error(order.status());
    HostArray q_perm, k_perm;
    if (!order->empty()) {
      if (Status s = permuted_copy(in.q, *order, &q_perm); !s.ok()) return method_error(s);
      if (Status s = permuted_copy(in.k, *order, &k_perm); !s.ok()) return method_error(s);
      in.q = q_perm.view();
      in.k = k_perm.view();
    }
    Result<LlsaPlan> llsa = llsa_plan(in.q, in.k, *options);
    if (!llsa.ok()) return method_error(llsa.status());
    if (o.batch >= 0 && o.batch < llsa->batch && o.head >= 0 && o.head < llsa->heads_q) {
      llsa_text = llsa->to_string(o.batch, o.head, 16);
    }
    llsa_summary = {{"levels", llsa->levels},
                    {"level_len", llsa->level_len},
                    {"keys_per_query", llsa->mean_keys_per_query()},
                    {"enrich", llsa->enrich},
                    {"dedupe", llsa->dedupe}};
    plan = llsa->fine_index();
  } else if (o.method == "xattention") {
    auto options = xattention_options_from(in);
    if (!options.ok()) return method_error(options.status());
    plan = xattention_plan(in.q, in.k, *options);
  } else {
    auto options = ba_att_options_from(o.method, in);
    if (!options.ok()) return method_error(options.status());
    plan = ba_att_plan(in.q, in.k, *options);
  }
  if (!plan.ok()) return method_error(plan.status());
  const double seconds = now_seconds() - t0;
  const int64_t batch = plan->counts.shape()[0], heads = plan->counts.shape()[1];
  if (o.batch < 0 || o.batch >= batch || o.head < 0 || o.head >= heads) {
    return usage_error(invalid_argument(format("--batch/--head: (%d, %d) is outside the plan's [%lld, %lld]", o.batch,
                                               o.head, static_cast<long long>(batch), static_cast<long long>(heads))));
  }
  const double density = block_index_density(plan->view(), in.q.shape[2], in.k.shape[2]);
  std::cout << o.method << " plan (" << params_text(*params) << ") on " << source << "\n"
            << format("  blocks %dx%d, %lld x %lld per head, capacity %lld, density %.4f, perm_q %s, perm_kv %s, %.4f s\n",
                      plan->block_q, plan->block_kv, static_cast<long long>(plan->num_q_blocks),
                      static_cast<long long>(plan->num_kv_blocks), static_cast<long long>(plan->indices.shape()[3]),
                      density, plan->perm_q.empty() ? "no" : "yes", plan->perm_kv.empty() ? "no" : "yes", seconds);
  if (!llsa_text.empty()) std::cout << llsa_text;
  if (!o.json_path.empty()) {
    nlohmann::json j = plan_json(*plan, o.method, *params);
    if (!llsa_summary.is_null()) j["llsa"] = llsa_summary;
    const std::string text = json_text(j);
    if (o.json_path == "-") {
      std::cout << text << "\n";
    } else {
      Status s = write_text_file("--json", o.json_path, text + "\n");
      if (!s.ok()) return runtime_error(s);
      std::cout << "  plan -> " << o.json_path << "\n";
    }
  }
  if (!o.index_path.empty()) {
    Status s = write_block_index(o.index_path, *plan);
    if (!s.ok()) return runtime_error(Status{s.code(), "--index: " + s.message()});
    std::cout << "  index -> " << o.index_path << " (sparsa run --method block_sparse --index " << o.index_path
              << ")\n";
  }
  if (!o.svg_path.empty()) {
    const std::string title = format("%s, batch %d head %d, density %.3f", o.method.c_str(), o.batch, o.head, density);
    Status s = write_text_file("--svg", o.svg_path, mask_svg(*plan, o.batch, o.head, title));
    if (!s.ok()) return runtime_error(s);
    std::cout << "  mask -> " << o.svg_path << "\n";
  }
  return success();
}

}  // namespace

Subcommand add_plan_command(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand("plan", "build a block selector's plan; dump it as JSON and its mask as SVG");
  cmd->add_option("--method", o->method, "ba_att, mean_pool, xattention or llsa")->capture_default_str();
  cmd->add_option("--q", o->q, "queries (.npy/.safetensors); default: the generated workload");
  cmd->add_option("--k", o->k, "keys (with --q)");
  cmd->add_option("--layout", o->layout, "bhsd ([batch, heads, seq, head_dim]) or bshd ([batch, seq, heads, head_dim])")
      ->capture_default_str();
  cmd->add_option("-P,--param", o->params, "method parameter key=value (repeatable)")->allow_extra_args(false);
  cmd->add_option("--length", o->length, "workload length (without --q/--k)")->capture_default_str();
  cmd->add_option("--heads", o->heads, "workload query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "workload key/value heads")->capture_default_str();
  cmd->add_option("--head-dim", o->head_dim, "workload head dimension")->capture_default_str();
  cmd->add_option("--seed", o->seed, "workload seed")->capture_default_str();
  cmd->add_option("--backend", o->backend, "cpu or cpu_ref")->capture_default_str();
  cmd->add_option("--mask", o->mask,
                  "ba_att / mean_pool / xattention: the mask a -P mask_aware=true selection sees (causal, block_causal(B), "
                  "sliding_window(W)...)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all cores)");
  cmd->add_option("--index", o->index_path,
                  "write the plan as the .safetensors index file that `run --method block_sparse --index` reads");
  cmd->add_option_function<std::string>(
         "--json", [o](const std::string& v) { o->json_path = v.empty() ? "-" : v; },
         "[FILE] write the plan as JSON to FILE (bare or '-': on stdout)")
      ->expected(0, 1);
  cmd->add_option("--svg", o->svg_path, "write the block mask of one (batch, head) as SVG");
  cmd->add_option("--batch", o->batch, "batch of the SVG mask")->capture_default_str();
  cmd->add_option("--head", o->head, "query head of the SVG mask")->capture_default_str();
  return {cmd, [o] { return run_plan(*o); }};
}

}  // namespace sparsa::cli
