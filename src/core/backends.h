// Internal: what each backend implements. The public entry points in src/core/
// validate, fill the params struct and call exactly one of these.
#pragma once

#include <cstdint>
#include <vector>

#include "core/attention_params.h"
#include "sparsa/status.h"

namespace sparsa::detail {

struct MergeParams {
  Tensor o1, lse1, o2, lse2, out, lse;  // validated: same shapes, f32 lse
};

}  // namespace sparsa::detail

namespace sparsa::cpu_ref {
// params.index == nullptr: dense over all keys; else the block-sparse plan. A query row
// whose log-sum-exp exceeds the f32 range (the scaled logits overflow; no finite LSE
// exists) is reported as non_finite, naming the row.
Status attention(const detail::AttentionParams& params);
// One query row (batch b, query head h, original position i_q) over the given original
// key positions, in f64: writes its O row and LSE. Returns false when the LSE does not
// fit f32 (it is then stored as +inf). The cpu backend hands it the rows whose f32
// arithmetic overflowed, so both backends give the same answer.
bool attend_row(const detail::AttentionParams& params, int64_t b, int64_t h, int64_t i_q,
                const std::vector<int64_t>& keys);
// The error for such a row.
Status lse_overflow(const detail::AttentionParams& params, int64_t b, int64_t h, int64_t i_q);
Status merge(const detail::MergeParams& params);
}  // namespace sparsa::cpu_ref

namespace sparsa::cpu {
Status attention(const detail::AttentionParams& params);
Status merge(const detail::MergeParams& params);
}  // namespace sparsa::cpu

namespace sparsa::cuda {
bool compiled_in();
// params.index == nullptr: dense; else the block-sparse plan. Every pointer (q, k, v, out, lse
// and the index tensors) is device memory of params.device_id; runs on params.stream.
Status attention(const detail::AttentionParams& params);
// The LSE merge; every tensor on the device of params.o1, ordered on `stream`.
Status merge(const detail::MergeParams& params, void* stream);
// Device memory behind DeviceArray, ordered on `stream` (a cudaStream_t; null: the legacy
// default stream): at least one byte is allocated (so an empty array still has a distinct
// pointer), zero-filled on request; the copy waits for the work queued on `stream`.
Status malloc_device(int device, size_t bytes, bool zero_fill, void* stream, void** ptr);
void free_device(int device, void* ptr, void* stream);
Status copy_to_host(int device, const void* src, size_t bytes, void* dst, void* stream);
// Host memory src into device memory dst, ordered on `stream`; returns once the copy is done (src
// may be freed then).
Status copy_to_device(int device, const void* src, size_t bytes, void* dst, void* stream);
// Number of visible CUDA devices (0 when none or not compiled in), and a description.
int device_count();
std::string device_description(int device);
}  // namespace sparsa::cuda
