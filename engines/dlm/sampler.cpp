// The sampler and schedules shared by the loops.
#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
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

namespace {

// The softmax of scale * logits over the tokens that `in` admits: its largest scaled logit and
// its normaliser, so that p_i = exp(scale l_i - max_logit) / z.
struct Softmax {
  double scale, max_logit, z;
  double log_prob(float l) const { return scale * l - max_logit - std::log(z); }
  double prob(float l) const { return std::exp(scale * l - max_logit) / z; }
};

// The normaliser when the largest scaled logit is already known.
template <class Admits>
Softmax softmax_given_max(const float* logits, int64_t vocab, double scale, double max_logit, Admits in) {
  Softmax s{scale, max_logit, 0};
  for (int64_t i = 0; i < vocab; ++i) {
    if (in(i)) s.z += std::exp(scale * logits[i] - s.max_logit);
  }
  return s;
}

template <class Admits>
Softmax softmax_of(const float* logits, int64_t vocab, double scale, Admits in) {
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (in(i)) max_logit = std::max(max_logit, scale * logits[i]);
  }
  return softmax_given_max(logits, vocab, scale, max_logit, in);
}

}  // namespace

std::vector<char> allowed_tokens(const float* logits, int64_t vocab, const GenerateOptions& o, const Config& c) {
  const bool by_p = o.top_p < 1, by_k = o.top_k > 0 && o.top_k < vocab;
  if (!by_p && !by_k) return {};
  std::vector<char> ok(static_cast<size_t>(vocab), 1);
  if (o.ban_eos) {
    for (int32_t t : c.eos_token_ids) {
      if (t >= 0 && t < vocab) ok[static_cast<size_t>(t)] = 0;
    }
  }
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  if (by_p) {
    // Keep the most probable tokens while the mass before them is <= top_p (the first always).
    // The order is needed only until the mass passes top_p: the tokens of probability >= 1e-12
    // first, sorted; the rest (less than vocab * 1e-12 of mass in all) only if the set needs them.
    const Softmax sm = softmax_of(logits, vocab, o.temperature > 0 ? 1.0 / o.temperature : 1.0,
                                  [&](int64_t i) { return ok[i] != 0; });
    std::vector<double> prob(static_cast<size_t>(vocab), 0.0);
    std::vector<int32_t> likely, rest;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!ok[i]) continue;
      prob[i] = sm.prob(logits[i]);
      (prob[i] >= 1e-12 ? likely : rest).push_back(static_cast<int32_t>(i));
    }
    std::sort(likely.begin(), likely.end(), by_logit);
    std::vector<char> kept(static_cast<size_t>(vocab), 0);
    double mass = 0;
    bool done = false;
    for (const std::vector<int32_t>* part : {&likely, &rest}) {
      if (part == &rest && !done) std::sort(rest.begin(), rest.end(), by_logit);
      for (int32_t t : *part) {
        if (done || (mass > o.top_p && mass > 0)) {
          done = true;
          break;
        }
        kept[static_cast<size_t>(t)] = 1;
        mass += prob[t];
      }
      if (done) break;
    }
    for (int64_t i = 0; i < vocab; ++i) ok[i] = ok[i] && kept[i];
  }
  if (by_k) {  // the k largest logits of what is left, ties with the k-th kept
    std::vector<float> values;
    for (int64_t i = 0; i < vocab; ++i) {
      if (ok[i]) values.push_back(logits[i]);
    }
    if (static_cast<int64_t>(values.size()) > o.top_k) {
      std::nth_element(values.begin(), values.begin() + (o.top_k - 1), values.end(), std::greater<float>());
      const float kth = values[static_cast<size_t>(o.top_k - 1)];
      for (int64_t i = 0; i < vocab; ++i) ok[i] = ok[i] && logits[i] >= kth;
    }
  }
  return ok;
}

Pick sample(const float* logits, int64_t vocab, const GenerateOptions& o, std::span<const char> allowed,
            uint64_t* rng, const Config& c) {
  auto banned = [&](int64_t i) { return o.ban_eos && is_eos(c, static_cast<int32_t>(i)); };
  auto out = [&](int64_t i) { return allowed.empty() ? banned(i) : !allowed[i]; };
  // LLaDA's Gumbel-max: argmax(exp(l) / (-log u)^T) = argmax(l - T log(-log u)). One draw per
  // unbanned entry, filtered out or not, so that a filter moves no other position's draws.
  int64_t best = -1;
  double best_score = -std::numeric_limits<double>::infinity();
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (banned(i)) continue;
    const double l = logits[i];
    double score = l;
    if (o.temperature > 0) score -= o.temperature * std::log(-std::log(uniform_open(rng)));
    if (out(i)) continue;
    max_logit = std::max(max_logit, l);
    if (best < 0 || score > best_score) {
      best = i;
      best_score = score;
    }
  }
  if (best < 0) best = 0;
  // confidence: softmax probability of the pick under the logits, among the allowed tokens
  const Softmax sm = softmax_given_max(logits, vocab, 1.0, max_logit, [&](int64_t i) { return !out(i); });
  Pick p;
  p.token = static_cast<int32_t>(best);
  p.confidence = sm.prob(logits[best]);
  return p;
}

double confidence_of(const float* logits, int64_t vocab, const GenerateOptions& o, std::span<const char> allowed,
                     const Config& c) {
  auto out = [&](int64_t i) {
    return allowed.empty() ? o.ban_eos && is_eos(c, static_cast<int32_t>(i)) : !allowed[i];
  };
  const Softmax sm = softmax_of(logits, vocab, o.temperature > 0 ? 1.0 / o.temperature : 1.0,
                                [&](int64_t i) { return !out(i); });
  if (o.confidence == Confidence::entropy) {  // sum p log p = sum p (l - max - log z)
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (out(i)) continue;
      const double logp = sm.log_prob(logits[i]);
      sum += std::exp(logp) * logp;
    }
    return sum;
  }
  double first = 0, second = 0;  // the two largest probabilities
  for (int64_t i = 0; i < vocab; ++i) {
    if (out(i)) continue;
    const double p = sm.prob(logits[i]);
    if (p > first) {
      second = first;
      first = p;
    } else if (p > second) {
      second = p;
    }
  }
  return o.confidence == Confidence::margin ? first - second : first;
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

std::vector<int64_t> sample_k(const std::vector<double>& conf, int64_t k, double temperature, uint64_t* rng) {
  std::vector<double> key(conf.size());
  for (size_t i = 0; i < conf.size(); ++i) key[i] = conf[i] / temperature - std::log(-std::log(uniform_open(rng)));
  return top_k(key, k);
}

}  // namespace sparsa::dlm
