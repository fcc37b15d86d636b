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
// Pages scored per CTA; each keeps at most its tile_keep best pages as the row's candidates.
constexpr int kTilePages = 128;
inline int64_t tile_keep(int64_t capacity) { return capacity < kTilePages ? capacity : kTilePages; }
inline int64_t candidate_tiles(int64_t pages) { return (pages + kTilePages - 1) / kTilePages; }

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
  // i32 [batch, heads_q, block, capacity], plan counts [batch, heads_q, block].
  void* o_p = nullptr;
  float* l_p = nullptr;
  void* q_ref = nullptr;
  int32_t* active = nullptr;
  int32_t* active_counts = nullptr;
  int32_t* plan_pages = nullptr;
  int32_t* plan_counts = nullptr;
  int64_t capacity = 0;
  // Scratch of sparse steps: each page tile's best pages per (entry, head, slot), as 64-bit
  // order keys [batch, heads_q, block, candidate_tiles, tile_keep(capacity)]; the rows' query
  // mse, f64 [batch, block].
  uint64_t* candidates = nullptr;
  int64_t candidate_tiles = 0;
  double* mse = nullptr;
  // Active rows: all (first steps, dense and quest), else top active_k by query MSE, or those
  // above threshold when use_threshold.
  bool all_rows = true;
  int active_k = 4;
  bool use_threshold = false;
  double threshold = 0.0;
  bool force_first = false, force_last = true;
  // Sparse steps: each active row attends over the union of the pages its kv head's query heads
  // chose at the entry's active rows (LosaOptions::attend_union), not its own pages alone.
  bool attend_union = false;
};

// Whether a sparse step over a longest prefix of max_pages pages at `capacity` pages a row fits
// the device: its selection's shared memory grows with the prefix. Checked before any launch.
Status sparse_step_fits(DType dtype, int64_t head_dim, int64_t max_pages, int64_t capacity, bool attend_union,
                        int device);
// A dense step's first launches: every row active (active, active_counts), plan counts zero.
Status dense_rows(const StepArgs& a);
// A sparse step, whole (three launches): the active rows (LoSA's query mse against q_ref, top-K
// or threshold; all rows when a.all_rows), QUEST's top `capacity` pages per (head, active row)
// (forced pages first), attention of each over its pages into o_p, l_p (q_ref of those rows =
// q), and every row's attention over the block's own keys merged with (o_p, l_p) into out, lse.
Status sparse_step(const StepArgs& a);
// The reuse method's later steps, first launches: LoSA's active rows (query mse against q_ref,
// top-K or threshold) into active, active_counts; plan counts zero.
Status reuse_rows(const StepArgs& a);
// Then, once o_new, l_new ([batch, heads_q, block, head_dim] in the pool dtype, f32 [batch,
// heads_q, block], contiguous) hold every row's dense prefix attention: the active rows' o_p, l_p
// from them and q_ref = q (stable rows untouched).
Status adopt_rows(const StepArgs& a, const void* o_new, const float* l_new);
// A dense or reuse step's last launch, after o_p and l_p are written: every row's attention over
// the block's own keys merged with (o_p, l_p) into out, lse (an entry with an empty prefix takes
// the block's alone); with qref_all (dense steps), q_ref = q for every row.
Status block_merge(const StepArgs& a, bool qref_all);

}  // namespace sparsa::losa_cuda
