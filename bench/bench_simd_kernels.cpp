// bench_simd_kernels: the two attention micro-kernels of src/cpu/simd.h alone, on
// cache-resident buffers, in GFLOP per CPU-second of the thread (compare with the
// 1-thread fma_peak). The gap between this and bench_attention is what the mainloop
// around the kernels (softmax, chunk loads, memory traffic, tails) costs.
//
//   bench_simd_kernels [head_dim ...]   (default 64 128)
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu/simd.h"

namespace {

using namespace sparsa::cpu::simd;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void run(int d) {
  constexpr int kRows = kRowVecs * kLanes, kKeys = 128;
  const int key_blocks = kKeys / kCols, col_blocks = d / kCols;  // whole blocks only
  std::vector<float> qt(d * kRows, 0.01f), k(kKeys * d, 0.02f), st(kKeys * kRows), v(kKeys * d, 0.03f),
      acc(d * kRows), alpha(kRows, 1.0f);
  const int iters = 2000000 / d;
  double best_scores = 0, best_pv = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const double t0 = thread_cpu_seconds();
    for (int it = 0; it < iters; ++it)
      for (int jb = 0; jb < key_blocks; ++jb)
        scores_kernel<kCols, kRowVecs>(qt.data(), kRows, k.data() + jb * kCols * d, d, d, st.data() + jb * kCols * kRows);
    const double t1 = thread_cpu_seconds();
    for (int it = 0; it < iters; ++it)
      for (int cb = 0; cb < col_blocks; ++cb)
        pv_kernel<kCols, kRowVecs>(st.data(), kRows, v.data() + cb * kCols, d, kKeys, alpha.data(),
                                   acc.data() + cb * kCols * kRows, kRows);
    const double t2 = thread_cpu_seconds();
    const double flops_scores = 2.0 * iters * key_blocks * kCols * d * kRows;
    const double flops_pv = 2.0 * iters * col_blocks * kCols * kKeys * kRows;
    best_scores = std::max(best_scores, flops_scores / (t1 - t0) * 1e-9);
    best_pv = std::max(best_pv, flops_pv / (t2 - t1) * 1e-9);
  }
  volatile float keep = acc[1] + st[1];
  (void)keep;
  std::printf("head_dim %3d: scores_kernel<%d,%d> %6.1f, pv_kernel<%d,%d> %6.1f GFLOP per CPU-second (best of 6)\n", d,
              kCols, kRowVecs, best_scores, kCols, kRowVecs, best_pv);
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("%d f32 lanes, %d x %d accumulator block\n", kLanes, kCols, kRowVecs);
  if (argc < 2) {
    for (int d : {64, 128}) run(d);
  } else {
    for (int i = 1; i < argc; ++i) run(std::atoi(argv[i]));
  }
  return 0;
}
