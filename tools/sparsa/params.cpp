#include "params.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace sparsa::cli {

namespace {

bool parse_integer(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

bool parse_real(const std::string& s, double* out) {
  if (s.empty()) return false;
  // strtod accepts "nan", "inf", hex floats: only plain decimal numbers are numbers here.
  for (char c : s) {
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E')) {
      return false;
    }
  }
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

Status expected(const std::string& key, const std::string& what, const nlohmann::json& got) {
  return invalid_argument("params: " + key + ": expected " + what + ", got " + param_text(got));
}

}  // namespace

std::string param_text(const nlohmann::json& value) {
  if (value.is_string()) {
    // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "'" + s + "'".
    std::string quoted(1, '\'');
    quoted += value.get_ref<const std::string&>();
    quoted += '\'';
    return quoted;
  }
  return value.dump();
}

Status parse_param(const std::string& text, Params* params) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos) return invalid_argument("-P: expected key=value, got '" + text + "'");
  const std::string key = text.substr(0, eq), value = text.substr(eq + 1);
  if (key.empty()) return invalid_argument("-P: empty key in '" + text + "'");
  if (!params->is_object()) *params = Params::object();
  if (params->contains(key)) return invalid_argument("-P: key '" + key + "' given more than once");
  int64_t i = 0;
  double r = 0;
  if (parse_integer(value, &i)) {
    (*params)[key] = i;
  } else if (parse_real(value, &r)) {
    (*params)[key] = r;
  } else if (value == "true" || value == "false") {
    (*params)[key] = value == "true";
  } else {
    (*params)[key] = value;
  }
  return {};
}

Result<int64_t> param_int(const Params& params, const std::string& key, int64_t fallback, int64_t min,
                          int64_t max) {
  if (!params.is_object() || !params.contains(key)) return fallback;
  const nlohmann::json& v = params.at(key);
  int64_t x = 0;
  if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>() &&
             std::fabs(v.get<double>()) < 9.0e18) {
    x = static_cast<int64_t>(v.get<double>());
  } else {
    return expected(key, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]", v);
  }
  if (x < min || x > max) {
    return expected(key, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]", v);
  }
  return x;
}

Result<double> param_real(const Params& params, const std::string& key, double fallback, double min, double max,
                          bool min_open, bool max_open) {
  if (!params.is_object() || !params.contains(key)) return fallback;
  const nlohmann::json& v = params.at(key);
  std::ostringstream range;
  range << "a number in " << (min_open ? "(" : "[") << min << ", " << max << (max_open ? ")" : "]");
  if (!v.is_number()) return expected(key, range.str(), v);
  const double x = v.get<double>();
  const bool low_ok = min_open ? x > min : x >= min;
  const bool high_ok = max_open ? x < max : x <= max;
  if (!std::isfinite(x) || !low_ok || !high_ok) return expected(key, range.str(), v);
  return x;
}

Result<bool> param_bool(const Params& params, const std::string& key, bool fallback) {
  if (!params.is_object() || !params.contains(key)) return fallback;
  const nlohmann::json& v = params.at(key);
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) return v.get<int64_t>() == 1;
  return expected(key, "true or false", v);
}

Result<std::string> param_string(const Params& params, const std::string& key, const std::string& fallback) {
  if (!params.is_object() || !params.contains(key)) return fallback;
  const nlohmann::json& v = params.at(key);
  if (v.is_string()) return v.get<std::string>();
  // A file named "64" is still a name.
  if (v.is_number() || v.is_boolean()) return v.dump();
  return expected(key, "a string", v);
}

}  // namespace sparsa::cli
