// sparsa/oracle.h — the evaluation side of block selectors: the dense block mass of
// BA-Att's Eq. 3 over any block partition, and the metrics every selector is judged by.
// Evaluation only: the block mass costs a dense O(L^2 d) pass per head.
#pragma once

#include <optional>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/index.h"

namespace sparsa {

// Blocks of block_q / block_kv consecutive permuted tokens; perm_q i32 [batch, heads_q, len_q]
// and perm_kv i32 [batch, heads_kv, len_kv] are optional (undefined: identity).
struct BlockPartition {
  int block_q = 64;
  int block_kv = 64;
  Tensor perm_q;
  Tensor perm_kv;
};
BlockPartition partition_of(const BlockIndex& plan);

struct OracleOptions {
  std::optional<float> scale;  // default 1/sqrt(head_dim)
  Backend backend = Backend::cpu;
  int num_threads = 0;
};

// Per (batch, head_q, query block, key block) of the partition, with A = softmax(scale Q K')
// computed exactly per query row:
//   mass      = (1/|I|) sum_{i in I} sum_{j in J} A_ij          (Eq. 3; rows sum to 1)
//   logit_max = max_{i in I, j in J} scale Q_i . K_j,  logit_min = the min.
struct OracleBlocks {
  int block_q = 0, block_kv = 0;
  int64_t num_q_blocks = 0, num_kv_blocks = 0;
  HostArray mass;       // f32 [batch, heads_q, num_q_blocks, num_kv_blocks]
  HostArray logit_max;  // f32, same shape
  HostArray logit_min;  // f32, same shape
};
Result<OracleBlocks> oracle_blocks(const Tensor& q, const Tensor& k, const BlockPartition& partition,
                                   const OracleOptions& options = {});

// Mass recall of a plan: mean over (batch, head, query block) of the oracle mass of the
// key blocks it keeps. The oracle must be computed on the plan's own partition.
Result<double> mass_recall(const BlockIndex& plan, const OracleBlocks& oracle);
// The same quantity per query token, from executor outputs: mean_i exp(lse_plan_i - lse_dense_i)
// (the share of row i's softmax mass the plan's visible keys hold). Equals mass_recall when
// every block is full.
Result<double> mass_recall_from_lse(const Tensor& lse_plan, const Tensor& lse_dense);
// ||out - reference||_F / ||reference||_F over the whole tensor (f64 sums).
Result<double> relative_error(const Tensor& out, const Tensor& reference);

// Eq. 8 against the observed deviation (Fig. 2), per block pair of the partition:
//   U   = (RQ MK + MQ RK + RQ RK) * scale, R = max distance of a token to its block mean,
//         M = max token norm (Eq. 7);
//   dev = max_{i in I, j in J} |scale Q_i . K_j - scale Qbar . Kbar|, from the oracle's
//         logit_max / logit_min on the same partition.
// Pearson R between U and dev over the block pairs of each (batch, head), and pooled.
struct DeviationBound {
  HostArray bound;      // f32 [batch, heads_q, num_q_blocks, num_kv_blocks]
  HostArray deviation;  // f32, same shape
  std::vector<double> pearson_per_head;  // [batch * heads_q]; NaN where U or dev is constant
  double pearson_overall = 0;
  int64_t violations = 0;  // pairs with dev > U beyond f32 rounding (Eq. 8 says none)
  double mean_bound = 0, mean_deviation = 0;
};
Result<DeviationBound> deviation_bound(const Tensor& q, const Tensor& k, const BlockPartition& partition,
                                       const OracleBlocks& oracle, const OracleOptions& options = {});

// Pearson correlation of x and y (NaN when either is constant or n < 2).
double pearson(const double* x, const double* y, int64_t n);

}  // namespace sparsa
