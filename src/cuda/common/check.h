// Internal: CUDA error checks that turn into Status. Every runtime call
// goes through SPARSA_CUDA_CHECK, and every launch is followed by
// SPARSA_CUDA_CHECK_LAUNCH(), so a failure names its file and line.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sparsa/status.h"

namespace sparsa::cuda::detail {

// A failed call's error is also taken out of the runtime's last-error slot, so that it cannot
// surface later in an unrelated check (CUB's launches read that slot; a leftover error from a
// failed call once failed the next call's sort). Sticky errors (a faulted context) stay.
inline Status cuda_status(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return {};
  cudaGetLastError();
  const StatusCode code = err == cudaErrorMemoryAllocation ? StatusCode::out_of_memory : StatusCode::internal;
  return {code, std::string("cuda: ") + what + " failed at " + file + ":" + std::to_string(line) + ": " +
                    cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

}  // namespace sparsa::cuda::detail

#define SPARSA_CUDA_CHECK(expr) \
  SPARSA_RETURN_IF_ERROR(::sparsa::cuda::detail::cuda_status((expr), #expr, __FILE__, __LINE__))

// After a kernel launch: the launch error (bad configuration, too much shared memory).
#define SPARSA_CUDA_CHECK_LAUNCH() \
  SPARSA_RETURN_IF_ERROR(::sparsa::cuda::detail::cuda_status(cudaGetLastError(), "kernel launch", __FILE__, __LINE__))

namespace sparsa::cuda::detail {

// Whether work queued on `stream` (a cudaStream_t; null: the legacy default stream, never captured
// on its own) is being captured into a CUDA graph.
inline bool capturing(void* stream) {
  if (stream == nullptr) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusActive;
}

// `name`'s memory must be device (or managed) memory of `device`; the error names the argument.
// While `stream` is being captured, memory CUDA does not know yet is accepted: what the capture
// itself allocates from a stream-ordered pool (a plan made inside the capture) has no attributes
// until the graph is instantiated. A host pointer passed during a capture then faults at replay
// instead of being refused here.
inline Status check_pointer(const char* name, const void* ptr, int device, void* stream = nullptr) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (capturing(stream)) return {};
    return invalid_argument(std::string(name) + ": expected memory of cuda:" + std::to_string(device) +
                            ", the pointer is unknown to CUDA (" + cudaGetErrorName(err) + ")");
  }
  if (attr.type == cudaMemoryTypeUnregistered && capturing(stream)) return {};
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) || attr.device != device) {
    const std::string got = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged
                                ? "cuda:" + std::to_string(attr.device)
                                : std::string("host memory");
    return invalid_argument(std::string(name) + ": expected memory of cuda:" + std::to_string(device) + ", got " +
                            got);
  }
  return {};
}

// Sets `device` current for the lifetime of the guard (enter), restoring the previous one.
struct DeviceGuard {
  int previous = -1;
  Status enter(int device) {
    SPARSA_CUDA_CHECK(cudaGetDevice(&previous));
    if (previous != device) SPARSA_CUDA_CHECK(cudaSetDevice(device));
    return {};
  }
  ~DeviceGuard() {
    if (previous >= 0) cudaSetDevice(previous);
  }
};

}  // namespace sparsa::cuda::detail
