// sparsa/workload.h — the seeded generator of attention inputs (docs/workload.md).
//
// The embedded default of `sparsa demo`, `bench` and `eval`. It reproduces the
// documented structure of real long-context attention: heavy-tailed token norms,
// attention sinks, a local band (RoPE-like decay), retrieval structure (query blocks
// matching distant key blocks) and noise. docs/workload.md documents every knob.
// The same config and seed give the same tensors on every machine and for every
// num_threads (own PRNG and own elementary functions; no libm, no <random>).
//
// Positions: key j sits at position j; query i sits at position i + len_kv - len_q
// (queries are the last len_q positions, as in chunked prefill and block diffusion).
// Strengths are in logit units at the default scale 1/sqrt(head_dim), before the
// per-token norm multipliers. Every kv head draws its own variation of every knob
// (head_variation); the query heads of a GQA group share their kv head's structure
// (sink direction, rotary profile, retrieval spans) with small per-head jitter.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

struct WorkloadConfig {
  uint64_t seed = 0;
  int64_t batch = 1;
  int64_t heads_q = 8;
  int64_t heads_kv = 2;
  int64_t len_q = 4096;
  int64_t len_kv = 4096;
  int64_t head_dim = 64;
  DType dtype = DType::f32;       // f32, f16 or bf16 (generated in f32, then rounded)

  float norm_sigma = 0.35f;       // log-normal sigma of per-token norm multipliers (heavy tail)
  int sink_tokens = 4;            // leading keys with large norms that attract attention
  float sink_strength = 8.0f;     // mean logit a sharing query gives a sink key
  float sink_key_norm = 2.0f;     // norm of a sink key, in units of sqrt(head_dim)
  float local_strength = 1.5f;    // strength of the RoPE-like local band (logit at distance 0)
  float local_width = 256.0f;     // tokens over which local similarity decays (e-folding length)
  int retrieval_pairs = 8;        // planted (query span, distant key span) pairs per kv head
  int retrieval_span = 64;        // tokens per planted span
  float retrieval_strength = 3.0f;  // logit a span query gives a key of its matching span
  float noise = 1.0f;             // isotropic Gaussian component (per-dimension std)
  float head_variation = 1.0f;    // per-head knob multipliers 2^(head_variation * U[-1, 1])

  int num_threads = 0;            // generation threads, 0 = hardware; the output does not depend on it
};

// One planted retrieval pair: the queries [q_start, q_start + length) of every query
// head of kv head `kv_head` (h / (heads_q / heads_kv) == kv_head) share a direction
// with the keys [kv_start, kv_start + length) of batch element `batch`.
struct PlantedRetrieval {
  int64_t batch = 0;
  int64_t kv_head = 0;
  int64_t q_start = 0;
  int64_t kv_start = 0;
  int64_t length = 0;
};

struct Workload {
  WorkloadConfig config;
  HostArray q;  // [batch, heads_q, len_q, head_dim]
  HostArray k;  // [batch, heads_kv, len_kv, head_dim]
  HostArray v;  // [batch, heads_kv, len_kv, head_dim]
  std::vector<PlantedRetrieval> planted;  // batch-major, then kv head, then pair
};

Status validate(const WorkloadConfig& config);
Result<Workload> generate_workload(const WorkloadConfig& config);
// One line: "seed=0 batch=1 heads=8/2 len=4096x4096 d=64 f32 ...".
std::string describe(const WorkloadConfig& config);

}  // namespace sparsa
