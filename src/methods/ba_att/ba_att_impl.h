// Internal: the validated inputs of BA-Att's scoring (steps 2-3 of Algorithm 1) and
// the backends that compute them. On the CPU, permutations (step 1) are computed by the
// entry point with the shared norm_sort, so both CPU backends score the same blocks; the
// cuda backend runs all four steps on the device (src/cuda/select/).
#pragma once

#include <cstdint>

#include "sparsa/ba_att.h"

namespace sparsa::detail {

struct BaAttParams {
  Tensor q;  // [batch, heads_q, len_q, head_dim], validated
  Tensor k;  // [batch, heads_kv, len_kv, head_dim]
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_kv = 0, head_dim = 0;
  int block_q = 0, block_kv = 0;
  int64_t num_q_blocks = 0, num_kv_blocks = 0;
  float scale = 1.0f;
  bool compensate = true;
  Compensation compensation = Compensation::diagonal;
  float beta = 1.0f;
  int num_threads = 0;
  const int32_t* perm_q = nullptr;   // [batch, heads_q, len_q] or null (identity)
  const int32_t* perm_kv = nullptr;  // [batch, heads_kv, len_kv] or null
  float* logits = nullptr;           // out: [batch, heads_q, num_q_blocks, num_kv_blocks]

  int64_t group() const { return heads_q / heads_kv; }
  // Original token at permuted position p.
  int64_t token_q(int64_t b, int64_t h, int64_t p) const {
    return perm_q ? perm_q[(b * heads_q + h) * len_q + p] : p;
  }
  int64_t token_kv(int64_t b, int64_t h_kv, int64_t p) const {
    return perm_kv ? perm_kv[(b * heads_kv + h_kv) * len_kv + p] : p;
  }
  float* logits_row(int64_t b, int64_t h, int64_t qb) const {
    return logits + ((b * heads_q + h) * num_q_blocks + qb) * num_kv_blocks;
  }
};

}  // namespace sparsa::detail

namespace sparsa::ba_att_cpu_ref {
Status scores(const detail::BaAttParams& params);
}
namespace sparsa::ba_att_cpu {
Status scores(const detail::BaAttParams& params);
}

namespace sparsa::ba_att_cuda {
// The validated request of the cuda selector: params (q, k on one cuda device; its perm and
// logits pointers are unused), the sort switches and the budget.
struct Request {
  detail::BaAttParams params;
  bool sort_q = true, sort_k = true;
  int64_t sort_window = 0;
  Budget budget;
  // BaAttOptions::mask_aware: the selection sees `mask` (hidden blocks out, diagonal ones forced,
  // the budget over the visible ones); needs the sorts off.
  Mask mask;
  bool mask_aware = false;
  void* stream = nullptr;  // cudaStream_t (null: the legacy default stream)
};
// Steps 1-4 on the device: a plan whose arrays live in device memory (BlockIndexBuffer::device_*).
Status plan(const Request& request, BlockIndexBuffer* plan);
// Steps 1-3 on the device; logits and permutations copied back to the host.
Status scores(const Request& request, BaAttScores* scores);
// Step 1's per-token L2 norms as the device computes them (f32), copied to the host:
// f32 [batch, heads, len]. For tests (the sort is checked against norm_sort of these).
Status token_norms(const Tensor& x, HostArray* norms);
}  // namespace sparsa::ba_att_cuda
