// Internal test hooks of the cuda backend: which executor the last attention() call on this
// thread launched, so that tests can prove a shape reaches the executor they mean to exercise;
// and the split-KV merge's waiting bound, so that tests can force its fallback. Not public API;
// only built with the CUDA backend.
#pragma once

namespace sparsa::cuda::detail {

enum class Route {
  none,                // none (the call was refused before dispatch, or no call yet)
  flash_dense,         // the flash executor over every key tile
  flash_block_sparse,  // the flash executor over a BlockIndex
  flash_block_sparse_gathered,  // the same, K and V first gathered in the plan's key order
  split_kv,            // split_kv_kernel.cuh or split_kv_tma_kernel.cuh (dense, few queries, long KV)
};

// The executor the last attention() call on this thread was dispatched to.
Route last_dense_route();
// Whether the last flash launch on this thread was the TMA kernel (rung 3) rather than rung 2.
bool last_flash_used_tma();
// Allows (true, the default) or forbids the TMA kernel, process-wide; returns the previous setting.
bool set_flash_tma(bool on);
// The TMA kernel's consumer schedules (flash_tma_kernel.cuh): plain, pingpong (the two consumer
// warpgroups take turns at the tensor cores), overlap (the default: pingpong, and each
// warpgroup's softmax overlapping its own previous P V), late (pingpong's order of the products
// without the turns). Measured side by side in bench/RESULTS.md; variable-length calls run plain.
enum class FlashSchedule { plain, pingpong, overlap, late };
// The schedule of the last flash launch on this thread (plain when it was not the TMA kernel).
FlashSchedule last_flash_schedule();
// The TMA kernel's schedule from now on, process-wide; returns the previous one. Variable-length
// batches always take plain.
FlashSchedule set_flash_schedule(FlashSchedule schedule);
// The key tile of rung 3's dense calls at head_dim 128 without a mask or a variable-length batch:
// 128 (the default) or 176 (FlashAttention-3's choice for that shape; measured side by side in
// bench/RESULTS.md); any other value means 128. Process-wide; returns the previous one.
int set_flash_dense_key_tile(int tile);
// The key tile of the last flash launch on this thread.
int last_flash_key_tile();
// The number of KV splits of the last call on this thread if it took the split-KV executor, else 0.
int last_split_kv_splits();
// Whether the last split-KV launch on this thread was the wgmma + TMA kernel (rung 2,
// split_kv_tma_kernel.cuh) rather than rung 1 (split_kv_kernel.cuh).
bool last_split_kv_used_tma();
// Allows (true, the default) or forbids the split-KV TMA kernel, process-wide; returns the previous
// setting.
bool set_split_kv_tma(bool on);
// How long a split-KV CTA waits for the rest of its merge group before leaving its rows to the
// last CTA out (split_kv_kernel.cuh; default kMergeWaitNs). 0: every CTA that is not the last
// to arrive, and does not see the count complete at its first look, leaves its rows (the
// fallback path). Process-wide; for tests. Returns the previous bound.
unsigned long long set_split_kv_merge_wait_ns(unsigned long long ns);
// Waits for the device and reads back the split-KV merge counters of `device`: true when every
// arrive / depart / withdrawn count is zero, as each call must leave them (or no workspace yet).
bool split_kv_counters_zero(int device);

}  // namespace sparsa::cuda::detail
