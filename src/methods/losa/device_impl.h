// Internal: what the device LoSA classes (device_losa.cpp, host bookkeeping and validation) ask
// of the cuda backend (src/cuda/losa/losa.cu). Every argument is validated by the caller.
#pragma once

#include <cstdint>

#include "sparsa/losa.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa::losa_cuda {

constexpr int kMaxBatch = 64;
constexpr int kMaxBlock = 64;
constexpr int kMaxPageSize = 64;

// The pool of a DevicePagedKVCache.
struct Pool {
  DType dtype = DType::bf16;
  int device = 0;
  int64_t heads_kv = 0, head_dim = 0, pool_pages = 0;
  int page_size = 16;
  void* k = nullptr;    // [heads_kv, pool_pages * page_size, head_dim]
  void* v = nullptr;
  void* min = nullptr;  // [heads_kv, pool_pages, head_dim]
  void* max = nullptr;
  int64_t pool_tokens() const { return pool_pages * page_size; }
};

// Writes k, v ([1, heads_kv, n, head_dim], validated, on the pool's device) at tokens
// [old_length, old_length + n) of the sequence starting at pool page first_page, then
// recomputes the min/max of the pages those tokens touch.
Status append(const Pool& pool, int64_t first_page, int64_t old_length, const Tensor& k, const Tensor& v,
              void* stream);

struct Sequence {
  int64_t first_page = 0, length = 0;
};

struct StepArgs {
  Pool pool;
  void* stream = nullptr;
  int64_t batch = 0, heads_q = 0, block = 0;
  Sequence seqs[kMaxBatch];
  Tensor q, k_block, v_block, out, lse;  // validated
  float scale = 1.0f;
  // State, contiguous: o_p, q_ref [batch, heads_q, block, head_dim] (pool dtype), l_p f32
  // [batch, heads_q, block], active i32 [batch, block], active_counts i32 [batch], plan pages
  // i32 [batch, heads_q, block, capacity], plan counts [batch, heads_q, block], scores f32
  // [batch, heads_q, block, score_pages].
  void* o_p = nullptr;
  float* l_p = nullptr;
  void* q_ref = nullptr;
  int32_t* active = nullptr;
  int32_t* active_counts = nullptr;
  int32_t* plan_pages = nullptr;
  int32_t* plan_counts = nullptr;
  int64_t capacity = 0;
  float* scores = nullptr;
  int64_t score_pages = 0;
  // Active rows: all (first steps, dense and quest), else top active_k by query MSE, or those
  // above threshold when use_threshold.
  bool all_rows = true;
  int active_k = 4;
  bool use_threshold = false;
  double threshold = 0.0;
  bool force_first = false, force_last = true;
};

// The active rows of every batch entry (active, active_counts).
Status choose_rows(const StepArgs& a);
// QUEST over the active rows: page scores, the top `capacity` pages per (head, active row)
// (forced pages first), attention of each over its pages into o_p, l_p; q_ref of those rows = q.
Status sparse_prefix(const StepArgs& a);
// Plan counts zero (a dense step has no page plan).
Status clear_plan(const StepArgs& a);
// Every row: attention over the block's own keys merged with (o_p, l_p) into out, lse (an
// entry with an empty prefix takes the block's alone); with qref_all, q_ref = q for every row.
Status block_merge(const StepArgs& a, bool qref_all);

}  // namespace sparsa::losa_cuda
