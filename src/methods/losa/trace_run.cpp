// Running PrefixAttention methods over a decode trace (sparsa/decode_trace.h).
#include <time.h>

#include <algorithm>
#include <cmath>

#include "sparsa/decode_trace.h"

namespace sparsa {

namespace {

double cpu_now_ms() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

double rel_err(const HostArray& a, const HostArray& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double{a.ptr<float>()[i]} - ref.ptr<float>()[i];
    num += d * d;
    den += double{ref.ptr<float>()[i]} * ref.ptr<float>()[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The same over the rows `rows` of [1, H, B, D] arrays.
double rel_err_rows(const HostArray& a, const HostArray& ref, const std::vector<int64_t>& rows) {
  const int64_t H = a.shape()[1], B = a.shape()[2], D = a.shape()[3];
  double num = 0, den = 0;
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r : rows) {
      for (int64_t t = 0; t < D; ++t) {
        const double x = a.ptr<float>()[(h * B + r) * D + t], y = ref.ptr<float>()[(h * B + r) * D + t];
        num += (x - y) * (x - y);
        den += y * y;
      }
    }
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

Result<std::vector<std::vector<TraceStep>>> run_trace(const DecodeTrace& trace, const std::vector<LosaOptions>& methods,
                                                      const TraceRunOptions& options) {
  if (methods.empty()) return invalid_argument("methods: expected at least one method, got none");
  if (options.repeats < 1 || options.repeats > 1000) {
    return invalid_argument("repeats: expected 1 to 1000, got " + std::to_string(options.repeats));
  }
  const int64_t Hq = trace.heads_q(), Hkv = trace.heads_kv(), D = trace.head_dim(), B = trace.config().block_size;
  const int64_t blocks = trace.config().num_blocks, steps = trace.steps_per_block();
  const LosaConfig config{Hq, Hkv, D, B};
  LosaOptions reference = methods[0];
  reference.method = PrefixMethod::dense;
  const size_t n = methods.size();
  std::vector<std::vector<TraceStep>> records(n);
  std::vector<std::vector<std::vector<double>>> cpu(n, std::vector<std::vector<double>>(blocks * steps));
  std::vector<std::vector<std::vector<double>>> wall(n, std::vector<std::vector<double>>(blocks * steps));

  for (int pass = 0; pass < options.repeats; ++pass) {
    auto cache = PagedKVCache::create({Hkv, D, 16});
    if (!cache.ok()) return cache.status();
    cache->reserve(trace.config().prefix_len + blocks * B);
    if (trace.config().prefix_len > 0) SPARSA_RETURN_IF_ERROR(cache->append(trace.prefix_k(), trace.prefix_v()));
    auto ref = PrefixAttention::create(config, reference);
    if (!ref.ok()) return ref.status();
    std::vector<PrefixAttention> layers;
    for (const LosaOptions& o : methods) {
      auto layer = PrefixAttention::create(config, o);
      if (!layer.ok()) return layer.status();
      layers.push_back(std::move(layer).value());
    }
    HostArray ref_out(DType::f32, {1, Hq, B, D}), out(DType::f32, {1, Hq, B, D}), lse(DType::f32, {1, Hq, B});
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t index = b * steps + s;
        std::vector<char> unmasked(B, 0);  // before this step
        for (int64_t e = 0; e < s; ++e)
          for (int64_t i : trace.unmasked_after(b, e)) unmasked[i] = 1;
        std::vector<int64_t> masked;
        for (int64_t i = 0; i < B; ++i)
          if (!unmasked[i]) masked.push_back(i);
        SPARSA_RETURN_IF_ERROR(ref->step(*cache, trace.q(b, s), trace.k(b, s), trace.v(b, s), ref_out.view(), lse.view()));
        for (size_t c = 0; c < n; ++c) {
          TraceStep r;
          const double t0 = cpu_now_ms();
          SPARSA_RETURN_IF_ERROR(
              layers[c].step(*cache, trace.q(b, s), trace.k(b, s), trace.v(b, s), out.view(), lse.view(), &r.stats));
          cpu[c][index].push_back(cpu_now_ms() - t0);
          wall[c][index].push_back(r.stats.total_ms);
          if (pass > 0) continue;
          r.err = rel_err(out, ref_out);
          r.err_prefix = rel_err(layers[c].o_p(), ref->o_p());
          r.err_masked = masked.empty() ? 0.0 : rel_err_rows(out, ref_out, masked);
          if (!r.stats.recomputed.empty()) {
            double sum = 0;
            for (int64_t h = 0; h < Hq; ++h) {
              for (int64_t row : r.stats.recomputed) {
                const double l = layers[c].l_p().ptr<float>()[h * B + row], ld = ref->l_p().ptr<float>()[h * B + row];
                sum += std::isinf(ld) ? 1.0 : std::exp(l - ld);
              }
            }
            r.recall = sum / (static_cast<double>(Hq) * static_cast<double>(r.stats.recomputed.size()));
          }
          if (!options.keep_plans) {
            r.stats.plan = {};
            r.stats.loaded.clear();
          }
          records[c].push_back(std::move(r));
        }
      }
      // One commit into the shared cache; every layer starts a new block.
      SPARSA_RETURN_IF_ERROR(ref->commit(*cache, trace.final_k(b), trace.final_v(b)));
      for (PrefixAttention& layer : layers) layer.begin_block();
    }
  }
  for (size_t c = 0; c < n; ++c) {
    for (size_t i = 0; i < records[c].size(); ++i) {
      records[c][i].cpu_ms = median(cpu[c][i]);
      records[c][i].stats.total_ms = median(wall[c][i]);
      records[c][i].stats.block = static_cast<int64_t>(i) / steps;
    }
  }
  return records;
}

TraceSummary summarise(const std::vector<TraceStep>& steps, int64_t heads_kv) {
  TraceSummary s;
  int64_t later = 0;
  for (const TraceStep& r : steps) {
    const double pages = static_cast<double>(r.stats.pages_loaded) / static_cast<double>(heads_kv);
    s.block_cpu_ms += r.cpu_ms;
    s.block_pages += pages;
    if (r.stats.step == 0) continue;
    ++later;
    s.pages += pages;
    s.pages_frac += r.stats.prefix_pages > 0 ? pages / static_cast<double>(r.stats.prefix_pages) : 0.0;
    s.err += r.err;
    s.err_max = std::max(s.err_max, r.err);
    s.err_prefix += r.err_prefix;
    s.err_masked += r.err_masked;
    s.recall += r.recall;
    s.cpu_ms += r.cpu_ms;
    s.wall_ms += r.stats.total_ms;
    s.recomputed += static_cast<double>(r.stats.recomputed.size());
  }
  if (later > 0) {
    for (double* x : {&s.pages, &s.pages_frac, &s.err, &s.err_prefix, &s.err_masked, &s.recall, &s.cpu_ms, &s.wall_ms, &s.recomputed})
      *x /= static_cast<double>(later);
  }
  if (!steps.empty()) {
    s.block_cpu_ms /= static_cast<double>(steps.size());
    s.block_pages /= static_cast<double>(steps.size());
  }
  return s;
}

}  // namespace sparsa
