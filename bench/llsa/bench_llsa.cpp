// bench_llsa — LLSA against dense attention on the CPU.
//
//   bench_llsa [--sizes 128,256,...,32768] [--heads 4] [--dim 64] [--threads 0] [--reps 5]
//     Timing table in the seed's shape: N, keys per query, dense fwd, LLSA fwd, dense
//     fwd+bwd, LLSA fwd+bwd (milliseconds, median of reps, wall clock and process CPU
//     time; at N >= 16384 dense runs once without warm-up). LLSA times include the plan (pooling + selection). Dense
//     forward is sparsa::dense (cpu backend); dense backward is bench/llsa/
//     dense_backward.cpp (FlashAttention-2 style, f32, same thread count).
//   bench_llsa --quality [--sizes 4096,16384]
//     Relative output error ||O - O_dense|| / ||O_dense|| of LLSA with and without
//     dedupe, on random inputs and on smooth image-like inputs in Z-order and row-major
//     order (the same grid).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dense_backward.h"
#include "sparsa/attention.h"
#include "sparsa/layout.h"
#include "sparsa/llsa.h"

using namespace sparsa;

namespace {

struct Args {
  std::vector<int64_t> sizes = {128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  int64_t heads = 4, dim = 64;
  int threads = 0, reps = 5;
  bool quality = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: missing value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (s == "--sizes") {
      a.sizes.clear();
      std::string list = next();
      for (size_t p = 0; p < list.size();) {
        const size_t q = list.find(',', p);
        a.sizes.push_back(std::stoll(list.substr(p, q - p)));
        p = q == std::string::npos ? list.size() : q + 1;
      }
    } else if (s == "--heads") a.heads = std::stoll(next());
    else if (s == "--dim") a.dim = std::stoll(next());
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--quality") a.quality = true;
    else {
      std::fprintf(stderr, "unknown argument %s\n", s.c_str());
      std::exit(2);
    }
  }
  return a;
}

HostArray randn(std::vector<int64_t> shape, uint32_t seed) {
  HostArray a(DType::f32, std::move(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] = nd(rng);
  return a;
}

void check(const Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
    std::exit(1);
  }
}

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Wall-clock and process CPU time (all threads) of one call, in milliseconds. On a
// shared machine the CPU time is the steadier measure of the work done.
struct Time {
  double wall = 0, cpu = 0;
};

Time measure_once(const std::function<void()>& f) {
  const double c0 = cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {wall * 1e3, (cpu_seconds() - c0) * 1e3};
}

Time median_ms(const std::function<void()>& f, int reps, bool warm_up) {
  if (warm_up) f();
  std::vector<double> wall, cpu;
  for (int r = 0; r < reps; ++r) {
    const Time t = measure_once(f);
    wall.push_back(t.wall);
    cpu.push_back(t.cpu);
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

double load_average() {
  double load = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = -1;
    std::fclose(f);
  }
  return load;
}

double rel_error(const HostArray& a, const HostArray& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.ptr<float>()[i]) - ref.ptr<float>()[i];
    num += d * d;
    den += double(ref.ptr<float>()[i]) * ref.ptr<float>()[i];
  }
  return std::sqrt(num / den);
}

// The dense backward is checked against LLSA with every block selected and no
// enrichment (which is dense attention) before anything is timed.
void self_check(int threads) {
  const int64_t n = 300, d = 32, h = 2;
  auto q = randn({1, h, n, d}, 1), k = randn({1, h, n, d}, 2), v = randn({1, h, n, d}, 3), g = randn({1, h, n, d}, 4);
  LlsaOptions o;
  o.block = 16;
  o.topk = 19;  // ceil(300 / 16): every block
  o.levels = 1;
  o.enrich = false;
  o.num_threads = threads;
  auto fwd = llsa_forward(q.view(), k.view(), v.view(), o);
  check(fwd.status());
  HostArray a[3] = {HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape())};
  HostArray b[3] = {HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape()), HostArray(DType::f32, q.shape())};
  check(llsa_backward(q.view(), k.view(), v.view(), fwd->out.view(), fwd->lse.view(), g.view(), a[0].view(), a[1].view(),
                      a[2].view(), o));
  bench::dense_backward(q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), fwd->out.ptr<float>(), fwd->lse.ptr<float>(),
                        g.ptr<float>(), b[0].ptr<float>(), b[1].ptr<float>(), b[2].ptr<float>(), 1, h, n, d,
                        1.0f / std::sqrt(float(d)), threads);
  for (int i = 0; i < 3; ++i) {
    const double e = rel_error(b[i], a[i]);
    if (!(e < 1e-4)) {
      std::fprintf(stderr, "dense backward self-check failed: gradient %d relative error %.3g\n", i, e);
      std::exit(1);
    }
  }
}

void timing(const Args& args) {
  self_check(args.threads);
  std::printf("wall ms (CPU ms, both threads) | ratios of wall (of CPU) | 1-min load average at the end of the row\n\n");
  std::printf("| N | keys per query | dense fwd | LLSA fwd | dense fwd+bwd | LLSA fwd+bwd | fwd ratio | fwd+bwd ratio | load |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t n : args.sizes) {
    const int64_t h = args.heads, d = args.dim;
    auto q = randn({1, h, n, d}, 11), k = randn({1, h, n, d}, 12), v = randn({1, h, n, d}, 13), g = randn({1, h, n, d}, 14);
    HostArray out(DType::f32, q.shape()), lse(DType::f32, {1, h, n});
    HostArray dq(DType::f32, q.shape()), dk(DType::f32, q.shape()), dv(DType::f32, q.shape());
    AttentionOptions dense_opt;
    dense_opt.num_threads = args.threads;
    LlsaOptions llsa_opt;
    llsa_opt.num_threads = args.threads;
    const float scale = 1.0f / std::sqrt(float(d));
    const bool big = n >= 16384;
    const int dense_reps = big ? 1 : args.reps;

    auto dense_fwd = [&] { check(dense(q.view(), k.view(), v.view(), out.view(), lse.view(), dense_opt)); };
    auto dense_bwd = [&] {
      bench::dense_backward(q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), out.ptr<float>(), lse.ptr<float>(),
                            g.ptr<float>(), dq.ptr<float>(), dk.ptr<float>(), dv.ptr<float>(), 1, h, n, d, scale,
                            args.threads);
    };
    auto llsa_fwd = [&] {
      auto plan = llsa_plan(q.view(), k.view(), llsa_opt);
      check(plan.status());
      check(llsa_forward(q.view(), k.view(), v.view(), *plan, out.view(), lse.view(), llsa_opt));
    };
    auto llsa_fwd_bwd = [&] {
      auto plan = llsa_plan(q.view(), k.view(), llsa_opt);
      check(plan.status());
      check(llsa_forward(q.view(), k.view(), v.view(), *plan, out.view(), lse.view(), llsa_opt));
      check(llsa_backward(q.view(), k.view(), v.view(), *plan, out.view(), lse.view(), g.view(), dq.view(), dk.view(),
                          dv.view(), llsa_opt));
    };
    auto plan = llsa_plan(q.view(), k.view(), llsa_opt);
    check(plan.status());
    const double keys = plan->mean_keys_per_query();
    const Time t_dense = median_ms(dense_fwd, dense_reps, !big);
    const Time t_llsa = median_ms(llsa_fwd, args.reps, true);
    const Time t_dense_all = median_ms([&] { dense_fwd(); dense_bwd(); }, dense_reps, !big);
    const Time t_llsa_all = median_ms(llsa_fwd_bwd, args.reps, true);
    std::printf("| %lld | %.0f | %.1f (%.1f) | %.1f (%.1f) | %.1f (%.1f) | %.1f (%.1f) | %.2fx (%.2fx) | %.2fx (%.2fx) | %.1f |\n",
                (long long)n, keys, t_dense.wall, t_dense.cpu, t_llsa.wall, t_llsa.cpu, t_dense_all.wall,
                t_dense_all.cpu, t_llsa_all.wall, t_llsa_all.cpu, t_dense.wall / t_llsa.wall, t_dense.cpu / t_llsa.cpu,
                t_dense_all.wall / t_llsa_all.wall, t_dense_all.cpu / t_llsa_all.cpu, load_average());
    std::fflush(stdout);
  }
}

// Smooth image-like tokens: a sum of random 2-d plane waves per feature on an
// side x side grid, plus a little noise, in the given token order; q and k are two noisy
// copies (so attention is local and peaked), v an independent smooth field.
void smooth_inputs(int64_t side, int64_t heads, int64_t d, uint32_t seed, TokenLayout layout, HostArray& q, HostArray& k,
                   HostArray& v) {
  const int64_t n = side * side;
  q = HostArray(DType::f32, {1, heads, n, d});
  k = HostArray(DType::f32, {1, heads, n, d});
  v = HostArray(DType::f32, {1, heads, n, d});
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> phase(0.0f, 6.2831853f);
  const auto perm = layout_permutation(side, side, layout).value();
  const int kWaves = 4;
  for (int64_t h = 0; h < heads; ++h) {
    for (HostArray* x : {&q, &v}) {
      std::vector<float> fx(d * kWaves), fy(d * kWaves), ph(d * kWaves), amp(d * kWaves);
      for (int64_t i = 0; i < d * kWaves; ++i) {
        fx[i] = nd(rng) * 6.0f / side;
        fy[i] = nd(rng) * 6.0f / side;
        ph[i] = phase(rng);
        amp[i] = nd(rng);
      }
      for (int64_t p = 0; p < n; ++p) {
        const int64_t r = perm[p] / side, c = perm[p] % side;
        for (int64_t t = 0; t < d; ++t) {
          float s = 0;
          for (int w = 0; w < kWaves; ++w)
            s += amp[t * kWaves + w] * std::cos(fx[t * kWaves + w] * r + fy[t * kWaves + w] * c + ph[t * kWaves + w]);
          x->ptr<float>()[(h * n + p) * d + t] = s;
        }
      }
    }
    for (int64_t p = 0; p < n; ++p)
      for (int64_t t = 0; t < d; ++t) {
        float& qv = q.ptr<float>()[(h * n + p) * d + t];
        k.ptr<float>()[(h * n + p) * d + t] = qv + 0.3f * nd(rng);
        qv += 0.3f * nd(rng);
      }
  }
}

void quality(const Args& args) {
  std::printf("| inputs | N | LLSA rel. error | LLSA + dedupe rel. error | keys/query (dedupe) |\n");
  std::printf("|---|---|---|---|---|\n");
  for (int64_t n : args.sizes) {
    const int64_t side = static_cast<int64_t>(std::lround(std::sqrt(double(n))));
    for (const char* kind : {"random", "smooth z-order", "smooth row-major"}) {
      HostArray q, k, v;
      const bool smooth = std::string(kind) != "random";
      if (smooth && side * side != n) continue;
      if (smooth) {
        const bool z = std::string(kind) == "smooth z-order";
        smooth_inputs(side, args.heads, args.dim, 5, z ? TokenLayout::z_order : TokenLayout::row_major, q, k, v);
      } else {
        q = randn({1, args.heads, n, args.dim}, 21);
        k = randn({1, args.heads, n, args.dim}, 22);
        v = randn({1, args.heads, n, args.dim}, 23);
      }
      AttentionOptions ao;
      ao.num_threads = args.threads;
      auto ref = dense(q.view(), k.view(), v.view(), ao);
      check(ref.status());
      double err[2], keys[2];
      for (int dd = 0; dd < 2; ++dd) {
        LlsaOptions o;
        o.dedupe = dd == 1;
        o.num_threads = args.threads;
        auto plan = llsa_plan(q.view(), k.view(), o);
        check(plan.status());
        keys[dd] = plan->mean_keys_per_query();
        auto out = llsa_forward(q.view(), k.view(), v.view(), o);
        check(out.status());
        err[dd] = rel_error(out->out, ref->out);
      }
      std::printf("| %s | %lld | %.4f | %.4f | %.0f (%.0f) |\n", kind, (long long)n, err[0], err[1], keys[0], keys[1]);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  std::printf("batch 1, heads %lld, head_dim %lld, f32, threads %d (0 = all), LLSA B 16 K 8 L auto\n\n",
              (long long)args.heads, (long long)args.dim, args.threads);
  if (args.quality) quality(args);
  else timing(args);
  return 0;
}
