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
// position before it is decoded (its generate() keeps the stop token). A batch's requests advance
// together: each round, the requests whose block is decoded run its final pass as one batched
// forward, the others a step of their sub-block as another.
#include "loop_common.h"

namespace sparsa::dlm {

namespace {

// Whether the request has ended before `end`: an EOS committed after the prompt with no mask
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
                                          const GenerateOptions& o, const BlockCallback& cb, PromptCache* cache) {
  const Config c = loop_config(m.config, o);  // the EOS ids of this request set
  const int64_t B = c.block_size, sub = o.sub_block;
  GenerateOptions greedy = o;  // the autoregressive token after each block: argmax
  greedy.temperature = 0;
  GenerateResult res;
  State s;
  s.ops = m.ops.get();
  std::vector<float> logits(static_cast<size_t>(B * c.vocab_size));

  // Each request: its canvas (prompt | masks, whole blocks and one position more), its cache of
  // `block` whole blocks, and the sub-block [lo, lo + sub) it decodes.
  struct Request {
    Canvas cv;
    Sequence seq;
    int64_t block = 0, lo = 0, end = 0;
    bool finished = false;
  };
  std::vector<int64_t> max_tokens;
  for (const auto& prompt : prompts) {
    max_tokens.push_back((static_cast<int64_t>(prompt.size()) + o.gen_len + B - 1) / B * B + 1);
  }
  auto seqs = make_sequences(c, m.policy, max_tokens);  // made together: the batch's attention state
  if (!seqs.ok()) return seqs.status();
  std::vector<Request> reqs;
  for (size_t r = 0; r < prompts.size(); ++r) {
    const int64_t P = static_cast<int64_t>(prompts[r].size());
    reqs.push_back({Canvas(prompts[r], max_tokens[r], c.mask_token_id, o.seed, r), std::move(seqs.value()[r]), P / B,
                    P / B * B, P + o.gen_len, false});
    Request& q = reqs.back();
    if (q.block == 0) continue;
    // Prefill the prompt's whole blocks (after those a PromptCache lends: at most all but the last
    // when the prompt is whole blocks, whose last row is needed); a prompt of whole blocks takes
    // its next token from the last row (the position just past the chunk, which the shift lets
    // the head read).
    const int64_t L = q.block * B;
    int64_t reused = 0;
    if (cache) {
      auto lent = reuse_prompt_cache(m, cache->state(), prompts[r], P == L ? q.block - 1 : q.block, q.seq);
      if (!lent.ok()) return lent.status();
      reused = lent.value();
    }
    res.reused_tokens += reused;
    if (reused == L) continue;
    ForwardOptions fo;
    fo.block_causal = B;
    fo.store_kv = L - reused;
    fo.logits_begin = L - reused;
    fo.logits_count = P == L ? 1 : 0;
    res.forward_tokens += L - reused;
    auto k = forward_candidates(m, s, q.seq,
                                std::span<const int32_t>(q.cv.x.data() + reused, static_cast<size_t>(L - reused)), fo,
                                c, greedy, q.cv, L, logits);
    if (!k.ok()) return k.status();
    if (!k->position.empty()) commit(q.cv, k.value(), {0});
  }

  // The block [L, L + B) of request q as a chunk over its cache, with logits of canvas rows
  // [from, to) (to may be L + B + 1: the row of L + B - 1 predicts it).
  auto block_chunk = [&](Request& q, int64_t from, int64_t to, int64_t store) {
    const int64_t L = q.block * B;
    ForwardOptions fo;
    fo.block_causal = B;
    fo.store_kv = store;
    fo.logits_begin = from - L;
    fo.logits_count = to - from;
    return Chunk{&q.seq, std::span<const int32_t>(q.cv.x.data() + L, static_cast<size_t>(B)), fo};
  };
  // Rounds: the requests whose block is decoded write its K/V and take the next block's first
  // token (one batch); the others run a step of their sub-block (another batch).
  StepBatch finals, steps;
  for (bool active = true; active;) {
    active = false;
    finals.clear();
    steps.clear();
    for (size_t r = 0; r < reqs.size(); ++r) {
      Request& q = reqs[r];
      if (q.finished) continue;
      const int64_t L = q.block * B;
      while (q.lo < L + B && q.cv.masks_in(q.lo, q.lo + sub) == 0) q.lo += sub;
      if (q.lo < L + B) {  // position L is never a mask, and its row would need the one before it
        steps.add(r, q.cv, std::max(q.lo, L + 1), block_chunk(q, std::max(q.lo, L + 1), q.lo + sub, 0));
      } else if (L + B < q.end) {
        finals.add(r, q.cv, L + B, block_chunk(q, L + B, L + B + 1, B));
      } else {  // the last block is decoded
        q.finished = true;
        if (cb) cb(r, q.cv.generated(c, q.end, o.stop_at_eos));
        continue;
      }
      active = true;
    }
    if (!finals.empty()) {
      auto picked = forward_candidates(m, s, finals, c, greedy, logits);
      if (!picked.ok()) return picked.status();
      for (size_t i = 0; i < finals.size(); ++i) {
        Request& q = reqs[finals.requests[i]];
        res.forward_tokens += B;
        commit(q.cv, picked.value()[i], {0});
        q.block++;
        q.lo = q.block * B;
        q.finished = o.stop_at_eos && stops(c, q.cv, q.lo + 1);
        if (cb) cb(finals.requests[i], q.cv.generated(c, std::min(q.lo + 1, q.end), o.stop_at_eos));
      }
    }
    if (!steps.empty()) {
      auto picked = forward_candidates(m, s, steps, c, o, logits);
      if (!picked.ok()) return picked.status();
      for (size_t i = 0; i < steps.size(); ++i) {
        Request& q = reqs[steps.requests[i]];
        const Candidates& k = picked.value()[i];
        res.steps++;
        res.forward_tokens += B;
        commit(q.cv, k, threshold_or_top_k(k.confidence, o.threshold, 1, /*strict=*/true));
        q.finished = o.stop_at_eos && stops(c, q.cv, q.block * B + B);
        if (q.finished && cb) cb(steps.requests[i], q.cv.generated(c, q.end, o.stop_at_eos));
      }
    }
  }
  for (const Request& q : reqs) res.tokens.push_back(q.cv.generated(c, q.end, o.stop_at_eos));
  if (cache) keep_prompt_cache(m, cache->state(), reqs[0].cv.x, reqs[0].seq);
  return res;
}

}  // namespace sparsa::dlm
