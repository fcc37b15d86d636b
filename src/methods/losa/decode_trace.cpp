// The synthetic block-diffusion decode trace (sparsa/decode_trace.h).
#include "sparsa/decode_trace.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "core/attention_params.h"
#include "core/validate.h"

namespace sparsa {

WorkloadConfig DecodeTraceConfig::default_workload() {
  WorkloadConfig w;
  w.heads_q = 8;
  w.heads_kv = 2;
  w.head_dim = 64;
  w.retrieval_span = 8;  // planted spans must fit in the decoded blocks' queries
  return w;
}

Status validate(const DecodeTraceConfig& c) {
  if (c.prefix_len < 0) return invalid_argument("prefix_len: expected >= 0, got " + std::to_string(c.prefix_len));
  if (c.block_size < 4 || c.block_size > 32) {
    return invalid_argument("block_size: expected 4 to 32 tokens, got " + std::to_string(c.block_size));
  }
  if (c.num_blocks < 1) return invalid_argument("num_blocks: expected >= 1, got " + std::to_string(c.num_blocks));
  if (c.tokens_per_step < 1 || c.tokens_per_step > c.block_size) {
    return invalid_argument("tokens_per_step: expected 1 to block_size (" + std::to_string(c.block_size) +
                            "), got " + std::to_string(c.tokens_per_step));
  }
  const int64_t needed = (c.block_size + c.tokens_per_step - 1) / c.tokens_per_step;
  if (c.steps_per_block != 0 && (c.steps_per_block < needed || c.steps_per_block > 1024)) {
    return invalid_argument("steps_per_block: unmasking " + std::to_string(c.tokens_per_step) +
                            " token(s) per step needs " + std::to_string(needed) + " to 1024 steps for a block of " +
                            std::to_string(c.block_size) + " (or 0 for exactly that), got " +
                            std::to_string(c.steps_per_block));
  }
  for (auto [name, x] : {std::pair{"unmask_move", c.unmask_move}, std::pair{"neighbour_move", c.neighbour_move},
                         std::pair{"drift", c.drift}}) {
    if (!std::isfinite(x) || x < 0.0f) {
      return invalid_argument(std::string(name) + ": expected a finite number >= 0, got " + std::to_string(x));
    }
  }
  return {};
}

namespace {

// Seeded standard normals (Box-Muller on mt19937_64, whose output the standard fixes, so
// the trace is the same with every standard library).
class Normal {
 public:
  explicit Normal(uint64_t seed) : rng_(seed) {}
  float operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(rng_() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)), a = 6.283185307179586 * u2;
    spare_ = static_cast<float>(r * std::sin(a));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(a));
  }
  uint64_t bits() { return rng_(); }

 private:
  std::mt19937_64 rng_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

// One of q, k, v of a block: clean rows x* [heads, Bb, d] and the walking state.
struct Rows {
  int64_t heads, B, D;
  std::vector<float> clean, state, rms;  // rms [heads, Bb]

  Rows(const Tensor& t, int64_t first, int64_t B_) : heads(t.shape[1]), B(B_), D(t.shape[3]) {
    clean.resize(heads * B * D);
    rms.resize(heads * B);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < B; ++i) {
        float* row = clean.data() + (h * B + i) * D;
        detail::load_row(t.data, DType::f32, t.offset({0, h, first + i, 0}), D, row);
        double ss = 0;
        for (int64_t x = 0; x < D; ++x) ss += double{row[x]} * row[x];
        rms[h * B + i] = static_cast<float>(std::sqrt(ss / D));
      }
    state = clean;
  }
  // state[i] += size * rms(x*_i) * N(0, I), for every head.
  void move(int64_t i, float size, Normal& normal) {
    for (int64_t h = 0; h < heads; ++h) {
      const float s = size * rms[h * B + i];
      float* row = state.data() + (h * B + i) * D;
      for (int64_t x = 0; x < D; ++x) row[x] += s * normal();
    }
  }
  void settle(int64_t i) {
    for (int64_t h = 0; h < heads; ++h)
      std::copy_n(clean.data() + (h * B + i) * D, D, state.data() + (h * B + i) * D);
  }
  HostArray snapshot() const {
    HostArray a(DType::f32, {1, heads, B, D});
    std::copy(state.begin(), state.end(), a.ptr<float>());
    return a;
  }
};

Status check_clean(const char* name, const Tensor& t, int64_t heads, int64_t len, int64_t d, bool at_least) {
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor(name, t, Device{}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype(name, t, DType::f32));
  const bool ok = t.shape[0] == 1 && (heads < 0 || t.shape[1] == heads) && (at_least ? t.shape[2] >= len : t.shape[2] == len) &&
                  (d < 0 || t.shape[3] == d);
  if (!ok) {
    return invalid_argument(std::string(name) + ": expected [1, " + (heads < 0 ? std::string("heads") : std::to_string(heads)) +
                            ", " + (at_least ? ">= " : "") + std::to_string(len) + ", " +
                            (d < 0 ? std::string("head_dim") : std::to_string(d)) + "], got " + t.shape_string());
  }
  return {};
}

}  // namespace

Result<DecodeTrace> DecodeTrace::from_tensors(const DecodeTraceConfig& config, const Tensor& q, const Tensor& k,
                                              const Tensor& v) {
  SPARSA_RETURN_IF_ERROR(validate(config));
  const int64_t B = config.block_size, nb = config.num_blocks, total = config.prefix_len + nb * B;
  SPARSA_RETURN_IF_ERROR(check_clean("k", k, -1, total, -1, false));
  const int64_t heads_kv = k.shape[1], d = k.shape[3];
  SPARSA_RETURN_IF_ERROR(check_clean("v", v, heads_kv, total, d, false));
  SPARSA_RETURN_IF_ERROR(check_clean("q", q, -1, nb * B, d, true));
  if (q.shape[1] % heads_kv != 0) {
    return invalid_argument("q: heads_q (" + std::to_string(q.shape[1]) + ") must be a multiple of heads_kv (" +
                            std::to_string(heads_kv) + ")");
  }
  DecodeTrace trace;
  trace.config_ = config;
  trace.heads_q_ = q.shape[1];
  trace.heads_kv_ = heads_kv;
  trace.head_dim_ = d;
  const int64_t S = config.steps_per_block != 0 ? config.steps_per_block
                                                : (B + config.tokens_per_step - 1) / config.tokens_per_step;
  trace.steps_ = S;
  trace.k_clean_ = HostArray::copy_of(k);
  trace.v_clean_ = HostArray::copy_of(v);

  Normal normal(config.seed);
  const int64_t q_first = q.shape[2] - nb * B;
  for (int64_t b = 0; b < nb; ++b) {
    Rows rq(q, q_first + b * B, B), rk(k, config.prefix_len + b * B, B), rv(v, config.prefix_len + b * B, B);
    for (int64_t i = 0; i < B; ++i)  // every token starts masked
      for (Rows* r : {&rq, &rk, &rv}) r->move(i, config.unmask_move, normal);
    std::vector<int64_t> order(B);  // unmask order: seeded Fisher-Yates
    for (int64_t i = 0; i < B; ++i) order[i] = i;
    for (int64_t i = B - 1; i > 0; --i) std::swap(order[i], order[normal.bits() % static_cast<uint64_t>(i + 1)]);
    for (int64_t s = 0; s < S; ++s) {
      trace.q_steps_.push_back(rq.snapshot());
      trace.k_steps_.push_back(rk.snapshot());
      trace.v_steps_.push_back(rv.snapshot());
      const int64_t begin = std::min(B, s * config.tokens_per_step);
      const int64_t end = s == S - 1 ? B : std::min(B, (s + 1) * config.tokens_per_step);
      std::vector<int64_t> now(order.begin() + begin, order.begin() + end);
      std::sort(now.begin(), now.end());
      std::vector<char> kind(B, 0);  // 0 drift, 1 neighbour, 2 unmasked
      for (int64_t i : now) {
        if (i > 0) kind[i - 1] = std::max<char>(kind[i - 1], 1);
        if (i + 1 < B) kind[i + 1] = std::max<char>(kind[i + 1], 1);
      }
      for (int64_t i : now) kind[i] = 2;
      for (int64_t i = 0; i < B; ++i) {
        for (Rows* r : {&rq, &rk, &rv}) {
          if (kind[i] == 2) r->settle(i);
          else r->move(i, kind[i] == 1 ? config.neighbour_move : config.drift, normal);
        }
      }
      trace.unmasked_.push_back(std::move(now));
    }
  }
  return trace;
}

Result<DecodeTrace> DecodeTrace::from_recorded(const Tensor& prefix_k, const Tensor& prefix_v,
                                               const std::vector<RecordedTraceBlock>& blocks) {
  if (blocks.empty()) return invalid_argument("blocks: expected at least one recorded block");
  const RecordedTraceBlock& first = blocks.front();
  if (first.q.empty()) return invalid_argument("blocks[0].q: expected at least one step");
  SPARSA_RETURN_IF_ERROR(check_clean("blocks[0].q[0]", first.q[0], -1, 4, -1, true));
  const int64_t heads_q = first.q[0].shape[1], B = first.q[0].shape[2], d = first.q[0].shape[3];
  const int64_t S = static_cast<int64_t>(first.q.size());
  if (first.final_k.data == nullptr) return invalid_argument("blocks[0].final_k: expected a tensor");
  SPARSA_RETURN_IF_ERROR(check_clean("blocks[0].final_k", first.final_k, -1, B, d, false));
  const int64_t heads_kv = first.final_k.shape[1];
  if (heads_q % heads_kv != 0) {
    return invalid_argument("blocks[0].q[0]: heads_q (" + std::to_string(heads_q) +
                            ") must be a multiple of heads_kv (" + std::to_string(heads_kv) + ")");
  }
  const bool has_prefix = prefix_k.data != nullptr || prefix_v.data != nullptr;
  int64_t P = 0;
  if (has_prefix) {
    SPARSA_RETURN_IF_ERROR(check_clean("prefix_k", prefix_k, heads_kv, 1, d, true));
    P = prefix_k.shape[2];
    SPARSA_RETURN_IF_ERROR(check_clean("prefix_v", prefix_v, heads_kv, P, d, false));
  }
  DecodeTraceConfig config;
  config.prefix_len = P;
  config.block_size = B;
  config.num_blocks = static_cast<int64_t>(blocks.size());
  config.steps_per_block = S;
  config.tokens_per_step = (B + S - 1) / S;
  if (Status s = validate(config); !s.ok()) return invalid_argument("blocks: " + s.message());

  DecodeTrace trace;
  trace.config_ = config;
  trace.heads_q_ = heads_q;
  trace.heads_kv_ = heads_kv;
  trace.head_dim_ = d;
  trace.steps_ = S;
  const int64_t total = P + config.num_blocks * B;
  trace.k_clean_ = HostArray(DType::f32, {1, heads_kv, total, d});
  trace.v_clean_ = HostArray(DType::f32, {1, heads_kv, total, d});
  // Rows [first, first + rows) of the clean K/V from t [1, heads_kv, rows, d].
  const auto place = [&](HostArray& dst, const Tensor& t, int64_t first_row) {
    for (int64_t h = 0; h < heads_kv; ++h)
      for (int64_t i = 0; i < t.shape[2]; ++i) {
        detail::load_row(t.data, DType::f32, t.offset({0, h, i, 0}), d,
                         dst.ptr<float>() + (h * total + first_row + i) * d);
      }
  };
  if (P > 0) {
    place(trace.k_clean_, prefix_k, 0);
    place(trace.v_clean_, prefix_v, 0);
  }
  for (size_t b = 0; b < blocks.size(); ++b) {
    const RecordedTraceBlock& rb = blocks[b];
    const std::string at = "blocks[" + std::to_string(b) + "]";
    if (static_cast<int64_t>(rb.q.size()) != S || rb.k.size() != rb.q.size() || rb.v.size() != rb.q.size() ||
        rb.unmasked.size() != rb.q.size()) {
      return invalid_argument(at + ": expected " + std::to_string(S) + " steps of q, k, v and unmasked (block 0's), got " +
                              std::to_string(rb.q.size()) + ", " + std::to_string(rb.k.size()) + ", " +
                              std::to_string(rb.v.size()) + ", " + std::to_string(rb.unmasked.size()));
    }
    for (const auto& [name, t] : {std::pair{".final_k", &rb.final_k}, std::pair{".final_v", &rb.final_v}}) {
      if (t->data == nullptr) return invalid_argument(at + name + ": expected a tensor");
      SPARSA_RETURN_IF_ERROR(check_clean((at + name).c_str(), *t, heads_kv, B, d, false));
    }
    place(trace.k_clean_, rb.final_k, P + static_cast<int64_t>(b) * B);
    place(trace.v_clean_, rb.final_v, P + static_cast<int64_t>(b) * B);
    for (int64_t st = 0; st < S; ++st) {
      const std::string step = at + "[step " + std::to_string(st) + "]";
      SPARSA_RETURN_IF_ERROR(check_clean((step + ".q").c_str(), rb.q[st], heads_q, B, d, false));
      SPARSA_RETURN_IF_ERROR(check_clean((step + ".k").c_str(), rb.k[st], heads_kv, B, d, false));
      SPARSA_RETURN_IF_ERROR(check_clean((step + ".v").c_str(), rb.v[st], heads_kv, B, d, false));
      const std::vector<int64_t>& u = rb.unmasked[st];
      for (size_t i = 0; i < u.size(); ++i) {
        if (u[i] < 0 || u[i] >= B || (i > 0 && u[i] <= u[i - 1])) {
          return invalid_argument(step + ".unmasked: expected ascending distinct tokens in [0, " + std::to_string(B) +
                                  "), got " + std::to_string(u[i]) + " at " + std::to_string(i));
        }
      }
      trace.q_steps_.push_back(HostArray::copy_of(rb.q[st]));
      trace.k_steps_.push_back(HostArray::copy_of(rb.k[st]));
      trace.v_steps_.push_back(HostArray::copy_of(rb.v[st]));
      trace.unmasked_.push_back(u);
    }
  }
  return trace;
}

Tensor DecodeTrace::prefix_view(const HostArray& a) const {
  if (config_.prefix_len == 0) return {};
  Tensor t = a.view();
  t.shape[2] = config_.prefix_len;
  return t;
}

Tensor DecodeTrace::block_view(const HostArray& a, int64_t block) const {
  if (!in_range(block, 0)) return {};
  Tensor t = a.view();
  t.data = const_cast<float*>(a.ptr<float>()) + (config_.prefix_len + block * config_.block_size) * head_dim_;
  t.shape[2] = config_.block_size;
  return t;
}

Tensor DecodeTrace::step_view(const std::vector<HostArray>& steps, int64_t, int64_t block, int64_t step) const {
  if (!in_range(block, step)) return {};
  return steps[block * steps_ + step].view();
}

}  // namespace sparsa
