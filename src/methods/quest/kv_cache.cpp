// The paged prefix KV cache (sparsa/kv_cache.h).
#include "sparsa/kv_cache.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/attention_params.h"
#include "core/validate.h"

namespace sparsa {

Result<PagedKVCache> PagedKVCache::create(const KVCacheConfig& config) {
  if (config.heads_kv < 1) return invalid_argument("heads_kv: expected >= 1, got " + std::to_string(config.heads_kv));
  if (config.head_dim < 1 || config.head_dim > 1024) {
    return invalid_argument("head_dim: expected 1 to 1024, got " + std::to_string(config.head_dim));
  }
  if (config.page_size < 1 || config.page_size > 4096) {
    return invalid_argument("page_size: expected 1 to 4096 tokens, got " + std::to_string(config.page_size));
  }
  PagedKVCache cache;
  cache.config_ = config;
  return cache;
}

int64_t PagedKVCache::page_length(int64_t page) const {
  const int64_t begin = page * config_.page_size;
  return std::clamp<int64_t>(length_ - begin, 0, config_.page_size);
}

void PagedKVCache::reserve(int64_t tokens) {
  if (tokens > capacity_) grow(tokens);
}

// Re-lays out storage for at least `tokens` tokens per head (capacity rounded up to
// whole pages, at least doubling so appends are amortised O(1)).
void PagedKVCache::grow(int64_t tokens) {
  const int64_t P = config_.page_size, H = config_.heads_kv, D = config_.head_dim;
  int64_t capacity = std::max<int64_t>({tokens, 2 * capacity_, P});
  capacity = (capacity + P - 1) / P * P;
  const int64_t page_capacity = capacity / P;
  std::vector<float> k(H * capacity * D), v(H * capacity * D);
  std::vector<float> mn(H * page_capacity * D), mx(H * page_capacity * D), sm(H * page_capacity * D);
  for (int64_t h = 0; h < H; ++h) {
    std::copy_n(k_.data() + h * capacity_ * D, length_ * D, k.data() + h * capacity * D);
    std::copy_n(v_.data() + h * capacity_ * D, length_ * D, v.data() + h * capacity * D);
    const int64_t pages = num_pages();
    std::copy_n(min_.data() + h * page_capacity_ * D, pages * D, mn.data() + h * page_capacity * D);
    std::copy_n(max_.data() + h * page_capacity_ * D, pages * D, mx.data() + h * page_capacity * D);
    std::copy_n(sum_.data() + h * page_capacity_ * D, pages * D, sm.data() + h * page_capacity * D);
  }
  k_.swap(k);
  v_.swap(v);
  min_.swap(mn);
  max_.swap(mx);
  sum_.swap(sm);
  capacity_ = capacity;
  page_capacity_ = page_capacity;
}

Status PagedKVCache::append(const Tensor& k, const Tensor& v) {
  if (config_.heads_kv < 1) return invalid_argument("cache: not created (use PagedKVCache::create)");
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor("k", k, Device{}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("k", k, DType::f32));
  const int64_t H = config_.heads_kv, D = config_.head_dim, n = k.shape[2];
  SPARSA_RETURN_IF_ERROR(detail::check_shape("k", k, {1, H, n, D}));
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor("v", v, Device{}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("v", v, DType::f32));
  SPARSA_RETURN_IF_ERROR(detail::check_shape("v", v, {1, H, n, D}));
  if (length_ + n > capacity_) grow(length_ + n);

  const int64_t P = config_.page_size;
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t token = length_ + i;
      float* kd = k_.data() + (h * capacity_ + token) * D;
      float* vd = v_.data() + (h * capacity_ + token) * D;
      detail::load_row(k.data, DType::f32, k.offset({0, h, i, 0}), D, kd);
      detail::load_row(v.data, DType::f32, v.offset({0, h, i, 0}), D, vd);
      const int64_t page = token / P;
      float* mn = min_.data() + (h * page_capacity_ + page) * D;
      float* mx = max_.data() + (h * page_capacity_ + page) * D;
      float* sm = sum_.data() + (h * page_capacity_ + page) * D;
      if (token % P == 0) {  // first token of a fresh page
        std::copy_n(kd, D, mn);
        std::copy_n(kd, D, mx);
        std::copy_n(kd, D, sm);
        continue;
      }
      for (int64_t t = 0; t < D; ++t) {
        mn[t] = std::min(mn[t], kd[t]);
        mx[t] = std::max(mx[t], kd[t]);
        sm[t] += kd[t];
      }
    }
  }
  length_ += n;
  return {};
}

Tensor PagedKVCache::keys() const {
  if (length_ == 0) return {};
  Tensor t = Tensor::contiguous(const_cast<float*>(k_.data()), DType::f32, {1, config_.heads_kv, length_, config_.head_dim});
  t.strides[0] = config_.heads_kv * capacity_ * config_.head_dim;
  t.strides[1] = capacity_ * config_.head_dim;
  return t;
}

Tensor PagedKVCache::values() const {
  if (length_ == 0) return {};
  Tensor t = Tensor::contiguous(const_cast<float*>(v_.data()), DType::f32, {1, config_.heads_kv, length_, config_.head_dim});
  t.strides[0] = config_.heads_kv * capacity_ * config_.head_dim;
  t.strides[1] = capacity_ * config_.head_dim;
  return t;
}

}  // namespace sparsa
