// ba_att_evidence — the evidence tables of docs/ba_att.md, on the generated workload.
//
//   ba_att_evidence --experiment sort|bound|compare|beta|planted|cost [--lens 4096,16384]
//                   [--seeds 0,1,2] [--heads 8/2] [--block 64] [--stride 8] [--threads N]
//
// sort:    Table 7 analogue: mass recall and output error at 50/70/90% sparsity for
//          no sort, SortQ, SortK, SortQ+SortK (no compensation, to isolate sorting).
// bound:   Fig. 2 analogue: Pearson R of the Eq. 8 bound U against the observed maximum
//          logit deviation, before and after sorting, per head and pooled.
// compare: ba_att against mean-pool top-k, xattention and the oracle top-k at equal density.
// beta:    compensation weight beta in {0, 0.5, 1, 2} (and the exact term).
// planted: share of the planted retrieval keys (workload.h) that each planted query sees.
// cost:    selector time against dense attention, 4K-32K.
// Every number is a mean over seeds (and over heads inside one run). Output: markdown.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "sparsa/oracle.h"
#include "sparsa/workload.h"
#include "sparsa/xattention.h"

using namespace sparsa;

namespace {

struct Args {
  std::string experiment = "sort";
  std::vector<int64_t> lens = {4096};
  std::vector<uint64_t> seeds = {0, 1, 2};
  int64_t heads_q = 8, heads_kv = 2;
  int block = 64;
  int stride = 8;
  int threads = 0;
  int repeats = 3;
};

template <class T>
std::vector<T> parse_list(const std::string& s) {
  std::vector<T> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(static_cast<T>(std::stoll(item)));
  return out;
}

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "ba_att_evidence: %s\n", message.c_str());
  std::exit(2);
}

template <class T>
T check(Result<T> r, const char* what) {
  if (!r.ok()) die(std::string(what) + ": " + r.status().to_string());
  return std::move(r).value();
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + key);
      return argv[++i];
    };
    if (key == "--experiment") a.experiment = value();
    else if (key == "--lens") a.lens = parse_list<int64_t>(value());
    else if (key == "--seeds") a.seeds = parse_list<uint64_t>(value());
    else if (key == "--heads") {
      const std::string h = value();
      const auto slash = h.find('/');
      if (slash == std::string::npos) die("--heads expects Q/KV, e.g. 8/2");
      a.heads_q = std::stoll(h.substr(0, slash));
      a.heads_kv = std::stoll(h.substr(slash + 1));
    } else if (key == "--block") a.block = std::stoi(value());
    else if (key == "--stride") a.stride = std::stoi(value());
    else if (key == "--threads") a.threads = std::stoi(value());
    else if (key == "--repeats") a.repeats = std::stoi(value());
    else die("unknown argument " + key);
  }
  return a;
}

Workload make_workload(const Args& a, int64_t len, uint64_t seed) {
  WorkloadConfig c;
  c.seed = seed;
  c.heads_q = a.heads_q;
  c.heads_kv = a.heads_kv;
  c.len_q = c.len_kv = len;
  return check(generate_workload(c), "generate_workload");
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What a plan achieves against dense: mass recall (per token, from LSEs), output error, density.
struct Quality {
  double recall = 0, error = 0, density = 0;
};

Quality evaluate(const Workload& w, const AttentionOutput& reference, const BlockIndexBuffer& plan, int threads) {
  AttentionOptions o;
  o.num_threads = threads;
  AttentionOutput sparse = check(block_sparse(w.q.view(), w.k.view(), w.v.view(), plan.view(), o), "block_sparse");
  Quality q;
  q.recall = check(mass_recall_from_lse(sparse.lse.view(), reference.lse.view()), "mass_recall");
  q.error = check(relative_error(sparse.out.view(), reference.out.view()), "relative_error");
  q.density = block_index_density(plan.view(), w.q.shape()[2], w.k.shape()[2]);
  return q;
}

// Mean over seeds of named rows of quality numbers.
struct Accumulator {
  std::vector<std::string> order;
  std::map<std::string, std::vector<Quality>> rows;
  void add(const std::string& name, Quality q) {
    if (!rows.count(name)) order.push_back(name);
    rows[name].push_back(q);
  }
  Quality mean(const std::string& name) const {
    Quality m;
    const auto& v = rows.at(name);
    for (const Quality& q : v) {
      m.recall += q.recall / v.size();
      m.error += q.error / v.size();
      m.density += q.density / v.size();
    }
    return m;
  }
};

BaAttOptions ba_options(const Args& a) {
  BaAttOptions o;
  o.block_q = o.block_kv = a.block;
  o.num_threads = a.threads;
  return o;
}

std::string header(const Args& a, int64_t len) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "L=%lld, heads %lld/%lld, d=64, block %d, seeds %zu", (long long)len,
                (long long)a.heads_q, (long long)a.heads_kv, a.block, a.seeds.size());
  return buf;
}

void experiment_sort(const Args& a) {
  const std::vector<double> sparsities = {0.5, 0.7, 0.9};
  struct Config { const char* name; bool sort_q, sort_k; int64_t window; };
  const std::vector<Config> configs = {{"no sort", false, false, 0},         {"SortQ", true, false, 0},
                                       {"SortK", false, true, 0},            {"SortQ+SortK", true, true, 0},
                                       {"SortQ+SortK, window 1024", true, true, 1024},
                                       {"SortQ+SortK, window 256", true, true, 256}};
  for (int64_t len : a.lens) {
    Accumulator acc;
    for (uint64_t seed : a.seeds) {
      const Workload w = make_workload(a, len, seed);
      AttentionOptions dense_opt;
      dense_opt.num_threads = a.threads;
      const AttentionOutput reference = check(dense(w.q.view(), w.k.view(), w.v.view(), dense_opt), "dense");
      for (const Config& c : configs) {
        for (double s : sparsities) {
          BaAttOptions o = ba_options(a);
          o.sort_q = c.sort_q;
          o.sort_k = c.sort_k;
          o.sort_window = c.window;
          o.compensate = false;
          o.budget = Budget::density(1.0 - s);
          const BlockIndexBuffer plan = check(ba_att_plan(w.q.view(), w.k.view(), o), "ba_att_plan");
          acc.add(std::string(c.name) + "|" + std::to_string(s), evaluate(w, reference, plan, a.threads));
        }
      }
      std::fprintf(stderr, "sort: L=%lld seed %llu done\n", (long long)len, (unsigned long long)seed);
    }
    std::printf("\n#### Sorting at fixed sparsity (%s; no compensation)\n\n", header(a, len).c_str());
    std::printf("| order | recall @50%% | recall @70%% | recall @90%% | error @50%% | error @70%% | error @90%% |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (const Config& c : configs) {
      std::printf("| %s", c.name);
      for (double s : sparsities) std::printf(" | %.4f", acc.mean(std::string(c.name) + "|" + std::to_string(s)).recall);
      for (double s : sparsities) std::printf(" | %.4f", acc.mean(std::string(c.name) + "|" + std::to_string(s)).error);
      std::printf(" |\n");
    }
    std::fflush(stdout);
  }
}

void experiment_bound(const Args& a) {
  for (int64_t len : a.lens) {
    std::printf("\n#### Eq. 8 bound U against the observed max logit deviation (%s)\n\n", header(a, len).c_str());
    std::printf("| seed | partition | Pearson R pooled | R per head (min / median / max) | mean U | mean max dev | violations |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (uint64_t seed : a.seeds) {
      const Workload w = make_workload(a, len, seed);
      for (bool sorted : {false, true}) {
        BaAttOptions o = ba_options(a);
        o.sort_q = o.sort_k = sorted;
        const BlockIndexBuffer plan = check(ba_att_plan(w.q.view(), w.k.view(), o), "ba_att_plan");
        const BlockPartition part = partition_of(plan.view());
        OracleOptions oo;
        oo.num_threads = a.threads;
        const OracleBlocks oracle = check(oracle_blocks(w.q.view(), w.k.view(), part, oo), "oracle_blocks");
        const DeviationBound b = check(deviation_bound(w.q.view(), w.k.view(), part, oracle, oo), "deviation_bound");
        std::vector<double> r = b.pearson_per_head;
        std::sort(r.begin(), r.end());
        std::printf("| %llu | %s | %.3f | %.3f / %.3f / %.3f | %.2f | %.2f | %lld |\n", (unsigned long long)seed,
                    sorted ? "SortQ+SortK" : "original", b.pearson_overall, r.front(), r[r.size() / 2], r.back(),
                    b.mean_bound, b.mean_deviation, (long long)b.violations);
        std::fflush(stdout);
      }
    }
  }
}

// The oracle's own top-k on the unsorted partition: the best any selector can do there.
BlockIndexBuffer oracle_plan(const OracleBlocks& oracle, int64_t batch, int64_t heads, int64_t len, double density) {
  const int64_t nq = oracle.num_q_blocks, nk = oracle.num_kv_blocks;
  BlockIndexBuffer plan = BlockIndexBuffer::empty(batch, heads, len, len, oracle.block_q, oracle.block_kv, nk);
  std::vector<double> m(nk);
  for (int64_t r = 0; r < batch * heads * nq; ++r) {
    for (int64_t j = 0; j < nk; ++j) m[j] = oracle.mass.ptr<float>()[r * nk + j];
    plan.counts.ptr<int32_t>()[r] = static_cast<int32_t>(
        select_blocks(m.data(), m.data(), nullptr, nk, Budget::density(density), plan.indices.ptr<int32_t>() + r * nk));
  }
  return plan;
}

void experiment_compare(const Args& a) {
  const std::vector<double> densities = {0.05, 0.1, 0.2, 0.3, 0.5};
  const std::vector<std::string> methods = {"oracle top-k (unsorted blocks)", "oracle top-k (SortQ+SortK blocks)", "mean-pool top-k", "xattention S=" + std::to_string(a.stride),
                                            "ba_att sort, no comp", "ba_att sort + Eq.14 beta=1",
                                            "ba_att sort + Eq.14 beta=0.5", "ba_att no sort + Eq.14 beta=0.5"};
  for (int64_t len : a.lens) {
    Accumulator acc, natural;
    for (uint64_t seed : a.seeds) {
      const Workload w = make_workload(a, len, seed);
      AttentionOptions dense_opt;
      dense_opt.num_threads = a.threads;
      const AttentionOutput reference = check(dense(w.q.view(), w.k.view(), w.v.view(), dense_opt), "dense");
      BlockPartition plain;
      plain.block_q = plain.block_kv = a.block;
      OracleOptions oo;
      oo.num_threads = a.threads;
      const OracleBlocks oracle = check(oracle_blocks(w.q.view(), w.k.view(), plain, oo), "oracle_blocks");
      BaAttOptions sorted_opt = ba_options(a);  // its permutations define the sorted partition
      const BlockIndexBuffer sorted_plan = check(ba_att_plan(w.q.view(), w.k.view(), sorted_opt), "plan");
      const OracleBlocks sorted_oracle =
          check(oracle_blocks(w.q.view(), w.k.view(), partition_of(sorted_plan.view()), oo), "oracle_blocks");
      for (double density : densities) {
        auto key = [&](const std::string& m) { return m + "|" + std::to_string(density); };
        acc.add(key(methods[0]),
                evaluate(w, reference, oracle_plan(oracle, 1, a.heads_q, len, density), a.threads));
        BlockIndexBuffer sorted_top = oracle_plan(sorted_oracle, 1, a.heads_q, len, density);
        sorted_top.perm_q = HostArray::copy_of(sorted_plan.perm_q.view());
        sorted_top.perm_kv = HostArray::copy_of(sorted_plan.perm_kv.view());
        acc.add(key(methods[1]), evaluate(w, reference, sorted_top, a.threads));
        BaAttOptions o = ba_options(a);
        o.budget = Budget::density(density);
        o.sort_q = o.sort_k = false;
        o.compensate = false;
        acc.add(key(methods[2]), evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
        XAttentionOptions xo;
        xo.block_q = xo.block_kv = a.block;
        xo.stride = a.stride;
        xo.budget = Budget::density(density);
        xo.num_threads = a.threads;
        acc.add(key(methods[3]),
                evaluate(w, reference, check(xattention_plan(w.q.view(), w.k.view(), xo), "xattention"), a.threads));
        o.sort_q = o.sort_k = true;
        acc.add(key(methods[4]), evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
        o.compensate = true;
        o.beta = 1.0f;
        acc.add(key(methods[5]), evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
        o.beta = 0.5f;
        acc.add(key(methods[6]), evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
        o.sort_q = o.sort_k = false;
        acc.add(key(methods[7]), evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
      }
      // XAttention in its own mode (cumulative threshold tau = 0.9), and ba_att at tau = 0.9 of its own softmax.
      XAttentionOptions xo;
      xo.block_q = xo.block_kv = a.block;
      xo.stride = a.stride;
      xo.num_threads = a.threads;
      xo.budget = Budget::mass(0.9);
      natural.add("xattention tau=0.9", evaluate(w, reference, check(xattention_plan(w.q.view(), w.k.view(), xo), "x"), a.threads));
      BaAttOptions o = ba_options(a);
      o.budget = Budget::mass(0.9);
      natural.add("ba_att tau=0.9", evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
      std::fprintf(stderr, "compare: L=%lld seed %llu done\n", (long long)len, (unsigned long long)seed);
    }
    std::printf("\n#### Selectors at equal density (%s)\n\nMass recall (higher is better):\n\n", header(a, len).c_str());
    std::printf("| method |");
    for (double d : densities) std::printf(" density %.2f |", d);
    std::printf("\n|---|");
    for (size_t i = 0; i < densities.size(); ++i) std::printf("---|");
    std::printf("\n");
    for (const std::string& m : methods) {
      std::printf("| %s |", m.c_str());
      for (double d : densities) std::printf(" %.4f |", acc.mean(m + "|" + std::to_string(d)).recall);
      std::printf("\n");
    }
    std::printf("\nOutput relative error (lower is better):\n\n| method |");
    for (double d : densities) std::printf(" density %.2f |", d);
    std::printf("\n|---|");
    for (size_t i = 0; i < densities.size(); ++i) std::printf("---|");
    std::printf("\n");
    for (const std::string& m : methods) {
      std::printf("| %s |", m.c_str());
      for (double d : densities) std::printf(" %.4f |", acc.mean(m + "|" + std::to_string(d)).error);
      std::printf("\n");
    }
    std::printf("\nCumulative-threshold modes (density is whatever tau gives):\n\n| method | density | recall | error |\n|---|---|---|---|\n");
    for (const std::string& m : natural.order) {
      const Quality q = natural.mean(m);
      std::printf("| %s | %.4f | %.4f | %.4f |\n", m.c_str(), q.density, q.recall, q.error);
    }
    std::fflush(stdout);
  }
}

void experiment_beta(const Args& a) {
  const std::vector<double> densities = {0.1, 0.3};
  struct Config { std::string name; bool compensate; Compensation c; float beta; };
  const std::vector<Config> configs = {
      {"beta=0", false, Compensation::diagonal, 0.0f},      {"beta=0.5 (Eq. 14)", true, Compensation::diagonal, 0.5f},
      {"beta=1 (Eq. 14)", true, Compensation::diagonal, 1.0f}, {"beta=2 (Eq. 14)", true, Compensation::diagonal, 2.0f},
      {"beta=0.5 exact", true, Compensation::exact, 0.5f},   {"beta=1 exact", true, Compensation::exact, 1.0f},
      {"beta=1 trace (Eq. 13)", true, Compensation::trace, 1.0f}};
  for (int64_t len : a.lens) {
    Accumulator acc;
    for (uint64_t seed : a.seeds) {
      const Workload w = make_workload(a, len, seed);
      AttentionOptions dense_opt;
      dense_opt.num_threads = a.threads;
      const AttentionOutput reference = check(dense(w.q.view(), w.k.view(), w.v.view(), dense_opt), "dense");
      for (bool sorted : {true, false})
        for (const Config& c : configs)
          for (double density : densities) {
            BaAttOptions o = ba_options(a);
            o.sort_q = o.sort_k = sorted;
            o.compensate = c.compensate;
            o.compensation = c.c;
            o.beta = c.beta;
            o.budget = Budget::density(density);
            acc.add(c.name + (sorted ? "|s|" : "|u|") + std::to_string(density),
                    evaluate(w, reference, check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"), a.threads));
          }
      std::fprintf(stderr, "beta: L=%lld seed %llu done\n", (long long)len, (unsigned long long)seed);
    }
    std::printf("\n#### Compensation weight (%s)\n\n", header(a, len).c_str());
    std::printf("| compensation | sorted recall @0.1 | sorted recall @0.3 | unsorted recall @0.1 | unsorted recall @0.3 | sorted error @0.1 | unsorted error @0.1 |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (const Config& c : configs) {
      auto m = [&](const char* s, double d) { return acc.mean(c.name + s + std::to_string(d)); };
      std::printf("| %s | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f |\n", c.name.c_str(), m("|s|", 0.1).recall,
                  m("|s|", 0.3).recall, m("|u|", 0.1).recall, m("|u|", 0.3).recall, m("|s|", 0.1).error,
                  m("|u|", 0.1).error);
    }
    std::fflush(stdout);
  }
}

// One untimed warm-up run (page faults, thread start), then the median of `repeats`.
// For each planted (query span, key span) pair and each query head of its kv head: the
// share of the span's keys visible to each span query under the plan, averaged.
double planted_recall(const Workload& w, const BlockIndexBuffer& plan) {
  const int64_t heads_q = w.q.shape()[1], heads_kv = w.k.shape()[1], len_q = w.q.shape()[2],
                len_kv = w.k.shape()[2], group = heads_q / heads_kv;
  const int64_t nq = plan.num_q_blocks, nk = plan.num_kv_blocks, cap = plan.indices.shape()[3];
  double total = 0;
  int64_t count = 0;
  std::vector<int64_t> pos_q(len_q), pos_k(len_kv);
  std::vector<char> kept(nk);
  for (const PlantedRetrieval& p : w.planted) {
    for (int64_t h = p.kv_head * group; h < (p.kv_head + 1) * group; ++h) {
      for (int64_t i = 0; i < len_q; ++i) {  // permuted position of each token
        const int64_t t = plan.perm_q.empty() ? i : plan.perm_q.ptr<int32_t>()[(p.batch * heads_q + h) * len_q + i];
        pos_q[t] = i;
      }
      for (int64_t j = 0; j < len_kv; ++j) {
        const int64_t t =
            plan.perm_kv.empty() ? j : plan.perm_kv.ptr<int32_t>()[(p.batch * heads_kv + p.kv_head) * len_kv + j];
        pos_k[t] = j;
      }
      for (int64_t i = p.q_start; i < p.q_start + p.length; ++i) {
        const int64_t row = (p.batch * heads_q + h) * nq + pos_q[i] / plan.block_q;
        std::fill(kept.begin(), kept.end(), 0);
        for (int32_t s = 0; s < plan.counts.ptr<int32_t>()[row]; ++s) kept[plan.indices.ptr<int32_t>()[row * cap + s]] = 1;
        int64_t visible = 0;
        for (int64_t j = p.kv_start; j < p.kv_start + p.length; ++j) visible += kept[pos_k[j] / plan.block_kv];
        total += static_cast<double>(visible) / static_cast<double>(p.length);
        ++count;
      }
    }
  }
  return count ? total / static_cast<double>(count) : 0.0;
}

void experiment_planted(const Args& a) {
  const std::vector<double> densities = {0.05, 0.1, 0.2};
  const std::vector<std::string> methods = {"mean-pool top-k", "xattention S=" + std::to_string(a.stride),
                                            "ba_att sort, no comp", "ba_att sort + Eq.14 beta=1",
                                            "ba_att sort window 1024 + Eq.14 beta=1",
                                            "ba_att sort window 256 + Eq.14 beta=1", "ba_att no sort + exact beta=1"};
  for (int64_t len : a.lens) {
    std::map<std::string, double> sum;
    for (uint64_t seed : a.seeds) {
      const Workload w = make_workload(a, len, seed);
      for (double density : densities) {
        auto add = [&](const std::string& m, const BlockIndexBuffer& plan) {
          sum[m + "|" + std::to_string(density)] += planted_recall(w, plan) / a.seeds.size();
        };
        BaAttOptions o = ba_options(a);
        o.budget = Budget::density(density);
        o.sort_q = o.sort_k = o.compensate = false;
        add(methods[0], check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"));
        XAttentionOptions xo;
        xo.block_q = xo.block_kv = a.block;
        xo.stride = a.stride;
        xo.budget = Budget::density(density);
        xo.num_threads = a.threads;
        add(methods[1], check(xattention_plan(w.q.view(), w.k.view(), xo), "xattention"));
        o.sort_q = o.sort_k = true;
        add(methods[2], check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"));
        o.compensate = true;
        add(methods[3], check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"));
        o.sort_window = 1024;
        add(methods[4], check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"));
        o.sort_window = 256;
        add(methods[5], check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"));
        o.sort_window = 0;
        o.sort_q = o.sort_k = false;
        o.compensation = Compensation::exact;
        add(methods[6], check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"));
      }
    }
    std::printf("\n#### Planted retrieval keys seen by their queries (%s)\n\n| method |", header(a, len).c_str());
    for (double d : densities) std::printf(" density %.2f |", d);
    std::printf("\n|---|");
    for (size_t i = 0; i < densities.size(); ++i) std::printf("---|");
    std::printf("\n");
    for (const std::string& m : methods) {
      std::printf("| %s |", m.c_str());
      for (double d : densities) std::printf(" %.4f |", sum[m + "|" + std::to_string(d)]);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}

double median_seconds(int repeats, const std::function<void()>& f, bool warmup = true) {
  if (warmup) f();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void experiment_cost(const Args& a) {
  std::printf("\n#### Selection cost on the CPU (heads %lld/%lld, d=64, block %d, threads %d, median of %d)\n\n",
              (long long)a.heads_q, (long long)a.heads_kv, a.block, a.threads, a.repeats);
  std::printf("| L | dense (ms) | ba_att plan sort+Eq.14 (ms) | ba_att plan no sort, no comp (ms) | xattention plan S=%d (ms) | ba_att / dense | growth exponent dense / ba_att / xattention |\n",
              a.stride);
  std::printf("|---|---|---|---|---|---|---|\n");
  double prev_len = 0, prev_dense = 0, prev_ba = 0, prev_x = 0;
  for (int64_t len : a.lens) {
    const Workload w = make_workload(a, len, a.seeds.front());
    AttentionOptions dense_opt;
    dense_opt.num_threads = a.threads;
    const double t_dense = median_seconds(std::max(1, a.repeats / 3), [&] {
      check(dense(w.q.view(), w.k.view(), w.v.view(), dense_opt), "dense");
    }, /*warmup=*/false);  // seconds per call at these lengths: a warm-up adds nothing but time
    BaAttOptions o = ba_options(a);
    const double t_ba = median_seconds(a.repeats, [&] { check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"); });
    o.sort_q = o.sort_k = o.compensate = false;
    const double t_pool = median_seconds(a.repeats, [&] { check(ba_att_plan(w.q.view(), w.k.view(), o), "plan"); });
    XAttentionOptions xo;
    xo.block_q = xo.block_kv = a.block;
    xo.stride = a.stride;
    xo.num_threads = a.threads;
    const double t_x = median_seconds(a.repeats, [&] { check(xattention_plan(w.q.view(), w.k.view(), xo), "x"); });
    // Growth exponent between consecutive lengths: log(t2 / t1) / log(L2 / L1).
    auto growth = [&](double t, double prev) { return prev > 0 ? std::log(t / prev) / std::log(len / prev_len) : NAN; };
    std::printf("| %lld | %.1f | %.2f | %.2f | %.1f | %.4f | %.2f / %.2f / %.2f |\n", (long long)len, t_dense * 1e3,
                t_ba * 1e3, t_pool * 1e3, t_x * 1e3, t_ba / t_dense, growth(t_dense, prev_dense), growth(t_ba, prev_ba),
                growth(t_x, prev_x));
    prev_len = static_cast<double>(len);
    prev_dense = t_dense;
    prev_ba = t_ba;
    prev_x = t_x;
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  std::string cmd = "ba_att_evidence";
  for (int i = 1; i < argc; ++i) cmd += std::string(" ") + argv[i];
  std::printf("`%s`\n", cmd.c_str());
  if (a.experiment == "sort") experiment_sort(a);
  else if (a.experiment == "bound") experiment_bound(a);
  else if (a.experiment == "compare") experiment_compare(a);
  else if (a.experiment == "beta") experiment_beta(a);
  else if (a.experiment == "planted") experiment_planted(a);
  else if (a.experiment == "cost") experiment_cost(a);
  else die("unknown experiment '" + a.experiment + "' (sort|bound|compare|beta|planted|cost)");
  return 0;
}
