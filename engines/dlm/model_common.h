// Helpers of the two forwards (model_common.cpp).
#pragma once

#include "engine.h"

namespace sparsa::dlm {

// Columns of the fused q/k/v rows: heads*hd + 2*kv_heads*hd.
inline int64_t qkv_width(const Config& c) { return (c.n_heads + 2 * c.n_kv_heads) * c.head_dim; }

// Attention of `layer` over the chunk in s.qkv (rows [n, qkv_width]) into s.att, then the K/V
// append of the first o.store_kv rows.
Status attend(const Config& c, State& s, Sequence& seq, int layer, int64_t n, const ForwardOptions& o);
Status check_chunk(const Config& c, const Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o);
// Final norm and LM head over the requested rows of s.x into s.logits, read back to host
// `logits` when it is not null.
Status head(const Config& c, const Weights& w, State& s, const ForwardOptions& o, float* logits);

#define SPARSA_ASSIGN_WEIGHT(dst, expr)         \
  do {                                          \
    auto weight_ = (expr);                      \
    if (!weight_.ok()) return weight_.status(); \
    dst = weight_.value();                      \
  } while (0)

}  // namespace sparsa::dlm
