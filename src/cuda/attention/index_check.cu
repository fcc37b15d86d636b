// The cuda backend's check of a BlockIndex in device memory (index_check.h). Three small kernels
// find the first wrong element in the order validate_block_index visits them (rows in order, in a
// row the count, then each slot's range and order; then perm_q's rows, then perm_kv's), each
// section's first position kept by an atomicMin on one 64-bit word; one read-back of the three
// words; then the host reads the few offending values and builds the host check's message.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <string>

#include "core/validate.h"
#include "cuda/attention/index_check.h"
#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/common/workspace.h"
#include "sparsa/tensor.h"

namespace sparsa::cuda::detail {

namespace {


constexpr unsigned long long kClean = ~0ull;
constexpr int kThreads = 256;

// The first wrong element of each section, as a flat position: rows: row * (capacity + 1) + slot
// + 1 (0: the count); permutations: row * len + entry.
struct Verdict {
  unsigned long long rows, perm_q, perm_kv;
};

struct Strided3 {
  const int32_t* data;
  int64_t s0, s1, s2;
  __device__ __forceinline__ int32_t at(int64_t i0, int64_t i1, int64_t i2) const {
    return data[i0 * s0 + i1 * s1 + i2 * s2];
  }
};

// One warp per (b, h, qb) row, grid-stride: the count in [0, capacity], then, for every slot below
// the count, the key block in [0, num_kv_blocks) and above the slot before it.
__global__ void check_rows_kernel(Strided3 counts, const int32_t* __restrict__ indices, int64_t is0, int64_t is1,
                                  int64_t is2, int64_t is3, int64_t heads, int64_t nq, int64_t rows, int capacity,
                                  int num_kv_blocks, unsigned long long* first) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    const int64_t b = r / (heads * nq), h = (r / nq) % heads, qb = r % nq;
    const unsigned long long base = static_cast<unsigned long long>(r) * (capacity + 1);
    const int32_t count = counts.at(b, h, qb);
    if (count < 0 || count > capacity) {
      if (lane == 0) atomicMin(first, base);
      continue;
    }
    const int32_t* row = indices + b * is0 + h * is1 + qb * is2;
    for (int s = lane; s < count; s += 32) {
      const int32_t kb = row[s * is3];
      const bool bad = kb < 0 || kb >= num_kv_blocks || (s > 0 && kb <= row[(s - 1) * is3]);
      if (bad) atomicMin(first, base + s + 1);
    }
  }
}

// Permutation rows [batch * heads][len]: first_pos[row][t] = the lowest entry holding t.
__global__ void first_positions_kernel(Strided3 perm, int64_t heads, int64_t len, int64_t total, int32_t* first_pos) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / len, p = i % len;
    const int32_t t = perm.at(row / heads, row % heads, p);
    if (t >= 0 && t < len) atomicMin(first_pos + row * len + t, static_cast<int32_t>(p));
  }
}

// Entry p of a row is wrong when its value is out of range or appeared at an earlier entry (the
// host check's rule: it reports the second occurrence of a repeated value).
__global__ void permutation_errors_kernel(Strided3 perm, int64_t heads, int64_t len, int64_t total,
                                          const int32_t* __restrict__ first_pos, unsigned long long* first) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / len, p = i % len;
    const int32_t t = perm.at(row / heads, row % heads, p);
    if (t < 0 || t >= len || first_pos[row * len + t] < p) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// Per (device, stream) (common/workspace.h): the verdict in device memory and its pinned
// read-back buffer, allocated once; the mutex keeps two host threads' checks apart.
static_assert(sizeof(Verdict) <= kReadBackBytes);
struct CheckState {
  std::mutex mutex;
  StreamBuffer verdict;
  ReadBackBuffer host;
};
PerStream<CheckState> g_check;

unsigned grid_for(int64_t work, int sms) {
  const int64_t ctas = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ctas, static_cast<int64_t>(sms) * 8)));
}

// One int32 of a device array, by element offset (after the work queued on `stream`).
Status read_int(const Tensor& t, int64_t offset, int32_t* value, cudaStream_t stream) {
  SPARSA_CUDA_CHECK(cudaMemcpyAsync(value, static_cast<const int32_t*>(t.data) + offset, sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream));
  SPARSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {};
}

Status launch_permutation(const Tensor& perm, int64_t batch, int64_t heads, int64_t len, int32_t* first_pos, int sms,
                          unsigned long long* first, cudaStream_t stream) {
  const int64_t total = batch * heads * len;
  if (total == 0) return {};
  SPARSA_CUDA_CHECK(cudaMemsetAsync(first_pos, 0x7f, static_cast<size_t>(total) * sizeof(int32_t), stream));
  const Strided3 p{static_cast<const int32_t*>(perm.data), perm.strides[0], perm.strides[1], perm.strides[2]};
  first_positions_kernel<<<grid_for(total, sms), kThreads, 0, stream>>>(p, heads, len, total, first_pos);
  SPARSA_CUDA_CHECK_LAUNCH();
  permutation_errors_kernel<<<grid_for(total, sms), kThreads, 0, stream>>>(p, heads, len, total, first_pos, first);
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

Status permutation_message(const char* name, const Tensor& perm, int64_t heads, int64_t len, unsigned long long at,
                           cudaStream_t stream) {
  const int64_t row = static_cast<int64_t>(at) / len, p = static_cast<int64_t>(at) % len;
  const int64_t b = row / heads, h = row % heads;
  int32_t t = 0;
  SPARSA_RETURN_IF_ERROR(read_int(perm, b * perm.strides[0] + h * perm.strides[1] + p * perm.strides[2], &t, stream));
  return sparsa::detail::permutation_error(name, b, h, len, p, t);
}

}  // namespace

Status check_index_on_device(const BlockIndex& ix, int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t len_q,
                             int64_t len_kv, int device, cudaStream_t stream) {
  const int64_t nq = ix.num_q_blocks, rows = batch * heads_q * nq;
  const int64_t capacity = ix.capacity();
  if (capacity > INT_MAX - 1) {
    return invalid_argument("index.indices: capacity " + std::to_string(capacity) + " exceeds the cuda backend's " +
                            std::to_string(INT_MAX - 1));
  }
  CheckState& state = g_check.at(device, stream);
  std::lock_guard<std::mutex> lock(state.mutex);
  SPARSA_RETURN_IF_ERROR(state.verdict.reserve(device, stream, sizeof(Verdict)));
  SPARSA_RETURN_IF_ERROR(state.host.reserve());
  auto* verdict_device = static_cast<Verdict*>(state.verdict.data());
  auto* verdict_host = static_cast<Verdict*>(state.host.data());
  int sms = 0;
  SPARSA_RETURN_IF_ERROR(sm_count(device, &sms));
  SPARSA_CUDA_CHECK(cudaMemsetAsync(verdict_device, 0xff, sizeof(Verdict), stream));
  if (rows > 0) {
    const Strided3 counts{static_cast<const int32_t*>(ix.counts.data), ix.counts.strides[0], ix.counts.strides[1],
                          ix.counts.strides[2]};
    const auto& is = ix.indices.strides;
    check_rows_kernel<<<grid_for(rows * 32, sms), kThreads, 0, stream>>>(
        counts, static_cast<const int32_t*>(ix.indices.data), is[0], is[1], is[2], is[3], heads_q, nq, rows,
        static_cast<int>(capacity), static_cast<int>(ix.num_kv_blocks), &verdict_device->rows);
    SPARSA_CUDA_CHECK_LAUNCH();
  }
  DeviceArray first_pos;
  if (ix.perm_q.defined() || ix.perm_kv.defined()) {
    const int64_t q_entries = ix.perm_q.defined() ? batch * heads_q * len_q : 0;
    const int64_t kv_entries = ix.perm_kv.defined() ? batch * heads_kv * len_kv : 0;
    auto scratch = DeviceArray::allocate(DType::i32, {std::max<int64_t>(1, std::max(q_entries, kv_entries))},
                                         Device{DeviceType::cuda, device}, false, stream);
    if (!scratch.ok()) return scratch.status();
    first_pos = std::move(scratch).value();
  }
  if (ix.perm_q.defined()) {
    SPARSA_RETURN_IF_ERROR(launch_permutation(ix.perm_q, batch, heads_q, len_q, first_pos.ptr<int32_t>(), sms,
                                              &verdict_device->perm_q, stream));
  }
  if (ix.perm_kv.defined()) {
    SPARSA_RETURN_IF_ERROR(launch_permutation(ix.perm_kv, batch, heads_kv, len_kv, first_pos.ptr<int32_t>(), sms,
                                              &verdict_device->perm_kv, stream));
  }
  SPARSA_CUDA_CHECK(cudaMemcpyAsync(verdict_host, verdict_device, sizeof(Verdict), cudaMemcpyDeviceToHost, stream));
  SPARSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Verdict verdict = *verdict_host;
  if (verdict.rows != kClean) {
    const int64_t row = static_cast<int64_t>(verdict.rows / (capacity + 1));
    const int64_t slot = static_cast<int64_t>(verdict.rows % (capacity + 1));
    const int64_t b = row / (heads_q * nq), h = (row / nq) % heads_q, qb = row % nq;
    if (slot == 0) {
      int32_t count = 0;
      SPARSA_RETURN_IF_ERROR(read_int(
          ix.counts, b * ix.counts.strides[0] + h * ix.counts.strides[1] + qb * ix.counts.strides[2], &count, stream));
      return sparsa::detail::index_count_error(b, h, qb, count, capacity);
    }
    const int64_t s = slot - 1;
    const auto& is = ix.indices.strides;
    const int64_t at = b * is[0] + h * is[1] + qb * is[2];
    int32_t kb = 0;
    SPARSA_RETURN_IF_ERROR(read_int(ix.indices, at + s * is[3], &kb, stream));
    if (kb < 0 || kb >= ix.num_kv_blocks) {
      return sparsa::detail::index_block_range_error(b, h, qb, s, kb, ix.num_kv_blocks);
    }
    int32_t prev = 0;
    SPARSA_RETURN_IF_ERROR(read_int(ix.indices, at + (s - 1) * is[3], &prev, stream));
    return sparsa::detail::index_block_order_error(b, h, qb, s, prev, kb);
  }
  if (verdict.perm_q != kClean) return permutation_message("index.perm_q", ix.perm_q, heads_q, len_q, verdict.perm_q, stream);
  if (verdict.perm_kv != kClean) {
    return permutation_message("index.perm_kv", ix.perm_kv, heads_kv, len_kv, verdict.perm_kv, stream);
  }
  return {};
}

}  // namespace sparsa::cuda::detail
