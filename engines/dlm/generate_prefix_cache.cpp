// Fast-dLLM's prefix cache with confidence-threshold parallel decoding (Wu et al.,
// "Fast-dLLM: Training-free Acceleration of Diffusion LLM by Enabling KV Cache and Parallel
// Decoding", 2025).
//
// Blocks as in the remasking loop. The first step of a block runs the whole canvas and keeps
// the K/V of the positions before the block (the prefix cache, refreshed here once per block,
// so it is approximate: it was computed while later tokens were still masked). Later steps run
// only the suffix (the block and every position after it) against that cached prefix. Each step
// commits every masked token of the block whose confidence is >= threshold, and always the most
// confident one (or, with a factor, the count of Fast-dLLM's factor rule); with neither it commits
// LLaDA's scheduled top-k instead.
//
// A model whose logits are shifted (dream: position p is predicted from the hidden state of
// p - 1) caches one position less, [0, begin - 1), and its suffix starts at begin - 1, so that the
// block's first position is predicted from a freshly computed row, as in the whole-canvas forward
// (Fast-dLLM's Dream generation runs the same prefix cache).
//
// The dual cache (Loop::dual_cache, Fast-dLLM's generate_with_dual_cache) also keeps, from the
// block's first step, the K/V of the positions after the block ([end - shift, canvas end): the
// masks still to come and their neighbours), and its later steps run the block's positions alone,
// [begin - shift, end - shift), over both caches: a step's forward is block_len tokens instead of
// the whole suffix, and the suffix's K/V, like the prefix's, are those of the block's first step.
#include "loop_common.h"

namespace sparsa::dlm {

Result<GenerateResult> generate_prefix_cache(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                             const GenerateOptions& o, const BlockCallback& cb) {
  const Config c = loop_config(m.config, o);  // the EOS ids of this request set
  const int64_t blocks = o.gen_len / o.block_len;
  const int64_t steps_per_block = std::max<int64_t>(o.steps / blocks, 1);
  GenerateResult res;
  std::vector<Canvas> canvas;
  std::vector<int64_t> max_tokens;
  for (size_t r = 0; r < prompts.size(); ++r) {
    canvas.emplace_back(prompts[r], static_cast<int64_t>(prompts[r].size()) + o.gen_len, c.mask_token_id, o.seed, r);
    max_tokens.push_back(static_cast<int64_t>(prompts[r].size()) + o.gen_len);
  }
  auto made = make_sequences(c, m.policy, max_tokens);  // made together: one device cache per layer
  if (!made.ok()) return made.status();
  std::vector<Sequence> seqs = std::move(made.value());
  State s;
  s.ops = m.ops.get();
  std::vector<float> logits(static_cast<size_t>(o.block_len * c.vocab_size));
  const int64_t shift = c.shifted_logits ? 1 : 0;  // begin > 0 always: a prompt is never empty
  const bool dual = o.loop == Loop::dual_cache;

  auto choose = [&](const Candidates& k, const std::vector<int64_t>& schedule, int64_t step) {
    if (o.factor > 0) return factor_rule(k.confidence, o.factor);
    return threshold_or_top_k(k.confidence, o.threshold,
                              step < static_cast<int64_t>(schedule.size()) ? schedule[step] : 1);
  };

  // Blocks outer, requests inner: every request decodes block b (its own cache) before block b + 1;
  // each step's forwards of the requests run as one batch.
  StepBatch batch;
  std::vector<std::vector<int64_t>> schedule(prompts.size());
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t step = 0;; ++step) {
      // Step 0: every request's whole canvas, keeping the K/V of [0, begin - shift) as its prefix
      // cache; later steps: the suffix [begin - shift, end of canvas) of the requests whose block
      // has masks.
      batch.clear();
      for (size_t r = 0; r < prompts.size(); ++r) {
        Canvas& cv = canvas[r];
        if (cv.done) continue;
        const int64_t begin = cv.prompt_len + b * o.block_len, end = begin + o.block_len;
        ForwardOptions fo;
        fo.logits_count = o.block_len;
        fo.step = static_cast<int>(step);
        if (step == 0) {
          schedule[r] = transfer_schedule(cv.masks_in(begin, end), steps_per_block);
          SPARSA_RETURN_IF_ERROR(reset_cache(c, seqs[r]));
          fo.store_kv = begin - shift;
          fo.logits_begin = begin;
          if (dual) fo.keep_suffix_from = end - shift;
          batch.add(r, cv, begin, {&seqs[r], cv.x, fo});
        } else {
          if (cv.masks_in(begin, end) == 0) continue;
          fo.logits_begin = shift;
          const int64_t from = begin - shift;
          const int64_t count = dual ? o.block_len : static_cast<int64_t>(cv.x.size()) - from;
          fo.with_suffix = dual;
          const std::span<const int32_t> chunk(cv.x.data() + from, static_cast<size_t>(count));
          batch.add(r, cv, begin, {&seqs[r], chunk, fo});
        }
      }
      if (batch.empty()) break;
      auto picked = forward_candidates(m, s, batch, c, o, logits);
      if (!picked.ok()) return picked.status();
      for (size_t i = 0; i < batch.size(); ++i) {
        Canvas& cv = canvas[batch.requests[i]];
        res.steps++;
        res.forward_tokens += static_cast<int64_t>(batch.chunks[i].tokens.size());
        const Candidates& k = picked.value()[i];
        if (!k.position.empty()) commit(cv, k, choose(k, schedule[batch.requests[i]], step));
      }
    }
    for (size_t r = 0; r < prompts.size(); ++r) {
      Canvas& cv = canvas[r];
      if (cv.done) continue;
      const int64_t begin = cv.prompt_len + b * o.block_len, end = begin + o.block_len;
      if (o.stop_at_eos && cv.eos_in(c, begin, end)) cv.done = true;
      if (cb) cb(r, cv.generated(c, end, o.stop_at_eos));
    }
  }
  for (const Canvas& cv : canvas) {
    res.tokens.push_back(cv.generated(c, static_cast<int64_t>(cv.x.size()), o.stop_at_eos));
  }
  return res;
}

}  // namespace sparsa::dlm
