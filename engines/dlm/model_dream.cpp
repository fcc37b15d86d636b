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
#include "model_common.h"

namespace sparsa::dlm {

Result<Weights> load_dream_weights(const Config& c, WeightSource& src) {
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
    SPARSA_ASSIGN_WEIGHT(L.q_bias, src.vector(b + "self_attn.q_proj.bias", qd));
    SPARSA_ASSIGN_WEIGHT(L.k_bias, src.vector(b + "self_attn.k_proj.bias", kvd));
    SPARSA_ASSIGN_WEIGHT(L.v_bias, src.vector(b + "self_attn.v_proj.bias", kvd));
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
      return Status(StatusCode::unsupported,
                    std::string("dream: the ") + ops.name() + " backend has no bias op (dream runs on the cpu backend)");
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
