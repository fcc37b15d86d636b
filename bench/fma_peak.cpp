// fma_peak: this machine's f32 fused multiply-add ceiling, per core and on all cores.
//
// Each thread runs kChains independent FMA chains held in vector registers
// (acc_i = acc_i * a + b). With kChains >= latency x throughput (e.g. 4 cycles x 2
// pipes = 8 on recent x86) the FMA units never wait for a result. A chain step is 2 FLOPs
// per lane. The ISA is the widest the compiler was allowed to use: AVX-512 (16 lanes),
// AVX2+FMA (8 lanes), or a scalar fallback (which measures the scalar, not the vector, peak).
// Reports the best of several runs (the ceiling, not the typical), both per wall-clock
// second and per CPU-second of the threads (on a shared machine the second stays near the
// uncontended rate of a busy core when the first does not).
//
//   fma_peak [--threads N] [--runs R] [--seconds S]
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr const char* kIsa = "AVX-512F (zmm, 16 f32 lanes)";
constexpr int kLanes = 16;
constexpr int kChains = 24;  // of 32 zmm registers
using Vec = __m512;
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "AVX2+FMA (ymm, 8 f32 lanes)";
constexpr int kLanes = 8;
constexpr int kChains = 12;  // of 16 ymm registers
using Vec = __m256;
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce(Vec v) {
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}
#else
constexpr const char* kIsa = "scalar (no AVX2+FMA at compile time)";
constexpr int kLanes = 1;
constexpr int kChains = 8;
using Vec = float;
inline Vec splat(float x) { return x; }
inline Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float reduce(Vec v) { return v; }
#endif

// Runs `iters` steps of kChains independent chains; returns a value that depends on every
// chain so the compiler cannot drop the work.
__attribute__((noinline)) float fma_chains(long iters, float seed) {
  Vec acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = splat(seed + 0.001f * c);
  const Vec a = splat(0.999999f), b = splat(1e-7f);  // fixed point near 0.1: no overflow/denormals
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = fma(acc[c], a, b);
  }
  float s = 0;
  for (int c = 0; c < kChains; ++c) s += reduce(acc[c]);
  return s;
}

constexpr double kFlopsPerIter = 2.0 * kLanes * kChains;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Rate {
  double wall;      // GFLOP per wall-clock second, all threads together
  double per_core;  // GFLOP per CPU-second, averaged over threads
};

// `threads` threads each running `iters` steps (wall time of the slowest).
Rate measure(int threads, long iters) {
  std::vector<float> sink(threads);
  std::vector<double> cpu(threads);
  auto work = [&](int t) {
    const double c0 = thread_cpu_seconds();
    sink[t] = fma_chains(iters, 0.1f + t);
    cpu[t] = thread_cpu_seconds() - c0;
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = 0;
  for (float s : sink) keep = keep + s;
  double cpu_total = 0;
  for (double c : cpu) cpu_total += c;
  const double flops = threads * iters * kFlopsPerIter;
  return {flops / seconds * 1e-9, flops / cpu_total * 1e-9};
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int runs = 7;
  double target_seconds = 0.3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--runs")) runs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seconds")) target_seconds = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: fma_peak [--threads N] [--runs R] [--seconds S]\n");
      return 2;
    }
  }
  // Calibrate the iteration count so one run lasts about target_seconds on one core.
  long iters = 1 << 20;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float keep = fma_chains(iters, 0.1f);
    (void)keep;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0.05) {
      iters = static_cast<long>(iters * target_seconds / s);
      break;
    }
    iters *= 4;
  }

  std::printf("isa: %s, %d independent chains, %.0f FLOP per chain step\n", kIsa, kChains, kFlopsPerIter);
  Rate best1{}, bestN{};
  for (int r = 0; r < runs; ++r) {
    const Rate x = measure(1, iters);
    best1 = {std::max(best1.wall, x.wall), std::max(best1.per_core, x.per_core)};
  }
  for (int r = 0; r < runs; ++r) {
    const Rate x = measure(threads, iters);
    bestN = {std::max(bestN.wall, x.wall), std::max(bestN.per_core, x.per_core)};
  }
  std::printf("fma peak, 1 thread:  %8.1f GFLOP/s wall, %8.1f GFLOP per CPU-second (best of %d)\n", best1.wall,
              best1.per_core, runs);
  std::printf("fma peak, %d threads: %8.1f GFLOP/s wall, %8.1f GFLOP per CPU-second per thread (best of %d)\n",
              threads, bestN.wall, bestN.per_core, runs);
  return 0;
}
