// Block-diffusion prefix attention on the device (sparsa/device_losa.h): the time of one step
// (prefix plus intra-block attention, merged) for dense (the split-KV executor over the whole
// prefix), QUEST (every row selects every step) and LoSA (the active rows only), at prefixes of
// 32K, 64K and 128K tokens; a batch of 8 sequences of 8K-64K; budgets x active_k swept at 64K.
// Shape of Trado / SDAR-8B: 32 query / 8 kv heads, head_dim 128, bf16, blocks of 16, pages of 16.
// Times: CUDA events around each step, the median of the steps after a block's first. Bytes: K+V
// of the prefix for dense; for QUEST/LoSA the page metadata (min and max) plus the pages of the
// per-kv-head union of the plan (read back after timing), against 4.8 TB/s.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/device_losa.h"

using namespace sparsa;

namespace {

constexpr int64_t kHeadsQ = 32, kHeadsKv = 8, kD = 128, kBlock = 16, kPage = 16;
constexpr double kHbm = 4.8e12;

#define CHECK(x)                                                           \
  do {                                                                     \
    const Status s_ = (x);                                                 \
    if (!s_.ok()) {                                                        \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.to_string().c_str()); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

// bf16 N(0, 1)-ish values (a fast generator: the 256 MB prefix would take long with std::normal).
std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed) {
  std::vector<uint16_t> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    // Sum of 4 uniforms, centred: roughly normal, variance 1/3 * 4 / 4.
    double s = 0;
    for (int j = 0; j < 4; ++j) s += static_cast<double>((x >> (16 * j)) & 0xffff) / 65535.0;
    out[i] = float_to_bf16(static_cast<float>((s - 2.0) * 1.7));
  }
  return out;
}

DeviceArray upload(const std::vector<uint16_t>& host, std::vector<int64_t> shape) {
  auto a = DeviceArray::allocate(DType::bf16, std::move(shape), {DeviceType::cuda, 0});
  CHECK(a.status());
  cudaMemcpy(a->data(), host.data(), host.size() * 2, cudaMemcpyHostToDevice);
  return std::move(a).value();
}

struct StepTime {
  double ms = 0;          // median step
  double bytes = 0;       // per step, estimated as above
  double pages_frac = 0;  // union pages / prefix pages (sparse)
};

// `steps` timed steps after a first (dense) step, on `batch` sequences of the given lengths.
// graph: the step captured once (after the timed eager steps) and its replays timed instead.
StepTime run(DevicePagedKVCache& cache, const std::vector<int>& seqs, const std::vector<int64_t>& lengths,
           PrefixMethod method, int64_t budget, int active_k, int steps, bool graph = false) {
  const int64_t B = static_cast<int64_t>(seqs.size());
  LosaOptions o;
  o.method = method;
  o.select.budget = budget;
  o.select.force_first = true;
  o.select.force_last = true;
  o.active_k = active_k;
  o.attention.backend = Backend::cuda;
  DeviceLosaConfig c{B, kHeadsQ, kHeadsKv, kD, kBlock};
  auto state = DevicePrefixAttention::create(c, o);
  CHECK(state.status());
  const int64_t qn = B * kHeadsQ * kBlock * kD, kvn = B * kHeadsKv * kBlock * kD;
  std::vector<uint16_t> q = random_bf16(qn, 7);
  const DeviceArray k = upload(random_bf16(kvn, 8), {B, kHeadsKv, kBlock, kD});
  const DeviceArray v = upload(random_bf16(kvn, 9), {B, kHeadsKv, kBlock, kD});
  auto dq = DeviceArray::allocate(DType::bf16, {B, kHeadsQ, kBlock, kD}, {DeviceType::cuda, 0});
  auto out = DeviceArray::allocate(DType::bf16, {B, kHeadsQ, kBlock, kD}, {DeviceType::cuda, 0});
  auto lse = DeviceArray::allocate(DType::f32, {B, kHeadsQ, kBlock}, {DeviceType::cuda, 0});
  CHECK(dq.status());
  std::mt19937 rng(11);
  std::vector<float> times;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  StepTime r;
  for (int step = 0; step <= steps + 2; ++step) {
    // Two rows per entry jump (newly unmasked tokens), the rest drift.
    for (int64_t b = 0; b < B; ++b) {
      const int64_t j1 = rng() % kBlock, j2 = rng() % kBlock;
      for (int64_t h = 0; h < kHeadsQ; ++h)
        for (int64_t i = 0; i < kBlock; ++i) {
          const float move = (i == j1 || i == j2) ? 1.0f : 0.02f;
          uint16_t* row = q.data() + ((b * kHeadsQ + h) * kBlock + i) * kD;
          for (int64_t e = 0; e < kD; ++e) {
            const float u = static_cast<float>(rng() % 2001) / 1000.0f - 1.0f;
            row[e] = float_to_bf16(bf16_to_float(row[e]) + move * u);
          }
        }
    }
    cudaMemcpy(dq->data(), q.data(), qn * 2, cudaMemcpyHostToDevice);
    cudaEventRecord(start);
    CHECK(state->step(cache, seqs, dq->view(), k.view(), v.view(), out->view(), lse->view()));
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (step >= 3) times.push_back(ms);  // after the first (dense) step and two warm-ups
  }
  if (graph) {
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaGraph_t g;
    cudaGraphExec_t exec;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
    CHECK(state->step(cache, seqs, dq->view(), k.view(), v.view(), out->view(), lse->view(), stream));
    cudaStreamEndCapture(stream, &g);
    cudaGraphInstantiate(&exec, g, 0);
    times.clear();
    for (int i = 0; i < steps + 3; ++i) {
      cudaEventRecord(start, stream);
      cudaGraphLaunch(exec, stream);
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (i >= 3) times.push_back(ms);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  }
  std::sort(times.begin(), times.end());
  r.ms = times[times.size() / 2];
  int64_t prefix_pages = 0, prefix_tokens = 0;
  for (int64_t len : lengths) prefix_pages += (len + kPage - 1) / kPage, prefix_tokens += len;
  if (method == PrefixMethod::dense) {
    r.bytes = static_cast<double>(prefix_tokens) * kHeadsKv * kD * 2 * 2;
    r.pages_frac = 1.0;
  } else {
    // The last step's plan: the union of pages per (entry, kv head).
    const int64_t cap = state->plan_capacity();
    std::vector<int32_t> pages(state->plan_pages().numel()), counts(state->plan_counts().numel()),
        active_counts(B);
    cudaMemcpy(pages.data(), state->plan_pages().data(), pages.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(counts.data(), state->plan_counts().data(), counts.size() * 4, cudaMemcpyDeviceToHost);
    int64_t union_pages = 0;
    const int64_t group = kHeadsQ / kHeadsKv;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hk = 0; hk < kHeadsKv; ++hk) {
        std::set<int32_t> u;
        for (int64_t g = 0; g < group; ++g)
          for (int64_t slot = 0; slot < kBlock; ++slot) {
            const int64_t row = (b * kHeadsQ + hk * group + g) * kBlock + slot;
            for (int32_t i = 0; i < counts[row]; ++i) u.insert(pages[row * cap + i]);
          }
        union_pages += static_cast<int64_t>(u.size());
      }
    r.bytes = static_cast<double>(prefix_pages) * kHeadsKv * kD * 2 * 2 +  // min and max
              static_cast<double>(union_pages) * kPage * kD * 2 * 2;       // K and V of the union
    r.pages_frac = static_cast<double>(union_pages) / (static_cast<double>(prefix_pages) * kHeadsKv);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return r;
}

// The bare split-KV executor over the prefix (16 queries), for reference.
double split_kv_ms(const DevicePagedKVCache& cache, int seq) {
  auto q = DeviceArray::allocate(DType::bf16, {1, kHeadsQ, kBlock, kD}, {DeviceType::cuda, 0}, true);
  auto out = DeviceArray::allocate(DType::bf16, {1, kHeadsQ, kBlock, kD}, {DeviceType::cuda, 0});
  auto lse = DeviceArray::allocate(DType::f32, {1, kHeadsQ, kBlock}, {DeviceType::cuda, 0});
  AttentionOptions o;
  o.backend = Backend::cuda;
  const Tensor k = cache.keys(seq).value(), v = cache.values(seq).value();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(start);
    CHECK(dense(q->view(), k, v, out->view(), lse->view(), o));
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 3) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return times[times.size() / 2];
}

}  // namespace

// --one: only LoSA at 64K (budget 256, K 4) for a few steps: the run to profile (ncu).
// --one-batch: the same for a batch of 8 sequences of 64K each (the engine's batch-8 step).
int main(int argc, char** argv) {
  const bool one_batch = argc > 1 && std::string(argv[1]) == "--one-batch";
  const bool one = one_batch || (argc > 1 && std::string(argv[1]) == "--one");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("LoSA / QUEST / dense prefix attention on the device (%s): 32/8 heads, d 128, bf16, block 16, "
              "pages of 16; median step time after a block's first\n",
              prop.name);
  const std::vector<int64_t> lengths = one_batch ? std::vector<int64_t>(9, 65536)
                                       : one     ? std::vector<int64_t>{32768, 65536}
                                           : std::vector<int64_t>{32768, 65536, 131072, 8192, 16384, 24576, 40960,
                                                                  49152, 57344};
  int64_t pages = 0;
  for (int64_t n : lengths) pages += n / kPage + 2;
  DeviceKVCacheConfig cc;
  cc.heads_kv = kHeadsKv;
  cc.head_dim = kD;
  cc.pool_pages = pages + 8;
  auto cache = DevicePagedKVCache::create(cc);
  CHECK(cache.status());
  std::vector<int> ids;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ids.push_back(cache->add_sequence(lengths[i] + kBlock).value());
    const int64_t n = lengths[i];
    const DeviceArray k = upload(random_bf16(kHeadsKv * n * kD, 100 + i), {1, kHeadsKv, n, kD});
    const DeviceArray v = upload(random_bf16(kHeadsKv * n * kD, 200 + i), {1, kHeadsKv, n, kD});
    CHECK(cache->append(ids[i], k.view(), v.view()));
  }
  cudaDeviceSynchronize();
  if (one_batch) {
    const std::vector<int> batch(ids.begin() + 1, ids.end());
    const StepTime r = run(*cache, batch, std::vector<int64_t>(8, 65536), PrefixMethod::losa, 256, 4, 3);
    std::printf("losa, batch of 8 at 64K: %.1f us\n", r.ms * 1e3);
    return 0;
  }
  if (one) {
    const StepTime r = run(*cache, {ids[1]}, {lengths[1]}, PrefixMethod::losa, 256, 4, 3);
    std::printf("losa at 64K: %.1f us\n", r.ms * 1e3);
    return 0;
  }
  std::printf("\n%8s %-22s %9s %9s %8s %10s %10s\n", "prefix", "method", "step us", "vs dense", "pages", "GB/step",
              "of floor");
  for (int i = 0; i < 3; ++i) {
    const std::vector<int> one = {ids[i]};
    const std::vector<int64_t> len = {lengths[i]};
    const double bare = split_kv_ms(*cache, ids[i]);
    std::printf("%8lld %-22s %9.1f %9s %8s %10.3f %9.0f%%\n", static_cast<long long>(lengths[i]), "split-KV alone",
                bare * 1e3, "", "1.000", lengths[i] * kHeadsKv * kD * 4.0 / 1e9,
                100.0 * (lengths[i] * kHeadsKv * kD * 4.0 / kHbm) / (bare * 1e-3));
    const StepTime dense_r = run(*cache, one, len, PrefixMethod::dense, 256, 4, 20);
    struct Row {
      const char* name;
      PrefixMethod method;
      bool graph;
    };
    for (Row row : {Row{"dense (split-KV)", PrefixMethod::dense, false}, Row{"quest every row", PrefixMethod::quest, false},
                    Row{"losa K=4", PrefixMethod::losa, false}, Row{"losa K=4, CUDA graph", PrefixMethod::losa, true}}) {
      const char* name = row.name;
      const StepTime r =
          row.method == PrefixMethod::dense ? dense_r : run(*cache, one, len, row.method, 256, 4, 20, row.graph);
      std::printf("%8lld %-22s %9.1f %8.2fx %8.3f %10.3f %9.0f%%\n", static_cast<long long>(lengths[i]), name,
                  r.ms * 1e3, dense_r.ms / r.ms, r.pages_frac, r.bytes / 1e9, 100.0 * (r.bytes / kHbm) / (r.ms * 1e-3));
    }
  }
  // A batch of 8 sequences, 8K to 64K.
  const std::vector<int> batch = {ids[3], ids[4], ids[5], ids[0], ids[6], ids[7], ids[8], ids[1]};
  const std::vector<int64_t> batch_len = {8192, 16384, 24576, 32768, 40960, 49152, 57344, 65536};
  std::printf("\nbatch of 8 sequences (8K..64K, 288K tokens of prefix), budget 256, K 4:\n");
  for (auto method : {PrefixMethod::dense, PrefixMethod::quest, PrefixMethod::losa}) {
    const StepTime r = run(*cache, batch, batch_len, method, 256, 4, 20);
    std::printf("  %-6s step %8.1f us, %7.0f block tokens/s, pages %.3f, %.0f%% of the bytes' floor\n",
                prefix_method_name(method), r.ms * 1e3, 8 * kBlock / (r.ms * 1e-3), r.pages_frac,
                100.0 * (r.bytes / kHbm) / (r.ms * 1e-3));
  }
  std::printf("\nbudget x active_k at 64K (losa): step us / pages loaded (fraction of the prefix)\n%8s", "budget");
  for (int k : {1, 2, 4, 8}) std::printf("        K=%d", k);
  std::printf("\n");
  for (int64_t budget : {128, 256, 512, 1024}) {
    std::printf("%8lld", static_cast<long long>(budget));
    for (int k : {1, 2, 4, 8}) {
      const StepTime r = run(*cache, {ids[1]}, {lengths[1]}, PrefixMethod::losa, budget, k, 12);
      std::printf("  %5.1f/%.3f", r.ms * 1e3, r.pages_frac);
    }
    std::printf("\n");
  }
  return 0;
}
