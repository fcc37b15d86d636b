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
// (load_qwen_weights in model_common.cpp reads this layout for sdar and dream.)
#include "model_common.h"

namespace sparsa::dlm {

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
