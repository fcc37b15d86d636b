// Internal: the plain params struct every attention backend takes (framework-free: pointers, shapes, strides).
// Built once by the validated public entry points; backends trust it.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/index.h"
#include "sparsa/tensor.h"

namespace sparsa::detail {

struct AttentionParams {
  // Inputs [batch, heads, seq, head_dim]; strides in elements for (batch, head, seq).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::f32;  // of q, k, v and out
  int64_t q_stride[3] = {};
  int64_t k_stride[3] = {};
  int64_t v_stride[3] = {};
  // Outputs.
  void* out = nullptr;
  float* lse = nullptr;
  int64_t out_stride[3] = {};
  int64_t lse_stride[2] = {};  // (batch, head); seq stride in lse_seq_stride
  int64_t lse_seq_stride = 1;

  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_kv = 0, head_dim = 0;
  float scale = 1.0f;
  int num_threads = 0;
  int device_id = 0;  // cuda backend: the device every tensor lives on
  void* stream = nullptr;  // cuda backend: the cudaStream_t of the call (null: the legacy default stream)

  // Block-sparse plan (nullptr for dense).
  const BlockIndex* index = nullptr;
  bool check_index = true;  // AttentionOptions::check_index (the cuda backend's device check)

  // The per-element mask (validated), on positions local to each sequence.
  Mask mask;
  // Variable-length batch (both null: every sequence has len_q / len_kv tokens). Offsets i32
  // [batch + 1] (validated; host memory for the cpu backends): batch is the number of sequences,
  // len_q / len_kv the longest, and sequence b's token i is row cu_seqlens_q[b] + i of the seq
  // dimension (the batch strides are 0).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_kv = nullptr;
  // The cuda backend: host copies of the device offsets (read back and validated by the entry
  // point); the helpers below read these. Empty on the cpu backends (the offsets are host memory).
  std::vector<int32_t> host_cu_seqlens_q, host_cu_seqlens_kv;

  bool varlen() const { return cu_seqlens_q != nullptr; }
  const int32_t* offsets_q() const { return host_cu_seqlens_q.empty() ? cu_seqlens_q : host_cu_seqlens_q.data(); }
  const int32_t* offsets_kv() const { return host_cu_seqlens_kv.empty() ? cu_seqlens_kv : host_cu_seqlens_kv.data(); }
  int64_t q_begin(int64_t b) const { return varlen() ? offsets_q()[b] : 0; }
  int64_t kv_begin(int64_t b) const { return varlen() ? offsets_kv()[b] : 0; }
  int64_t seq_len_q(int64_t b) const { return varlen() ? offsets_q()[b + 1] - offsets_q()[b] : len_q; }
  int64_t seq_len_kv(int64_t b) const { return varlen() ? offsets_kv()[b + 1] - offsets_kv()[b] : len_kv; }

  int64_t group() const { return heads_q / heads_kv; }
  int64_t q_off(int64_t b, int64_t h, int64_t i) const {
    return b * q_stride[0] + h * q_stride[1] + (q_begin(b) + i) * q_stride[2];
  }
  int64_t k_off(int64_t b, int64_t h, int64_t j) const {
    return b * k_stride[0] + h * k_stride[1] + (kv_begin(b) + j) * k_stride[2];
  }
  int64_t v_off(int64_t b, int64_t h, int64_t j) const {
    return b * v_stride[0] + h * v_stride[1] + (kv_begin(b) + j) * v_stride[2];
  }
  int64_t out_off(int64_t b, int64_t h, int64_t i) const {
    return b * out_stride[0] + h * out_stride[1] + (q_begin(b) + i) * out_stride[2];
  }
  float& lse_at(int64_t b, int64_t h, int64_t i) const {
    return lse[b * lse_stride[0] + h * lse_stride[1] + (q_begin(b) + i) * lse_seq_stride];
  }
};

// The rows of sequence s of a block index made for a variable-length batch, as the plan of a
// single sequence of len_q x len_kv tokens: batch 1, the first ceil(len_q / block_q) query-block
// rows, num_kv_blocks = ceil(len_kv / block_kv), the first len_q / len_kv permutation entries.
inline BlockIndex sequence_index(const BlockIndex& ix, int64_t s, int64_t len_q, int64_t len_kv) {
  auto rows = [s](Tensor t, int64_t len) {
    if (!t.defined()) return t;
    t.data = static_cast<char*>(t.data) + s * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
    t.shape[0] = 1;
    if (len >= 0) t.shape[2] = len;
    return t;
  };
  BlockIndex sub = ix;
  sub.num_q_blocks = (len_q + ix.block_q - 1) / ix.block_q;
  sub.num_kv_blocks = (len_kv + ix.block_kv - 1) / ix.block_kv;
  sub.counts = rows(ix.counts, sub.num_q_blocks);
  sub.indices = rows(ix.indices, sub.num_q_blocks);
  sub.perm_q = rows(ix.perm_q, len_q);
  sub.perm_kv = rows(ix.perm_kv, len_kv);
  return sub;
}

// Sequence s of a variable-length call as a fixed-length call of one sequence (batch 1, its own
// lengths, pointers moved to its first token, its rows of the index in *sub_index).
inline AttentionParams sequence_params(const AttentionParams& p, int64_t s, BlockIndex* sub_index) {
  AttentionParams one = p;
  const int64_t esize = static_cast<int64_t>(dtype_size(p.dtype));
  one.q = static_cast<const char*>(p.q) + p.q_off(s, 0, 0) * esize;
  one.k = static_cast<const char*>(p.k) + p.k_off(s, 0, 0) * esize;
  one.v = static_cast<const char*>(p.v) + p.v_off(s, 0, 0) * esize;
  one.out = static_cast<char*>(p.out) + p.out_off(s, 0, 0) * esize;
  one.lse = &p.lse_at(s, 0, 0);
  one.batch = 1;
  one.len_q = p.seq_len_q(s);
  one.len_kv = p.seq_len_kv(s);
  one.cu_seqlens_q = one.cu_seqlens_kv = nullptr;
  one.host_cu_seqlens_q.clear();
  one.host_cu_seqlens_kv.clear();
  if (p.index != nullptr) {
    *sub_index = sequence_index(*p.index, s, one.len_q, one.len_kv);
    one.index = sub_index;
  }
  return one;
}

// Read helpers for BlockIndex tensors (i32, any strides).
inline int32_t index_count(const BlockIndex& ix, int64_t b, int64_t h, int64_t qb) {
  return ix.counts.ptr<const int32_t>()[ix.counts.offset({b, h, qb})];
}
inline int32_t index_block(const BlockIndex& ix, int64_t b, int64_t h, int64_t qb, int64_t slot) {
  return ix.indices.ptr<const int32_t>()[ix.indices.offset({b, h, qb, slot})];
}
// Original token of permuted position p (identity without a permutation).
inline int64_t perm_q_at(const BlockIndex& ix, int64_t b, int64_t h, int64_t p) {
  return ix.perm_q.defined() ? ix.perm_q.ptr<const int32_t>()[ix.perm_q.offset({b, h, p})] : p;
}
inline int64_t perm_kv_at(const BlockIndex& ix, int64_t b, int64_t h_kv, int64_t p) {
  return ix.perm_kv.defined() ? ix.perm_kv.ptr<const int32_t>()[ix.perm_kv.offset({b, h_kv, p})] : p;
}

// Element loads/stores of the attention dtypes.
inline float load_element(const void* base, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[offset];
    case DType::f16: return half_to_float(static_cast<const uint16_t*>(base)[offset]);
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[offset]);
    case DType::i32: return static_cast<float>(static_cast<const int32_t*>(base)[offset]);
  }
  return 0.0f;
}
inline void store_element(void* base, DType dtype, int64_t offset, float x) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[offset] = x; break;
    case DType::f16: static_cast<uint16_t*>(base)[offset] = float_to_half(x); break;
    case DType::bf16: static_cast<uint16_t*>(base)[offset] = float_to_bf16(x); break;
    case DType::i32: static_cast<int32_t*>(base)[offset] = static_cast<int32_t>(x); break;
  }
}
// n contiguous elements into f32.
inline void load_row(const void* base, DType dtype, int64_t offset, int64_t n, float* dst) {
  if (dtype == DType::f32) {
    const float* src = static_cast<const float*>(base) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = load_element(base, dtype, offset + i);
}

}  // namespace sparsa::detail
