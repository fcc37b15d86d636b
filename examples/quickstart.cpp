// The README's C++ example, built and run by CTest so it cannot rot.
#include <cstdio>

#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "sparsa/llsa.h"
#include "sparsa/oracle.h"
#include "sparsa/workload.h"

int main() {
  using namespace sparsa;
  // q [1, 8, 4096, 64], k/v [1, 2, 4096, 64] (GQA 8:2) from the seeded workload.
  WorkloadConfig config;
  config.len_q = config.len_kv = 4096;
  Result<Workload> w = generate_workload(config);
  if (!w.ok()) return std::fprintf(stderr, "%s\n", w.status().to_string().c_str()), 1;
  const Tensor q = w->q.view(), k = w->k.view(), v = w->v.view();

  // Dense attention: O and LSE.
  Result<AttentionOutput> dense_out = dense(q, k, v);
  if (!dense_out.ok()) return std::fprintf(stderr, "%s\n", dense_out.status().to_string().c_str()), 1;

  // BA-Att: plan (a BlockIndex with perm_q / perm_kv), then run the block-sparse executor.
  BaAttOptions options;
  options.block_q = options.block_kv = 64;
  options.budget = Budget::density(0.1);
  Result<BlockIndexBuffer> plan = ba_att_plan(q, k, options);
  if (!plan.ok()) return std::fprintf(stderr, "%s\n", plan.status().to_string().c_str()), 1;
  Result<AttentionOutput> sparse_out = block_sparse(q, k, v, plan->view());
  if (!sparse_out.ok()) return std::fprintf(stderr, "%s\n", sparse_out.status().to_string().c_str()), 1;

  // LLSA: hierarchical top-k with KV enrichment (self-attention, forward).
  LlsaOptions llsa_options;
  Result<AttentionOutput> llsa_out = llsa_forward(q, k, v, llsa_options);
  if (!llsa_out.ok()) return std::fprintf(stderr, "%s\n", llsa_out.status().to_string().c_str()), 1;

  const double density = block_index_density(plan->view(), config.len_q, config.len_kv);
  const double ba_err = relative_error(sparse_out->out.view(), dense_out->out.view()).value();
  const double llsa_err = relative_error(llsa_out->out.view(), dense_out->out.view()).value();
  std::printf("ba_att: density %.3f, relative error %.3f; llsa: relative error %.3f\n", density, ba_err, llsa_err);
  // A sanity bound, not a quality claim: the plan keeps about 10% of the blocks, and the
  // outputs are real attention outputs (errors below 1 mean better than predicting zero).
  return (density > 0.05 && density < 0.2 && ba_err < 1.0 && llsa_err < 1.5) ? 0 : 1;
}
