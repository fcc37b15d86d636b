// `sparsa bench`: methods x lengths on the generated workload, side by side.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

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

struct Row {
  std::string method;
  int64_t length = 0;
  Params params;
  std::vector<double> seconds;
  double median_s = 0, select_s = 0, density = 1, dense_pairs = 0;
};

Status check_bench_options(const BenchOptions& o) {
  auto positive = [](const char* flag, long long v, long long max) -> Status {
    if (v < 1 || v > max) {
      return invalid_argument(std::string(flag) + ": expected an integer in [1, " + std::to_string(max) + "], got " +
                              std::to_string(v));
    }
    return {};
  };
  SPARSA_RETURN_IF_ERROR(positive("--heads", o.heads, 1024));
  SPARSA_RETURN_IF_ERROR(positive("--head-dim", o.head_dim, 1024));
  SPARSA_RETURN_IF_ERROR(positive("--repeats", o.repeats, 1000));
  if (o.kv_heads < 0 || o.kv_heads > o.heads || (o.kv_heads > 0 && o.heads % o.kv_heads != 0)) {
    return invalid_argument("--kv-heads: expected 0 (default) or a divisor of --heads (" + std::to_string(o.heads) +
                            "), got " + std::to_string(o.kv_heads));
  }
  if (o.warmup < 0 || o.warmup > 100) {
    return invalid_argument("--warmup: expected an integer in [0, 100], got " + std::to_string(o.warmup));
  }
  if (o.threads < 0 || o.threads > kMaxThreads) {
    return invalid_argument("--threads: expected an integer in [0, " + std::to_string(kMaxThreads) +
                                        "] (0 = all cores), got " + std::to_string(o.threads));
  }
  return {};
}

std::string cell(double v, const char* fmt) { return std::isfinite(v) ? format(fmt, v) : "-"; }

// LoSA keeps state across denoising steps, so its benchmark is a decode trace: with
// `--methods` naming losa (or reuse), each length is a prefix length and `sparsa trace`
// times dense / quest / losa / reuse prefix attention per step over it (-P, --seed when given,
// --backend, --threads and --repeats passed through; the other flags refused).
Outcome bench_trace(const BenchOptions& o) {
  if (Status s = check_trace_flags(o.given, {"--methods", "--lengths", "--param", "--seed", "--backend", "--threads",
                                             "--repeats"});
      !s.ok()) {
    return usage_error(s);
  }
  auto lengths = parse_lengths("--lengths", o.lengths);
  if (!lengths.ok()) return usage_error(lengths.status());
  for (int64_t length : *lengths) {
    TraceOptions trace;
    trace.methods = o.methods;
    trace.prefix = length;
    trace.params = trace_params(o.params);
    if (std::find(o.given.begin(), o.given.end(), "--seed") != o.given.end()) trace.seed = o.seed;
    trace.backend = o.backend;
    trace.threads = o.threads;
    trace.repeats = o.repeats;
    std::cout << (length == lengths->front() ? "" : "\n") << "prefix " << length << ":\n";
    std::cout.flush();
    const Outcome t = cmd_trace(trace);
    if (t.exit_code != 0) return t;
  }
  return success();
}

}  // namespace

Outcome cmd_bench(const BenchOptions& o) {
  if (names_a_trace_method(o.methods)) {
    if (!o.json_path.empty() || !o.plot_path.empty()) {
      return usage_error(invalid_argument("--json/--plot: not available for the decode-trace methods (losa, reuse); "
                                          "use `sparsa trace --json`"));
    }
    return bench_trace(o);
  }
  if (Status s = check_bench_options(o); !s.ok()) return usage_error(s);
  auto selected = select_methods(o.methods, /*demo_only=*/false);
  if (!selected.ok()) return usage_error(selected.status());
  auto lengths = parse_lengths("--lengths", o.lengths);
  if (!lengths.ok()) return usage_error(lengths.status());
  auto backend = parse_backend_flag(o.backend);
  if (!backend.ok()) return usage_error(backend.status());
  auto params = parse_scoped_params(o.params, *selected);
  if (!params.ok()) return usage_error(params.status());
  const bool json_stdout = o.json_path == "-";  // bare --json: JSON instead of the table
  for (auto [flag, path, ext] : {std::tuple{"--json", &o.json_path, ".json"}, std::tuple{"--plot", &o.plot_path, ".svg"}}) {
    if (path->empty() || (json_stdout && *path == "-")) continue;
    Status s = check_output_path(flag, *path, {ext});
    if (!s.ok()) return s.code() == StatusCode::invalid_argument ? usage_error(s) : runtime_error(s);
  }

  WorkloadConfig config;
  config.seed = o.seed;
  config.heads_q = o.heads;
  config.heads_kv = o.kv_heads > 0 ? o.kv_heads : (o.heads % 4 == 0 ? o.heads / 4 : o.heads);
  config.head_dim = o.head_dim;
  AttentionOptions options;
  options.backend = *backend;
  options.num_threads = o.threads;
  const MachineInfo machine = machine_info();

  if (Status s = preflight(*selected, *params, config.heads_q, config.heads_kv, config.head_dim, options); !s.ok()) {
    return method_error(s);
  }

  std::vector<Row> rows;
  const size_t total = lengths->size() * selected->size();
  size_t done = 0;
  for (int64_t length : *lengths) {
    config.len_q = config.len_kv = length;
    Result<Workload> workload = generate_workload(config);
    if (!workload.ok()) return runtime_error(Status{workload.status().code(), "workload: " + workload.status().message()});
    for (const Method* method : *selected) {
      ++done;
      std::cerr << "bench: [" << done << "/" << total << "] " << method->name << " L=" << length << " ..."
                << std::flush;
      Result<Measurement> m = measure(*method, workload->q.view(), workload->k.view(), workload->v.view(),
                                      (*params)[method->name], options, o.warmup, o.repeats);
      if (!m.ok()) {
        std::cerr << " failed\n";
        return method_error(m.status());
      }
      Row row{method->name, length, (*params)[method->name], m->seconds, median(m->seconds), m->select_seconds,
              m->density, static_cast<double>(config.batch) * config.heads_q * length * length};
      std::cerr << format(" %.4f s (median of %d)\n", row.median_s, o.repeats);
      rows.push_back(std::move(row));
    }
  }

  // Speed-up against dense at the same length, when dense was run.
  std::map<int64_t, double> dense_time;
  for (const Row& r : rows) {
    if (r.method == "dense") dense_time[r.length] = r.median_s;
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto speedup = [&](const Row& r) { return dense_time.count(r.length) ? dense_time[r.length] / r.median_s : nan; };
  auto gflops = [&](const Row& r, double pairs) { return attention_flops(pairs, o.head_dim) / r.median_s / 1e9; };

  if (!json_stdout) {
    std::cout << "workload: " << describe(config) << " (shown at the last length)\n"
              << "machine:  " << machine.cpu_model << ", " << machine.logical_cores << " logical cores, backend "
              << backend_name(*backend) << (o.threads ? ", " + std::to_string(o.threads) + " threads" : "") << "\n"
              << "time: median of " << o.repeats << " runs after " << o.warmup
              << " warm-up; GFLOP/s eff = dense FLOPs / time, act = visited pairs' FLOPs / time\n\n";
    Table table({"method", "length", "time_ms", "select_ms", "GFLOP/s_eff", "GFLOP/s_act", "speedup", "density"});
    for (const Row& r : rows) {
      table.add_row({r.method, std::to_string(r.length), format("%.3f", r.median_s * 1e3), format("%.3f", r.select_s * 1e3),
                     format("%.2f", gflops(r, r.dense_pairs)), format("%.2f", gflops(r, r.dense_pairs * r.density)),
                     cell(speedup(r), "%.2fx"), format("%.4f", r.density)});
    }
    std::cout << table.render();
  }

  if (!o.json_path.empty()) {
    nlohmann::json j;
    j["workload"] = describe(config);
    j["machine"] = {{"cpu", machine.cpu_model}, {"logical_cores", machine.logical_cores}, {"isa", machine.isa}};
    j["backend"] = backend_name(*backend);
    j["threads"] = o.threads;
    j["repeats"] = o.repeats;
    j["warmup"] = o.warmup;
    j["heads_q"] = config.heads_q;
    j["heads_kv"] = config.heads_kv;
    j["head_dim"] = config.head_dim;
    nlohmann::json results = nlohmann::json::array();
    for (const Row& r : rows) {
      const double s = speedup(r);
      results.push_back({{"method", r.method},
                         {"length", r.length},
                         {"params", r.params},
                         {"seconds", r.seconds},
                         {"median_s", r.median_s},
                         {"select_s", r.select_s},
                         {"gflops_effective", gflops(r, r.dense_pairs)},
                         {"gflops_actual", gflops(r, r.dense_pairs * r.density)},
                         {"speedup_vs_dense", std::isfinite(s) ? nlohmann::json(s) : nlohmann::json()},
                         {"density", r.density}});
    }
    j["results"] = results;
    if (json_stdout) {
      std::cout << json_text(j) << "\n";
    } else {
      Status s = write_text_file("--json", o.json_path, json_text(j) + "\n");
      if (!s.ok()) return runtime_error(s);
    }
  }
  if (!o.plot_path.empty()) {
    LinePlot plot;
    plot.title = format("attention time vs length (heads %lld/%lld, d=%lld, %s)", static_cast<long long>(config.heads_q),
                        static_cast<long long>(config.heads_kv), static_cast<long long>(config.head_dim),
                        backend_name(*backend));
    plot.x_label = "sequence length (tokens)";
    plot.y_label = "median time (s)";
    plot.log_x = plot.log_y = true;
    for (const Method* method : *selected) {
      Series series{method->name, {}, {}};
      for (const Row& r : rows) {
        if (r.method != method->name) continue;
        series.x.push_back(static_cast<double>(r.length));
        series.y.push_back(r.median_s);
      }
      plot.series.push_back(std::move(series));
    }
    Status s = write_text_file("--plot", o.plot_path, render_svg(plot));
    if (!s.ok()) return runtime_error(s);
  }
  return success();
}

}  // namespace sparsa::cli
