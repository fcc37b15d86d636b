// The LSE merge of two partial attention results over disjoint key sets, on the device (the
// contract of sparsa/attention.h, the cpu_ref merge its specification): one warp per query row,
// f32 arithmetic, O in the dtype of the inputs (bf16, f16 or f32), any strides with a contiguous
// last dimension. out / lse may alias o1 / lse1: every lane reads its elements of the row
// before it writes them, and the LSE is written after the row's weights are read.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "core/backends.h"
#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"

namespace sparsa::cuda {

namespace {

struct MergeArgs {
  const void *o1, *o2;
  const float *lse1, *lse2;
  void* out;
  float* lse;
  int64_t o1_stride[3], o2_stride[3], out_stride[3];  // batch, head, row (elements)
  int64_t lse1_stride[3], lse2_stride[3], lse_stride[3];
  int64_t heads, len, head_dim, rows;
};

template <class T>
__device__ inline float load(const void* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  } else {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
}

template <class T>
__device__ inline void store(void* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
  } else {
    static_cast<__half*>(p)[i] = __float2half(v);
  }
}

__device__ inline int64_t at(const int64_t* s, int64_t b, int64_t h, int64_t i) { return b * s[0] + h * s[1] + i * s[2]; }

template <class T>
__global__ void merge_kernel(MergeArgs a) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.rows) return;
  const int64_t i = row % a.len, h = (row / a.len) % a.heads, b = row / (a.len * a.heads);
  const float l1 = a.lse1[at(a.lse1_stride, b, h, i)], l2 = a.lse2[at(a.lse2_stride, b, h, i)];
  const float m = fmaxf(l1, l2);
  const bool none = m == -INFINITY;
  // A side of weight 0 (L = -inf) contributes nothing, even if its O is not finite.
  const float w1 = none ? 0.0f : expf(l1 - m), w2 = none ? 0.0f : expf(l2 - m);
  const float inv = none ? 0.0f : 1.0f / (w1 + w2);
  const int64_t p1 = at(a.o1_stride, b, h, i), p2 = at(a.o2_stride, b, h, i), po = at(a.out_stride, b, h, i);
  for (int64_t t = lane; t < a.head_dim; t += 32) {
    const float x1 = w1 > 0.0f ? w1 * load<T>(a.o1, p1 + t) : 0.0f;
    const float x2 = w2 > 0.0f ? w2 * load<T>(a.o2, p2 + t) : 0.0f;
    store<T>(a.out, po + t, none ? 0.0f : (x1 + x2) * inv);
  }
  __syncwarp();
  if (lane == 0) a.lse[at(a.lse_stride, b, h, i)] = none ? -INFINITY : m + logf(w1 + w2);
}

// The same merge with each thread on 16 bytes of a row (8 bf16/f16 or 4 f32 values) where every
// row of o1, o2 and out starts on a 16-byte boundary and spans whole 16-byte chunks: a group of G
// lanes (the power of two at or above the row's chunks, at most 32; G > 32 chunks loop) takes one
// row, so a warp merges 32 / G rows with vector loads. The per-element warp above moved 2-byte
// values and took a warp per row (at head_dim 64, a quarter of its lanes' loads idle in width).
// The row's lanes all read lse1 / lse2 before the group's first lane writes the merged LSE (the
// __syncwarp), so lse may alias lse1; each lane writes only the chunks it read, so out may
// alias o1.
template <class T>
__global__ void merge_vec_kernel(MergeArgs a, int chunks, int group) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32, in_group = lane % group;
  const int64_t row = thread / group;
  const bool live = row < a.rows;
  const int64_t r = live ? row : 0;
  const int64_t i = r % a.len, h = (r / a.len) % a.heads, b = r / (a.len * a.heads);
  const float l1 = live ? a.lse1[at(a.lse1_stride, b, h, i)] : -INFINITY;
  const float l2 = live ? a.lse2[at(a.lse2_stride, b, h, i)] : -INFINITY;
  const float m = fmaxf(l1, l2);
  const bool none = m == -INFINITY;
  const float w1 = none ? 0.0f : expf(l1 - m), w2 = none ? 0.0f : expf(l2 - m);
  const float inv = none ? 0.0f : 1.0f / (w1 + w2);
  const T* o1 = static_cast<const T*>(a.o1) + at(a.o1_stride, b, h, i);
  const T* o2 = static_cast<const T*>(a.o2) + at(a.o2_stride, b, h, i);
  T* out = static_cast<T*>(a.out) + at(a.out_stride, b, h, i);
  for (int c = in_group; live && c < chunks; c += group) {
    uint4 x1 = make_uint4(0, 0, 0, 0), x2 = make_uint4(0, 0, 0, 0), y;
    if (w1 > 0.0f) x1 = reinterpret_cast<const uint4*>(o1)[c];
    if (w2 > 0.0f) x2 = reinterpret_cast<const uint4*>(o2)[c];
    const T* v1 = reinterpret_cast<const T*>(&x1);
    const T* v2 = reinterpret_cast<const T*>(&x2);
    T* vy = reinterpret_cast<T*>(&y);
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const float p1 = w1 > 0.0f ? w1 * load<T>(v1, e) : 0.0f;
      const float p2 = w2 > 0.0f ? w2 * load<T>(v2, e) : 0.0f;
      store<T>(vy, e, none ? 0.0f : (p1 + p2) * inv);
    }
    reinterpret_cast<uint4*>(out)[c] = y;
  }
  __syncwarp();
  if (live && in_group == 0) a.lse[at(a.lse_stride, b, h, i)] = none ? -INFINITY : m + logf(w1 + w2);
}

// Whether every row of t starts on a 16-byte boundary and spans whole 16-byte chunks.
bool rows_in_chunks(const Tensor& t) {
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0 || (t.shape[3] * es) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.shape[d] > 1 && (t.strides[d] * es) % 16 != 0) return false;
  }
  return true;
}

void strides3(const Tensor& t, int64_t* s) {
  for (int d = 0; d < 3; ++d) s[d] = t.strides[d];
}

}  // namespace

Status merge(const sparsa::detail::MergeParams& p, void* stream) {
  const Tensor& o1 = p.o1;
  const int device = o1.device.id;
  SPARSA_RETURN_IF_ERROR(detail::check_device_id("o1", device));
  detail::DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  const std::pair<const char*, const void*> ptrs[] = {{"o1", o1.data},     {"lse1", p.lse1.data}, {"o2", p.o2.data},
                                                      {"lse2", p.lse2.data}, {"out", p.out.data}, {"lse", p.lse.data}};
  for (auto [name, ptr] : ptrs) SPARSA_RETURN_IF_ERROR(detail::check_pointer(name, ptr, device, stream));
  MergeArgs a{};
  a.o1 = o1.data;
  a.o2 = p.o2.data;
  a.lse1 = static_cast<const float*>(p.lse1.data);
  a.lse2 = static_cast<const float*>(p.lse2.data);
  a.out = p.out.data;
  a.lse = static_cast<float*>(p.lse.data);
  strides3(o1, a.o1_stride);
  strides3(p.o2, a.o2_stride);
  strides3(p.out, a.out_stride);
  strides3(p.lse1, a.lse1_stride);
  strides3(p.lse2, a.lse2_stride);
  strides3(p.lse, a.lse_stride);
  a.heads = o1.shape[1];
  a.len = o1.shape[2];
  a.head_dim = o1.shape[3];
  a.rows = o1.shape[0] * a.heads * a.len;
  if (a.rows == 0) return {};
  constexpr int kThreads = 256;
  const auto s = static_cast<cudaStream_t>(stream);
  if (rows_in_chunks(o1) && rows_in_chunks(p.o2) && rows_in_chunks(p.out)) {
    const int chunks = static_cast<int>(a.head_dim * static_cast<int64_t>(dtype_size(o1.dtype)) / 16);
    int group = 1;
    while (group < chunks && group < 32) group *= 2;
    const auto vblocks = static_cast<unsigned>((a.rows * group + kThreads - 1) / kThreads);
    switch (o1.dtype) {
      case DType::bf16: merge_vec_kernel<__nv_bfloat16><<<vblocks, kThreads, 0, s>>>(a, chunks, group); break;
      case DType::f16: merge_vec_kernel<__half><<<vblocks, kThreads, 0, s>>>(a, chunks, group); break;
      case DType::f32: merge_vec_kernel<float><<<vblocks, kThreads, 0, s>>>(a, chunks, group); break;
      default: return unsupported_dtype(std::string("o1: merge takes bf16, f16 or f32, got ") + dtype_name(o1.dtype));
    }
    SPARSA_CUDA_CHECK_LAUNCH();
    return {};
  }
  const auto blocks = static_cast<unsigned>((a.rows * 32 + kThreads - 1) / kThreads);
  switch (o1.dtype) {
    case DType::bf16: merge_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(a); break;
    case DType::f16: merge_kernel<__half><<<blocks, kThreads, 0, s>>>(a); break;
    case DType::f32: merge_kernel<float><<<blocks, kThreads, 0, s>>>(a); break;
    default: return unsupported_dtype(std::string("o1: merge takes bf16, f16 or f32, got ") + dtype_name(o1.dtype));
  }
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

}  // namespace sparsa::cuda
