// test-ops: checks every backend against cpu_ref and cpu_ref against the harness's
// own f64 oracles (mode `test`, the default), or times the backends (mode `perf`).
//
//   test-ops [test|perf] [-o OP] [-p REGEX] [-b BACKEND] [--seed N] [--full] [--list] [-j N]
//
// A failure prints its reason and the command that reruns that one case.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

namespace {

using namespace ops;

struct Args {
  std::string mode = "test";
  std::string op, pattern, backend;
  uint64_t seed = 1;
  bool seed_given = false, full = false, list = false;
  int jobs = 0;  // test mode: cases run on this many threads (0: hardware concurrency)
};

void usage() {
  std::printf(
      "usage: test-ops [test|perf] [-o OP] [-p REGEX] [-b BACKEND] [--seed N] [--full] [--list] [-j N]\n"
      "  test     (default) each backend against cpu_ref, and cpu_ref against the f64 oracles\n"
      "  perf     time each backend (median of repeated runs), GFLOP/s and GB/s\n"
      "  -o OP    only cases of this op (dense, block_sparse, block_sparse_full, dense_split_merge, merge)\n"
      "  -p REGEX only cases whose parameter string matches (std::regex, ECMAScript, search)\n"
      "  -b NAME  only this backend (cpu_ref: the oracle checks; cpu: against cpu_ref)\n"
      "  --seed N seed of the fuzzed cases (default 1)\n"
      "  --full   more and larger fuzzed cases\n"
      "  --list   print the selected cases and exit\n"
      "  -j N     test mode: run cases on N threads (default: hardware concurrency)\n");
}

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "test-ops: %s needs a value\n", name);
        return nullptr;
      }
      return argv[++i];
    };
    if (arg == "test" || arg == "perf") {
      a->mode = arg;
    } else if (arg == "-o" || arg == "-p" || arg == "-b" || arg == "--seed" || arg == "-j") {
      const char* v = value(arg.c_str());
      if (!v) return false;
      if (arg == "-o") a->op = v;
      if (arg == "-p") a->pattern = v;
      if (arg == "-b") a->backend = v;
      if (arg == "-j") {
        char* end = nullptr;
        const long jobs = std::strtol(v, &end, 10);
        if (*v == '\0' || *end != '\0' || jobs < 1 || jobs > 256) {
          std::fprintf(stderr, "test-ops: -j: expected a number of threads in [1, 256], got '%s'\n", v);
          return false;
        }
        a->jobs = static_cast<int>(jobs);
      }
      if (arg == "--seed") {
        char* end = nullptr;
        a->seed = std::strtoull(v, &end, 10);
        if (*v == '\0' || *end != '\0') {
          std::fprintf(stderr, "test-ops: --seed: expected a non-negative integer, got '%s'\n", v);
          return false;
        }
        a->seed_given = true;
      }
    } else if (arg == "--full") {
      a->full = true;
    } else if (arg == "--list") {
      a->list = true;
    } else if (arg == "-h" || arg == "--help") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "test-ops: unknown argument '%s'\n", arg.c_str());
      usage();
      return false;
    }
  }
  return true;
}

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::strchr("\\^$.|?*+()[]{}", c)) out += '\\';
    out += c;
  }
  return out;
}

std::string rerun_command(const Args& a, const Case& c, Backend backend) {
  std::string cmd = "test-ops -o " + c.op + " -b " + sparsa::backend_name(backend);
  if (a.seed_given) cmd += " --seed " + std::to_string(a.seed);
  if (a.full) cmd += " --full";
  return cmd + " -p '^" + regex_escape(c.params) + "$'";
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2g", x);
  return buf;
}

struct Run {
  std::string error;  // "" on success
  Results results;
};

// Run the case on a backend into fresh guarded outputs; check the guards and that
// every element was written.
Run run_guarded(const Prepared& p, Backend backend) {
  const Shape& s = p.shape;
  GuardedOutput out(p.out_dtype, {s.batch, s.heads, s.len, s.head_dim}, p.out_layout);
  GuardedOutput lse(DType::f32, {s.batch, s.heads, s.len}, p.out_layout);
  Run r;
  const Status status = p.run(backend, out.view(), lse.view());
  if (!status.ok()) {
    r.error = "returned " + status.to_string();
    return r;
  }
  r.error = out.check("O");
  if (r.error.empty()) r.error = lse.check("LSE");
  if (r.error.empty()) r.results = {out.values(), lse.values()};
  return r;
}

struct Tally {
  int passed = 0, failed = 0;
  std::string log;       // this case's lines (cases run on several threads, print in order)
  std::string failures;  // the FAIL blocks again, repeated at the end of the run
};

template <class... T>
void append(std::string* log, const char* format, T... args) {
  const int n = std::snprintf(nullptr, 0, format, args...);
  std::string line(static_cast<size_t>(n) + 1, '\0');
  std::snprintf(line.data(), line.size(), format, args...);
  line.pop_back();
  *log += line;
}

void report(Tally* t, const Args& a, const Case& c, Backend backend, const char* against, const std::string& error,
            double o_err, double lse_err, const Bound& b) {
  if (error.empty()) {
    ++t->passed;
    append(&t->log, "  OK    %-7s %s  (vs %s: O err %s <= %s, LSE err %s <= %s)\n", sparsa::backend_name(backend),
           c.params.c_str(), against, num(o_err).c_str(), num(b.o).c_str(), num(lse_err).c_str(), num(b.lse).c_str());
    return;
  }
  ++t->failed;
  std::string block;
  append(&block, "  FAIL  %-7s %s\n        vs %s: %s\n        rerun: %s\n", sparsa::backend_name(backend),
         c.params.c_str(), against, error.c_str(), rerun_command(a, c, backend).c_str());
  t->log += block;
  t->failures += block;
}

void test_case(const Args& a, const Case& c, const std::vector<Backend>& backends, Tally* t) {
  const Prepared p = c.prepare();
  const Run ref = run_guarded(p, Backend::cpu_ref);
  for (Backend backend : backends) {
    const bool is_ref = backend == Backend::cpu_ref;
    if (is_ref && !p.oracle) continue;
    const char* against = is_ref ? p.oracle_name : "cpu_ref";
    if (!ref.error.empty()) {  // nothing to compare against
      report(t, a, c, backend, against, std::string("cpu_ref ") + ref.error, 0, 0, {});
      continue;
    }
    double o_err = 0, lse_err = 0;
    std::string error;
    Bound b;
    if (is_ref) {
      b = bound(p.out_dtype, p.roundings, 1, p.logit_bound);
      error = compare(p.shape, p.oracle(), ref.results, b, &o_err, &lse_err);
    } else {
      const Run got = run_guarded(p, backend);
      b = bound(p.out_dtype, p.roundings, 2, p.logit_bound);
      error = got.error.empty() ? compare(p.shape, ref.results, got.results, b, &o_err, &lse_err) : got.error;
    }
    report(t, a, c, backend, against, error, o_err, lse_err, b);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void perf_case(const Case& c, const std::vector<Backend>& backends, Tally* t) {
  const Prepared p = c.prepare();
  const Shape& s = p.shape;
  for (Backend backend : backends) {
    GuardedOutput out(p.out_dtype, {s.batch, s.heads, s.len, s.head_dim}, p.out_layout);
    GuardedOutput lse(DType::f32, {s.batch, s.heads, s.len}, p.out_layout);
    Status status = p.run(backend, out.view(), lse.view());  // warm-up
    std::vector<double> times;
    const auto start = std::chrono::steady_clock::now();
    while (status.ok() && (times.size() < 3 || (seconds_since(start) < 0.5 && times.size() < 100))) {
      const auto t0 = std::chrono::steady_clock::now();
      status = p.run(backend, out.view(), lse.view());
      times.push_back(seconds_since(t0));
    }
    if (!status.ok()) {
      ++t->failed;
      std::printf("  FAIL  %-7s %s: %s\n", sparsa::backend_name(backend), c.params.c_str(), status.to_string().c_str());
      continue;
    }
    ++t->passed;
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    std::printf("  %-7s %s: %9.3f ms  %8.2f GFLOP/s  %7.2f GB/s  (median of %zu)\n", sparsa::backend_name(backend),
                c.params.c_str(), median * 1e3, p.flops / median * 1e-9, p.bytes / median * 1e-9, times.size());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, &a)) return 2;
  const bool perf = a.mode == "perf";

  // The harness builds host tensors, so it drives the host backends; the cuda backend
  // (device tensors) is checked against cpu_ref by tests/test_cuda_attention.cpp.
  std::vector<Backend> backends;
  for (Backend b : {Backend::cpu_ref, Backend::cpu}) {
    if (!sparsa::backend_available(b)) continue;
    if (!a.backend.empty() ? a.backend == sparsa::backend_name(b) : !(perf && b == Backend::cpu_ref)) {
      backends.push_back(b);
    }
  }
  if (!a.backend.empty() && backends.empty()) {
    const auto parsed = sparsa::parse_backend(a.backend);
    std::fprintf(stderr, "test-ops: -b: %s\n",
                 parsed.ok() ? ("backend '" + a.backend + "' is not available in this build").c_str()
                             : parsed.status().message().c_str());
    return 2;
  }

  std::regex pattern;
  try {
    pattern = std::regex(a.pattern);
  } catch (const std::regex_error& e) {
    std::fprintf(stderr, "test-ops: -p: invalid regular expression '%s': %s\n", a.pattern.c_str(), e.what());
    return 2;
  }
  std::vector<Case> cases;
  for (Case& c : make_cases(a.seed, a.full, perf)) {
    if (!a.op.empty() && c.op != a.op) continue;
    if (!a.pattern.empty() && !std::regex_search(c.params, pattern)) continue;
    if (perf && !c.perf_only && a.pattern.empty() && a.op.empty()) continue;  // default perf: the perf shapes
    cases.push_back(std::move(c));
  }
  if (a.list) {
    for (const Case& c : cases) std::printf("%s\n", c.params.c_str());
    std::printf("%zu cases\n", cases.size());
    return 0;
  }
  if (cases.empty()) {
    std::fprintf(stderr, "test-ops: no case matches the filters\n");
    return 2;
  }

  const auto start = std::chrono::steady_clock::now();
  Tally tally;
  if (perf) {  // one at a time: timings must not share the machine
    for (const Case& c : cases) {
      perf_case(c, backends, &tally);
      std::fflush(stdout);
    }
  } else {
    // Cases are independent; cpu_ref and the oracles are single-threaded f64 loops, so
    // running cases side by side is what keeps the default run short.
    const size_t n = cases.size();
    std::vector<Tally> results(n);
    std::vector<char> done(n, 0);
    std::atomic<size_t> next{0};
    std::mutex mutex;
    size_t printed = 0;
    auto worker = [&] {
      for (size_t i = next++; i < n; i = next++) {
        test_case(a, cases[i], backends, &results[i]);
        const std::lock_guard<std::mutex> lock(mutex);
        done[i] = 1;
        for (; printed < n && done[printed]; ++printed) {
          std::fputs(results[printed].log.c_str(), stdout);
          tally.passed += results[printed].passed;
          tally.failed += results[printed].failed;
          tally.failures += results[printed].failures;
        }
        std::fflush(stdout);
      }
    };
    const unsigned hw = std::thread::hardware_concurrency();
    const size_t jobs = std::min<size_t>(n, a.jobs > 0 ? a.jobs : (hw == 0 ? 1 : hw));
    std::vector<std::thread> pool;
    for (size_t t = 1; t < jobs; ++t) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
  }
  if (!tally.failures.empty()) std::printf("failures:\n%s", tally.failures.c_str());
  std::printf("%zu cases, %.1f s\n", cases.size(), seconds_since(start));
  std::printf("%d passed, %d failed\n", tally.passed, tally.failed);
  return tally.failed == 0 ? 0 : 1;
}
