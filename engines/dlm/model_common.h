// Helpers of the two forwards (model_common.cpp).
#pragma once

#include "engine.h"

namespace sparsa::dlm {

// Columns of the fused q/k/v rows: heads*hd + 2*kv_heads*hd.
inline int64_t qkv_width(const Config& c) { return (c.n_heads + 2 * c.n_kv_heads) * c.head_dim; }

// Where a forward's chunk is: rows [row0, row0 + n) of the State's buffers, positions from
// pos0 (its sequence's length before the forward), logit rows from logit0.
struct ChunkRows {
  int64_t row0 = 0, n = 0, pos0 = 0, logit0 = 0;
};
// Checks every chunk, sizes the State for all their rows and logit rows, and embeds their tokens
// into s.x; the chunks' rows, in order.
Result<std::vector<ChunkRows>> begin_forward(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks);
// RoPE of each chunk's first `heads` heads of s.qkv at its own positions.
void rope_chunks(const Config& c, State& s, std::span<const ChunkRows> rows, int64_t heads);
// Attention of `layer` for each chunk over its rows of s.qkv (rows of qkv_width) into its rows of
// s.att, then the K/V append of its first store_kv rows.
Status attend(const Config& c, State& s, std::span<const Chunk> chunks, std::span<const ChunkRows> rows, int layer);
Status check_chunk(const Config& c, const Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o);
// Final norm and LM head over every chunk's requested rows of s.x into s.logits (chunk after
// chunk), read back to host `logits` when it is not null.
Status head(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks,
            std::span<const ChunkRows> rows, float* logits);

#define SPARSA_ASSIGN_WEIGHT(dst, expr)         \
  do {                                          \
    auto weight_ = (expr);                      \
    if (!weight_.ok()) return weight_.status(); \
    dst = weight_.value();                      \
  } while (0)

}  // namespace sparsa::dlm
