// dream — Dream 7B and its family (HKUNLP's Dream; the Qwen2 architecture, bidirectional):
// DiffuCoder and Dream-Coder share it.
//
// Per layer (biases on q, k, v only; grouped-query attention; no mask):
//   q, k, v = q_proj(rms(x)) + b_q, k_proj(rms(x)) + b_k, v_proj(rms(x)) + b_v
//   h       = x + o_proj( attention( rope(q), rope(k), v ) )
//   out     = h + down_proj( silu(gate_proj(rms(h))) * up_proj(rms(h)) )
// then model.norm and lm_head. RoPE is NeoX style with rope_theta. Dream predicts position i
// from the logits of position i - 1 (position 0 from its own): the head reads the hidden state
// one row back (model_common.cpp, head()).
//
// Weight names (Hugging Face Dream-org/Dream-v0-*-7B, Qwen2 layout):
//   model.embed_tokens.weight                                  [vocab, dim]
//   model.layers.N.input_layernorm.weight                      [dim]
//   model.layers.N.self_attn.{q,k,v}_proj.weight               [heads*hd | kv_heads*hd, dim]
//   model.layers.N.self_attn.{q,k,v}_proj.bias                 [heads*hd | kv_heads*hd]
//   model.layers.N.self_attn.o_proj.weight                     [dim, heads*hd]
//   model.layers.N.post_attention_layernorm.weight             [dim]
//   model.layers.N.mlp.{gate,up}_proj.weight                   [hidden, dim]
//   model.layers.N.mlp.down_proj.weight                        [dim, hidden]
//   model.norm.weight                                          [dim]
//   lm_head.weight                                             [vocab, dim]   (absent when tied)
// (load_qwen_weights in model_common.cpp reads this layout for sdar and dream.)
#include "model_common.h"

namespace sparsa::dlm {

Status forward_dream(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks, float* logits) {
  auto rows = begin_forward(c, w, s, chunks);
  if (!rows.ok()) return rows.status();
  Ops& ops = *s.ops;
  const int64_t n = rows->back().row0 + rows->back().n, d = c.dim, hd = c.head_dim;
  const int64_t qkv = qkv_width(c), qd = c.n_heads * hd, kvd = c.n_kv_heads * hd;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    // attention block: q, k, v in one GEMM plus their biases, RoPE on q and k
    ops.rms_norm(s.xb, s.x, L.attn_norm, n, d, c.norm_eps);
    ops.matmul(s.qkv, s.xb, n, L.wqkv);
    if (!ops.add_bias(s.qkv, n, qkv, 0, L.q_bias) || !ops.add_bias(s.qkv, n, qkv, qd, L.k_bias) ||
        !ops.add_bias(s.qkv, n, qkv, qd + kvd, L.v_bias)) {
      return Status(StatusCode::unsupported, std::string("dream: the ") + ops.name() + " backend has no bias op");
    }
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
