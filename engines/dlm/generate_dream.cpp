// Dream's denoising loop (Ye et al., "Dream 7B", 2025; diffusion_generate semantics).
//
// canvas = prompt | [MASK] * gen_len, decoded as one block: `steps` steps on the timesteps
// t_i = 1 - i (1 - eps) / steps (eps = 1e-3), each running the model over the whole canvas
// (bidirectional, no cache), sampling every masked position (argmax, or Gumbel-max at the
// temperature) and committing the floor(n (1 - t_{i+1} / t_i)) most confident of its n masked
// positions; the last step commits all that are left. The confidence is GenerateOptions::
// confidence (Dream's default alg, entropy, is the CLI's for dream models); with alg_temp > 0 the
// positions are drawn instead, weights softmax(confidence / alg_temp). Dream computes the
// schedule in float32 and averages the mask count over the batch; here it is double and per
// request, which can move one token between two steps where the product lands on an integer.
#include <cmath>

#include "loop_common.h"

namespace sparsa::dlm {

namespace {
constexpr double kEps = 1e-3;  // Dream's default eps: the last timestep
}  // namespace

Result<GenerateResult> generate_dream(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                      const GenerateOptions& o, const BlockCallback& cb) {
  const Config c = loop_config(m.config, o);
  GenerateResult res;
  std::vector<Canvas> canvas;
  std::vector<Sequence> seqs;
  SPARSA_RETURN_IF_ERROR(full_canvas_requests(m, c, prompts, o, canvas, seqs));
  State s;
  s.ops = m.ops.get();
  std::vector<float> logits(static_cast<size_t>(o.gen_len * c.vocab_size));
  auto timestep = [&](int64_t i) { return 1.0 - static_cast<double>(i) * (1.0 - kEps) / static_cast<double>(o.steps); };
  StepBatch batch;
  for (int64_t step = 0; step < o.steps; ++step) {
    batch.clear();
    for (size_t r = 0; r < prompts.size(); ++r) {
      Canvas& cv = canvas[r];
      if (cv.masks_in(cv.prompt_len, static_cast<int64_t>(cv.x.size())) == 0) continue;
      ForwardOptions fo;
      fo.logits_begin = cv.prompt_len;
      fo.logits_count = o.gen_len;
      fo.step = static_cast<int>(step);
      batch.add(r, cv, cv.prompt_len, {&seqs[r], cv.x, fo});
    }
    if (batch.empty()) break;
    auto picked = forward_candidates(m, s, batch, c, o, logits);
    if (!picked.ok()) return picked.status();
    const double fraction = 1.0 - timestep(step + 1) / timestep(step);
    for (size_t i = 0; i < batch.size(); ++i) {
      Canvas& cv = canvas[batch.requests[i]];
      res.steps++;
      res.forward_tokens += static_cast<int64_t>(cv.x.size());
      const Candidates& k = picked.value()[i];
      const int64_t masks = static_cast<int64_t>(k.position.size());
      const int64_t commit_now =
          step + 1 < o.steps ? static_cast<int64_t>(std::floor(static_cast<double>(masks) * fraction)) : masks;
      if (commit_now > 0) {
        commit(cv, k, o.alg_temp > 0 ? sample_k(k.confidence, commit_now, o.alg_temp, &cv.rng)
                                     : top_k(k.confidence, commit_now));
      }
    }
  }
  for (size_t r = 0; r < prompts.size(); ++r) {
    const Canvas& cv = canvas[r];
    res.tokens.push_back(cv.generated(c, static_cast<int64_t>(cv.x.size()), o.stop_at_eos));
    if (cb) cb(r, res.tokens.back());
  }
  return res;
}

}  // namespace sparsa::dlm
