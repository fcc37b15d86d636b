// `sparsa trace` (block-diffusion decode traces): dense / quest / losa / reuse prefix
// attention run step by step over a decode trace (sparsa/decode_trace.h), synthetic or
// captured from a model, each measured against dense: pages loaded, output error, mass kept,
// CPU time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "commands.h"

namespace sparsa::cli {

struct TraceOptions {
  std::string methods = "dense,quest,losa";
  long long prefix = 16384, block = 16, blocks = 1, tokens_per_step = 1, steps = 0;
  double unmask = 1.0, neighbour = 0.1, drift = 0.02;
  int heads = 14, kv_heads = 2, head_dim = 128;
  std::uint64_t seed = 1;
  std::vector<std::string> params;  // budget=, k=, threshold=, selector=, group=, union=, force_first=, force_last=
  std::string backend = "cpu";
  int threads = 0, repeats = 1;
  bool json = false;      // JSON on stdout instead of the table
  std::string json_path;  // JSON to this file (the table still printed)
  std::string plot_path;  // an SVG bar chart of the table ('' for none)
  // A trace recorded by the engine (`generate --dump-attention DIR`) instead of a synthetic one:
  // the decoded blocks of one request at one layer (the shape flags above then do not apply).
  std::string capture;
  long long layer = -1, request = 0;
};

// Adds the subcommand `name` to app, bound to `options`.
CLI::App* add_trace_command(CLI::App& app, const std::string& name, TraceOptions& options);
Outcome cmd_trace(const TraceOptions& options);

// The stateful decode methods, which run on a decode trace (`trace`, or `eval` / `bench` with
// --methods naming one), not on a single q, k, v: `info` lists them beside the registered methods.
struct TraceMethod {
  std::string name, summary;
};
const std::vector<TraceMethod>& trace_methods();

// `eval` and `bench` hand a --methods list that names a stateful decode method (losa or reuse)
// to cmd_trace. names_a_trace_method: whether the comma-separated list does.
bool names_a_trace_method(const std::string& methods);
// The flags of `cmd` set on the command line (long names, "--length").
std::vector<std::string> flags_given(const CLI::App& cmd);
// Refuses a flag in `given` that the trace does not use (not in `carried`), naming it; the
// trace's own flags are those of `sparsa trace`.
Status check_trace_flags(const std::vector<std::string>& given, const std::vector<std::string>& carried);
// -P for the trace: key=value as `sparsa trace` takes it, or method.key=value with the method one
// of dense, quest, losa, reuse (the scope is dropped: the trace's parameters are shared).
std::vector<std::string> trace_params(const std::vector<std::string>& params);

}  // namespace sparsa::cli
