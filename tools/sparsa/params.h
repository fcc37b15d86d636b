// Typed reads of method parameters (`-P key=value`) with defaults and range checks.
// Every failure is a Status "params: <key>: expected ..., got ..." so the user sees
// which -P was wrong.
#pragma once

#include <cstdint>
#include <string>

#include "methods.h"

namespace sparsa::cli {

// "-P key=value" text to a JSON scalar: integers and reals become numbers, true/false
// booleans, anything else a string. Fails on a missing '=' or an empty key.
Status parse_param(const std::string& text, Params* params);

Result<int64_t> param_int(const Params& params, const std::string& key, int64_t fallback, int64_t min,
                          int64_t max);
// A real in [min, max]; min_open / max_open exclude the end points.
Result<double> param_real(const Params& params, const std::string& key, double fallback, double min, double max,
                          bool min_open = false, bool max_open = false);
Result<bool> param_bool(const Params& params, const std::string& key, bool fallback);
Result<std::string> param_string(const Params& params, const std::string& key, const std::string& fallback);

// Printable value of a parameter ("0.1", "true", "'abc'").
std::string param_text(const nlohmann::json& value);

}  // namespace sparsa::cli
