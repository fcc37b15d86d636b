#include "common.h"

#include "core/io_file.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <sstream>
#include <unistd.h>

#include "commands.h"
#include "params.h"
#include "sparsa/io.h"

namespace sparsa::cli {

Outcome method_error(Status status) {
  const std::string& m = status.message();
  // "params: ..." or, from bench/demo, "<method>: params: ...".
  const bool usage = m.rfind("params:", 0) == 0 || m.rfind("-P", 0) == 0 || m.find(": params:") != std::string::npos;
  return {std::move(status), usage ? kExitUsage : kExitRuntime};
}

Outcome load_inputs_or_workload(const std::string& q_path, const std::string& k_path, const std::string* v_path,
                                const WorkloadConfig& config, InputTensors* inputs) {
  if (!q_path.empty()) {
    auto q = load_input("--q", q_path);
    if (!q.ok()) return runtime_error(q.status());
    auto k = load_input("--k", k_path);
    if (!k.ok()) return runtime_error(k.status());
    inputs->q = std::move(q).value();
    inputs->k = std::move(k).value();
    if (v_path != nullptr) {
      auto v = load_input("--v", *v_path);
      if (!v.ok()) return runtime_error(v.status());
      inputs->v = std::move(v).value();
    }
    inputs->source = v_path != nullptr ? q_path : q_path + ", " + k_path;
    return success();
  }
  // The generated workload is allocated from these flags: bound them before it is
  // (--length 2^40 died in the allocator). The same bound as demo's --length.
  constexpr long long kMaxLength = 1 << 22;
  if (config.len_q < 1 || config.len_q > kMaxLength) {
    return usage_error(invalid_argument("--length: expected an integer in [1, " + std::to_string(kMaxLength) +
                                        "], got " + std::to_string(config.len_q)));
  }
  // q, k and v of the workload in f32; 2^31 elements each (8 GiB) is beyond any machine this runs on.
  constexpr long long kMaxElements = 1LL << 31;
  const long long heads = std::max<long long>(config.heads_q, 1), dim = std::max<long long>(config.head_dim, 1);
  if (config.len_q * dim > kMaxElements / heads) {
    return usage_error(invalid_argument("--length: the workload of " + std::to_string(heads) + " heads x " +
                                        std::to_string(config.len_q) + " tokens x head_dim " + std::to_string(dim) +
                                        " exceeds 2^31 elements per tensor; lower --length, --heads or --head-dim"));
  }
  auto w = generate_workload(config);
  if (!w.ok()) return usage_error(w.status());
  inputs->q = std::move(w->q);
  inputs->k = std::move(w->k);
  inputs->v = std::move(w->v);
  inputs->source = describe(config);
  return success();
}

Result<HostArray> load_input(const std::string& flag, const std::string& path) {
  if (path.empty()) return invalid_argument(flag + ": expected a file name, got an empty string");
  Result<HostArray> array = read_tensor(path);
  if (!array.ok()) return Status{array.status().code(), flag + ": " + array.status().message()};
  return array;
}

static bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Status check_output_path(const std::string& flag, const std::string& path_and_name,
                         const std::vector<std::string>& extensions) {
  if (path_and_name.empty()) return invalid_argument(flag + ": expected a file name, got an empty string");
  // "x.safetensors:name" names the entry (write_tensor); the file is "x.safetensors".
  std::string path = path_and_name;
  const size_t entry = path.rfind(".safetensors:");
  if (entry != std::string::npos &&
      std::find(extensions.begin(), extensions.end(), ".safetensors") != extensions.end()) {
    path.resize(entry + std::string(".safetensors").size());
  }
  bool known = false;
  std::string list;
  for (const std::string& ext : extensions) {
    known = known || ends_with(path, ext);
    list += (list.empty() ? "" : " or ") + ext;
  }
  if (!known) return invalid_argument(flag + ": expected a file name ending in " + list + ", got '" + path + "'");
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) {
    return {StatusCode::io_error, flag + ": '" + path + "' is a directory"};
  }
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    return {StatusCode::io_error, flag + ": directory '" + dir.string() + "' of '" + path + "' does not exist"};
  }
  if (::access(dir.c_str(), W_OK) != 0 || (fs::exists(p, ec) && ::access(p.c_str(), W_OK) != 0)) {
    return {StatusCode::io_error, flag + ": '" + path + "' is not writable"};
  }
  return {};
}

// The file of "x.safetensors:name" (the path itself otherwise) and the entry name ("" if none).
static std::pair<std::string, std::string> file_and_entry(const std::string& path_and_name) {
  const std::string kSt = ".safetensors";
  const size_t at = path_and_name.rfind(kSt + ":");
  if (at == std::string::npos) return {path_and_name, ""};
  return {path_and_name.substr(0, at + kSt.size()), path_and_name.substr(at + kSt.size() + 1)};
}

Status check_outputs_distinct(const std::vector<std::pair<std::string, std::string>>& outputs,
                              const std::vector<std::pair<std::string, std::string>>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& [flag, path] = outputs[i];
    const auto [file, entry] = file_and_entry(path);
    for (const auto& [in_flag, in_path] : inputs) {
      if (in_path.empty()) continue;
      if (detail::same_file(file, file_and_entry(in_path).first)) {
        return invalid_argument(flag + ": '" + path + "' is the same file as the input " + in_flag + " ('" + in_path +
                                "'); writing it would replace the input: choose another output file");
      }
    }
    for (size_t j = 0; j < i; ++j) {
      const auto [other_file, other_entry] = file_and_entry(outputs[j].second);
      if (!detail::same_file(file, other_file)) continue;
      // Two named entries of one .safetensors file are written together as one file.
      if (!entry.empty() && !other_entry.empty() && entry != other_entry) continue;
      return invalid_argument(flag + ": '" + path + "' is the same file as " + outputs[j].first + " ('" +
                              outputs[j].second + "'); give each its own file, or name two entries of one "
                              ".safetensors file (x.safetensors:o and x.safetensors:lse)");
    }
  }
  return {};
}

Result<Params> parse_params(const std::vector<std::string>& texts) {
  Params params = Params::object();
  for (const std::string& t : texts) SPARSA_RETURN_IF_ERROR(parse_param(t, &params));
  return params;
}

namespace {

// Whether `m` takes -P `key`: a key of its demo parameters, or one its help lines start with
// ("density=0.1  ...", "force_first=false, force_last=true  ...", "block_q, block_kv  ...").
bool method_takes(const Method& m, const std::string& key) {
  if (m.demo_params.is_object() && m.demo_params.contains(key)) return true;
  for (const std::string& line : m.param_help) {
    std::stringstream names(line.substr(0, line.find("  ")));
    std::string name;
    while (std::getline(names, name, ',')) {
      name.erase(0, name.find_first_not_of(' '));
      if (name.substr(0, name.find('=')) == key) return true;
    }
  }
  return false;
}

}  // namespace

Result<std::map<std::string, Params>> parse_scoped_params(const std::vector<std::string>& texts,
                                                          const std::vector<const Method*>& selected) {
  std::map<std::string, Params> per_method;
  std::map<std::string, Params> given;
  for (const Method* m : selected) {
    per_method[m->name] = m->demo_params.is_object() ? m->demo_params : Params::object();
    given[m->name] = Params::object();
  }
  for (const std::string& t : texts) {
    const size_t dot = t.find('.'), eq = t.find('=');
    if (dot == std::string::npos || (eq != std::string::npos && dot > eq)) {
      // A plain key=value (as `trace` and `run` take it) goes to every method run that takes it.
      const std::string key = t.substr(0, eq);
      bool taken = false;
      for (const Method* m : selected) {
        if (!method_takes(*m, key)) continue;
        SPARSA_RETURN_IF_ERROR(parse_param(t, &given[m->name]));
        taken = true;
      }
      if (!taken) {
        return invalid_argument("-P: no method run takes '" + key + "' (" + t +
                                "); scope it as method.key=value, e.g. block_sparse.density=0.2");
      }
      continue;
    }
    const std::string name = t.substr(0, dot);
    if (!per_method.count(name)) {
      return invalid_argument("-P: '" + t + "' names method '" + name + "', which is not among the methods run");
    }
    SPARSA_RETURN_IF_ERROR(parse_param(t.substr(dot + 1), &given[name]));
  }
  for (auto& [name, params] : given) {
    for (auto& [key, value] : params.items()) per_method[name][key] = value;
  }
  return per_method;
}

Result<std::vector<const Method*>> select_methods(const std::string& csv, bool demo_only) {
  std::vector<const Method*> chosen;
  if (csv.empty()) {
    for (const Method& m : methods()) {
      if (!demo_only || m.in_demo) chosen.push_back(&m);
    }
    return chosen;
  }
  std::stringstream ss(csv);
  std::string name;
  while (std::getline(ss, name, ',')) {
    const Method* m = find_method(name);
    if (m == nullptr) {
      return invalid_argument("--methods: unknown method '" + name + "' (known: " + method_names() + ")");
    }
    if (std::find(chosen.begin(), chosen.end(), m) != chosen.end()) {
      return invalid_argument("--methods: method '" + name + "' is listed twice");
    }
    chosen.push_back(m);
  }
  if (chosen.empty()) return invalid_argument("--methods: expected at least one method name");
  return chosen;
}

Result<std::vector<int64_t>> parse_lengths(const std::string& flag, const std::string& csv) {
  std::vector<int64_t> lengths;
  std::stringstream ss(csv);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || errno != 0 || end != item.c_str() + item.size() || v <= 0 || v > (int64_t{1} << 24)) {
      return invalid_argument(flag + ": expected positive integers up to " + std::to_string(1 << 24) +
                              " separated by commas, got '" + item + "'");
    }
    lengths.push_back(v);
  }
  if (lengths.empty()) return invalid_argument(flag + ": expected at least one length");
  return lengths;
}

Result<Backend> parse_backend_flag(const std::string& text) {
  Result<Backend> backend = parse_backend(text);
  if (!backend.ok()) return invalid_argument("--backend: expected cpu, cpu_ref or cuda, got '" + text + "'");
  return backend;
}

Comparison compare_outputs(const AttentionOutput& output, const AttentionOutput& reference) {
  Comparison c;
  const Tensor o = output.out.view(), r = reference.out.view();
  double diff2 = 0, ref2 = 0;
  const int64_t n = std::min(o.numel(), r.numel());
  for (int64_t i = 0; i < n; ++i) {
    const double a = load_as_double(o, i), b = load_as_double(r, i);
    diff2 += (a - b) * (a - b);
    ref2 += b * b;
  }
  c.rel_frobenius = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  const float* lse = output.lse.ptr<float>();
  const float* lse_ref = reference.lse.ptr<float>();
  const int64_t m = std::min(output.lse.numel(), reference.lse.numel());
  for (int64_t i = 0; i < m; ++i) {
    const double a = lse[i], b = lse_ref[i];
    double d;
    if (std::isinf(a) && std::isinf(b) && a == b) {
      d = 0;
    } else {
      d = std::fabs(a - b);
      if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    }
    c.max_lse_diff = std::max(c.max_lse_diff, d);
  }
  return c;
}

double median(std::vector<double> values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string json_text(const nlohmann::json& value, int indent) {
  return value.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string params_text(const Params& params) {
  if (!params.is_object() || params.empty()) return "-";
  std::string s;
  for (const auto& [key, value] : params.items()) {
    if (!s.empty()) s += " ";
    s += key + "=" + (value.is_string() ? value.get<std::string>() : json_text(value, -1));
  }
  return s;
}

}  // namespace sparsa::cli

#include "sparsa/workload.h"
#include "util.h"

namespace sparsa::cli {

Result<Measurement> measure(const Method& method, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Params& params, const AttentionOptions& options, int warmup, int repeats) {
  MethodInputs inputs{q, k, v, options, params};
  Measurement m;
  for (int r = 0; r < warmup + repeats; ++r) {
    const double t0 = now_seconds();
    Result<MethodOutput> out = method.run(inputs);
    const double t1 = now_seconds();
    if (!out.ok()) return Status{out.status().code(), method.name + ": " + out.status().message()};
    if (r >= warmup) m.seconds.push_back(t1 - t0);
    if (r == warmup + repeats - 1) {
      m.select_seconds = out->select_seconds;
      m.density = out->density;
      m.output = std::move(out->attention);
      m.plan = std::move(out->plan);
    }
  }
  return m;
}

Status preflight(const std::vector<const Method*>& selected, const std::map<std::string, Params>& params,
                 int64_t heads_q, int64_t heads_kv, int64_t head_dim, const AttentionOptions& options) {
  WorkloadConfig config;
  config.heads_q = heads_q;
  config.heads_kv = heads_kv;
  config.head_dim = head_dim;
  config.len_q = config.len_kv = 128;
  Result<Workload> small = generate_workload(config);
  if (!small.ok()) return Status{small.status().code(), "workload: " + small.status().message()};
  for (const Method* method : selected) {
    const auto it = params.find(method->name);
    Result<Measurement> m = measure(*method, small->q.view(), small->k.view(), small->v.view(),
                                    it == params.end() ? Params::object() : it->second, options, 0, 1);
    if (!m.ok()) return m.status();
  }
  return {};
}

}  // namespace sparsa::cli
