#include "machine.h"

#include <fstream>
#include <thread>

#include "core/backends.h"

namespace sparsa::cli {

namespace {

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0 || line.rfind("Model", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        const size_t start = line.find_first_not_of(" \t", colon + 1);
        if (start != std::string::npos) return line.substr(start);
      }
    }
  }
  return "unknown";
}

std::vector<std::string> isa_features() {
  std::vector<std::string> found;
#if defined(__x86_64__) || defined(__i386__)
  // cpuid through the compiler's builtin (it also checks the OS saves the AVX state).
  __builtin_cpu_init();
  if (__builtin_cpu_supports("sse4.2")) found.push_back("sse4.2");
  if (__builtin_cpu_supports("avx")) found.push_back("avx");
  if (__builtin_cpu_supports("avx2")) found.push_back("avx2");
  if (__builtin_cpu_supports("fma")) found.push_back("fma");
  if (__builtin_cpu_supports("avx512f")) found.push_back("avx512f");
  if (__builtin_cpu_supports("avx512bw")) found.push_back("avx512bw");
  if (__builtin_cpu_supports("avx512vl")) found.push_back("avx512vl");
  if (__builtin_cpu_supports("avx512bf16")) found.push_back("avx512bf16");
#if !defined(__clang__) || __clang_major__ >= 16  // older clang does not know the name (the sanitizer build)
  if (__builtin_cpu_supports("avx512fp16")) found.push_back("avx512fp16");
#endif
#else
  // Elsewhere, the kernel's flag list.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("Features", 0) == 0 || line.rfind("flags", 0) == 0) {
      for (const char* f : {"asimd", "sve", "sve2", "bf16"}) {
        if (line.find(std::string(" ") + f) != std::string::npos) found.push_back(f);
      }
      break;
    }
  }
#endif
  return found;
}

}  // namespace

MachineInfo machine_info() {
  MachineInfo info;
  info.cpu_model = cpu_model();
  info.logical_cores = std::thread::hardware_concurrency();
  info.isa = isa_features();
  const int gpus = cuda::device_count();
  for (int d = 0; d < gpus; ++d) info.gpus.push_back(cuda::device_description(d));
  return info;
}

}  // namespace sparsa::cli
