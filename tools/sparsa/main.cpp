// sparsa: the command-line tool (docs/cli.md).
//
// Every failure prints exactly one line "sparsa: error: <message>" on stderr and exits
// 2 for a usage error (the command line is wrong) or 1 for a runtime error (files,
// data, the computation). No exception leaves main.
#include <cstdio>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include <CLI/CLI.hpp>

#include "cmd_dlm.h"
#include "cmd_eval_model.h"
#include "cmd_selectors.h"
#include "commands.h"
#include "cmd_trace.h"
#include "methods.h"

namespace sparsa::cli {
namespace {

constexpr const char* kIndexFormatHelp = R"(
Index files (--index, block_sparse): a .safetensors file with
  counts   I32 [batch, heads_q, num_q_blocks]            key blocks visited per query block
  indices  I32 [batch, heads_q, num_q_blocks, capacity]  their ids, ascending, padded
  perm_q   I32 [batch, heads_q, len_q]     optional: blocks over permuted query tokens
  perm_kv  I32 [batch, heads_kv, len_kv]   optional: blocks over permuted key tokens
Block sizes come from -P block=N (or -P block_q=N -P block_kv=N), else from the
header's __metadata__ {"block_q": "64", "block_kv": "64"}. num_q_blocks must be
ceil(len_q / block_q); indices must lie in [0, ceil(len_kv / block_kv)).)";

// Length of the valid UTF-8 sequence starting at s[i], or 0.
size_t utf8_length(const std::string& s, size_t i) {
  const auto byte = [&](size_t j) { return static_cast<unsigned char>(s[j]); };
  const unsigned char c = byte(i);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t j = 1; j < n; ++j) {
    if ((byte(i + j) & 0xC0) != 0x80) return 0;
  }
  return n;
}

// The message as one printable line: a file name or header text may carry newlines,
// control bytes or invalid UTF-8; those are written as \xNN.
std::string one_line(const std::string& message) {
  std::string out;
  for (size_t i = 0; i < message.size();) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    const size_t n = utf8_length(message, i);
    if (n == 0 || c < 0x20 || c == 0x7F) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02X", c);
      out += hex;
      ++i;
    } else {
      out.append(message, i, n);
      i += n;
    }
  }
  return out;
}

int fail(const Status& status, int exit_code) {
  std::cerr << "sparsa: error: " << one_line(status.message()) << std::endl;
  return exit_code;
}

std::string methods_help() {
  std::string s = "\nMethods (-P key=value parameters):\n";
  for (const Method& m : methods()) {
    s += "  " + m.name + ": " + m.summary + "\n";
    for (const std::string& p : m.param_help) s += "      " + p + "\n";
  }
  return s;
}

int run_main(int argc, char** argv) {
  CLI::App app{"sparsa " SPARSA_VERSION " - sparse attention for diffusion models", "sparsa"};
  app.set_version_flag("--version", SPARSA_VERSION);
  app.require_subcommand(1);
  app.footer("Run 'sparsa <command> --help' for a command's flags. Exit codes: 0 ok, 1 runtime error, 2 usage error.");

  InfoOptions info;
  CLI::App* info_cmd = app.add_subcommand("info", "version, backends, CPU/GPU and registered methods");
  info_cmd->add_flag("--json", info.json, "print JSON instead of text");

  RunOptions run;
  CLI::App* run_cmd = app.add_subcommand("run", "run one method on tensors from .npy/.safetensors files");
  run_cmd->add_option("--method", run.method, "method name (sparsa info lists them)")->required();
  run_cmd->add_option("--q", run.q, "queries [batch, heads_q, len_q, head_dim] (f32/f16 .npy; .safetensors[:name])")
      ->required();
  run_cmd->add_option("--k", run.k, "keys [batch, heads_kv, len_kv, head_dim]")->required();
  run_cmd->add_option("--v", run.v, "values [batch, heads_kv, len_kv, head_dim]")->required();
  run_cmd->add_option("--index", run.index, "block_sparse plan from a .safetensors index file (format below)");
  run_cmd->add_option("-P,--param", run.params, "method parameter key=value (repeatable)")->allow_extra_args(false);
  run_cmd->add_option("--backend", run.backend, "cpu (default), cpu_ref (the specification) or cuda");
  CLI::Option* scale = run_cmd->add_option("--scale", run.scale, "logit scale (default 1/sqrt(head_dim))");
  run_cmd->add_flag("--check-finite", run.check_finite, "refuse NaN/Inf in q, k, v");
  run_cmd->add_option("--mask", run.mask,
                      "none, causal, block_causal(B), sliding_window(W) or sliding_window(L,R) (also block_causal:B; "
                      "queries aligned at the end of the keys; dense, block_sparse and the selectors' executor)")
      ->capture_default_str();
  run_cmd->add_option("--threads", run.threads, "CPU threads (0 = all cores)");
  run_cmd->add_option("--out", run.out, "output O (.npy or .safetensors), dtype of q")->required();
  run_cmd->add_option("--lse", run.lse, "output LSE, f32 [batch, heads_q, len_q]");
  run_cmd->add_option("--layout", run.layout,
                      "bhsd: files are [batch, heads, seq, head_dim]; bshd: [batch, seq, heads, head_dim] "
                      "(FlashAttention's; --out is written the same way, LSE stays [batch, heads_q, len_q])")
      ->capture_default_str();
  run_cmd->add_flag("--quiet", run.quiet, "no summary line on stdout");
  run_cmd->footer(std::string(kIndexFormatHelp) + "\n" + methods_help());

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "time methods x lengths on the generated workload");
  bench_cmd->add_option("--methods", bench.methods, "comma-separated methods (default: all registered)");
  bench_cmd->add_option("--lengths", bench.lengths, "comma-separated sequence lengths (len_q = len_kv)")
      ->capture_default_str();
  bench_cmd->add_option("--heads", bench.heads, "query heads")->capture_default_str();
  bench_cmd->add_option("--kv-heads", bench.kv_heads, "key/value heads (default heads/4 when it divides, else heads)");
  bench_cmd->add_option("--head-dim", bench.head_dim, "head dimension")->capture_default_str();
  bench_cmd->add_option("--repeats", bench.repeats, "timed runs per cell (the median is reported)")->capture_default_str();
  bench_cmd->add_option("--warmup", bench.warmup, "untimed runs before timing")->capture_default_str();
  bench_cmd->add_option("--seed", bench.seed, "workload seed")->capture_default_str();
  bench_cmd->add_option("--backend", bench.backend, "cpu, cpu_ref or cuda")->capture_default_str();
  bench_cmd->add_option("--threads", bench.threads, "CPU threads (0 = all cores)");
  bench_cmd->add_option("-P,--param", bench.params, "method.key=value, e.g. block_sparse.density=0.2 (repeatable)")
      ->allow_extra_args(false);
  bench_cmd->add_option_function<std::string>(
              "--json", [&bench](const std::string& v) { bench.json_path = v.empty() ? "-" : v; },
              "[FILE] write results as JSON to FILE (bare or '-': JSON on stdout instead of the table)")
      ->expected(0, 1);
  bench_cmd->add_option("--plot", bench.plot_path, "write an SVG plot (time vs length, log-log) to this file");
  bench_cmd->footer(methods_help());

  DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand("demo", "every demo method on the default workload, against dense");
  demo_cmd->add_option("--length", demo.length, "sequence length (dense, the slowest method, grows with its square)")
      ->capture_default_str();
  demo_cmd->add_option("--methods", demo.methods, "comma-separated methods (default: all demo methods)");
  demo_cmd->add_option("--repeats", demo.repeats, "timed runs per method (the median is reported)")
      ->capture_default_str();
  demo_cmd->add_option("--backend", demo.backend, "cpu, cpu_ref or cuda")->capture_default_str();
  demo_cmd->add_option("--threads", demo.threads, "CPU threads (0 = all cores)");
  demo_cmd->add_option("-P,--param", demo.params, "method.key=value (repeatable)")->allow_extra_args(false);
  demo_cmd->add_option("--plot", demo.plot_path, "SVG bar chart of time and error ('' for none)")->capture_default_str();
  demo_cmd->add_option_function<std::string>(
              "--json",
              [&demo](const std::string& v) {
                if (v.empty() || v == "-") demo.json = true;
                else demo.json_path = v;
              },
              "[FILE] print JSON instead of the table (with FILE: write it there, the table printed too)")
      ->expected(0, 1);
  bool demo_no_trace = false;  // a plain flag: CLI11 prints a negated one as "--no-trace{false}"
  demo_cmd->add_flag("--no-trace", demo_no_trace,
                     "skip the block-diffusion decode section (LoSA, QUEST, dense prefix attention; see `trace`)");
  demo_cmd->add_option("--model", demo.model,
                       "the needle part's model directory ('' to skip it; the default is skipped where absent)")
      ->capture_default_str();
  demo_cmd->add_option("--model-length", demo.model_length, "the needle part's context length in tokens")
      ->capture_default_str();
  demo_cmd->add_option("--model-samples", demo.model_samples, "the needle part's questions per method")
      ->capture_default_str();
  demo_cmd->footer(methods_help());

  const Subcommand plan_cmd = add_plan_command(app);
  const Subcommand eval_cmd = add_eval_command(app);
  TraceOptions trace;
  CLI::App* trace_cmd = add_trace_command(app, "trace", trace);
  std::vector<Subcommand> dlm_cmds = add_dlm_commands(app);
  for (Subcommand& sub : add_eval_model_commands(app)) dlm_cmds.push_back(sub);

  // CLI11 reads an unknown first word as a stray argument ("A subcommand is required");
  // name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands({})) known = known || sub->get_name() == word;
    if (!known) {
      return fail(invalid_argument("unknown command '" + word + "' (expected info, run, bench, demo, plan, eval, trace, generate, logits, tokenize, model, ruler or eval-model)"),
                  kExitUsage);
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(invalid_argument(e.what()), kExitUsage);
  }
  run.scale_given = scale->count() > 0;

  Outcome outcome;
  if (info_cmd->parsed()) outcome = cmd_info(info);
  if (run_cmd->parsed()) outcome = cmd_run(run);
  if (bench_cmd->parsed()) {
    bench.given = flags_given(*bench_cmd);
    outcome = cmd_bench(bench);
  }
  if (demo_cmd->parsed()) {
    demo.trace = !demo_no_trace;
    outcome = cmd_demo(demo);
  }
  if (plan_cmd.app->parsed()) outcome = plan_cmd.run();
  if (eval_cmd.app->parsed()) outcome = eval_cmd.run();
  if (trace_cmd->parsed()) outcome = cmd_trace(trace);
  for (const Subcommand& sub : dlm_cmds) {
    if (sub.app->parsed()) outcome = sub.run();
  }
  if (!outcome.status.ok()) return fail(outcome.status, outcome.exit_code ? outcome.exit_code : kExitRuntime);
  return 0;
}

}  // namespace
}  // namespace sparsa::cli

int main(int argc, char** argv) {
  using sparsa::Status;
  using sparsa::StatusCode;
  try {
    return sparsa::cli::run_main(argc, argv);
  } catch (const std::bad_alloc&) {
    return sparsa::cli::fail(Status{StatusCode::out_of_memory, "out of memory"}, sparsa::cli::kExitRuntime);
  } catch (const std::exception& e) {
    return sparsa::cli::fail(Status{StatusCode::internal, std::string("internal error: ") + e.what()},
                             sparsa::cli::kExitRuntime);
  } catch (...) {
    return sparsa::cli::fail(Status{StatusCode::internal, "internal error: unknown exception"},
                             sparsa::cli::kExitRuntime);
  }
}
