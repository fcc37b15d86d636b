// Block diffusion with an exact prefix KV cache (SDAR, JetAstra 2025; the semantics of BD3-LM,
// Arriola et al., "Block Diffusion", ICLR 2025).
//
// The canvas is prompt | [MASK]... rounded up to whole blocks of block_size. The prompt's whole
// blocks are prefilled in one block-causal pass that writes their K/V to the cache; the
// prompt's tail shares the first decoded block with masks. Each block then runs up to `steps`
// steps: the block's tokens against the cached prefix plus the block itself (bidirectional
// inside the block); with threshold > 0 every masked token whose confidence is > threshold is
// committed, or, when fewer qualify than the step's scheduled count, the top scheduled count
// (SDAR's low_confidence_dynamic); with threshold 0 the scheduled top-k (low_confidence_static);
// GenerateOptions::unmask picks SDAR's other strategies (sequential, entropy_bounded).
// When the block has no mask left, one more pass writes its final K/V into the cache — the
// prefix is therefore exact: every cached K/V is that of committed tokens under the model's
// own block-causal attention. A PromptCache (one request) lends the prompt's leading blocks that
// match its tokens, and takes the blocks the call ends with.
#include "loop_common.h"

namespace sparsa::dlm {

Result<GenerateResult> generate_block(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                      const GenerateOptions& o, const BlockCallback& cb, PromptCache* cache) {
  const Config c = loop_config(m.config, o);  // the EOS ids of this request set
  GenerateOptions picking = o;                 // entropy_bounded ranks the candidates by entropy
  if (o.unmask == Unmask::entropy_bounded) picking.confidence = Confidence::entropy;
  const int64_t B = c.block_size;
  GenerateResult res;
  State s;
  s.ops = m.ops.get();
  std::vector<float> logits(static_cast<size_t>(B * c.vocab_size));

  // Each request advances one forward per round, and a round's requests run as batched
  // forwards: those whose block is final (the pass that writes its K/V) together, then those
  // that denoise a step together (one forward of every such request's block).
  struct Request {
    Canvas cv;
    Sequence seq;
    int64_t block = 0, blocks = 0, step = 0;
    std::vector<int64_t> schedule;
    bool finished = false;
  };
  // The requests' sequences made together: their denoising steps share each layer's batched
  // attention state where the method has one (make_sequences).
  std::vector<int64_t> max_tokens;
  for (const auto& prompt : prompts) {
    max_tokens.push_back((static_cast<int64_t>(prompt.size()) + o.gen_len + B - 1) / B * B);
  }
  auto seqs = make_sequences(c, m.policy, max_tokens);
  if (!seqs.ok()) return seqs.status();
  std::vector<Request> reqs;
  for (size_t r = 0; r < prompts.size(); ++r) {
    const int64_t p = static_cast<int64_t>(prompts[r].size());
    const int64_t blocks = max_tokens[r] / B;
    reqs.push_back({Canvas(prompts[r], blocks * B, c.mask_token_id, o.seed, r),
                    std::move(seqs.value()[r]),
                    p / B,
                    blocks,
                    0,
                    {},
                    false});
    Request& q = reqs.back();
    int64_t reused = 0;
    if (cache) {
      auto lent = reuse_prompt_cache(m, cache->state(), prompts[r], q.block, q.seq);
      if (!lent.ok()) return lent.status();
      reused = lent.value();
    }
    res.reused_tokens += reused;
    if (q.block * B > reused) {  // prefill the prompt's whole blocks (block-causal, exact) after those
      ForwardOptions fo;
      fo.block_causal = B;
      fo.store_kv = q.block * B - reused;
      const std::span<const int32_t> prefill(q.cv.x.data() + reused, static_cast<size_t>(q.block * B - reused));
      SPARSA_RETURN_IF_ERROR(m.forward(s, q.seq, prefill, fo, nullptr));
      res.steps++;
      res.forward_tokens += q.block * B - reused;
    }
    const int64_t begin = q.block * B;
    q.schedule = transfer_schedule(q.cv.masks_in(begin, begin + B), o.steps);
  }

  std::vector<Chunk> chunks;   // the requests whose block is final, as one batched forward
  std::vector<size_t> members;
  StepBatch batch;             // the others' denoising step
  for (bool active = true; active;) {
    active = false;
    // The requests whose block is final: write its K/V, move on.
    chunks.clear();
    members.clear();
    for (size_t r = 0; r < reqs.size(); ++r) {
      Request& q = reqs[r];
      if (q.finished) continue;
      active = true;
      const int64_t begin = q.block * B;
      if (q.cv.masks_in(begin, begin + B) != 0) continue;
      ForwardOptions fo;
      fo.store_kv = B;
      chunks.push_back({&q.seq, std::span<const int32_t>(q.cv.x.data() + begin, static_cast<size_t>(B)), fo});
      members.push_back(r);
    }
    if (!chunks.empty()) SPARSA_RETURN_IF_ERROR(m.forward(s, chunks, nullptr));
    for (size_t r : members) {
      Request& q = reqs[r];
      const int64_t begin = q.block * B, end = begin + B;
      res.steps++;
      res.forward_tokens += B;
      const bool eos = o.stop_at_eos && q.cv.eos_in(c, begin, end);
      if (cb) cb(r, q.cv.generated(c, std::min(end, q.cv.prompt_len + o.gen_len), o.stop_at_eos));
      q.block++;
      q.step = 0;
      if (eos || q.block == q.blocks) {
        q.finished = true;
      } else {
        q.schedule = transfer_schedule(q.cv.masks_in(q.block * B, q.block * B + B), o.steps);
      }
    }
    // The others: one denoising step of their blocks.
    batch.clear();
    for (size_t r = 0; r < reqs.size(); ++r) {
      Request& q = reqs[r];
      if (q.finished || std::find(members.begin(), members.end(), r) != members.end()) continue;
      const int64_t begin = q.block * B;
      ForwardOptions fo;
      fo.logits_count = B;
      fo.step = static_cast<int>(q.step);
      batch.add(r, q.cv, begin, {&q.seq, std::span<const int32_t>(q.cv.x.data() + begin, static_cast<size_t>(B)), fo});
    }
    if (batch.empty()) continue;
    auto picked = forward_candidates(m, s, batch, c, picking, logits);
    if (!picked.ok()) return picked.status();
    for (size_t i = 0; i < batch.size(); ++i) {
      Request& q = reqs[batch.requests[i]];
      res.steps++;
      res.forward_tokens += B;
      const Candidates& k = picked.value()[i];
      const int64_t want =
          std::max<int64_t>(q.step < static_cast<int64_t>(q.schedule.size()) ? q.schedule[q.step] : 1, 1);
      std::vector<int64_t> chosen;
      if (o.unmask == Unmask::sequential) {
        chosen = first_candidates(k, want);
      } else if (o.unmask == Unmask::entropy_bounded) {
        chosen = entropy_bounded(k.confidence, o.eb_threshold);
      } else if (o.threshold > 0) {
        for (size_t j = 0; j < k.confidence.size(); ++j) {
          if (k.confidence[j] > o.threshold) chosen.push_back(static_cast<int64_t>(j));
        }
        if (static_cast<int64_t>(chosen.size()) < want) chosen = top_k(k.confidence, want);
      } else {
        chosen = top_k(k.confidence, want);
      }
      commit(q.cv, k, chosen);
      q.step++;
    }
  }
  for (const Request& q : reqs) {
    res.tokens.push_back(q.cv.generated(c, q.cv.prompt_len + o.gen_len, o.stop_at_eos));
  }
  if (cache) keep_prompt_cache(m, cache->state(), reqs[0].cv.x, reqs[0].seq);
  return res;
}

}  // namespace sparsa::dlm
