// The per-layer attention of the engine, one method per layer from a spec `name[:key=value,...]`:
// `dense` is exact softmax attention through sparsa's own executors: the chunk's own keys (dense,
// or block_sparse over the block-causal plan), the cached prefix (dense), and the two merged by
// their log-sum-exp — the same split LoSA uses, so a sparse method replaces one half without
// touching the model: `ba_att` the chunk's own keys of long bidirectional canvases, `quest` the
// prefix, `losa` the prefix on a block's denoising steps.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"
#include "sparsa/ba_att.h"
#include "sparsa/device_losa.h"
#include "sparsa/losa.h"
#include "sparsa/quest.h"
#include "sparsa/xattention.h"

namespace sparsa::dlm {

namespace {

// `name[:key=value,key=value]`.
struct MethodSpec {
  std::string name;
  std::vector<std::pair<std::string, std::string>> params;
};

Result<MethodSpec> parse_spec(const std::string& text, const std::string& where) {
  MethodSpec m;
  const size_t colon = text.find(':');
  m.name = text.substr(0, colon);
  if (colon == std::string::npos) return m;
  const std::string rest = text.substr(colon + 1);
  size_t i = 0;
  while (i <= rest.size()) {
    const size_t j = std::min(rest.find(',', i), rest.size());
    const std::string item = rest.substr(i, j - i);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      return invalid_argument(where + ": expected key=value after '" + m.name + ":', got '" + item + "'");
    }
    m.params.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    i = j + 1;
  }
  return m;
}

// The parameters of one method: each key read once, the rest an error naming it.
class Params {
 public:
  Params(const MethodSpec& m, std::string where) : m_(m), where_(std::move(where)) {}
  Status number(const char* key, double lo, double hi, double* value) {
    for (auto& [k, v] : m_.params) {
      if (k != key) continue;
      used_.push_back(k);
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (end != v.c_str() + v.size() || !(x >= lo && x <= hi)) {
        return invalid_argument(where_ + ": " + m_.name + " " + key + ": expected a number in [" + fmt(lo) + ", " +
                                fmt(hi) + "], got '" + v + "'");
      }
      *value = x;
    }
    return Status::Ok();
  }
  Status integer(const char* key, int64_t lo, int64_t hi, int64_t* value) {
    double x = static_cast<double>(*value);
    SPARSA_RETURN_IF_ERROR(number(key, static_cast<double>(lo), static_cast<double>(hi), &x));
    if (x != std::floor(x)) return invalid_argument(where_ + ": " + m_.name + " " + key + ": expected an integer");
    *value = static_cast<int64_t>(x);
    return Status::Ok();
  }
  Status flag(const char* key, bool* value) {
    for (auto& [k, v] : m_.params) {
      if (k != key) continue;
      used_.push_back(k);
      if (v != "true" && v != "false" && v != "1" && v != "0") {
        return invalid_argument(where_ + ": " + m_.name + " " + key + ": expected true or false, got '" + v + "'");
      }
      *value = v == "true" || v == "1";
    }
    return Status::Ok();
  }
  bool has(const char* key) const {
    for (auto& kv : m_.params)
      if (kv.first == key) return true;
    return false;
  }
  Status done(const char* keys) const {
    for (auto& kv : m_.params) {
      if (std::find(used_.begin(), used_.end(), kv.first) == used_.end()) {
        return invalid_argument(where_ + ": " + m_.name + " has no parameter '" + kv.first + "' (" + keys + ")");
      }
    }
    return Status::Ok();
  }

 private:
  static std::string fmt(double x) {
    std::string s = std::to_string(x);
    s.erase(s.find_last_not_of('0') + 1);
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }
  const MethodSpec& m_;
  std::string where_;
  std::vector<std::string> used_;
};

// Scratch tensors of one LayerAttention on the call's device (host arrays on the CPU; device
// arrays ordered on the engine's stream on CUDA), kept while the shape fits.
class Scratch {
 public:
  Result<Tensor> get(int slot, DType dtype, std::vector<int64_t> shape, Device device, void* stream) {
    Slot& s = slots_[slot];
    int64_t need = 1;
    for (int64_t x : shape) need *= x;
    if (s.dtype != dtype || s.device != device || s.elements < need) {
      s = Slot{};
      if (device.type == DeviceType::cuda) {
        auto a = DeviceArray::allocate(dtype, {need}, device, false, stream);
        if (!a.ok()) return a.status();
        s.device_array = std::move(a.value());
        s.data = s.device_array.data();
      } else {
        s.host = HostArray(dtype, {need});
        s.data = s.host.data();
      }
      s.dtype = dtype;
      s.device = device;
      s.elements = need;
    }
    return Tensor::contiguous(s.data, dtype, std::span<const int64_t>(shape), device);
  }

 private:
  struct Slot {
    HostArray host;
    DeviceArray device_array;
    void* data = nullptr;
    DType dtype = DType::f32;
    Device device{};
    int64_t elements = 0;
  };
  Slot slots_[3];
};

// Exact softmax attention through sparsa's own executors, in two halves merged by their
// log-sum-exp: the chunk's own keys (own(): dense, or the block-causal pattern) and the cached
// prefix (prefix(): dense). The sparse methods replace one half.
class SplitAttention : public LayerAttention {
 public:
  explicit SplitAttention(const AttentionPolicy& policy) {
    options_.backend = policy.backend;
    options_.num_threads = policy.num_threads;
    options_.stream = policy.stream;
  }

  Status forward(const AttentionCall& call) override {
    const int64_t heads_q = call.q.shape[1], n = call.q.shape[2], hd = call.q.shape[3];
    const Device dev = call.q.device;
    auto own_lse = scratch_.get(0, DType::f32, {1, heads_q, n}, dev, options_.stream);
    if (!own_lse.ok()) return own_lse.status();
    SPARSA_RETURN_IF_ERROR(own(call, own_lse.value()));
    if (call.pos0 == 0 && !call.suffix_k.defined()) return Status::Ok();
    auto pre_out = scratch_.get(1, call.q.dtype, {1, heads_q, n, hd}, dev, options_.stream);
    auto pre_lse = scratch_.get(2, DType::f32, {1, heads_q, n}, dev, options_.stream);
    if (!pre_out.ok()) return pre_out.status();
    if (!pre_lse.ok()) return pre_lse.status();
    const Backend merge_backend = options_.backend == Backend::cuda ? Backend::cuda : Backend::cpu;
    if (call.pos0 > 0) {
      SPARSA_RETURN_IF_ERROR(prefix(call, pre_out.value(), pre_lse.value()));
      SPARSA_RETURN_IF_ERROR(merge(call.out, own_lse.value(), pre_out.value(), pre_lse.value(), call.out,
                                   own_lse.value(), merge_backend, options_.stream));
    }
    if (call.suffix_k.defined()) {  // the dual cache's suffix: dense, as the prefix
      SPARSA_RETURN_IF_ERROR(dense(call.q, call.suffix_k, call.suffix_v, pre_out.value(), pre_lse.value(), options_));
      SPARSA_RETURN_IF_ERROR(merge(call.out, own_lse.value(), pre_out.value(), pre_lse.value(), call.out,
                                   own_lse.value(), merge_backend, options_.stream));
    }
    return Status::Ok();
  }
  bool takes_suffix() const override { return true; }

 protected:
  // The chunk's own keys into call.out and lse.
  virtual Status own(const AttentionCall& call, const Tensor& lse) { return dense_own(call, lse); }
  // The prefix (pos0 > 0) into out and lse.
  virtual Status prefix(const AttentionCall& call, const Tensor& out, const Tensor& lse) {
    return dense(call.q, call.prefix_k, call.prefix_v, out, lse, options_);
  }

  Status dense_own(const AttentionCall& call, const Tensor& lse) {
    const int64_t n = call.q.shape[2], b = call.block_causal;
    if (b > 0 && b < n) {
      if (call.pos0 % b != 0) {
        return Status(StatusCode::internal, "attention: a block-causal chunk must start at a block boundary");
      }
      if (options_.backend != Backend::cuda) {
        SPARSA_RETURN_IF_ERROR(block_causal_plan(n, b, call.q.shape[1]));
        return block_sparse(call.q, call.k, call.v, plan_.view(), call.out, lse, options_);
      }
      // cuda: one call under the executor's block-causal mask (its key tiles past a query tile's
      // last block are skipped, not computed).
      AttentionOptions masked = options_;
      masked.mask = Mask::block_causal(b);
      return dense(call.q, call.k, call.v, call.out, lse, masked);
    }
    return dense(call.q, call.k, call.v, call.out, lse, options_);
  }

  AttentionOptions options_;
  Scratch scratch_;

 private:
  // Query block qb of the chunk sees key blocks 0..qb (causal across blocks, all of a block).
  Status block_causal_plan(int64_t n, int64_t b, int64_t heads_q) {
    if (plan_n_ == n && plan_b_ == b && plan_heads_ == heads_q) return Status::Ok();
    const int64_t nb = (n + b - 1) / b;
    std::vector<int32_t> counts(static_cast<size_t>(heads_q * nb));
    std::vector<int32_t> blocks(static_cast<size_t>(heads_q * nb * nb));
    for (int64_t h = 0; h < heads_q; ++h) {
      for (int64_t qb = 0; qb < nb; ++qb) {
        const int64_t r = h * nb + qb;
        counts[r] = static_cast<int32_t>(qb + 1);
        for (int64_t j = 0; j <= qb; ++j) blocks[r * nb + j] = static_cast<int32_t>(j);
      }
    }
    plan_ = BlockIndexBuffer::from_rows(1, heads_q, n, n, static_cast<int>(b), static_cast<int>(b), counts,
                                        blocks.data(), nb);
    plan_n_ = n;
    plan_b_ = b;
    plan_heads_ = heads_q;
    return Status::Ok();
  }

  BlockIndexBuffer plan_;
  int64_t plan_n_ = -1, plan_b_ = -1, plan_heads_ = -1;
};

class DenseAttention final : public SplitAttention {
 public:
  using SplitAttention::SplitAttention;
};

// "density=0.5", "kappa=2" or "tau=0.9": a budget as `sparsa plan` takes it.
std::string budget_param(const Budget& b) {
  char text[64];
  const char* name = b.kind == BudgetKind::top_kappa ? "kappa" : b.kind == BudgetKind::mass ? "tau" : "density";
  std::snprintf(text, sizeof text, "%s=%.17g", name, b.value);
  return text;
}
const char* bool_text(bool b) { return b ? "true" : "false"; }

// A block selector over the chunk's own keys where the chunk is one bidirectional canvas of at
// least min_tokens tokens (LLaDA's full-canvas steps, Fast-dLLM's block-and-suffix chunks), then
// the block-sparse executor; dense below that; block-causal chunks (block-diffusion prefill) dense
// too unless the method selects under the mask (`block_causal=true`); the prefix stays dense. The
// methods differ only in their selector (the hooks).
class CanvasAttention : public SplitAttention {
 public:
  CanvasAttention(const AttentionPolicy& policy, int64_t min_tokens, bool block_causal)
      : SplitAttention(policy), min_tokens_(min_tokens), block_causal_(block_causal) {}

  Result<std::optional<CallPlan>> plan_of(const AttentionCall& call) override {
    if (!sparse(call)) return std::optional<CallPlan>{};
    auto plan = select(call);
    if (!plan.ok()) return plan.status();
    return std::optional<CallPlan>(std::move(plan).value());
  }

 protected:
  // The method over the chunk's own keys into call.out and lse.
  virtual Status attend_sparse(const AttentionCall& call, const Tensor& lse) = 0;
  // Its plan for the call, with the `sparsa plan` method and parameters that rebuild it.
  virtual Result<CallPlan> select(const AttentionCall& call) = 0;

  Status own(const AttentionCall& call, const Tensor& lse) final {
    return sparse(call) ? attend_sparse(call, lse) : dense_own(call, lse);
  }

  // A selector's options (BaAttOptions, XAttentionOptions) for the call: over a block-causal
  // chunk the executor applies the mask (the chunk starts on a block boundary, so the mask's
  // blocks are the model's) and the selection sees it, unless `sorted` (BA-Att's norm sort mixes
  // positions across the mask's blocks, so its selection stays blind to it); a bidirectional
  // canvas has none.
  template <class Options>
  static Result<Options> for_chunk(Options o, const AttentionCall& call, bool sorted = false) {
    const int64_t b = call.block_causal;
    if (b == 0 || b >= call.q.shape[2]) return o;
    if (call.pos0 % b != 0) {
      return Status(StatusCode::internal, "attention: a block-causal chunk must start at a block boundary");
    }
    o.mask = Mask::block_causal(b);
    o.mask_aware = !sorted;
    return o;
  }

 private:
  bool sparse(const AttentionCall& call) const {
    return (call.block_causal == 0 || block_causal_) && call.q.shape[2] >= min_tokens_;
  }
  int64_t min_tokens_;
  bool block_causal_;
};

// BA-Att (norm-sorted, compensated mean-pool logits), or with the sorts and the compensation off,
// mean-pool top-k (`mean_pool`); on the cpu or, with its device selection, the cuda backend.
class BaAttAttention final : public CanvasAttention {
 public:
  BaAttAttention(const AttentionPolicy& policy, const BaAttOptions& ba, int64_t min_tokens, bool block_causal,
                 std::string name)
      : CanvasAttention(policy, min_tokens, block_causal), ba_(ba), name_(std::move(name)) {
    ba_.backend = policy.backend;
    ba_.num_threads = policy.num_threads;
  }

 protected:
  Status attend_sparse(const AttentionCall& call, const Tensor& lse) override {
    auto options = for_chunk(ba_, call, ba_.sort_q || ba_.sort_k);
    if (!options.ok()) return options.status();
    return ba_att(call.q, call.k, call.v, call.out, lse, *options);
  }
  Result<CallPlan> select(const AttentionCall& call) override {
    auto options = for_chunk(ba_, call, ba_.sort_q || ba_.sort_k);
    if (!options.ok()) return options.status();
    auto plan = ba_att_plan(call.q, call.k, *options);
    if (!plan.ok()) return plan.status();
    std::string params = budget_param(ba_.budget) + " block_q=" + std::to_string(ba_.block_q) +
                         " block_kv=" + std::to_string(ba_.block_kv);
    if (name_ == "ba_att") {
      char beta[32];
      std::snprintf(beta, sizeof beta, "%.9g", static_cast<double>(ba_.beta));
      params += std::string(" beta=") + beta + " compensate=" + bool_text(ba_.compensate) +
                " sort_q=" + bool_text(ba_.sort_q) + " sort_k=" + bool_text(ba_.sort_k);
    }
    if (options->mask_aware) params += " mask_aware=true";
    return CallPlan{std::move(plan).value(), name_, params};
  }

 private:
  BaAttOptions ba_;
  std::string name_;  // "ba_att" or "mean_pool"
};

// XAttention (antidiagonal block scores, sparsa/xattention.h): its selection runs on the cpu.
class XAttentionAttention final : public CanvasAttention {
 public:
  XAttentionAttention(const AttentionPolicy& policy, const XAttentionOptions& x, int64_t min_tokens,
                      bool block_causal)
      : CanvasAttention(policy, min_tokens, block_causal), x_(x) {
    x_.backend = policy.backend;
    x_.num_threads = policy.num_threads;
  }

 protected:
  Status attend_sparse(const AttentionCall& call, const Tensor& lse) override {
    auto options = for_chunk(x_, call);
    if (!options.ok()) return options.status();
    auto plan = xattention_plan(call.q, call.k, *options);
    if (!plan.ok()) return plan.status();
    AttentionOptions executor = options_;
    executor.mask = options->mask;
    return block_sparse(call.q, call.k, call.v, plan->view(), call.out, lse, executor);
  }
  Result<CallPlan> select(const AttentionCall& call) override {
    auto options = for_chunk(x_, call);
    if (!options.ok()) return options.status();
    auto plan = xattention_plan(call.q, call.k, *options);
    if (!plan.ok()) return plan.status();
    return CallPlan{std::move(plan).value(), "xattention",
                    budget_param(x_.budget) + " block=" + std::to_string(x_.block_q) + " stride=" +
                        std::to_string(x_.stride) + " force_first=" + bool_text(x_.force_first) +
                        " force_diagonal=" + bool_text(x_.force_diagonal) +
                        (options->mask_aware ? " mask_aware=true" : "")};
  }

 private:
  XAttentionOptions x_;
};

// QUEST over the cached prefix: every query row's top budget / 16 pages by the page bound, then
// attention over them (sparsa/quest.h); the chunk's own keys stay exact.
class QuestAttention final : public SplitAttention {
 public:
  QuestAttention(const AttentionPolicy& policy, const PageSelectOptions& select)
      : SplitAttention(policy), select_(select) {}

 protected:
  Status prefix(const AttentionCall& call, const Tensor& out, const Tensor& lse) override {
    // select_pages takes contiguous-row f32 queries: the call's q is a strided view.
    auto plan = select_pages(call.q, *call.prefix, select_, options_.num_threads);
    if (!plan.ok()) return plan.status();
    PagedAttentionOptions po;
    po.attention = options_;
    return paged_attention(call.q, *call.prefix, *plan, out, lse, po);
  }

 private:
  PageSelectOptions select_;
};

// LoSA on the denoising steps of a block (call.step >= 0, the chunk one bidirectional block over
// a non-empty prefix): PrefixAttention keeps O_p, L_p, Q_ref per layer, recomputes the prefix
// attention of the top-K changed rows by QUEST and merges the intra-block attention (sparsa/losa.h);
// a block's first step is dense. Prefill, commit and logits passes stay exact (the base class).
class LosaAttention final : public SplitAttention {
 public:
  LosaAttention(const AttentionPolicy& policy, const LosaOptions& losa) : SplitAttention(policy), losa_(losa) {
    losa_.attention.backend = policy.backend == Backend::cuda ? Backend::cpu : policy.backend;
    losa_.attention.num_threads = policy.num_threads;
  }

  Status forward(const AttentionCall& call) override {
    const int64_t heads_q = call.q.shape[1], n = call.q.shape[2], hd = call.q.shape[3];
    const bool block_step = call.step >= 0 && call.prefix != nullptr && call.pos0 > 0 &&
                            (call.block_causal == 0 || call.block_causal >= n);
    if (!block_step) return SplitAttention::forward(call);
    if (!state_ || state_->config().block_size != n || state_->config().heads_q != heads_q) {
      LosaConfig lc{heads_q, call.k.shape[1], hd, n};
      auto s = PrefixAttention::create(lc, losa_);
      if (!s.ok()) return s.status();
      state_ = std::make_unique<PrefixAttention>(std::move(s).value());
    }
    if (call.step == 0) state_->begin_block();
    if (lse_.empty() || lse_.shape()[1] != heads_q || lse_.shape()[2] != n) lse_ = HostArray(DType::f32, {1, heads_q, n});
    return state_->step(*call.prefix, call.q, call.k, call.v, call.out, lse_.view());
  }
  // Its block steps merge the prefix and the block only (LoSA's cached rows know no suffix).
  bool takes_suffix() const override { return false; }
  void on_commit() override {
    if (state_) state_->begin_block();
  }
  void on_reset() override {
    if (state_) state_->begin_block();
  }

 private:
  LosaOptions losa_;
  std::unique_ptr<PrefixAttention> state_;
  HostArray lse_;
};

// The device state of one layer's QUEST or LoSA, shared by the sequences made together
// (make_sequences): the batched DevicePrefixAttention (made at the first block step), sequence i
// its entry i, and the batched steps' log-sum-exp scratch.
struct DeviceBatch {
  int64_t size = 1;
  std::unique_ptr<DevicePrefixAttention> state;
  Scratch scratch;
};

// QUEST or LoSA on the cuda backend (sparsa/device_losa.h): the denoising steps of a block (the
// chunk one bidirectional block of up to 64 tokens over a non-empty prefix) run the device step
// over the engine's own paged cache — QUEST's pages for every row every step; LoSA's dense
// first step, then QUEST for the top-K changed rows with the others' cached prefix output — and
// merge the intra-block attention in the same launches. Prefill, commit and logits passes stay
// exact (the base class), so on this backend QUEST selects on denoising steps only. The block
// steps of a batched forward's sequences run together: consecutive entries whose rows are
// consecutive in the forward's scratch as one step_entries call, each entry in its own phase.
class DevicePrefixMethod final : public SplitAttention {
 public:
  DevicePrefixMethod(const AttentionPolicy& policy, const LosaOptions& o, std::shared_ptr<DeviceBatch> batch,
                     int64_t entry)
      : SplitAttention(policy), o_(o), batch_(std::move(batch)), entry_(entry) {
    o_.attention.backend = Backend::cuda;
    device_ = policy.device;
  }

  const void* batch_state() const override { return batch_.get(); }
  bool takes_suffix() const override { return false; }  // the device step knows no suffix

  Status forward(const AttentionCall& call) override {
    LayerAttention* self = this;
    return forward_batch(std::span<LayerAttention* const>(&self, 1), std::span<const AttentionCall>(&call, 1));
  }

  // members: DevicePrefixMethods of this layer sharing batch_ (attend() groups them by batch_state).
  Status forward_batch(std::span<LayerAttention* const> members, std::span<const AttentionCall> calls) override {
    std::vector<size_t> steps;  // the members on a block step, in the given order
    for (size_t i = 0; i < members.size(); ++i) {
      auto* m = static_cast<DevicePrefixMethod*>(members[i]);
      if (m->batch_.get() != batch_.get()) return Status(StatusCode::internal, "attention: a batch of another layer");
      if (block_step(calls[i])) {
        steps.push_back(i);
      } else {
        SPARSA_RETURN_IF_ERROR(m->SplitAttention::forward(calls[i]));
      }
    }
    if (steps.empty()) return Status::Ok();
    const AttentionCall& c0 = calls[steps[0]];
    const int64_t heads_q = c0.q.shape[1], n = c0.q.shape[2], hd = c0.q.shape[3];
    if (!batch_->state || batch_->state->config().block_size != n || batch_->state->config().heads_q != heads_q) {
      DeviceLosaConfig dc{batch_->size, heads_q, c0.k.shape[1], hd, n};
      auto made = DevicePrefixAttention::create(dc, o_, device_, c0.q.dtype);
      if (!made.ok()) {
        return Status(made.status().code(),
                      std::string(prefix_method_name(o_.method)) + " on cuda: " + made.status().message());
      }
      batch_->state = std::make_unique<DevicePrefixAttention>(std::move(made).value());
    }
    DevicePrefixAttention* state = batch_->state.get();
    auto entry_of = [&](size_t i) { return static_cast<DevicePrefixMethod*>(members[steps[i]])->entry_; };
    for (size_t i = 0; i < steps.size(); ++i) {
      const AttentionCall& c = calls[steps[i]];
      if (c.q.shape[2] != n || c.q.shape[1] != heads_q) {
        return Status(StatusCode::internal, "attention: block steps of different shapes in one batch");
      }
      if (c.step == 0) state->begin_block(entry_of(i));
    }
    // Runs of entries e, e + 1, ... whose calls' rows follow each other in the scratch (one
    // strided [count, heads, n, head_dim] view each) over one cache.
    auto follows = [&](const AttentionCall& a, const AttentionCall& b) {
      auto next = [](const Tensor& x, const Tensor& y) {
        return static_cast<const std::byte*>(x.data) + x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype)) ==
               static_cast<const std::byte*>(y.data);
      };
      return a.device_prefix == b.device_prefix && next(a.q, b.q) && next(a.k, b.k) && next(a.v, b.v) &&
             next(a.out, b.out);
    };
    for (size_t r0 = 0; r0 < steps.size();) {
      size_t r1 = r0 + 1;
      while (r1 < steps.size() && entry_of(r1) == entry_of(r1 - 1) + 1 &&
             follows(calls[steps[r1 - 1]], calls[steps[r1]])) {
        ++r1;
      }
      const int64_t count = static_cast<int64_t>(r1 - r0);
      const AttentionCall& first = calls[steps[r0]];
      std::vector<int> seqs;
      for (size_t i = r0; i < r1; ++i) seqs.push_back(calls[steps[i]].device_seq);
      auto run = [&](Tensor t) {
        t.shape[0] = count;
        return t;
      };
      auto lse = batch_->scratch.get(0, DType::f32, {count, heads_q, n}, first.q.device, options_.stream);
      if (!lse.ok()) return lse.status();
      SPARSA_RETURN_IF_ERROR(state->step_entries(entry_of(r0), *first.device_prefix, seqs, run(first.q), run(first.k),
                                                 run(first.v), run(first.out), lse.value(), options_.stream));
      r0 = r1;
    }
    return Status::Ok();
  }
  // Entry `entry` of a batch of sequences made together (make_layer_attentions).
  void join(std::shared_ptr<DeviceBatch> batch, int64_t entry) {
    batch_ = std::move(batch);
    entry_ = entry;
  }
  void on_commit() override {
    if (batch_->state) batch_->state->begin_block(entry_);
  }
  void on_reset() override {
    if (batch_->state) batch_->state->begin_block(entry_);
  }

 private:
  static bool block_step(const AttentionCall& call) {
    const int64_t n = call.q.shape[2];
    return call.step >= 0 && call.device_prefix != nullptr && call.pos0 > 0 &&
           (call.block_causal == 0 || call.block_causal >= n);
  }

  LosaOptions o_;
  int device_ = 0;
  std::shared_ptr<DeviceBatch> batch_;
  int64_t entry_ = 0;
};

Status page_options(Params& p, PageSelectOptions* s, const std::string& where) {
  SPARSA_RETURN_IF_ERROR(p.integer("budget", 16, int64_t{1} << 30, &s->budget));
  SPARSA_RETURN_IF_ERROR(p.flag("force_first", &s->force_first));
  SPARSA_RETURN_IF_ERROR(p.flag("force_last", &s->force_last));
  Status st = validate(*s, 16);  // the pages of the engine's cache hold 16 tokens
  return st.ok() ? st : Status(st.code(), where + ": " + st.message());
}

}  // namespace

int64_t canvas_block_default(Backend backend) { return backend == Backend::cuda ? 128 : 64; }

namespace {

Result<std::unique_ptr<LayerAttention>> make_method(const AttentionPolicy& policy, const std::string& text,
                                                    const std::string& where) {
  auto spec = parse_spec(text, where);
  if (!spec.ok()) return spec.status();
  Params p(*spec, where);
  if (spec->name == "dense") {
    SPARSA_RETURN_IF_ERROR(p.done("dense takes none"));
    return std::unique_ptr<LayerAttention>(new DenseAttention(policy));
  }
  if (spec->name == "ba_att" || spec->name == "mean_pool" || spec->name == "xattention") {
    // The canvas selectors: one budget (density 0.5 by default), block, min_tokens; then each
    // method's own switches.
    const std::string& name = spec->name;
    double density = 0.5, tau = 0.9;
    int64_t top_kappa = 0, block = canvas_block_default(policy.backend), min_tokens = 1024;
    const int budgets = int{p.has("density")} + int{p.has("top_kappa")} + int{p.has("tau")};
    if (budgets > 1) return invalid_argument(where + ": " + name + " takes one of density, top_kappa, tau");
    SPARSA_RETURN_IF_ERROR(p.number("density", 1e-9, 1.0, &density));
    SPARSA_RETURN_IF_ERROR(p.number("tau", 1e-9, 1.0, &tau));
    SPARSA_RETURN_IF_ERROR(p.integer("top_kappa", 1, int64_t{1} << 30, &top_kappa));
    SPARSA_RETURN_IF_ERROR(p.integer("block", 1, 4096, &block));
    SPARSA_RETURN_IF_ERROR(p.integer("min_tokens", 0, int64_t{1} << 40, &min_tokens));
    const Budget budget = p.has("top_kappa") ? Budget::top_kappa(top_kappa)
                          : p.has("tau")     ? Budget::mass(tau)
                                             : Budget::density(density);
    // block_causal: also the block-causal chunks (sdar's prefill), the selection seeing the mask
    // unless BA-Att sorts (for_chunk).
    bool block_causal = false;
    SPARSA_RETURN_IF_ERROR(p.flag("block_causal", &block_causal));
    if (name == "xattention") {
      XAttentionOptions x;
      int64_t stride = 8;
      SPARSA_RETURN_IF_ERROR(p.integer("stride", 1, 4096, &stride));
      SPARSA_RETURN_IF_ERROR(p.flag("force_first", &x.force_first));
      SPARSA_RETURN_IF_ERROR(p.flag("force_diagonal", &x.force_diagonal));
      SPARSA_RETURN_IF_ERROR(
          p.done("density, top_kappa, tau, block, min_tokens, stride, force_first, force_diagonal, block_causal"));
      if (policy.backend == Backend::cuda) {
        return Status(StatusCode::unsupported, where + ": xattention's selection runs on the cpu backend only");
      }
      x.budget = budget;
      x.block_q = x.block_kv = static_cast<int>(block);
      x.stride = static_cast<int>(stride);
      return std::unique_ptr<LayerAttention>(new XAttentionAttention(policy, x, min_tokens, block_causal));
    }
    BaAttOptions ba;
    ba.budget = budget;
    ba.block_q = ba.block_kv = static_cast<int>(block);
    if (name == "mean_pool") {  // BA-Att's selector without the norm sort and the compensation
      SPARSA_RETURN_IF_ERROR(p.done("density, top_kappa, tau, block, min_tokens, block_causal"));
      ba.sort_q = ba.sort_k = false;
      ba.compensate = false;
      return std::unique_ptr<LayerAttention>(new BaAttAttention(policy, ba, min_tokens, block_causal, name));
    }
    double beta = 1.0;
    SPARSA_RETURN_IF_ERROR(p.number("beta", 0.0, 16.0, &beta));
    SPARSA_RETURN_IF_ERROR(p.flag("compensate", &ba.compensate));
    if (p.has("sort") && (p.has("sort_q") || p.has("sort_k"))) {
      return invalid_argument(where + ": ba_att sort sets both sort_q and sort_k; give either sort or sort_q/sort_k");
    }
    bool sort = true;
    SPARSA_RETURN_IF_ERROR(p.flag("sort", &sort));
    ba.sort_q = ba.sort_k = sort;
    SPARSA_RETURN_IF_ERROR(p.flag("sort_q", &ba.sort_q));
    SPARSA_RETURN_IF_ERROR(p.flag("sort_k", &ba.sort_k));
    SPARSA_RETURN_IF_ERROR(
        p.done("density, top_kappa, tau, block, min_tokens, beta, compensate, sort, sort_q, sort_k, block_causal"));
    ba.beta = static_cast<float>(beta);
    return std::unique_ptr<LayerAttention>(new BaAttAttention(policy, ba, min_tokens, block_causal, name));
  }
  if (spec->name == "quest") {
    PageSelectOptions s;
    SPARSA_RETURN_IF_ERROR(page_options(p, &s, where + ": quest"));
    SPARSA_RETURN_IF_ERROR(p.done("budget, force_first, force_last"));
    if (policy.backend == Backend::cuda) {
      LosaOptions o;
      o.method = PrefixMethod::quest;
      o.select = s;
      return std::unique_ptr<LayerAttention>(new DevicePrefixMethod(policy, o, std::make_shared<DeviceBatch>(), 0));
    }
    return std::unique_ptr<LayerAttention>(new QuestAttention(policy, s));
  }
  if (spec->name == "losa") {
    LosaOptions o;
    SPARSA_RETURN_IF_ERROR(page_options(p, &o.select, where + ": losa"));
    int64_t k = o.active_k;
    SPARSA_RETURN_IF_ERROR(p.integer("k", 0, 1024, &k));
    o.active_k = static_cast<int>(k);
    if (p.has("threshold")) {
      double t = 0;
      SPARSA_RETURN_IF_ERROR(p.number("threshold", 0.0, 1e30, &t));
      o.mse_threshold = t;
    }
    SPARSA_RETURN_IF_ERROR(p.done("budget, k, threshold, force_first, force_last"));
    if (policy.backend == Backend::cuda) {
      return std::unique_ptr<LayerAttention>(new DevicePrefixMethod(policy, o, std::make_shared<DeviceBatch>(), 0));
    }
    return std::unique_ptr<LayerAttention>(new LosaAttention(policy, o));
  }
  return invalid_argument(where + ": unknown method '" + spec->name +
                          "' (expected dense, ba_att, mean_pool, xattention, quest or losa)");
}

}  // namespace

Result<std::unique_ptr<LayerAttention>> make_layer_attention(const AttentionPolicy& policy, int layer, int request) {
  const std::string& text =
      layer < static_cast<int>(policy.layer_methods.size()) && !policy.layer_methods[layer].empty()
          ? policy.layer_methods[layer]
          : policy.method;
  auto method = make_method(policy, text, "attention (layer " + std::to_string(layer) + ")");
  if (!method.ok() || !policy.recorder || request < 0) return method;
  return policy.recorder->wrap(std::move(method).value(), layer, request, text);
}

Result<std::vector<std::unique_ptr<LayerAttention>>> make_layer_attentions(const AttentionPolicy& policy, int layer,
                                                                           std::span<const int> requests) {
  if (requests.empty() || static_cast<int64_t>(requests.size()) > kDeviceLosaMaxBatch) {
    return invalid_argument("requests: expected 1 to " + std::to_string(kDeviceLosaMaxBatch) + " sequences, got " +
                            std::to_string(requests.size()));
  }
  std::vector<std::unique_ptr<LayerAttention>> out;
  for (int request : requests) {
    auto a = make_layer_attention(policy, layer, request);
    if (!a.ok()) return a.status();
    out.push_back(std::move(a).value());
  }
  // The device prefix methods of the batch share one state, entry i for sequence i.
  auto batch = std::make_shared<DeviceBatch>();
  batch->size = static_cast<int64_t>(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    if (auto* d = dynamic_cast<DevicePrefixMethod*>(out[i].get())) d->join(batch, static_cast<int64_t>(i));
  }
  return out;
}

Status expand_layer_methods(const std::vector<std::string>& overrides, int n_layers,
                            std::vector<std::string>* layer_methods) {
  layer_methods->assign(static_cast<size_t>(n_layers), "");
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == o.size()) {
      return invalid_argument("attention_layers: expected LAYERS=METHOD such as 0,1,31=dense, got '" + o + "'");
    }
    const std::string layers = o.substr(0, eq), method = o.substr(eq + 1);
    size_t i = 0;
    while (i <= layers.size()) {
      const size_t j = std::min(layers.find(',', i), layers.size());
      const std::string item = layers.substr(i, j - i);
      char* end = nullptr;
      const long l = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || end != item.c_str() + item.size() || l < 0 || l >= n_layers) {
        return invalid_argument("attention_layers: layer '" + item + "' in '" + o + "' is not in [0, " +
                                std::to_string(n_layers) + ")");
      }
      (*layer_methods)[static_cast<size_t>(l)] = method;
      i = j + 1;
    }
  }
  return Status::Ok();
}

}  // namespace sparsa::dlm
