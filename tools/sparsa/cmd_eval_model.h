// `sparsa ruler tasks|generate` and `sparsa eval-model`: the long-context task generator and
// the accuracy of a diffusion LM on it, per task x length x attention method (docs/eval.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cmd_selectors.h"

namespace sparsa::cli {

struct EvalModelOptions {
  std::string model, tasks = "niah_single_1", lengths = "1K", attention = "dense", svg, json_path, tokenizer;
  std::string backend = "cpu";
  // Per-layer overrides LAYERS=METHOD applied under every method (e.g. 0=dense).
  std::vector<std::string> attention_layers;
  int64_t samples = 10, steps = 0, gen_len = 0;
  uint64_t seed = 0;
  int threads = 0;
  bool json = false, quiet = false;
  bool chat = false;  // each task's question as the user's message in the model's chat template
  // The flags that set lengths and samples, as errors name them (`sparsa demo` passes its own).
  std::string lengths_flag = "--lengths", samples_flag = "--samples";
};

// The accuracy table (or JSON) of one model over tasks x lengths x methods; `sparsa demo` runs
// it on the shipped model for its needle part.
Outcome run_eval_model(const EvalModelOptions& o);

std::vector<Subcommand> add_eval_model_commands(CLI::App& app);

}  // namespace sparsa::cli
