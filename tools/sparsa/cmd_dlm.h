// `sparsa generate`, `sparsa logits`, `sparsa tokenize`, `sparsa model info`: the
// diffusion-LM engine's commands (docs/dlm.md).
#pragma once

#include <vector>

#include <CLI/CLI.hpp>

#include "cmd_selectors.h"

namespace sparsa::cli {

std::vector<Subcommand> add_dlm_commands(CLI::App& app);

}  // namespace sparsa::cli
