// Internal: what every cuda launcher asks of a device, asked once and kept here (one home, so no
// launcher writes its own cache): the SM count, the dynamic shared-memory limit a kernel needs
// raised, the CTAs of a kernel that fit on one SM, and small pinned buffers for read-backs.
// Function attributes belong to the current device: the caller has made `device` current
// (DeviceGuard) before asking anything of a kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "sparsa/status.h"

namespace sparsa::cuda::detail {

// Devices the cuda backend keeps per-device state for (device ids 0 .. kMaxDevices - 1).
constexpr int kMaxDevices = 64;

// "NAME: cuda:N is beyond the 64 devices ..." for an id outside [0, kMaxDevices).
Status check_device_id(const char* name, int device);

// The number of SMs of `device` (at least 1).
Status sm_count(int device, int* sms);

// Lets `kernel` launch with `smem` bytes of dynamic shared memory on `device`: above the 48 KiB
// every kernel may take, the kernel's limit is raised (once per device and size) to exactly what
// it needs, and its carveout set to all of the unified L1 as shared memory (these kernels read
// global memory through L2, and the carveout decides how many CTAs fit). The limit is what the
// launch needs, not the device's opt-in maximum: the attribute counts dynamic memory only, and a
// kernel with static shared memory may not ask for the whole opt-in on top of it. A need beyond
// the device is a clear `unsupported` error, not a launch failure.
Status allow_dynamic_smem(const void* kernel, int device, size_t smem);

// CTAs of `kernel` resident per SM at (threads, smem), at least 1; raises the shared-memory limit
// first (allow_dynamic_smem). Asked of the driver once per (device, kernel, threads, smem).
Status resident_ctas(const void* kernel, int device, int threads, size_t smem, int* per_sm);

// A host buffer for small device-to-host read-backs (an error word, a verdict: at most
// kReadBackBytes): a slot of one pinned slab the process allocates once, so that a state made
// for a new stream allocates no pinned memory (cudaMallocHost may serialise streams); pageable
// when the driver has no pinned memory to give (a slower copy, still correct). Slots are never
// returned: there is one per (launcher, device, stream).
constexpr size_t kReadBackBytes = 256;
class ReadBackBuffer {
 public:
  // A slot of kReadBackBytes bytes at data().
  Status reserve();
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

// Test hook: the next `count` calls of allow_dynamic_smem for more than 48 KiB (raised before or
// not) instead ask the runtime for an impossible limit, so that a real CUDA error (cudaErrorInvalidValue, left in the
// runtime's last-error slot) happens mid-call, as it did when the limit was the opt-in maximum.
// Tests use it to show that a failed call leaves the library usable for the next one.
void fail_next_smem_raises_for_testing(int count);

}  // namespace sparsa::cuda::detail
