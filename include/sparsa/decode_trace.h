// sparsa/decode_trace.h — a block-diffusion decode trace: the inputs one attention layer
// sees while a block-diffusion LM decodes blocks of tokens against a long prefix, either
// synthetic, on the workload generator (docs/workload.md), or recorded from a real model.
//
// The workload generator supplies the clean tensors of a sequence of prefix_len +
// num_blocks * block_size tokens (its queries are the last num_blocks * block_size
// positions). The prefix's K/V are the cache. For each block, the block's clean
// (final) q, k, v rows are where its tokens end up; the trace walks them there:
//
//   step 0        every token is [MASK]: x_i = x*_i + unmask_move * rms(x*_i) * u_i,
//                 u_i ~ N(0, I) per head (x is each of q, k, v; rms over head_dim).
//   after step s  tokens_per_step tokens (a seeded random order) are unmasked: their
//                 rows jump to x*_i. Their still-present neighbours (i-1, i+1) move by
//                 neighbour_move * rms(x*_i) * N(0, I); every other row takes a
//                 random-walk step of drift * rms(x*_i) * N(0, I).
//   commit        the block's clean K/V (x*) are appended to the cache, as the extra
//                 forward pass over the finished block does in SDAR / BD3-LM.
//
// So consecutive-step query MSE is ~unmask_move^2 * rms^2 for a token just unmasked,
// ~neighbour_move^2 * rms^2 for its neighbours and ~drift^2 * rms^2 for the rest:
// the locality of LoSA's observation, with each magnitude a knob.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsa/losa.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"
#include "sparsa/workload.h"

namespace sparsa {

struct DecodeTraceConfig {
  // Heads, head_dim, seed and the structure knobs of the clean tensors. The trace sets
  // batch = 1, dtype = f32, len_kv = prefix_len + num_blocks * block_size and
  // len_q = num_blocks * block_size; retrieval_span must fit in len_q.
  WorkloadConfig workload = default_workload();
  int64_t prefix_len = 16384;   // committed tokens before the first decoded block (>= 0)
  int64_t block_size = 16;      // tokens decoded in parallel, 4 to 32
  int64_t num_blocks = 1;       // blocks decoded (each committed after its last step)
  int64_t tokens_per_step = 1;  // tokens unmasked after each step, 1 to block_size
  int64_t steps_per_block = 0;  // 0: ceil(block_size / tokens_per_step); fewer is an error
  float unmask_move = 1.0f;     // size of an unmasked token's jump, relative to its rms
  float neighbour_move = 0.1f;  // size of its neighbours' move, relative to their rms
  float drift = 0.02f;          // per-step random-walk size of every other token
  uint64_t seed = 1;            // masks, unmask order and moves (the workload has its own)

  static WorkloadConfig default_workload();  // 8 q / 2 kv heads, d 64, retrieval_span 8
};

Status validate(const DecodeTraceConfig& config);

// One block of a recorded trace (DecodeTrace::from_recorded): each step's inputs, the block's
// clean K/V (the commit pass) and the tokens unmasked after each step (ascending, in [0, B)).
struct RecordedTraceBlock {
  std::vector<Tensor> q, k, v;                  // per step: [1, heads_q, B, d]; [1, heads_kv, B, d]
  Tensor final_k, final_v;                      // [1, heads_kv, B, d]
  std::vector<std::vector<int64_t>> unmasked;   // per step
};

class DecodeTrace {
 public:
  // Generates the clean tensors with generate_workload(), then the trace.
  static Result<DecodeTrace> generate(const DecodeTraceConfig& config);
  // The trace over given clean tensors: q f32 [1, heads_q, >= num_blocks * block_size, d]
  // (the blocks are its last rows), k, v f32 [1, heads_kv, prefix_len + num_blocks *
  // block_size, d]. config.workload's shape fields are ignored.
  static Result<DecodeTrace> from_tensors(const DecodeTraceConfig& config, const Tensor& q, const Tensor& k,
                                          const Tensor& v);
  // A trace a model recorded (the engine's attention capture, docs/dlm.md; `sparsa trace
  // --capture`): the prefix cache's K/V, f32 [1, heads_kv, P, d] (both undefined when P = 0),
  // then the blocks in order, every block with the same size B (4 to 32) and number of steps.
  // The config is derived: prefix_len P, block_size B, num_blocks, steps_per_block, and
  // tokens_per_step = ceil(B / steps); its move fields and seed are unused.
  static Result<DecodeTrace> from_recorded(const Tensor& prefix_k, const Tensor& prefix_v,
                                           const std::vector<RecordedTraceBlock>& blocks);
  // The decoded blocks of request R at layer L in a directory the engine's attention capture
  // wrote (`sparsa generate --dump-attention DIR`: DIR/rR-lL-fF.safetensors with q, k, v,
  // prefix_k/prefix_v and the metadata step, pos0, tokens). A block is a run of denoising
  // steps 0, 1, ..., S-1 at one position followed by its commit pass (step -1): those K/V are
  // the block's clean K/V. The tokens unmasked after each step are read from layer 0's keys
  // (which DIR must hold: there a key depends only on its token and position). Prefill passes,
  // a last block never committed and a first block with fewer steps than the next (the prompt
  // ended inside it) are left out (their forwards counted in *skipped). Errors:
  // invalid_argument for a capture that cannot be a trace (no such files, no layer 0, forwards
  // missing, blocks not consecutive or of different step counts), malformed_file / io_error
  // for files that do not read or lack their entries, each naming the file.
  static Result<DecodeTrace> from_capture(const std::string& dir, int64_t request, int64_t layer,
                                          int64_t* skipped = nullptr);

  const DecodeTraceConfig& config() const { return config_; }
  int64_t heads_q() const { return heads_q_; }
  int64_t heads_kv() const { return heads_kv_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t steps_per_block() const { return steps_; }

  // f32 [1, heads_kv, prefix_len, d] (undefined when prefix_len = 0).
  Tensor prefix_k() const { return prefix_view(k_clean_); }
  Tensor prefix_v() const { return prefix_view(v_clean_); }
  // Inputs of step s of block b: q [1, heads_q, Bb, d]; k, v [1, heads_kv, Bb, d].
  Tensor q(int64_t block, int64_t step) const { return step_view(q_steps_, heads_q_, block, step); }
  Tensor k(int64_t block, int64_t step) const { return step_view(k_steps_, heads_kv_, block, step); }
  Tensor v(int64_t block, int64_t step) const { return step_view(v_steps_, heads_kv_, block, step); }
  // The clean K/V of block b, to commit: [1, heads_kv, Bb, d] views.
  Tensor final_k(int64_t block) const { return block_view(k_clean_, block); }
  Tensor final_v(int64_t block) const { return block_view(v_clean_, block); }
  // Tokens unmasked after step s of block b (ascending).
  // Out-of-range block or step: an undefined tensor / an empty list.
  const std::vector<int64_t>& unmasked_after(int64_t block, int64_t step) const {
    static const std::vector<int64_t> kNone;
    return in_range(block, step) ? unmasked_[block * steps_ + step] : kNone;
  }

 private:
  bool in_range(int64_t block, int64_t step) const {
    return block >= 0 && block < config_.num_blocks && step >= 0 && step < steps_;
  }
  Tensor prefix_view(const HostArray& a) const;
  Tensor block_view(const HostArray& a, int64_t block) const;
  Tensor step_view(const std::vector<HostArray>& steps, int64_t heads, int64_t block, int64_t step) const;

  DecodeTraceConfig config_{};
  int64_t heads_q_ = 0, heads_kv_ = 0, head_dim_ = 0, steps_ = 0;
  HostArray k_clean_, v_clean_;  // [1, heads_kv, prefix_len + blocks * Bb, d]
  std::vector<HostArray> q_steps_, k_steps_, v_steps_;  // [block * steps + step]
  std::vector<std::vector<int64_t>> unmasked_;          // [block * steps + step]
};

// ---- running methods over a trace ---------------------------------------------------

// One step of one method, measured against dense prefix attention on the same inputs.
struct TraceStep {
  StepStats stats;        // plan and loaded lists dropped (keep_plans = false)
  double err = 0;         // ||O - O_dense||_F / ||O_dense||_F of the block output (prefix + block)
  double err_prefix = 0;  // the same for the prefix part O_p
  double err_masked = 0;  // the block-output error over the rows still masked at this step
                          // (the ones whose predictions decide what is unmasked next; 0 if none)
  double recall = 1;      // mean over (head, recomputed row) of exp(L_p - L_p_dense): dense mass kept
  double cpu_ms = 0;      // process CPU time of step() (all threads), median over repeats
};

struct TraceRunOptions {
  int repeats = 1;          // passes; times are the median per step, the rest from the first
  bool keep_plans = false;  // keep StepStats::plan and ::loaded (memory grows with steps)
};

// Runs every method through the trace in lockstep: at each step dense prefix attention
// (with methods[0]'s attention options) and then every method on the same inputs, so a
// busy machine slows all alike. All share one prefix cache, committed after each block.
// Result: [method][block * steps + step].
Result<std::vector<std::vector<TraceStep>>> run_trace(const DecodeTrace& trace, const std::vector<LosaOptions>& methods,
                                                      const TraceRunOptions& options = {});

// Means over the steps after the first of each block (the sparse steps), and the
// block means over all steps.
struct TraceSummary {
  double pages = 0;        // pages loaded per step per kv head
  double pages_frac = 0;   // ... as a share of the prefix pages
  double err = 0, err_max = 0, err_prefix = 0, err_masked = 0, recall = 0;
  double cpu_ms = 0, wall_ms = 0, recomputed = 0;
  double block_cpu_ms = 0, block_pages = 0;  // over every step, first steps included
};
TraceSummary summarise(const std::vector<TraceStep>& steps, int64_t heads_kv);

}  // namespace sparsa
