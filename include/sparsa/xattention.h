// sparsa/xattention.h — the XAttention selector (Xu et al., ICML 2025), the baseline of
// BA-Att's tables. docs/ba_att.md describes it beside BA-Att.
//
// Per (batch, head), with stride S dividing block_q and block_kv:
//   - query group g = tokens [gS, gS+S), key group c = tokens [cS, cS+S);
//   - antidiagonal score a[g, c] = scale/S * sum_{s=0}^{S-1} Q[gS+S-1-s] . K[cS+s]
//     (terms whose token lies past the end of the sequence are left out);
//   - softmax of a[g, :] over all key groups;
//   - block mass X[qb, kb] = sum of the probabilities of the groups of qb (rows) and kb (columns);
//   - per query block, forced blocks (key block 0 and the diagonal key block
//     qb + num_kv_blocks - num_q_blocks, as XAttention aligns them) and then blocks in
//     descending X until the budget is met (default: cumulative mass tau = 0.9 of the row);
//   - mask_aware (below): the softmax and the choice see the mask.
// No norm sort: the plan carries no permutations. GQA: query head h scores kv head h / group.
#pragma once

#include <optional>

#include "sparsa/ba_att.h"

namespace sparsa {

struct XAttentionOptions {
  int block_q = 128;
  int block_kv = 128;
  int stride = 8;
  Budget budget = Budget::mass(0.9);
  bool force_first = true;
  bool force_diagonal = true;
  std::optional<float> scale;  // default 1/sqrt(head_dim)
  Backend backend = Backend::cpu;  // cpu_ref and cpu share one implementation (threads over heads)
  int num_threads = 0;
  bool check_finite = false;
  // The executor's per-element mask (sparsa/attention.h). With mask_aware the selection sees it
  // too: each query group's softmax runs over the key groups it can see (a key group with a
  // visible pair), key blocks hidden from the whole query block are never chosen, the block of
  // each query's last visible key is kept (as BA-Att's mask_aware, sparsa/ba_att.h), and the
  // budget counts the visible blocks. XAttention was made for causal prefill; this is its mask.
  Mask mask;
  bool mask_aware = false;
};

// Block masses X: f32 [batch, heads_q, num_q_blocks, num_kv_blocks]; each row sums to the
// number of query groups in the block.
Result<HostArray> xattention_scores(const Tensor& q, const Tensor& k, const XAttentionOptions& options = {});
Result<BlockIndexBuffer> xattention_plan(const Tensor& q, const Tensor& k, const XAttentionOptions& options = {});
Result<AttentionOutput> xattention(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const XAttentionOptions& options = {});

}  // namespace sparsa
