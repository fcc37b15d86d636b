// `sparsa plan` and `sparsa eval`: the block selectors' own commands. Each adds its
// subcommand to the parser and returns what main runs when it was chosen.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

#include "commands.h"

namespace sparsa::cli {

struct Subcommand {
  CLI::App* app = nullptr;
  std::function<Outcome()> run;
};

Subcommand add_plan_command(CLI::App& app);
Subcommand add_eval_command(CLI::App& app);

}  // namespace sparsa::cli
