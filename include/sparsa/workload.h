// sparsa/workload.h — the seeded generator of attention inputs (DESIGN.md §5).
//
// The embedded default of `sparsa demo`, `bench` and `eval`. It reproduces the
// documented structure of real long-context attention: heavy-tailed token norms,
// attention sinks, a local band (RoPE-like decay), retrieval structure (query blocks
// matching distant key blocks) and noise. docs/workload.md documents every knob.
// The same config and seed give the same tensors on every machine.
#pragma once

#include <cstdint>
#include <string>

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
  DType dtype = DType::f32;

  float norm_sigma = 0.5f;        // log-normal sigma of per-token norm multipliers (heavy tail)
  int sink_tokens = 4;            // leading keys with large norms that attract attention
  float sink_strength = 4.0f;
  float local_strength = 1.5f;    // strength of the RoPE-like local band
  float local_width = 256.0f;     // tokens over which local similarity decays
  int retrieval_pairs = 8;        // planted (query span, distant key span) pairs per head
  int retrieval_span = 64;        // tokens per planted span
  float retrieval_strength = 3.0f;
  float noise = 1.0f;             // isotropic Gaussian component
};

struct Workload {
  WorkloadConfig config;
  HostArray q;  // [batch, heads_q, len_q, head_dim]
  HostArray k;  // [batch, heads_kv, len_kv, head_dim]
  HostArray v;  // [batch, heads_kv, len_kv, head_dim]
};

Status validate(const WorkloadConfig& config);
Result<Workload> generate_workload(const WorkloadConfig& config);
// One line: "seed=0 batch=1 heads=8/2 len=4096x4096 d=64 f32 ...".
std::string describe(const WorkloadConfig& config);

}  // namespace sparsa
