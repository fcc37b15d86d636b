// The cuda backend of XAttention's selector: the block masses (xattention_scores.cuh) and the budget
// per query-block row (BA-Att's sorting select kernel, select_blocks.cuh, with XAttention's forced
// blocks and masses weighted as they are) on the device of q and k, into a plan whose arrays are
// device memory. Ordered on the request's stream; the masses and the error word come from the
// stream-ordered pool, and the one synchronisation is the error word's read-back at the end
// (skipped while the stream is captured into a CUDA graph, as BA-Att's).
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/backends.h"
#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/select/select_blocks.cuh"
#include "cuda/select/xattention_scores.cuh"
#include "methods/xattention/xattention_impl.h"

namespace sparsa::xattention_cuda {

namespace {

using namespace sparsa::cuda::xattention;
using sparsa::cuda::ba_att::input_of;
using sparsa::cuda::ba_att::kSelectThreads;
using sparsa::cuda::ba_att::select_bytes_per_row;
using sparsa::cuda::ba_att::select_kernel;
using sparsa::cuda::ba_att::SelectArgs;
using sparsa::cuda::detail::allow_dynamic_smem;
using sparsa::cuda::detail::check_pointer;
using sparsa::cuda::detail::DeviceGuard;

constexpr int64_t kInt32Max = 0x7fffffff;
constexpr int kMaxSharedSortSize = 8192;  // rows up to this many key blocks sort in shared memory

Status check_request(const Request& r) {
  if (r.len_q > kInt32Max || r.len_kv > kInt32Max) {
    return invalid_argument("q: the cuda xattention selector takes sequences of at most 2^31 - 1 tokens, got len_q " +
                            std::to_string(r.len_q) + ", len_kv " + std::to_string(r.len_kv));
  }
  const int64_t rows = r.batch * r.heads_q * r.num_q_blocks;
  if (rows > kInt32Max) {
    return invalid_argument("q: the cuda xattention selector takes at most 2^31 - 1 query-block rows (batch * heads_q"
                            " * num_q_blocks), got " + std::to_string(rows));
  }
  if (r.num_kv_blocks > (int64_t{1} << 26)) {
    return invalid_argument("block_kv: the cuda xattention selector takes at most 2^26 key blocks per row, got " +
                            std::to_string(r.num_kv_blocks));
  }
  if (static_cast<int64_t>(r.stride) * r.head_dim > kInt32Max) {
    return invalid_argument("stride: stride * head_dim must stay below 2^31 on the cuda backend");
  }
  return {};
}

template <class T>
Status run_typed(const Request& r, HostArray* host_x, BlockIndexBuffer* plan) {
  const Device device = r.q.device;
  const auto stream = static_cast<cudaStream_t>(r.stream);
  const int64_t rows = r.batch * r.heads_q * r.num_q_blocks, nk = r.num_kv_blocks;
  auto x = DeviceArray::allocate(DType::f32, {r.batch, r.heads_q, r.num_q_blocks, nk}, device, false, r.stream);
  if (!x.ok()) return x.status();
  auto err = DeviceArray::allocate(DType::i32, {2}, device, false, r.stream);  // one unsigned long long
  if (!err.ok()) return err.status();
  SPARSA_CUDA_CHECK(cudaMemsetAsync(err->data(), 0xff, 8, stream));

  ScoreArgs<T> a;
  a.q = input_of<T>(r.q);
  a.k = input_of<T>(r.k);
  a.heads_q = static_cast<int>(r.heads_q);
  a.heads_kv = static_cast<int>(r.heads_kv);
  a.group = static_cast<int>(r.heads_q / r.heads_kv);
  a.len_q = static_cast<int>(r.len_q);
  a.len_kv = static_cast<int>(r.len_kv);
  a.d = static_cast<int>(r.head_dim);
  a.stride = r.stride;
  a.block_q = r.block_q;
  a.block_kv = r.block_kv;
  a.nq = static_cast<int>(r.num_q_blocks);
  a.nk = static_cast<int>(nk);
  a.q_groups = static_cast<int>((r.len_q + r.stride - 1) / r.stride);
  a.k_groups = static_cast<int>((r.len_kv + r.stride - 1) / r.stride);
  a.a_scale = r.scale / static_cast<float>(r.stride);
  a.mask_aware = r.mask_aware;
  if (r.mask_aware) sparsa::cuda::detail::mask_args(r.mask, &a.mask);
  a.x = x->ptr<float>();
  a.err = static_cast<unsigned long long*>(err->data());
  if (rows > 0) {
    xattention_scores_kernel<T><<<static_cast<unsigned>(rows), kScoreThreads, 0, stream>>>(a);
    SPARSA_CUDA_CHECK_LAUNCH();
  }

  if (plan != nullptr) {
    // Every row keeps a count of its own (forced blocks may pass a fixed budget): room for all.
    auto counts = DeviceArray::allocate(DType::i32, {r.batch, r.heads_q, r.num_q_blocks}, device, false, r.stream);
    if (!counts.ok()) return counts.status();
    auto indices = DeviceArray::allocate(DType::i32, {r.batch, r.heads_q, r.num_q_blocks, nk}, device, false,
                                         r.stream);
    if (!indices.ok()) return indices.status();
    SelectArgs s;
    s.logits = x->ptr<float>();
    s.rows = rows;
    s.nk = static_cast<int>(nk);
    s.sort_size = static_cast<int>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(nk, 1))));
    s.mass = r.budget.kind == BudgetKind::mass;
    s.tau = r.budget.value;
    s.top_kappa = r.budget.kind == BudgetKind::top_kappa;
    s.budget = r.budget.value;
    s.counts = counts->ptr<int32_t>();
    s.indices = indices->ptr<int32_t>();
    s.capacity = static_cast<int>(nk);
    s.mask_aware = true;  // the visibility rule; without a mask every block is visible
    if (r.mask_aware) sparsa::cuda::detail::mask_args(r.mask, &s.mask);
    s.nq = static_cast<int>(r.num_q_blocks);
    s.block_q = r.block_q;
    s.block_kv = r.block_kv;
    s.len_q = static_cast<int>(r.len_q);
    s.len_kv = static_cast<int>(r.len_kv);
    s.force_first = r.force_first;
    s.force_diagonal = r.force_diagonal;
    s.linear_mass = true;
    int sms = 0;
    SPARSA_RETURN_IF_ERROR(sparsa::cuda::detail::sm_count(device.id, &sms));
    DeviceArray scratch;
    if (rows > 0 && s.sort_size > kMaxSharedSortSize) {
      const int ctas = static_cast<int>(std::min<int64_t>(rows, 2 * static_cast<int64_t>(sms)));
      const int64_t words = static_cast<int64_t>(ctas) * (select_bytes_per_row(s.sort_size, s.nk) / 8);
      auto buffer = DeviceArray::allocate(DType::i32, {2 * words}, device, false, r.stream);
      if (!buffer.ok()) return buffer.status();
      scratch = std::move(buffer).value();
      s.scratch = static_cast<uint64_t*>(scratch.data());
      select_kernel<true, true><<<ctas, kSelectThreads, 0, stream>>>(s);
      SPARSA_CUDA_CHECK_LAUNCH();
    } else if (rows > 0) {
      const size_t smem = select_bytes_per_row(s.sort_size, s.nk);
      constexpr auto kernel = select_kernel<false, true>;
      SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device.id, smem));
      kernel<<<static_cast<unsigned>(rows), kSelectThreads, smem, stream>>>(s);
      SPARSA_CUDA_CHECK_LAUNCH();
    }
    plan->block_q = r.block_q;
    plan->block_kv = r.block_kv;
    plan->num_q_blocks = r.num_q_blocks;
    plan->num_kv_blocks = nk;
    plan->device_counts = std::move(counts).value();
    plan->device_indices = std::move(indices).value();
  }
  if (host_x != nullptr) {
    auto copy = x->to_host();
    if (!copy.ok()) return copy.status();
    *host_x = std::move(copy).value();
  }
  // The error word (the one synchronisation). Under capture nothing has run yet: a non-finite
  // mass then goes unreported, as BA-Att's selector's.
  if (sparsa::cuda::detail::capturing(r.stream)) return {};
  auto word = err->to_host();
  if (!word.ok()) return word.status();
  unsigned long long first = 0;
  std::memcpy(&first, word->data(), sizeof first);
  if (first != ~0ull) {
    return Status(StatusCode::non_finite, "xattention: block mass " + std::to_string(first) +
                                              " is not finite (NaN/Inf or overflow in q or k)");
  }
  return {};
}

Status run(const Request& r, HostArray* host_x, BlockIndexBuffer* plan) {
  SPARSA_RETURN_IF_ERROR(check_request(r));
  const int device = r.q.device.id;
  SPARSA_RETURN_IF_ERROR(sparsa::cuda::detail::check_device_id("q", device));
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  SPARSA_RETURN_IF_ERROR(check_pointer("q", r.q.data, device, r.stream));
  SPARSA_RETURN_IF_ERROR(check_pointer("k", r.k.data, device, r.stream));
  switch (r.q.dtype) {
    case DType::bf16: return run_typed<__nv_bfloat16>(r, host_x, plan);
    case DType::f16: return run_typed<__half>(r, host_x, plan);
    case DType::f32: return run_typed<float>(r, host_x, plan);
    case DType::i32: break;
  }
  return unsupported_dtype(std::string("q: the cuda xattention selector takes bf16, f16 or f32, got ") +
                           dtype_name(r.q.dtype));
}

}  // namespace

Status scores(const Request& request, HostArray* x) { return run(request, x, nullptr); }

Status plan(const Request& request, BlockIndexBuffer* plan) {
  BlockIndexBuffer result;
  SPARSA_RETURN_IF_ERROR(run(request, nullptr, &result));
  *plan = std::move(result);
  return {};
}

}  // namespace sparsa::xattention_cuda
