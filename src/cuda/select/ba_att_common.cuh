// Internal: what every kernel of BA-Att's cuda selector shares (ba_att_kernels.cuh lists them):
// the device-side error word, element conversion and the input view.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma.cuh"
#include "cuda/select/ba_att_keys.h"

namespace sparsa::cuda::ba_att {

// The first (lowest flat index) offending item per kind; ~0 (memset 0xff) when none.
struct ErrorWord {
  unsigned long long first[3];
};
enum ErrorSlot { kErrQNorm = 0, kErrKNorm = 1, kErrLogit = 2 };

template <class T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// A [batch, heads, len, d] input; strides in elements for (batch, head, seq), d contiguous.
template <class T>
struct Input {
  const T* data;
  int64_t stride_b, stride_h, stride_s;
  int heads, len, d;
  // Row `token` of (batch, head) bh = batch * heads + head.
  __device__ __forceinline__ const T* row(int64_t bh, int64_t token) const {
    return data + (bh / heads) * stride_b + (bh % heads) * stride_h + token * stride_s;
  }
};

// 16-byte loads of a row: kVector<T> elements each. The launcher takes the vector path when d is a
// multiple of it and every row starts 16-byte aligned (vector_rows() in ba_att.cu).
template <class T> constexpr int kVector = 16 / static_cast<int>(sizeof(T));

}  // namespace sparsa::cuda::ba_att
