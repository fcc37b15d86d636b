// Internal test and benchmark hooks of BA-Att's cuda selector (not public API; only built with the
// CUDA backend): which kernel computes the block logits, and whether the key side runs beside the
// query side.
#pragma once

namespace sparsa::ba_att_cuda {

// Allows (true, the default) or forbids the tensor-core logits kernels (3xTF32: wgmma or mma.sync,
// set_wgmma_logits) process-wide; forbidden, F % 4 == 0 takes the SIMT 128x128 kernel. Returns the
// previous setting.
bool set_tensor_core_logits(bool on);
// Whether the last selector call on this thread computed its logits on the tensor cores.
bool last_logits_used_tensor_cores();
// Among the tensor-core kernels: allows (true, the default) the wgmma one
// (block_logits_wgmma_kernel) or forbids it, which takes the mma.sync one
// (block_logits_tf32_kernel); both are 3xTF32. Process-wide; returns the previous setting.
bool set_wgmma_logits(bool on);
// Whether the last selector call on this thread computed its logits with wgmma.
bool last_logits_used_wgmma();
// Allows (true, the default) or forbids running the key side's steps 1-3 on a second stream beside
// the query side's; returns the previous setting.
bool set_concurrent_sides(bool on);
// Whether the last selector call on this thread ran the two sides concurrently.
bool last_selection_concurrent();

}  // namespace sparsa::ba_att_cuda
