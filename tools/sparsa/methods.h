// The CLI's table of attention methods. `run`, `bench`, `demo` (and later `plan`,
// `eval`) iterate this table, so a new method adds itself by one file in
// tools/sparsa/methods/ that calls SPARSA_REGISTER_METHOD — no edit of the commands.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sparsa/attention.h"

namespace sparsa::cli {

// Method parameters from the command line: `-P key=value` (repeatable), parsed to
// JSON scalars ("0.1" -> number, "true" -> bool, else string). A method reads what
// it needs with defaults and must reject keys it does not know (check_known_params).
using Params = nlohmann::json;

struct MethodInputs {
  Tensor q, k, v;            // CPU tensors [batch, heads, seq, head_dim]
  AttentionOptions options;  // backend, threads, scale, check_finite
  Params params;             // method-specific
};

struct MethodOutput {
  AttentionOutput attention;  // O and LSE
  double density = 1.0;       // fraction of (query, key) pairs visited
  double select_seconds = 0;  // time spent choosing keys (plan), if the method has a plan
  nlohmann::json plan;        // optional: a printable summary of the plan (for `plan` / --json)
};

struct Method {
  std::string name;
  std::string summary;                        // one line for --help and `info`
  std::vector<std::string> param_help;        // "density=0.1  fraction of key blocks kept", ...
  std::function<Result<MethodOutput>(const MethodInputs&)> run;
  bool in_demo = true;                        // part of `sparsa demo`
  Params demo_params = Params::object();      // parameters `demo` and `bench` use by default
  // Whether the method's executor takes AttentionOptions::mask (`run --mask`): the dense and
  // block-sparse executors do; a method that would ignore it refuses it instead.
  bool takes_mask = false;
};

void register_method(Method method);
const std::vector<Method>& methods();          // dense first, then by name (stable across link orders)
const Method* find_method(const std::string& name);
std::string method_names();                    // "dense|block_sparse|..."

// Refuse parameters a method does not know: "params: unknown key 'denstiy' for method block_sparse (known: density, block)".
Status check_known_params(const std::string& method, const Params& params, const std::vector<std::string>& known);

struct Registrar {
  explicit Registrar(Method method) { register_method(std::move(method)); }
};

}  // namespace sparsa::cli

#define SPARSA_CLI_CONCAT2(a, b) a##b
#define SPARSA_CLI_CONCAT(a, b) SPARSA_CLI_CONCAT2(a, b)
#define SPARSA_REGISTER_METHOD(...) \
  static ::sparsa::cli::Registrar SPARSA_CLI_CONCAT(sparsa_method_registrar_, __LINE__){__VA_ARGS__}
