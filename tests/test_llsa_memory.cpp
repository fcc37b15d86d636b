// LLSA memory: the bytes the forward and the backward allocate grow linearly with N.
//
// This binary replaces the global operator new/delete with counting versions, so every
// heap allocation of the library (vectors, scratch, threads) is seen. A quadratic
// backward (an N x N score or mask buffer, or a per-query copy of K as the seed's first
// version had) fails both checks below by a wide margin.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "llsa_test_util.h"
#include "sparsa/llsa.h"

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

constexpr size_t kHeader = 16;  // keeps the returned pointer 16-byte aligned

void* counted_alloc(size_t n) {
  void* p = std::malloc(n + kHeader);
  if (!p) throw std::bad_alloc();
  *static_cast<size_t*>(p) = n;
  const int64_t live = g_live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return static_cast<char*>(p) + kHeader;
}

void counted_free(void* p) {
  if (!p) return;
  void* base = static_cast<char*>(p) - kHeader;
  g_live.fetch_sub(static_cast<int64_t>(*static_cast<size_t*>(base)));
  std::free(base);
}

}  // namespace

void* operator new(size_t n) { return counted_alloc(n); }
void* operator new[](size_t n) { return counted_alloc(n); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, size_t) noexcept { counted_free(p); }
void operator delete[](void* p, size_t) noexcept { counted_free(p); }

using namespace sparsa;

namespace {

struct Peaks {
  int64_t forward = 0, backward = 0;
};

// Peak bytes allocated above the level at entry, for one forward and one backward.
Peaks measure(int64_t n, int64_t d) {
  auto q = llsa_test::randn({1, 1, n, d}, 1), k = llsa_test::randn({1, 1, n, d}, 2), v = llsa_test::randn({1, 1, n, d}, 3);
  auto g = llsa_test::randn({1, 1, n, d}, 4);
  HostArray out(DType::f32, {1, 1, n, d}), lse(DType::f32, {1, 1, n});
  HostArray dq(DType::f32, {1, 1, n, d}), dk(DType::f32, {1, 1, n, d}), dv(DType::f32, {1, 1, n, d});
  LlsaOptions o;  // B 16, K 8, automatic L
  o.num_threads = 2;
  auto plan = llsa_plan(q.view(), k.view(), o);
  EXPECT_TRUE(plan.ok());
  Peaks peaks;
  int64_t base = g_live.load();
  g_peak.store(base);
  EXPECT_TRUE(llsa_forward(q.view(), k.view(), v.view(), *plan, out.view(), lse.view(), o).ok());
  peaks.forward = g_peak.load() - base;
  base = g_live.load();
  g_peak.store(base);
  EXPECT_TRUE(llsa_backward(q.view(), k.view(), v.view(), *plan, out.view(), lse.view(), g.view(), dq.view(), dk.view(),
                            dv.view(), o)
                  .ok());
  peaks.backward = g_peak.load() - base;
  return peaks;
}

}  // namespace

TEST(LlsaMemory, BackwardIsLinearInN) {
  const int64_t d = 16;
  const Peaks small = measure(4096, d);
  const Peaks large = measure(32768, d);
  const double n2_bytes = 32768.0 * 32768.0 * 4.0;  // one f32 N x N buffer: 4 GiB
  std::printf("peak bytes: forward %lld / %lld, backward %lld / %lld (N = 4096 / 32768)\n", (long long)small.forward,
              (long long)large.forward, (long long)small.backward, (long long)large.backward);
  // Absolute: far below a single N x N buffer (and below 64 bytes per token per
  // head-dim element, which covers the pyramid in four layouts plus two threads'
  // gradient pyramids: ~4 * 1.07 + 2 * 2 * 1.07 floats per element).
  EXPECT_LT(large.backward, n2_bytes / 64);
  EXPECT_LT(large.backward, 64.0 * 32768 * d);
  EXPECT_LT(large.forward, 64.0 * 32768 * d);
  // Growth: 8x the tokens must cost well under 8^2 = 64x the memory (linear gives ~8x,
  // plus the constant of thread stacks and scratch).
  EXPECT_LT(double(large.backward) / double(small.backward), 12.0);
  EXPECT_LT(double(large.forward) / double(small.forward), 12.0);
}
