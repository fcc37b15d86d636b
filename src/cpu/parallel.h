// Internal: a minimal parallel-for over work items for the CPU backend.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#include "sparsa/tensor.h"

namespace sparsa::cpu {

inline int resolve_threads(int requested) {
  // The public entries refuse more than kMaxNumThreads; internal callers are clamped too.
  if (requested > 0) return std::min(requested, kMaxNumThreads);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Calls body(item, thread) for item in [0, n); items are handed out dynamically so
// uneven work (sparse rows with different counts) balances.
template <class Body>
void parallel_for(int64_t n, int num_threads, Body&& body) {
  const int threads = static_cast<int>(std::min<int64_t>(resolve_threads(num_threads), std::max<int64_t>(n, 1)));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&](int t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(i, t);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker, t);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones running (and this one) take every item
    }
  }
  worker(0);
  for (auto& th : pool) th.join();
}

}  // namespace sparsa::cpu
