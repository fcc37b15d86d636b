// LLaDA's semi-autoregressive low-confidence remasking (Nie et al., "Large Language Diffusion
// Models", 2025, Alg. / generate.py semantics).
//
// canvas = prompt | [MASK] * gen_len, split into gen_len / block_len blocks decoded left to
// right; each block gets steps / blocks steps. Every step runs the model over the whole canvas
// (bidirectional, no cache), samples every masked position of the current block (argmax, or
// Gumbel-max at the temperature), and commits the k most confident ones, k from LLaDA's
// schedule (equal shares, the remainder to the first steps); the rest stay masked.
// With threshold > 0 it is Fast-dLLM's parallel decoding without a cache: each step commits the
// most confident masked token of the block and every other one with confidence >= threshold,
// until the block has no mask (steps then only sets nothing; the block decides).
#include "loop_common.h"

namespace sparsa::dlm {

Result<GenerateResult> generate_remask(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                       const GenerateOptions& o, const BlockCallback& cb) {
  const Config c = loop_config(m.config, o);  // the EOS ids of this request set
  const int64_t blocks = o.gen_len / o.block_len, steps_per_block = o.steps / blocks;
  GenerateResult res;
  std::vector<Canvas> canvas;
  std::vector<Sequence> seqs;
  SPARSA_RETURN_IF_ERROR(full_canvas_requests(m, c, prompts, o, canvas, seqs));
  State s;
  s.ops = m.ops.get();
  std::vector<float> logits(static_cast<size_t>(o.block_len * c.vocab_size));
  for (int64_t b = 0; b < blocks; ++b) {
    std::vector<std::vector<int64_t>> schedule(prompts.size());
    for (size_t r = 0; r < prompts.size(); ++r) {
      const int64_t begin = canvas[r].prompt_len + b * o.block_len;
      schedule[r] = transfer_schedule(canvas[r].masks_in(begin, begin + o.block_len), steps_per_block);
    }
    StepBatch batch;
    for (int64_t step = 0;; ++step) {
      // The requests still denoising this block: one batched forward of their canvases.
      batch.clear();
      for (size_t r = 0; r < prompts.size(); ++r) {
        Canvas& cv = canvas[r];
        if (cv.done) continue;
        const int64_t begin = cv.prompt_len + b * o.block_len;
        const bool dynamic = o.threshold > 0 || o.factor > 0;  // the block's masks set the pace
        if (dynamic ? cv.masks_in(begin, begin + o.block_len) == 0 : step >= steps_per_block) continue;
        ForwardOptions fo;
        fo.logits_begin = begin;
        fo.logits_count = o.block_len;
        fo.step = static_cast<int>(step);
        batch.add(r, cv, begin, {&seqs[r], cv.x, fo});
      }
      if (batch.empty()) break;
      auto picked = forward_candidates(m, s, batch, c, o, logits);
      if (!picked.ok()) return picked.status();
      for (size_t i = 0; i < batch.size(); ++i) {
        const size_t r = batch.requests[i];
        Canvas& cv = canvas[r];
        res.steps++;
        res.forward_tokens += static_cast<int64_t>(cv.x.size());
        const Candidates& k = picked.value()[i];
        if (o.factor > 0) {
          commit(cv, k, factor_rule(k.confidence, o.factor));
        } else if (o.threshold > 0) {
          commit(cv, k, threshold_or_top_k(k.confidence, o.threshold, 1));
        } else {
          commit(cv, k, top_k(k.confidence, schedule[r][step]));
        }
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
