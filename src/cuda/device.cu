// CUDA device queries for `sparsa info`. Compiled when SPARSA_CUDA is on.
#include <cuda_runtime.h>

#include <string>

#include "core/backends.h"
#include "cuda/common/check.h"

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

namespace {
// Runs f with `device` current, restoring the caller's device afterwards.
template <class F>
Status on_device(int device, F&& f) {
  int current = 0;
  SPARSA_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) SPARSA_CUDA_CHECK(cudaSetDevice(device));
  const Status st = f();
  if (current != device) cudaSetDevice(current);
  return st;
}
}  // namespace

Status malloc_device(int device, size_t bytes, bool zero_fill, void** ptr) {
  *ptr = nullptr;
  return on_device(device, [&]() -> Status {
    SPARSA_CUDA_CHECK(cudaMalloc(ptr, bytes > 0 ? bytes : 1));
    if (zero_fill && bytes > 0) {
      const cudaError_t err = cudaMemsetAsync(*ptr, 0, bytes, nullptr);
      if (err != cudaSuccess) {
        cudaFree(*ptr);
        *ptr = nullptr;
        return detail::cuda_status(err, "cudaMemsetAsync", __FILE__, __LINE__);
      }
    }
    return {};
  });
}

void free_device(int device, void* ptr) {
  if (ptr == nullptr) return;
  (void)on_device(device, [&]() -> Status {
    cudaFree(ptr);
    return {};
  });
}

Status copy_to_host(int device, const void* src, size_t bytes, void* dst) {
  return on_device(device, [&]() -> Status {
    SPARSA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return {};
  });
}

}  // namespace sparsa::cuda
