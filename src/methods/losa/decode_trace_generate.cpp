// DecodeTrace::generate: the trace on the workload generator's clean tensors. Kept in
// its own file so that from_tensors() links without the generator.
#include "sparsa/decode_trace.h"

namespace sparsa {

Result<DecodeTrace> DecodeTrace::generate(const DecodeTraceConfig& config) {
  SPARSA_RETURN_IF_ERROR(validate(config));
  WorkloadConfig w = config.workload;
  w.batch = 1;
  w.dtype = DType::f32;
  w.len_q = config.num_blocks * config.block_size;
  w.len_kv = config.prefix_len + w.len_q;
  auto workload = generate_workload(w);
  if (!workload.ok()) return workload.status();
  return from_tensors(config, workload->q.view(), workload->k.view(), workload->v.view());
}

}  // namespace sparsa
