// CUDA device queries for `sparsa info`. Compiled when SPARSA_CUDA is on.
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
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

constexpr int kMaxPoolDevices = 64;

namespace {
// Runs f with `device` current, restoring the caller's device afterwards.
template <class F>
Status on_device(int device, F&& f) {
  detail::DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  return f();
}
}  // namespace

// DeviceArrays come from a stream-ordered pool of sparsa's own per device (cudaMallocFromPoolAsync
// / cudaFreeAsync on the default stream, where every sparsa kernel runs): freeing a plan no longer
// synchronises the device as cudaFree does, and the next plan of the same size reuses the memory
// without asking the driver. The pool keeps up to an eighth of the device's memory across
// synchronisations (the default pool would return it at every one); the rest goes back to the
// driver. Devices without memory pools use cudaMalloc / cudaFree. Memory a caller uses on another
// non-blocking stream must be synchronised before the array is released, as for any CUDA op on
// the default stream.
namespace {
struct Pools {
  std::mutex mutex;
  bool ready[kMaxPoolDevices] = {};
  cudaMemPool_t pool[kMaxPoolDevices] = {};  // null: no pool support, plain cudaMalloc
};
Pools& pools() {
  static Pools* p = new Pools;  // never destroyed: arrays may be released during static destruction
  return *p;
}

// The pool of `device` (current), created on first use; null where pools are unsupported.
Status pool_of(int device, cudaMemPool_t* out) {
  *out = nullptr;
  if (device < 0 || device >= kMaxPoolDevices) return {};
  Pools& p = pools();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (!p.ready[device]) {
    int supported = 0;
    SPARSA_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    if (supported != 0) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.handleTypes = cudaMemHandleTypeNone;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cudaMemPool_t pool = nullptr;
      SPARSA_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
      size_t free_bytes = 0, total_bytes = 0;
      SPARSA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      uint64_t keep = total_bytes / 8;
      SPARSA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
      p.pool[device] = pool;
    }
    p.ready[device] = true;
  }
  *out = p.pool[device];
  return {};
}
}  // namespace

Status malloc_device(int device, size_t bytes, bool zero_fill, void** ptr) {
  *ptr = nullptr;
  return on_device(device, [&]() -> Status {
    cudaMemPool_t pool = nullptr;
    SPARSA_RETURN_IF_ERROR(pool_of(device, &pool));
    if (pool != nullptr) {
      SPARSA_CUDA_CHECK(cudaMallocFromPoolAsync(ptr, bytes > 0 ? bytes : 1, pool, nullptr));
    } else {
      SPARSA_CUDA_CHECK(cudaMalloc(ptr, bytes > 0 ? bytes : 1));
    }
    if (zero_fill && bytes > 0) {
      const cudaError_t err = cudaMemsetAsync(*ptr, 0, bytes, nullptr);
      if (err != cudaSuccess) {
        if (pool != nullptr) cudaFreeAsync(*ptr, nullptr);
        else cudaFree(*ptr);
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
    cudaMemPool_t pool = nullptr;
    SPARSA_RETURN_IF_ERROR(pool_of(device, &pool));  // made by malloc_device already: a lookup
    if (pool != nullptr) cudaFreeAsync(ptr, nullptr);
    else cudaFree(ptr);
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
