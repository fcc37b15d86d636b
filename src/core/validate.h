// Internal: argument checks shared by every public entry point. Each returns a
// Status whose message names the argument, what was expected and what was given.
#pragma once

#include <string>

#include "sparsa/tensor.h"

namespace sparsa::detail {

// A 4-d [batch, heads, seq, head_dim] float tensor on `device`, non-empty,
// contiguous last dimension, non-negative strides.
Status check_attention_tensor(const char* name, const Tensor& t, Device device);
// q [batch, heads_q, len_q, d] and k [batch, heads_kv, len_kv, d] on `device`: both valid
// attention tensors, same dtype, same batch and head_dim, heads_q a multiple of heads_kv.
Status check_query_key(const Tensor& q, const Tensor& k, Device device);
// A tensor of exactly `shape` and `dtype` (for outputs and side inputs).
Status check_shape(const char* name, const Tensor& t, std::initializer_list<int64_t> shape);
Status check_dtype(const char* name, const Tensor& t, DType dtype);
// NaN/Inf scan (CPU tensors); the message names the first bad element.
Status check_finite(const char* name, const Tensor& t);

// An output whose elements overlap each other (a stride of 0 over a dimension longer
// than 1, or strides that interleave) would have several results written to one
// address: refused. Conservative: dimensions sorted by |stride| must each step past
// everything the smaller ones span.
Status check_no_self_overlap(const char* name, const Tensor& t);
// Two outputs whose memory ranges intersect (lse= a view into out=) would overwrite each
// other: refused, naming both.
Status check_disjoint(const char* name, const Tensor& t, const char* other_name, const Tensor& other);
// Both of the above for an (out, lse) pair.
Status check_outputs(const char* out_name, const Tensor& out, const char* lse_name, const Tensor& lse);

std::string shape_string(std::initializer_list<int64_t> shape);

// The messages of a BlockIndex whose contents are wrong, shared by the host check
// (validate_block_index) and the cuda backend's device check, so both name the same element the
// same way. Row [b, h, qb]; slot s of that row; perm row [b, h], entry p holding t.
Status index_count_error(int64_t b, int64_t h, int64_t qb, int32_t count, int64_t capacity);
Status index_block_range_error(int64_t b, int64_t h, int64_t qb, int64_t s, int32_t block, int64_t num_kv_blocks);
Status index_block_order_error(int64_t b, int64_t h, int64_t qb, int64_t s, int32_t prev, int32_t block);
Status permutation_error(const char* name, int64_t b, int64_t h, int64_t len, int64_t p, int32_t t);

}  // namespace sparsa::detail
