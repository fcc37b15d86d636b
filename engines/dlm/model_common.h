// Helpers of the two forwards (model_common.cpp).
#pragma once

#include "engine.h"

namespace sparsa::dlm {

// Attention of `layer` over the chunk in s.q / s.k / s.v (rows [n, heads, head_dim]) into s.att,
// then the K/V append of the first o.store_kv rows.
Status attend(const Config& c, State& s, Sequence& seq, int layer, int64_t n, const ForwardOptions& o);
Status check_chunk(const Config& c, const Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o);
// Final norm and LM head over the requested rows of s.x, read back to host `logits`.
void head(const Config& c, const Weights& w, State& s, const ForwardOptions& o, float* logits);
Result<Weight> load_weight(const TensorStore& store, Ops& ops, const std::string& name, std::vector<int64_t> shape);

#define SPARSA_ASSIGN_WEIGHT(dst, expr)         \
  do {                                          \
    auto weight_ = (expr);                      \
    if (!weight_.ok()) return weight_.status(); \
    dst = weight_.value();                      \
  } while (0)

}  // namespace sparsa::dlm
