// The seeded workload generator (docs/workload.md).
//
// Bit-identical output on every machine rests on three things:
//   1. our own PRNG (xoshiro256** seeded through splitmix64), never <random>, whose
//      distributions are implementation-defined;
//   2. our own elementary functions (log, exp, sin/cos) built from + - * / sqrt,
//      floor and bit operations, all exactly rounded by IEEE 754; libm results may
//      differ in the last bit between libraries;
//   3. no fused multiply-add contraction in this file (the pragma below), so an
//      FMA-capable and an FMA-less build round identically.
// Work is split into fixed chunks of tokens, each with its own PRNG stream keyed by
// (seed, tensor, batch, head, chunk), so the thread count never changes a bit.

// Must precede every function definition of this translation unit (headers included).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "sparsa/workload.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu/parallel.h"

namespace sparsa {
namespace {

// ---- PRNG ------------------------------------------------------------------------

// splitmix64's output function: a bijective 64-bit mixer.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Stream tags: one per kind of random draw, so streams never overlap.
enum Tag : uint64_t {
  kTagHead = 1,      // per kv head profile
  kTagQueryHead,     // per query head jitter
  kTagSequence,      // per (batch, kv head) retrieval plan
  kTagQueryNoise,
  kTagQueryToken,
  kTagKeyNoise,
  kTagKeyToken,
  kTagValueNoise,
};

uint64_t stream_key(uint64_t seed, Tag tag, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0) {
  uint64_t h = mix64(seed);
  h = mix64(h ^ tag);
  h = mix64(h ^ a);
  h = mix64(h ^ (b + 0x632BE59BD9B4E019ull));
  return mix64(h ^ (c + 0x8CB92BA72F3D8DD7ull));
}

// ---- elementary functions (float, exactly reproducible) ----------------------------

// floor for |x| < 2^31 (resp. 2^63). std::floor is exact too, but the compiler
// does not vectorise it here.
inline float floor_float(float x) {
  const float t = static_cast<float>(static_cast<int32_t>(x));
  return t > x ? t - 1.0f : t;
}
inline double floor_double(double x) {
  const double t = static_cast<double>(static_cast<int64_t>(x));
  return t > x ? t - 1.0 : t;
}

// log(x) for x a positive normal float. x = m * 2^e with m in [sqrt(1/2), sqrt(2));
// log m = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.172: the odd series to s^9 is
// accurate to ~1e-9, below float rounding.
inline float log_positive(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  int e = static_cast<int>(bits >> 23) - 127;
  float m = std::bit_cast<float>((bits & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  e += high ? 1 : 0;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  const float log_m = 2.0f * s * (1.0f + s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9)))));
  return static_cast<float>(e) * 0.693147181f + log_m;
}

// exp(x): x = k ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), Taylor to r^7.
inline float exp_float(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float k = floor_float(x * 1.44269504f + 0.5f);
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682e-6f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 +
                  r * (1.0f / 720 + r * (1.0f / 5040)))))));
  return p * std::bit_cast<float>(static_cast<uint32_t>(static_cast<int>(k) + 127) << 23);
}

// sqrt(x) for x >= 0 by Newton's iteration on 1/sqrt(x) from the classic bit-level
// guess: three steps reach float precision. (std::sqrt would be exact too, but its
// errno path keeps the Box-Muller loop from vectorising.)
inline float sqrt_nonnegative(float x) {
  const float xc = std::max(x, 1e-30f);
  float y = std::bit_cast<float>(0x5F375A86u - (std::bit_cast<uint32_t>(xc) >> 1));
  for (int step = 0; step < 3; ++step) y = y * (1.5f - 0.5f * xc * y * y);
  return x * y;
}

// sin and cos of 2*pi*turns for turns in [0, 1]: reduce to the nearest quarter turn,
// a Taylor polynomial on [-pi/4, pi/4], then rotate by the quadrant.
inline void sincos_turns(float turns, float& sin_out, float& cos_out) {
  const float quarters = turns * 4.0f;
  const float quadrant = floor_float(quarters + 0.5f);
  const float a = (quarters - quadrant) * 1.57079633f;
  const float a2 = a * a;
  const float s = a * (1.0f + a2 * (-1.0f / 6 + a2 * (1.0f / 120 + a2 * (-1.0f / 5040 + a2 * (1.0f / 362880)))));
  const float c = 1.0f + a2 * (-0.5f + a2 * (1.0f / 24 + a2 * (-1.0f / 720 + a2 * (1.0f / 40320))));
  const int q = static_cast<int>(quadrant) & 3;
  sin_out = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
  cos_out = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
}

// xoshiro256** (Blackman & Vigna), seeded from a stream key through splitmix64.
class Rng {
 public:
  explicit Rng(uint64_t key) {
    for (uint64_t& word : state_) {
      key += 0x9E3779B97F4A7C15ull;
      word = mix64(key);
    }
  }

  uint64_t next() {
    const uint64_t result = std::rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = std::rotl(state_[3], 45);
    return result;
  }

  float uniform() { return static_cast<float>(next() >> 40) * 0x1p-24f; }       // [0, 1)
  float uniform_symmetric() { return 2.0f * uniform() - 1.0f; }                 // [-1, 1)
  uint64_t below(uint64_t n) {                                                   // [0, n)
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }

  void uniforms(float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = uniform();
  }

  // Standard normals by Box-Muller over blocks of kPairs draws: each 64-bit draw gives
  // u1 in (0, 1] and u2 in [0, 1) (24 bits each); a block yields the kPairs cosine
  // normals, then the kPairs sine normals. A partial last block is drawn whole.
  void normals(float* out, int64_t n) {
    constexpr int kPairs = 128;
    int32_t bits1[kPairs], bits2[kPairs];
    float z[2 * kPairs];
    while (n > 0) {
      for (int i = 0; i < kPairs; ++i) {
        const uint64_t x = next();
        bits1[i] = static_cast<int32_t>(x >> 40);
        bits2[i] = static_cast<int32_t>((x >> 8) & 0xFFFFFFu);
      }
      for (int i = 0; i < kPairs; ++i) {  // branch-free: the compiler vectorises it
        const float u1 = static_cast<float>(bits1[i] + 1) * 0x1p-24f;
        const float u2 = static_cast<float>(bits2[i]) * 0x1p-24f;
        const float radius = sqrt_nonnegative(-2.0f * log_positive(u1));
        float s, c;
        sincos_turns(u2, s, c);
        z[i] = radius * c;
        z[kPairs + i] = radius * s;
      }
      const int64_t take = std::min<int64_t>(n, 2 * kPairs);
      std::memcpy(out, z, static_cast<size_t>(take) * sizeof(float));
      out += take;
      n -= take;
    }
  }

 private:
  uint64_t state_[4];
};

// ---- fixed modelling constants (docs/workload.md, "Fixed choices") -----------------

constexpr int64_t kChunkTokens = 1024;      // tokens per PRNG stream
constexpr float kSinkQueryShare = 0.9f;     // fraction of queries with a sink component
constexpr float kSinkQueryJitter = 0.25f;   // relative spread of that component
constexpr float kSinkKeyJitter = 0.1f;      // relative spread of sink key norms
constexpr float kSinkKeyNoise = 0.25f;      // sink keys carry this fraction of the noise
constexpr float kSinkValueScale = 0.25f;    // sink values are small ("no-op" sinks)
constexpr float kRetrievalJitter = 0.5f;    // span tokens scale their component by U[0.75, 1.25]
constexpr float kValueMeanStd = 0.3f;       // per-head mean of the values, per dimension
constexpr float kValueSpanNorm = 0.5f;      // shared value direction of a key span, x sqrt(d)
constexpr float kQueryHeadJitter = 0.25f;   // query heads jitter by 2^(0.25 hv U[-1, 1])
constexpr float kSigmaVariation = 0.5f;     // norm_sigma varies by 2^(0.5 hv U[-1, 1])
constexpr int kPlacementTries = 64;         // draws to find a distant span pair

// Dimension roles, RoPE's rotate-half layout: pair p is dims (p, p + d/2). The first
// ceil(d/4) pairs rotate with position (the local band lives there); the remaining
// dims do not rotate (sink and retrieval directions live there, as content does in the
// low-frequency dims of RoPE models). With no static dims (d = 2) content uses all.
struct Layout {
  int64_t dim = 0;
  int64_t half = 0;
  int64_t rotary_pairs = 0;
  std::vector<int64_t> static_dims;
};

Layout make_layout(int64_t dim) {
  Layout layout;
  layout.dim = dim;
  layout.half = dim / 2;
  layout.rotary_pairs = (layout.half + 1) / 2;
  for (int64_t p = layout.rotary_pairs; p < layout.half; ++p) layout.static_dims.push_back(p);
  for (int64_t p = layout.rotary_pairs; p < layout.half; ++p) layout.static_dims.push_back(p + layout.half);
  if (dim % 2 == 1) layout.static_dims.push_back(dim - 1);
  if (layout.static_dims.empty())
    for (int64_t t = 0; t < dim; ++t) layout.static_dims.push_back(t);
  std::sort(layout.static_dims.begin(), layout.static_dims.end());
  return layout;
}

// A random unit vector over `support` (zero elsewhere), made orthogonal to `basis`
// (unit vectors) while that still leaves room in the support.
std::vector<float> random_direction(Rng& rng, int64_t dim, const std::vector<int64_t>& support,
                                    const std::vector<const std::vector<float>*>& basis) {
  std::vector<float> draws(support.size());
  rng.normals(draws.data(), static_cast<int64_t>(draws.size()));
  std::vector<double> x(static_cast<size_t>(dim), 0.0);
  for (size_t i = 0; i < support.size(); ++i) x[static_cast<size_t>(support[i])] = draws[i];
  if (basis.size() < support.size()) {
    for (const std::vector<float>* b : basis) {  // Gram-Schmidt
      double dot = 0;
      for (int64_t t = 0; t < dim; ++t) dot += x[t] * (*b)[t];
      for (int64_t t = 0; t < dim; ++t) x[t] -= dot * (*b)[t];
    }
  }
  double norm2 = 0;
  for (double value : x) norm2 += value * value;
  std::vector<float> unit(static_cast<size_t>(dim), 0.0f);
  if (norm2 <= 1e-24) {  // a measure-zero draw; keep a valid direction
    unit[static_cast<size_t>(support[0])] = 1.0f;
    return unit;
  }
  const double inv = 1.0 / std::sqrt(norm2);
  for (int64_t t = 0; t < dim; ++t) unit[t] = static_cast<float>(x[t] * inv);
  return unit;
}

float head_multiplier(Rng& rng, float variation) {
  return exp_float(variation * rng.uniform_symmetric() * 0.693147181f);  // 2^(variation U[-1, 1])
}

// What a kv head is like: a property of the "model", shared by every batch element.
struct KvHeadProfile {
  float sink_strength = 0;
  float local_strength = 0;
  float local_width = 0;
  float retrieval_strength = 0;
  float norm_sigma = 0;
  std::vector<double> cycles;     // [rotary_pairs] cycles per token of each rotary pair
  std::vector<float> local_dir;   // [d] unit, on rotary dims; rotated by position
  std::vector<float> sink_dir;    // [d] unit, on static dims
  std::vector<float> value_mean;  // [d]
};

// Frequencies of the rotary pairs: the quantiles of a half-Cauchy of scale 1/width,
// highest first as in RoPE. Equal weights make the mean of cos(omega * distance)
// approximate exp(-distance / width): a band that decays over `width` tokens and
// oscillates beyond it, like RoPE's long-term decay.
KvHeadProfile make_kv_profile(const WorkloadConfig& config, const Layout& layout, int64_t kv_head) {
  Rng rng(stream_key(config.seed, kTagHead, static_cast<uint64_t>(kv_head)));
  const float hv = config.head_variation;
  KvHeadProfile profile;
  profile.sink_strength = config.sink_strength * head_multiplier(rng, hv);
  profile.local_strength = config.local_strength * head_multiplier(rng, hv);
  profile.local_width = config.local_width * head_multiplier(rng, hv);
  profile.retrieval_strength = config.retrieval_strength * head_multiplier(rng, hv);
  profile.norm_sigma = config.norm_sigma * head_multiplier(rng, kSigmaVariation * hv);

  const int64_t d = layout.dim;
  profile.local_dir.assign(static_cast<size_t>(d), 0.0f);
  for (int64_t p = 0; p < layout.rotary_pairs; ++p) {
    const float quantile = 1.0f - (static_cast<float>(p) + 0.5f) / static_cast<float>(layout.rotary_pairs);
    float s, c;
    sincos_turns(0.25f * quantile, s, c);  // angle pi/2 * quantile
    const double omega = static_cast<double>(s) / static_cast<double>(c) / profile.local_width;
    profile.cycles.push_back(omega / 6.283185307179586);
    // Unit total norm, equal per pair, a random phase within the pair.
    const float radius = std::sqrt(1.0f / static_cast<float>(layout.rotary_pairs));
    float ps, pc;
    sincos_turns(rng.uniform(), ps, pc);
    profile.local_dir[static_cast<size_t>(p)] = radius * pc;
    if (p + layout.half < d) profile.local_dir[static_cast<size_t>(p + layout.half)] = radius * ps;
  }
  profile.sink_dir = random_direction(rng, d, layout.static_dims, {});
  profile.value_mean.resize(static_cast<size_t>(d));
  rng.normals(profile.value_mean.data(), d);
  for (float& x : profile.value_mean) x *= kValueMeanStd;
  return profile;
}

struct QueryHeadJitter {
  float sink = 1, local = 1, retrieval = 1;
};

QueryHeadJitter make_query_jitter(const WorkloadConfig& config, int64_t query_head) {
  Rng rng(stream_key(config.seed, kTagQueryHead, static_cast<uint64_t>(query_head)));
  const float variation = kQueryHeadJitter * config.head_variation;
  QueryHeadJitter jitter;
  jitter.sink = head_multiplier(rng, variation);
  jitter.local = head_multiplier(rng, variation);
  jitter.retrieval = head_multiplier(rng, variation);
  return jitter;
}

struct RetrievalPlan {
  int64_t q_start = 0, kv_start = 0;
  std::vector<float> direction;        // [d] unit, static dims, shared by Q span and K span
  std::vector<float> value_direction;  // [d] unit
};

// Planted pairs of one (batch, kv head): a key span and a query span at least
// span + 2 * width apart in position (beyond the local band), when the lengths allow;
// otherwise the most distant of kPlacementTries draws.
std::vector<RetrievalPlan> make_retrieval_plans(const WorkloadConfig& config, const Layout& layout,
                                                const KvHeadProfile& profile, int64_t batch,
                                                int64_t kv_head) {
  std::vector<RetrievalPlan> plans;
  if (config.retrieval_pairs <= 0) return plans;
  Rng rng(stream_key(config.seed, kTagSequence, static_cast<uint64_t>(batch), static_cast<uint64_t>(kv_head)));
  const int64_t span = config.retrieval_span;
  const int64_t q_offset = config.len_kv - config.len_q;  // position of query 0
  const int64_t kv_first = std::min<int64_t>(config.sink_tokens, config.len_kv - span);
  const int64_t kv_choices = config.len_kv - span - kv_first + 1;
  const int64_t q_choices = config.len_q - span + 1;
  const double min_gap = static_cast<double>(span) + 2.0 * profile.local_width;
  std::vector<const std::vector<float>*> basis{&profile.sink_dir};
  plans.reserve(static_cast<size_t>(config.retrieval_pairs));
  for (int pair = 0; pair < config.retrieval_pairs; ++pair) {
    RetrievalPlan plan;
    int64_t best_gap = -1;
    for (int attempt = 0; attempt < kPlacementTries; ++attempt) {
      const int64_t q_start = static_cast<int64_t>(rng.below(static_cast<uint64_t>(q_choices)));
      const int64_t kv_start = kv_first + static_cast<int64_t>(rng.below(static_cast<uint64_t>(kv_choices)));
      const int64_t gap = std::abs(q_start + q_offset - kv_start);
      if (gap > best_gap) {
        best_gap = gap;
        plan.q_start = q_start;
        plan.kv_start = kv_start;
      }
      if (static_cast<double>(gap) >= min_gap) break;
    }
    plans.push_back(std::move(plan));
  }
  for (RetrievalPlan& plan : plans) {
    plan.direction = random_direction(rng, layout.dim, layout.static_dims, basis);
    basis.push_back(&plan.direction);
  }
  std::vector<int64_t> all_dims(static_cast<size_t>(layout.dim));
  for (int64_t t = 0; t < layout.dim; ++t) all_dims[static_cast<size_t>(t)] = t;
  for (RetrievalPlan& plan : plans) plan.value_direction = random_direction(rng, layout.dim, all_dims, {});
  return plans;
}

// Everything the chunk generators read.
struct Context {
  const WorkloadConfig* config = nullptr;
  Layout layout;
  std::vector<KvHeadProfile> profiles;               // [heads_kv]
  std::vector<QueryHeadJitter> jitters;              // [heads_q]
  std::vector<std::vector<RetrievalPlan>> plans;     // [batch * heads_kv]
  int64_t group = 1;                                 // heads_q / heads_kv
};

// Adds amplitude * R(position) * local_dir to row (the rotate-half RoPE rotation).
void add_rotated_local(const Layout& layout, const KvHeadProfile& profile, double position,
                       float amplitude, float* row, float* sin_scratch, float* cos_scratch) {
  const int64_t pairs = layout.rotary_pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    const double phase = profile.cycles[static_cast<size_t>(p)] * position;
    const float turns = static_cast<float>(phase - floor_double(phase));
    sincos_turns(turns, sin_scratch[p], cos_scratch[p]);
  }
  const float* c = profile.local_dir.data();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t second = p + layout.half;
    const float x1 = c[p];
    const float x2 = second < layout.dim ? c[second] : 0.0f;
    row[p] += amplitude * (x1 * cos_scratch[p] - x2 * sin_scratch[p]);
    if (second < layout.dim) row[second] += amplitude * (x2 * cos_scratch[p] + x1 * sin_scratch[p]);
  }
}

void add_scaled(float* row, const float* direction, float amount, int64_t dim) {
  for (int64_t t = 0; t < dim; ++t) row[t] += amount * direction[t];
}

// Pairs whose span [start, start + span) meets the tokens [first, last).
std::vector<const RetrievalPlan*> plans_meeting(const std::vector<RetrievalPlan>& plans, bool query_side,
                                                int64_t span, int64_t first, int64_t last) {
  std::vector<const RetrievalPlan*> hits;
  for (const RetrievalPlan& plan : plans) {
    const int64_t start = query_side ? plan.q_start : plan.kv_start;
    if (start < last && start + span > first) hits.push_back(&plan);
  }
  return hits;
}

enum class Which { q, k, v };

// Rows [first, first + count) of one (tensor, batch, head) into `rows` ([count, d], f32).
void generate_chunk(const Context& ctx, Which which, int64_t batch, int64_t head, int64_t chunk,
                    int64_t first, int64_t count, float* rows) {
  const WorkloadConfig& config = *ctx.config;
  const int64_t d = ctx.layout.dim;
  const int64_t kv_head = which == Which::q ? head / ctx.group : head;
  const KvHeadProfile& profile = ctx.profiles[static_cast<size_t>(kv_head)];
  const std::vector<RetrievalPlan>& plans = ctx.plans[static_cast<size_t>(batch * config.heads_kv + kv_head)];
  const int64_t span = config.retrieval_span;
  const uint64_t b = static_cast<uint64_t>(batch), h = static_cast<uint64_t>(head), c = static_cast<uint64_t>(chunk);
  const float root_d = std::sqrt(static_cast<float>(d));
  const float fourth_root_d = std::sqrt(root_d);
  std::vector<float> sin_scratch(static_cast<size_t>(ctx.layout.rotary_pairs) + 1);
  std::vector<float> cos_scratch(static_cast<size_t>(ctx.layout.rotary_pairs) + 1);

  if (which == Which::v) {
    Rng noise_rng(stream_key(config.seed, kTagValueNoise, b, h, c));
    noise_rng.normals(rows, count * d);
    const auto hits = plans_meeting(plans, false, span, first, first + count);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t j = first + r;
      float* row = rows + r * d;
      if (j < config.sink_tokens) {
        for (int64_t t = 0; t < d; ++t) row[t] *= kSinkValueScale;
        continue;
      }
      add_scaled(row, profile.value_mean.data(), 1.0f, d);
      for (const RetrievalPlan* plan : hits)
        if (j >= plan->kv_start && j < plan->kv_start + span)
          add_scaled(row, plan->value_direction.data(), kValueSpanNorm * root_d, d);
    }
    return;
  }

  const bool is_query = which == Which::q;
  Rng noise_rng(stream_key(config.seed, is_query ? kTagQueryNoise : kTagKeyNoise, b, h, c));
  Rng token_rng(stream_key(config.seed, is_query ? kTagQueryToken : kTagKeyToken, b, h, c));
  noise_rng.normals(rows, count * d);
  std::vector<float> norm_draws(static_cast<size_t>(count)), sink_draws(static_cast<size_t>(count));
  std::vector<float> share_draws(static_cast<size_t>(count)), span_draws(static_cast<size_t>(count));
  token_rng.normals(norm_draws.data(), count);
  token_rng.normals(sink_draws.data(), count);
  token_rng.uniforms(share_draws.data(), count);
  token_rng.uniforms(span_draws.data(), count);

  const QueryHeadJitter jitter = is_query ? ctx.jitters[static_cast<size_t>(head)] : QueryHeadJitter{};
  // Key and query sides carry sqrt(strength) d^(1/4) each, so their logit is the strength;
  // a query head's jitter multiplies its side (and so the logit) once.
  const float local_amplitude = std::sqrt(profile.local_strength) * fourth_root_d * jitter.local;
  const float retrieval_amplitude = std::sqrt(profile.retrieval_strength) * fourth_root_d * jitter.retrieval;
  const float sink_key_amplitude = config.sink_key_norm * root_d;
  // A query component beta along sink_dir gives logit beta * sink_key_norm: beta = S / sink_key_norm.
  const float sink_query_amplitude = profile.sink_strength * jitter.sink / config.sink_key_norm;
  const int64_t position_offset = is_query ? config.len_kv - config.len_q : 0;
  const auto hits = plans_meeting(plans, is_query, span, first, first + count);

  for (int64_t r = 0; r < count; ++r) {
    const int64_t token = first + r;
    float* row = rows + r * d;
    for (int64_t t = 0; t < d; ++t) row[t] *= config.noise;
    if (!is_query && token < config.sink_tokens) {  // a sink key: large, along sink_dir
      for (int64_t t = 0; t < d; ++t) row[t] *= kSinkKeyNoise;
      add_scaled(row, profile.sink_dir.data(), sink_key_amplitude * (1.0f + kSinkKeyJitter * sink_draws[r]), d);
      continue;
    }
    if (local_amplitude > 0.0f)
      add_rotated_local(ctx.layout, profile, static_cast<double>(token + position_offset), local_amplitude, row,
                        sin_scratch.data(), cos_scratch.data());
    if (is_query && share_draws[r] < kSinkQueryShare) {
      const float share = std::max(0.0f, 1.0f + kSinkQueryJitter * sink_draws[r]);
      add_scaled(row, profile.sink_dir.data(), sink_query_amplitude * share, d);
    }
    const float span_scale = retrieval_amplitude * (1.0f - 0.5f * kRetrievalJitter + kRetrievalJitter * span_draws[r]);
    for (const RetrievalPlan* plan : hits) {
      const int64_t start = is_query ? plan->q_start : plan->kv_start;
      if (token >= start && token < start + span) add_scaled(row, plan->direction.data(), span_scale, d);
    }
    const float multiplier = exp_float(profile.norm_sigma * norm_draws[r]);
    for (int64_t t = 0; t < d; ++t) row[t] *= multiplier;
  }
}

std::string format_float(float x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%g", static_cast<double>(x));
  return buffer;
}

Status check_range(const char* field, float value, float lowest, float highest, bool open_low = false) {
  const bool ok = std::isfinite(value) && (open_low ? value > lowest : value >= lowest) && value <= highest;
  if (ok) return Status::Ok();
  return invalid_argument(std::string(field) + ": expected a finite value in " + (open_low ? "(" : "[") +
                          format_float(lowest) + ", " + format_float(highest) + "], got " + format_float(value));
}

Status check_at_least(const char* field, int64_t value, int64_t lowest) {
  if (value >= lowest) return Status::Ok();
  return invalid_argument(std::string(field) + ": expected >= " + std::to_string(lowest) + ", got " +
                          std::to_string(value));
}

// Elements of a [batch, heads, len, dim] tensor, or -1 when the byte count overflows.
int64_t checked_numel(int64_t batch, int64_t heads, int64_t len, int64_t dim) {
  int64_t n = 1;
  for (int64_t factor : {batch, heads, len, dim, int64_t{4}})
    if (__builtin_mul_overflow(n, factor, &n)) return -1;
  return n / 4;
}

}  // namespace

Status validate(const WorkloadConfig& config) {
  SPARSA_RETURN_IF_ERROR(check_at_least("batch", config.batch, 1));
  SPARSA_RETURN_IF_ERROR(check_at_least("heads_q", config.heads_q, 1));
  SPARSA_RETURN_IF_ERROR(check_at_least("heads_kv", config.heads_kv, 1));
  if (config.heads_q % config.heads_kv != 0)
    return invalid_argument("heads_q: expected a multiple of heads_kv (" + std::to_string(config.heads_kv) +
                            ") for grouped-query attention, got " + std::to_string(config.heads_q));
  SPARSA_RETURN_IF_ERROR(check_at_least("len_q", config.len_q, 1));
  SPARSA_RETURN_IF_ERROR(check_at_least("len_kv", config.len_kv, 1));
  SPARSA_RETURN_IF_ERROR(check_at_least("head_dim", config.head_dim, 1));
  if (config.dtype != DType::f32 && config.dtype != DType::f16 && config.dtype != DType::bf16)
    return unsupported_dtype(std::string("dtype: expected f32, f16 or bf16, got ") + dtype_name(config.dtype));
  if (checked_numel(config.batch, config.heads_q, config.len_q, config.head_dim) < 0)
    return invalid_argument("q: batch * heads_q * len_q * head_dim * 4 bytes overflows 64 bits");
  if (checked_numel(config.batch, config.heads_kv, config.len_kv, config.head_dim) < 0)
    return invalid_argument("k: batch * heads_kv * len_kv * head_dim * 4 bytes overflows 64 bits");

  SPARSA_RETURN_IF_ERROR(check_range("norm_sigma", config.norm_sigma, 0.0f, 4.0f));
  if (config.sink_tokens < 0 || config.sink_tokens > config.len_kv)
    return invalid_argument("sink_tokens: expected in [0, len_kv = " + std::to_string(config.len_kv) + "], got " +
                            std::to_string(config.sink_tokens));
  SPARSA_RETURN_IF_ERROR(check_range("sink_strength", config.sink_strength, 0.0f, 1e4f));
  SPARSA_RETURN_IF_ERROR(check_range("sink_key_norm", config.sink_key_norm, 0.0f, 1e3f, /*open_low=*/true));
  SPARSA_RETURN_IF_ERROR(check_range("local_strength", config.local_strength, 0.0f, 1e4f));
  SPARSA_RETURN_IF_ERROR(check_range("local_width", config.local_width, 1.0f, 1e9f));
  if (config.retrieval_pairs < 0 || config.retrieval_pairs > 4096)
    return invalid_argument("retrieval_pairs: expected in [0, 4096], got " + std::to_string(config.retrieval_pairs));
  if (config.retrieval_span < 0)
    return invalid_argument("retrieval_span: expected >= 0, got " + std::to_string(config.retrieval_span));
  if (config.retrieval_pairs > 0) {
    const int64_t longest = std::min(config.len_q, config.len_kv);
    if (config.retrieval_span < 1 || config.retrieval_span > longest)
      return invalid_argument("retrieval_span: expected in [1, min(len_q, len_kv) = " + std::to_string(longest) +
                              "] when retrieval_pairs > 0 (or set retrieval_pairs = 0), got " +
                              std::to_string(config.retrieval_span));
  }
  SPARSA_RETURN_IF_ERROR(check_range("retrieval_strength", config.retrieval_strength, 0.0f, 1e4f));
  SPARSA_RETURN_IF_ERROR(check_range("noise", config.noise, 0.0f, 1e4f));
  SPARSA_RETURN_IF_ERROR(check_range("head_variation", config.head_variation, 0.0f, 8.0f));
  if (config.num_threads < 0 || config.num_threads > kMaxNumThreads)
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " +
                            std::to_string(config.num_threads));
  return Status::Ok();
}

Result<Workload> generate_workload(const WorkloadConfig& config) {
  SPARSA_RETURN_IF_ERROR(validate(config));
  Context ctx;
  ctx.config = &config;
  ctx.layout = make_layout(config.head_dim);
  ctx.group = config.heads_q / config.heads_kv;
  for (int64_t g = 0; g < config.heads_kv; ++g) ctx.profiles.push_back(make_kv_profile(config, ctx.layout, g));
  for (int64_t h = 0; h < config.heads_q; ++h) ctx.jitters.push_back(make_query_jitter(config, h));

  Workload workload;
  workload.config = config;
  for (int64_t b = 0; b < config.batch; ++b)
    for (int64_t g = 0; g < config.heads_kv; ++g) {
      ctx.plans.push_back(make_retrieval_plans(config, ctx.layout, ctx.profiles[static_cast<size_t>(g)], b, g));
      for (const RetrievalPlan& plan : ctx.plans.back())
        workload.planted.push_back({b, g, plan.q_start, plan.kv_start, config.retrieval_span});
    }

  const int64_t d = config.head_dim;
  try {
    workload.q = HostArray(config.dtype, {config.batch, config.heads_q, config.len_q, d});
    workload.k = HostArray(config.dtype, {config.batch, config.heads_kv, config.len_kv, d});
    workload.v = HostArray(config.dtype, {config.batch, config.heads_kv, config.len_kv, d});
  } catch (const std::exception&) {  // bad_alloc, or length_error beyond max_size
    return Status(StatusCode::out_of_memory, "workload: cannot allocate q, k and v for " + describe(config));
  }

  // Work items: (tensor, batch, head, chunk), q first, then k, then v.
  const int64_t q_chunks = (config.len_q + kChunkTokens - 1) / kChunkTokens;
  const int64_t kv_chunks = (config.len_kv + kChunkTokens - 1) / kChunkTokens;
  const int64_t q_items = config.batch * config.heads_q * q_chunks;
  const int64_t kv_items = config.batch * config.heads_kv * kv_chunks;
  const float dtype_max = config.dtype == DType::f16 ? 65504.0f : 3.38953139e38f;
  std::atomic<bool> overflow{false};

  cpu::parallel_for(q_items + 2 * kv_items, config.num_threads, [&](int64_t item, int) {
    Which which = Which::q;
    int64_t heads = config.heads_q, chunks = q_chunks, len = config.len_q;
    HostArray* target = &workload.q;
    if (item >= q_items) {
      item -= q_items;
      which = item < kv_items ? Which::k : Which::v;
      target = which == Which::k ? &workload.k : &workload.v;
      item %= kv_items;
      heads = config.heads_kv, chunks = kv_chunks, len = config.len_kv;
    }
    const int64_t chunk = item % chunks;
    const int64_t head = (item / chunks) % heads;
    const int64_t batch = item / (chunks * heads);
    const int64_t first = chunk * kChunkTokens;
    const int64_t count = std::min(kChunkTokens, len - first);
    const int64_t offset = ((batch * heads + head) * len + first) * d;
    if (config.dtype == DType::f32) {
      generate_chunk(ctx, which, batch, head, chunk, first, count, target->ptr<float>() + offset);
      return;
    }
    std::vector<float> rows(static_cast<size_t>(count * d));
    generate_chunk(ctx, which, batch, head, chunk, first, count, rows.data());
    uint16_t* out = target->ptr<uint16_t>() + offset;
    bool too_large = false;
    for (int64_t i = 0; i < count * d; ++i) {
      too_large |= !(std::abs(rows[i]) <= dtype_max);
      out[i] = config.dtype == DType::f16 ? float_to_half(rows[i]) : float_to_bf16(rows[i]);
    }
    if (too_large) overflow.store(true);
  });
  if (overflow.load())
    return Status(StatusCode::non_finite, std::string("workload: values exceed the range of ") +
                                              dtype_name(config.dtype) +
                                              "; lower norm_sigma or the strengths, or generate f32");
  return workload;
}

std::string describe(const WorkloadConfig& config) {
  return "seed=" + std::to_string(config.seed) + " batch=" + std::to_string(config.batch) +
         " heads=" + std::to_string(config.heads_q) + "/" + std::to_string(config.heads_kv) +
         " len=" + std::to_string(config.len_q) + "x" + std::to_string(config.len_kv) +
         " d=" + std::to_string(config.head_dim) + " " + dtype_name(config.dtype) +
         " norm_sigma=" + format_float(config.norm_sigma) +
         " sinks=" + std::to_string(config.sink_tokens) + "@" + format_float(config.sink_strength) +
         " sink_key_norm=" + format_float(config.sink_key_norm) +
         " local=" + format_float(config.local_strength) + "/" + format_float(config.local_width) +
         " retrieval=" + std::to_string(config.retrieval_pairs) + "x" + std::to_string(config.retrieval_span) +
         "@" + format_float(config.retrieval_strength) +
         " noise=" + format_float(config.noise) + " head_variation=" + format_float(config.head_variation);
}

}  // namespace sparsa
