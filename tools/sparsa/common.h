// Helpers shared by the commands: reading inputs, checking output paths, -P parsing,
// method selection, and comparison of an output with the dense reference.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "methods.h"
#include "sparsa/attention.h"
#include "sparsa/tensor.h"
#include "sparsa/workload.h"

namespace sparsa::cli {

// A tensor file named by a flag; failures are prefixed by the flag ("--q: ...").
Result<HostArray> load_input(const std::string& flag, const std::string& path);

// Inputs of `plan` and `eval`: q, k (and v when `v_path` is not null) from files when
// paths are given, else the generated workload of `config`. A failure comes back as the
// Outcome to return: file problems are runtime errors, a bad workload is a usage error.
struct InputTensors {
  HostArray q, k, v;
  std::string source;  // the file or the workload's one-line description
};
Outcome load_inputs_or_workload(const std::string& q_path, const std::string& k_path, const std::string* v_path,
                                const WorkloadConfig& config, InputTensors* inputs);
// The workload of a self-attention command's flags (--seed, --heads, --kv-heads, --length,
// --head-dim), the rest at WorkloadConfig's defaults.
inline WorkloadConfig workload_of(std::uint64_t seed, int heads, int kv_heads, long long length, int head_dim) {
  WorkloadConfig c;
  c.seed = seed;
  c.heads_q = heads;
  c.heads_kv = kv_heads;
  c.len_q = c.len_kv = length;
  c.head_dim = head_dim;
  return c;
}

// The output file can be created: a known extension (".npy", ".safetensors" for
// tensors; `extensions` for others), an existing writable directory, not a directory.
// Refuses (invalid_argument, naming both flags) an output that is the same file as an
// input, or as another output — by file identity (symlinks, hard links, "./x" and "x"
// alike), not by spelling; two distinct named entries of one .safetensors file are
// allowed (write_tensors writes them as one file). Pairs are (flag, path[:entry]).
Status check_outputs_distinct(const std::vector<std::pair<std::string, std::string>>& outputs,
                              const std::vector<std::pair<std::string, std::string>>& inputs);
Status check_output_path(const std::string& flag, const std::string& path,
                         const std::vector<std::string>& extensions);

// `-P key=value` list to a params object.
Result<Params> parse_params(const std::vector<std::string>& texts);
// `-P method.key=value` list (bench, demo) to params per method, starting from each
// method's demo_params; the methods must be among `selected`.
Result<std::map<std::string, Params>> parse_scoped_params(const std::vector<std::string>& texts,
                                                          const std::vector<const Method*>& selected);

// "a,b,c" to registered methods (in the order given); empty = every method that
// is part of the demo (demo_only) or every registered method.
Result<std::vector<const Method*>> select_methods(const std::string& csv, bool demo_only);
// "1024,2048" to positive integers.
Result<std::vector<int64_t>> parse_lengths(const std::string& flag, const std::string& csv);

Result<Backend> parse_backend_flag(const std::string& text);

struct Comparison {
  double rel_frobenius = 0;  // ||O - O_ref||_F / ||O_ref||_F
  double max_lse_diff = 0;   // max |LSE - LSE_ref| (inf where exactly one side is -inf)
};
Comparison compare_outputs(const AttentionOutput& output, const AttentionOutput& reference);

double median(std::vector<double> values);

// JSON text that never throws (invalid UTF-8 in file names is replaced).
std::string json_text(const nlohmann::json& value, int indent = 2);

// "block=64 density=0.1" (or "-" when empty).
std::string params_text(const Params& params);

}  // namespace sparsa::cli

namespace sparsa::cli {

// `warmup` untimed runs, then `repeats` timed runs of a method; the output and plan of
// the last run are kept (for error metrics against dense).
struct Measurement {
  std::vector<double> seconds;  // wall time of each timed run (selection + attention)
  double select_seconds = 0;    // of the last run
  double density = 1;
  AttentionOutput output;
  nlohmann::json plan;
};
Result<Measurement> measure(const Method& method, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Params& params, const AttentionOptions& options, int warmup, int repeats);


// Runs every method once on a small input of the same heads and head_dim (len 128),
// so a bad -P value fails before minutes of timing, not after.
Status preflight(const std::vector<const Method*>& selected, const std::map<std::string, Params>& params,
                 int64_t heads_q, int64_t heads_kv, int64_t head_dim, const AttentionOptions& options);

}  // namespace sparsa::cli
