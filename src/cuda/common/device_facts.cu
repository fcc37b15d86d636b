// Device facts asked once (device_facts.h). Every cache here is a small vector under one mutex:
// the lookups are host work of a few hundred nanoseconds, the driver queries they replace are not.
#include <algorithm>
#include <atomic>
#include <climits>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"

namespace sparsa::cuda::detail {

namespace {

constexpr size_t kDefaultSmemLimit = 48 * 1024;  // dynamic shared memory any kernel may take

struct Raised {
  int device;
  const void* kernel;
  size_t smem;  // the limit now set
};
struct Occupancy {
  int device;
  const void* kernel;
  int threads;
  size_t smem;
  int per_sm;
};

struct Facts {
  std::mutex mutex;
  int sms[kMaxDevices] = {};
  int optin[kMaxDevices] = {};
  std::vector<Raised> raised;
  std::vector<Occupancy> occupancy;
};
Facts& facts() {
  static Facts* f = new Facts;  // never destroyed: launches may run during static destruction
  return *f;
}

std::atomic<int> g_fail_smem_raises{0};

Status sm_count_locked(Facts& f, int device, int* sms) {
  if (f.sms[device] == 0) {
    int n = 0;
    SPARSA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    f.sms[device] = std::max(n, 1);
  }
  *sms = f.sms[device];
  return {};
}

Status allow_dynamic_smem_locked(Facts& f, const void* kernel, int device, size_t smem) {
  if (smem <= kDefaultSmemLimit) return {};
  if (g_fail_smem_raises.load() > 0) {
    g_fail_smem_raises.fetch_sub(1);
    SPARSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, INT_MAX));
  }
  auto it = std::find_if(f.raised.begin(), f.raised.end(),
                         [&](const Raised& r) { return r.device == device && r.kernel == kernel; });
  if (it != f.raised.end() && it->smem >= smem) return {};
  if (f.optin[device] == 0) {
    SPARSA_CUDA_CHECK(cudaDeviceGetAttribute(&f.optin[device], cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  }
  cudaFuncAttributes attr{};
  SPARSA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (smem + attr.sharedSizeBytes > static_cast<size_t>(f.optin[device])) {
    return {StatusCode::unsupported, "cuda: a kernel needs " + std::to_string(smem) + " bytes of dynamic and " +
                                         std::to_string(attr.sharedSizeBytes) +
                                         " of static shared memory; cuda:" + std::to_string(device) + " has " +
                                         std::to_string(f.optin[device]) + " per block"};
  }
  SPARSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  SPARSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  if (it != f.raised.end()) {
    it->smem = smem;
  } else {
    f.raised.push_back({device, kernel, smem});
  }
  return {};
}

}  // namespace

Status check_device_id(const char* name, int device) {
  if (device >= 0 && device < kMaxDevices) return {};
  return {StatusCode::unsupported, std::string(name) + ": cuda:" + std::to_string(device) + " is beyond the " +
                                       std::to_string(kMaxDevices) + " devices the cuda backend keeps state for"};
}

Status sm_count(int device, int* sms) {
  SPARSA_RETURN_IF_ERROR(check_device_id("device", device));
  Facts& f = facts();
  std::lock_guard<std::mutex> lock(f.mutex);
  return sm_count_locked(f, device, sms);
}

Status allow_dynamic_smem(const void* kernel, int device, size_t smem) {
  SPARSA_RETURN_IF_ERROR(check_device_id("device", device));
  Facts& f = facts();
  std::lock_guard<std::mutex> lock(f.mutex);
  return allow_dynamic_smem_locked(f, kernel, device, smem);
}

Status resident_ctas(const void* kernel, int device, int threads, size_t smem, int* per_sm) {
  SPARSA_RETURN_IF_ERROR(check_device_id("device", device));
  Facts& f = facts();
  std::lock_guard<std::mutex> lock(f.mutex);
  SPARSA_RETURN_IF_ERROR(allow_dynamic_smem_locked(f, kernel, device, smem));
  for (const Occupancy& o : f.occupancy) {
    if (o.device == device && o.kernel == kernel && o.threads == threads && o.smem == smem) {
      *per_sm = o.per_sm;
      return {};
    }
  }
  int n = 0;
  SPARSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  *per_sm = std::max(n, 1);
  if (f.occupancy.size() >= 256) f.occupancy.erase(f.occupancy.begin());  // many shapes: forget the oldest
  f.occupancy.push_back({device, kernel, threads, smem, *per_sm});
  return {};
}

Status ReadBackBuffer::reserve() {
  if (data_ != nullptr) return {};
  // Slabs of 256 slots (64 KiB); a new slab only when one is used up.
  constexpr size_t kSlots = 256;
  static std::mutex mutex;
  static char* slab = nullptr;
  static size_t used = kSlots;
  std::lock_guard<std::mutex> lock(mutex);
  if (used == kSlots) {
    void* p = nullptr;
    if (cudaMallocHost(&p, kSlots * kReadBackBytes) != cudaSuccess) {
      cudaGetLastError();  // no pinned memory to be had: pageable slots still work
      p = ::operator new(kSlots * kReadBackBytes);
    }
    slab = static_cast<char*>(p);
    used = 0;
  }
  data_ = slab + used++ * kReadBackBytes;
  return {};
}

void fail_next_smem_raises_for_testing(int count) { g_fail_smem_raises.store(count); }

}  // namespace sparsa::cuda::detail
