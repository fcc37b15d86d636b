// A dense attention backward for the CPU benchmark (the library has dense forward only).
#pragma once

#include <cstdint>

namespace sparsa::bench {

// FlashAttention-2 style: P is recomputed from the saved LSE tile by tile (64 queries x
// 64 keys), nothing N x N is stored. Contiguous f32 [batch, heads, n, d] (heads_q ==
// heads_kv); threads over (batch, head). Overwrites dq, dk, dv.
void dense_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                    const float* d_o, float* dq, float* dk, float* dv, int64_t batch, int64_t heads, int64_t n,
                    int64_t d, float scale, int num_threads);

}  // namespace sparsa::bench
