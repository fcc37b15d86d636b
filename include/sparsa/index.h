// sparsa/index.h — BlockIndex, the plan of every block-sparse method.
//
// Its core matches PyTorch FlexAttention's BlockMask (kv_num_blocks / kv_indices),
// so masks convert both ways. Query block qb of (batch b, query head h) visits the
// key blocks indices[b, h, qb, 0 .. counts[b, h, qb]), ascending and distinct.
//
// With perm_q / perm_kv the blocks are formed over permuted tokens: permuted query
// position p is original token perm_q[b, h, p]; the executor reads Q[perm_q],
// K[perm_kv], V[perm_kv] and writes O (and LSE) back at the original positions.
// The last block of a sequence may be partial: num_q_blocks = ceil(len_q / block_q).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "sparsa/tensor.h"

namespace sparsa {

struct BlockIndex {
  int block_q = 0;         // query tokens per block
  int block_kv = 0;        // key tokens per block
  int64_t num_q_blocks = 0;
  int64_t num_kv_blocks = 0;
  Tensor counts;           // i32 [batch, heads_q, num_q_blocks]
  Tensor indices;          // i32 [batch, heads_q, num_q_blocks, capacity]
  Tensor perm_q;           // optional i32 [batch, heads_q, len_q]  (undefined: identity)
  Tensor perm_kv;          // optional i32 [batch, heads_kv, len_kv] (undefined: identity)

  int64_t capacity() const { return indices.ndim == 4 ? indices.shape[3] : 0; }
};

// Owns the arrays a BlockIndex points at; selectors return one of these.
struct BlockIndexBuffer {
  int block_q = 0;
  int block_kv = 0;
  int64_t num_q_blocks = 0;
  int64_t num_kv_blocks = 0;
  HostArray counts;
  HostArray indices;
  HostArray perm_q;   // empty() when absent
  HostArray perm_kv;  // empty() when absent
  // A plan built by a cuda selector keeps the same four arrays in device memory instead; the
  // HostArrays above stay empty then.
  DeviceArray device_counts;
  DeviceArray device_indices;
  DeviceArray device_perm_q;   // empty() when absent
  DeviceArray device_perm_kv;  // empty() when absent

  bool on_device() const { return !device_counts.empty(); }
  // Views of whichever arrays the plan holds (device tensors for a device plan).
  BlockIndex view() const;
  // A host copy of a device plan (a host plan is returned as it is).
  Result<BlockIndexBuffer> to_host() const;

  // Every query block visits every key block (dense as a plan).
  static BlockIndexBuffer full(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv,
                               int block_q, int block_kv);
  // A plan from per-row selections (what selectors compute): row r = (b * heads_q + h) *
  // num_q_blocks + qb keeps the counts[r] ascending key blocks at blocks + r * row_stride;
  // the capacity is the largest count.
  static BlockIndexBuffer from_rows(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv, int block_q,
                                    int block_kv, std::span<const int32_t> counts, const int32_t* blocks,
                                    int64_t row_stride);
  // Empty plan of the given capacity (counts = 0).
  static BlockIndexBuffer empty(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv,
                                int block_q, int block_kv, int64_t capacity);
};

// Validate an index against the attention shapes it will drive: block sizes, counts
// within [0, capacity], indices in [0, num_kv_blocks), strictly ascending, permutations
// that are permutations. `what` prefixes messages ("index").
Status validate_block_index(const BlockIndex& index, int64_t batch, int64_t heads_q,
                            int64_t heads_kv, int64_t len_q, int64_t len_kv);

// Fraction of (query block, key block) pairs the plan visits, weighted by the real
// size of partial blocks (tokens pairs visited / all token pairs). For a valid host index
// (validate_block_index); an index whose counts or indices live in device memory gives NaN
// (copy it with BlockIndexBuffer::to_host() first).
double block_index_density(const BlockIndex& index, int64_t len_q, int64_t len_kv);

}  // namespace sparsa
