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

Result<Weights> load_llada_weights(const Config& c, WeightSource& src) {
  const std::string p = "model.transformer.";
  const int64_t d = c.dim, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim, f = c.hidden_dim;
  Weights w;
  SPARSA_ASSIGN_WEIGHT(w.embed, src.matrix(p + "wte.weight", c.vocab_size, d));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string b = p + "blocks." + std::to_string(l) + ".";
    LayerWeights L;
    SPARSA_ASSIGN_WEIGHT(L.attn_norm, src.vector(b + "attn_norm.weight", d));
    const std::string qkv[] = {b + "q_proj.weight", b + "k_proj.weight", b + "v_proj.weight"};
    const int64_t qkv_rows[] = {qd, kvd, kvd};
    SPARSA_ASSIGN_WEIGHT(L.wqkv, src.matrix(qkv, qkv_rows, d));
    SPARSA_ASSIGN_WEIGHT(L.wo, src.matrix(b + "attn_out.weight", d, qd));
    SPARSA_ASSIGN_WEIGHT(L.ffn_norm, src.vector(b + "ff_norm.weight", d));
    const std::string gate_up[] = {b + "ff_proj.weight", b + "up_proj.weight"};
    const int64_t gate_up_rows[] = {f, f};
    SPARSA_ASSIGN_WEIGHT(L.w_gate_up, src.matrix(gate_up, gate_up_rows, d));
    SPARSA_ASSIGN_WEIGHT(L.w_down, src.matrix(b + "ff_out.weight", d, f));
    w.layers.push_back(L);
  }
  SPARSA_ASSIGN_WEIGHT(w.final_norm, src.vector(p + "ln_f.weight", d));
  if (c.tied_embeddings) {
    w.lm_head = w.embed;
  } else {
    SPARSA_ASSIGN_WEIGHT(w.lm_head, src.matrix(p + "ff_out.weight", c.vocab_size, d));
  }
  return w;
}

Status forward_llada(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks, float* logits) {
  auto rows = begin_forward(c, w, s, chunks);
  if (!rows.ok()) return rows.status();
  Ops& ops = *s.ops;
  const int64_t n = rows->back().row0 + rows->back().n, d = c.dim;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    // attention block: q, k, v in one GEMM, RoPE on q and k
    ops.rms_norm(s.xb, s.x, L.attn_norm, n, d, c.norm_eps);
    ops.matmul(s.qkv, s.xb, n, L.wqkv);
    rope_chunks(c, s, *rows, c.n_heads + c.n_kv_heads);
    SPARSA_RETURN_IF_ERROR(attend(c, s, chunks, *rows, l));
    ops.matmul_add(s.x, s.att, n, L.wo);
    // SwiGLU feed-forward: gate and up in one GEMM
    ops.rms_norm(s.xb, s.x, L.ffn_norm, n, d, c.norm_eps);
    ops.matmul(s.gu, s.xb, n, L.w_gate_up);
    ops.swiglu(s.h, s.gu, n, c.hidden_dim);
    ops.matmul_add(s.x, s.h, n, L.w_down);
  }
  return head(c, w, s, chunks, *rows, logits);
}

}  // namespace sparsa::dlm
