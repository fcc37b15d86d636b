// CUDA device queries for `sparsa info`. Compiled when SPARSA_CUDA is on.
#include <cuda_runtime.h>

#include <string>

#include "core/backends.h"

namespace sparsa::cuda {

bool compiled_in() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string device_description(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "unknown";
  return std::string(prop.name) + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.totalGlobalMem >> 20) + " MiB, " + std::to_string(prop.multiProcessorCount) + " SMs";
}

}  // namespace sparsa::cuda
