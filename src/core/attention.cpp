// Public entry points of the executors: validate, fill the params struct, dispatch
// to one backend (the one dispatch place).
#include "sparsa/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/backends.h"
#include "core/validate.h"

namespace sparsa {

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::cpu_ref: return "cpu_ref";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "?";
}

Result<Backend> parse_backend(const std::string& name) {
  if (name == "cpu_ref") return Backend::cpu_ref;
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  return invalid_argument("backend: expected cpu_ref, cpu or cuda, got '" + name + "'");
}

bool backend_available(Backend backend) { return backend_status(backend).ok(); }

Status backend_status(Backend backend) {
  if (backend != Backend::cuda) return {};
  if (!cuda::compiled_in()) {
    return {StatusCode::unsupported,
            "backend: 'cuda' is not compiled into this build (configure with -DSPARSA_CUDA=ON on a machine with nvcc)"};
  }
  if (cuda::device_count() == 0) {
    return {StatusCode::unsupported, "backend: 'cuda' is compiled into this build, but no CUDA device is visible"};
  }
  return {};
}

namespace {

using detail::AttentionParams;
using detail::check_attention_tensor;
using detail::check_dtype;
using detail::check_shape;

Status check_backend(Backend backend) { return backend_status(backend); }

Status build_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, const AttentionOptions& options, AttentionParams* p) {
  SPARSA_RETURN_IF_ERROR(check_backend(options.backend));
  // cpu backends: every tensor on the host; cuda: every tensor on q's CUDA device.
  const bool on_gpu = options.backend == Backend::cuda;
  const Device host = on_gpu ? q.device : Device{};
  if (on_gpu && q.device.type != DeviceType::cuda && q.data != nullptr) {
    return invalid_argument("q: the cuda backend expected a tensor on a cuda device, got " + device_name(q.device));
  }
  SPARSA_RETURN_IF_ERROR(detail::check_query_key(q, k, host));
  SPARSA_RETURN_IF_ERROR(check_attention_tensor("v", v, host));
  if (v.dtype != q.dtype) {
    return unsupported_dtype(std::string("v: dtype ") + dtype_name(v.dtype) + " differs from q's " +
                             dtype_name(q.dtype));
  }
  const int64_t batch = q.shape[0], heads_q = q.shape[1], len_q = q.shape[2], head_dim = q.shape[3];
  const int64_t heads_kv = k.shape[1], len_kv = k.shape[2];
  if (v.shape[0] != batch || v.shape[1] != heads_kv || v.shape[2] != len_kv || v.shape[3] != head_dim) {
    return invalid_argument("v: expected shape " +
                            detail::shape_string({batch, heads_kv, len_kv, head_dim}) + " (as k), got " +
                            v.shape_string());
  }
  SPARSA_RETURN_IF_ERROR(check_shape("out", out, {batch, heads_q, len_q, head_dim}));
  SPARSA_RETURN_IF_ERROR(check_dtype("out", out, q.dtype));
  if (out.strides[3] != 1) return invalid_argument("out: the last dimension must be contiguous (stride 1)");
  SPARSA_RETURN_IF_ERROR(check_shape("lse", lse, {batch, heads_q, len_q}));
  SPARSA_RETURN_IF_ERROR(check_dtype("lse", lse, DType::f32));
  if (!(out.device == host)) {
    return invalid_argument("out: expected a tensor on " + device_name(host) + ", got " + device_name(out.device));
  }
  if (!(lse.device == host)) {
    return invalid_argument("lse: expected a tensor on " + device_name(host) + ", got " + device_name(lse.device));
  }
  SPARSA_RETURN_IF_ERROR(detail::check_outputs("out", out, "lse", lse));
  const float scale = options.scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return invalid_argument("scale: expected a finite positive number, got " + std::to_string(scale));
  }
  if (options.num_threads < 0 || options.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(options.num_threads));
  }
  SPARSA_RETURN_IF_ERROR(validate_mask(options.mask, "mask"));
  if (options.check_finite && on_gpu) {
    return {StatusCode::unsupported, "check_finite: not available on the cuda backend (scan on the host first)"};
  }
  if (options.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k", k));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("v", v));
  }
  p->q = q.data;
  p->k = k.data;
  p->v = v.data;
  p->dtype = q.dtype;
  for (int d = 0; d < 3; ++d) {
    p->q_stride[d] = q.strides[d];
    p->k_stride[d] = k.strides[d];
    p->v_stride[d] = v.strides[d];
    p->out_stride[d] = out.strides[d];
  }
  p->out = out.data;
  p->lse = static_cast<float*>(lse.data);
  p->lse_stride[0] = lse.strides[0];
  p->lse_stride[1] = lse.strides[1];
  p->lse_seq_stride = lse.strides[2];
  p->batch = batch;
  p->heads_q = heads_q;
  p->heads_kv = heads_kv;
  p->len_q = len_q;
  p->len_kv = len_kv;
  p->head_dim = head_dim;
  p->scale = scale;
  p->num_threads = options.num_threads;
  p->device_id = host.id;
  p->stream = options.stream;
  p->mask = options.mask;
  return {};
}

Status run(const AttentionParams& p, Backend backend) {
  switch (backend) {
    case Backend::cpu_ref: return cpu_ref::attention(p);
    case Backend::cpu: return cpu::attention(p);
    case Backend::cuda: return cuda::attention(p);
  }
  return check_backend(backend);
}

// The cuda backend's plan check: shapes, dtypes and devices on the host. The index contents
// stay on the device, where the backend checks them (src/cuda/attention/index_check.cu) unless
// options.check_index is false; the kernels also guard them (counts clamped, out-of-range blocks
// and permutation entries skipped), so even an unchecked malformed plan cannot read or write out
// of bounds.
Status check_device_index(const BlockIndex& ix, const AttentionParams& p, Device device) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  if (ix.block_q <= 0) return invalid_argument("index.block_q: expected > 0, got " + std::to_string(ix.block_q));
  if (ix.block_kv <= 0) return invalid_argument("index.block_kv: expected > 0, got " + std::to_string(ix.block_kv));
  const int64_t nq = ceil_div(p.len_q, ix.block_q), nkv = ceil_div(p.len_kv, ix.block_kv);
  if (ix.num_q_blocks != nq) {
    return invalid_argument("index.num_q_blocks: expected ceil(len_q / block_q) = " + std::to_string(nq) +
                            ", got " + std::to_string(ix.num_q_blocks));
  }
  if (ix.num_kv_blocks != nkv) {
    return invalid_argument("index.num_kv_blocks: expected ceil(len_kv / block_kv) = " + std::to_string(nkv) +
                            ", got " + std::to_string(ix.num_kv_blocks));
  }
  SPARSA_RETURN_IF_ERROR(check_shape("index.counts", ix.counts, {p.batch, p.heads_q, nq}));
  SPARSA_RETURN_IF_ERROR(check_dtype("index.counts", ix.counts, DType::i32));
  if (ix.indices.ndim != 4 || ix.indices.shape[0] != p.batch || ix.indices.shape[1] != p.heads_q ||
      ix.indices.shape[2] != nq || ix.indices.shape[3] < 0) {
    return invalid_argument("index.indices: expected shape [" + std::to_string(p.batch) + ", " +
                            std::to_string(p.heads_q) + ", " + std::to_string(nq) + ", capacity], got " +
                            ix.indices.shape_string());
  }
  SPARSA_RETURN_IF_ERROR(check_dtype("index.indices", ix.indices, DType::i32));
  std::pair<const char*, const Tensor*> parts[] = {{"index.counts", &ix.counts}, {"index.indices", &ix.indices},
                                                   {"index.perm_q", &ix.perm_q}, {"index.perm_kv", &ix.perm_kv}};
  for (auto [name, t] : parts) {
    if (!t->defined()) continue;
    if (t->data == nullptr && t->numel() > 0) return invalid_argument(std::string(name) + ": is missing (null data)");
    if (!(t->device == device)) {
      return invalid_argument(std::string(name) + ": expected a tensor on " + device_name(device) + ", got " +
                              device_name(t->device));
    }
    for (int d = 0; d < t->ndim; ++d) {
      if (t->strides[d] < 0) {
        return invalid_argument(std::string(name) + ": negative stride " + std::to_string(t->strides[d]) +
                                " in dim " + std::to_string(d) + " is not supported");
      }
    }
  }
  if (ix.perm_q.defined()) {
    SPARSA_RETURN_IF_ERROR(check_shape("index.perm_q", ix.perm_q, {p.batch, p.heads_q, p.len_q}));
    SPARSA_RETURN_IF_ERROR(check_dtype("index.perm_q", ix.perm_q, DType::i32));
  }
  if (ix.perm_kv.defined()) {
    SPARSA_RETURN_IF_ERROR(check_shape("index.perm_kv", ix.perm_kv, {p.batch, p.heads_kv, p.len_kv}));
    SPARSA_RETURN_IF_ERROR(check_dtype("index.perm_kv", ix.perm_kv, DType::i32));
  }
  return {};
}

// A varlen operand [total, heads, d] (or lse [heads, total]) as the [1, heads, total, d]
// ([1, heads, total]) view the fixed-length checks read; `rank` is the rank it must have.
Status varlen_view(const char* name, const Tensor& t, int rank, const char* dims, Tensor* view) {
  if (t.data == nullptr && t.ndim == 0) return invalid_argument(std::string(name) + ": is missing (null data)");
  if (t.ndim != rank) {
    return invalid_argument(std::string(name) + ": expected " + std::to_string(rank) + " dimensions " + dims +
                            " (variable-length batch), got " + std::to_string(t.ndim) + " " + t.shape_string());
  }
  *view = t;
  view->ndim = rank + 1;
  view->shape[0] = 1;
  view->strides[0] = 0;
  if (rank == 3) {  // [total, heads, d] -> [1, heads, total, d]
    view->shape[1] = t.shape[1];
    view->strides[1] = t.strides[1];
    view->shape[2] = t.shape[0];
    view->strides[2] = t.strides[0];
    view->shape[3] = t.shape[2];
    view->strides[3] = t.strides[2];
  } else {  // lse [heads, total] -> [1, heads, total]
    view->shape[1] = t.shape[0];
    view->strides[1] = t.strides[0];
    view->shape[2] = t.shape[1];
    view->strides[2] = t.strides[1];
  }
  return {};
}

// cu_seqlens: i32 [num_seqs + 1], contiguous, on `device`, and its values: starts at 0, never
// decreases, ends at `total` (the first dimension of `of`). Offsets in device memory are first
// read back (ordered on `stream`, which that synchronises) into *host_copy, which the checks and
// the call's per-sequence lengths then read.
Status check_cu_seqlens(const char* name, const Tensor& cu, int64_t total, const char* of, Device device,
                        void* stream, std::vector<int32_t>* host_copy) {
  const std::string n = name;
  if (cu.data == nullptr) return invalid_argument(n + ": is missing (null data)");
  if (cu.ndim != 1 || cu.shape[0] < 2) {
    return invalid_argument(n + ": expected a 1-d i32 tensor [num_seqs + 1] of at least 2 offsets, got " +
                            std::to_string(cu.ndim) + "-d " + cu.shape_string());
  }
  SPARSA_RETURN_IF_ERROR(check_dtype(name, cu, DType::i32));
  if (cu.strides[0] != 1) {
    return invalid_argument(n + ": expected a contiguous tensor (stride 1), got stride " + std::to_string(cu.strides[0]));
  }
  if (!(cu.device == device)) {
    return invalid_argument(n + ": expected a tensor on " + device_name(device) + ", got " + device_name(cu.device));
  }
  const int32_t* off = cu.ptr<const int32_t>();
  if (device.type == DeviceType::cuda) {
    host_copy->resize(static_cast<size_t>(cu.shape[0]));
    SPARSA_RETURN_IF_ERROR(
        cuda::copy_to_host(device.id, cu.data, host_copy->size() * sizeof(int32_t), host_copy->data(), stream));
    off = host_copy->data();
  }
  if (off[0] != 0) return invalid_argument(n + ": expected " + n + "[0] = 0, got " + std::to_string(off[0]));
  for (int64_t s = 1; s < cu.shape[0]; ++s) {
    if (off[s] < off[s - 1]) {
      return invalid_argument(n + ": offsets must not decrease, got " + n + "[" + std::to_string(s) + "] = " +
                              std::to_string(off[s]) + " after " + n + "[" + std::to_string(s - 1) + "] = " +
                              std::to_string(off[s - 1]));
    }
  }
  const int64_t last = cu.shape[0] - 1;
  if (off[last] != total) {
    return invalid_argument(n + ": the last offset " + n + "[" + std::to_string(last) + "] = " +
                            std::to_string(off[last]) + " must equal " + of + "'s first dimension " +
                            std::to_string(total));
  }
  return {};
}

// An i32 tensor in device memory read back (after the work queued on `stream`, which this
// synchronises) into *buffer; *view is the same tensor over the host copy (same shape and strides).
Status read_back_i32(const Tensor& t, void* stream, std::vector<int32_t>* buffer, Tensor* view) {
  *view = t;
  view->device = Device{};
  if (t.numel() == 0) return {};
  int64_t lo = 0, hi = 0;  // element offsets of the lowest and highest element
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  buffer->resize(static_cast<size_t>(hi - lo + 1));
  SPARSA_RETURN_IF_ERROR(cuda::copy_to_host(t.device.id, static_cast<const int32_t*>(t.data) + lo,
                                            buffer->size() * sizeof(int32_t), buffer->data(), stream));
  view->data = buffer->data() - lo;
  return {};
}

// The params of a variable-length call: the [1, heads, total, d] views through build_params, then
// batch = number of sequences, zero batch strides, the offsets, and the longest lengths.
Status build_varlen_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_kv,
                           const Tensor& out, const Tensor& lse, const AttentionOptions& options, AttentionParams* p) {
  Tensor q4, k4, v4, out4, lse3;
  SPARSA_RETURN_IF_ERROR(varlen_view("q", q, 3, "[total_q, heads_q, head_dim]", &q4));
  SPARSA_RETURN_IF_ERROR(varlen_view("k", k, 3, "[total_kv, heads_kv, head_dim]", &k4));
  SPARSA_RETURN_IF_ERROR(varlen_view("v", v, 3, "[total_kv, heads_kv, head_dim]", &v4));
  SPARSA_RETURN_IF_ERROR(varlen_view("out", out, 3, "[total_q, heads_q, head_dim]", &out4));
  SPARSA_RETURN_IF_ERROR(varlen_view("lse", lse, 2, "[heads_q, total_q]", &lse3));
  SPARSA_RETURN_IF_ERROR(build_params(q4, k4, v4, out4, lse3, options, p));
  const Device device = options.backend == Backend::cuda ? q.device : Device{};
  SPARSA_RETURN_IF_ERROR(
      check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], "q", device, options.stream, &p->host_cu_seqlens_q));
  SPARSA_RETURN_IF_ERROR(
      check_cu_seqlens("cu_seqlens_kv", cu_kv, k.shape[0], "k", device, options.stream, &p->host_cu_seqlens_kv));
  if (cu_kv.shape[0] != cu_q.shape[0]) {
    return invalid_argument("cu_seqlens_kv: expected " + std::to_string(cu_q.shape[0]) +
                            " offsets (num_seqs + 1, as cu_seqlens_q), got " + std::to_string(cu_kv.shape[0]));
  }
  p->batch = cu_q.shape[0] - 1;
  p->cu_seqlens_q = cu_q.ptr<const int32_t>();
  p->cu_seqlens_kv = cu_kv.ptr<const int32_t>();
  p->len_q = p->len_kv = 0;
  for (int64_t s = 0; s < p->batch; ++s) {
    p->len_q = std::max(p->len_q, p->seq_len_q(s));
    p->len_kv = std::max(p->len_kv, p->seq_len_kv(s));
  }
  return {};
}

AttentionOutput allocate_outputs(const Tensor& q) {
  AttentionOutput o;
  if (q.ndim == 4) {
    o.out = HostArray(q.dtype, {q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
    o.lse = HostArray(DType::f32, {q.shape[0], q.shape[1], q.shape[2]});
  }
  return o;
}

// Outputs of a varlen call: out [total_q, heads_q, d] (dtype of q), lse f32 [heads_q, total_q].
AttentionOutput allocate_varlen_outputs(const Tensor& q) {
  AttentionOutput o;
  if (q.ndim == 3) {
    o.out = HostArray(q.dtype, {q.shape[0], q.shape[1], q.shape[2]});
    o.lse = HostArray(DType::f32, {q.shape[1], q.shape[0]});
  }
  return o;
}

}  // namespace

Status dense(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
             const AttentionOptions& options) {
  AttentionParams p;
  SPARSA_RETURN_IF_ERROR(build_params(q, k, v, out, lse, options, &p));
  return run(p, options.backend);
}

Status block_sparse(const Tensor& q, const Tensor& k, const Tensor& v, const BlockIndex& index,
                    const Tensor& out, const Tensor& lse, const AttentionOptions& options) {
  AttentionParams p;
  SPARSA_RETURN_IF_ERROR(build_params(q, k, v, out, lse, options, &p));
  if (options.backend == Backend::cuda) {
    SPARSA_RETURN_IF_ERROR(check_device_index(index, p, q.device));
    p.check_index = options.check_index;
  } else {
    SPARSA_RETURN_IF_ERROR(validate_block_index(index, p.batch, p.heads_q, p.heads_kv, p.len_q, p.len_kv));
  }
  p.index = &index;
  return run(p, options.backend);
}

Result<AttentionOutput> dense(const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionOptions& options) {
  if (q.ndim != 4) SPARSA_RETURN_IF_ERROR(check_attention_tensor("q", q, Device{}));
  AttentionOutput o = allocate_outputs(q);
  SPARSA_RETURN_IF_ERROR(dense(q, k, v, o.out.view(), o.lse.view(), options));
  return o;
}

Result<AttentionOutput> block_sparse(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const BlockIndex& index, const AttentionOptions& options) {
  if (q.ndim != 4) SPARSA_RETURN_IF_ERROR(check_attention_tensor("q", q, Device{}));
  AttentionOutput o = allocate_outputs(q);
  SPARSA_RETURN_IF_ERROR(block_sparse(q, k, v, index, o.out.view(), o.lse.view(), options));
  return o;
}

Status dense_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                    const Tensor& cu_seqlens_kv, const Tensor& out, const Tensor& lse, const AttentionOptions& options) {
  AttentionParams p;
  SPARSA_RETURN_IF_ERROR(build_varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, options, &p));
  return run(p, options.backend);
}

Status block_sparse_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_kv, const BlockIndex& index, const Tensor& out, const Tensor& lse,
                           const AttentionOptions& options) {
  AttentionParams p;
  SPARSA_RETURN_IF_ERROR(build_varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, options, &p));
  p.index = &index;
  // Shapes against the longest sequence, then each sequence's rows as the plan of that sequence.
  const bool on_gpu = options.backend == Backend::cuda;
  SPARSA_RETURN_IF_ERROR(check_device_index(index, p, on_gpu ? q.device : Device{}));
  // The cuda backend checks a device plan's contents on the host, per sequence as below (the
  // device check knows one length for every row): its arrays are read back first.
  BlockIndex host_index = index;
  std::vector<int32_t> copies[4];
  if (on_gpu) {
    p.check_index = false;
    if (!options.check_index) return run(p, options.backend);
    Tensor* parts[] = {&host_index.counts, &host_index.indices, &host_index.perm_q, &host_index.perm_kv};
    for (int i = 0; i < 4; ++i) {
      if (parts[i]->defined()) SPARSA_RETURN_IF_ERROR(read_back_i32(*parts[i], options.stream, &copies[i], parts[i]));
    }
  }
  for (int64_t s = 0; s < p.batch; ++s) {
    const int64_t len_q = p.seq_len_q(s), len_kv = p.seq_len_kv(s);
    if (len_q == 0) continue;
    const BlockIndex sub = detail::sequence_index(host_index, s, len_q, len_kv);
    const Status st = validate_block_index(sub, 1, p.heads_q, p.heads_kv, len_q, len_kv);
    if (!st.ok()) {
      return {st.code(), "sequence " + std::to_string(s) + " (index batch row " + std::to_string(s) + ", " +
                             std::to_string(len_q) + " queries, " + std::to_string(len_kv) + " keys): " + st.message()};
    }
  }
  return run(p, options.backend);
}

Result<AttentionOutput> dense_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                                     const Tensor& cu_seqlens_kv, const AttentionOptions& options) {
  if (q.ndim != 3) {
    Tensor view;
    SPARSA_RETURN_IF_ERROR(varlen_view("q", q, 3, "[total_q, heads_q, head_dim]", &view));
  }
  AttentionOutput o = allocate_varlen_outputs(q);
  SPARSA_RETURN_IF_ERROR(dense_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, o.out.view(), o.lse.view(), options));
  return o;
}

Result<AttentionOutput> block_sparse_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                                            const BlockIndex& index, const AttentionOptions& options) {
  if (q.ndim != 3) {
    Tensor view;
    SPARSA_RETURN_IF_ERROR(varlen_view("q", q, 3, "[total_q, heads_q, head_dim]", &view));
  }
  AttentionOutput o = allocate_varlen_outputs(q);
  SPARSA_RETURN_IF_ERROR(
      block_sparse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, index, o.out.view(), o.lse.view(), options));
  return o;
}

BlockIndexBuffer masked_full_plan(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv, int block_q,
                                  int block_kv, const Mask& mask) {
  const int64_t nq = (len_q + block_q - 1) / block_q, nkv = (len_kv + block_kv - 1) / block_kv;
  std::vector<int32_t> counts(batch * heads_q * nq), blocks(batch * heads_q * nq * std::max<int64_t>(nkv, 1));
  for (int64_t qb = 0; qb < nq; ++qb) {
    // The keys some query of the block sees: [begin of its first row, end of its last row). Both
    // ends are non-decreasing in the row (attention.h) and consecutive rows' ranges overlap or
    // touch (a window moves by one key per row; causal ranges all start at 0), so their union is
    // that one range, and a key block holds a visible pair iff it meets it (the tests check this
    // against every pair).
    const int64_t first = qb * block_q, last = std::min<int64_t>(first + block_q, len_q) - 1;
    const int64_t begin = mask_key_begin(mask, first, len_q, len_kv), end = mask_key_end(mask, last, len_q, len_kv);
    int32_t count = 0;
    for (int64_t kb = 0; kb < nkv; ++kb) {
      const int64_t kb_begin = kb * block_kv, kb_end = std::min<int64_t>(kb_begin + block_kv, len_kv);
      if (kb_begin < end && kb_end > begin) blocks[qb * nkv + count++] = static_cast<int32_t>(kb);
    }
    counts[qb] = count;
  }
  // Every (batch, head) has the same rows.
  for (int64_t row = nq; row < batch * heads_q * nq; ++row) {
    counts[row] = counts[row % nq];
    std::copy_n(blocks.begin() + (row % nq) * nkv, nkv, blocks.begin() + row * nkv);
  }
  return BlockIndexBuffer::from_rows(batch, heads_q, len_q, len_kv, block_q, block_kv, counts, blocks.data(), nkv);
}

Status merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2,
             const Tensor& out, const Tensor& lse, Backend backend, void* stream) {
  SPARSA_RETURN_IF_ERROR(check_backend(backend));
  // Every tensor where the backend computes: the host, or o1's CUDA device.
  Device host{};
  if (backend == Backend::cuda) {
    if (o1.device.type != DeviceType::cuda) {
      return invalid_argument("o1: the cuda backend expects a tensor on a cuda device, got " + device_name(o1.device));
    }
    host = o1.device;
  }
  SPARSA_RETURN_IF_ERROR(check_attention_tensor("o1", o1, host));
  const int64_t b = o1.shape[0], h = o1.shape[1], l = o1.shape[2], d = o1.shape[3];
  SPARSA_RETURN_IF_ERROR(check_shape("o2", o2, {b, h, l, d}));
  SPARSA_RETURN_IF_ERROR(check_dtype("o2", o2, o1.dtype));
  SPARSA_RETURN_IF_ERROR(check_shape("out", out, {b, h, l, d}));
  SPARSA_RETURN_IF_ERROR(check_dtype("out", out, o1.dtype));
  for (auto [name, t] : {std::pair{"o2", &o2}, std::pair{"out", &out}}) {
    if (t->strides[3] != 1) return invalid_argument(std::string(name) + ": the last dimension must be contiguous");
    if (!(t->device == host)) {
      return invalid_argument(std::string(name) + ": expected a tensor on " + device_name(host) + ", got " +
                              device_name(t->device));
    }
  }
  for (auto [name, t] : {std::pair{"lse1", &lse1}, std::pair{"lse2", &lse2}, std::pair{"lse", &lse}}) {
    SPARSA_RETURN_IF_ERROR(check_shape(name, *t, {b, h, l}));
    SPARSA_RETURN_IF_ERROR(check_dtype(name, *t, DType::f32));
    if (!(t->device == host)) {
      return invalid_argument(std::string(name) + ": expected a tensor on " + device_name(host) + ", got " +
                              device_name(t->device));
    }
  }
  // out / lse may alias o1 / lse1 (each row is read before it is written), not each other.
  SPARSA_RETURN_IF_ERROR(detail::check_outputs("out", out, "lse", lse));
  detail::MergeParams p{o1, lse1, o2, lse2, out, lse};
  switch (backend) {
    case Backend::cpu_ref: return cpu_ref::merge(p);
    case Backend::cpu: return cpu::merge(p);
    case Backend::cuda: return cuda::merge(p, stream);
  }
  return check_backend(backend);
}

Result<AttentionOutput> merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2,
                              Backend backend) {
  SPARSA_RETURN_IF_ERROR(check_attention_tensor("o1", o1, Device{}));
  AttentionOutput o = allocate_outputs(o1);
  SPARSA_RETURN_IF_ERROR(merge(o1, lse1, o2, lse2, o.out.view(), o.lse.view(), backend));
  return o;
}

}  // namespace sparsa
