// `sparsa ruler tasks|generate` and `sparsa eval-model`: the long-context task generator and
// the accuracy of a diffusion LM on it, per task x length x attention method (docs/eval.md).
#pragma once

#include <vector>

#include <CLI/CLI.hpp>

#include "cmd_selectors.h"

namespace sparsa::cli {

std::vector<Subcommand> add_eval_model_commands(CLI::App& app);

}  // namespace sparsa::cli
