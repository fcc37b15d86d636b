// Internal test and benchmark hooks of BA-Att's cuda selector (not public API; only built with the
// CUDA backend): which kernel computes the block logits.
#pragma once

namespace sparsa::ba_att_cuda {

// Allows (true, the default) or forbids the tensor-core logits kernel (block_logits_tf32_kernel,
// 3xTF32) process-wide; forbidden, F % 4 == 0 takes the SIMT 128x128 kernel. Returns the previous
// setting.
bool set_tensor_core_logits(bool on);
// Whether the last selector call on this thread computed its logits on the tensor cores.
bool last_logits_used_tensor_cores();

}  // namespace sparsa::ba_att_cuda
