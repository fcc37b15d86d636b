#include "sparsa/index.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "core/attention_params.h"
#include "core/validate.h"

namespace sparsa {

BlockIndex BlockIndexBuffer::view() const {
  BlockIndex ix;
  ix.block_q = block_q;
  ix.block_kv = block_kv;
  ix.num_q_blocks = num_q_blocks;
  ix.num_kv_blocks = num_kv_blocks;
  if (on_device()) {
    ix.counts = device_counts.view();
    ix.indices = device_indices.view();
    if (!device_perm_q.empty()) ix.perm_q = device_perm_q.view();
    if (!device_perm_kv.empty()) ix.perm_kv = device_perm_kv.view();
    return ix;
  }
  ix.counts = counts.view();
  ix.indices = indices.view();
  if (!perm_q.empty()) ix.perm_q = perm_q.view();
  if (!perm_kv.empty()) ix.perm_kv = perm_kv.view();
  return ix;
}

Result<BlockIndexBuffer> BlockIndexBuffer::to_host() const {
  if (!on_device()) return *this;
  BlockIndexBuffer h;
  h.block_q = block_q;
  h.block_kv = block_kv;
  h.num_q_blocks = num_q_blocks;
  h.num_kv_blocks = num_kv_blocks;
  std::pair<const DeviceArray*, HostArray*> parts[] = {
      {&device_counts, &h.counts}, {&device_indices, &h.indices}, {&device_perm_q, &h.perm_q}, {&device_perm_kv, &h.perm_kv}};
  for (auto [from, to] : parts) {
    if (from->empty()) continue;
    auto copy = from->to_host();
    if (!copy.ok()) return copy.status();
    *to = std::move(copy).value();
  }
  return h;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

BlockIndexBuffer BlockIndexBuffer::empty(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv,
                                         int block_q, int block_kv, int64_t capacity) {
  BlockIndexBuffer b;
  b.block_q = block_q;
  b.block_kv = block_kv;
  b.num_q_blocks = ceil_div(len_q, block_q);
  b.num_kv_blocks = ceil_div(len_kv, block_kv);
  b.counts = HostArray(DType::i32, {batch, heads_q, b.num_q_blocks});
  b.indices = HostArray(DType::i32, {batch, heads_q, b.num_q_blocks, capacity});
  return b;
}

BlockIndexBuffer BlockIndexBuffer::from_rows(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv,
                                             int block_q, int block_kv, std::span<const int32_t> counts,
                                             const int32_t* blocks, int64_t row_stride) {
  int64_t capacity = 0;
  for (int32_t c : counts) capacity = std::max<int64_t>(capacity, c);
  BlockIndexBuffer b = empty(batch, heads_q, len_q, len_kv, block_q, block_kv, capacity);
  for (size_t r = 0; r < counts.size(); ++r) {
    b.counts.ptr<int32_t>()[r] = counts[r];
    std::copy(blocks + r * row_stride, blocks + r * row_stride + counts[r], b.indices.ptr<int32_t>() + r * capacity);
  }
  return b;
}

BlockIndexBuffer BlockIndexBuffer::full(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv,
                                        int block_q, int block_kv) {
  const int64_t nkv = ceil_div(len_kv, block_kv);
  BlockIndexBuffer b = empty(batch, heads_q, len_q, len_kv, block_q, block_kv, nkv);
  int32_t* counts = b.counts.ptr<int32_t>();
  int32_t* indices = b.indices.ptr<int32_t>();
  const int64_t rows = batch * heads_q * b.num_q_blocks;
  for (int64_t r = 0; r < rows; ++r) {
    counts[r] = static_cast<int32_t>(nkv);
    for (int64_t j = 0; j < nkv; ++j) indices[r * nkv + j] = static_cast<int32_t>(j);
  }
  return b;
}

namespace {

Status check_permutation(const char* name, const Tensor& perm, int64_t batch, int64_t heads, int64_t len) {
  SPARSA_RETURN_IF_ERROR(detail::check_shape(name, perm, {batch, heads, len}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype(name, perm, DType::i32));
  if (!(perm.device == Device{})) return invalid_argument(std::string(name) + ": expected a tensor on cpu");
  std::vector<char> seen(static_cast<size_t>(len));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t p = 0; p < len; ++p) {
        const int32_t t = perm.ptr<const int32_t>()[perm.offset({b, h, p})];
        if (t < 0 || t >= len || seen[t]) return detail::permutation_error(name, b, h, len, p, t);
        seen[t] = 1;
      }
    }
  }
  return {};
}

}  // namespace

Status validate_block_index(const BlockIndex& ix, int64_t batch, int64_t heads_q, int64_t heads_kv,
                            int64_t len_q, int64_t len_kv) {
  if (ix.block_q <= 0) return invalid_argument("index.block_q: expected > 0, got " + std::to_string(ix.block_q));
  if (ix.block_kv <= 0) {
    return invalid_argument("index.block_kv: expected > 0, got " + std::to_string(ix.block_kv));
  }
  const int64_t nq = ceil_div(len_q, ix.block_q), nkv = ceil_div(len_kv, ix.block_kv);
  if (ix.num_q_blocks != nq) {
    return invalid_argument("index.num_q_blocks: expected ceil(len_q / block_q) = " + std::to_string(nq) +
                            ", got " + std::to_string(ix.num_q_blocks));
  }
  if (ix.num_kv_blocks != nkv) {
    return invalid_argument("index.num_kv_blocks: expected ceil(len_kv / block_kv) = " + std::to_string(nkv) +
                            ", got " + std::to_string(ix.num_kv_blocks));
  }
  SPARSA_RETURN_IF_ERROR(detail::check_shape("index.counts", ix.counts, {batch, heads_q, nq}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("index.counts", ix.counts, DType::i32));
  if (ix.indices.ndim != 4 || ix.indices.shape[0] != batch || ix.indices.shape[1] != heads_q ||
      ix.indices.shape[2] != nq) {
    return invalid_argument("index.indices: expected shape [" + std::to_string(batch) + ", " +
                            std::to_string(heads_q) + ", " + std::to_string(nq) + ", capacity], got " +
                            ix.indices.shape_string());
  }
  if (ix.indices.data == nullptr && ix.indices.numel() > 0) {
    return invalid_argument("index.indices: is missing (null data)");
  }
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("index.indices", ix.indices, DType::i32));
  if (!(ix.counts.device == Device{}) || !(ix.indices.device == Device{})) {
    return invalid_argument("index: counts and indices must be on cpu for the cpu backends");
  }
  const int64_t capacity = ix.indices.shape[3];
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads_q; ++h) {
      for (int64_t qb = 0; qb < nq; ++qb) {
        const int32_t count = detail::index_count(ix, b, h, qb);
        if (count < 0 || count > capacity) return detail::index_count_error(b, h, qb, count, capacity);
        int32_t prev = -1;
        for (int64_t s = 0; s < count; ++s) {
          const int32_t kb = detail::index_block(ix, b, h, qb, s);
          if (kb < 0 || kb >= nkv) return detail::index_block_range_error(b, h, qb, s, kb, nkv);
          if (kb <= prev) return detail::index_block_order_error(b, h, qb, s, prev, kb);
          prev = kb;
        }
      }
    }
  }
  if (ix.perm_q.defined()) SPARSA_RETURN_IF_ERROR(check_permutation("index.perm_q", ix.perm_q, batch, heads_q, len_q));
  if (ix.perm_kv.defined()) {
    SPARSA_RETURN_IF_ERROR(check_permutation("index.perm_kv", ix.perm_kv, batch, heads_kv, len_kv));
  }
  return {};
}

double block_index_density(const BlockIndex& ix, int64_t len_q, int64_t len_kv) {
  if (!(ix.counts.device == Device{}) || (ix.indices.defined() && !(ix.indices.device == Device{}))) {
    return std::numeric_limits<double>::quiet_NaN();  // device memory: not readable here
  }
  const int64_t batch = ix.counts.shape[0], heads = ix.counts.shape[1];
  double pairs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t qb = 0; qb < ix.num_q_blocks; ++qb) {
        const int64_t rows = std::min<int64_t>(ix.block_q, len_q - qb * ix.block_q);
        const int32_t count = detail::index_count(ix, b, h, qb);
        for (int64_t s = 0; s < count; ++s) {
          const int64_t kb = detail::index_block(ix, b, h, qb, s);
          pairs += static_cast<double>(rows) * std::min<int64_t>(ix.block_kv, len_kv - kb * ix.block_kv);
        }
      }
    }
  }
  return pairs / (static_cast<double>(batch * heads) * len_q * len_kv);
}

}  // namespace sparsa
