// Options of the block selectors from `-P` parameters, shared by their registry
// entries (methods/ba_att.cpp, methods/xattention.cpp, methods/llsa.cpp) and by `sparsa plan`, which
// needs the plan itself rather than the attention output.
#pragma once

#include "methods.h"
#include "sparsa/ba_att.h"
#include "sparsa/llsa.h"
#include "sparsa/xattention.h"

namespace sparsa::cli {

// `ba_att` parameters (and `mean_pool`, which is ba_att with sort=false compensate=false).
Result<BaAttOptions> ba_att_options_from(const std::string& method, const MethodInputs& in);
Result<XAttentionOptions> xattention_options_from(const MethodInputs& in);
// Runs a selector's plan through the block-sparse executor and fills the fields every
// block selector reports: output, density, selection time, and the plan's shape
// (block sizes, block counts, capacity, density, permutations).
Result<MethodOutput> execute_plan(const MethodInputs& in, const BlockIndexBuffer& plan, double select_seconds);

// `llsa` parameters (block, topk, levels, enrich, dedupe).
Result<LlsaOptions> llsa_options_from(const MethodInputs& in);
// `llsa` -P layout=z_order|hilbert -P height=H -P width=W: the token order to run in (perm[p]
// = row-major index of position p), empty for row-major; and a copy of `in` in that order.
Result<std::vector<int32_t>> llsa_token_order(const MethodInputs& in);
Status permuted_copy(const Tensor& in, const std::vector<int32_t>& perm, HostArray* out);

}  // namespace sparsa::cli
