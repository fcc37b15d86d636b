// `sparsa trace`: prefix-attention methods over a block-diffusion decode trace (docs/losa.md).
#include "cmd_trace.h"

#include <algorithm>
#include <iostream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common.h"
#include "params.h"
#include "sparsa/decode_trace.h"
#include "sparsa/losa.h"
#include "svg.h"
#include "table.h"
#include "util.h"

namespace sparsa::cli {

CLI::App* add_trace_command(CLI::App& app, const std::string& name, TraceOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      name, "dense/quest/losa/reuse prefix attention over a block-diffusion decode trace, against dense");
  cmd->add_option("--methods", o.methods, "comma-separated: dense, quest, losa, reuse")->capture_default_str();
  cmd->add_option("--prefix", o.prefix, "committed tokens before the first block")->capture_default_str();
  cmd->add_option("--block", o.block, "block size, 4 to 32")->capture_default_str();
  cmd->add_option("--blocks", o.blocks, "blocks decoded (each committed after its last step)")->capture_default_str();
  cmd->add_option("--tokens-per-step", o.tokens_per_step, "tokens unmasked after each step")->capture_default_str();
  cmd->add_option("--steps", o.steps, "steps per block (0: block / tokens-per-step)")->capture_default_str();
  cmd->add_option("--unmask", o.unmask, "an unmasked token's jump, relative to its rms")->capture_default_str();
  cmd->add_option("--neighbour", o.neighbour, "its neighbours' move, relative to their rms")->capture_default_str();
  cmd->add_option("--drift", o.drift, "per-step random walk of the other tokens, relative")->capture_default_str();
  cmd->add_option("--heads", o.heads, "query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o.kv_heads, "key/value heads")->capture_default_str();
  cmd->add_option("--head-dim", o.head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of the workload and the trace")->capture_default_str();
  cmd->add_option("-P,--param", o.params,
                  "budget=256 (tokens per query), k=4 (active tokens), threshold=X (MSE, instead of k), "
                  "selector=quest|pooled, group=per_head|shared, union=false, force_first=false, force_last=true")
      ->allow_extra_args(false);
  cmd->add_option("--backend", o.backend,
                  "cpu, cpu_ref or cuda (every method and the dense reference on device 0, the trace in bf16)")
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "CPU threads (0 = all cores)");
  cmd->add_option("--repeats", o.repeats, "passes; the time is the median per step")->capture_default_str();
  cmd->add_option_function<std::string>(
         "--json",
         [&o](const std::string& v) {
           if (v.empty() || v == "-") o.json = true;
           else o.json_path = v;
         },
         "[FILE] print JSON instead of the table (with FILE: write it there, the table printed too)")
      ->expected(0, 1);
  cmd->add_option("--plot", o.plot_path, "write an SVG bar chart (CPU time, pages loaded, error per method)");
  CLI::Option* capture =
      cmd->add_option("--capture", o.capture,
                      "a trace recorded by the engine: the directory of `sparsa generate --dump-attention` (its "
                      "layer 0 too, which gives the unmasking order); the shape flags do not apply");
  CLI::Option* layer = cmd->add_option("--layer", o.layer, "with --capture: the layer whose attention is traced");
  CLI::Option* request = cmd->add_option("--request", o.request, "with --capture: the request (sequence) traced")
                             ->capture_default_str();
  layer->needs(capture);
  request->needs(capture);
  for (const char* shape : {"--prefix", "--block", "--blocks", "--tokens-per-step", "--steps", "--unmask",
                            "--neighbour", "--drift", "--heads", "--kv-heads", "--head-dim", "--seed"}) {
    capture->excludes(cmd->get_option(shape));
  }
  return cmd;
}

namespace {

Result<LosaOptions> method_options(const Params& p, Backend backend, int threads) {
  SPARSA_RETURN_IF_ERROR(check_known_params(
      "trace", p, {"budget", "k", "threshold", "selector", "group", "union", "force_first", "force_last"}));
  LosaOptions o;
  o.attention.backend = backend;
  o.attention.num_threads = threads;
  auto budget = param_int(p, "budget", 256, 1, int64_t{1} << 40);
  if (!budget.ok()) return budget.status();
  o.select.budget = *budget;
  auto k = param_int(p, "k", 4, 0, 1024);
  if (!k.ok()) return k.status();
  o.active_k = static_cast<int>(*k);
  if (p.contains("threshold")) {
    auto t = param_real(p, "threshold", 0.0, 0.0, 1e30);
    if (!t.ok()) return t.status();
    o.mse_threshold = *t;
  }
  auto selector = param_string(p, "selector", "quest");
  if (!selector.ok()) return selector.status();
  auto sel = parse_page_selector(*selector);
  if (!sel.ok()) return invalid_argument("params: " + sel.status().message());
  o.select.selector = *sel;
  auto group = param_string(p, "group", "per_head");
  if (!group.ok()) return group.status();
  if (*group != "per_head" && *group != "shared") {
    return invalid_argument("params: group: expected per_head or shared, got '" + *group + "'");
  }
  o.select.group = *group == "shared" ? GroupPolicy::shared : GroupPolicy::per_head;
  for (auto [key, field, fallback] : {std::tuple{"union", &o.attend_union, false},
                                      std::tuple{"force_first", &o.select.force_first, false},
                                      std::tuple{"force_last", &o.select.force_last, true}}) {
    auto b = param_bool(p, key, fallback);
    if (!b.ok()) return b.status();
    *field = *b;
  }
  return o;
}

}  // namespace

Outcome cmd_trace(const TraceOptions& o) {
  auto backend = parse_backend_flag(o.backend);
  if (!backend.ok()) return usage_error(backend.status());
  if (*backend == Backend::cuda) {  // before the trace is generated
    if (Status s = backend_status(Backend::cuda); !s.ok()) return runtime_error(Status(s.code(), "--backend: " + s.message()));
  }
  if (o.threads < 0) return usage_error(invalid_argument("--threads: expected >= 0, got " + std::to_string(o.threads)));
  if (o.repeats < 1 || o.repeats > 1000) {
    return usage_error(invalid_argument("--repeats: expected 1 to 1000, got " + std::to_string(o.repeats)));
  }
  auto params = parse_params(o.params);
  if (!params.ok()) return usage_error(params.status());
  if (!o.plot_path.empty()) {
    Status s = check_output_path("--plot", o.plot_path, {".svg"});
    if (!s.ok()) return usage_error(s);
  }
  if (!o.json_path.empty()) {
    Status s = check_output_path("--json", o.json_path, {".json"});
    if (!s.ok()) return usage_error(s);
  }
  auto base = method_options(*params, *backend, o.threads);
  if (!base.ok()) return usage_error(base.status());

  // The trace's shape: a captured trace's own, read first; a synthetic one's from the flags,
  // generated once the methods are known to be valid for it.
  const bool captured = !o.capture.empty();
  std::optional<DecodeTrace> trace;
  DecodeTraceConfig tc;
  int64_t skipped = 0;
  if (captured) {
    if (o.layer < 0) return usage_error(invalid_argument("--layer: expected the captured layer to trace (>= 0)"));
    if (o.request < 0) return usage_error(invalid_argument("--request: expected >= 0, got " + std::to_string(o.request)));
    auto loaded = DecodeTrace::from_capture(o.capture, o.request, o.layer, &skipped);
    if (!loaded.ok()) {
      const Status named(loaded.status().code(), "--capture: " + loaded.status().message());
      return named.code() == StatusCode::invalid_argument ? usage_error(named) : runtime_error(named);
    }
    trace.emplace(std::move(loaded).value());
    tc = trace->config();
  } else {
    tc.workload.heads_q = o.heads;
    tc.workload.heads_kv = o.kv_heads;
    tc.workload.head_dim = o.head_dim;
    tc.workload.seed = tc.seed = o.seed;
    tc.prefix_len = o.prefix;
    tc.block_size = o.block;
    tc.num_blocks = o.blocks;
    tc.tokens_per_step = o.tokens_per_step;
    tc.steps_per_block = o.steps;
    tc.unmask_move = static_cast<float>(o.unmask);
    tc.neighbour_move = static_cast<float>(o.neighbour);
    tc.drift = static_cast<float>(o.drift);
    if (Status s = validate(tc); !s.ok()) return usage_error(s);
  }
  const int heads = static_cast<int>(captured ? trace->heads_q() : o.heads);
  const int kv_heads = static_cast<int>(captured ? trace->heads_kv() : o.kv_heads);
  const int head_dim = static_cast<int>(captured ? trace->head_dim() : o.head_dim);
  const long long prefix = tc.prefix_len, block = tc.block_size, blocks = tc.num_blocks;

  std::vector<std::string> names;
  std::vector<LosaOptions> configs;
  for (size_t start = 0; start <= o.methods.size();) {
    const size_t comma = std::min(o.methods.find(',', start), o.methods.size());
    const std::string name = o.methods.substr(start, comma - start);
    start = comma + 1;
    auto m = parse_prefix_method(name);
    if (!m.ok()) return usage_error(invalid_argument("--methods: " + m.status().message()));
    LosaOptions c = *base;
    c.method = *m;
    // The checks every backend shares (the device's own, e.g. its head_dim 64 or 128, come from
    // DevicePrefixAttention::create when the run starts).
    LosaOptions generic = c;
    if (generic.attention.backend == Backend::cuda) generic.attention.backend = Backend::cpu;
    if (Status s = validate(LosaConfig{heads, kv_heads, head_dim, block}, generic); !s.ok()) {
      return usage_error(invalid_argument("params: " + s.message()));
    }
    names.push_back(name);
    configs.push_back(c);
  }

  if (captured) {
    if (!o.json) {
      std::cerr << "captured trace: " << o.capture << ", request " << o.request << ", layer " << o.layer << ": "
                << blocks << " block(s) of " << block << " tokens x " << trace->steps_per_block()
                << " steps after a prefix of " << prefix << " (" << skipped << " other forward pass(es) left out)"
                << std::endl;
    }
  } else {
    if (!o.json) std::cerr << "generating the trace (prefix " << o.prefix << ") ..." << std::endl;
    auto generated = DecodeTrace::generate(tc);
    if (!generated.ok()) return runtime_error(generated.status());
    trace.emplace(std::move(generated).value());
  }
  if (!o.json) std::cerr << "running " << o.methods << " over " << blocks * trace->steps_per_block() << " steps ..." << std::endl;
  TraceRunOptions ro;
  ro.repeats = o.repeats;
  auto runs = run_trace(*trace, configs, ro);
  if (!runs.ok()) return runtime_error(runs.status());

  const int64_t heads_kv = trace->heads_kv();
  // The time per step: process CPU time on the CPU backends; on cuda the wall time of a step until
  // its work is done (the stream synchronised), which includes that synchronisation.
  const bool device = *backend == Backend::cuda;
  const char* time_key = device ? "device_ms" : "cpu_ms";
  std::vector<TraceSummary> sums;
  for (const auto& steps : *runs) sums.push_back(summarise(steps, heads_kv));
  const double dense_cpu = [&] {
    for (size_t i = 0; i < configs.size(); ++i)
      if (configs[i].method == PrefixMethod::dense) return sums[i].cpu_ms;
    return 0.0;
  }();
  if (o.json || !o.json_path.empty()) {
    nlohmann::json out;
    if (captured) {
      out["trace"] = {{"capture", o.capture}, {"request", o.request}, {"layer", o.layer}, {"prefix", prefix},
                      {"block", block}, {"blocks", blocks}, {"steps_per_block", trace->steps_per_block()},
                      {"heads", heads}, {"kv_heads", kv_heads}, {"head_dim", head_dim}};
    } else {
      out["trace"] = {{"prefix", o.prefix}, {"block", o.block}, {"blocks", o.blocks}, {"steps_per_block", trace->steps_per_block()},
                      {"tokens_per_step", o.tokens_per_step}, {"unmask", o.unmask}, {"neighbour", o.neighbour},
                      {"drift", o.drift}, {"heads", o.heads}, {"kv_heads", o.kv_heads}, {"head_dim", o.head_dim},
                      {"seed", o.seed}};
    }
    out["trace"]["backend"] = backend_name(*backend);
    out["params"] = *params;
    for (size_t i = 0; i < configs.size(); ++i) {
      const TraceSummary& s = sums[i];
      nlohmann::json steps = nlohmann::json::array();
      for (const TraceStep& r : (*runs)[i]) {
        steps.push_back({{"block", r.stats.block}, {"step", r.stats.step}, {"recomputed", r.stats.recomputed.size()},
                         {"pages_loaded", r.stats.pages_loaded}, {"err", r.err}, {"err_prefix", r.err_prefix}, {"err_masked", r.err_masked},
                         {"mass_kept", r.recall}, {time_key, r.cpu_ms},
                         {"unmasked", trace->unmasked_after(r.stats.block, r.stats.step)}});
      }
      out["methods"].push_back({{"method", names[i]}, {"pages_per_kv_head", s.pages}, {"err", s.err},
                                {"err_masked", s.err_masked},
                                {"err_max", s.err_max}, {"mass_kept", s.recall}, {time_key, s.cpu_ms},
                                {std::string("block_") + time_key, s.block_cpu_ms}, {"steps", steps}});
    }
    if (o.json) {
      std::cout << json_text(out) << std::endl;
      return success();
    }
    Status s = write_text_file("--json", o.json_path, json_text(out) + "\n");
    if (!s.ok()) return runtime_error(s);
  }
  if (captured) {
    std::cout << "captured decode trace: " << o.capture << ", request " << o.request << ", layer " << o.layer << ", "
              << blocks << " block(s)\n";
  }
  std::cout << format("decode trace: prefix %lld (%lld pages of 16 per kv head), block %lld x %lld steps, %d/%d heads, d %d; ",
                      prefix, (prefix + 15) / 16, block, static_cast<long long>(trace->steps_per_block()),
                      heads, kv_heads, head_dim)
            << "params " << params_text(*params) << "\n"
            << "means over the steps after each block's first; err = ||O - O_dense|| / ||O_dense|| of the block "
               "output (err masked: rows still masked); block "
            << (device ? "device" : "CPU") << " = mean over every step"
            << (device ? "; cuda: bf16 on the device, the dense reference too; ms = wall time of a step to a "
                         "synchronised stream"
                       : "")
            << "\n\n";
  Table table({"method", "pages/step/kv head", "% prefix", "rows/step", "err vs dense", "max err", "err masked", "mass kept",
               device ? "device ms/step" : "CPU ms/step", device ? "block device ms" : "block CPU ms", "x dense"});
  for (size_t i = 0; i < configs.size(); ++i) {
    const TraceSummary& s = sums[i];
    table.add_row({names[i], format("%.1f", s.pages), format("%.2f", 100 * s.pages_frac), format("%.1f", s.recomputed),
                   format("%.4f", s.err), format("%.4f", s.err_max), format("%.4f", s.err_masked), format("%.3f", s.recall), format("%.2f", s.cpu_ms),
                   format("%.2f", s.block_cpu_ms), dense_cpu > 0 ? format("%.2f", dense_cpu / s.cpu_ms) : "-"});
  }
  std::cout << table.render();
  if (!o.plot_path.empty()) {
    BarChart chart;
    chart.title = format("sparsa trace: prefix %lld, block %lld, %d/%d heads, d %d", prefix, block, heads, kv_heads,
                         head_dim);
    BarPanel cpu{device ? "device ms per step" : "CPU ms per step", {}, false},
        pages{"% of prefix pages loaded", {}, false},
        err{"error vs dense", {}, false};
    for (size_t i = 0; i < configs.size(); ++i) {
      chart.categories.push_back(names[i]);
      cpu.values.push_back(sums[i].cpu_ms);
      pages.values.push_back(100 * sums[i].pages_frac);
      err.values.push_back(sums[i].err);
    }
    chart.panels = {cpu, pages, err};
    Status s = write_text_file("--plot", o.plot_path, render_svg(chart));
    if (!s.ok()) return runtime_error(s);
    std::cout << "\nplot: " << o.plot_path << "\n";
  }
  return success();
}

const std::vector<TraceMethod>& trace_methods() {
  static const std::vector<TraceMethod> list = {
      {"losa", "LoSA: per decode step only the k tokens whose queries moved most recompute sparse prefix attention "
               "(QUEST pages, the union per kv head loaded once); the others reuse cached O and LSE"},
      {"reuse", "LoSA's active/stable split with the active rows dense (the error of reuse alone)"},
  };
  return list;
}

bool names_a_trace_method(const std::string& methods) {
  std::stringstream ss(methods);
  std::string item;
  while (std::getline(ss, item, ',')) {
    for (const TraceMethod& m : trace_methods())
      if (item == m.name) return true;
  }
  return false;
}

std::vector<std::string> flags_given(const CLI::App& cmd) {
  std::vector<std::string> given;
  for (const CLI::Option* opt : cmd.get_options()) {
    if (opt->count() > 0 && !opt->get_lnames().empty()) given.push_back("--" + opt->get_lnames().front());
  }
  return given;
}

Status check_trace_flags(const std::vector<std::string>& given, const std::vector<std::string>& carried) {
  for (const std::string& flag : given) {
    if (std::find(carried.begin(), carried.end(), flag) == carried.end()) {
      return invalid_argument(flag + ": not used when --methods names losa or reuse (a decode trace; its own flags "
                              "are those of `sparsa trace`)");
    }
  }
  return {};
}

std::vector<std::string> trace_params(const std::vector<std::string>& params) {
  std::vector<std::string> out;
  for (const std::string& p : params) {
    const size_t eq = p.find('='), dot = p.find('.');
    std::string text = p;
    if (dot != std::string::npos && dot < eq) {
      const std::string scope = p.substr(0, dot);
      if (scope == "dense" || scope == "quest" || scope == "losa" || scope == "reuse") text = p.substr(dot + 1);
    }
    out.push_back(text);
  }
  return out;
}

}  // namespace sparsa::cli
