// Pieces the three loops share: a request's canvas and its EOS-aware output.
#pragma once

#include <algorithm>
#include <vector>

#include "engine.h"

namespace sparsa::dlm {

// The config the sampler and the EOS checks see: GenerateOptions::eos_ids, when given, replace
// the config's eos_token_id list.
inline Config loop_config(const Config& model, const GenerateOptions& o) {
  Config c = model;
  if (!o.eos_ids.empty()) c.eos_token_ids = o.eos_ids;
  return c;
}

struct Canvas {
  std::vector<int32_t> x;    // prompt, then the generated / masked positions
  std::vector<char> masked;  // 1 where x is still [MASK]
  int64_t prompt_len = 0;
  bool done = false;  // stopped at EOS
  uint64_t rng = 0;

  Canvas(const std::vector<int32_t>& prompt, int64_t total, int32_t mask_id, uint64_t seed, size_t request)
      : x(prompt),
        masked(prompt.size(), 0),
        prompt_len(static_cast<int64_t>(prompt.size())),
        rng(seed ^ (0x9E3779B97F4A7C15ull * (request + 1))) {
    x.resize(static_cast<size_t>(total), mask_id);
    masked.resize(static_cast<size_t>(total), 1);
  }
  int64_t masks_in(int64_t begin, int64_t end) const {
    return std::count(masked.begin() + begin, masked.begin() + end, 1);
  }
  // The committed tokens after the prompt up to `end` (cut before the first EOS when asked).
  std::vector<int32_t> generated(const Config& c, int64_t end, bool cut_at_eos) const {
    std::vector<int32_t> g;
    for (int64_t i = prompt_len; i < end && i < static_cast<int64_t>(x.size()); ++i) {
      if (masked[i]) break;
      if (cut_at_eos && is_eos(c, x[i])) break;
      g.push_back(x[i]);
    }
    return g;
  }
  bool eos_in(const Config& c, int64_t begin, int64_t end) const {
    for (int64_t i = std::max(begin, prompt_len); i < end; ++i) {
      if (!masked[i] && is_eos(c, x[i])) return true;
    }
    return false;
  }
};

// The canvases (prompt | gen_len masks) of a batch of requests and, for the loops that run the
// whole canvas every step (remask, dream), their sequences, whose caches stay empty.
inline Status full_canvas_requests(const Model::Impl& m, const Config& c,
                                   const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& o,
                                   std::vector<Canvas>& canvas, std::vector<Sequence>& seqs) {
  for (size_t r = 0; r < prompts.size(); ++r) {
    canvas.emplace_back(prompts[r], static_cast<int64_t>(prompts[r].size()) + o.gen_len, c.mask_token_id, o.seed, r);
    auto seq = make_sequence(c, m.policy, 0);
    if (!seq.ok()) return seq.status();
    seqs.push_back(std::move(seq.value()));
  }
  return Status::Ok();
}

// Samples every masked position of rows [begin, begin + count) of the canvas from `logits`
// (row i of logits is canvas position begin + i): positions, picks and confidences (of the
// kind GenerateOptions::confidence asks for).
struct Candidates {
  std::vector<int64_t> position;
  std::vector<Pick> pick;
  std::vector<double> confidence;
};
inline Candidates candidates(const Config& c, const GenerateOptions& o, Canvas& cv, const float* logits, int64_t begin,
                             int64_t count) {
  Candidates k;
  for (int64_t i = 0; i < count; ++i) {
    if (!cv.masked[begin + i]) continue;
    const float* row = logits + i * c.vocab_size;
    const std::vector<char> allowed = allowed_tokens(row, c.vocab_size, o, c);
    const Pick p = sample(row, c.vocab_size, o, allowed, &cv.rng, c);
    k.position.push_back(begin + i);
    k.pick.push_back(p);
    k.confidence.push_back(o.confidence == Confidence::probability ? p.confidence
                                                                   : confidence_of(row, c.vocab_size, o, allowed, c));
  }
  return k;
}
// One denoising forward of a batch of requests' chunks and, per chunk, the picks of its logit
// rows: rows [begins[i], begins[i] + logits_count) of canvas i. On a backend with a greedy
// sampler at temperature 0 the picks are made where the logits are and only they come back;
// otherwise the logits are read back into `host` and sampled there, request by request (each
// with its own generator).
inline Result<std::vector<Candidates>> forward_candidates(const Model::Impl& m, State& s, std::span<const Chunk> chunks,
                                                          const Config& c, const GenerateOptions& o,
                                                          std::span<Canvas* const> canvases,
                                                          std::span<const int64_t> begins, std::vector<float>& host) {
  int64_t rows = 0;
  for (const Chunk& ch : chunks) rows += ch.options.logits_count;
  if (static_cast<int64_t>(host.size()) < rows * c.vocab_size) host.resize(static_cast<size_t>(rows * c.vocab_size));
  std::vector<Candidates> out(chunks.size());
  const bool filtered = o.top_p < 1 || o.top_k > 0;  // the device's greedy sampler has no filters
  if (o.temperature == 0 && o.confidence == Confidence::probability && !filtered &&
      m.ops->device().type == DeviceType::cuda) {
    SPARSA_RETURN_IF_ERROR(m.forward(s, chunks, nullptr));
    std::vector<int32_t> banned;
    if (o.ban_eos) banned = c.eos_token_ids;
    std::vector<Pick> picks(static_cast<size_t>(rows));
    if (m.ops->greedy(s.logits, rows, c.vocab_size, banned, picks.data())) {
      SPARSA_RETURN_IF_ERROR(m.ops->check());
      int64_t at = 0;
      for (size_t r = 0; r < chunks.size(); ++r) {
        Canvas& cv = *canvases[r];
        for (int64_t i = 0; i < chunks[r].options.logits_count; ++i, ++at) {
          if (!cv.masked[begins[r] + i]) continue;
          out[r].position.push_back(begins[r] + i);
          out[r].pick.push_back(picks[at]);
          out[r].confidence.push_back(picks[at].confidence);
        }
      }
      return out;
    }
    SPARSA_RETURN_IF_ERROR(m.ops->check());
    m.ops->to_host(host.data(), s.logits, rows * c.vocab_size);
    SPARSA_RETURN_IF_ERROR(m.ops->check());
  } else {
    SPARSA_RETURN_IF_ERROR(m.forward(s, chunks, host.data()));
  }
  int64_t at = 0;
  for (size_t r = 0; r < chunks.size(); ++r) {
    const int64_t count = chunks[r].options.logits_count;
    out[r] = candidates(c, o, *canvases[r], host.data() + at * c.vocab_size, begins[r], count);
    at += count;
  }
  return out;
}
// One request's forward and its picks (the batch of one).
// The requests of one batched denoising step: per chunk the request's index, its canvas and the
// canvas position of the chunk's first logit row.
struct StepBatch {
  std::vector<Chunk> chunks;
  std::vector<size_t> requests;
  std::vector<Canvas*> canvases;
  std::vector<int64_t> begins;

  void clear() {
    chunks.clear();
    requests.clear();
    canvases.clear();
    begins.clear();
  }
  void add(size_t request, Canvas& cv, int64_t begin, const Chunk& chunk) {
    chunks.push_back(chunk);
    requests.push_back(request);
    canvases.push_back(&cv);
    begins.push_back(begin);
  }
  bool empty() const { return chunks.empty(); }
  size_t size() const { return chunks.size(); }
};

inline Result<std::vector<Candidates>> forward_candidates(const Model::Impl& m, State& s, const StepBatch& batch,
                                                          const Config& c, const GenerateOptions& o,
                                                          std::vector<float>& host) {
  return forward_candidates(m, s, batch.chunks, c, o, batch.canvases, batch.begins, host);
}

inline Result<Candidates> forward_candidates(const Model::Impl& m, State& s, Sequence& seq,
                                             std::span<const int32_t> tokens, const ForwardOptions& fo,
                                             const Config& c, const GenerateOptions& o, Canvas& cv, int64_t begin,
                                             std::vector<float>& host) {
  const Chunk one{&seq, tokens, fo};
  Canvas* const canvas[1] = {&cv};
  const int64_t begins[1] = {begin};
  auto k = forward_candidates(m, s, std::span<const Chunk>(&one, 1), c, o, canvas, begins, host);
  if (!k.ok()) return k.status();
  return std::move(k.value()[0]);
}

// Fast-dLLM's parallel decoding rule: with threshold > 0 the most confident candidate and every
// other one with confidence >= threshold (> threshold when `strict`: Fast-dLLM v2's); else the
// `want` most confident (at least one).
inline std::vector<int64_t> threshold_or_top_k(const std::vector<double>& confidence, double threshold, int64_t want,
                                               bool strict = false) {
  if (threshold > 0) {
    std::vector<int64_t> chosen = top_k(confidence, 1);
    for (size_t j = 0; j < confidence.size(); ++j) {
      const bool above = strict ? confidence[j] > threshold : confidence[j] >= threshold;
      if (static_cast<int64_t>(j) != chosen[0] && above) chosen.push_back(static_cast<int64_t>(j));
    }
    return chosen;
  }
  return top_k(confidence, std::max<int64_t>(want, 1));
}

// Fast-dLLM's factor rule (GenerateOptions::factor; its get_transfer_index_dynamic): the n most
// confident, where, with the confidences sorted (c_0 >= c_1 >= ...), n is the first i > 0 whose
// c_i < 1 - factor / (i + 2), or the last index when none is; then one more when n is the last
// index, so a block whose last candidate alone falls short commits it too, as Fast-dLLM does
// (and at least one always).
inline std::vector<int64_t> factor_rule(const std::vector<double>& confidence, double factor) {
  const int64_t m = static_cast<int64_t>(confidence.size());
  std::vector<int64_t> order = top_k(confidence, m);
  int64_t n = m - 1;
  for (int64_t i = 1; i < m; ++i) {
    if (confidence[static_cast<size_t>(order[static_cast<size_t>(i)])] < 1.0 - factor / static_cast<double>(i + 2)) {
      n = i;
      break;
    }
  }
  if (n <= 0 || n == m - 1) ++n;
  order.resize(static_cast<size_t>(std::min(n, m)));
  return order;
}

// SDAR's entropy_bounded rule (GenerateOptions::Unmask): with the candidates' entropies sorted
// ascending (e_0 <= e_1 <= ...; `neg_entropy` holds -e, the entropy confidence), the n lowest
// whose running sum e_0 + ... + e_{n-1} stays below `bound`, at least one (none of none).
inline std::vector<int64_t> entropy_bounded(const std::vector<double>& neg_entropy, double bound) {
  if (neg_entropy.empty()) return {};
  std::vector<int64_t> order = top_k(neg_entropy, static_cast<int64_t>(neg_entropy.size()));
  size_t n = 0;
  for (double sum = 0; n < order.size(); ++n) {
    sum -= neg_entropy[static_cast<size_t>(order[n])];
    if (!(sum < bound)) break;
  }
  order.resize(std::max<size_t>(n, 1));
  return order;
}

// The first `want` candidates in canvas order (SDAR's sequential rule; candidates are made in
// position order).
inline std::vector<int64_t> first_candidates(const Candidates& k, int64_t want) {
  std::vector<int64_t> chosen;
  for (int64_t j = 0; j < static_cast<int64_t>(k.position.size()) && j < want; ++j) chosen.push_back(j);
  return chosen;
}

inline void commit(Canvas& cv, const Candidates& k, const std::vector<int64_t>& chosen) {
  for (int64_t j : chosen) {
    cv.x[k.position[j]] = k.pick[j].token;
    cv.masked[k.position[j]] = 0;
  }
}

}  // namespace sparsa::dlm
