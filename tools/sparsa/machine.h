// What `info` (and the headers of `bench` / `demo`) report about the machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsa::cli {

struct MachineInfo {
  std::string cpu_model;              // "model name" of /proc/cpuinfo, or "unknown"
  unsigned logical_cores = 0;         // std::thread::hardware_concurrency()
  std::vector<std::string> isa;       // of avx, avx2, fma, avx512f, ... that the CPU supports
  std::vector<std::string> gpus;      // one description per visible CUDA device
};

MachineInfo machine_info();

}  // namespace sparsa::cli
