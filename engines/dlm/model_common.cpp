// What both architectures share: the scratch State, a Sequence's caches, and the attention
// step of a layer (views over the row-major activations, the layer's LayerAttention, the
// K/V append of committed tokens).
#include "engine.h"
#include "model_common.h"

namespace sparsa::dlm {

State::~State() {
  if (ops == nullptr) return;
  for (float* p : {x, xb, q, k, v, att, hb, hb2, logits}) ops->free(p);
}

void State::reserve(const Config& c, int64_t tokens) {
  if (tokens <= capacity) return;
  for (float* p : {x, xb, q, k, v, att, hb, hb2, logits}) ops->free(p);
  const int64_t n = tokens;
  x = ops->alloc(n * c.dim);
  xb = ops->alloc(n * std::max(c.dim, c.n_heads * c.head_dim));
  q = ops->alloc(n * c.n_heads * c.head_dim);
  k = ops->alloc(n * c.n_kv_heads * c.head_dim);
  v = ops->alloc(n * c.n_kv_heads * c.head_dim);
  att = ops->alloc(n * c.n_heads * c.head_dim);
  hb = ops->alloc(n * c.hidden_dim);
  hb2 = ops->alloc(n * c.hidden_dim);
  logits = ops->alloc(n * c.vocab_size);
  capacity = n;
}

Result<Sequence> make_sequence(const Config& c, const AttentionPolicy& policy) {
  Sequence seq;
  SPARSA_RETURN_IF_ERROR(reset_cache(c, seq));
  for (int l = 0; l < c.n_layers; ++l) {
    auto a = make_layer_attention(policy, l);
    if (!a.ok()) return a.status();
    seq.attention.push_back(std::move(a.value()));
  }
  return seq;
}

Status reset_cache(const Config& c, Sequence& seq) {
  seq.cache.clear();
  for (int64_t l = 0; l < c.n_layers; ++l) {
    auto cache = PagedKVCache::create({c.n_kv_heads, c.head_dim, 16});
    if (!cache.ok()) return cache.status();
    seq.cache.push_back(std::move(cache.value()));
  }
  for (auto& a : seq.attention) a->on_reset();
  return Status::Ok();
}

namespace {
// [n, heads, head_dim] row-major as the [1, heads, n, head_dim] view attention takes.
Tensor heads_view(float* data, int64_t n, int64_t heads, int64_t head_dim) {
  Tensor t = Tensor::contiguous(data, DType::f32, {1, heads, n, head_dim});
  t.strides[0] = n * heads * head_dim;
  t.strides[1] = head_dim;
  t.strides[2] = heads * head_dim;
  t.strides[3] = 1;
  return t;
}
}  // namespace

Status attend(const Config& c, State& s, Sequence& seq, int layer, int64_t n, const ForwardOptions& o) {
  AttentionCall call;
  call.layer = layer;
  call.pos0 = seq.cache[layer].length();
  call.q = heads_view(s.q, n, c.n_heads, c.head_dim);
  call.k = heads_view(s.k, n, c.n_kv_heads, c.head_dim);
  call.v = heads_view(s.v, n, c.n_kv_heads, c.head_dim);
  call.out = heads_view(s.att, n, c.n_heads, c.head_dim);
  call.prefix = &seq.cache[layer];
  call.block_causal = o.block_causal;
  call.step = o.step;
  call.q.device = call.k.device = call.v.device = call.out.device = s.ops->device();
  SPARSA_RETURN_IF_ERROR(seq.attention[layer]->forward(call));
  if (o.store_kv > 0) {
    const int64_t m = o.store_kv;
    SPARSA_RETURN_IF_ERROR(seq.cache[layer].append(heads_view(s.k, m, c.n_kv_heads, c.head_dim),
                                                   heads_view(s.v, m, c.n_kv_heads, c.head_dim)));
    seq.attention[layer]->on_commit();
  }
  return Status::Ok();
}

Status check_chunk(const Config& c, const Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return invalid_argument("forward: empty chunk");
  if (seq.length() + n > c.max_seq_len) {
    return invalid_argument("forward: positions up to " + std::to_string(seq.length() + n) +
                            " exceed the model's context of " + std::to_string(c.max_seq_len) + " tokens");
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return invalid_argument("forward: token id " + std::to_string(t) + " outside [0, " +
                              std::to_string(c.vocab_size) + ")");
    }
  }
  if (o.store_kv < 0 || o.store_kv > n || o.logits_begin < 0 || o.logits_count < 0 ||
      o.logits_begin + o.logits_count > n) {
    return invalid_argument("forward: store_kv / logits rows outside the chunk");
  }
  return Status::Ok();
}

void head(const Config& c, const Weights& w, State& s, const ForwardOptions& o, float* logits) {
  if (logits == nullptr || o.logits_count == 0) return;
  const int64_t rows = o.logits_count;
  s.ops->rms_norm(s.xb, s.x + o.logits_begin * c.dim, w.final_norm, rows, c.dim, c.norm_eps);
  s.ops->matmul(s.logits, s.xb, rows, w.lm_head);
  s.ops->to_host(logits, s.logits, rows * c.vocab_size);
}

Result<Weight> load_weight(const TensorStore& store, Ops& ops, const std::string& name, std::vector<int64_t> shape) {
  auto t = store.get(name, std::move(shape));
  if (!t.ok()) return t.status();
  return ops.prepare(t.value());
}

}  // namespace sparsa::dlm
