// llada — LLaDA-8B and its family (ML-GSAI's LLaDA; an OLMo-derived Llama-shaped encoder).
//
// Per layer (no biases, fully bidirectional attention, no mask):
//   h   = x + attn_out( attention( rope(q_proj(rms(x))), rope(k_proj(rms(x))), v_proj(rms(x)) ) )
//   out = h + ff_out( silu(ff_proj(rms(h))) * up_proj(rms(h)) )
// then ln_f (RMSNorm) and the untied head transformer.ff_out (or wte with weight_tying).
// RoPE is NeoX style (rotate half) over the whole head with theta = rope_theta.
//
// Weight names (Hugging Face GSAI-ML/LLaDA-8B-*):
//   model.transformer.wte.weight                      [vocab, dim]
//   model.transformer.blocks.N.attn_norm.weight       [dim]
//   model.transformer.blocks.N.{q,k,v}_proj.weight    [heads*hd | kv_heads*hd, dim]
//   model.transformer.blocks.N.attn_out.weight        [dim, heads*hd]
//   model.transformer.blocks.N.ff_norm.weight         [dim]
//   model.transformer.blocks.N.ff_proj.weight         [hidden, dim]   (gate, through SiLU)
//   model.transformer.blocks.N.up_proj.weight         [hidden, dim]
//   model.transformer.blocks.N.ff_out.weight          [dim, hidden]
//   model.transformer.ln_f.weight                     [dim]
//   model.transformer.ff_out.weight                   [vocab, dim]     (absent with weight_tying)
#include "model_common.h"

namespace sparsa::dlm {

Result<Weights> load_llada_weights(const Config& c, const TensorStore& store, Ops& ops) {
  const std::string p = "model.transformer.";
  const int64_t d = c.dim, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim, f = c.hidden_dim;
  Weights w;
  SPARSA_ASSIGN_WEIGHT(w.embed, load_weight(store, ops, p + "wte.weight", {c.vocab_size, d}));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string b = p + "blocks." + std::to_string(l) + ".";
    LayerWeights L;
    SPARSA_ASSIGN_WEIGHT(L.attn_norm, load_weight(store, ops, b + "attn_norm.weight", {d}));
    SPARSA_ASSIGN_WEIGHT(L.wq, load_weight(store, ops, b + "q_proj.weight", {qd, d}));
    SPARSA_ASSIGN_WEIGHT(L.wk, load_weight(store, ops, b + "k_proj.weight", {kvd, d}));
    SPARSA_ASSIGN_WEIGHT(L.wv, load_weight(store, ops, b + "v_proj.weight", {kvd, d}));
    SPARSA_ASSIGN_WEIGHT(L.wo, load_weight(store, ops, b + "attn_out.weight", {d, qd}));
    SPARSA_ASSIGN_WEIGHT(L.ffn_norm, load_weight(store, ops, b + "ff_norm.weight", {d}));
    SPARSA_ASSIGN_WEIGHT(L.w_gate, load_weight(store, ops, b + "ff_proj.weight", {f, d}));
    SPARSA_ASSIGN_WEIGHT(L.w_up, load_weight(store, ops, b + "up_proj.weight", {f, d}));
    SPARSA_ASSIGN_WEIGHT(L.w_down, load_weight(store, ops, b + "ff_out.weight", {d, f}));
    w.layers.push_back(L);
  }
  SPARSA_ASSIGN_WEIGHT(w.final_norm, load_weight(store, ops, p + "ln_f.weight", {d}));
  if (c.tied_embeddings) {
    w.lm_head = w.embed;
  } else {
    SPARSA_ASSIGN_WEIGHT(w.lm_head, load_weight(store, ops, p + "ff_out.weight", {c.vocab_size, d}));
  }
  return w;
}

Status forward_llada(const Config& c, const Weights& w, State& s, Sequence& seq, std::span<const int32_t> tokens,
                     const ForwardOptions& o, float* logits) {
  SPARSA_RETURN_IF_ERROR(check_chunk(c, seq, tokens, o));
  Ops& ops = *s.ops;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = c.dim;
  const int64_t pos0 = seq.length();
  s.reserve(c, n);
  ops.embed(s.x, w.embed, tokens);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    // attention block
    ops.rms_norm(s.xb, s.x, L.attn_norm, n, d, c.norm_eps);
    ops.matmul(s.q, s.xb, n, L.wq);
    ops.matmul(s.k, s.xb, n, L.wk);
    ops.matmul(s.v, s.xb, n, L.wv);
    ops.rope(s.q, n, c.n_heads, c.head_dim, pos0, c.rope);
    ops.rope(s.k, n, c.n_kv_heads, c.head_dim, pos0, c.rope);
    SPARSA_RETURN_IF_ERROR(attend(c, s, seq, l, n, o));
    ops.matmul(s.xb, s.att, n, L.wo);
    ops.add(s.x, s.xb, n * d);
    // SwiGLU feed-forward
    ops.rms_norm(s.xb, s.x, L.ffn_norm, n, d, c.norm_eps);
    ops.matmul(s.hb, s.xb, n, L.w_gate);
    ops.matmul(s.hb2, s.xb, n, L.w_up);
    ops.swiglu(s.hb, s.hb2, n * c.hidden_dim);
    ops.matmul(s.xb, s.hb, n, L.w_down);
    ops.add(s.x, s.xb, n * d);
  }
  head(c, w, s, o, logits);
  return Status::Ok();
}

}  // namespace sparsa::dlm
