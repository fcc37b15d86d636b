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
