// `sparsa eval`: block-sparse methods at matched densities against dense attention on
// the generated workload or on tensors from files. For every (density, method) it runs
// the method with -P density=<d> and reports the density it reached, the mass recall
// mean_i exp(LSE_i - LSE_dense_i) (the share of each query's softmax mass its visible
// keys hold) and the output error ||O - O_dense||_F / ||O_dense||_F.
#include <algorithm>
#include <iostream>
#include <memory>
#include <sstream>

#include "cmd_selectors.h"
#include "cmd_trace.h"
#include "common.h"
#include "sparsa/oracle.h"
#include "sparsa/workload.h"
#include "svg.h"
#include "table.h"
#include "util.h"

namespace sparsa::cli {
namespace {


struct EvalOptions {
  std::string methods = "ba_att,mean_pool,xattention,block_sparse", densities = "0.05,0.1,0.2,0.3";
  std::string q, k, v, backend = "cpu", mask = "none";
  std::vector<std::string> params;  // method.key=value
  long long length = 4096;
  int heads = 8, kv_heads = 2, head_dim = 64, threads = 0;
  std::uint64_t seed = 0;
  bool json = false;      // JSON on stdout instead of the table
  std::string json_path;  // JSON to this file (the table still printed)
  std::vector<std::string> given;  // the flags set on the command line
};

Result<std::vector<double>> parse_densities(const std::string& csv) {
  std::vector<double> out;
  std::stringstream ss(csv);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double d = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(d > 0.0 && d <= 1.0)) {
      return invalid_argument("--densities: expected comma-separated fractions in (0, 1], got '" + item + "'");
    }
    out.push_back(d);
  }
  if (out.empty()) return invalid_argument("--densities: empty list");
  return out;
}

// The stateful block-diffusion methods (losa, reuse) are judged over a decode trace, not at
// matched densities: `eval --methods losa,quest,dense` runs `sparsa trace` with those methods
// (its defaults: a 16K-token prefix, one block of 16; docs/losa.md), passing -P, --seed (when
// given; else the trace's own default), --backend, --threads and --json through and refusing the
// flags a trace does not use (--q/--k/--v, --densities, the workload's shape).
Outcome run_eval(const EvalOptions& o) {
  if (names_a_trace_method(o.methods)) {
    if (Status s = check_trace_flags(o.given, {"--methods", "--param", "--seed", "--backend", "--threads", "--json"});
        !s.ok()) {
      return usage_error(s);
    }
    TraceOptions trace;
    trace.methods = o.methods;
    trace.params = trace_params(o.params);
    if (std::find(o.given.begin(), o.given.end(), "--seed") != o.given.end()) trace.seed = o.seed;
    trace.backend = o.backend;
    trace.threads = o.threads;
    trace.json = o.json;
    trace.json_path = o.json_path;
    return cmd_trace(trace);
  }
  auto selected = select_methods(o.methods, /*demo_only=*/false);
  if (!selected.ok()) return usage_error(selected.status());
  if (!o.json_path.empty()) {
    Status s = check_output_path("--json", o.json_path, {".json"});
    if (!s.ok()) return s.code() == StatusCode::invalid_argument ? usage_error(s) : runtime_error(s);
  }
  auto densities = parse_densities(o.densities);
  if (!densities.ok()) return usage_error(densities.status());
  auto scoped = parse_scoped_params(o.params, *selected);
  if (!scoped.ok()) return usage_error(scoped.status());
  Result<Backend> backend = parse_backend_flag(o.backend);
  if (!backend.ok()) return usage_error(backend.status());
  if (o.threads < 0 || o.threads > kMaxThreads) return usage_error(invalid_argument("--threads: expected 0.." + std::to_string(kMaxThreads)));
  const int given = !o.q.empty() + !o.k.empty() + !o.v.empty();
  if (given != 0 && given != 3) return usage_error(invalid_argument("--q, --k, --v: give all three or none (none: the generated workload)"));
  for (const Method* m : *selected) {
    if (m->name == "dense") return usage_error(invalid_argument("--methods: dense is the reference of eval, not a method to score"));
  }
  Result<Mask> mask = parse_mask(o.mask, "--mask");
  if (!mask.ok()) return usage_error(mask.status());
  for (const Method* m : *selected) {
    if (!mask->is_none() && !m->takes_mask) {
      return usage_error(invalid_argument("--mask: method " + m->name + " takes no mask (" + mask_string(*mask) + ")"));
    }
  }

  const WorkloadConfig c = workload_of(o.seed, o.heads, o.kv_heads, o.length, o.head_dim);
  InputTensors inputs;
  if (Outcome loaded = load_inputs_or_workload(o.q, o.k, &o.v, c, &inputs); loaded.exit_code != 0) {
    return loaded;
  }
  HostArray &q = inputs.q, &k = inputs.k, &v = inputs.v;
  const std::string& source = inputs.source;
  AttentionOptions options;
  options.backend = *backend;
  options.num_threads = o.threads;
  options.mask = *mask;  // the reference and every method's executor; a -P m.mask_aware=true selection sees it
  std::cerr << "eval: dense reference ...\n";
  auto reference = dense(q.view(), k.view(), v.view(), options);
  if (!reference.ok()) return runtime_error(reference.status());

  Table table({"method", "target", "density", "mass_recall", "rel_err", "select_s", "params"});
  nlohmann::json rows = nlohmann::json::array();
  for (double target : *densities) {
    for (const Method* m : *selected) {
      MethodInputs in;
      in.q = q.view();
      in.k = k.view();
      in.v = v.view();
      in.options = options;
      in.params = scoped->at(m->name);
      for (const char* alternative : {"tau", "kappa"}) in.params.erase(alternative);
      in.params["density"] = target;
      std::cerr << "eval: " << m->name << " at density " << target << " ...\n";
      auto out = m->run(in);
      if (!out.ok()) return method_error(Status{out.status().code(), m->name + ": " + out.status().message()});
      auto recall = mass_recall_from_lse(out->attention.lse.view(), reference->lse.view());
      auto error = relative_error(out->attention.out.view(), reference->out.view());
      if (!recall.ok()) return runtime_error(recall.status());
      if (!error.ok()) return runtime_error(error.status());
      table.add_row({m->name, format("%.3f", target), format("%.4f", out->density), format("%.4f", *recall),
                     format("%.4f", *error), format("%.4f", out->select_seconds), params_text(in.params)});
      rows.push_back({{"method", m->name}, {"target_density", target}, {"density", out->density},
                      {"mass_recall", *recall}, {"rel_err", *error}, {"select_seconds", out->select_seconds},
                      {"params", in.params}});
    }
  }
  if (!o.json_path.empty()) {
    Status s = write_text_file("--json", o.json_path,
                               json_text({{"source", source}, {"mask", mask_string(*mask)}, {"results", rows}}) + "\n");
    if (!s.ok()) return runtime_error(s);
  }
  if (o.json) {
    std::cout << json_text({{"source", source}, {"mask", mask_string(*mask)}, {"results", rows}}) << "\n";
  } else {
    std::cout << "sparsa eval: " << source << (mask->is_none() ? "" : ", mask " + mask_string(*mask)) << "\n"
              << "mass_recall = mean over queries of exp(LSE - LSE_dense); rel_err = ||O - O_dense||_F / ||O_dense||_F\n\n"
              << table.render();
  }
  return success();
}

}  // namespace

Subcommand add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalOptions>();
  CLI::App* cmd = app.add_subcommand("eval", "block-sparse methods at matched densities: mass recall and error vs dense");
  cmd->add_option("--methods", o->methods,
                 "comma-separated methods taking -P density; naming losa (or reuse) evaluates dense/quest/losa/reuse "
                 "over a block-diffusion decode trace instead (as `sparsa trace`)")
      ->capture_default_str();
  cmd->add_option("--densities", o->densities, "comma-separated target densities in (0, 1]")->capture_default_str();
  cmd->add_option("--q", o->q, "queries (.npy/.safetensors); default: the generated workload");
  cmd->add_option("--k", o->k, "keys");
  cmd->add_option("--v", o->v, "values");
  cmd->add_option("-P,--param", o->params, "method.key=value (repeatable; density is set by eval)")->allow_extra_args(false);
  cmd->add_option("--length", o->length, "workload length (without --q/--k/--v)")->capture_default_str();
  cmd->add_option("--heads", o->heads, "workload query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "workload key/value heads")->capture_default_str();
  cmd->add_option("--head-dim", o->head_dim, "workload head dimension")->capture_default_str();
  cmd->add_option("--seed", o->seed, "workload seed")->capture_default_str();
  cmd->add_option("--backend", o->backend, "cpu or cpu_ref")->capture_default_str();
  cmd->add_option("--mask", o->mask,
                  "the attention's mask (causal, block_causal(B), sliding_window(W)...): the dense reference and "
                  "every method's executor apply it; -P METHOD.mask_aware=true lets a selection see it")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all cores)");
  cmd->add_option_function<std::string>(
         "--json",
         [o](const std::string& v) {
           if (v.empty() || v == "-") o->json = true;
           else o->json_path = v;
         },
         "[FILE] print JSON instead of the table (with FILE: write it there, the table printed too)")
      ->expected(0, 1);
  return {cmd, [o, cmd] {
            o->given = flags_given(*cmd);
            return run_eval(*o);
          }};
}

}  // namespace sparsa::cli
