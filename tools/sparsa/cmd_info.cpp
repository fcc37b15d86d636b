// `sparsa info`: version, backends, machine, registered methods.
#include <iostream>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "common.h"
#include "core/backends.h"
#include "machine.h"
#include "methods.h"
#include "sparsa/attention.h"

namespace sparsa::cli {

Outcome cmd_info(const InfoOptions& options) {
  const MachineInfo machine = machine_info();
  nlohmann::json j;
  j["version"] = SPARSA_VERSION;
  nlohmann::json backends = nlohmann::json::array();
  for (Backend b : {Backend::cpu_ref, Backend::cpu, Backend::cuda}) {
    const bool compiled = b != Backend::cuda || cuda::compiled_in();
    backends.push_back({{"name", backend_name(b)}, {"compiled_in", compiled}, {"available", backend_available(b)}});
  }
  j["backends"] = backends;
  j["cpu"] = {{"model", machine.cpu_model}, {"logical_cores", machine.logical_cores}, {"isa", machine.isa}};
  j["gpus"] = machine.gpus;
  nlohmann::json list = nlohmann::json::array();
  for (const Method& m : methods()) {
    list.push_back({{"name", m.name}, {"summary", m.summary}, {"in_demo", m.in_demo}, {"params", m.param_help}});
  }
  j["methods"] = list;
  if (options.json) {
    std::cout << json_text(j) << "\n";
    return success();
  }

  std::cout << "sparsa " << SPARSA_VERSION << "\n\nbackends:\n";
  for (const auto& b : backends) {
    std::cout << "  " << b["name"].get<std::string>() << std::string(9 - b["name"].get<std::string>().size(), ' ')
              << (b["compiled_in"].get<bool>() ? "compiled in" : "not compiled in") << ", "
              << (b["available"].get<bool>() ? "available" : "not available") << "\n";
  }
  std::cout << "\ncpu:      " << machine.cpu_model << "\ncores:    " << machine.logical_cores << " logical\nisa:      ";
  for (size_t i = 0; i < machine.isa.size(); ++i) std::cout << (i ? " " : "") << machine.isa[i];
  if (machine.isa.empty()) std::cout << "(none detected)";
  std::cout << "\ngpu:      ";
  if (machine.gpus.empty()) {
    std::cout << (cuda::compiled_in() ? "none visible" : "none (CUDA not compiled in)") << "\n";
  } else {
    for (size_t i = 0; i < machine.gpus.size(); ++i) std::cout << (i ? "          " : "") << machine.gpus[i] << "\n";
  }
  std::cout << "\nmethods:\n";
  size_t width = 0;
  for (const Method& m : methods()) width = std::max(width, m.name.size());
  for (const Method& m : methods()) {
    std::cout << "  " << m.name << std::string(width - m.name.size() + 2, ' ') << m.summary
              << (m.in_demo ? "" : " [not in demo]") << "\n";
    for (const std::string& p : m.param_help) std::cout << "  " << std::string(width + 2, ' ') << "-P " << p << "\n";
  }
  return success();
}

}  // namespace sparsa::cli
