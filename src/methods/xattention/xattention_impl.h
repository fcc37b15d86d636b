// Internal: the validated request of XAttention's cuda selector (src/cuda/select/xattention.cu);
// the entry points in xattention.cpp fill it and call exactly one of these.
#pragma once

#include <cstdint>

#include "sparsa/xattention.h"

namespace sparsa::xattention_cuda {

struct Request {
  Tensor q, k;  // [batch, heads, len, head_dim] on one cuda device, validated
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_kv = 0, head_dim = 0;
  int block_q = 0, block_kv = 0, stride = 1;
  int64_t num_q_blocks = 0, num_kv_blocks = 0;
  float scale = 1.0f;
  Budget budget;
  bool force_first = true, force_diagonal = true;
  Mask mask;  // seen by the selection only with mask_aware
  bool mask_aware = false;
  void* stream = nullptr;  // cudaStream_t (null: the legacy default stream)
};

// The block masses on the device, copied back: f32 [batch, heads_q, num_q_blocks, num_kv_blocks].
Status scores(const Request& request, HostArray* x);
// Masses and the budget on the device: a plan whose arrays live in device memory.
Status plan(const Request& request, BlockIndexBuffer* plan);

}  // namespace sparsa::xattention_cuda
