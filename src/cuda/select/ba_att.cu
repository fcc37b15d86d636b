// The cuda backend of BA-Att's selector: steps 1-4 of Algorithm 1 on the device of q and k, into a
// plan whose arrays are device memory (BlockIndexBuffer::device_*). Ordered on the caller's stream
// (BaAttOptions::stream; the key side's steps 1-3 run on a second stream forked from and joined
// back to it). The kernels
// are listed in ba_att_kernels.cuh (one file per step); this file sizes the scratch, launches them
// and turns the device-side error word into a Status (the one host synchronisation, at the end).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "core/validate.h"
#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/common/workspace.h"
#include "cuda/select/ba_att_hooks.h"
#include "cuda/select/ba_att_kernels.cuh"
#include "methods/ba_att/ba_att_impl.h"

namespace sparsa::ba_att_cuda {

namespace {

using namespace sparsa::cuda::ba_att;
using detail::BaAttParams;

constexpr int kMaxSharedSortSize = 8192;  // select rows up to this many key blocks sort in shared memory
constexpr int64_t kInt32Max = 0x7fffffff;

using sparsa::cuda::detail::allow_dynamic_smem;
using sparsa::cuda::detail::ReadBackBuffer;
using sparsa::cuda::detail::resident_ctas;
using sparsa::cuda::detail::sm_count;
using sparsa::cuda::detail::StreamBuffer;

// Grow-only scratch per (device, stream) (common/workspace.h): the calls of one stream run in
// order (the side stream is joined back before a call returns, also on errors), so the next
// call's kernels run after this call's; the mutex keeps two host threads from sharing it at once.
// Nothing in a call's launch sequence allocates, frees, synchronises or asks the device a
// question once the workspace has grown to the shape (the plan's own arrays come from the
// stream-ordered pool): the host stays ahead of the device queue, and the one synchronisation is
// the error word's read-back at the end, into pinned memory.
static_assert(sizeof(ErrorWord) <= sparsa::cuda::detail::kReadBackBytes);

struct Workspace {
  std::mutex mutex;
  StreamBuffer memory;
  ReadBackBuffer host_err;  // the error word's read-back
  // The device error word (the workspace's first bytes) is known to be all ~0: the last call read
  // it back clean, so this call need not reset it. False after a reallocation, an error found, or
  // a call that returned before its read-back.
  bool err_clean = false;
  // CUB's scratch size per (items, bits), asked once (a host computation, but not a free one).
  struct SortSize {
    int64_t items;
    int begin_bit, end_bit;
    size_t bytes;
  };
  std::vector<SortSize> sort_sizes;
  // The key side's stream (steps 1-3 of K beside those of Q) and the two events that fork it from
  // and join it back to the call's stream; created on first use.
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
// The logits kernel switches (ba_att_hooks.h) and what the last call on this thread took.
std::atomic<bool> g_tc_logits{true};
thread_local bool g_last_tc_logits = false;
std::atomic<bool> g_wgmma_logits{true};
thread_local bool g_last_wgmma_logits = false;
// The concurrent key side switch (ba_att_hooks.h) and whether the last call on this thread used it.
std::atomic<bool> g_concurrent_sides{true};
thread_local bool g_last_concurrent = false;
sparsa::cuda::detail::PerStream<Workspace> g_workspaces;

// `device` is current (DeviceGuard). The SM count and the CTAs per SM (device_facts.h), which
// also raises the kernel's shared-memory limit when smem needs it.
Status launch_facts(int device, const void* kernel, int threads, size_t smem, int* sms, int* per_sm) {
  SPARSA_RETURN_IF_ERROR(sm_count(device, sms));
  return resident_ctas(kernel, device, threads, smem, per_sm);
}

// Carves aligned sub-buffers out of one allocation: a first pass with base = null measures.
struct Carver {
  char* base = nullptr;
  size_t used = 0;
  template <class T>
  T* take(size_t count) {
    used = (used + 255) / 256 * 256;
    T* p = base != nullptr ? reinterpret_cast<T*>(base + used) : nullptr;
    used += count * sizeof(T);
    return p;
  }
};

using sparsa::cuda::detail::check_pointer;
using sparsa::cuda::detail::DeviceGuard;

template <class T>
Input<T> input_of(const Tensor& x) {
  return {static_cast<const T*>(x.data), x.strides[0], x.strides[1], x.strides[2], static_cast<int>(x.shape[1]),
          static_cast<int>(x.shape[2]), static_cast<int>(x.shape[3])};
}

int feature_kind(const BaAttParams& p) {
  if (!p.compensate) return kPlain;
  switch (p.compensation) {
    case Compensation::diagonal: return kDiagonal;
    case Compensation::trace: return kTrace;
    case Compensation::exact: return kExact;
  }
  return kPlain;
}

// Everything one run needs beyond the inputs, sized on the host before anything is launched.
struct Sizes {
  int64_t tokens_q = 0, tokens_k = 0;     // batch * heads * len
  int64_t window_q = 0, window_k = 0;     // tokens per sort window
  int64_t windows_q = 0, windows_k = 0;   // windows per (batch, head)
  int index_bits_q = 0, index_bits_k = 0; // norm_key: bits of the index in a window
  int end_bit_q = 31, end_bit_k = 31;     // sorted key bits [index_bits, end_bit): norm, segment
  int kind = kPlain;
  int64_t F = 0;
  int64_t rows = 0;                       // batch * heads_q * num_q_blocks
  size_t sort_temp_q = 0, sort_temp_k = 0;  // CUB's scratch per side
  int sort_size = 0;                      // power of two >= num_kv_blocks
  bool global_select = false;
  int select_ctas = 0;
};

// The sort buffers of one side (Q or K). With the sides concurrent each has its own; serial, K
// reuses Q's.
struct SortScratch {
  uint64_t* keys_in = nullptr;
  uint64_t* keys_out = nullptr;
  void* temp = nullptr;
};

// The arrays of one run inside the workspace (null pointers while measuring).
struct Scratch {
  ErrorWord* err = nullptr;
  SortScratch sort_q, sort_k;
  float* query_features = nullptr;
  float* key_features = nullptr;
  float* logits = nullptr;
  uint64_t* select_scratch = nullptr;
};

Scratch carve(Carver& c, const Request& r, const Sizes& s, bool select, bool concurrent) {
  const BaAttParams& p = r.params;
  Scratch w;
  w.err = c.take<ErrorWord>(1);
  auto sort_buffers = [&](int64_t tokens, size_t temp_bytes) {
    SortScratch b;
    b.keys_in = c.take<uint64_t>(tokens);
    b.keys_out = c.take<uint64_t>(tokens);
    b.temp = c.take<char>(temp_bytes);
    return b;
  };
  if (concurrent) {
    w.sort_q = sort_buffers(r.sort_q ? s.tokens_q : 0, s.sort_temp_q);
    w.sort_k = sort_buffers(r.sort_k ? s.tokens_k : 0, s.sort_temp_k);
  } else {
    w.sort_q = w.sort_k = sort_buffers(std::max(r.sort_q ? s.tokens_q : 0, r.sort_k ? s.tokens_k : 0),
                                       std::max(s.sort_temp_q, s.sort_temp_k));
  }
  w.query_features = c.take<float>(static_cast<size_t>(p.batch * p.heads_q * p.num_q_blocks * s.F));
  w.key_features = c.take<float>(static_cast<size_t>(p.batch * p.heads_kv * p.num_kv_blocks * s.F));
  w.logits = c.take<float>(static_cast<size_t>(s.rows * p.num_kv_blocks));
  if (select && s.global_select) {
    w.select_scratch = c.take<uint64_t>(static_cast<size_t>(s.select_ctas) *
                                        (select_bytes_per_row(s.sort_size, static_cast<int>(p.num_kv_blocks)) / 8));
  }
  return w;
}

Status check_request(const Request& r) {
  const BaAttParams& p = r.params;
  if (p.len_q > kInt32Max || p.len_kv > kInt32Max) {
    return invalid_argument("q: the cuda selector takes sequences of at most 2^31 - 1 tokens, got len_q " +
                            std::to_string(p.len_q) + ", len_kv " + std::to_string(p.len_kv));
  }
  if (p.batch * p.heads_q * p.len_q > kInt32Max || p.batch * p.heads_kv * p.len_kv > kInt32Max) {
    return invalid_argument("q: the cuda selector takes at most 2^31 - 1 tokens per input (batch * heads * len), "
                            "got " + std::to_string(p.batch * p.heads_q * p.len_q) + " in q and " +
                            std::to_string(p.batch * p.heads_kv * p.len_kv) + " in k");
  }
  if (p.batch * p.heads_q > 65535) {
    return invalid_argument("q: the cuda selector takes batch * heads_q <= 65535, got " +
                            std::to_string(p.batch * p.heads_q));
  }
  if (p.num_kv_blocks > (int64_t{1} << 26)) {
    return invalid_argument("block_kv: the cuda selector takes at most 2^26 key blocks per row, got " +
                            std::to_string(p.num_kv_blocks));
  }
  return {};
}

Sizes size_run(const Request& r, int sms) {
  const BaAttParams& p = r.params;
  Sizes s;
  s.tokens_q = p.batch * p.heads_q * p.len_q;
  s.tokens_k = p.batch * p.heads_kv * p.len_kv;
  s.window_q = r.sort_window > 0 ? std::min(r.sort_window, p.len_q) : p.len_q;
  s.window_k = r.sort_window > 0 ? std::min(r.sort_window, p.len_kv) : p.len_kv;
  s.windows_q = (p.len_q + s.window_q - 1) / s.window_q;
  s.windows_k = (p.len_kv + s.window_k - 1) / s.window_k;
  s.index_bits_q = bits_for(static_cast<uint64_t>(s.window_q));
  s.index_bits_k = bits_for(static_cast<uint64_t>(s.window_k));
  s.end_bit_q = s.index_bits_q + 31 + bits_for(static_cast<uint64_t>(p.batch * p.heads_q * s.windows_q));
  s.end_bit_k = s.index_bits_k + 31 + bits_for(static_cast<uint64_t>(p.batch * p.heads_kv * s.windows_k));
  s.kind = feature_kind(p);
  s.F = feature_size(s.kind, p.head_dim);
  s.rows = p.batch * p.heads_q * p.num_q_blocks;
  s.sort_size = static_cast<int>(std::bit_ceil(static_cast<uint64_t>(p.num_kv_blocks)));
  s.global_select = s.sort_size > kMaxSharedSortSize;
  s.select_ctas = static_cast<int>(std::min<int64_t>(s.rows, s.global_select ? 2 * sms : kInt32Max));
  return s;
}

// Rows of x can be read with 16-byte loads: d a multiple of kVector<T>, every row 16-byte aligned.
template <class T>
bool vector_rows(const Tensor& x) {
  constexpr int V = kVector<T>;
  bool ok = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.shape[3] % V == 0;
  for (int d = 0; d < 3; ++d) ok = ok && x.strides[d] % V == 0;
  return ok;
}

template <class T, int kLanes>
Status launch_norm_vector(const Tensor& x, const NormArgs& a, int device, cudaStream_t stream) {
  const auto kernel = norm_keys_vector_kernel<T, kLanes>;
  int sms = 0, per_sm = 0;
  SPARSA_RETURN_IF_ERROR(launch_facts(device, reinterpret_cast<const void*>(kernel), kNormThreads, 0, &sms, &per_sm));
  const int64_t tokens_per_cta = static_cast<int64_t>(kNormThreads / 32) * (32 / kLanes) * kNormTokens;
  const int64_t grid = std::min<int64_t>((a.total + tokens_per_cta - 1) / tokens_per_cta, static_cast<int64_t>(sms) * per_sm);
  kernel<<<static_cast<unsigned>(grid), kNormThreads, 0, stream>>>(input_of<T>(x), a);
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

// Step 1's first kernel (norms, and sort keys when keys != null), vector path when possible.
// tokens < 2^31 (check_request, token_norms), as NormArgs' FastDiv needs. `device` is current.
template <class T>
Status launch_norms(const Tensor& x, int64_t window, int64_t windows, int index_bits, uint64_t* keys, float* norms,
                    ErrorWord* err, int err_slot, int device, cudaStream_t stream) {
  const int64_t tokens = x.shape[0] * x.shape[1] * x.shape[2];
  if (tokens == 0) return {};
  NormArgs a;
  a.total = tokens;
  a.len = FastDiv(static_cast<uint32_t>(x.shape[2]));
  a.heads = FastDiv(static_cast<uint32_t>(x.shape[1]));
  a.window = FastDiv(static_cast<uint32_t>(window));
  a.windows_per_row = windows;
  a.index_bits = index_bits;
  a.keys = keys;
  a.norms = norms;
  a.err = err;
  a.err_slot = err_slot;
  if (vector_rows<T>(x)) {
    // The fewest lanes per token (a power of two, at most 32) covering its 16-byte chunks.
    const int64_t chunks = x.shape[3] / kVector<T>;
    if (chunks <= 1) return launch_norm_vector<T, 1>(x, a, device, stream);
    if (chunks <= 2) return launch_norm_vector<T, 2>(x, a, device, stream);
    if (chunks <= 4) return launch_norm_vector<T, 4>(x, a, device, stream);
    if (chunks <= 8) return launch_norm_vector<T, 8>(x, a, device, stream);
    if (chunks <= 16) return launch_norm_vector<T, 16>(x, a, device, stream);
    return launch_norm_vector<T, 32>(x, a, device, stream);
  }
  const int64_t grid = (tokens + kNormThreads / 32 - 1) / (kNormThreads / 32);
  norm_keys_scalar_kernel<T><<<static_cast<unsigned>(grid), kNormThreads, 0, stream>>>(input_of<T>(x), a);
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

// Step 1 for one input: norms and keys, a keys-only stable radix sort of bits [index_bits,
// end_bit) (norm_key: the token's index rides in the low bits), and perm from the sorted keys.
template <class T>
Status sort_by_norm(const Tensor& x, int64_t tokens, int64_t window, int64_t windows, int index_bits, int end_bit,
                    int err_slot, ErrorWord* err, const SortScratch& w, size_t temp_bytes, int32_t* perm, int device,
                    cudaStream_t stream) {
  if (tokens == 0) return {};
  SPARSA_RETURN_IF_ERROR(
      launch_norms<T>(x, window, windows, index_bits, w.keys_in, nullptr, err, err_slot, device, stream));
  SPARSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(w.temp, temp_bytes, w.keys_in, w.keys_out, tokens, index_bits,
                                                   end_bit, stream));
  int sms = 0, per_sm = 0;
  SPARSA_RETURN_IF_ERROR(
      launch_facts(device, reinterpret_cast<const void*>(perm_from_keys_kernel), kPermThreads, 0, &sms, &per_sm));
  const int64_t grid = std::min<int64_t>((tokens + kPermThreads - 1) / kPermThreads, static_cast<int64_t>(sms) * per_sm);
  perm_from_keys_kernel<<<static_cast<unsigned>(grid), kPermThreads, 0, stream>>>(
      w.keys_out, perm, tokens, FastDiv(static_cast<uint32_t>(x.shape[2])), FastDiv(static_cast<uint32_t>(window)),
      index_bits);
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

template <class T, bool kQuery>
Status features(const Tensor& x, int block, int64_t num_blocks, const int32_t* perm, const BaAttParams& p,
                int kind, int64_t F, float* out, int device, cudaStream_t stream) {
  FeatureArgs a;
  a.kind = kind;
  a.F = F;
  a.scale = p.scale;
  a.c = p.beta * p.scale * p.scale;
  a.block = block;
  a.num_blocks = static_cast<int>(num_blocks);
  a.perm = perm;
  a.features = out;
  const int d = static_cast<int>(p.head_dim);
  const int64_t bh = x.shape[0] * x.shape[1];
  if (bh * num_blocks == 0) return {};
  const int n_max = static_cast<int>(std::min<int64_t>(block, x.shape[2]));
  // block_stats_kernel: plain / diagonal, 16-byte rows, at most kStatThreads chunks per row, a
  // block's rows within kMaxStagedBytes and its permutation entries within the prefetch registers.
  const bool pipelined = (kind == kPlain || kind == kDiagonal) && vector_rows<T>(x) &&
                         d / kVector<T> <= kStatThreads && n_max <= kStatThreads * kStatPermRegs &&
                         static_cast<size_t>(n_max) * d * sizeof(T) <= kMaxStagedBytes;
  if (pipelined) {
    const auto kernel = block_stats_kernel<T, kQuery>;
    const size_t smem = stat_layout(d, n_max, static_cast<int>(sizeof(T))).bytes;
    int sms = 0, per_sm = 0;
    SPARSA_RETURN_IF_ERROR(
        launch_facts(device, reinterpret_cast<const void*>(kernel), kStatThreads, smem, &sms, &per_sm));
    a.items = bh * num_blocks;  // <= tokens < 2^31 (check_request)
    a.blocks_div = FastDiv(static_cast<uint32_t>(num_blocks));
    const int64_t grid = std::min<int64_t>(a.items, static_cast<int64_t>(sms) * per_sm);
    kernel<<<static_cast<unsigned>(grid), kStatThreads, smem, stream>>>(input_of<T>(x), a, n_max);
  } else {
    const auto kernel = block_features_kernel<T, kQuery>;
    const size_t smem = feature_smem_bytes(kind, d);
    SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem));
    const dim3 grid(static_cast<unsigned>(num_blocks), static_cast<unsigned>(bh));
    kernel<<<grid, kFeatureThreads, smem, stream>>>(input_of<T>(x), a);
  }
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

// Reads the error word back into the pinned `host` (the one synchronisation) and names the first
// offending item; *clean says whether the device word is still all ~0.
Status check_errors(const ErrorWord* device_err, ErrorWord* host, const BaAttParams& p, bool* clean,
                    cudaStream_t stream) {
  // Under CUDA-graph capture nothing runs until the graph is launched, and a read-back would end
  // the capture: the selection is captured without it (*clean stays false, so the next call resets
  // the word). Non-finite q/k then go unreported; the plan is still a permutation with in-range
  // block indices, and the NaN reaches the output.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SPARSA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return {};
  SPARSA_CUDA_CHECK(cudaMemcpyAsync(host, device_err, sizeof(ErrorWord), cudaMemcpyDeviceToHost, stream));
  SPARSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const ErrorWord e = *host;
  constexpr unsigned long long kNone = ~0ull;
  *clean = e.first[kErrQNorm] == kNone && e.first[kErrKNorm] == kNone && e.first[kErrLogit] == kNone;
  auto token = [](const char* name, unsigned long long g, int64_t heads, int64_t len) {
    const int64_t bh = static_cast<int64_t>(g) / len, i = static_cast<int64_t>(g) % len;
    using sparsa::detail::shape_string;
    return Status(StatusCode::non_finite, std::string(name) + ": token " + shape_string({bh / heads, bh % heads, i}) +
                                              " has a NaN/Inf norm; cannot sort by norm");
  };
  if (e.first[kErrQNorm] != kNone) return token("q", e.first[kErrQNorm], p.heads_q, p.len_q);
  if (e.first[kErrKNorm] != kNone) return token("k", e.first[kErrKNorm], p.heads_kv, p.len_kv);
  if (e.first[kErrLogit] != kNone) {
    const int64_t i = static_cast<int64_t>(e.first[kErrLogit]);
    const int64_t kb = i % p.num_kv_blocks, qb = (i / p.num_kv_blocks) % p.num_q_blocks,
                  h = (i / (p.num_kv_blocks * p.num_q_blocks)) % p.heads_q,
                  b = i / (p.num_kv_blocks * p.num_q_blocks * p.heads_q);
    return Status(StatusCode::non_finite, "ba_att: block logit " + sparsa::detail::shape_string({b, h, qb, kb}) +
                                              " is not finite (NaN/Inf or overflow in q or k)");
  }
  return {};
}

// Steps 1-3 (and 4 when plan != null). perm_q / perm_kv: device arrays (empty when not sorted);
// host_logits (when not null) receives a copy of the logits.
template <class T>
Status run_typed(const Request& r, BlockIndexBuffer* plan, DeviceArray* perm_q, DeviceArray* perm_kv,
                 HostArray* host_logits) {
  const BaAttParams& p = r.params;
  const int device = p.q.device.id;
  const bool select = plan != nullptr;
  const auto stream = static_cast<cudaStream_t>(r.stream);
  int sms = 0;
  SPARSA_RETURN_IF_ERROR(sm_count(device, &sms));
  Sizes s = size_run(r, sms);

  Workspace& ws = g_workspaces.at(device, stream);
  std::lock_guard<std::mutex> lock(ws.mutex);
  // CUB's scratch size: a host-side computation (no launch), remembered per (items, bits).
  auto sort_temp = [&](int64_t items, int begin_bit, int end_bit, size_t* bytes) -> Status {
    for (const Workspace::SortSize& e : ws.sort_sizes) {
      if (e.items == items && e.begin_bit == begin_bit && e.end_bit == end_bit) {
        *bytes = e.bytes;
        return {};
      }
    }
    SPARSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, *bytes, static_cast<uint64_t*>(nullptr),
                                                     static_cast<uint64_t*>(nullptr), items, begin_bit, end_bit));
    if (ws.sort_sizes.size() >= 16) ws.sort_sizes.erase(ws.sort_sizes.begin());
    ws.sort_sizes.push_back({items, begin_bit, end_bit, *bytes});
    return {};
  };
  if (r.sort_q) SPARSA_RETURN_IF_ERROR(sort_temp(s.tokens_q, s.index_bits_q, s.end_bit_q, &s.sort_temp_q));
  if (r.sort_k) SPARSA_RETURN_IF_ERROR(sort_temp(s.tokens_k, s.index_bits_k, s.end_bit_k, &s.sort_temp_k));
  const bool concurrent = g_concurrent_sides.load(std::memory_order_relaxed);
  g_last_concurrent = false;  // until the side stream is forked below

  Carver measure;
  carve(measure, r, s, select, concurrent);
  bool grew = false;
  SPARSA_RETURN_IF_ERROR(ws.memory.reserve(device, stream, measure.used, &grew));
  if (grew) ws.err_clean = false;
  SPARSA_RETURN_IF_ERROR(ws.host_err.reserve());
  Carver carver{static_cast<char*>(ws.memory.data())};
  const Scratch w = carve(carver, r, s, select, concurrent);
  // The error word starts all ~0 (memset 0xff); after a clean read-back it still is.
  if (!ws.err_clean) SPARSA_CUDA_CHECK(cudaMemsetAsync(w.err, 0xff, sizeof(ErrorWord), stream));
  ws.err_clean = false;  // until this call's read-back finds it clean

  // Steps 1-3 per side: norms, the stable sort into the plan's permutation, block statistics as
  // features. The two sides are independent until the logits, so K's runs on the side stream
  // beside Q's on the default stream: CUB's short, latency-bound passes and the kernels' ramps and
  // tails of one side overlap the other side's streaming kernels instead of leaving the GPU idle
  // between launches. (Serial when the switch in ba_att_hooks.h is off: K then reuses Q's sort
  // buffers.) The plan's arrays are allocated on the call's stream before the fork.
  if (r.sort_q) {
    auto a = DeviceArray::allocate(DType::i32, {p.batch, p.heads_q, p.len_q}, p.q.device, false, r.stream);
    if (!a.ok()) return a.status();
    *perm_q = std::move(a).value();
  }
  if (r.sort_k) {
    auto a = DeviceArray::allocate(DType::i32, {p.batch, p.heads_kv, p.len_kv}, p.q.device, false, r.stream);
    if (!a.ok()) return a.status();
    *perm_kv = std::move(a).value();
  }
  cudaStream_t key_stream = stream;
  if (concurrent) {
    // Created on first use; each handle is kept only once created, so a failure part-way is
    // retried by the next call instead of leaving a null event behind a non-null stream.
    if (ws.side == nullptr) SPARSA_CUDA_CHECK(cudaStreamCreateWithFlags(&ws.side, cudaStreamNonBlocking));
    if (ws.fork == nullptr) SPARSA_CUDA_CHECK(cudaEventCreateWithFlags(&ws.fork, cudaEventDisableTiming));
    if (ws.join == nullptr) SPARSA_CUDA_CHECK(cudaEventCreateWithFlags(&ws.join, cudaEventDisableTiming));
    SPARSA_CUDA_CHECK(cudaEventRecord(ws.fork, stream));
    SPARSA_CUDA_CHECK(cudaStreamWaitEvent(ws.side, ws.fork, 0));
    key_stream = ws.side;
    g_last_concurrent = true;
  }
  // Whatever happens below, the call's stream (and so the next call) waits for the side stream.
  struct Join {
    Workspace* ws = nullptr;
    cudaStream_t stream = nullptr;
    bool pending = false;
    cudaError_t done() {
      if (!pending) return cudaSuccess;
      pending = false;
      cudaError_t e = cudaEventRecord(ws->join, ws->side);
      return e == cudaSuccess ? cudaStreamWaitEvent(stream, ws->join, 0) : e;
    }
    ~Join() {
      if (done() != cudaSuccess) cudaGetLastError();
    }
  } join{&ws, stream, concurrent};

  if (r.sort_k) {
    SPARSA_RETURN_IF_ERROR(sort_by_norm<T>(p.k, s.tokens_k, s.window_k, s.windows_k, s.index_bits_k, s.end_bit_k,
                                           kErrKNorm, w.err, w.sort_k, s.sort_temp_k, perm_kv->ptr<int32_t>(),
                                           device, key_stream));
  }
  const Status key_status = features<T, false>(p.k, p.block_kv, p.num_kv_blocks,
                                               r.sort_k ? perm_kv->ptr<int32_t>() : nullptr, p, s.kind, s.F,
                                               w.key_features, device, key_stream);
  SPARSA_RETURN_IF_ERROR(key_status);
  if (r.sort_q) {
    SPARSA_RETURN_IF_ERROR(sort_by_norm<T>(p.q, s.tokens_q, s.window_q, s.windows_q, s.index_bits_q, s.end_bit_q,
                                           kErrQNorm, w.err, w.sort_q, s.sort_temp_q, perm_q->ptr<int32_t>(),
                                           device, stream));
  }
  const Status query_status = features<T, true>(p.q, p.block_q, p.num_q_blocks,
                                                r.sort_q ? perm_q->ptr<int32_t>() : nullptr, p, s.kind, s.F,
                                                w.query_features, device, stream);
  SPARSA_RETURN_IF_ERROR(query_status);
  SPARSA_CUDA_CHECK(join.done());  // the logits need both sides' features

  g_last_tc_logits = s.F % 4 == 0 && g_tc_logits.load(std::memory_order_relaxed);
  g_last_wgmma_logits = g_last_tc_logits && g_wgmma_logits.load(std::memory_order_relaxed);
  if (g_last_wgmma_logits) {
    const size_t smem = kWgLogitSmemBytes;
    SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(block_logits_wgmma_kernel), device, smem));
    const dim3 grid(static_cast<unsigned>((p.num_kv_blocks + kWgLogitTile - 1) / kWgLogitTile),
                    static_cast<unsigned>((p.num_q_blocks + kWgLogitTile - 1) / kWgLogitTile),
                    static_cast<unsigned>(p.batch * p.heads_q));
    block_logits_wgmma_kernel<<<grid, kWgLogitThreads, smem, stream>>>(
        w.query_features, w.key_features, w.logits, static_cast<int>(p.num_q_blocks),
        static_cast<int>(p.num_kv_blocks), s.F, static_cast<int>(p.heads_q), static_cast<int>(p.group()),
        static_cast<int>(p.heads_kv), w.err);
  } else if (g_last_tc_logits) {
    const dim3 grid(static_cast<unsigned>((p.num_kv_blocks + kTcTile - 1) / kTcTile),
                    static_cast<unsigned>((p.num_q_blocks + kTcTile - 1) / kTcTile),
                    static_cast<unsigned>(p.batch * p.heads_q));
    block_logits_tf32_kernel<<<grid, kTcThreads, 0, stream>>>(w.query_features, w.key_features, w.logits,
                                                   static_cast<int>(p.num_q_blocks), static_cast<int>(p.num_kv_blocks),
                                                   s.F, static_cast<int>(p.heads_q), static_cast<int>(p.group()),
                                                   static_cast<int>(p.heads_kv), w.err);
  } else if (s.F % 4 == 0) {
    const dim3 grid(static_cast<unsigned>((p.num_kv_blocks + kBigTile - 1) / kBigTile),
                    static_cast<unsigned>((p.num_q_blocks + kBigTile - 1) / kBigTile),
                    static_cast<unsigned>(p.batch * p.heads_q));
    block_logits_big_kernel<<<grid, kBigLogitThreads, 0, stream>>>(
        w.query_features, w.key_features, w.logits, static_cast<int>(p.num_q_blocks),
        static_cast<int>(p.num_kv_blocks), s.F, static_cast<int>(p.heads_q), static_cast<int>(p.group()),
        static_cast<int>(p.heads_kv), w.err);
  } else {
    const dim3 grid(static_cast<unsigned>((p.num_kv_blocks + kTile - 1) / kTile),
                    static_cast<unsigned>((p.num_q_blocks + kTile - 1) / kTile),
                    static_cast<unsigned>(p.batch * p.heads_q));
    block_logits_kernel<<<grid, kLogitThreads, 0, stream>>>(w.query_features, w.key_features, w.logits,
                                                 static_cast<int>(p.num_q_blocks), static_cast<int>(p.num_kv_blocks),
                                                 s.F, static_cast<int>(p.heads_q), static_cast<int>(p.group()),
                                                 static_cast<int>(p.heads_kv), w.err);
  }
  SPARSA_CUDA_CHECK_LAUNCH();

  // Step 4: the budget per query block.
  if (select) {
    const int64_t nk = p.num_kv_blocks;
    const int64_t keep = fixed_block_count(r.budget, nk);
    // Mass budgets and mask-aware rows keep a count per row: room for every block.
    const int64_t capacity = r.budget.kind == BudgetKind::mass || r.mask_aware ? nk : keep;
    auto counts = DeviceArray::allocate(DType::i32, {p.batch, p.heads_q, p.num_q_blocks}, p.q.device, false,
                                        r.stream);
    if (!counts.ok()) return counts.status();
    auto indices = DeviceArray::allocate(DType::i32, {p.batch, p.heads_q, p.num_q_blocks, capacity}, p.q.device,
                                         false, r.stream);
    if (!indices.ok()) return indices.status();
    SelectArgs a;
    a.logits = w.logits;
    a.rows = s.rows;
    a.nk = static_cast<int>(nk);
    a.sort_size = s.sort_size;
    a.mass = r.budget.kind == BudgetKind::mass;
    a.keep = static_cast<int>(keep);
    a.tau = r.budget.value;
    a.counts = counts->ptr<int32_t>();
    a.indices = indices->ptr<int32_t>();
    a.capacity = static_cast<int>(capacity);
    a.scratch = w.select_scratch;
    if (r.mask_aware) {  // select_kernel (the sorting one) only
      a.mask_aware = true;
      sparsa::cuda::detail::mask_args(r.mask, &a.mask);
      a.nq = static_cast<int>(p.num_q_blocks);
      a.block_q = p.block_q;
      a.block_kv = p.block_kv;
      a.len_q = static_cast<int>(p.len_q);
      a.len_kv = static_cast<int>(p.len_kv);
      a.top_kappa = r.budget.kind == BudgetKind::top_kappa;
      a.budget = r.budget.value;
    }
    if (!a.mask_aware && !a.mass && nk <= kMaxWarpTopBlocks) {
      const size_t smem = warp_top_smem_bytes(a.nk);
      int sms = 0, per_sm = 0;
      SPARSA_RETURN_IF_ERROR(launch_facts(device, reinterpret_cast<const void*>(select_top_warp_kernel),
                                          kWarpTopWarps * 32, smem, &sms, &per_sm));
      const int64_t grid = std::min<int64_t>((s.rows + kWarpTopWarps - 1) / kWarpTopWarps,
                                             static_cast<int64_t>(sms) * per_sm);
      select_top_warp_kernel<<<static_cast<unsigned>(grid), kWarpTopWarps * 32, smem, stream>>>(a);
    } else if (!a.mask_aware && !a.mass && nk <= kMaxTopBlocks) {
      const size_t smem = static_cast<size_t>(nk) * sizeof(uint32_t);  // at most 32 KiB (kMaxTopBlocks)
      select_top_kernel<<<s.select_ctas, kTopThreads, smem, stream>>>(a);
    } else if (s.global_select) {
      if (a.mask_aware) {
        select_kernel<true, true><<<s.select_ctas, kSelectThreads, 0, stream>>>(a);
      } else {
        select_kernel<true><<<s.select_ctas, kSelectThreads, 0, stream>>>(a);
      }
    } else {
      const size_t smem = select_bytes_per_row(s.sort_size, a.nk);
      constexpr auto plain = select_kernel<false>;
      constexpr auto aware = select_kernel<false, true>;
      const auto kernel = a.mask_aware ? aware : plain;
      SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem));
      kernel<<<s.select_ctas, kSelectThreads, smem, stream>>>(a);
    }
    SPARSA_CUDA_CHECK_LAUNCH();
    plan->block_q = p.block_q;
    plan->block_kv = p.block_kv;
    plan->num_q_blocks = p.num_q_blocks;
    plan->num_kv_blocks = p.num_kv_blocks;
    plan->device_counts = std::move(counts).value();
    plan->device_indices = std::move(indices).value();
  }
  if (host_logits != nullptr) {
    *host_logits = HostArray(DType::f32, {p.batch, p.heads_q, p.num_q_blocks, p.num_kv_blocks});
    SPARSA_CUDA_CHECK(
        cudaMemcpyAsync(host_logits->data(), w.logits, host_logits->nbytes(), cudaMemcpyDeviceToHost, stream));
  }
  return check_errors(w.err, static_cast<ErrorWord*>(ws.host_err.data()), p, &ws.err_clean, stream);
}

Status run(const Request& r, BlockIndexBuffer* plan, HostArray* host_logits, DeviceArray* perm_q,
           DeviceArray* perm_kv) {
  const BaAttParams& p = r.params;
  SPARSA_RETURN_IF_ERROR(check_request(r));
  const int device = p.q.device.id;
  SPARSA_RETURN_IF_ERROR(sparsa::cuda::detail::check_device_id("q", device));
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  SPARSA_RETURN_IF_ERROR(check_pointer("q", p.q.data, device, r.stream));
  SPARSA_RETURN_IF_ERROR(check_pointer("k", p.k.data, device, r.stream));
  switch (p.q.dtype) {
    case DType::bf16: return run_typed<__nv_bfloat16>(r, plan, perm_q, perm_kv, host_logits);
    case DType::f16: return run_typed<__half>(r, plan, perm_q, perm_kv, host_logits);
    case DType::f32: return run_typed<float>(r, plan, perm_q, perm_kv, host_logits);
    case DType::i32: break;
  }
  return unsupported_dtype(std::string("q: the cuda selector takes bf16, f16 or f32, got ") + dtype_name(p.q.dtype));
}

}  // namespace

Status plan(const Request& request, BlockIndexBuffer* plan) {
  BlockIndexBuffer result;
  SPARSA_RETURN_IF_ERROR(run(request, &result, nullptr, &result.device_perm_q, &result.device_perm_kv));
  *plan = std::move(result);
  return {};
}

Status scores(const Request& request, BaAttScores* scores) {
  const BaAttParams& p = request.params;
  BaAttScores s;
  s.block_q = p.block_q;
  s.block_kv = p.block_kv;
  s.num_q_blocks = p.num_q_blocks;
  s.num_kv_blocks = p.num_kv_blocks;
  DeviceArray perm_q, perm_kv;
  SPARSA_RETURN_IF_ERROR(run(request, nullptr, &s.logits, &perm_q, &perm_kv));
  for (auto [from, to] : {std::pair{&perm_q, &s.perm_q}, std::pair{&perm_kv, &s.perm_kv}}) {
    if (from->empty()) continue;
    auto copy = from->to_host();
    if (!copy.ok()) return copy.status();
    *to = std::move(copy).value();
  }
  *scores = std::move(s);
  return {};
}

Status token_norms(const Tensor& x, HostArray* norms) {
  if (x.device.type != DeviceType::cuda || x.ndim != 4) {
    return invalid_argument("x: expected a 4-d tensor on a cuda device, got " + x.shape_string() + " on " +
                            device_name(x.device));
  }
  if (x.shape[0] * x.shape[1] * x.shape[2] > kInt32Max) {
    return invalid_argument("x: expected at most 2^31 - 1 tokens (batch * heads * len), got " +
                            std::to_string(x.shape[0] * x.shape[1] * x.shape[2]));
  }
  const int device = x.device.id;
  SPARSA_RETURN_IF_ERROR(sparsa::cuda::detail::check_device_id("x", device));
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(device));
  SPARSA_RETURN_IF_ERROR(check_pointer("x", x.data, device));
  auto out = DeviceArray::allocate(DType::f32, {x.shape[0], x.shape[1], x.shape[2]}, x.device);
  if (!out.ok()) return out.status();
  // The norm kernel records non-finite norms in an error word; this evaluation helper does not
  // read it back: a NaN/Inf token comes back as a NaN/Inf norm in *norms.
  auto err = DeviceArray::allocate(DType::i32, {static_cast<int64_t>(sizeof(ErrorWord) / 4)}, x.device);
  if (!err.ok()) return err.status();
  SPARSA_CUDA_CHECK(cudaMemsetAsync(err->data(), 0xff, sizeof(ErrorWord), nullptr));
  auto* e = static_cast<ErrorWord*>(err->data());
  const Status launched = [&]() -> Status {
    switch (x.dtype) {
      case DType::bf16: return launch_norms<__nv_bfloat16>(x, 1, 1, 0, nullptr, out->ptr<float>(), e, kErrQNorm, device, nullptr);
      case DType::f16: return launch_norms<__half>(x, 1, 1, 0, nullptr, out->ptr<float>(), e, kErrQNorm, device, nullptr);
      case DType::f32: return launch_norms<float>(x, 1, 1, 0, nullptr, out->ptr<float>(), e, kErrQNorm, device, nullptr);
      case DType::i32: break;
    }
    return unsupported_dtype("x: expected bf16, f16 or f32, got i32");
  }();
  SPARSA_RETURN_IF_ERROR(launched);
  auto host = out->to_host();
  if (!host.ok()) return host.status();
  *norms = std::move(host).value();
  return {};
}

bool set_tensor_core_logits(bool on) { return g_tc_logits.exchange(on); }
bool last_logits_used_tensor_cores() { return g_last_tc_logits; }
bool set_wgmma_logits(bool on) { return g_wgmma_logits.exchange(on); }
bool last_logits_used_wgmma() { return g_last_wgmma_logits; }

bool set_concurrent_sides(bool on) { return g_concurrent_sides.exchange(on); }
bool last_selection_concurrent() { return g_last_concurrent; }

}  // namespace sparsa::ba_att_cuda
