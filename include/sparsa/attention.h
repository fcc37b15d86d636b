// sparsa/attention.h — the executors: dense, block-sparse, and the LSE merge.
//
// Every executor returns O (dtype of q, [batch, heads_q, len_q, head_dim]) and
// LSE (f32 [batch, heads_q, len_q]), the natural-log log-sum-exp of each query's
// scaled logits. A query that sees no key gets O = 0 and LSE = -inf.
//
// Grouped-query attention: heads_q % heads_kv == 0 and query head h reads kv head
// h / (heads_q / heads_kv). len_q and len_kv may differ.
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
