// Running PrefixAttention methods over a decode trace (sparsa/decode_trace.h): on the CPU
// (PrefixAttention over a PagedKVCache, f32) or on a CUDA device (DevicePrefixAttention over a
// DevicePagedKVCache, the trace in bf16), each pass's layers behind one interface.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "sparsa/decode_trace.h"
#include "sparsa/device_losa.h"

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

// The layers of one pass, the dense reference first and then every method, over one backend's
// prefix cache holding the trace's prefix.
class PassLayers {
 public:
  virtual ~PassLayers() = default;
  // Before the layers' steps on trace step (b, s): its inputs where the layers read them.
  virtual Status begin_step(int64_t /*b*/, int64_t /*s*/) { return {}; }
  // Layer i's step on trace step (b, s): its output f32 [1, H, B, D] into out, stats filled
  // (total_ms: wall time), *ms: the time reported per step (process CPU time on the CPU; on the
  // device the wall time until the step's work is done).
  virtual Status step(size_t i, int64_t b, int64_t s, HostArray& out, StepStats* stats, double* ms) = 0;
  // Layer i's prefix state after its last step, f32: O_p [1, H, B, D] and L_p [1, H, B].
  virtual Result<HostArray> o_p(size_t i) = 0;
  virtual Result<HostArray> l_p(size_t i) = 0;
  // Block b's clean K/V into the cache; every layer's next step starts a block.
  virtual Status commit(int64_t b) = 0;
};

class CpuLayers final : public PassLayers {
 public:
  static Result<std::unique_ptr<PassLayers>> create(const DecodeTrace& trace, const std::vector<LosaOptions>& layers) {
    auto self = std::make_unique<CpuLayers>(trace);
    const int64_t Hq = trace.heads_q(), Hkv = trace.heads_kv(), D = trace.head_dim(), B = trace.config().block_size;
    auto cache = PagedKVCache::create({Hkv, D, 16});
    if (!cache.ok()) return cache.status();
    self->cache_ = std::move(cache).value();
    self->cache_.reserve(trace.config().prefix_len + trace.config().num_blocks * B);
    if (trace.config().prefix_len > 0) SPARSA_RETURN_IF_ERROR(self->cache_.append(trace.prefix_k(), trace.prefix_v()));
    for (const LosaOptions& o : layers) {
      auto layer = PrefixAttention::create(LosaConfig{Hq, Hkv, D, B}, o);
      if (!layer.ok()) return layer.status();
      self->layers_.push_back(std::move(layer).value());
    }
    self->lse_ = HostArray(DType::f32, {1, Hq, B});
    return std::unique_ptr<PassLayers>(std::move(self));
  }
  explicit CpuLayers(const DecodeTrace& trace) : trace_(trace) {}
  Status step(size_t i, int64_t b, int64_t s, HostArray& out, StepStats* stats, double* ms) override {
    const double t0 = cpu_now_ms();
    SPARSA_RETURN_IF_ERROR(
        layers_[i].step(cache_, trace_.q(b, s), trace_.k(b, s), trace_.v(b, s), out.view(), lse_.view(), stats));
    *ms = cpu_now_ms() - t0;
    return {};
  }
  Result<HostArray> o_p(size_t i) override { return layers_[i].o_p(); }
  Result<HostArray> l_p(size_t i) override { return layers_[i].l_p(); }
  Status commit(int64_t b) override {
    SPARSA_RETURN_IF_ERROR(layers_[0].commit(cache_, trace_.final_k(b), trace_.final_v(b)));
    for (PrefixAttention& layer : layers_) layer.begin_block();
    return {};
  }

 private:
  const DecodeTrace& trace_;
  PagedKVCache cache_;
  std::vector<PrefixAttention> layers_;
  HostArray lse_;
};

// A host f32 tensor as a bf16 device array.
Result<DeviceArray> upload_bf16(const Tensor& t, Device device) {
  auto b = convert(t, DType::bf16);
  if (!b.ok()) return b.status();
  return DeviceArray::from_host(*b, device);
}

// A device bf16 or f32 array as a host f32 array.
Result<HostArray> download_f32(const DeviceArray& a) {
  auto h = a.to_host();
  if (!h.ok()) return h.status();
  if (h->dtype() == DType::f32) return h;
  return convert(h->view(), DType::f32);
}

// On device 0, in bf16: one DevicePagedKVCache (pages of 16) holding the prefix as one sequence,
// one DevicePrefixAttention a layer. Stats as the CPU's PrefixAttention gives them, from the
// device's active rows and page plan: the pages loaded are the union per kv head of the plans of
// its query heads at the active rows; no PagePlan is kept (`loaded` is).
class DeviceLayers final : public PassLayers {
 public:
  static Result<std::unique_ptr<PassLayers>> create(const DecodeTrace& trace, const std::vector<LosaOptions>& layers) {
    auto self = std::make_unique<DeviceLayers>(trace);
    const int64_t Hq = trace.heads_q(), Hkv = trace.heads_kv(), D = trace.head_dim(), B = trace.config().block_size;
    const int64_t tokens = trace.config().prefix_len + trace.config().num_blocks * B;
    DeviceKVCacheConfig cc;
    cc.heads_kv = Hkv;
    cc.head_dim = D;
    cc.page_size = kPage;
    cc.pool_pages = (tokens + kPage - 1) / kPage + 1;
    auto cache = DevicePagedKVCache::create(cc);
    if (!cache.ok()) return cache.status();
    self->cache_ = std::move(cache).value();
    auto seq = self->cache_.add_sequence(tokens);
    if (!seq.ok()) return seq.status();
    self->seq_ = *seq;
    if (trace.config().prefix_len > 0) {
      auto k = upload_bf16(trace.prefix_k(), kDevice), v = upload_bf16(trace.prefix_v(), kDevice);
      if (!k.ok()) return k.status();
      if (!v.ok()) return v.status();
      SPARSA_RETURN_IF_ERROR(self->cache_.append(self->seq_, k->view(), v->view()));
    }
    for (const LosaOptions& o : layers) {
      auto layer = DevicePrefixAttention::create(DeviceLosaConfig{1, Hq, Hkv, D, B}, o, kDevice.id);
      if (!layer.ok()) return layer.status();
      self->layers_.push_back(std::move(layer).value());
      self->options_.push_back(o);
    }
    auto out = DeviceArray::allocate(DType::bf16, {1, Hq, B, D}, kDevice);
    auto lse = DeviceArray::allocate(DType::f32, {1, Hq, B}, kDevice);
    if (!out.ok()) return out.status();
    if (!lse.ok()) return lse.status();
    self->out_ = std::move(out).value();
    self->lse_ = std::move(lse).value();
    return std::unique_ptr<PassLayers>(std::move(self));
  }
  explicit DeviceLayers(const DecodeTrace& trace) : trace_(trace) {}
  Status begin_step(int64_t b, int64_t s) override {
    for (auto [dst, src] : {std::pair{&q_, trace_.q(b, s)}, std::pair{&k_, trace_.k(b, s)}, std::pair{&v_, trace_.v(b, s)}}) {
      auto a = upload_bf16(src, kDevice);
      if (!a.ok()) return a.status();
      *dst = std::move(a).value();
    }
    return {};
  }
  Status step(size_t i, int64_t, int64_t, HostArray& out, StepStats* stats, double* ms) override {
    DevicePrefixAttention& layer = layers_[i];
    const LosaOptions& o = options_[i];
    *stats = StepStats{};
    stats->step = layer.steps_in_block();
    auto length = cache_.length(seq_);
    if (!length.ok()) return length.status();
    const int64_t pages = (*length + kPage - 1) / kPage;
    stats->prefix_pages = pages;
    const auto t0 = std::chrono::steady_clock::now();
    SPARSA_RETURN_IF_ERROR(layer.step(cache_, {seq_}, q_.view(), k_.view(), v_.view(), out_.view(), lse_.view()));
    auto counts = layer.active_counts().to_host();  // waits for the step's work
    if (!counts.ok()) return counts.status();
    *ms = stats->total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    auto rows = layer.active_rows().to_host();
    if (!rows.ok()) return rows.status();
    const int32_t count = counts->ptr<int32_t>()[0];
    stats->recomputed.assign(rows->ptr<int32_t>(), rows->ptr<int32_t>() + count);
    const bool first = stats->step == 0;
    stats->dense_prefix = o.method == PrefixMethod::dense || o.method == PrefixMethod::reuse ||
                          (o.method == PrefixMethod::losa && first);
    SPARSA_RETURN_IF_ERROR(loaded_stats(layer, o, *length, pages, stats));
    auto o32 = download_f32(out_);
    if (!o32.ok()) return o32.status();
    out = std::move(o32).value();
    return {};
  }
  Result<HostArray> o_p(size_t i) override { return download_f32(layers_[i].o_p()); }
  Result<HostArray> l_p(size_t i) override { return download_f32(layers_[i].l_p()); }
  Status commit(int64_t b) override {
    auto k = upload_bf16(trace_.final_k(b), kDevice), v = upload_bf16(trace_.final_v(b), kDevice);
    if (!k.ok()) return k.status();
    if (!v.ok()) return v.status();
    SPARSA_RETURN_IF_ERROR(layers_[0].commit(cache_, {seq_}, k->view(), v->view()));
    for (DevicePrefixAttention& layer : layers_) layer.begin_block();
    return {};
  }

 private:
  static constexpr int kPage = 16;
  static constexpr Device kDevice{DeviceType::cuda, 0};

  // pages_loaded, tokens_loaded, pages_attended and loaded of the step just taken, as the CPU
  // counts them: dense prefix over the recomputed rows loads every page; a sparse step loads, per
  // kv head, the union of its query heads' plans at the active rows.
  Status loaded_stats(const DevicePrefixAttention& layer, const LosaOptions& o, int64_t length, int64_t pages,
                      StepStats* s) const {
    const int64_t Hq = trace_.heads_q(), Hkv = trace_.heads_kv(), B = trace_.config().block_size, group = Hq / Hkv;
    const int64_t n = static_cast<int64_t>(s->recomputed.size());
    if (n == 0 || length == 0) return {};
    if (s->dense_prefix) {
      s->pages_loaded = pages * Hkv;
      s->tokens_loaded = length * Hkv;
      s->pages_attended = pages * Hq * n;
      return {};
    }
    auto plan = layer.plan_pages().to_host();
    if (!plan.ok()) return plan.status();
    auto plan_counts = layer.plan_counts().to_host();
    if (!plan_counts.ok()) return plan_counts.status();
    const int64_t capacity = layer.plan_capacity();
    s->loaded.assign(Hkv, {});
    std::vector<int64_t> attended_own(Hkv, 0);
    for (int64_t h = 0; h < Hq; ++h) {
      std::vector<int32_t>& u = s->loaded[h / group];
      for (int64_t slot = 0; slot < n; ++slot) {
        const int64_t row = h * B + slot;
        const int32_t* p = plan->ptr<int32_t>() + row * capacity;
        const int32_t c = plan_counts->ptr<int32_t>()[row];
        u.insert(u.end(), p, p + c);
        attended_own[h / group] += c;
      }
    }
    for (int64_t h_kv = 0; h_kv < Hkv; ++h_kv) {
      std::vector<int32_t>& u = s->loaded[h_kv];
      std::sort(u.begin(), u.end());
      u.erase(std::unique(u.begin(), u.end()), u.end());
      s->pages_loaded += static_cast<int64_t>(u.size());
      for (int32_t p : u) s->tokens_loaded += std::min<int64_t>(kPage, length - int64_t{p} * kPage);
      s->pages_attended += o.attend_union ? static_cast<int64_t>(u.size()) * group * n : attended_own[h_kv];
    }
    return {};
  }

  const DecodeTrace& trace_;
  DevicePagedKVCache cache_;
  int seq_ = 0;
  std::vector<DevicePrefixAttention> layers_;
  std::vector<LosaOptions> options_;
  DeviceArray q_, k_, v_, out_, lse_;
};

}  // namespace

Result<std::vector<std::vector<TraceStep>>> run_trace(const DecodeTrace& trace, const std::vector<LosaOptions>& methods,
                                                      const TraceRunOptions& options) {
  if (methods.empty()) return invalid_argument("methods: expected at least one method, got none");
  if (options.repeats < 1 || options.repeats > 1000) {
    return invalid_argument("repeats: expected 1 to 1000, got " + std::to_string(options.repeats));
  }
  const Backend backend = methods[0].attention.backend;
  for (size_t c = 1; c < methods.size(); ++c) {
    if (methods[c].attention.backend != backend) {
      return invalid_argument("methods[" + std::to_string(c) + "]: backend: expected " + backend_name(backend) +
                              " as methods[0], got " + backend_name(methods[c].attention.backend));
    }
  }
  const bool device = backend == Backend::cuda;
  if (device && options.keep_plans) {
    return invalid_argument("keep_plans: the cuda backend keeps the pages loaded (StepStats::loaded), not the plans");
  }
  const int64_t Hq = trace.heads_q(), B = trace.config().block_size;
  const int64_t blocks = trace.config().num_blocks, steps = trace.steps_per_block();
  // Layer 0: the dense reference, with methods[0]'s attention options; then the methods.
  std::vector<LosaOptions> layer_options = {methods[0]};
  layer_options[0].method = PrefixMethod::dense;
  layer_options.insert(layer_options.end(), methods.begin(), methods.end());
  const size_t n = methods.size();
  std::vector<std::vector<TraceStep>> records(n);
  std::vector<std::vector<std::vector<double>>> cpu(n, std::vector<std::vector<double>>(blocks * steps));
  std::vector<std::vector<std::vector<double>>> wall(n, std::vector<std::vector<double>>(blocks * steps));

  for (int pass = 0; pass < options.repeats; ++pass) {
    auto layers = device ? DeviceLayers::create(trace, layer_options) : CpuLayers::create(trace, layer_options);
    if (!layers.ok()) return layers.status();
    PassLayers& L = **layers;
    HostArray ref_out(DType::f32, {1, Hq, B, trace.head_dim()}), out;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t index = b * steps + s;
        std::vector<char> unmasked(B, 0);  // before this step
        for (int64_t e = 0; e < s; ++e)
          for (int64_t i : trace.unmasked_after(b, e)) unmasked[i] = 1;
        std::vector<int64_t> masked;
        for (int64_t i = 0; i < B; ++i)
          if (!unmasked[i]) masked.push_back(i);
        SPARSA_RETURN_IF_ERROR(L.begin_step(b, s));
        StepStats ref_stats;
        double ref_ms = 0;
        SPARSA_RETURN_IF_ERROR(L.step(0, b, s, ref_out, &ref_stats, &ref_ms));
        for (size_t c = 0; c < n; ++c) {
          TraceStep r;
          double ms = 0;
          out = HostArray(DType::f32, {1, Hq, B, trace.head_dim()});
          SPARSA_RETURN_IF_ERROR(L.step(c + 1, b, s, out, &r.stats, &ms));
          cpu[c][index].push_back(ms);
          wall[c][index].push_back(r.stats.total_ms);
          if (pass > 0) continue;
          auto o_p = L.o_p(c + 1), ref_o_p = L.o_p(0), l_p = L.l_p(c + 1), ref_l_p = L.l_p(0);
          for (const auto* a : {&o_p, &ref_o_p, &l_p, &ref_l_p})
            if (!a->ok()) return a->status();
          r.err = rel_err(out, ref_out);
          r.err_prefix = rel_err(*o_p, *ref_o_p);
          r.err_masked = masked.empty() ? 0.0 : rel_err_rows(out, ref_out, masked);
          if (!r.stats.recomputed.empty()) {
            double sum = 0;
            for (int64_t h = 0; h < Hq; ++h) {
              for (int64_t row : r.stats.recomputed) {
                const double l = l_p->ptr<float>()[h * B + row], ld = ref_l_p->ptr<float>()[h * B + row];
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
      SPARSA_RETURN_IF_ERROR(L.commit(b));
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
