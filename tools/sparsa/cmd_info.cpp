// `sparsa info`: version, backends, machine, registered methods.
#include <iostream>

#include <nlohmann/json.hpp>

#include "cmd_trace.h"
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
    const Status why = backend_status(b);
    backends.push_back({{"name", backend_name(b)}, {"compiled_in", compiled}, {"available", why.ok()},
                        {"reason", why.ok() ? std::string() : why.message()}});
  }
  j["backends"] = backends;
  j["cpu"] = {{"model", machine.cpu_model}, {"logical_cores", machine.logical_cores}, {"isa", machine.isa}};
  j["gpus"] = machine.gpus;
  nlohmann::json list = nlohmann::json::array();
  for (const Method& m : methods()) {
    list.push_back({{"name", m.name}, {"summary", m.summary}, {"in_demo", m.in_demo}, {"params", m.param_help}});
  }
  j["methods"] = list;
  nlohmann::json decode = nlohmann::json::array();
  for (const TraceMethod& m : trace_methods()) decode.push_back({{"name", m.name}, {"summary", m.summary}});
  j["trace_methods"] = decode;
  if (options.json) {
    std::cout << json_text(j) << "\n";
    return success();
  }

  std::cout << "sparsa " << SPARSA_VERSION << "\n\nbackends:\n";
  for (Backend b : {Backend::cpu_ref, Backend::cpu, Backend::cuda}) {
    const std::string name = backend_name(b);
    const Status why = backend_status(b);
    std::cout << "  " << name << std::string(9 - name.size(), ' ')
              << (why.ok() ? "available" : "not available: " + why.message().substr(why.message().find(':') + 2))
              << "\n";
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
  std::cout << "\ndecode methods (sparsa trace; eval and bench take them in --methods):\n";
  for (const TraceMethod& m : trace_methods()) {
    std::cout << "  " << m.name << std::string(width > m.name.size() ? width - m.name.size() + 2 : 2, ' ') << m.summary
              << "\n";
  }
  return success();
}

}  // namespace sparsa::cli
