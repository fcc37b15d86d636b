// losa_trace — the evidence driver of docs/losa.md.
//
// Runs decode traces (sparsa/decode_trace.h) through PrefixAttention with every method
// in lockstep (run_trace) and prints markdown tables, per prefix length, of the means
// over the steps after the first of each block:
//   - KV pages loaded per step per kv head: the union over the block's recomputed rows
//     and the kv head's query heads; and the traffic including the selector's metadata;
//   - output error against dense prefix attention, ||O - O_dense||_F / ||O_dense||_F of
//     the block output, and the dense softmax mass the sparse rows keep;
//   - CPU time per step (process CPU time, all threads), and the block mean including
//     the dense first step.
// Usage: losa_trace [--prefix 16384,32768,65536] [--block 16] [--budgets 128,256,512]
//                   [--ks 1,2,4,8] [--heads 14 --heads-kv 2 --dim 128] [--blocks 1]
//                   [--tokens-per-step 1] [--steps 0] [--drift 0.02] [--neighbour 0.1]
//                   [--unmask 1.0] [--workload-noise 1.0] [--threads 0] [--backend cpu]
//                   [--seed 1] [--ablations] [--repeats 1] [--csv FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "sparsa/decode_trace.h"
#include "sparsa/losa.h"

using namespace sparsa;

namespace {

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  const char* p = s;
  while (*p) {
    char* end = nullptr;
    v.push_back(std::strtoll(p, &end, 10));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "losa_trace: %s\n", msg.c_str());
  std::exit(2);
}

void row_rule(size_t columns) {
  std::printf("|");
  for (size_t i = 0; i < columns; ++i) std::printf("---|");
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> prefixes = {16384, 32768, 65536}, budgets = {128, 256, 512}, ks = {1, 2, 4, 8};
  DecodeTraceConfig tc;
  tc.workload.heads_q = 14;  // Qwen2.5-7B's GQA group (7) and head_dim, half its 28/4 heads
  tc.workload.heads_kv = 2;
  tc.workload.head_dim = 128;
  int threads = 0, repeats = 1;
  Backend backend = Backend::cpu;
  bool ablations = false;
  const char* csv = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--prefix") prefixes = parse_list(next());
    else if (a == "--block") tc.block_size = std::atoll(next());
    else if (a == "--budgets") budgets = parse_list(next());
    else if (a == "--ks") ks = parse_list(next());
    else if (a == "--heads") tc.workload.heads_q = std::atoll(next());
    else if (a == "--heads-kv") tc.workload.heads_kv = std::atoll(next());
    else if (a == "--dim") tc.workload.head_dim = std::atoll(next());
    else if (a == "--blocks") tc.num_blocks = std::atoll(next());
    else if (a == "--tokens-per-step") tc.tokens_per_step = std::atoll(next());
    else if (a == "--steps") tc.steps_per_block = std::atoll(next());
    else if (a == "--drift") tc.drift = std::strtof(next(), nullptr);
    else if (a == "--neighbour") tc.neighbour_move = std::strtof(next(), nullptr);
    else if (a == "--unmask") tc.unmask_move = std::strtof(next(), nullptr);
    else if (a == "--workload-noise") tc.workload.noise = std::strtof(next(), nullptr);
    else if (a == "--threads") threads = std::atoi(next());
    else if (a == "--repeats") repeats = std::max(1, std::atoi(next()));
    else if (a == "--seed") tc.seed = tc.workload.seed = std::strtoull(next(), nullptr, 10);
    else if (a == "--ablations") ablations = true;
    else if (a == "--csv") csv = next();
    else if (a == "--backend") {
      auto b = parse_backend(next());
      if (!b.ok()) die(b.status().to_string());
      backend = *b;
    } else {
      die("unknown argument '" + a + "' (see the header of bench/losa/losa_trace.cpp)");
    }
  }
  FILE* csv_file = csv ? std::fopen(csv, "w") : nullptr;
  if (csv && !csv_file) die(std::string("cannot write ") + csv);
  if (csv_file) {
    std::fprintf(csv_file, "prefix,method,selector,group,budget,k,union,block,step,recomputed,pages_per_kv_head,"
                           "prefix_pages,err,err_prefix,err_masked,recall,select_ms,prefix_ms,wall_ms,cpu_ms\n");
  }
  std::printf("# losa_trace: heads %lld/%lld, d %lld, block %lld, blocks %lld, tokens/step %lld, unmask %.2f, "
              "neighbour %.2f, drift %.3f, workload noise %.2f, backend %s, threads %d, repeats %d\n\n",
              (long long)tc.workload.heads_q, (long long)tc.workload.heads_kv, (long long)tc.workload.head_dim,
              (long long)tc.block_size, (long long)tc.num_blocks, (long long)tc.tokens_per_step, tc.unmask_move,
              tc.neighbour_move, tc.drift, tc.workload.noise, backend_name(backend), threads, repeats);

  for (int64_t prefix : prefixes) {
    tc.prefix_len = prefix;
    const auto t0 = std::chrono::steady_clock::now();
    auto tr = DecodeTrace::generate(tc);
    if (!tr.ok()) die(tr.status().to_string());
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t Hkv = tr->heads_kv();

    // The configurations, run in lockstep against dense.
    LosaOptions base;
    base.attention.backend = backend;
    base.attention.num_threads = threads;
    std::vector<LosaOptions> configs;
    std::vector<std::string> names;
    auto add = [&](const LosaOptions& o, const std::string& name) {
      configs.push_back(o);
      names.push_back(name);
      return configs.size() - 1;
    };
    LosaOptions dn = base;
    dn.method = PrefixMethod::dense;
    const size_t dense_i = add(dn, "dense");
    std::map<int64_t, size_t> quest_i, reuse_i;
    std::map<std::pair<int64_t, int64_t>, size_t> losa_i;
    for (int64_t budget : budgets) {
      LosaOptions q = base;
      q.method = PrefixMethod::quest;
      q.select.budget = budget;
      quest_i[budget] = add(q, "quest");
      for (int64_t k : ks) {
        LosaOptions l = q;
        l.method = PrefixMethod::losa;
        l.active_k = static_cast<int>(k);
        losa_i[{budget, k}] = add(l, "losa");
      }
    }
    for (int64_t k : ks) {
      LosaOptions r = base;
      r.method = PrefixMethod::reuse;
      r.active_k = static_cast<int>(k);
      reuse_i[k] = add(r, "reuse");
    }
    std::vector<size_t> ablation_i;
    if (ablations) {
      LosaOptions l = base;
      l.method = PrefixMethod::losa;
      l.select.budget = 256;
      l.active_k = 4;
      LosaOptions u = l, p = l, f = l, th = l, g = l;
      u.attend_union = true;
      p.select.selector = PageSelector::pooled;
      f.select.force_first = true;
      th.mse_threshold = 0.05;
      g.select.group = GroupPolicy::shared;
      LosaOptions q = l, qg = g, qu = u, qp = p;
      for (LosaOptions* o : {&q, &qg, &qu, &qp}) o->method = PrefixMethod::quest;
      ablation_i = {add(l, "losa K=4 (quest selector, per-head pages, last page forced)"),
                    add(u, "losa, active rows attend the whole loaded union"),
                    add(p, "losa, pooled (page-mean) selector"),
                    add(f, "losa, first page forced too"),
                    add(th, "losa, MSE threshold 0.05 instead of top-K"),
                    add(g, "losa, one page list per GQA group (group max score)"),
                    add(q, "quest (same settings)"),
                    add(qg, "quest, one page list per GQA group"),
                    add(qu, "quest, rows attend the whole loaded union"),
                    add(qp, "quest, pooled selector")};
    }
    TraceRunOptions ro;
    ro.repeats = repeats;
    auto all = run_trace(*tr, configs, ro);
    if (!all.ok()) die(all.status().to_string());
    std::vector<TraceSummary> sum;
    for (const auto& steps : *all) sum.push_back(summarise(steps, Hkv));
    if (csv_file) {
      for (size_t c = 0; c < configs.size(); ++c) {
        const LosaOptions& o = configs[c];
        for (const TraceStep& r : (*all)[c]) {
          std::fprintf(csv_file, "%lld,%s,%s,%s,%lld,%d,%d,%lld,%lld,%zu,%.2f,%lld,%.6g,%.6g,%.6g,%.6g,%.4f,%.4f,%.4f,%.4f\n",
                       (long long)prefix, prefix_method_name(o.method), page_selector_name(o.select.selector),
                       o.select.group == GroupPolicy::shared ? "shared" : "per_head", (long long)o.select.budget,
                       o.active_k, o.attend_union ? 1 : 0, (long long)r.stats.block, (long long)r.stats.step,
                       r.stats.recomputed.size(), double(r.stats.pages_loaded) / Hkv, (long long)r.stats.prefix_pages,
                       r.err, r.err_prefix, r.err_masked, r.recall, r.stats.select_ms, r.stats.prefix_ms, r.stats.total_ms, r.cpu_ms);
        }
      }
      std::fflush(csv_file);
    }
    const TraceSummary& dense_s = sum[dense_i];
    const int64_t prefix_pages = (prefix + 15) / 16;
    std::printf("## prefix %lld (%lld pages per kv head; trace generated in %.1f s)\n\n", (long long)prefix,
                (long long)prefix_pages, gen_s);
    std::printf("dense: %.1f ms CPU per step, %lld pages per kv head\n\n", dense_s.cpu_ms, (long long)prefix_pages);

    std::printf("Pages loaded per step per kv head (mean over steps 1..%lld; %% of the prefix). Traffic adds the "
                "selector's metadata scan (min and max: 1/16 page per page) and is %% of dense:\n\n",
                (long long)tr->steps_per_block() - 1);
    std::printf("| budget | pages per query | quest (all %lld rows) |", (long long)tc.block_size);
    for (int64_t k : ks) std::printf(" losa K=%lld |", (long long)k);
    std::printf(" quest / losa K=4 | traffic quest / losa K=4 |\n");
    row_rule(5 + ks.size());
    const double meta = prefix_pages / 16.0;
    for (int64_t budget : budgets) {
      const TraceSummary& qs = sum[quest_i[budget]];
      std::printf("| %lld | %lld | %.0f (%.1f%%) |", (long long)budget, (long long)budget / 16, qs.pages, 100 * qs.pages_frac);
      for (int64_t k : ks) {
        const TraceSummary& l = sum[losa_i[{budget, k}]];
        std::printf(" %.0f (%.1f%%) |", l.pages, 100 * l.pages_frac);
      }
      auto it = losa_i.find({budget, 4});
      if (it != losa_i.end() && sum[it->second].pages > 0) {
        const TraceSummary& l4 = sum[it->second];
        std::printf(" %.2fx | %.1f%% / %.1f%% |\n", qs.pages / l4.pages, 100 * (qs.pages + meta) / prefix_pages,
                    100 * (l4.pages + meta) / prefix_pages);
      } else {
        std::printf(" - | - |\n");
      }
    }

    std::printf("\nOutput error vs dense, ||O - O_dense|| / ||O_dense|| of the block output: mean over steps 1.. "
                "[max]:\n\n| budget | quest |");
    for (int64_t k : ks) std::printf(" losa K=%lld |", (long long)k);
    std::printf("\n");
    row_rule(2 + ks.size());
    for (int64_t budget : budgets) {
      const TraceSummary& qs = sum[quest_i[budget]];
      std::printf("| %lld | %.3f [%.2f] |", (long long)budget, qs.err, qs.err_max);
      for (int64_t k : ks) {
        const TraceSummary& l = sum[losa_i[{budget, k}]];
        std::printf(" %.3f [%.2f] |", l.err, l.err_max);
      }
      std::printf("\n");
    }
    std::printf("| reuse only (active rows dense) | - |");
    for (int64_t k : ks) std::printf(" %.3f [%.2f] |", sum[reuse_i[k]].err, sum[reuse_i[k]].err_max);

    std::printf("\n\nThe same error over the rows still masked at each step (the rows whose predictions decide "
                "what is unmasked next):\n\n| budget | quest |");
    for (int64_t k : ks) std::printf(" losa K=%lld |", (long long)k);
    std::printf("\n");
    row_rule(2 + ks.size());
    for (int64_t budget : budgets) {
      std::printf("| %lld | %.3f |", (long long)budget, sum[quest_i[budget]].err_masked);
      for (int64_t k : ks) std::printf(" %.3f |", sum[losa_i[{budget, k}]].err_masked);
      std::printf("\n");
    }
    std::printf("| reuse only (active rows dense) | - |");
    for (int64_t k : ks) std::printf(" %.3f |", sum[reuse_i[k]].err_masked);

    std::printf("\n\nDense prefix softmax mass kept by the rows recomputed sparsely, mean of exp(L_p - L_p_dense):\n\n"
                "| budget | quest |");
    for (int64_t k : ks) std::printf(" losa K=%lld |", (long long)k);
    std::printf("\n");
    row_rule(2 + ks.size());
    for (int64_t budget : budgets) {
      std::printf("| %lld | %.3f |", (long long)budget, sum[quest_i[budget]].recall);
      for (int64_t k : ks) std::printf(" %.3f |", sum[losa_i[{budget, k}]].recall);
      std::printf("\n");
    }

    std::printf("\nCPU time per step, ms (process CPU time of the whole step, all threads): mean over steps 1.. "
                "[block mean including the dense first step]:\n\n| budget | dense | quest |");
    for (int64_t k : ks) std::printf(" losa K=%lld |", (long long)k);
    std::printf(" dense / quest | dense / losa K=4 [block] |\n");
    row_rule(5 + ks.size());
    for (int64_t budget : budgets) {
      const TraceSummary& qs = sum[quest_i[budget]];
      std::printf("| %lld | %.1f | %.1f [%.1f] |", (long long)budget, dense_s.cpu_ms, qs.cpu_ms, qs.block_cpu_ms);
      for (int64_t k : ks) {
        const TraceSummary& l = sum[losa_i[{budget, k}]];
        std::printf(" %.1f [%.1f] |", l.cpu_ms, l.block_cpu_ms);
      }
      std::printf(" %.1fx |", dense_s.cpu_ms / qs.cpu_ms);
      auto it = losa_i.find({budget, 4});
      if (it != losa_i.end()) {
        std::printf(" %.1fx [%.1fx] |\n", dense_s.cpu_ms / sum[it->second].cpu_ms,
                    dense_s.block_cpu_ms / sum[it->second].block_cpu_ms);
      } else {
        std::printf(" - |\n");
      }
    }
    std::printf("| reuse only | %.1f | |", dense_s.cpu_ms);
    for (int64_t k : ks) std::printf(" %.1f [%.1f] |", sum[reuse_i[k]].cpu_ms, sum[reuse_i[k]].block_cpu_ms);
    std::printf(" | |\n\n");

    if (ablations) {
      std::printf("Ablations (budget 256, K 4): block-output error (all rows / still-masked rows), pages per kv "
                  "head, mass kept, CPU ms per step, mean recomputed rows:\n\n"
                  "| variant | err | err masked | pages | mass kept | CPU ms | rows |\n");
      row_rule(7);
      for (size_t i : ablation_i) {
        const TraceSummary& s = sum[i];
        std::printf("| %s | %.3f | %.3f | %.0f | %.3f | %.1f | %.1f |\n", names[i].c_str(), s.err, s.err_masked, s.pages,
                    s.recall, s.cpu_ms, s.recomputed);
      }
      std::printf("\n");
    }
    std::fflush(stdout);
  }
  if (csv_file) std::fclose(csv_file);
  return 0;
}
