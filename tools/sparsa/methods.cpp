// The CLI's method registry (methods.h). Registrars run during static initialisation,
// in an order the linker chooses, so the table lives in a function-local static and
// methods() puts dense first and the rest in name order: stable output everywhere.
#include "methods.h"

#include <algorithm>

namespace sparsa::cli {

namespace {

std::vector<Method>& table() {
  static std::vector<Method> registered;
  return registered;
}

}  // namespace

void register_method(Method method) {
  auto& t = table();
  // A second registration of the same name replaces the first (never two rows).
  auto same = std::find_if(t.begin(), t.end(), [&](const Method& m) { return m.name == method.name; });
  if (same != t.end()) {
    *same = std::move(method);
  } else {
    t.push_back(std::move(method));
  }
  std::stable_sort(t.begin(), t.end(), [](const Method& a, const Method& b) {
    if ((a.name == "dense") != (b.name == "dense")) return a.name == "dense";
    return a.name < b.name;
  });
}

const std::vector<Method>& methods() { return table(); }

const Method* find_method(const std::string& name) {
  for (const Method& m : table()) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

std::string method_names() {
  std::string names;
  for (const Method& m : table()) {
    if (!names.empty()) names += "|";
    names += m.name;
  }
  return names;
}

Status check_known_params(const std::string& method, const Params& params, const std::vector<std::string>& known) {
  if (params.is_null()) return {};
  if (!params.is_object()) return invalid_argument("params: expected key=value pairs for method " + method);
  for (const auto& [key, value] : params.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string list;
    for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
    return invalid_argument("params: unknown key '" + key + "' for method " + method + " (known: " +
                            (list.empty() ? "none" : list) + ")");
  }
  return {};
}

}  // namespace sparsa::cli
