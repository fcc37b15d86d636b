// The sampler and schedules shared by the loops.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "engine.h"

namespace sparsa::dlm {

namespace {
// splitmix64: a small, seedable, platform-independent generator.
uint64_t next_u64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double uniform_open(uint64_t* state) {  // (0, 1)
  return (static_cast<double>(next_u64(state) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
}  // namespace

bool is_eos(const Config& c, int32_t token) {
  return std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), token) != c.eos_token_ids.end();
}

Pick sample(const float* logits, int64_t vocab, double temperature, uint64_t* rng, const Config& c, bool ban_eos) {
  auto banned = [&](int64_t i) { return ban_eos && is_eos(c, static_cast<int32_t>(i)); };
  // LLaDA's Gumbel-max: argmax(exp(l) / (-log u)^T) = argmax(l - T log(-log u)).
  int64_t best = -1;
  double best_score = -std::numeric_limits<double>::infinity();
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (banned(i)) continue;
    const double l = logits[i];
    max_logit = std::max(max_logit, l);
    double score = l;
    if (temperature > 0) score -= temperature * std::log(-std::log(uniform_open(rng)));
    if (best < 0 || score > best_score) {
      best = i;
      best_score = score;
    }
  }
  if (best < 0) best = 0;
  // confidence: softmax probability of the pick under the logits (EOS banned -> excluded)
  double z = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!banned(i)) z += std::exp(static_cast<double>(logits[i]) - max_logit);
  }
  Pick p;
  p.token = static_cast<int32_t>(best);
  p.confidence = std::exp(static_cast<double>(logits[best]) - max_logit) / z;
  return p;
}

double confidence_of(const float* logits, int64_t vocab, double temperature, Confidence kind, const Config& c,
                     bool ban_eos) {
  auto banned = [&](int64_t i) { return ban_eos && is_eos(c, static_cast<int32_t>(i)); };
  const double scale = temperature > 0 ? 1.0 / temperature : 1.0;
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (!banned(i)) max_logit = std::max(max_logit, scale * logits[i]);
  }
  double z = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!banned(i)) z += std::exp(scale * logits[i] - max_logit);
  }
  if (kind == Confidence::entropy) {  // sum p log p = sum p (l - max - log z)
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (banned(i)) continue;
      const double logp = scale * logits[i] - max_logit - std::log(z);
      sum += std::exp(logp) * logp;
    }
    return sum;
  }
  double first = 0, second = 0;  // the two largest probabilities
  for (int64_t i = 0; i < vocab; ++i) {
    if (banned(i)) continue;
    const double p = std::exp(scale * logits[i] - max_logit) / z;
    if (p > first) {
      second = first;
      first = p;
    } else if (p > second) {
      second = p;
    }
  }
  return kind == Confidence::margin ? first - second : first;
}

std::vector<int64_t> transfer_schedule(int64_t masks, int64_t steps) {
  std::vector<int64_t> k(static_cast<size_t>(std::max<int64_t>(steps, 1)), masks / std::max<int64_t>(steps, 1));
  for (int64_t i = 0; i < masks % std::max<int64_t>(steps, 1); ++i) ++k[i];
  return k;
}

std::vector<int64_t> top_k(const std::vector<double>& conf, int64_t k) {
  std::vector<int64_t> order(conf.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return conf[a] > conf[b]; });
  order.resize(static_cast<size_t>(std::min<int64_t>(k, static_cast<int64_t>(order.size()))));
  return order;
}

}  // namespace sparsa::dlm
