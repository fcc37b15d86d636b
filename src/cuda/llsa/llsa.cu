// The cuda backend of LLSA: the plan (pyramid and coarse-to-fine selection) built on the device,
// the forward and the backward (llsa_kernels.cuh). Inputs are validated by the public entry points
// (src/methods/llsa/llsa.cpp); every kernel, allocation and copy is ordered on the caller's stream
// (LlsaOptions::stream). Device scratch comes from the stream-ordered pool (common/workspace.h) per
// call and is freed on the stream at the end, so nothing here synchronises except the read-back
// of a plan the caller asked to see (llsa_plan).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common/check.h"
#include "cuda/common/device_facts.h"
#include "cuda/common/workspace.h"
#include "cuda/llsa/llsa_kernels.cuh"
#include "methods/llsa/internal.h"
#include "sparsa/attention.h"

namespace sparsa::llsa_cuda {

namespace {

using cuda::detail::allow_dynamic_smem;
using cuda::detail::DeviceGuard;
using cuda::detail::stream_free;
using cuda::detail::stream_malloc;
namespace k = cuda::llsa;

constexpr int64_t kInt32Max = 0x7fffffff;

// Device memory of one call, carved from one allocation and freed on the stream.
class Scratch {
 public:
  Scratch(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~Scratch() {
    if (base_ != nullptr) stream_free(device_, base_, stream_);
  }
  // Reserve `bytes` (256-byte aligned); the pointer is valid after allocate().
  size_t add(size_t bytes) {
    const size_t at = size_;
    size_ += (bytes + 255) / 256 * 256;
    return at;
  }
  Status allocate() { return stream_malloc(device_, std::max<size_t>(size_, 1), stream_, &base_); }
  template <class P>
  P* at(size_t offset) const {
    return reinterpret_cast<P*>(static_cast<uint8_t*>(base_) + offset);
  }

 private:
  int device_;
  cudaStream_t stream_;
  void* base_ = nullptr;
  size_t size_ = 0;
};

// The forward's rung: SPARSA_LLSA_FORWARD_RUNG=1 forces rung 1 (for the kernel ladder and its
// tests); otherwise the fastest that applies.
int forward_rung() {
  const char* env = std::getenv("SPARSA_LLSA_FORWARD_RUNG");
  return env != nullptr && std::string(env) == "1" ? 1 : 2;
}
thread_local int g_last_forward_rung = 0;
thread_local int g_last_forward_fine_keys = 0;

// The fine blocks of the forward and of dQ in 16-key steps, or with SPARSA_LLSA_FINE_STEP=64 in
// 64-key steps (forward<.., WIDE>, backward_dq<.., WIDE>) where those apply (head_dim 64, rung 2
// or 3). The 64-key rung measured slower on an H100 (bench/RESULTS.md, "LLSA's 64-key fine
// steps measured"), so it is opt-in.
bool fine_wide_allowed() {
  const char* env = std::getenv("SPARSA_LLSA_FINE_STEP");
  return env != nullptr && std::string(env) == "64";
}

// The selection's rung: SPARSA_LLSA_SELECT_RUNG=1 forces rung 1 (select_level: a warp per query
// token, candidates from L2), =2 rung 2 (select_level_shared: the query tokens that share
// candidates share their rows in shared memory, a warp per token); otherwise rung 3 where it
// applies (select_level_lanes: a thread per token and part of its candidates, the query in
// registers), rung 2 at the other levels. All give the same picks bit for bit.
int select_rung() {
  const char* env = std::getenv("SPARSA_LLSA_SELECT_RUNG");
  if (env != nullptr && std::string(env) == "1") return 1;
  if (env != nullptr && std::string(env) == "2") return 2;
  return 3;
}

// Whether the `warps` 16-row groups of every CTA (consecutive groups of one head) have the same
// keys at levels >= 1: their query blocks share the level-2 ancestor (always, with one level).
bool shares_coarse_keys(const cuda::llsa::Plan& p, int warps) {
  const int wpb = p.warps_per_block;
  if (wpb % warps == 0) return true;            // a CTA inside one query block
  if (warps % wpb != 0) return false;           // a CTA would split a query block
  return p.L == 1 || p.B % (warps / wpb) == 0;  // whole query blocks, never across a level-2 token
}

int blocks_for(int64_t items, int per_block) { return static_cast<int>((items + per_block - 1) / per_block); }

k::Rows rows_of(const Tensor& t) {
  k::Rows r;
  r.data = t.data;
  for (int d = 0; d < 3; ++d) r.stride[d] = t.strides[d];
  return r;
}

// 16-byte copies need 16-byte aligned bases and token/head/batch strides of whole 8-element chunks.
bool aligned16(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.strides[d] % 8 != 0) return false;
  return true;
}
// 8-byte stores of four 16-bit elements: an 8-byte aligned base and strides of whole 4-element chunks.
bool aligned8(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 8 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.strides[d] % 4 != 0) return false;
  return true;
}
bool aligned4(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.strides[d] % 2 != 0) return false;
  return true;
}

// The plan on the device: the pyramids (f32 for selection, 16-bit k and v for the tensor cores)
// and the picks.
struct DevicePlan {
  k::Plan p;
  std::vector<size_t> pq, pk, pv, k16, v16, picks, counts;  // offsets per level (index l)
};

template <class T>
Status pool(const Tensor& in, int heads, const std::vector<int64_t>& len, int d, int B, int L, const Scratch& s,
            const std::vector<size_t>& f32, const std::vector<size_t>* b16, cudaStream_t stream) {
  // 8 channels a thread where every row allows 16-byte loads (the scratch levels always do).
  const bool vec = d % 8 == 0 && aligned16(in);
  for (int l = 1; l <= L; ++l) {
    const int64_t total = static_cast<int64_t>(in.shape[0]) * heads * len[l] * d;
    const T* src_in = l == 1 ? static_cast<const T*>(in.data) : nullptr;
    const float* src_f32 = l == 1 ? nullptr : s.at<float>(f32[l - 1]);
    T* dst16 = b16 ? s.at<T>((*b16)[l]) : nullptr;
    if (vec) {
      k::pool_level_vec<T><<<blocks_for(total / 8, 256), 256, 0, stream>>>(
          src_in, rows_of(in), src_f32, heads, static_cast<int>(len[l - 1]), d, B, s.at<float>(f32[l]), dst16,
          static_cast<int>(len[l]), total / 8);
    } else {
      k::pool_level<T><<<blocks_for(total, 256), 256, 0, stream>>>(
          src_in, rows_of(in), src_f32, heads, static_cast<int>(len[l - 1]), d, B, s.at<float>(f32[l]), dst16,
          static_cast<int>(len[l]), total);
    }
    SPARSA_CUDA_CHECK_LAUNCH();
  }
  return {};
}

// Sizes the plan's memory in `s` (before s.allocate()).
void size_plan(const Tensor& q, const Tensor& k_, int levels, int topk, bool with_v, bool select, DevicePlan* dp,
               Scratch& s) {
  const int64_t bhq = q.shape[0] * q.shape[1], bhkv = k_.shape[0] * k_.shape[1], d = q.shape[3];
  const int esize = 2;
  for (auto* v : {&dp->pq, &dp->pk, &dp->pv, &dp->k16, &dp->v16, &dp->picks, &dp->counts}) v->assign(levels + 1, 0);
  std::vector<int64_t> len = llsa_detail::level_lengths(q.shape[2], dp->p.B, levels);
  for (int l = 1; l <= levels; ++l) {
    if (select) dp->pq[l] = s.add(bhq * len[l] * d * 4);
    dp->pk[l] = s.add(bhkv * len[l] * d * 4);
    dp->k16[l] = s.add(bhkv * len[l] * d * esize);
    if (with_v) {
      dp->pv[l] = s.add(bhkv * len[l] * d * 4);
      dp->v16[l] = s.add(bhkv * len[l] * d * esize);
    }
    dp->picks[l] = s.add(bhq * len[l] * topk * 4);
    dp->counts[l] = s.add(bhq * len[l] * 4);
  }
}

void fill_plan_view(const Scratch& s, DevicePlan* dp) {
  for (int l = 1; l <= dp->p.L; ++l) {
    dp->p.picks[l] = s.at<int32_t>(dp->picks[l]);
    dp->p.counts[l] = s.at<int32_t>(dp->counts[l]);
    dp->p.k16[l] = s.at<void>(dp->k16[l]);
    dp->p.v16[l] = dp->v16[l] ? s.at<void>(dp->v16[l]) : nullptr;
  }
}

void init_plan(const Tensor& q, const Tensor& k_, int levels, const LlsaOptions& o, DevicePlan* dp) {
  k::Plan& p = dp->p;
  p.B = o.block;
  p.L = levels;
  p.enrich = o.enrich;
  p.dedupe = o.dedupe;
  p.batch = static_cast<int>(q.shape[0]);
  p.heads_q = static_cast<int>(q.shape[1]);
  p.heads_kv = static_cast<int>(k_.shape[1]);
  p.group = p.heads_q / p.heads_kv;
  p.len = static_cast<int>(q.shape[2]);
  p.d = static_cast<int>(q.shape[3]);
  p.warps_per_block = (p.B + k::kTile - 1) / k::kTile;
  const auto len = llsa_detail::level_lengths(q.shape[2], p.B, levels);
  p.K = static_cast<int>(std::min<int64_t>(o.topk, len[1]));
  for (int l = 0; l <= levels; ++l) {
    p.level_len[l] = static_cast<int>(len[l]);
    p.region[l] = static_cast<int>(llsa_detail::region_size(p.B, l, q.shape[2]));
    // The CPU's log2 of the same counts (f32), so both bias the logits alike.
    const int64_t last = len[l] > 0 ? std::min<int64_t>(p.region[l], q.shape[2] - (len[l] - 1) * p.region[l]) : 1;
    p.log2_full[l] = std::log2(static_cast<float>(p.region[l]));
    p.log2_last[l] = std::log2(static_cast<float>(last));
  }
}

// Pools (and selects, or uploads host_plan's picks) into dp, whose memory is in s.
template <class T>
Status build(const Tensor& q, const Tensor& k_, const Tensor* v, const LlsaPlan* host_plan, DevicePlan* dp,
             const Scratch& s, cudaStream_t stream) {
  const k::Plan& p = dp->p;
  const auto len = llsa_detail::level_lengths(p.len, p.B, p.L);
  SPARSA_RETURN_IF_ERROR(pool<T>(k_, p.heads_kv, len, p.d, p.B, p.L, s, dp->pk, &dp->k16, stream));
  if (v) SPARSA_RETURN_IF_ERROR(pool<T>(*v, p.heads_kv, len, p.d, p.B, p.L, s, dp->pv, &dp->v16, stream));
  if (host_plan) {
    for (int l = 1; l <= p.L; ++l) {
      SPARSA_CUDA_CHECK(cudaMemcpyAsync(p.picks[l], host_plan->picks[l - 1].data(),
                                        host_plan->picks[l - 1].numel() * 4, cudaMemcpyHostToDevice, stream));
      SPARSA_CUDA_CHECK(cudaMemcpyAsync(p.counts[l], host_plan->pick_counts[l - 1].data(),
                                        host_plan->pick_counts[l - 1].numel() * 4, cudaMemcpyHostToDevice, stream));
    }
    return {};
  }
  SPARSA_RETURN_IF_ERROR(pool<T>(q, p.heads_q, len, p.d, p.B, p.L, s, dp->pq, nullptr, stream));
  const int kmax = p.K <= 8 ? 8 : p.K <= 16 ? 16 : p.K <= 32 ? 32 : 64;
  if (select_rung() == 1) {
    const int warps = 4;
    const size_t smem = warps * (p.d * sizeof(float) + k::kMaxTopk * sizeof(int));
    auto* kernel = kmax == 8 ? k::select_level<8> : kmax == 16 ? k::select_level<16>
                 : kmax == 32 ? k::select_level<32> : k::select_level<64>;
    for (int l = p.L; l >= 1; --l) {
      const int64_t items = static_cast<int64_t>(p.batch) * p.heads_q * len[l];
      kernel<<<blocks_for(items, warps), 32 * warps, smem, stream>>>(p, l, s.at<float>(dp->pq[l]),
                                                                       s.at<float>(dp->pk[l]));
      SPARSA_CUDA_CHECK_LAUNCH();
    }
    return {};
  }
  // Rungs 2 and 3: a CTA per group of query tokens sharing their candidates (rung 2: kSelectWarps
  // tokens at the coarsest level; rung 3: kSelectTopGroup; one parent's children below it).
  static_assert(k::select_shared_bytes(128) <= 48 * 1024, "head_dim 64 and 128 within the default shared memory");
  static_assert(k::select_lanes_bytes(64, k::kSelectThreads, 16) <= 48 * 1024 &&
                    k::select_lanes_bytes(128, k::kSelectThreads, 16) <= 48 * 1024,
                "rung 3 within the default shared memory");
  auto* shared_kernel = kmax == 8 ? k::select_level_shared<8> : kmax == 16 ? k::select_level_shared<16>
                      : kmax == 32 ? k::select_level_shared<32> : k::select_level_shared<64>;
  auto* lanes_kernel = p.d == 64 ? (kmax == 8 ? k::select_level_lanes<64, 8> : k::select_level_lanes<64, 16>)
                                 : (kmax == 8 ? k::select_level_lanes<128, 8> : k::select_level_lanes<128, 16>);
  for (int l = p.L; l >= 1; --l) {
    const bool lanes = select_rung() == 3 && k::select_lanes_fits(p, l);
    const int per_group = lanes ? k::select_lanes_group(p, l) : k::kSelectWarps;
    const int64_t groups = l == p.L ? (len[l] + per_group - 1) / per_group : len[l + 1];
    const int64_t blocks = static_cast<int64_t>(p.batch) * p.heads_q * groups;
    if (blocks == 0) continue;
    if (lanes) {
      lanes_kernel<<<static_cast<unsigned>(blocks), k::kSelectThreads, k::select_lanes_bytes(p.d, per_group, p.K),
                     stream>>>(p, l, s.at<float>(dp->pq[l]), s.at<float>(dp->pk[l]));
    } else {
      shared_kernel<<<static_cast<unsigned>(blocks), 32 * k::kSelectWarps, k::select_shared_bytes(p.d), stream>>>(
          p, l, s.at<float>(dp->pq[l]), s.at<float>(dp->pk[l]));
    }
    SPARSA_CUDA_CHECK_LAUNCH();
  }
  return {};
}

Status check_sizes(const Tensor& q, const Tensor& k_, int levels, const LlsaOptions& o) {
  const int64_t bhq = q.shape[0] * q.shape[1], len = q.shape[2];
  if (bhq * len > kInt32Max || k_.shape[0] * k_.shape[1] * len > kInt32Max) {
    return invalid_argument("q: batch * heads * len above 2^31 - 1 is not supported on the cuda backend");
  }
  const auto lens = llsa_detail::level_lengths(len, o.block, levels);
  if (bhq * (lens.size() > 2 ? lens[2] : 1) * o.topk > kInt32Max) {
    return invalid_argument("topk: the plan's entries exceed 2^31 - 1 on the cuda backend");
  }
  return {};
}

template <class F>
Status with_dtype(DType dtype, F&& f) {
  if (dtype == DType::bf16) return f(__nv_bfloat16{});
  if (dtype == DType::f16) return f(__half{});
  return unsupported_dtype(std::string("q: the cuda backend of llsa takes bf16 or f16, got ") + dtype_name(dtype));
}

// The row-wise kernels (forward, dQ): rung 2 (KERNEL<.., WARPS, true>: the CTA shares the coarse
// keys) where the CTA's query blocks share their level-2 ancestor, with 8 warps where head_dim 64
// lets two such CTAs share an SM, else 4; rung 1 (per-warp streams) otherwise or when forced.
// row_tiles: the per-warp row tiles (Q; Q and dO). *rung: the rung that ran.
// pick_wide (head_dim 64): pick_wide(4, true) is the wide kernel (64-key fine steps), tried first
// with its own shared memory (k::wide_tiles).
template <int D, class Pick>
Status launch_rowwise(Pick pick, int row_tiles, const k::Plan& p, const k::AttnArgs& a, int device,
                      cudaStream_t stream, int* rung, Pick pick_wide = nullptr) {
  const int64_t bhq = static_cast<int64_t>(p.batch) * p.heads_q;
  const int64_t items = static_cast<int64_t>(p.level_len[1]) * p.warps_per_block;
  const size_t tile = static_cast<size_t>(k::kTile) * D * 2;
  if (forward_rung() != 1 && bhq <= 65535) {
    if (pick_wide != nullptr && shares_coarse_keys(p, 4)) {
      const void* kernel = pick_wide(4, true);
      const size_t smem = k::wide_tiles(4, row_tiles) * tile;
      SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(kernel, device, smem));
      const dim3 grid(static_cast<unsigned>((items + 3) / 4), static_cast<unsigned>(bhq));
      void* args[] = {const_cast<k::Plan*>(&p), const_cast<k::AttnArgs*>(&a)};
      SPARSA_CUDA_CHECK(cudaLaunchKernel(kernel, grid, dim3(32 * 4), args, smem, stream));
      *rung = 2;
      return {};
    }
    for (const int warps : {D == 64 ? 8 : 4, 4}) {
      if (!shares_coarse_keys(p, warps)) continue;
      const void* kernel = pick(warps, true);
      const size_t smem = (warps * k::warp_tiles(row_tiles) + k::shared_tiles()) * tile;
      SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(kernel, device, smem));
      const dim3 grid(static_cast<unsigned>((items + warps - 1) / warps), static_cast<unsigned>(bhq));
      void* args[] = {const_cast<k::Plan*>(&p), const_cast<k::AttnArgs*>(&a)};
      SPARSA_CUDA_CHECK(cudaLaunchKernel(kernel, grid, dim3(32 * warps), args, smem, stream));
      *rung = 2;
      return {};
    }
  }
  const void* kernel = pick(k::kWarps, false);
  const size_t smem = k::kWarps * k::warp_tiles(row_tiles) * tile;
  SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(kernel, device, smem));
  *rung = 1;
  if (bhq * items == 0) return {};
  void* args[] = {const_cast<k::Plan*>(&p), const_cast<k::AttnArgs*>(&a)};
  SPARSA_CUDA_CHECK(cudaLaunchKernel(kernel, dim3(blocks_for(bhq * items, k::kWarps)), dim3(32 * k::kWarps), args,
                                     smem, stream));
  return {};
}

// Kernel pickers: (warps, shared) -> the instantiation.
template <class T, int D>
const void* forward_kernel(int warps, bool shared) {
  if (!shared) return reinterpret_cast<const void*>(k::forward<T, D, k::kWarps, false>);
  return warps == 8 ? reinterpret_cast<const void*>(k::forward<T, D, 8, true>)
                    : reinterpret_cast<const void*>(k::forward<T, D, 4, true>);
}
template <class T, int D>
const void* forward_wide_kernel(int, bool) {
  return reinterpret_cast<const void*>(k::forward<T, D, 4, true, true>);
}
template <class T, int D>
const void* dq_wide_kernel(int, bool) {
  return reinterpret_cast<const void*>(k::backward_dq<T, D, 4, true, true>);
}
template <class T, int D>
const void* dq_kernel(int warps, bool shared) {
  if (!shared) return reinterpret_cast<const void*>(k::backward_dq<T, D, k::kWarps, false>);
  return warps == 8 ? reinterpret_cast<const void*>(k::backward_dq<T, D, 8, true>)
                    : reinterpret_cast<const void*>(k::backward_dq<T, D, 4, true>);
}

k::AttnArgs attn_args(const Call& c) {
  k::AttnArgs a;
  a.q = rows_of(c.q);
  a.k = rows_of(c.k);
  a.v = rows_of(c.v);
  a.o = rows_of(c.out);
  a.lse = static_cast<float*>(c.lse.data);
  for (int d = 0; d < 3; ++d) a.lse_stride[d] = c.lse.strides[d];
  a.scale = c.scale;
  a.scale_log2 = c.scale * k::kLog2e;
  a.aligned = aligned16(c.q) && aligned16(c.k) && aligned16(c.v);
  a.aligned_out = aligned4(c.out);
  if (c.d_o.data) {
    a.d_o = rows_of(c.d_o);
    a.dq = rows_of(c.dq);
    a.aligned = a.aligned && aligned16(c.d_o);
  }
  return a;
}

// The forward's coarsest level, where it leaves the row-wise kernel: every query attends to every
// level-L token, so that part is dense attention of the queries over the level-L pooled keys. Exact
// when every level-L token carries the same weight (len a multiple of B^L: each token's log-weight
// bias is then one constant, which moves the part's LSE and not its output) and nothing is left
// out of the level (no dedupe). It runs first; the row-wise kernel then attends the other levels
// starting each row's online softmax from this part's O and LSE (AttnArgs::init_o), so no merge
// pass follows. Two ways:
//   executor  (rung 3) the dense flash executor, then the LSE raised by log(region);
//   resident  (rung 4) k::coarse_resident: the level's K and V loaded once per CTA into shared
//             memory, 16-row query tiles streamed past them; where K and V fit in shared memory.
// Where each applies by default, from H100 runs (bench/RESULTS.md): the executor's extra call cost
// more than it saved at 64 tokens (16K, two levels: 0.80x rung 2, later 0.92x) and less at 256 (64K,
// 1.04x) and 1,024 (256K, 1.77x), so it takes levels of kCoarseDenseMinTokens or more; the resident
// kernel has no pipeline to fill per 128 rows and was 1.01x rung 2 at 64 tokens (16K), 1.10x at
// 128 (32K) and 1.07x rung 3 at 256 (64K), so it takes levels of kCoarseResidentMinTokens or more
// whose K and V fit in shared memory (at d 64 up to 768 tokens; not 256K's 1,024, where the
// executor runs). Shorter levels stay in the row-wise kernel.
// SPARSA_LLSA_FORWARD_RUNG=1 or 2 keeps the level in the row-wise kernel; =3 takes the executor and
// =4 the resident kernel (the executor where it does not fit) wherever exact, whatever the level's
// length (the tests' short shapes).
constexpr int kCoarseDenseMinTokens = 256;
constexpr int kCoarseResidentMinTokens = 64;

enum class Coarse { in_rowwise, executor, resident };

template <int D>
Status coarse_path(const k::Plan& p, int device, Coarse* path) {
  *path = Coarse::in_rowwise;
  const char* env = std::getenv("SPARSA_LLSA_FORWARD_RUNG");
  const std::string forced = env != nullptr ? env : "";
  const bool exact = p.enrich && !p.dedupe && p.len % p.region[p.L] == 0;
  if (forced == "1" || forced == "2" || !exact) return {};
  if (forced == "3") {
    *path = Coarse::executor;
    return {};
  }
  const int n = p.level_len[p.L];
  int optin = 0;
  SPARSA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const bool fits = k::resident_bytes(D, n) <= static_cast<size_t>(optin) &&
                    static_cast<int64_t>(p.batch) * p.heads_q <= 65535;
  if (forced == "4") {
    *path = fits ? Coarse::resident : Coarse::executor;
  } else if (fits && n >= kCoarseResidentMinTokens) {
    *path = Coarse::resident;
  } else if (n >= kCoarseDenseMinTokens) {
    *path = Coarse::executor;
  }
  return {};
}

// Rung 4: the coarsest level by k::coarse_resident into o2/lse2. One wave of CTAs, rounded down:
// each (batch, q head) gets wave / (batch * heads_q) CTAs (at least one, at most one per 8 query
// tiles), which share its query tiles.
template <class T, int D>
Status coarse_level_resident(const k::AttnArgs& a, const DevicePlan& dp, const Scratch& s, size_t o2_at,
                             size_t lse2_at, int device, cudaStream_t stream) {
  const k::Plan& p = dp.p;
  auto* const kernel = &k::coarse_resident<T, D>;
  const size_t smem = k::resident_bytes(D, p.level_len[p.L]);
  const int threads = 32 * k::kResidentWarps;
  int sms = 0, per_sm = 0;
  SPARSA_RETURN_IF_ERROR(cuda::detail::sm_count(device, &sms));
  SPARSA_RETURN_IF_ERROR(
      cuda::detail::resident_ctas(reinterpret_cast<const void*>(kernel), device, threads, smem, &per_sm));
  const int64_t bhq = static_cast<int64_t>(p.batch) * p.heads_q;
  const int64_t tiles = (p.len + k::kTile - 1) / k::kTile;
  const int64_t splits = std::clamp<int64_t>(static_cast<int64_t>(sms) * per_sm / bhq, 1,
                                             (tiles + k::kResidentWarps - 1) / k::kResidentWarps);
  kernel<<<dim3(static_cast<unsigned>(splits), static_cast<unsigned>(bhq)), threads, smem, stream>>>(
      p, a, s.at<void>(o2_at), s.at<float>(lse2_at), std::log(static_cast<float>(p.region[p.L])));
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

template <class T>
Status coarse_level_dense(const Call& c, const DevicePlan& dp, const Scratch& s, size_t o2_at, size_t lse2_at,
                          int device, cudaStream_t stream) {
  const k::Plan& p = dp.p;
  const DType dt = c.q.dtype;
  const Device dev{DeviceType::cuda, device};
  const int64_t n = p.level_len[p.L];
  const Tensor kc = Tensor::contiguous(s.at<void>(dp.k16[p.L]), dt, {p.batch, p.heads_kv, n, p.d}, dev);
  const Tensor vc = Tensor::contiguous(s.at<void>(dp.v16[p.L]), dt, {p.batch, p.heads_kv, n, p.d}, dev);
  const Tensor o2 = Tensor::contiguous(s.at<void>(o2_at), dt, {p.batch, p.heads_q, p.len, p.d}, dev);
  const Tensor lse2 = Tensor::contiguous(s.at<void>(lse2_at), DType::f32, {p.batch, p.heads_q, p.len}, dev);
  AttentionOptions o;
  o.backend = Backend::cuda;
  o.scale = c.scale;
  o.stream = stream;
  SPARSA_RETURN_IF_ERROR(dense(c.q, kc, vc, o2, lse2, o));
  // Each level-L token stands for B^L tokens: its logits carry + log(B^L), one constant.
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.len;
  k::add_constant<<<static_cast<unsigned>(std::clamp<int64_t>((rows + 255) / 256, 1, 4096)), 256, 0, stream>>>(
      s.at<float>(lse2_at), rows, std::log(static_cast<float>(p.region[p.L])));
  SPARSA_CUDA_CHECK_LAUNCH();
  return {};
}

template <class T, int D>
Status forward_typed(const Call& c, const LlsaPlan* host_plan, int device, cudaStream_t stream) {
  DevicePlan dp;
  init_plan(c.q, c.k, c.levels, c.options, &dp);
  Scratch s(device, stream);
  size_plan(c.q, c.k, c.levels, dp.p.K, true, host_plan == nullptr, &dp, s);
  Coarse coarse = Coarse::in_rowwise;
  SPARSA_RETURN_IF_ERROR(coarse_path<D>(dp.p, device, &coarse));
  const bool coarse_dense = coarse != Coarse::in_rowwise;
  const int64_t rows = static_cast<int64_t>(dp.p.batch) * dp.p.heads_q * dp.p.len;
  const size_t o2_at = coarse_dense ? s.add(static_cast<size_t>(rows) * dp.p.d * 2) : 0;
  const size_t lse2_at = coarse_dense ? s.add(static_cast<size_t>(rows) * 4) : 0;
  SPARSA_RETURN_IF_ERROR(s.allocate());
  fill_plan_view(s, &dp);
  SPARSA_RETURN_IF_ERROR(build<T>(c.q, c.k, &c.v, host_plan, &dp, s, stream));
  k::AttnArgs a = attn_args(c);
  if (coarse_dense) {
    if (coarse == Coarse::resident) {
      SPARSA_RETURN_IF_ERROR((coarse_level_resident<T, D>(a, dp, s, o2_at, lse2_at, device, stream)));
    } else {
      SPARSA_RETURN_IF_ERROR(coarse_level_dense<T>(c, dp, s, o2_at, lse2_at, device, stream));
    }
    a.forward_last_level = dp.p.L - 1;
    a.init_o = s.at<void>(o2_at);
    a.init_lse = s.at<float>(lse2_at);
  }
  bool wide = false;
  const void* (*pick_wide)(int, bool) = nullptr;
  if constexpr (D == 64) {  // head_dim 128: the wide stages would leave one CTA an SM
    wide = fine_wide_allowed();
    if (wide) pick_wide = forward_wide_kernel<T, D>;
  }
  SPARSA_RETURN_IF_ERROR(
      launch_rowwise<D>(forward_kernel<T, D>, 1, dp.p, a, device, stream, &g_last_forward_rung, pick_wide));
  g_last_forward_fine_keys = wide && g_last_forward_rung == 2 && shares_coarse_keys(dp.p, 4) ? 64 : 16;
  if (coarse_dense) g_last_forward_rung = coarse == Coarse::resident ? 4 : 3;
  return {};
}

template <class T, int D>
Status backward_typed(const Call& c, const LlsaPlan* host_plan, int device, cudaStream_t stream) {
  DevicePlan dp;
  init_plan(c.q, c.k, c.levels, c.options, &dp);
  const k::Plan& p = dp.p;
  const int L = p.L, B = p.B;
  const int64_t bhq = static_cast<int64_t>(p.batch) * p.heads_q, bhkv = static_cast<int64_t>(p.batch) * p.heads_kv;
  Scratch s(device, stream);
  size_plan(c.q, c.k, L, p.K, true, host_plan == nullptr, &dp, s);
  const size_t delta_at = s.add(bhq * p.len * 4);
  std::vector<size_t> dk_at(L + 1), dv_at(L + 1);
  for (int l = 0; l <= L; ++l) {
    dk_at[l] = s.add(bhkv * p.level_len[l] * p.d * 4);
    dv_at[l] = s.add(bhkv * p.level_len[l] * p.d * 4);
  }
  // The transposed index of levels l < L: entries (key group, visitor) sorted by key group.
  std::vector<size_t> keys_at(L), vals_at(L), skeys_at(L), svals_at(L), begin_at(L), end_at(L);
  std::vector<int64_t> entries(L), groups(L + 1);
  for (int l = 0; l <= L; ++l) groups[l] = (p.level_len[l] + B - 1) / B;
  size_t sort_bytes = 0;
  for (int l = 0; l < L; ++l) {
    entries[l] = bhq * p.level_len[l + 1] * p.K;
    for (auto* at : {&keys_at[l], &vals_at[l], &skeys_at[l], &svals_at[l]}) *at = s.add(entries[l] * 4);
    begin_at[l] = s.add(bhkv * groups[l] * 4);
    end_at[l] = s.add(bhkv * groups[l] * 4);
    size_t bytes = 0;
    SPARSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                      static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                      static_cast<int32_t*>(nullptr), static_cast<int>(entries[l]), 0,
                                                      32, stream));
    sort_bytes = std::max(sort_bytes, bytes);
  }
  const size_t sort_at = s.add(sort_bytes);
  // The coarsest level's splits: enough warps to fill the device, each over >= 4 query blocks.
  const int tpg = (B + k::kTile - 1) / k::kTile;
  const int64_t tiles_L = bhkv * groups[L] * tpg;
  const int64_t rows_L = static_cast<int64_t>(p.group) * p.level_len[1];
  const int splits = static_cast<int>(std::clamp<int64_t>((16384 + tiles_L - 1) / tiles_L, 1,
                                                          std::max<int64_t>(1, rows_L / 4)));
  const int64_t split_stride = bhkv * p.level_len[L] * p.d;
  const size_t split_k_at = splits > 1 ? s.add(splits * split_stride * 4) : 0;
  const size_t split_v_at = splits > 1 ? s.add(splits * split_stride * 4) : 0;
  SPARSA_RETURN_IF_ERROR(s.allocate());
  fill_plan_view(s, &dp);
  SPARSA_RETURN_IF_ERROR(build<T>(c.q, c.k, &c.v, host_plan, &dp, s, stream));

  k::AttnArgs a = attn_args(c);
  float* delta = s.at<float>(delta_at);
  a.delta = delta;
  for (int l = 0; l <= L; ++l) {
    a.dk_pyr[l] = s.at<float>(dk_at[l]);
    a.dv_pyr[l] = s.at<float>(dv_at[l]);
  }
  if (splits > 1) {
    a.dk_split = s.at<float>(split_k_at);
    a.dv_split = s.at<float>(split_v_at);
  }
  a.splits = splits;
  k::backward_delta<T><<<blocks_for(bhq * p.len, 8), 256, 0, stream>>>(p, a, delta);
  SPARSA_CUDA_CHECK_LAUNCH();
  for (int l = 0; l < L; ++l) {
    const int32_t sentinel = static_cast<int32_t>(bhkv * groups[l]);
    int end_bit = 1;
    while (end_bit < 32 && (int64_t{1} << end_bit) <= sentinel) ++end_bit;
    k::visit_entries<<<blocks_for(entries[l], 256), 256, 0, stream>>>(p, l, s.at<int32_t>(keys_at[l]),
                                                                       s.at<int32_t>(vals_at[l]), sentinel, entries[l]);
    SPARSA_CUDA_CHECK_LAUNCH();
    size_t bytes = sort_bytes;
    SPARSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.at<void>(sort_at), bytes, s.at<int32_t>(keys_at[l]),
                                                      s.at<int32_t>(skeys_at[l]), s.at<int32_t>(vals_at[l]),
                                                      s.at<int32_t>(svals_at[l]), static_cast<int>(entries[l]), 0,
                                                      end_bit, stream));
    SPARSA_CUDA_CHECK(cudaMemsetAsync(s.at<void>(begin_at[l]), 0, bhkv * groups[l] * 4, stream));
    SPARSA_CUDA_CHECK(cudaMemsetAsync(s.at<void>(end_at[l]), 0, bhkv * groups[l] * 4, stream));
    k::visit_ranges<<<blocks_for(entries[l], 256), 256, 0, stream>>>(s.at<int32_t>(skeys_at[l]), entries[l], sentinel,
                                                                      s.at<int32_t>(begin_at[l]),
                                                                      s.at<int32_t>(end_at[l]));
    SPARSA_CUDA_CHECK_LAUNCH();
    a.visitors[l] = s.at<int32_t>(svals_at[l]);
    a.visit_begin[l] = s.at<int32_t>(begin_at[l]);
    a.visit_end[l] = s.at<int32_t>(end_at[l]);
  }
  int dq_rung = 0;
  const void* (*pick_wide)(int, bool) = nullptr;
  if constexpr (D == 64) {
    if (fine_wide_allowed()) pick_wide = dq_wide_kernel<T, D>;
  }
  SPARSA_RETURN_IF_ERROR(launch_rowwise<D>(dq_kernel<T, D>, 2, p, a, device, stream, &dq_rung, pick_wide));
  const size_t dkv_smem = static_cast<size_t>(k::kWarps) * 6 * k::kTile * D * 2;
  SPARSA_RETURN_IF_ERROR(allow_dynamic_smem(reinterpret_cast<const void*>(k::backward_dkv<T, D>), device, dkv_smem));
  // Without enrichment only the fine keys are visited: the coarse levels get no gradient.
  const int grad_levels = p.enrich ? L : 0;
  for (int l = 0; l <= grad_levels; ++l) {
    const int sp = l == L ? splits : 1;
    const int64_t warps = bhkv * groups[l] * tpg * sp;
    k::backward_dkv<T, D><<<blocks_for(warps, k::kWarps), 32 * k::kWarps, dkv_smem, stream>>>(p, a, l, tpg, sp);
    SPARSA_CUDA_CHECK_LAUNCH();
  }
  if (grad_levels == L && splits > 1) {
    k::sum_splits<<<blocks_for(split_stride, 256), 256, 0, stream>>>(a.dk_split, splits, split_stride, a.dk_pyr[L]);
    SPARSA_CUDA_CHECK_LAUNCH();
    k::sum_splits<<<blocks_for(split_stride, 256), 256, 0, stream>>>(a.dv_split, splits, split_stride, a.dv_pyr[L]);
    SPARSA_CUDA_CHECK_LAUNCH();
  }
  // Levels grad_levels .. 2 spread to their children here; level 1's spread is fused into the
  // store of level 0.
  for (int l = grad_levels; l >= 2; --l) {
    const int64_t total = bhkv * p.level_len[l - 1] * p.d;
    for (float* const* pyr : {a.dk_pyr, a.dv_pyr}) {
      k::pool_backward<<<blocks_for(total, 256), 256, 0, stream>>>(pyr[l], pyr[l - 1], p.level_len[l - 1],
                                                                   p.level_len[l], p.d, B, total);
      SPARSA_CUDA_CHECK_LAUNCH();
    }
  }
  const int64_t rows = bhkv * p.len;
  const int rows_per_block = 256 / (p.d / 4);
  for (const auto& [pyr, out] : {std::pair{a.dk_pyr, &c.dk}, std::pair{a.dv_pyr, &c.dv}}) {
    k::store_grad<T><<<blocks_for(rows, rows_per_block), 256, 0, stream>>>(
        pyr[0], grad_levels >= 1 ? pyr[1] : nullptr, rows_of(*out), p.heads_kv, p.len, p.level_len[1], p.d, B, rows,
        aligned8(*out));
    SPARSA_CUDA_CHECK_LAUNCH();
  }
  return {};
}

template <class F>
Status with_head_dim(int64_t d, F&& f) {
  if (d == 64) return f(std::integral_constant<int, 64>{});
  if (d == 128) return f(std::integral_constant<int, 128>{});
  return {StatusCode::unsupported,
          "q: the cuda backend of llsa takes head_dim 64 or 128, got " + std::to_string(d) + " (use cpu)"};
}

}  // namespace

int last_forward_rung() { return g_last_forward_rung; }
int last_forward_fine_keys() { return g_last_forward_fine_keys; }

Status check(const Tensor& q, const Tensor& k_, int levels, const LlsaOptions& o) {
  if (o.topk > k::kMaxTopk) {
    return {StatusCode::unsupported,
            "topk: the cuda backend of llsa takes topk <= " + std::to_string(k::kMaxTopk) + ", got " + std::to_string(o.topk)};
  }
  if (levels > k::kMaxLevels) return invalid_argument("levels: at most 16 on the cuda backend");
  auto nothing = [](auto) { return Status{}; };
  SPARSA_RETURN_IF_ERROR(with_head_dim(q.shape[3], nothing));
  SPARSA_RETURN_IF_ERROR(with_dtype(q.dtype, nothing));
  return check_sizes(q, k_, levels, o);
}

Status plan(const Tensor& q, const Tensor& k_, const LlsaOptions& o, int levels, LlsaPlan* out) {
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(q.device.id));
  auto stream = static_cast<cudaStream_t>(o.stream);
  SPARSA_RETURN_IF_ERROR(cuda::detail::check_pointer("q", q.data, q.device.id, o.stream));
  SPARSA_RETURN_IF_ERROR(cuda::detail::check_pointer("k", k_.data, q.device.id, o.stream));
  *out = llsa_detail::empty_plan(q, k_, o, levels);
  if (q.shape[2] == 0) return {};
  DevicePlan dp;
  init_plan(q, k_, levels, o, &dp);
  Scratch s(q.device.id, stream);
  size_plan(q, k_, levels, dp.p.K, false, true, &dp, s);
  SPARSA_RETURN_IF_ERROR(s.allocate());
  fill_plan_view(s, &dp);
  SPARSA_RETURN_IF_ERROR(with_dtype(q.dtype, [&](auto t) {
    using T = decltype(t);
    return build<T>(q, k_, nullptr, nullptr, &dp, s, stream);
  }));
  for (int l = 1; l <= levels; ++l) {
    SPARSA_CUDA_CHECK(cudaMemcpyAsync(out->picks[l - 1].data(), dp.p.picks[l], out->picks[l - 1].numel() * 4,
                                      cudaMemcpyDeviceToHost, stream));
    SPARSA_CUDA_CHECK(cudaMemcpyAsync(out->pick_counts[l - 1].data(), dp.p.counts[l],
                                      out->pick_counts[l - 1].numel() * 4, cudaMemcpyDeviceToHost, stream));
  }
  SPARSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {};
}

// Every tensor of the call is device memory of q's device (a tensor's device field is the caller's
// word; the pointer is checked).
Status check_pointers(const Call& c) {
  const std::pair<const char*, const Tensor*> all[] = {{"q", &c.q},     {"k", &c.k},   {"v", &c.v},
                                                       {"out", &c.out}, {"lse", &c.lse}, {"d_o", &c.d_o},
                                                       {"dq", &c.dq},   {"dk", &c.dk}, {"dv", &c.dv}};
  for (auto [name, t] : all) {
    if (t->data != nullptr && t->numel() > 0) {
      SPARSA_RETURN_IF_ERROR(cuda::detail::check_pointer(name, t->data, c.q.device.id, c.options.stream));
    }
  }
  return {};
}

// The call on q's device, its pointers checked, run as run<T, D>(call, host_plan, device, stream).
template <class Run>
Status dispatch(const Call& c, Run&& run) {
  if (c.q.shape[2] == 0) return {};
  DeviceGuard guard;
  SPARSA_RETURN_IF_ERROR(guard.enter(c.q.device.id));
  SPARSA_RETURN_IF_ERROR(check_pointers(c));
  auto stream = static_cast<cudaStream_t>(c.options.stream);
  return with_dtype(c.q.dtype, [&](auto t) {
    return with_head_dim(c.q.shape[3], [&](auto dim) {
      return run(t, dim, c.q.device.id, stream);
    });
  });
}

Status forward(const Call& c, const LlsaPlan* host_plan) {
  return dispatch(c, [&](auto t, auto dim, int device, cudaStream_t stream) {
    return forward_typed<decltype(t), decltype(dim)::value>(c, host_plan, device, stream);
  });
}

Status backward(const Call& c, const LlsaPlan* host_plan) {
  return dispatch(c, [&](auto t, auto dim, int device, cudaStream_t stream) {
    return backward_typed<decltype(t), decltype(dim)::value>(c, host_plan, device, stream);
  });
}

}  // namespace sparsa::llsa_cuda
