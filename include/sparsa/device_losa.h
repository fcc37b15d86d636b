// sparsa/device_losa.h — block-diffusion decoding on a CUDA device: the device paged KV cache
// and LoSA / QUEST / dense prefix attention over it, for a batch of sequences, with no host
// synchronisation inside a step (the semantics of sparsa/losa.h and sparsa/quest.h; the CPU
// classes there are the specification these are tested against).
//
// DevicePagedKVCache: one pool of pages (page_size tokens each; K and V in bf16 or f16 as
// [heads_kv, pool_pages * page_size, head_dim], per page and kv head the element-wise key
// minimum and maximum as [heads_kv, pool_pages, head_dim] in the same dtype, exact since they are
// keys). Each sequence owns a run of consecutive pages of the pool, reserved when it is added
// (first fit), so its prefix is one strided [1, heads_kv, length, head_dim] view that the dense
// executors read in place. append() writes tokens and recomputes, on the device, the min/max of
// every page it touches.
//
// DevicePrefixAttention: the per-layer state of LoSA (O_p, L_p, Q_ref per batch entry; see
// sparsa/losa.h) on the device. One step is a fixed sequence of kernel launches on the given
// stream: the active rows (query MSE against Q_ref, top-K or a threshold, chosen on the device),
// QUEST page scores and the top budget/page_size pages per (query head, active row), attention
// of the active rows over their own pages or, with attend_union, over the union of the pages
// their kv head's query heads chose (on a first step, for method dense, and for the active rows
// of method reuse, dense prefix attention through the split-KV executor), then intra-block
// attention of every row over
// the block's own keys merged with (O_p, L_p) by log-sum-exp. Stable rows' O_p, L_p and Q_ref are
// not touched. No step allocates once the state has seen the largest prefix (the page
// candidates' scratch grows with it), so a step can be captured in a CUDA graph and replayed while the prefix
// does not change (between commits).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sparsa/losa.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

struct DeviceKVCacheConfig {
  int64_t heads_kv = 0;
  int64_t head_dim = 0;      // 64 or 128
  int page_size = 16;        // 1 to 64
  DType dtype = DType::bf16; // bf16 or f16
  int64_t pool_pages = 0;    // pages in the pool, shared by every sequence
  int device = 0;            // the cuda device
  // The stream (a cudaStream_t) the pool is allocated, zeroed and freed on; null: the legacy
  // default stream. Give the stream the cache is used on: a non-blocking stream does not wait for
  // the legacy one, so a pool zeroed there could still be being zeroed when the first append runs.
  void* stream = nullptr;
};

class DevicePagedKVCache {
 public:
  DevicePagedKVCache() = default;
  // Validates the config and allocates the pool ("pool_pages: expected >= 1, got 0").
  static Result<DevicePagedKVCache> create(const DeviceKVCacheConfig& config);

  // A new empty sequence owning ceil(max_tokens / page_size) consecutive pages; a clear error
  // when the pool has no free run that long.
  Result<int> add_sequence(int64_t max_tokens);
  // Frees the sequence's pages; its id is not reused.
  Status remove_sequence(int seq);
  // Length 0; the sequence keeps its pages.
  Status reset(int seq);
  // Appends n tokens: k and v [1, heads_kv, n, head_dim] in the cache's dtype on its device (any
  // strides with a contiguous last dimension), ordered on `stream` (a cudaStream_t; null is the
  // legacy default stream); more tokens than the sequence's pages hold is an error before any
  // write.
  Status append(int seq, const Tensor& k, const Tensor& v, void* stream = nullptr);

  const DeviceKVCacheConfig& config() const { return config_; }
  Result<int64_t> length(int seq) const;
  Result<int64_t> capacity(int seq) const;  // tokens its pages hold
  int64_t free_pages() const;
  // [1, heads_kv, length, head_dim] views into the pool (undefined while empty).
  Result<Tensor> keys(int seq) const;
  Result<Tensor> values(int seq) const;
  // [1, heads_kv, num_pages, head_dim]: the pages' key minimum / maximum.
  Result<Tensor> page_min(int seq) const;
  Result<Tensor> page_max(int seq) const;

  // The pool: K, V [heads_kv, pool_pages * page_size, head_dim]; min, max [heads_kv, pool_pages,
  // head_dim].
  const DeviceArray& pool_keys() const { return k_; }
  const DeviceArray& pool_values() const { return v_; }
  const DeviceArray& pool_min() const { return min_; }
  const DeviceArray& pool_max() const { return max_; }

  // For the step: the sequence's first pool page and its length (no checks beyond the id).
  struct SequenceView {
    int64_t first_page = 0, pages = 0, length = 0;
  };
  Result<SequenceView> sequence(int seq) const;

 private:
  struct Sequence {
    int64_t first_page = 0, pages = 0, length = 0;
    bool live = false;
  };
  Result<Sequence*> find(int seq);
  Result<const Sequence*> find(int seq) const;
  Result<Tensor> view(int seq, const DeviceArray& pool, int64_t rows_per_head, bool per_page) const;

  DeviceKVCacheConfig config_{};
  DeviceArray k_, v_, min_, max_;
  std::vector<Sequence> sequences_;
};

inline constexpr int64_t kDeviceLosaMaxBatch = 64;  // the most sequences one DevicePrefixAttention steps

struct DeviceLosaConfig {
  int64_t batch = 1;       // sequences stepped together, 1 to kDeviceLosaMaxBatch
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;    // 64 or 128
  int64_t block_size = 16; // Bb, 1 to 64
};

class DevicePrefixAttention {
 public:
  DevicePrefixAttention() = default;
  // options: method dense, quest, losa or reuse; selector quest, group per_head; attend_union as
  // on the CPU (each active row over its kv head's union of pages);
  // options.attention.backend cuda (the others are the CPU's). The state lives on `device`.
  // `stream` (a cudaStream_t; null: the legacy default stream): the state's arrays are allocated,
  // zeroed and freed there; give the stream the steps run on (DeviceKVCacheConfig::stream says why).
  static Result<DevicePrefixAttention> create(const DeviceLosaConfig& config, const LosaOptions& options,
                                              int device = 0, DType dtype = DType::bf16, void* stream = nullptr);

  // One denoising step of the current block for every batch entry i, whose prefix is sequence
  // seqs[i] of `cache`. q [batch, heads_q, Bb, d]; k_block, v_block [batch, heads_kv, Bb, d] (the
  // blocks' own keys and values this step); out [batch, heads_q, Bb, d] (q's dtype) and lse f32
  // [batch, heads_q, Bb]: prefix + block. All on the state's device, in its dtype (lse f32).
  // Each entry keeps its own place in its block: an entry on its block's first step takes LoSA's
  // dense step while the others take sparse ones (a run of entries in one phase is one launch
  // sequence).
  Status step(const DevicePagedKVCache& cache, const std::vector<int>& seqs, const Tensor& q, const Tensor& k_block,
              const Tensor& v_block, const Tensor& out, const Tensor& lse, void* stream = nullptr);
  // The step of entries [first, first + seqs.size()) alone (requests of a batch that do not all
  // step together: the others' state is untouched): the tensors hold those entries only
  // ([seqs.size(), heads, Bb, d]). step() is step_entries(0, ...) over the whole batch.
  Status step_entries(int64_t first, const DevicePagedKVCache& cache, const std::vector<int>& seqs, const Tensor& q,
                      const Tensor& k_block, const Tensor& v_block, const Tensor& out, const Tensor& lse,
                      void* stream = nullptr);
  // Appends every entry's finished block (k_block, v_block [batch, heads_kv, Bb, d]) to its
  // sequence and makes every entry's next step a first step.
  Status commit(DevicePagedKVCache& cache, const std::vector<int>& seqs, const Tensor& k_block, const Tensor& v_block,
                void* stream = nullptr);
  // The next step of every entry, or of one, is its block's first.
  void begin_block();
  void begin_block(int64_t entry);

  const DeviceLosaConfig& config() const { return config_; }
  const LosaOptions& options() const { return options_; }
  // Steps taken in its current block by entry `entry` (0 for an entry outside the batch).
  int64_t steps_in_block(int64_t entry = 0) const;
  // The device state (after a block's first step): O_p [batch, heads_q, Bb, d] (q's dtype), L_p
  // f32 [batch, heads_q, Bb], Q_ref like O_p; the last step's active rows i32 [batch, Bb]
  // (ascending, the first active_counts[b] valid) and counts i32 [batch]; its page plan i32
  // [batch, heads_q, Bb, capacity] over the active slots (the slot's row is active_rows[b][slot])
  // with counts i32 [batch, heads_q, Bb] (0 for unused slots and on dense steps).
  const DeviceArray& o_p() const { return o_p_; }
  const DeviceArray& l_p() const { return l_p_; }
  const DeviceArray& q_ref() const { return q_ref_; }
  const DeviceArray& active_rows() const { return active_; }
  const DeviceArray& active_counts() const { return active_counts_; }
  const DeviceArray& plan_pages() const { return plan_pages_; }
  const DeviceArray& plan_counts() const { return plan_counts_; }
  int64_t plan_capacity() const { return capacity_; }

 private:
  DeviceLosaConfig config_{};
  LosaOptions options_{};
  int device_ = 0;
  DType dtype_ = DType::bf16;
  // The launches of entries [first, first + count), all on a first step or all not (tensors and
  // seqs of those entries alone).
  Status run_entries(int64_t first, int64_t count, bool first_step, const DevicePagedKVCache& cache,
                     const std::vector<int>& seqs, const Tensor& q, const Tensor& k_block, const Tensor& v_block,
                     const Tensor& out, const Tensor& lse, void* stream);

  std::vector<int64_t> steps_in_block_;  // per entry
  int64_t capacity_ = 0;  // budget / page_size
  DeviceArray o_p_, l_p_, q_ref_, active_, active_counts_, plan_pages_, plan_counts_;
  DeviceArray mse_;         // f64 [batch, Bb] as i32 pairs: the rows' query change
  DeviceArray o_new_, l_new_;  // reuse: every row's dense prefix [batch, heads_q, Bb, d], [batch, heads_q, Bb]
  DeviceArray candidates_;  // u64 keys as i32 pairs [batch, heads_q, Bb, tiles, tile keep], grown with the prefix
  int64_t candidate_tiles_ = 0;
};

}  // namespace sparsa
