// bench_attention: the CPU executors (cpu, and cpu_ref at small N) on dense and
// block-sparse attention, reporting GFLOP/s as a counter.
//
// FLOPs = 4 * (visited query-key pairs) * head_dim (QK^T and PV, one multiply-add each is
// 2 FLOPs); dense visits Lq * Lk pairs per (batch, head). Compare with bench/fma_peak.
//
//   bench_attention [--benchmark_filter=REGEX] [--benchmark_repetitions=N] ...
// Arguments of each case: N (= Lq = Lk), head_dim, heads_q, heads_kv, and for sparse
// the density in percent.
#include <benchmark/benchmark.h>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "sparsa/attention.h"

namespace {

using namespace sparsa;

constexpr int kBlock = 64;  // block_q = block_kv of the sparse cases

struct Inputs {
  HostArray q, k, v;
};

Inputs make_inputs(int64_t n, int64_t d, int64_t heads_q, int64_t heads_kv, DType dtype) {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  Inputs in{HostArray(DType::f32, {1, heads_q, n, d}), HostArray(DType::f32, {1, heads_kv, n, d}),
            HostArray(DType::f32, {1, heads_kv, n, d})};
  for (HostArray* a : {&in.q, &in.k, &in.v})
    for (int64_t i = 0; i < a->numel(); ++i) a->ptr<float>()[i] = normal(rng);
  if (dtype != DType::f32) {
    for (HostArray* a : {&in.q, &in.k, &in.v}) *a = convert(a->view(), dtype).value();
  }
  return in;
}

// Each query block keeps a random subset of ceil(density * num_kv_blocks) key blocks
// (the diagonal block always among them), ascending.
BlockIndexBuffer make_plan(int64_t n, int64_t heads_q, double density) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t keep = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(density * blocks)));
  BlockIndexBuffer plan = BlockIndexBuffer::empty(1, heads_q, n, n, kBlock, kBlock, keep);
  std::mt19937 rng(7);
  std::vector<int32_t> all(blocks);
  for (int64_t h = 0; h < heads_q; ++h) {
    for (int64_t qb = 0; qb < blocks; ++qb) {
      std::iota(all.begin(), all.end(), 0);
      std::swap(all[0], all[qb]);
      std::shuffle(all.begin() + 1, all.end(), rng);
      std::sort(all.begin(), all.begin() + keep);
      plan.counts.ptr<int32_t>()[h * blocks + qb] = static_cast<int32_t>(keep);
      std::copy(all.begin(), all.begin() + keep, plan.indices.ptr<int32_t>() + (h * blocks + qb) * keep);
    }
  }
  return plan;
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// GFLOP: per wall-clock second (the all-core rate, shown as "GFLOP=x/s").
// GF_core: per CPU-second of the process, i.e. the rate of one busy core; on a shared
// machine this stays near the uncontended value when the wall-clock rate does not
// (compare with the 1-core fma_peak).
void report(benchmark::State& state, double flops_per_iter, double cpu_seconds) {
  const double flops = flops_per_iter * static_cast<double>(state.iterations());
  state.counters["GFLOP"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsRate);
  state.counters["GF_core"] = flops * 1e-9 / cpu_seconds;
}

void BM_dense(benchmark::State& state, Backend backend, DType dtype, int threads) {
  const int64_t n = state.range(0), d = state.range(1), heads_q = state.range(2), heads_kv = state.range(3);
  const Inputs in = make_inputs(n, d, heads_q, heads_kv, dtype);
  HostArray out(dtype, {1, heads_q, n, d}), lse(DType::f32, {1, heads_q, n});
  AttentionOptions options;
  options.backend = backend;
  options.num_threads = threads;
  const double cpu0 = process_cpu_seconds();
  for (auto _ : state) {
    const Status s = dense(in.q.view(), in.k.view(), in.v.view(), out.view(), lse.view(), options);
    if (!s.ok()) state.SkipWithError(s.to_string().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  report(state, attention_flops(static_cast<double>(n) * n * heads_q, d), process_cpu_seconds() - cpu0);
}

void BM_block_sparse(benchmark::State& state, DType dtype) {
  const int64_t n = state.range(0), d = state.range(1), heads_q = state.range(2), heads_kv = state.range(3);
  const double density = state.range(4) / 100.0;
  const Inputs in = make_inputs(n, d, heads_q, heads_kv, dtype);
  const BlockIndexBuffer plan = make_plan(n, heads_q, density);
  const BlockIndex index = plan.view();
  HostArray out(dtype, {1, heads_q, n, d}), lse(DType::f32, {1, heads_q, n});
  const double cpu0 = process_cpu_seconds();
  for (auto _ : state) {
    const Status s = block_sparse(in.q.view(), in.k.view(), in.v.view(), index, out.view(), lse.view());
    if (!s.ok()) state.SkipWithError(s.to_string().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  const double visited = block_index_density(index, n, n) * static_cast<double>(n) * n * heads_q;
  state.counters["density"] = block_index_density(index, n, n);
  report(state, attention_flops(visited, d), process_cpu_seconds() - cpu0);
}

// Dense shapes: N in {1024, 2048, 4096} x d in {64, 128}, 4 query heads (2 cores: enough
// query tiles to balance), plus a GQA case (8 query heads over 2 kv heads).
void dense_args(benchmark::internal::Benchmark* b) {
  for (int64_t n : {1024, 2048, 4096})
    for (int64_t d : {64, 128}) b->Args({n, d, 4, 4});
  b->Args({4096, 128, 8, 2});
  b->ArgNames({"N", "d", "Hq", "Hkv"})->UseRealTime()->Unit(benchmark::kMillisecond);
}
void ref_args(benchmark::internal::Benchmark* b) {  // the f64 reference is ~100x slower
  b->Args({1024, 64, 1, 1})->ArgNames({"N", "d", "Hq", "Hkv"})->UseRealTime()->Unit(benchmark::kMillisecond);
}
void sparse_args(benchmark::internal::Benchmark* b) {
  for (int64_t n : {4096})
    for (int64_t d : {64, 128})
      for (int64_t pct : {10, 50}) b->Args({n, d, 4, 4, pct});
  b->ArgNames({"N", "d", "Hq", "Hkv", "pct"})->UseRealTime()->Unit(benchmark::kMillisecond);
}

// threads = 0: every hardware thread; 1: the one-core rate (compare with the 1-core peak).
BENCHMARK_CAPTURE(BM_dense, cpu_f32, Backend::cpu, DType::f32, 0)->Apply(dense_args);
BENCHMARK_CAPTURE(BM_dense, cpu_bf16, Backend::cpu, DType::bf16, 0)->Apply(dense_args);
BENCHMARK_CAPTURE(BM_dense, cpu_f32_1thread, Backend::cpu, DType::f32, 1)->Args({4096, 128, 2, 2})
    ->ArgNames({"N", "d", "Hq", "Hkv"})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_dense, cpu_ref_f32, Backend::cpu_ref, DType::f32, 1)->Apply(ref_args);
BENCHMARK_CAPTURE(BM_dense, cpu_ref_bf16, Backend::cpu_ref, DType::bf16, 1)->Apply(ref_args);
BENCHMARK_CAPTURE(BM_block_sparse, cpu_f32, DType::f32)->Apply(sparse_args);
BENCHMARK_CAPTURE(BM_block_sparse, cpu_bf16, DType::bf16)->Apply(sparse_args);

}  // namespace

BENCHMARK_MAIN();
