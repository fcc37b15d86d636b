// A C ABI over the executors for benchmark scripts (ctypes): contiguous [B, H, L, D] device
// tensors, an optional device BlockIndex (counts == nullptr: dense), timed with CUDA events.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/attention/route.h"
#include "cuda/select/ba_att_hooks.h"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"

using namespace sparsa;

namespace {

struct Call {
  Tensor q, k, v, out, lse;
  BlockIndex index;
  bool sparse = false;
};

bool g_check_index = true;  // sparsa_bench_set_check_index

Status run(const Call& c) {
  AttentionOptions opt;
  opt.backend = Backend::cuda;
  opt.check_index = g_check_index;
  return c.sparse ? block_sparse(c.q, c.k, c.v, c.index, c.out, c.lse, opt) : dense(c.q, c.k, c.v, c.out, c.lse, opt);
}

// Contiguous [B, H, L, D] device tensors of one call (no plan yet).
Call dense_call(void* q, void* k, void* v, void* out, void* lse, int is_f16, int64_t batch, int64_t heads_q,
                int64_t heads_kv, int64_t len_q, int64_t len_kv, int64_t head_dim) {
  const Device gpu{DeviceType::cuda, 0};
  const DType dt = is_f16 ? DType::f16 : DType::bf16;
  Call c;
  c.q = Tensor::contiguous(q, dt, {batch, heads_q, len_q, head_dim}, gpu);
  c.k = Tensor::contiguous(k, dt, {batch, heads_kv, len_kv, head_dim}, gpu);
  c.v = Tensor::contiguous(v, dt, {batch, heads_kv, len_kv, head_dim}, gpu);
  c.out = Tensor::contiguous(out, dt, {batch, heads_q, len_q, head_dim}, gpu);
  c.lse = Tensor::contiguous(lse, DType::f32, {batch, heads_q, len_q}, gpu);
  return c;
}

// The shim's error convention: the message into err, status 1.
int report(char* err, int err_len, const std::string& msg) {
  std::snprintf(err, err_len, "%s", msg.c_str());
  return 1;
}

// The one timing loop of the shim: max(warmup, 1) untimed calls of f, then `iters` samples, each
// the time of `reps` back-to-back calls between two CUDA events divided by reps; *median_ms gets
// their median (untouched when iters = 0). Returns "" or the error.
template <class F>
std::string time_median(F&& f, int warmup, int iters, int reps, float* median_ms) {
  for (int i = 0; i < std::max(warmup, 1); ++i) {
    const Status st = f();
    if (!st.ok()) return st.to_string();
  }
  if (cudaDeviceSynchronize() != cudaSuccess) return cudaGetErrorString(cudaGetLastError());
  struct Events {
    cudaEvent_t start = nullptr, stop = nullptr;
    Events() {
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
    }
    ~Events() {
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
  } ev;
  reps = std::max(reps, 1);
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(ev.start);
    for (int r = 0; r < reps; ++r) {
      const Status st = f();
      if (!st.ok()) return st.to_string();
    }
    cudaEventRecord(ev.stop);
    if (cudaEventSynchronize(ev.stop) != cudaSuccess) return cudaGetErrorString(cudaGetLastError());
    float ms = 0;
    cudaEventElapsedTime(&ms, ev.start, ev.stop);
    times.push_back(ms / reps);
  }
  if (!times.empty()) {
    std::sort(times.begin(), times.end());
    *median_ms = times[times.size() / 2];
  }
  return {};
}

}  // namespace

extern "C" {

// Runs the executor `warmup + iters` times; *median_ms receives the median of the timed runs
// (iters = 0: one untimed run). Returns 0, or 1 with the Status message in err.
int sparsa_bench_attention(void* q, void* k, void* v, void* out, void* lse, int is_f16, int64_t batch,
                           int64_t heads_q, int64_t heads_kv, int64_t len_q, int64_t len_kv, int64_t head_dim,
                           const int32_t* counts, const int32_t* indices, int64_t capacity, int block_q,
                           int block_kv, int warmup, int iters, float* median_ms, char* err, int err_len) {
  const Device gpu{DeviceType::cuda, 0};
  Call c = dense_call(q, k, v, out, lse, is_f16, batch, heads_q, heads_kv, len_q, len_kv, head_dim);
  if (counts != nullptr) {
    c.sparse = true;
    const int64_t nq = (len_q + block_q - 1) / block_q, nkv = (len_kv + block_kv - 1) / block_kv;
    c.index.block_q = block_q;
    c.index.block_kv = block_kv;
    c.index.num_q_blocks = nq;
    c.index.num_kv_blocks = nkv;
    c.index.counts = Tensor::contiguous(const_cast<int32_t*>(counts), DType::i32, {batch, heads_q, nq}, gpu);
    c.index.indices =
        Tensor::contiguous(const_cast<int32_t*>(indices), DType::i32, {batch, heads_q, nq, capacity}, gpu);
  }
  auto fail = [&](const std::string& msg) { return report(err, err_len, msg); };
  const std::string e = time_median([&] { return run(c); }, warmup, iters, 1, median_ms);
  if (!e.empty()) return fail(e);
  return 0;
}

// Dense only, timed as loops: *median_ms receives the median over `iters` samples of (time of
// `reps` back-to-back calls between two events) / reps. For kernels of tens of microseconds, where
// one call's host-side work would otherwise sit inside its own timing.
int sparsa_bench_dense_loop(void* q, void* k, void* v, void* out, void* lse, int is_f16, int64_t batch,
                            int64_t heads_q, int64_t heads_kv, int64_t len_q, int64_t len_kv, int64_t head_dim,
                            int warmup, int reps, int iters, float* median_ms, char* err, int err_len) {
  Call c = dense_call(q, k, v, out, lse, is_f16, batch, heads_q, heads_kv, len_q, len_kv, head_dim);
  auto fail = [&](const std::string& msg) { return report(err, err_len, msg); };
  const std::string e = time_median([&] { return run(c); }, warmup, iters, reps, median_ms);
  if (!e.empty()) return fail(e);
  return 0;
}

// ---- BA-Att on the device: selection alone, the executor alone, both end to end -----------------
// Contiguous bf16/f16 [batch, heads, len, head_dim] device tensors (self-attention: len_q = len_kv),
// block x block blocks, budget = density (a fraction of key blocks per query block), the defaults
// otherwise (global norm sort of q and k, diagonal compensation, beta 1). Each time is the median
// of `iters` CUDA-event-timed calls after `warmup` untimed ones:
//   *select_ms   ba_att_plan(Backend::cuda) (it ends with one device synchronisation: its error check);
//   *executor_ms block_sparse on that plan (trusted: no device check, as in ba_att);
//   *total_ms    ba_att(q, k, v, out, lse) (plan + executor, what a caller pays);
//   *visited     the fraction of (query, key) token pairs the plan visits.
int sparsa_bench_ba_att(void* q, void* k, void* v, void* out, void* lse, int is_f16, int64_t batch, int64_t heads_q,
                        int64_t heads_kv, int64_t len, int64_t head_dim, int block, double density, int warmup,
                        int iters, float* select_ms, float* executor_ms, float* total_ms, double* visited, char* err,
                        int err_len) {
  const Call c = dense_call(q, k, v, out, lse, is_f16, batch, heads_q, heads_kv, len, len, head_dim);
  const Tensor &tq = c.q, &tk = c.k, &tv = c.v, &tout = c.out, &tlse = c.lse;
  BaAttOptions o;
  o.block_q = o.block_kv = block;
  o.budget = Budget::density(density);
  o.backend = Backend::cuda;
  AttentionOptions exec;
  exec.backend = Backend::cuda;
  exec.check_index = false;  // the plan ba_att_plan just made, trusted as ba_att does
  auto fail = [&](const std::string& msg) { return report(err, err_len, msg); };
  auto time = [&](auto&& f, float* median_ms) { return time_median(f, warmup, iters, 1, median_ms); };
  BlockIndexBuffer plan;
  std::string e = time(
      [&]() -> Status {
        auto p = ba_att_plan(tq, tk, o);
        if (!p.ok()) return p.status();
        plan = std::move(p).value();
        return {};
      },
      select_ms);
  if (!e.empty()) return fail(e);
  auto host = plan.to_host();
  if (!host.ok()) return fail(host.status().to_string());
  *visited = block_index_density(host->view(), len, len);
  const BlockIndex index = plan.view();
  e = time([&] { return block_sparse(tq, tk, tv, index, tout, tlse, exec); }, executor_ms);
  if (!e.empty()) return fail(e);
  e = time([&] { return ba_att(tq, tk, tv, tout, tlse, o); }, total_ms);
  if (!e.empty()) return fail(e);
  return 0;
}

// 0: the flash executor's TMA kernel (rung 3) is not used, so rung 2 runs; 1: the default.
void sparsa_bench_set_flash_tma(int on) { sparsa::cuda::detail::set_flash_tma(on != 0); }
// Rung 3's consumer schedule (flash_tma_kernel.cuh): 0 plain, 1 ping-pong, 2 ping-pong with each
// warpgroup's softmax overlapping its previous P V (the default), 3 late P V without turns.
// Returns the previous one.
int sparsa_bench_set_flash_schedule(int schedule) {
  return static_cast<int>(
      sparsa::cuda::detail::set_flash_schedule(static_cast<sparsa::cuda::detail::FlashSchedule>(schedule)));
}
// Rung 3's key tile for dense calls at head_dim 128 without a mask: 128 (the default) or 176.
void sparsa_bench_set_flash_dense_key_tile(int tile) { sparsa::cuda::detail::set_flash_dense_key_tile(tile); }
// 1: block_sparse checks the plan's contents on the device (AttentionOptions::check_index, the
// default); 0: the plan is trusted (sparsa_bench_attention only).
void sparsa_bench_set_check_index(int on) { g_check_index = on != 0; }
// Allows (1) or forbids (0) the split-KV executor's wgmma + TMA kernel (rung 2); rung 1 otherwise.
void sparsa_bench_set_split_kv_tma(int on) { sparsa::cuda::detail::set_split_kv_tma(on != 0); }

// Allows (1) or forbids (0) BA-Att's tensor-core logits kernel; 0 takes the SIMT f32 kernel.
void sparsa_bench_set_ba_att_tensor_core_logits(int on) { sparsa::ba_att_cuda::set_tensor_core_logits(on != 0); }
// Allows (1) or forbids (0) the wgmma kernel among BA-Att's tensor-core logits kernels; 0 takes
// the mma.sync one.
void sparsa_bench_set_ba_att_wgmma_logits(int on) { sparsa::ba_att_cuda::set_wgmma_logits(on != 0); }

// Allows (1) or forbids (0) BA-Att's key side on a second stream beside the query side.
void sparsa_bench_set_ba_att_concurrent_sides(int on) { sparsa::ba_att_cuda::set_concurrent_sides(on != 0); }

}  // extern "C"
