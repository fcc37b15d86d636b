#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace sparsa::detail {

std::string shape_string(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  bool first = true;
  for (int64_t x : shape) {
    if (!first) s += ", ";
    s += std::to_string(x);
    first = false;
  }
  return s + "]";
}

Status check_attention_tensor(const char* name, const Tensor& t, Device device) {
  static const char* kDimNames[] = {"batch", "heads", "seq", "head_dim"};
  const std::string n = name;
  if (t.data == nullptr) return invalid_argument(n + ": is missing (null data)");
  if (t.ndim != 4) {
    return invalid_argument(n + ": expected 4 dimensions [batch, heads, seq, head_dim], got " +
                            std::to_string(t.ndim) + " " + t.shape_string());
  }
  if (t.dtype != DType::f32 && t.dtype != DType::f16 && t.dtype != DType::bf16) {
    return unsupported_dtype(n + ": expected dtype f32, f16 or bf16, got " + dtype_name(t.dtype));
  }
  if (!(t.device == device)) {
    return invalid_argument(n + ": expected a tensor on " + device_name(device) + ", got " +
                            device_name(t.device));
  }
  for (int d = 0; d < 4; ++d) {
    if (t.shape[d] <= 0) {
      return invalid_argument(n + ": " + kDimNames[d] + " (dim " + std::to_string(d) + ") is " +
                              std::to_string(t.shape[d]) + "; empty " + kDimNames[d] +
                              " is not accepted, shape " + t.shape_string());
    }
    if (t.strides[d] < 0) {
      return invalid_argument(n + ": negative stride " + std::to_string(t.strides[d]) + " in dim " +
                              std::to_string(d) + " is not supported");
    }
  }
  if (t.strides[3] != 1 && t.shape[3] != 1) {
    return invalid_argument(n + ": the last dimension (head_dim) must be contiguous (stride 1), got stride " +
                            std::to_string(t.strides[3]));
  }
  if (t.shape[3] > 1024) {
    return invalid_argument(n + ": head_dim " + std::to_string(t.shape[3]) + " exceeds the maximum 1024");
  }
  return {};
}

Status check_query_key(const Tensor& q, const Tensor& k, Device device) {
  SPARSA_RETURN_IF_ERROR(check_attention_tensor("q", q, device));
  SPARSA_RETURN_IF_ERROR(check_attention_tensor("k", k, device));
  if (k.dtype != q.dtype) {
    return unsupported_dtype(std::string("k: dtype ") + dtype_name(k.dtype) + " differs from q's " + dtype_name(q.dtype));
  }
  if (k.shape[0] != q.shape[0]) {
    return invalid_argument("k: batch " + std::to_string(k.shape[0]) + " differs from q's batch " +
                            std::to_string(q.shape[0]));
  }
  if (k.shape[3] != q.shape[3]) {
    return invalid_argument("k: head_dim " + std::to_string(k.shape[3]) + " differs from q's head_dim " +
                            std::to_string(q.shape[3]));
  }
  if (q.shape[1] % k.shape[1] != 0) {
    return invalid_argument("k: heads_q (" + std::to_string(q.shape[1]) + ") must be a multiple of heads_kv (" +
                            std::to_string(k.shape[1]) + ") for grouped-query attention");
  }
  return {};
}

Status check_shape(const char* name, const Tensor& t, std::initializer_list<int64_t> shape) {
  bool same = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) {
    if (!same) break;
    same = t.shape[d++] == s;
  }
  if (t.data == nullptr) return invalid_argument(std::string(name) + ": is missing (null data)");
  if (!same) {
    return invalid_argument(std::string(name) + ": expected shape " + shape_string(shape) + ", got " +
                            t.shape_string());
  }
  for (int i = 0; i < t.ndim; ++i) {
    if (t.strides[i] < 0) {
      return invalid_argument(std::string(name) + ": negative stride in dim " + std::to_string(i) +
                              " is not supported");
    }
  }
  return {};
}

Status check_dtype(const char* name, const Tensor& t, DType dtype) {
  if (t.dtype != dtype) {
    return unsupported_dtype(std::string(name) + ": expected dtype " + dtype_name(dtype) + ", got " +
                             dtype_name(t.dtype));
  }
  return {};
}

Status check_no_self_overlap(const char* name, const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of dimensions longer than 1
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return {};  // no element at all
    if (t.shape[d] > 1) dims.emplace_back(t.strides[d] < 0 ? -t.strides[d] : t.strides[d], t.shape[d]);
  }
  std::sort(dims.begin(), dims.end());
  std::string strides = "(";
  for (int d = 0; d < t.ndim; ++d) strides += (d ? ", " : "") + std::to_string(t.strides[d]);
  strides += ")";
  int64_t span = 1;  // elements covered by the dimensions so far
  for (auto [stride, size] : dims) {
    if (stride < span) {
      return invalid_argument(std::string(name) + ": its elements overlap (strides " + strides +
                              " over shape " + t.shape_string() + "; a stride of " + std::to_string(stride) +
                              " repeats addresses): expected a writable view whose elements are distinct");
    }
    span = stride * (size - 1) + span;
  }
  return {};
}

namespace {
// [first, last] byte addresses a tensor's elements occupy; false when it has no element.
bool byte_range(const Tensor& t, uintptr_t* first, uintptr_t* last) {
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return false;
    const int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  *first = base + static_cast<uintptr_t>(lo * elem);
  *last = base + static_cast<uintptr_t>(hi * elem + elem - 1);
  return true;
}
}  // namespace

Status check_disjoint(const char* name, const Tensor& t, const char* other_name, const Tensor& other) {
  uintptr_t a0 = 0, a1 = 0, b0 = 0, b1 = 0;
  if (t.data == nullptr || other.data == nullptr || !(t.device == other.device)) return {};
  if (!byte_range(t, &a0, &a1) || !byte_range(other, &b0, &b1)) return {};
  if (a0 <= b1 && b0 <= a1) {
    return invalid_argument(std::string(name) + ": shares memory with " + other_name +
                            " (both are outputs; one would overwrite the other): expected separate arrays");
  }
  return {};
}

Status check_outputs(const char* out_name, const Tensor& out, const char* lse_name, const Tensor& lse) {
  SPARSA_RETURN_IF_ERROR(check_no_self_overlap(out_name, out));
  SPARSA_RETURN_IF_ERROR(check_no_self_overlap(lse_name, lse));
  return check_disjoint(lse_name, lse, out_name, out);
}

Status check_finite(const char* name, const Tensor& t) {
  if (t.dtype == DType::i32) return {};
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double x = load_as_double(t, i);
    if (!std::isfinite(x)) {
      std::string where;
      int64_t rem = i;
      std::vector<int64_t> idx(t.ndim);
      for (int d = t.ndim - 1; d >= 0; --d) {
        idx[d] = rem % t.shape[d];
        rem /= t.shape[d];
      }
      for (int d = 0; d < t.ndim; ++d) where += (d ? ", " : "") + std::to_string(idx[d]);
      return {StatusCode::non_finite, std::string(name) + ": contains " + (std::isnan(x) ? "NaN" : "Inf") +
                                          " at [" + where + "] (check_finite)"};
    }
  }
  return {};
}

namespace {
std::string index_row(int64_t b, int64_t h, int64_t qb) {
  return "[" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(qb);
}
}  // namespace

Status index_count_error(int64_t b, int64_t h, int64_t qb, int32_t count, int64_t capacity) {
  return invalid_argument("index.counts" + index_row(b, h, qb) + "]: " + std::to_string(count) +
                          " is outside [0, capacity = " + std::to_string(capacity) + "]");
}

Status index_block_range_error(int64_t b, int64_t h, int64_t qb, int64_t s, int32_t block, int64_t num_kv_blocks) {
  return invalid_argument("index.indices" + index_row(b, h, qb) + ", " + std::to_string(s) + "]: key block " +
                          std::to_string(block) + " is outside [0, num_kv_blocks = " + std::to_string(num_kv_blocks) +
                          ")");
}

Status index_block_order_error(int64_t b, int64_t h, int64_t qb, int64_t s, int32_t prev, int32_t block) {
  return invalid_argument("index.indices" + index_row(b, h, qb) + ", " + std::to_string(s) +
                          "]: key blocks must be strictly ascending, got " + std::to_string(prev) + " then " +
                          std::to_string(block));
}

Status permutation_error(const char* name, int64_t b, int64_t h, int64_t len, int64_t p, int32_t t) {
  return invalid_argument(std::string(name) + ": row [" + std::to_string(b) + ", " + std::to_string(h) +
                          "] is not a permutation of 0.." + std::to_string(len - 1) + " (entry " + std::to_string(p) +
                          " is " + std::to_string(t) + (t >= 0 && t < len ? ", repeated)" : ", out of range)"));
}

}  // namespace sparsa::detail
