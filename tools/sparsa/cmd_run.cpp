// `sparsa run`: one method on tensors from files, O (and LSE) to files.
#include <cmath>
#include <iostream>

#include "commands.h"
#include "common.h"
#include "file_layout.h"
#include "methods.h"
#include "sparsa/io.h"
#include "util.h"

namespace sparsa::cli {

Outcome cmd_run(const RunOptions& options) {
  // Everything the command line alone decides is checked before any file is read.
  const Method* method = find_method(options.method);
  if (method == nullptr) {
    return usage_error(invalid_argument("--method: unknown method '" + options.method + "' (known: " +
                                        method_names() + ")"));
  }
  Result<Params> params = parse_params(options.params);
  if (!params.ok()) return usage_error(params.status());
  if (!options.index.empty()) {
    if (params->contains("index")) return usage_error(invalid_argument("--index: also given as -P index=..."));
    (*params)["index"] = options.index;
  }
  Result<Mask> mask = parse_mask(options.mask, "--mask");
  if (!mask.ok()) return usage_error(mask.status());
  if (!mask->is_none() && !method->takes_mask) {
    return usage_error(invalid_argument("--mask: method " + method->name + " takes no mask (" + mask_string(*mask) +
                                        " given); dense, block_sparse and the block-selector methods do"));
  }
  Result<Backend> backend = parse_backend_flag(options.backend);
  if (!backend.ok()) return usage_error(backend.status());
  Result<FileLayout> layout = parse_layout(options.layout);
  if (!layout.ok()) return usage_error(layout.status());
  // The scale is used as an f32: 1e39 would become inf and 1e-50 zero.
  const float scale_f32 = static_cast<float>(options.scale);
  if (options.scale_given && !(std::isfinite(scale_f32) && scale_f32 > 0)) {
    return usage_error(invalid_argument("--scale: expected a finite positive number, got " + format("%g", options.scale)));
  }
  if (options.threads < 0 || options.threads > kMaxThreads) {
    return usage_error(invalid_argument("--threads: expected an integer in [0, " + std::to_string(kMaxThreads) +
                                        "] (0 = all cores), got " + std::to_string(options.threads)));
  }
  for (auto [flag, path] : {std::pair<const char*, const std::string*>{"--out", &options.out},
                            std::pair<const char*, const std::string*>{"--lse", &options.lse}}) {
    if (path->empty() && std::string(flag) == "--lse") continue;
    Status s = check_output_path(flag, *path, {".npy", ".safetensors"});
    if (!s.ok()) return s.code() == StatusCode::invalid_argument ? usage_error(s) : runtime_error(s);
  }
  std::vector<std::pair<std::string, std::string>> outputs = {{"--out", options.out}};
  if (!options.lse.empty()) outputs.emplace_back("--lse", options.lse);
  std::vector<std::pair<std::string, std::string>> input_files = {
      {"--q", options.q}, {"--k", options.k}, {"--v", options.v}};
  if (params->contains("index") && (*params)["index"].is_string()) {
    input_files.emplace_back(options.index.empty() ? "-P index" : "--index", (*params)["index"].get<std::string>());
  }
  if (Status distinct = check_outputs_distinct(outputs, input_files); !distinct.ok()) return usage_error(distinct);

  Result<HostArray> q = load_input("--q", options.q);
  if (!q.ok()) return runtime_error(q.status());
  Result<HostArray> k = load_input("--k", options.k);
  if (!k.ok()) return runtime_error(k.status());
  Result<HostArray> v = load_input("--v", options.v);
  if (!v.ok()) return runtime_error(v.status());

  // A file may hold an empty array; its view has no data, which the library would
  // report as "missing", so name the real problem here.
  for (auto [name, array] : {std::pair{"q", &*q}, std::pair{"k", &*k}, std::pair{"v", &*v}}) {
    if (array->numel() == 0) {
      return runtime_error(invalid_argument(std::string(name) + ": empty tensor of shape " +
                                            array->view().shape_string() + "; every dimension must be > 0"));
    }
  }

  MethodInputs inputs;
  inputs.q = swap_layout(q->view(), *layout);
  inputs.k = swap_layout(k->view(), *layout);
  inputs.v = swap_layout(v->view(), *layout);
  inputs.options.backend = *backend;
  inputs.options.check_finite = options.check_finite;
  inputs.options.num_threads = options.threads;
  inputs.options.mask = *mask;
  if (options.scale_given) inputs.options.scale = static_cast<float>(options.scale);
  inputs.params = *params;

  const double t0 = now_seconds();
  Result<MethodOutput> output = method->run(inputs);
  const double seconds = now_seconds() - t0;
  if (!output.ok()) return method_error(output.status());

  // Both files are written before either replaces what was there: a failure leaves
  // neither a new O without its LSE nor a lost old file. O goes back in the inputs' layout.
  std::vector<std::pair<std::string, Tensor>> files = {
      {options.out, swap_layout(output->attention.out.view(), *layout)}};
  std::vector<const char*> labels = {"--out"};
  if (!options.lse.empty()) {
    files.emplace_back(options.lse, output->attention.lse.view());
    labels.push_back("--lse");
  }
  Status written = write_tensors(files, labels.data());
  if (!written.ok()) return runtime_error(written);
  if (!options.quiet) {
    std::cout << method->name << ": q " << inputs.q.shape_string() << " k " << inputs.k.shape_string() << " "
              << dtype_name(inputs.q.dtype) << ", backend " << backend_name(*backend)
              << (mask->is_none() ? "" : ", mask " + mask_string(*mask)) << ", "
              << format("%.4f s (select %.4f s), density %.4f", seconds, output->select_seconds, output->density)
              << "\n  out -> " << options.out;
    if (!options.lse.empty()) std::cout << "\n  lse -> " << options.lse;
    std::cout << "\n";
  }
  return success();
}

}  // namespace sparsa::cli
