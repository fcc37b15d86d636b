// sparsa/llsa.h — Log-linear Sparse Attention (LLSA), forward and backward.
//
// Zhou et al., "Trainable Log-linear Sparse Attention for Efficient Diffusion
// Transformers" (CVPR 2026, arXiv:2512.16615); semantics follow the authors' code
// where it differs from the paper (docs/llsa.md).
//
// Self-attention over N tokens, inputs [batch, heads, N, head_dim] (len_q == len_kv),
// bidirectional. Grouped-query attention: heads_q % heads_kv == 0, query head h reads
// kv head h / (heads_q / heads_kv); selection is per query head.
//
// Levels 0..L: level 0 is the tokens; level l (n_l = ceil(n_{l-1} / B) tokens) is the
// mean of the (up to B) level-(l-1) tokens below it (f32). Token t of level l covers
// count_l(t) = min(B^l, N - t*B^l) original tokens.
//
// Selection, coarse to fine (not differentiated; unscaled dot products of pooled q
// and pooled k, ties to the smaller index):
//   level L: each level-L query token keeps the top-K of all n_L level-L keys;
//   level l < L: query token i scores the children of its parent's picks (up to K*B
//   candidates) and keeps its own top-K (K = min(topk, candidates)).
// Level-1 query token qb is fine query block qb; its level-1 picks are key blocks.
//
// Executor: a fine query in block qb (ancestor a_l = qb / B^(l-1) at level l) runs ONE
// softmax over
//   level 0 : the tokens of the key blocks picks_1(a_1)                  (weight 1)
//   level l : the candidates of a_l = children of picks_{l+1}(a_{l+1}),   1 <= l < L
//   level L : every level-L token
// with the logit of a level-l token t raised by log(count_l(t)) — as if the coarse
// token were repeated count_l(t) times. enrich = false keeps level 0 only.
// dedupe = true (beyond the paper) leaves out at level l the tokens picks_l(a_l), whose
// regions are already present at a finer level: the visited regions then partition the
// sequence and nothing is counted twice.
//
// Backward: dQ, dK, dV given dO, O, LSE; gradients reach K and V through the fine and
// the pooled keys/values (pooling's backward spreads grad / children to each child);
// pooled q only selects and gets no gradient. Memory is O(N * keys per query): no
// N x N buffer, no per-query copy of K.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/index.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

struct LlsaOptions {
  int block = 16;                // B: tokens pooled per coarse token, fine block size
  int topk = 8;                  // K: picks per query token at every level (clipped to
                                 // the number of level-1 tokens)
  int levels = -1;               // L >= 1; -1: automatic (llsa_auto_levels)
  bool enrich = true;            // KV enrichment with the coarse levels
  bool dedupe = false;           // leave out coarse tokens already attended finer
  std::optional<float> scale;    // default 1/sqrt(head_dim)
  Backend backend = Backend::cpu;
  int num_threads = 0;           // cpu backend; 0 = hardware concurrency
  bool check_finite = false;     // refuse NaN/Inf in the inputs (host backends)
  // cuda backend: the stream (a cudaStream_t) every kernel, allocation and copy of the call is
  // ordered on; null is the legacy default stream. Outputs are ready for work queued on it after
  // the call. The cuda backend takes bf16/f16, head_dim 64 or 128, topk <= 64.
  void* stream = nullptr;
};

// The paper's L = floor(log_B N) - 1, at least 1: the largest L with B^(L+1) <= N.
int llsa_auto_levels(int64_t n, int block);

// Keys per query from the plan's shape, for a sequence of n tokens (full blocks, enough
// candidates): K*B fine + (L-1)*K*B intermediate candidates + n_L coarsest (enrich), minus
// L*K with dedupe. Counted, not run.
int64_t llsa_keys_per_query(int64_t n, const LlsaOptions& options);

// The selection plan. picks[l-1] (l = 1..levels) is i32 [batch, heads_q, level_len[l],
// topk]: the level-l key tokens that level-l query token i keeps, ascending, padded with
// -1 after pick_counts; level-1 picks are fine key blocks.
struct LlsaPlan {
  int block = 0;
  int topk = 0;
  int levels = 0;
  bool enrich = true;
  bool dedupe = false;
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len = 0;
  std::vector<int64_t> level_len;   // [levels + 1]; level_len[0] = len
  std::vector<HostArray> picks;     // [levels] of i32 [batch, heads_q, level_len[l], topk]
  std::vector<HostArray> pick_counts;  // [levels] of i32 [batch, heads_q, level_len[l]]

  int32_t pick(int level, int64_t b, int64_t h, int64_t i, int slot) const;
  int32_t pick_count(int level, int64_t b, int64_t h, int64_t i) const;
  // Original tokens covered by token t of level l: min(B^l, len - t*B^l).
  int64_t token_count(int level, int64_t t) const;
  // Keys the queries of fine block qb attend to (all levels together), and the mean
  // over query tokens of (batch 0, head 0).
  int64_t keys_for_block(int64_t b, int64_t h, int64_t qb) const;
  double mean_keys_per_query() const;
  // Per level, per query token, the key tokens it keeps; max_rows limits the rows
  // printed per level (0 = all).
  std::string to_string(int64_t b, int64_t h, int64_t max_rows = 0) const;
  // The fine part as a BlockIndex (block_q = block_kv = block): what LLSA visits with
  // enrich = false.
  BlockIndexBuffer fine_index() const;
};

// The selection. Backend cuda: built on q's device and copied back into the host arrays (this
// synchronises options.stream).
Result<LlsaPlan> llsa_plan(const Tensor& q, const Tensor& k, const LlsaOptions& options = {});

// Forward: O (dtype of q) and LSE (f32), into caller outputs or allocated (host outputs; the
// cuda backend writes caller outputs on the device). With a plan the executor follows it (its
// block, topk, levels, enrich and dedupe); without, the plan is built from q and k first — on
// the cuda backend on the device, with no host round trip.
Status llsa_forward(const Tensor& q, const Tensor& k, const Tensor& v, const LlsaPlan& plan,
                    const Tensor& out, const Tensor& lse, const LlsaOptions& options = {});
Status llsa_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const LlsaOptions& options = {});
Result<AttentionOutput> llsa_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const LlsaOptions& options = {});

// Backward: dq, dk, dv (shapes of q, k, v; any float dtype, contiguous last dim)
// given the forward's out, lse and the output gradient d_o. The plan must be the one
// the forward used (the allocating form rebuilds it from q and k, which is the same).
Status llsa_backward(const Tensor& q, const Tensor& k, const Tensor& v, const LlsaPlan& plan,
                     const Tensor& out, const Tensor& lse, const Tensor& d_o, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, const LlsaOptions& options = {});
Status llsa_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, const Tensor& d_o, const Tensor& dq, const Tensor& dk,
                     const Tensor& dv, const LlsaOptions& options = {});

}  // namespace sparsa
