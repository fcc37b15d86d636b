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

Result<Weights> load_sdar_weights(const Config& c, WeightSource& src) {
  const int64_t d = c.dim, hd = c.head_dim, qd = c.n_heads * hd, kvd = c.n_kv_heads * hd, f = c.hidden_dim;
  Weights w;
  SPARSA_ASSIGN_WEIGHT(w.embed, src.matrix("model.embed_tokens.weight", c.vocab_size, d));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string b = "model.layers." + std::to_string(l) + ".";
    LayerWeights L;
    SPARSA_ASSIGN_WEIGHT(L.attn_norm, src.vector(b + "input_layernorm.weight", d));
    const std::string qkv[] = {b + "self_attn.q_proj.weight", b + "self_attn.k_proj.weight",
                               b + "self_attn.v_proj.weight"};
    const int64_t qkv_rows[] = {qd, kvd, kvd};
    SPARSA_ASSIGN_WEIGHT(L.wqkv, src.matrix(qkv, qkv_rows, d));
    SPARSA_ASSIGN_WEIGHT(L.q_norm, src.vector(b + "self_attn.q_norm.weight", hd));
    SPARSA_ASSIGN_WEIGHT(L.k_norm, src.vector(b + "self_attn.k_norm.weight", hd));
    SPARSA_ASSIGN_WEIGHT(L.wo, src.matrix(b + "self_attn.o_proj.weight", d, qd));
    SPARSA_ASSIGN_WEIGHT(L.ffn_norm, src.vector(b + "post_attention_layernorm.weight", d));
    const std::string gate_up[] = {b + "mlp.gate_proj.weight", b + "mlp.up_proj.weight"};
    const int64_t gate_up_rows[] = {f, f};
    SPARSA_ASSIGN_WEIGHT(L.w_gate_up, src.matrix(gate_up, gate_up_rows, d));
    SPARSA_ASSIGN_WEIGHT(L.w_down, src.matrix(b + "mlp.down_proj.weight", d, f));
    w.layers.push_back(L);
  }
  SPARSA_ASSIGN_WEIGHT(w.final_norm, src.vector("model.norm.weight", d));
  if (c.tied_embeddings) {
    w.lm_head = w.embed;
  } else {
    SPARSA_ASSIGN_WEIGHT(w.lm_head, src.matrix("lm_head.weight", c.vocab_size, d));
  }
  return w;
}

Status forward_sdar(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks, float* logits) {
  auto rows = begin_forward(c, w, s, chunks);
  if (!rows.ok()) return rows.status();
  Ops& ops = *s.ops;
  const int64_t n = rows->back().row0 + rows->back().n, d = c.dim, hd = c.head_dim;
  const int64_t qkv = qkv_width(c), qd = c.n_heads * hd;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    // attention block: q, k, v in one GEMM, then RMSNorm of every query and key head before RoPE
    ops.rms_norm(s.xb, s.x, L.attn_norm, n, d, c.norm_eps);
    ops.matmul(s.qkv, s.xb, n, L.wqkv);
    ops.head_norm(s.qkv, n, c.n_heads, hd, qkv, L.q_norm, c.norm_eps);
    ops.head_norm(static_cast<char*>(s.qkv) + qd * dtype_size(ops.act_dtype()), n, c.n_kv_heads, hd, qkv, L.k_norm,
                  c.norm_eps);
    rope_chunks(c, s, *rows, c.n_heads + c.n_kv_heads);
    SPARSA_RETURN_IF_ERROR(attend(c, s, chunks, *rows, l));
    ops.matmul_add(s.x, s.att, n, L.wo);
    // SwiGLU MLP: gate and up in one GEMM
    ops.rms_norm(s.xb, s.x, L.ffn_norm, n, d, c.norm_eps);
    ops.matmul(s.gu, s.xb, n, L.w_gate_up);
    ops.swiglu(s.h, s.gu, n, c.hidden_dim);
    ops.matmul_add(s.x, s.h, n, L.w_down);
  }
  return head(c, w, s, chunks, *rows, logits);
}

}  // namespace sparsa::dlm
