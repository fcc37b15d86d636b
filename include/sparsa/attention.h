// sparsa/attention.h — the executors: dense, block-sparse, and the LSE merge.
//
// Every executor returns O (dtype of q, [batch, heads_q, len_q, head_dim]) and
// LSE (f32 [batch, heads_q, len_q]), the natural-log log-sum-exp of each query's
// scaled logits. A query that sees no key gets O = 0 and LSE = -inf.
//
// Grouped-query attention: heads_q % heads_kv == 0 and query head h reads kv head
// h / (heads_q / heads_kv). len_q and len_kv may differ.
//
// Masks (AttentionOptions::mask) act on original token positions (after any BlockIndex
// permutation is undone). When len_q != len_kv the query positions are aligned at the end, as
// FlashAttention does: query i stands at position i' = i + (len_kv - len_q) of the key sequence
// (the queries are the last len_q tokens of the keys, as in a KV-cached decode step). Query i
// sees key j iff
//   none                    every j
//   causal                  j <= i'
//   block_causal(b)         floor(j / b) <= floor(i' / b)   (bidirectional inside blocks of b
//                           tokens, causal across: block diffusion's prefill and training)
//   sliding_window(l, r)    i' - l <= j <= i' + r  (FlashAttention's window_size = (l, r);
//                           sliding_window(w) is the symmetric window (w, w), |i' - j| <= w,
//                           and sliding_window(w, 0) the causal one)
// Every mask shows a query a contiguous range of keys [mask_key_begin, mask_key_end). A query
// that sees no key (causal with len_q > len_kv, for the first len_q - len_kv rows) gets O = 0
// and LSE = -inf, as any empty row. Key blocks that no query of a tile sees are skipped, not
// computed.
//
// Variable-length batches (dense_varlen, block_sparse_varlen) follow FlashAttention's varlen
// API: q [total_q, heads_q, head_dim], k/v [total_kv, heads_kv, head_dim], and i32 offsets
// cu_seqlens_q / cu_seqlens_kv [num_seqs + 1] (0 = cu[0] <= cu[1] <= ... <= cu[num_seqs] =
// total): sequence s is q rows cu_seqlens_q[s] .. cu_seqlens_q[s+1] against k/v rows
// cu_seqlens_kv[s] .. cu_seqlens_kv[s+1]. O is [total_q, heads_q, head_dim] and LSE f32
// [heads_q, total_q] (FlashAttention's varlen LSE). Masks apply per sequence (positions local
// to the sequence, end-aligned per sequence). Sequences may be empty; a sequence with queries
// and no keys gives empty rows.
#pragma once

#include <optional>

#include "sparsa/index.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

enum class Backend : uint8_t {
  cpu_ref,  // the specification: plain loops, f64 accumulation
  cpu,      // the fast CPU path: threads, f32 accumulation, online softmax
  cuda,     // Hopper kernels (when compiled in)
};

const char* backend_name(Backend backend);
Result<Backend> parse_backend(const std::string& name);
bool backend_available(Backend backend);
// Why a backend cannot run here, or ok: cuda is either not compiled into this build
// (configure with -DSPARSA_CUDA=ON) or compiled in with no CUDA device visible. Every entry
// point that refuses a backend returns this status.
Status backend_status(Backend backend);

enum class MaskKind : uint8_t { none, causal, block_causal, sliding_window };

// A per-element mask of the executors (see the top of this file for the exact semantics).
struct Mask {
  MaskKind kind = MaskKind::none;
  int64_t block = 0;         // block_causal: tokens per block (> 0)
  int64_t window_left = 0;   // sliding_window: keys up to window_left before the query (>= 0)
  int64_t window_right = 0;  // sliding_window: keys up to window_right after the query (>= 0)

  static Mask none() { return {}; }
  static Mask causal() { return {MaskKind::causal, 0, 0, 0}; }
  static Mask block_causal(int64_t block) { return {MaskKind::block_causal, block, 0, 0}; }
  static Mask sliding_window(int64_t window) { return {MaskKind::sliding_window, 0, window, window}; }
  static Mask sliding_window(int64_t left, int64_t right) { return {MaskKind::sliding_window, 0, left, right}; }

  bool is_none() const { return kind == MaskKind::none; }
};

// "none", "causal", "block_causal(16)", "sliding_window(128)" / "sliding_window(128,0)".
std::string mask_string(const Mask& mask);
// Parses the forms mask_string writes, and also "block_causal:16", "sliding_window:128" and
// "sliding_window:128,0"; the error names the argument `what`.
Result<Mask> parse_mask(const std::string& text, const char* what = "mask");
// The mask's parameters are in range (block > 0, windows >= 0); the message names `what`.
Status validate_mask(const Mask& mask, const char* what = "mask");
// Whether query i (0 <= i < len_q) sees key j (0 <= j < len_kv) under the mask.
bool mask_visible(const Mask& mask, int64_t i, int64_t j, int64_t len_q, int64_t len_kv);
// The keys query i sees are [mask_key_begin, mask_key_end) (clipped to [0, len_kv]; begin >=
// end when it sees none). Both are non-decreasing in i.
int64_t mask_key_begin(const Mask& mask, int64_t i, int64_t len_q, int64_t len_kv);
int64_t mask_key_end(const Mask& mask, int64_t i, int64_t len_q, int64_t len_kv);

struct AttentionOptions {
  std::optional<float> scale;  // default 1/sqrt(head_dim)
  Backend backend = Backend::cpu;
  bool check_finite = false;   // refuse NaN/Inf in q, k, v with a clear error
  // cuda backend, block_sparse: check the BlockIndex's contents (counts, key blocks, permutations)
  // on the device before running, as the host backends always do: a few small kernels and one
  // read-back that synchronises the default stream. false trusts the plan (for plans sparsa's own
  // selectors just made; the kernels still never read or write out of bounds, but a malformed
  // plan then gives wrong numbers instead of an error).
  bool check_index = true;
  int num_threads = 0;         // cpu backend; 0 = hardware concurrency
  // cuda backend: the stream (a cudaStream_t) every kernel, allocation and read-back of the call is
  // ordered on; null is the legacy default stream. As with any CUDA library call, the caller orders
  // its own work on other streams against this one; outputs are ready for work queued on `stream`
  // after the call. (The plan check's read-back synchronises this stream, not the device.)
  void* stream = nullptr;
  // The per-element mask (none, causal, block_causal, sliding_window; the top of this file).
  // Host backends only for now: the cuda backend refuses a mask by name.
  Mask mask;
};

struct AttentionOutput {
  HostArray out;  // dtype of q, [batch, heads_q, len_q, head_dim]
  HostArray lse;  // f32 [batch, heads_q, len_q]
};

// Into caller-provided outputs (any strides with a contiguous last dimension).
Status dense(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
             const Tensor& lse, const AttentionOptions& options = {});
Status block_sparse(const Tensor& q, const Tensor& k, const Tensor& v, const BlockIndex& index,
                    const Tensor& out, const Tensor& lse, const AttentionOptions& options = {});

// Allocating forms (host outputs).
Result<AttentionOutput> dense(const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionOptions& options = {});
Result<AttentionOutput> block_sparse(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const BlockIndex& index, const AttentionOptions& options = {});

// Variable-length batches (see the top of this file): q [total_q, heads_q, d], k/v [total_kv,
// heads_kv, d], cu_seqlens_q / cu_seqlens_kv i32 [num_seqs + 1] on the host (cpu backends),
// out [total_q, heads_q, d], lse f32 [heads_q, total_q]. Block-sparse: the index's batch
// dimension is the sequence: counts [num_seqs, heads_q, ceil(max_len_q / block_q)], indices
// [num_seqs, heads_q, ceil(max_len_q / block_q), capacity] (max over sequences); sequence s uses
// its first ceil(len_q_s / block_q) query-block rows (later rows are ignored) and may list only
// its own ceil(len_kv_s / block_kv) key blocks; perm_q [num_seqs, heads_q, max_len_q] and perm_kv
// [num_seqs, heads_kv, max_len_kv] hold in their first len_s entries a permutation of 0..len_s-1.
Status dense_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                    const Tensor& cu_seqlens_kv, const Tensor& out, const Tensor& lse,
                    const AttentionOptions& options = {});
Status block_sparse_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_kv, const BlockIndex& index, const Tensor& out,
                           const Tensor& lse, const AttentionOptions& options = {});
Result<AttentionOutput> dense_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                                     const AttentionOptions& options = {});
Result<AttentionOutput> block_sparse_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                                            const BlockIndex& index, const AttentionOptions& options = {});
// The plan that lists, for every query block, exactly the key blocks in which the mask leaves
// at least one (query, key) pair of the block visible (BlockIndexBuffer::full with the fully
// masked blocks left out). With Mask::none() it is BlockIndexBuffer::full.
BlockIndexBuffer masked_full_plan(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv, int block_q,
                                  int block_kv, const Mask& mask);

// Merge two partial results over disjoint key sets (docs/architecture.md, Contracts):
//   m = max(L1, L2); w1 = exp(L1 - m); w2 = exp(L2 - m)
//   O = (w1*O1 + w2*O2) / (w1 + w2);  L = m + log(w1 + w2)
// A side with L = -inf contributes nothing; both -inf gives O = 0, L = -inf.
// out/lse may alias o1/lse1. Backend cuda: every tensor on one CUDA device, the kernel ordered on
// `stream` (a cudaStream_t; null is the legacy default stream).
Status merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2,
             const Tensor& out, const Tensor& lse, Backend backend = Backend::cpu, void* stream = nullptr);
Result<AttentionOutput> merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2,
                              const Tensor& lse2, Backend backend = Backend::cpu);

// FLOPs of attention with the given number of visited (query, key) pairs: 4 * pairs * head_dim.
inline double attention_flops(double pairs, int64_t head_dim) { return 4.0 * pairs * head_dim; }

}  // namespace sparsa
