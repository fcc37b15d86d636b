// Internal: which executor the cuda backend's last attention() call on this thread launched, so
// that tests can prove a shape reaches the executor they mean to exercise. Not public API; only
// built with the CUDA backend.
#pragma once

namespace sparsa::cuda::detail {

enum class Route {
  none,                // no launch (the call failed before one, or no call yet)
  flash_dense,         // flash_kernel.cuh over every key tile
  flash_block_sparse,  // flash_kernel.cuh over a BlockIndex
  split_kv,            // split_kv_kernel.cuh (dense, few queries, long KV)
};

Route last_dense_route();
// The number of KV splits of the last call on this thread if it took the split-KV executor, else 0.
int last_split_kv_splits();

}  // namespace sparsa::cuda::detail
