// CUDA device queries for `sparsa info`. Compiled when SPARSA_CUDA is on.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/backends.h"
#include "cuda/common/check.h"
#include "cuda/common/workspace.h"

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

// DeviceArrays come from the stream-ordered pool of their device (common/workspace.h) on the
// caller's stream: freeing a plan does not synchronise the device as cudaFree does, and the next
// plan of the same size reuses the memory without asking the driver.
Status malloc_device(int device, size_t bytes, bool zero_fill, void* stream, void** ptr) {
  const auto s = static_cast<cudaStream_t>(stream);
  SPARSA_RETURN_IF_ERROR(detail::stream_malloc(device, bytes, s, ptr));
  if (zero_fill && bytes > 0) {
    detail::DeviceGuard guard;  // the legacy stream is the current device's
    SPARSA_RETURN_IF_ERROR(guard.enter(device));
    const cudaError_t err = cudaMemsetAsync(*ptr, 0, bytes, s);
    if (err != cudaSuccess) {
      detail::stream_free(device, *ptr, s);
      *ptr = nullptr;
      return detail::cuda_status(err, "cudaMemsetAsync", __FILE__, __LINE__);
    }
  }
  return {};
}

void free_device(int device, void* ptr, void* stream) {
  detail::stream_free(device, ptr, static_cast<cudaStream_t>(stream));
}

namespace {
// A copy between host and device memory ordered on `stream`, waited for.
Status copy_and_wait(int device, const void* src, size_t bytes, void* dst, cudaMemcpyKind kind, void* stream) {
  detail::DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  const auto s = static_cast<cudaStream_t>(stream);
  SPARSA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  SPARSA_CUDA_CHECK(cudaStreamSynchronize(s));
  return {};
}
}  // namespace

Status copy_to_host(int device, const void* src, size_t bytes, void* dst, void* stream) {
  return copy_and_wait(device, src, bytes, dst, cudaMemcpyDeviceToHost, stream);
}

Status copy_to_device(int device, const void* src, size_t bytes, void* dst, void* stream) {
  return copy_and_wait(device, src, bytes, dst, cudaMemcpyHostToDevice, stream);
}

}  // namespace sparsa::cuda
