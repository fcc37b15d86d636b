// Fast-dLLM v2's decoding (Wu et al., "Fast-dLLM v2: Efficient Block-Diffusion LLM", 2025;
// the semantics of its model's generate(), without the sub-block cache).
//
// A fast_dllm model is block-causal (blocks of block_size tokens) and predicts position i from
// the row of position i - 1 (token shift). The prompt's whole blocks are prefilled into the cache
// (exact, block-causal). A block is the prompt's tail (or the token the last pass predicted) and
// masks up to the block's end; its first position is never a mask. The block is decoded sub-block
// after sub-block (GenerateOptions::sub_block tokens, its small_block_size): each step runs the
// whole block against the cached prefix (bidirectional inside the block) and, among the
// sub-block's masked positions, commits the most confident and every other one whose confidence
// is > threshold (threshold 0: the most confident only, one token a step, as its generate()
// defaults to). A decoded block runs once more to write its K/V into the cache, and the row of its
// last position predicts the first token of the next block, taken greedily (autoregressively).
//
// Where this differs from the model's generate(): gen_len counts the tokens generated (its
// max_new_tokens counts blocks of max_new_tokens / block_size); a prompt of exactly one block is
// prefilled and continued autoregressively like any prompt of whole blocks (its generate() decodes
// it without the prompt in view); with stop_at_eos the output ends before the first EOS once every
// position before it is decoded (its generate() keeps the stop token). Requests of a batch decode
// one after the other.
#include "loop_common.h"

namespace sparsa::dlm {

namespace {

// Whether position i's EOS ends the request: an EOS committed after the prompt with no mask
// between the prompt and it.
bool stops(const Config& c, const Canvas& cv, int64_t end) {
  for (int64_t i = cv.prompt_len; i < end; ++i) {
    if (cv.masked[i]) return false;
    if (is_eos(c, cv.x[i])) return true;
  }
  return false;
}

}  // namespace

Result<GenerateResult> generate_fast_dllm(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                          const GenerateOptions& o, const BlockCallback& cb) {
  const Config c = loop_config(m.config, o);  // the EOS ids of this request set
  const int64_t B = c.block_size, sub = o.sub_block;
  GenerateOptions greedy = o;  // the autoregressive token after each block: argmax
  greedy.temperature = 0;
  GenerateResult res;
  State s;
  s.ops = m.ops.get();
  std::vector<float> logits(static_cast<size_t>(B * c.vocab_size));
  for (size_t r = 0; r < prompts.size(); ++r) {
    const int64_t P = static_cast<int64_t>(prompts[r].size()), end = P + o.gen_len;
    const int64_t total = (end + B - 1) / B * B + 1;
    Canvas cv(prompts[r], total, c.mask_token_id, o.seed, r);
    auto seq = make_sequence(c, m.policy, total);
    if (!seq.ok()) return seq.status();
    int64_t L = P / B * B;  // the cached prefix: whole blocks
    // The block [L, L + B) as a chunk over the cache, with logits of canvas rows [from, to).
    auto block_pass = [&](int64_t from, int64_t to, int64_t store, const GenerateOptions& go) {
      ForwardOptions fo;
      fo.block_causal = B;
      fo.store_kv = store;
      fo.logits_begin = from - L;
      fo.logits_count = to - from;
      res.forward_tokens += B;
      return forward_candidates(m, s, seq.value(), std::span<const int32_t>(cv.x.data() + L, static_cast<size_t>(B)),
                                fo, c, go, cv, from, logits);
    };
    if (L > 0) {  // prefill; a prompt of whole blocks takes its next token from the last row
      ForwardOptions fo;
      fo.block_causal = B;
      fo.store_kv = L;
      fo.logits_begin = L;
      fo.logits_count = P == L ? 1 : 0;
      res.forward_tokens += L;
      auto k = forward_candidates(m, s, seq.value(), std::span<const int32_t>(cv.x.data(), static_cast<size_t>(L)),
                                  fo, c, greedy, cv, L, logits);
      if (!k.ok()) return k.status();
      if (!k->position.empty()) commit(cv, k.value(), {0});
    }
    bool stopped = false;
    while (L < end && !stopped) {
      for (int64_t lo = L; lo < L + B && !stopped; lo += sub) {
        const int64_t hi = lo + sub;
        while (cv.masks_in(lo, hi) > 0) {
          // Position L is never a mask, and its row would need the cached one before it.
          auto k = block_pass(std::max(lo, L + 1), hi, 0, o);
          if (!k.ok()) return k.status();
          res.steps++;
          std::vector<int64_t> chosen = top_k(k->confidence, 1);
          for (size_t j = 0; j < k->confidence.size() && o.threshold > 0; ++j) {
            if (static_cast<int64_t>(j) != chosen[0] && k->confidence[j] > o.threshold) {
              chosen.push_back(static_cast<int64_t>(j));
            }
          }
          commit(cv, k.value(), chosen);
          if (o.stop_at_eos && stops(c, cv, L + B)) {
            stopped = true;
            break;
          }
        }
      }
      if (!stopped && L + B < end) {  // the block's K/V into the cache; the next block's first token
        auto k = block_pass(L + B, L + B + 1, B, greedy);
        if (!k.ok()) return k.status();
        commit(cv, k.value(), {0});
        stopped = o.stop_at_eos && stops(c, cv, L + B + 1);
      }
      L += B;
      if (cb) cb(r, cv.generated(c, std::min(L + 1, end), o.stop_at_eos));
    }
    res.tokens.push_back(cv.generated(c, end, o.stop_at_eos));
  }
  return res;
}

}  // namespace sparsa::dlm
