// `sparsa demo`: every demo method on the embedded default workload, against dense.
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>

#include <nlohmann/json.hpp>

#include "cmd_eval_model.h"
#include "cmd_trace.h"
#include "commands.h"
#include "common.h"
#include "machine.h"
#include "svg.h"
#include "table.h"
#include "util.h"
#include "sparsa/workload.h"

namespace sparsa::cli {

namespace {

struct DemoRow {
  const Method* method = nullptr;
  Params params;
  Measurement m;
  double median_s = 0;
  Comparison error;
};

nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

Outcome cmd_demo(const DemoOptions& o) {
  const long long length = o.length;
  if (length < 1 || length > (1 << 22)) {
    return usage_error(invalid_argument("--length: expected an integer in [1, " + std::to_string(1 << 22) + "], got " +
                                        std::to_string(length)));
  }
  if (o.repeats < 1 || o.repeats > 1000) {
    return usage_error(invalid_argument("--repeats: expected an integer in [1, 1000], got " + std::to_string(o.repeats)));
  }
  if (o.threads < 0 || o.threads > kMaxThreads) {
    return usage_error(invalid_argument("--threads: expected an integer in [0, " + std::to_string(kMaxThreads) +
                                        "] (0 = all cores), got " + std::to_string(o.threads)));
  }
  if (o.model_length < 1 || o.model_length > (1 << 20)) {
    return usage_error(invalid_argument("--model-length: expected an integer in [1, " + std::to_string(1 << 20) +
                                        "], got " + std::to_string(o.model_length)));
  }
  if (o.model_samples < 1 || o.model_samples > 1000) {
    return usage_error(invalid_argument("--model-samples: expected an integer in [1, 1000], got " +
                                        std::to_string(o.model_samples)));
  }
  auto selected = select_methods(o.methods, /*demo_only=*/true);
  if (!selected.ok()) return usage_error(selected.status());
  // Dense is the reference of every error column: run it first even when not listed.
  const Method* dense = find_method("dense");
  if (dense == nullptr) return runtime_error(Status{StatusCode::internal, "demo: method 'dense' is not registered"});
  std::erase(*selected, dense);
  selected->insert(selected->begin(), dense);
  auto backend = parse_backend_flag(o.backend);
  if (!backend.ok()) return usage_error(backend.status());
  auto params = parse_scoped_params(o.params, *selected);
  if (!params.ok()) return usage_error(params.status());
  if (!o.plot_path.empty()) {
    Status s = check_output_path("--plot", o.plot_path, {".svg"});
    if (!s.ok()) return s.code() == StatusCode::invalid_argument ? usage_error(s) : runtime_error(s);
  }
  if (!o.json_path.empty()) {
    Status s = check_output_path("--json", o.json_path, {".json"});
    if (!s.ok()) return s.code() == StatusCode::invalid_argument ? usage_error(s) : runtime_error(s);
  }

  WorkloadConfig config;  // the embedded default workload, seed 0
  config.len_q = config.len_kv = length;
  AttentionOptions options;
  options.backend = *backend;
  options.num_threads = o.threads;
  if (Status s = preflight(*selected, *params, config.heads_q, config.heads_kv, config.head_dim, options); !s.ok()) {
    return method_error(s);
  }
  std::cerr << "demo: generating workload (" << describe(config) << ")\n";
  Result<Workload> workload = generate_workload(config);
  if (!workload.ok()) return runtime_error(Status{workload.status().code(), "workload: " + workload.status().message()});
  std::vector<DemoRow> rows;
  for (size_t i = 0; i < selected->size(); ++i) {
    const Method* method = (*selected)[i];
    std::cerr << "demo: [" << i + 1 << "/" << selected->size() << "] " << method->name << " ..." << std::flush;
    Result<Measurement> m = measure(*method, workload->q.view(), workload->k.view(), workload->v.view(),
                                    (*params)[method->name], options, /*warmup=*/0, o.repeats);
    if (!m.ok()) {
      std::cerr << " failed\n";
      return method_error(m.status());
    }
    DemoRow row{method, (*params)[method->name], std::move(m).value(), 0, {}};
    row.median_s = median(row.m.seconds);
    std::cerr << format(" %.3f s\n", row.median_s);
    rows.push_back(std::move(row));
  }
  for (DemoRow& row : rows) row.error = compare_outputs(row.m.output, rows.front().m.output);
  const double dense_s = rows.front().median_s;
  const MachineInfo machine = machine_info();

  if (o.json || !o.json_path.empty()) {
    nlohmann::json j;
    j["workload"] = describe(config);
    j["length"] = length;
    j["machine"] = {{"cpu", machine.cpu_model}, {"logical_cores", machine.logical_cores}, {"isa", machine.isa}};
    j["backend"] = backend_name(*backend);
    j["threads"] = o.threads;
    j["repeats"] = o.repeats;
    nlohmann::json results = nlohmann::json::array();
    for (const DemoRow& r : rows) {
      results.push_back({{"method", r.method->name},
                         {"params", r.params},
                         {"seconds", r.m.seconds},
                         {"median_s", r.median_s},
                         {"select_s", r.m.select_seconds},
                         {"speedup_vs_dense", finite_or_null(dense_s / r.median_s)},
                         {"density", r.m.density},
                         {"rel_error", finite_or_null(r.error.rel_frobenius)},
                         {"max_lse_diff", finite_or_null(r.error.max_lse_diff)},
                         {"plan", r.m.plan}});
    }
    j["results"] = results;
    j["plot"] = o.plot_path;
    if (o.json) {
      std::cout << json_text(j) << "\n";
    } else {
      Status s = write_text_file("--json", o.json_path, json_text(j) + "\n");
      if (!s.ok()) return runtime_error(s);
    }
  }
  if (!o.json) {
    std::cout << "sparsa demo: " << describe(config) << "\n"
              << "machine: " << machine.cpu_model << ", " << machine.logical_cores << " logical cores, backend "
              << backend_name(*backend) << "\n"
              << "error columns compare with dense: rel_err = ||O - O_dense||_F / ||O_dense||_F, "
                 "max_dLSE = max |LSE - LSE_dense|\n\n";
    Table table({"method", "params", "time_s", "select_s", "speedup", "density", "rel_err", "max_dLSE"});
    for (const DemoRow& r : rows) {
      table.add_row({r.method->name, params_text(r.params), format("%.3f", r.median_s),
                     format("%.3f", r.m.select_seconds), format("%.2fx", dense_s / r.median_s),
                     format("%.4f", r.m.density), format("%.2e", r.error.rel_frobenius),
                     format("%.2e", r.error.max_lse_diff)});
    }
    std::cout << table.render();
  }

  if (!o.plot_path.empty()) {
    BarChart chart;
    chart.title = format("sparsa demo: L=%lld, heads %lld/%lld, d=%lld, %s", length,
                         static_cast<long long>(config.heads_q), static_cast<long long>(config.heads_kv),
                         static_cast<long long>(config.head_dim), backend_name(*backend));
    // Errors lie between 0 and about 1: a linear axis from 0 shows every bar (on a log axis
    // fitted to the data the smallest error, BA-Att's, sat on the axis and drew no bar).
    BarPanel time{"time (s)", {}, false}, error{"relative error vs dense", {}, false};
    for (const DemoRow& r : rows) {
      chart.categories.push_back(r.method->name);
      time.values.push_back(r.median_s);
      error.values.push_back(r.error.rel_frobenius);
    }
    chart.panels = {time, error};
    Status s = write_text_file("--plot", o.plot_path, render_svg(chart));
    if (!s.ok()) return runtime_error(s);
    if (!o.json) std::cout << "\nplot: " << o.plot_path << "\n";
  }
  if (!o.json_path.empty()) std::cout << "json: " << o.json_path << "\n";

  // Block diffusion: LoSA keeps state across denoising steps, so it is shown on a decode
  // trace (the `trace` command's defaults) rather than as a row of the table above.
  if (o.trace && !o.json) {
    std::cout << "\nblock-diffusion decode: prefix attention of one block over a 16K-token prefix "
                 "(sparsa trace)\n";
    std::cout.flush();
    TraceOptions trace;
    trace.threads = o.threads;
    trace.backend = o.backend == "cuda" ? "cpu" : o.backend;
    if (!o.plot_path.empty()) {  // demo.svg -> demo-decode.svg beside it
      const size_t dot = o.plot_path.rfind('.');
      const bool has_ext = dot != std::string::npos && o.plot_path.find('/', dot) == std::string::npos;
      trace.plot_path = (has_ext ? o.plot_path.substr(0, dot) : o.plot_path) + "-decode.svg";
    }
    const Outcome t = cmd_trace(trace);
    if (t.exit_code != 0) return t;
  }

  // A real model: the shipped small diffusion LM (docs/eval.md) finds a 7-digit needle in a
  // noise haystack with dense attention, QUEST and LoSA at budget 128, and BA-Att over the
  // prompt's prefill at 10% with layer 0 dense (accuracy and seconds per question; `sparsa
  // eval-model` is the full evaluation).
  if (!o.json && !o.model.empty()) {
    if (o.model == kDemoModel && !std::filesystem::exists(o.model)) {
      std::cout << "\n(no model at " << o.model << ": run from the repository root, or pass --model DIR)\n";
      return success();
    }
    std::cout << "\nneedle in a haystack on a real model: " << o.model << ", niah_single_1 at " << o.model_length
              << " tokens, " << o.model_samples << (o.model_samples == 1 ? " question" : " questions")
              << " per method\n";
    std::cout.flush();
    EvalModelOptions e;
    e.model = o.model;
    e.tasks = "niah_single_1";
    e.lengths = std::to_string(o.model_length);
    e.samples = o.model_samples;
    e.backend = o.backend == "cuda" ? "cuda" : "cpu";
    e.attention = "dense;quest:budget=128;losa:budget=128,k=4;ba_att:density=0.1,sort=false,block_causal=true|0=dense";
    e.threads = o.threads;
    e.lengths_flag = "--model-length";  // its errors name the demo's flags
    e.samples_flag = "--model-samples";
    Outcome m = run_eval_model(e);
    if (m.exit_code != 0) return m;
  }
  return success();
}

}  // namespace sparsa::cli
