// The subcommands of `sparsa`. main.cpp parses the command line with CLI11 into these
// option structs; each command returns an Outcome, and main prints a failure as the
// single line "sparsa: error: <message>".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa::cli {

// Exit codes: 0 success, 1 runtime failure (files, data, the computation), 2 usage
// (the command line itself is wrong: flags, values, -P parameters).
inline constexpr int kExitRuntime = 1;
inline constexpr int kExitUsage = 2;

// --threads above this is refused: the CPU backend starts one thread per unit of
// work up to the request, and thread creation failing mid-way is not recoverable.
inline constexpr int kMaxThreads = kMaxNumThreads;  // the library's bound

struct Outcome {
  Status status;
  int exit_code = 0;
};
inline Outcome success() { return {}; }
inline Outcome usage_error(Status status) { return {std::move(status), kExitUsage}; }
inline Outcome runtime_error(Status status) { return {std::move(status), kExitRuntime}; }

// `--json [FILE]` means one thing in every command: bare (or "-"), JSON on stdout instead of
// the table; with FILE, the JSON written there and the usual output printed.
// A method's failure: its parameter errors ("params: ...") are usage errors.
Outcome method_error(Status status);

struct InfoOptions {
  bool json = false;
};

struct RunOptions {
  std::string method, q, k, v, index, out, lse, backend = "cpu", layout = "bhsd", mask = "none";
  std::vector<std::string> params;
  double scale = 0;
  bool scale_given = false;
  bool check_finite = false;
  int threads = 0;
  bool quiet = false;
};

struct BenchOptions {
  std::string methods;  // comma-separated; empty = every registered method
  std::string lengths = "1024,2048,4096";
  int heads = 8, kv_heads = 0, head_dim = 64, repeats = 3, warmup = 1, threads = 0;
  std::uint64_t seed = 0;
  std::string backend = "cpu";
  std::vector<std::string> params;  // method.key=value
  std::string json_path, plot_path;  // json_path "-": JSON on stdout instead of the table
  std::vector<std::string> given;  // the flags set on the command line
};

// The demo's default length: dense dominates the demo's time and is quadratic in it; the run
// docs/cli.md cites shows the table 10 s after start on the 2-core build machine.
inline constexpr long long kDemoDefaultLength = 16384;
inline constexpr const char* kDemoModel = "models/sparsa-sdar-ruler";  // relative to the working directory

struct DemoOptions {
  long long length = kDemoDefaultLength;
  std::string methods;   // comma-separated; empty = every method with in_demo
  int threads = 0, repeats = 1;
  std::string backend = "cpu";
  std::vector<std::string> params;  // method.key=value
  std::string plot_path = "demo.svg";
  bool json = false;      // JSON on stdout instead of the table
  std::string json_path;  // JSON to this file (the table still printed)
  bool trace = true;  // also run the default decode trace (LoSA vs QUEST vs dense prefix attention)
  // The needle part: the shipped model answers a needle question with dense, QUEST and LoSA
  // (`sparsa eval-model`); skipped when `model` is empty, or is the default and absent.
  std::string model = std::string(kDemoModel);
  long long model_length = 2048, model_samples = 4;
};

Outcome cmd_info(const InfoOptions& options);
Outcome cmd_run(const RunOptions& options);
Outcome cmd_bench(const BenchOptions& options);
Outcome cmd_demo(const DemoOptions& options);

}  // namespace sparsa::cli
