// Internal: CUDA error checks that turn into Status (STYLE.md 9). Every runtime call
// goes through SPARSA_CUDA_CHECK, and every launch is followed by
// SPARSA_CUDA_CHECK_LAUNCH(), so a failure names its file and line.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sparsa/status.h"

namespace sparsa::cuda::detail {

inline Status cuda_status(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return {};
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
