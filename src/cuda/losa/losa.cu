// The cuda backend of block-diffusion decoding (methods/losa/device_impl.h): sizes and launches
// the kernels of losa_kernels.cuh on the caller's stream. Nothing here allocates, synchronises or
// reads device memory back: a step is a fixed sequence of launches (CUDA-graph capturable).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/losa/losa_kernels.cuh"
#include "methods/losa/device_impl.h"

namespace sparsa::losa_cuda {

namespace {

using cuda::detail::DeviceGuard;
using namespace sparsa::cuda::losa;

static_assert(cuda::losa::kMaxBatch == kMaxBatch, "one batch limit");
static_assert(cuda::losa::kScorePages == kTilePages, "one tile of pages");

template <class T>
Rows4<const T> rows_of(const Tensor& t) {
  return {static_cast<const T*>(t.data), t.strides[0], t.strides[1], t.strides[2]};
}
template <class T>
Rows4<T> mutable_rows_of(const Tensor& t) {
  return {static_cast<T*>(t.data), t.strides[0], t.strides[1], t.strides[2]};
}

PoolView pool_view(const StepArgs& a) {
  PoolView p{};
  p.k = a.pool.k;
  p.v = a.pool.v;
  p.min = a.pool.min;
  p.max = a.pool.max;
  p.pool_tokens = a.pool.pool_tokens();
  p.pool_pages = a.pool.pool_pages;
  p.page_size = a.pool.page_size;
  for (int64_t b = 0; b < a.batch; ++b) {
    p.first_page[b] = a.seqs[b].first_page;
    p.length[b] = a.seqs[b].length;
  }
  return p;
}

int group_of(const StepArgs& a) { return static_cast<int>(a.heads_q / a.pool.heads_kv); }

// One dispatch place for (dtype, head_dim): calls f.template operator()<T, D>().
template <class F>
Status dispatch(DType dtype, int64_t head_dim, F&& f) {
  const bool bf16 = dtype == DType::bf16;
  if (head_dim == 64) return bf16 ? f.template operator()<__nv_bfloat16, 64>() : f.template operator()<__half, 64>();
  return bf16 ? f.template operator()<__nv_bfloat16, 128>() : f.template operator()<__half, 128>();
}

// Launches kernel<<<grid, threads, smem, s>>>(args...); `dependent`: as a programmatic dependent
// launch of the stream's previous kernel, which must be one of this file's that calls
// launch_dependents() (losa_kernels.cuh): the kernel may start while that one runs.
template <class... Params, class... Args>
Status launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem, cudaStream_t s, bool dependent,
              Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = s;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = dependent ? attribute : nullptr;
  config.numAttrs = dependent ? 1 : 0;
  SPARSA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  return {};
}

unsigned elementwise_grid(int64_t total) {
  return static_cast<unsigned>(std::clamp<int64_t>((total + 255) / 256, 1, 4096));
}

}  // namespace

Status append(const Pool& pool, int64_t first_page, int64_t old_length, const Tensor& k, const Tensor& v,
              void* stream) {
  const int64_t n = k.shape[2];
  if (n == 0) return {};
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(pool.device));
  const auto s = static_cast<cudaStream_t>(stream);
  const int d = static_cast<int>(pool.head_dim);
  const int64_t token0 = first_page * pool.page_size + old_length, length = old_length + n;
  const int64_t page0 = old_length / pool.page_size, page_end = (length + pool.page_size - 1) / pool.page_size;
  return dispatch(pool.dtype, pool.head_dim, [&]<class T, int D>() -> Status {
    append_rows_kernel<T><<<elementwise_grid(pool.heads_kv * n * d), 256, 0, s>>>(
        rows_of<T>(k), rows_of<T>(v), static_cast<T*>(pool.k), static_cast<T*>(pool.v), pool.pool_tokens(), token0, n,
        pool.heads_kv, d);
    SPARSA_CUDA_CHECK_LAUNCH();
    const dim3 grid(static_cast<unsigned>(page_end - page0), static_cast<unsigned>(pool.heads_kv));
    page_minmax_kernel<T><<<grid, D, 0, s>>>(static_cast<const T*>(pool.k), static_cast<T*>(pool.min),
                                             static_cast<T*>(pool.max), pool.pool_tokens(), pool.pool_pages,
                                             first_page, page0, length, pool.page_size, d);
    SPARSA_CUDA_CHECK_LAUNCH();
    return {};
  });
}

Status dense_rows(const StepArgs& a) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(a.pool.device));
  const auto s = static_cast<cudaStream_t>(a.stream);
  all_rows_kernel<<<static_cast<unsigned>(a.batch), 64, 0, s>>>(static_cast<int>(a.block), a.active, a.active_counts);
  SPARSA_CUDA_CHECK_LAUNCH();
  SPARSA_CUDA_CHECK(cudaMemsetAsync(a.plan_counts, 0, static_cast<size_t>(a.batch * a.heads_q * a.block) * sizeof(int32_t), s));
  return {};
}

namespace {
// Dynamic shared memory of sparse_rows_kernel<T, D> over a longest prefix of max_pages pages at
// `capacity` pages a row: its state, the plan and the selection (which grows with the prefix).
template <int D>
size_t rows_smem(int64_t max_pages, int64_t capacity) {
  const int64_t keep = std::min<int64_t>(capacity, max_pages);
  return rows_state_bytes<D>() + rows_plan_bytes(keep) +
         rows_select_bytes(candidate_tiles(max_pages) * tile_keep(capacity), static_cast<int>(keep));
}

}  // namespace

Status sparse_step_fits(DType dtype, int64_t head_dim, int64_t max_pages, int64_t capacity, bool attend_union,
                        int device) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  return dispatch(dtype, head_dim, [&]<class T, int D>() -> Status {
    if (attend_union) {
      SPARSA_RETURN_IF_ERROR(cuda::detail::allow_dynamic_smem(reinterpret_cast<const void*>(union_rows_kernel<T, D>),
                                                              device, union_smem_bytes<D>(max_pages)));
      return cuda::detail::allow_dynamic_smem(reinterpret_cast<const void*>(sparse_rows_kernel<T, D, false>), device,
                                              rows_smem<D>(max_pages, capacity));
    }
    constexpr auto kernel = sparse_rows_kernel<T, D>;
    return cuda::detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device,
                                            rows_smem<D>(max_pages, capacity));
  });
}

Status sparse_step(const StepArgs& a) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(a.pool.device));
  const int device = a.pool.device;
  const auto s = static_cast<cudaStream_t>(a.stream);
  const PoolView pool = pool_view(a);
  int64_t max_pages = 0;
  for (int64_t b = 0; b < a.batch; ++b) max_pages = std::max(max_pages, (a.seqs[b].length + a.pool.page_size - 1) / a.pool.page_size);
  const int group = group_of(a), heads_q = static_cast<int>(a.heads_q), block = static_cast<int>(a.block);
  const int capacity = static_cast<int>(a.capacity), keep_tile = static_cast<int>(tile_keep(a.capacity));
  const ActiveRule rule{a.mse, a.all_rows, a.active_k, a.use_threshold, a.threshold};
  return dispatch(a.pool.dtype, a.pool.head_dim, [&]<class T, int D>() -> Status {
    if (!a.all_rows) {
      row_mse_kernel<T, D><<<dim3(static_cast<unsigned>(a.block), static_cast<unsigned>(a.batch)), kMseWarps * 32, 0, s>>>(
          rows_of<T>(a.q), static_cast<const T*>(a.q_ref), heads_q, block, a.mse);
      SPARSA_CUDA_CHECK_LAUNCH();
    }
    // The most and the fewest rows the rule makes active (the top-K rule: exactly min(K, block)).
    const int max_rows = a.all_rows || a.use_threshold ? block : std::min(a.active_k, block);
    const int min_rows = a.use_threshold ? 0 : max_rows;
    {
      // A CTA scores kChunkQueries of a kv head's queries (its group at the active rows): as
      // many chunks as the most rows the rule can make active.
      const int chunks = std::max((group * max_rows + kChunkQueries - 1) / kChunkQueries, 1);
      constexpr size_t smem = candidates_smem_bytes<T, D>();
      constexpr auto kernel = quest_candidates_kernel<T, D>;
      SPARSA_RETURN_IF_ERROR(cuda::detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem));
      // The whole carveout for shared memory: three CTAs an SM (kScoreCtasPerSm).
      SPARSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared));
      const dim3 grid(static_cast<unsigned>(std::max<int64_t>(candidate_tiles(max_pages), 1)),
                      static_cast<unsigned>(a.pool.heads_kv * chunks), static_cast<unsigned>(a.batch));
      // Dependent of the row-change kernel when there is one (LoSA after a block's first step).
      // q's rows as 16-byte vectors when every row starts on 16 bytes.
      const bool q_vec = reinterpret_cast<uintptr_t>(a.q.data) % 16 == 0 && a.q.strides[0] % 8 == 0 &&
                         a.q.strides[1] % 8 == 0 && a.q.strides[2] % 8 == 0;
      SPARSA_RETURN_IF_ERROR(launch(kernel, grid, kScoreThreads, smem, s, /*dependent=*/!a.all_rows, pool,
                                    rows_of<T>(a.q), q_vec, rule, a.active, a.active_counts, heads_q, group, block, chunks,
                                    capacity, keep_tile, a.candidate_tiles, a.force_first, a.force_last,
                                    a.candidates));
    }
    const int64_t keep = std::min<int64_t>(a.capacity, max_pages);
    const size_t smem = rows_smem<D>(max_pages, a.capacity);
    // attend_union: the rows kernel writes the plans only, union_rows_kernel attends.
    const auto kernel = a.attend_union ? sparse_rows_kernel<T, D, false> : sparse_rows_kernel<T, D>;
    SPARSA_RETURN_IF_ERROR(cuda::detail::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem));
    const dim3 grid(static_cast<unsigned>(a.heads_q), static_cast<unsigned>(max_rows + rows_stable_ctas(block, min_rows)),
                    static_cast<unsigned>(a.batch));
    // Dependent of the candidates kernel.
    SPARSA_RETURN_IF_ERROR(launch(kernel, grid, kRowWarps * 32, smem, s, /*dependent=*/true, pool, rows_of<T>(a.q),
                                  rows_of<T>(a.k_block), rows_of<T>(a.v_block), mutable_rows_of<T>(a.out),
                                  mutable_rows_of<float>(a.lse), a.active, a.active_counts, a.candidates,
                                  a.candidate_tiles, keep_tile, capacity, static_cast<int>(keep), a.plan_pages,
                                  a.plan_counts, heads_q, group, block, max_rows, a.scale * kLog2e,
                                  static_cast<T*>(a.o_p), a.l_p, static_cast<T*>(a.q_ref)));
    if (!a.attend_union) return {};
    const size_t union_smem = union_smem_bytes<D>(max_pages);
    constexpr auto union_kernel = union_rows_kernel<T, D>;
    SPARSA_RETURN_IF_ERROR(
        cuda::detail::allow_dynamic_smem(reinterpret_cast<const void*>(union_kernel), device, union_smem));
    union_kernel<<<grid, kRowWarps * 32, union_smem, s>>>(
        pool, rows_of<T>(a.q), rows_of<T>(a.k_block), rows_of<T>(a.v_block), mutable_rows_of<T>(a.out),
        mutable_rows_of<float>(a.lse), a.active, a.active_counts, capacity, a.plan_pages, a.plan_counts, heads_q, group,
        block, max_rows, a.scale * kLog2e, static_cast<T*>(a.o_p), a.l_p, static_cast<T*>(a.q_ref));
    SPARSA_CUDA_CHECK_LAUNCH();
    return {};
  });
}

Status reuse_rows(const StepArgs& a) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(a.pool.device));
  const auto s = static_cast<cudaStream_t>(a.stream);
  const int heads_q = static_cast<int>(a.heads_q), block = static_cast<int>(a.block);
  const ActiveRule rule{a.mse, a.all_rows, a.active_k, a.use_threshold, a.threshold};
  SPARSA_RETURN_IF_ERROR(dispatch(a.pool.dtype, a.pool.head_dim, [&]<class T, int D>() -> Status {
    if (!a.all_rows) {
      row_mse_kernel<T, D><<<dim3(static_cast<unsigned>(a.block), static_cast<unsigned>(a.batch)), kMseWarps * 32, 0, s>>>(
          rows_of<T>(a.q), static_cast<const T*>(a.q_ref), heads_q, block, a.mse);
      SPARSA_CUDA_CHECK_LAUNCH();
    }
    return {};
  }));
  choose_rows_kernel<<<static_cast<unsigned>(a.batch), 32, 0, s>>>(rule, block, a.active, a.active_counts);
  SPARSA_CUDA_CHECK_LAUNCH();
  SPARSA_CUDA_CHECK(cudaMemsetAsync(a.plan_counts, 0, static_cast<size_t>(a.batch * a.heads_q * a.block) * sizeof(int32_t), s));
  return {};
}

Status adopt_rows(const StepArgs& a, const void* o_new, const float* l_new) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(a.pool.device));
  const auto s = static_cast<cudaStream_t>(a.stream);
  return dispatch(a.pool.dtype, a.pool.head_dim, [&]<class T, int D>() -> Status {
    const dim3 grid(static_cast<unsigned>(a.heads_q), static_cast<unsigned>(a.block), static_cast<unsigned>(a.batch));
    adopt_rows_kernel<T, D><<<grid, 32, 0, s>>>(rows_of<T>(a.q), a.active, a.active_counts, static_cast<const T*>(o_new),
                                                l_new, static_cast<int>(a.heads_q), static_cast<int>(a.block),
                                                static_cast<T*>(a.o_p), a.l_p, static_cast<T*>(a.q_ref));
    SPARSA_CUDA_CHECK_LAUNCH();
    return {};
  });
}

Status block_merge(const StepArgs& a, bool qref_all) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(a.pool.device));
  const auto s = static_cast<cudaStream_t>(a.stream);
  const PoolView pool = pool_view(a);
  return dispatch(a.pool.dtype, a.pool.head_dim, [&]<class T, int D>() -> Status {
    const dim3 grid(static_cast<unsigned>(a.heads_q), static_cast<unsigned>(a.batch),
                    static_cast<unsigned>((a.block + kMergeWarps - 1) / kMergeWarps));
    block_merge_kernel<T, D><<<grid, kMergeWarps * 32, 0, s>>>(
        pool, rows_of<T>(a.q), rows_of<T>(a.k_block), rows_of<T>(a.v_block), mutable_rows_of<T>(a.out),
        mutable_rows_of<float>(a.lse), static_cast<const T*>(a.o_p), a.l_p, static_cast<T*>(a.q_ref),
        static_cast<int>(a.heads_q), group_of(a), static_cast<int>(a.block), a.scale * kLog2e, qref_all);
    SPARSA_CUDA_CHECK_LAUNCH();
    return {};
  });
}

}  // namespace sparsa::losa_cuda
