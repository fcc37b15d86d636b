// sparsa/losa.h — LoSA, Locality-aware Sparse Attention for block-diffusion decoding
// (docs/losa.md), and its baselines in the same API.
//
// A block of Bb tokens is denoised in several steps against a frozen prefix cache.
// Per layer, PrefixAttention keeps for the current block
//   O_p   f32 [heads_q, Bb, d]   prefix-attention output of every block token
//   L_p   f32 [heads_q, Bb]      its log-sum-exp
//   Q_ref f32 [heads_q, Bb, d]   the query each row was last computed with
// Method losa:
//   first step of a block: dense prefix attention for all rows; O_p, L_p, Q_ref = Q.
//   later steps: mse_i = mean over heads and dims of (Q_i - Q_ref_i)^2; the top-K
//     tokens (or those above a threshold) are active; the selector routes the active
//     rows to prefix pages; each kv head loads the union of its active heads' pages
//     once; active rows recompute O_p, L_p and set Q_ref = Q; stable rows keep theirs.
//   every step: intra-block attention of all rows over the block's own keys (O_b, L_b),
//     merged with (O_p, L_p) by log-sum-exp.
//   commit: the finished block's K/V are appended to the prefix cache (page min/max
//     updated) and the next step starts a new block.
// Baselines (method): dense (dense prefix for all rows every step), quest (the selector
// for every row every step: the "KV inflation" case), reuse (LoSA's active/stable split,
// active rows dense; an ablation that isolates the selector's error).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/kv_cache.h"
#include "sparsa/quest.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

enum class PrefixMethod : uint8_t { dense, quest, losa, reuse };
const char* prefix_method_name(PrefixMethod method);
Result<PrefixMethod> parse_prefix_method(const std::string& name);  // dense|quest|losa|reuse

struct LosaOptions {
  PrefixMethod method = PrefixMethod::losa;
  PageSelectOptions select;            // selector, budget (tokens per query), forced pages
  int active_k = 4;                    // active tokens per step, 0..Bb (top-K by query MSE)
  std::optional<double> mse_threshold; // if set: active = {i : mse_i > threshold}, top-K ignored
  bool attend_union = false;           // active rows attend over the whole loaded union
  AttentionOptions attention;          // backend (cpu_ref | cpu), scale, threads
};

struct LosaConfig {
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t block_size = 16;  // Bb, 1..1024
};

// What one step did and cost.
struct StepStats {
  int64_t block = 0;               // blocks committed before this step
  int64_t step = 0;                // step within the block (0 = first)
  bool dense_prefix = false;       // prefix attention was dense for the recomputed rows
  std::vector<int64_t> recomputed; // rows whose O_p, L_p, Q_ref were recomputed, ascending
  std::vector<double> mse;         // [Bb] query MSE vs Q_ref (zeros on a first step)
  int64_t prefix_pages = 0;        // pages in the prefix (per kv head)
  int64_t pages_loaded = 0;        // sum over kv heads of the pages loaded (the union)
  int64_t tokens_loaded = 0;
  int64_t pages_attended = 0;      // sum over (head, recomputed row) of pages attended
  std::vector<std::vector<int32_t>> loaded;  // per kv head, ascending (sparse steps)
  PagePlan plan;                   // selector's plan over the recomputed rows (sparse steps)
  double select_ms = 0, prefix_ms = 0, block_ms = 0, total_ms = 0;
};

class PrefixAttention {
 public:
  PrefixAttention() = default;
  static Result<PrefixAttention> create(const LosaConfig& config, const LosaOptions& options);

  // One denoising step of the current block. q: f32 [1, heads_q, Bb, d]; k_block,
  // v_block: f32 [1, heads_kv, Bb, d] (the block's own keys and values this step).
  // Writes out f32 [1, heads_q, Bb, d] and lse f32 [1, heads_q, Bb] (prefix + block).
  Status step(const PagedKVCache& cache, const Tensor& q, const Tensor& k_block, const Tensor& v_block,
              const Tensor& out, const Tensor& lse, StepStats* stats = nullptr);

  // Appends the finished block's K/V (f32 [1, heads_kv, Bb, d]) to the cache and makes
  // the next step the first step of a new block.
  Status commit(PagedKVCache& cache, const Tensor& k_block, const Tensor& v_block);
  // Drops the state: the next step is a first step (dense).
  void begin_block() { steps_in_block_ = 0; }

  const LosaConfig& config() const { return config_; }
  const LosaOptions& options() const { return options_; }
  int64_t steps_in_block() const { return steps_in_block_; }
  int64_t blocks_committed() const { return blocks_committed_; }
  // The state (valid after the first step of a block).
  const HostArray& o_p() const { return o_p_; }      // f32 [1, heads_q, Bb, d]
  const HostArray& l_p() const { return l_p_; }      // f32 [1, heads_q, Bb]
  const HostArray& q_ref() const { return q_ref_; }  // f32 [1, heads_q, Bb, d]

 private:
  Status check_step_inputs(const PagedKVCache& cache, const Tensor& q, const Tensor& k_block,
                           const Tensor& v_block, const Tensor& out, const Tensor& lse) const;
  Status prefix_dense(const PagedKVCache& cache, const Tensor& q, const std::vector<int64_t>& rows, StepStats* s);
  Status prefix_sparse(const PagedKVCache& cache, const Tensor& q, const std::vector<int64_t>& rows, StepStats* s);

  LosaConfig config_{};
  LosaOptions options_{};
  int64_t steps_in_block_ = 0;
  int64_t blocks_committed_ = 0;
  HostArray o_p_, l_p_, q_ref_;
  HostArray o_b_, l_b_;  // intra-block scratch
};

// Active rows of one step: mse_i = mean over heads and dims of (q_i - q_ref_i)^2
// (f64 accumulation), then the top-K (ties to the lower row) or those above the
// threshold, ascending. q, q_ref: f32 [1, heads_q, Bb, d].
std::vector<double> query_mse(const Tensor& q, const Tensor& q_ref);
std::vector<int64_t> active_rows(const std::vector<double>& mse, int active_k, std::optional<double> threshold);

Status validate(const LosaConfig& config, const LosaOptions& options, int page_size = 16);

}  // namespace sparsa
