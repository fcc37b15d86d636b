// Stream-ordered device memory (workspace.h) from one pool per device. The pool keeps up to an
// eighth of the device's memory across synchronisations (the default pool would return it to the
// driver at every one, and the next plan of the same size would ask again); the rest goes back.
// Devices without memory pools use cudaMalloc / cudaFree.
#include <mutex>

#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/common/workspace.h"

namespace sparsa::cuda::detail {

namespace {

struct Pools {
  std::mutex mutex;
  bool ready[kMaxDevices] = {};
  cudaMemPool_t pool[kMaxDevices] = {};  // null: no pool support, plain cudaMalloc
};
Pools& pools() {
  static Pools* p = new Pools;  // never destroyed: arrays may be released during static destruction
  return *p;
}

// The pool of `device` (current), created on first use; null where pools are unsupported.
Status pool_of(int device, cudaMemPool_t* out) {
  *out = nullptr;
  SPARSA_RETURN_IF_ERROR(check_device_id("device", device));
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

Status stream_malloc(int device, size_t bytes, cudaStream_t stream, void** ptr) {
  *ptr = nullptr;
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  cudaMemPool_t pool = nullptr;
  SPARSA_RETURN_IF_ERROR(pool_of(device, &pool));
  if (pool != nullptr) {
    SPARSA_CUDA_CHECK(cudaMallocFromPoolAsync(ptr, bytes > 0 ? bytes : 1, pool, stream));
  } else {
    SPARSA_CUDA_CHECK(cudaMalloc(ptr, bytes > 0 ? bytes : 1));
  }
  return {};
}

void stream_free(int device, void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return;
  DeviceGuard guard;
  if (!guard.enter(device).ok()) return;
  cudaMemPool_t pool = nullptr;
  if (!pool_of(device, &pool).ok()) return;  // made by stream_malloc already: a lookup
  const cudaError_t err = pool != nullptr ? cudaFreeAsync(ptr, stream) : cudaFree(ptr);
  if (err != cudaSuccess) cudaGetLastError();  // nothing to report to: a destructor's free
}

Status StreamBuffer::reserve(int device, cudaStream_t stream, size_t bytes, bool* grew) {
  if (grew != nullptr) *grew = false;
  if (bytes <= bytes_ && data_ != nullptr) return {};
  stream_free(device, data_, stream);
  data_ = nullptr;
  bytes_ = 0;
  SPARSA_RETURN_IF_ERROR(stream_malloc(device, bytes, stream, &data_));
  bytes_ = bytes;
  if (grew != nullptr) *grew = true;
  return {};
}

}  // namespace sparsa::cuda::detail
