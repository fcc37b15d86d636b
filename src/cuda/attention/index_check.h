// Internal: the cuda backend's check of a device BlockIndex's contents (counts, key blocks,
// permutations), the device counterpart of validate_block_index (src/core/index.cpp): the same
// rules, the same first error, the same message.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sparsa/index.h"
#include "sparsa/status.h"

namespace sparsa::cuda::detail {

// `index`'s arrays live on `device` (the caller has checked shapes, dtypes, pointers and made
// `device` current). Runs on `stream` and synchronises it once (the read-back of the verdict).
Status check_index_on_device(const BlockIndex& index, int64_t batch, int64_t heads_q, int64_t heads_kv,
                             int64_t len_q, int64_t len_kv, int device, cudaStream_t stream);

}  // namespace sparsa::cuda::detail
