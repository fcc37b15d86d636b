// sdar — SDAR / TraDo block diffusion (JetAstra's SDAR, the Qwen3 architecture).
//
// Per layer (no biases; grouped-query attention):
//   q, k  = rms_per_head(q_proj(rms(x))), rms_per_head(k_proj(rms(x)))     (q_norm, k_norm: [head_dim])
//   h     = x + o_proj( attention( rope(q), rope(k), v_proj(rms(x)) ) )
//   out   = h + down_proj( silu(gate_proj(rms(h))) * up_proj(rms(h)) )
// then model.norm and lm_head (embed_tokens with tie_word_embeddings). RoPE is NeoX style
// with rope_theta. Attention is block-causal: causal across blocks of block_size tokens,
// bidirectional inside a block; decoding attends a block to the cached prefix plus itself.
//
// Weight names (Hugging Face JetLM/SDAR-*-Chat, Qwen3 layout):
//   model.embed_tokens.weight                                  [vocab, dim]
//   model.layers.N.input_layernorm.weight                      [dim]
//   model.layers.N.self_attn.{q,k,v}_proj.weight               [heads*hd | kv_heads*hd, dim]
//   model.layers.N.self_attn.{q,k}_norm.weight                 [head_dim]
//   model.layers.N.self_attn.o_proj.weight                     [dim, heads*hd]
//   model.layers.N.post_attention_layernorm.weight             [dim]
//   model.layers.N.mlp.{gate,up}_proj.weight                   [hidden, dim]
//   model.layers.N.mlp.down_proj.weight                        [dim, hidden]
//   model.norm.weight                                          [dim]
//   lm_head.weight                                             [vocab, dim]
#include "model_common.h"

namespace sparsa::dlm {

Result<Weights> load_sdar_weights(const Config& c, const TensorStore& store, Ops& ops) {
  const int64_t d = c.dim, hd = c.head_dim, qd = c.n_heads * hd, kvd = c.n_kv_heads * hd, f = c.hidden_dim;
  Weights w;
  SPARSA_ASSIGN_WEIGHT(w.embed, load_weight(store, ops, "model.embed_tokens.weight", {c.vocab_size, d}));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string b = "model.layers." + std::to_string(l) + ".";
    LayerWeights L;
    SPARSA_ASSIGN_WEIGHT(L.attn_norm, load_weight(store, ops, b + "input_layernorm.weight", {d}));
    SPARSA_ASSIGN_WEIGHT(L.wq, load_weight(store, ops, b + "self_attn.q_proj.weight", {qd, d}));
    SPARSA_ASSIGN_WEIGHT(L.wk, load_weight(store, ops, b + "self_attn.k_proj.weight", {kvd, d}));
    SPARSA_ASSIGN_WEIGHT(L.wv, load_weight(store, ops, b + "self_attn.v_proj.weight", {kvd, d}));
    SPARSA_ASSIGN_WEIGHT(L.q_norm, load_weight(store, ops, b + "self_attn.q_norm.weight", {hd}));
    SPARSA_ASSIGN_WEIGHT(L.k_norm, load_weight(store, ops, b + "self_attn.k_norm.weight", {hd}));
    SPARSA_ASSIGN_WEIGHT(L.wo, load_weight(store, ops, b + "self_attn.o_proj.weight", {d, qd}));
    SPARSA_ASSIGN_WEIGHT(L.ffn_norm, load_weight(store, ops, b + "post_attention_layernorm.weight", {d}));
    SPARSA_ASSIGN_WEIGHT(L.w_gate, load_weight(store, ops, b + "mlp.gate_proj.weight", {f, d}));
    SPARSA_ASSIGN_WEIGHT(L.w_up, load_weight(store, ops, b + "mlp.up_proj.weight", {f, d}));
    SPARSA_ASSIGN_WEIGHT(L.w_down, load_weight(store, ops, b + "mlp.down_proj.weight", {d, f}));
    w.layers.push_back(L);
  }
  SPARSA_ASSIGN_WEIGHT(w.final_norm, load_weight(store, ops, "model.norm.weight", {d}));
  if (c.tied_embeddings) {
    w.lm_head = w.embed;
  } else {
    SPARSA_ASSIGN_WEIGHT(w.lm_head, load_weight(store, ops, "lm_head.weight", {c.vocab_size, d}));
  }
  return w;
}

Status forward_sdar(const Config& c, const Weights& w, State& s, Sequence& seq, std::span<const int32_t> tokens,
                    const ForwardOptions& o, float* logits) {
  SPARSA_RETURN_IF_ERROR(check_chunk(c, seq, tokens, o));
  Ops& ops = *s.ops;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = c.dim, hd = c.head_dim;
  const int64_t pos0 = seq.length();
  s.reserve(c, n);
  ops.embed(s.x, w.embed, tokens);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    // attention block, with RMSNorm of every query and key head before RoPE
    ops.rms_norm(s.xb, s.x, L.attn_norm, n, d, c.norm_eps);
    ops.matmul(s.q, s.xb, n, L.wq);
    ops.matmul(s.k, s.xb, n, L.wk);
    ops.matmul(s.v, s.xb, n, L.wv);
    ops.rms_norm(s.q, s.q, L.q_norm, n * c.n_heads, hd, c.norm_eps);
    ops.rms_norm(s.k, s.k, L.k_norm, n * c.n_kv_heads, hd, c.norm_eps);
    ops.rope(s.q, n, c.n_heads, hd, pos0, c.rope);
    ops.rope(s.k, n, c.n_kv_heads, hd, pos0, c.rope);
    SPARSA_RETURN_IF_ERROR(attend(c, s, seq, l, n, o));
    ops.matmul(s.xb, s.att, n, L.wo);
    ops.add(s.x, s.xb, n * d);
    // SwiGLU MLP
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
