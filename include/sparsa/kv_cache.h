// sparsa/kv_cache.h — the paged prefix KV cache of block-diffusion decoding.
//
// Block diffusion decodes a block of tokens in parallel against the keys and values of
// every committed (clean) token before it. That prefix only changes when a finished
// block is committed, so the cache is append-only. Tokens are grouped into pages of
// `page_size` consecutive tokens (16 by default, as in QUEST); page p holds tokens
// [p * page_size, (p + 1) * page_size), and the last page may be partial.
//
// Per page and kv head the cache keeps the element-wise minimum and maximum of the
// page's keys (QUEST's metadata) and their sum (for pooled page-mean scores). They are
// maintained on append: a commit that fills a partial page extends its min/max/sum.
//
// Storage is f32 [heads_kv, capacity, head_dim] for K and V; keys()/values() hand out
// [1, heads_kv, length, head_dim] views that stay valid until the next append.
// Batch is 1 (one sequence per cache), grouped-query attention is the caller's:
// any number of query heads that is a multiple of heads_kv may read it.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

struct KVCacheConfig {
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int page_size = 16;
};

class PagedKVCache {
 public:
  PagedKVCache() = default;
  // Validates the config ("heads_kv: expected >= 1, got 0").
  static Result<PagedKVCache> create(const KVCacheConfig& config);

  // Appends n tokens: k and v f32 [1, heads_kv, n, head_dim] (any strides, contiguous
  // last dimension), updating the min/max/sum of every page they touch.
  Status append(const Tensor& k, const Tensor& v);
  void reserve(int64_t tokens);

  const KVCacheConfig& config() const { return config_; }
  int64_t heads_kv() const { return config_.heads_kv; }
  int64_t head_dim() const { return config_.head_dim; }
  int page_size() const { return config_.page_size; }
  int64_t length() const { return length_; }
  int64_t num_pages() const { return (length_ + config_.page_size - 1) / config_.page_size; }
  // Tokens in page `page` (page_size except for a partial last page).
  int64_t page_length(int64_t page) const;

  // f32 [1, heads_kv, length, head_dim] views (undefined tensors while empty).
  Tensor keys() const;
  Tensor values() const;
  // Row pointers: [head_dim] f32.
  const float* key(int64_t h_kv, int64_t token) const { return k_.data() + (h_kv * capacity_ + token) * config_.head_dim; }
  const float* value(int64_t h_kv, int64_t token) const { return v_.data() + (h_kv * capacity_ + token) * config_.head_dim; }
  const float* page_min(int64_t h_kv, int64_t page) const { return meta(min_, h_kv, page); }
  const float* page_max(int64_t h_kv, int64_t page) const { return meta(max_, h_kv, page); }
  const float* page_key_sum(int64_t h_kv, int64_t page) const { return meta(sum_, h_kv, page); }

 private:
  const float* meta(const std::vector<float>& m, int64_t h_kv, int64_t page) const {
    return m.data() + (h_kv * page_capacity_ + page) * config_.head_dim;
  }
  void grow(int64_t tokens);

  KVCacheConfig config_{};
  int64_t length_ = 0;
  int64_t capacity_ = 0;       // tokens per head allocated
  int64_t page_capacity_ = 0;  // capacity_ / page_size
  std::vector<float> k_, v_;   // [heads_kv, capacity, head_dim]
  std::vector<float> min_, max_, sum_;  // [heads_kv, page_capacity, head_dim]
};

}  // namespace sparsa
