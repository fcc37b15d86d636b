// bench_quest_cpu: QUEST (every key is prefix, as `sparsa demo` runs it) against dense attention
// on the CPU, on the demo's workload: page selection (select_pages), the executor
// (paged_attention) and the one-call form (quest_attention: paging, selection, attention)
// timed apart, each the median of --repeats calls after one warm-up, in wall time and in process
// CPU time (both threads together: the figure that stays meaningful on a shared machine).
//
//   bench_quest_cpu [--length 16384] [--budget 512] [--repeats 3] [--threads 0]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/quest.h"
#include "sparsa/workload.h"

using namespace sparsa;

namespace {

double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Timing {
  double wall = 0, cpu = 0;
};

// Median wall and median CPU time of `repeats` calls after one warm-up.
Timing time_it(int repeats, const std::function<void()>& body) {
  body();
  std::vector<double> wall, cpu;
  for (int i = 0; i < repeats; ++i) {
    const double w0 = wall_seconds(), c0 = cpu_seconds();
    body();
    wall.push_back(wall_seconds() - w0);
    cpu.push_back(cpu_seconds() - c0);
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "bench_quest_cpu: %s: %s\n", what, s.message().c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t length = 16384, budget = 512;
  int repeats = 3, threads = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long long value = std::atoll(argv[i + 1]);
    if (flag == "--length") length = value;
    else if (flag == "--budget") budget = value;
    else if (flag == "--repeats") repeats = static_cast<int>(value);
    else if (flag == "--threads") threads = static_cast<int>(value);
    else {
      std::fprintf(stderr, "bench_quest_cpu: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  WorkloadConfig config;  // the demo's: seed 0, 8 query heads / 2 kv heads, d 64, f32
  config.len_q = config.len_kv = length;
  Result<Workload> w = generate_workload(config);
  check(w.status(), "workload");
  const Tensor q = w->q.view(), k = w->k.view(), v = w->v.view();

  auto cache = PagedKVCache::create({k.shape[1], k.shape[3], 16});
  check(cache.status(), "cache");
  check(cache->append(k, v), "append");
  PageSelectOptions select;
  select.budget = budget;
  PagedAttentionOptions paged;
  paged.attention.num_threads = threads;
  AttentionOptions dense_options;
  dense_options.num_threads = threads;

  Result<PagePlan> plan = select_pages(q, *cache, select, threads);
  check(plan.status(), "select_pages");
  HostArray out(DType::f32, q.shape_vector()), lse(DType::f32, {1, q.shape[1], q.shape[2]});

  const Timing t_select = time_it(repeats, [&] { check(select_pages(q, *cache, select, threads).status(), "select"); });
  const Timing t_attend =
      time_it(repeats, [&] { check(paged_attention(q, *cache, *plan, out.view(), lse.view(), paged), "attend"); });
  const Timing t_quest = time_it(repeats, [&] { check(quest_attention(q, k, v, select, paged).status(), "quest"); });
  const Timing t_dense = time_it(repeats, [&] { check(dense(q, k, v, dense_options).status(), "dense"); });

  std::printf("QUEST vs dense, cpu backend: len %lld, heads %lld/%lld, d %lld, budget %lld (%lld of %lld pages), "
              "threads %d, median of %d\n\n",
              static_cast<long long>(length), static_cast<long long>(q.shape[1]), static_cast<long long>(k.shape[1]),
              static_cast<long long>(q.shape[3]), static_cast<long long>(budget),
              static_cast<long long>(budget / 16), static_cast<long long>(cache->num_pages()), threads, repeats);
  std::printf("%-34s %10s %10s %14s %14s\n", "", "wall s", "CPU s", "dense/x wall", "dense/x CPU");
  auto row = [&](const char* name, const Timing& t) {
    std::printf("%-34s %10.3f %10.3f %13.2fx %13.2fx\n", name, t.wall, t.cpu, t_dense.wall / t.wall, t_dense.cpu / t.cpu);
  };
  row("select_pages (selection)", t_select);
  row("paged_attention (executor)", t_attend);
  row("quest_attention (all, as the demo)", t_quest);
  row("dense", t_dense);
  return 0;
}
