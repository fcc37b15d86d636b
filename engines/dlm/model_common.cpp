// What both architectures share: the weight sources, the scratch State, a Sequence's caches, and
// the attention step of a layer (views over the fused q/k/v rows, the layer's LayerAttention,
// the K/V append of committed tokens).
#include <algorithm>
#include <atomic>
#include <cmath>

#include "engine.h"
#include "model_common.h"

namespace sparsa::dlm {

namespace {

class FileWeights final : public WeightSource {
 public:
  FileWeights(const TensorStore& store, Ops& ops) : store_(store), ops_(ops) {}
  Result<Weight> matrix(std::span<const std::string> names, std::span<const int64_t> rows, int64_t cols) override {
    std::vector<Tensor> parts;
    for (size_t i = 0; i < names.size(); ++i) {
      auto t = store_.get(names[i], {rows[i], cols});
      if (!t.ok()) return t.status();
      parts.push_back(t.value());
    }
    return ops_.prepare(parts);
  }
  Result<Weight> vector(const std::string& name, int64_t dim) override {
    auto t = store_.get(name, {dim});
    if (!t.ok()) return t.status();
    return ops_.prepare_vector(t.value());
  }

 private:
  const TensorStore& store_;
  Ops& ops_;
};

// Uniform in ±1/sqrt(cols) (the embedding ±1), norm weights 1: activations of a sane size through
// every layer, so the timings are those of real numbers (no NaN or denormal paths).
class RandomWeights final : public WeightSource {
 public:
  RandomWeights(Ops& ops, uint64_t seed) : ops_(ops), seed_(seed) {}
  Result<Weight> matrix(std::span<const std::string> names, std::span<const int64_t> rows, int64_t cols) override {
    int64_t total = 0;
    for (int64_t r : rows) total += r;
    const bool embedding = names[0].find("embed") != std::string::npos || names[0].find("wte") != std::string::npos;
    return ops_.random(total, cols, embedding ? 1.0 : 1.0 / std::sqrt(static_cast<double>(cols)),
                       seed_ ^ (0x9E3779B97F4A7C15ull * ++count_));
  }
  Result<Weight> vector(const std::string&, int64_t dim) override { return ops_.constant_vector(dim, 1.0f); }

 private:
  Ops& ops_;
  uint64_t seed_;
  uint64_t count_ = 0;
};

}  // namespace

std::unique_ptr<WeightSource> file_weights(const TensorStore& store, Ops& ops) {
  return std::make_unique<FileWeights>(store, ops);
}
std::unique_ptr<WeightSource> random_weights(Ops& ops, uint64_t seed) {
  return std::make_unique<RandomWeights>(ops, seed);
}

State::~State() {
  if (ops == nullptr) return;
  ops->free(x);
  for (void* p : {xb, qkv, att, gu, h}) ops->free(p);
  ops->free(logits);
}

void State::reserve(const Config& c, int64_t tokens, int64_t rows) {
  const DType act = ops->act_dtype();
  if (tokens > capacity) {
    ops->free(x);
    for (void* p : {xb, qkv, att, gu, h}) ops->free(p);
    const int64_t n = tokens;
    x = static_cast<float*>(ops->alloc(n * c.dim, DType::f32));
    xb = ops->alloc(n * c.dim, act);
    qkv = ops->alloc(n * qkv_width(c), act);
    att = ops->alloc(n * c.n_heads * c.head_dim, act);
    gu = ops->alloc(n * 2 * c.hidden_dim, act);
    h = ops->alloc(n * c.hidden_dim, act);
    capacity = n;
  }
  if (rows > logit_rows) {
    ops->free(logits);
    logits = static_cast<float*>(ops->alloc(rows * c.vocab_size, DType::f32));
    logit_rows = rows;
  }
}

namespace {
// The cached length of one layer (the layers of a forward that stores K/V grow one by one).
int64_t layer_length(const Sequence& seq, size_t layer) {
  if (layer < seq.cache.size()) return seq.cache[layer].length();
  if (seq.device_cache && layer < seq.device_cache->size()) {
    auto n = (*seq.device_cache)[layer].length(seq.device_seq);
    return n.ok() ? n.value() : 0;
  }
  return 0;
}
}  // namespace

int64_t Sequence::length() const { return layer_length(*this, 0); }

Result<std::vector<Sequence>> make_sequences(const Config& c, const AttentionPolicy& policy,
                                             std::span<const int64_t> max_tokens) {
  std::vector<Sequence> seqs(max_tokens.size());
  const bool device = policy.backend == Backend::cuda;
  // cuda: groups of up to kDeviceLosaMaxBatch sequences, each group one pool per layer.
  const size_t group = device ? static_cast<size_t>(kDeviceLosaMaxBatch) : 1;
  for (size_t g0 = 0; g0 < seqs.size(); g0 += group) {
    const size_t g1 = std::min(seqs.size(), g0 + group);
    if (device) {
      // A group of sequences of 0 tokens has no cache (forwards that store nothing); in a group
      // with others, such a sequence holds one page.
      int64_t pages = 0;
      bool any = false;
      for (size_t i = g0; i < g1; ++i) {
        if (max_tokens[i] < 0) return invalid_argument("max_tokens: expected >= 0, got " + std::to_string(max_tokens[i]));
        any = any || max_tokens[i] > 0;
        pages += std::max<int64_t>(1, (max_tokens[i] + 15) / 16);
      }
      if (any) {
        DeviceKVCacheConfig kc;
        kc.heads_kv = c.n_kv_heads;
        kc.head_dim = c.head_dim;
        kc.page_size = 16;
        kc.dtype = DType::bf16;
        kc.pool_pages = pages;
        kc.device = policy.device;
        auto layers = std::make_shared<std::vector<DevicePagedKVCache>>();
        for (int64_t l = 0; l < c.n_layers; ++l) {
          auto cache = DevicePagedKVCache::create(kc);
          if (!cache.ok()) return cache.status();
          for (size_t i = g0; i < g1; ++i) {
            auto id = cache->add_sequence(std::max<int64_t>(1, max_tokens[i]));  // sequence i is id i - g0
            if (!id.ok()) return id.status();
          }
          layers->push_back(std::move(cache.value()));
        }
        for (size_t i = g0; i < g1; ++i) {
          seqs[i].device_cache = layers;
          seqs[i].device_seq = static_cast<int>(i - g0);
        }
      }
    } else {
      for (size_t i = g0; i < g1; ++i) SPARSA_RETURN_IF_ERROR(reset_cache(c, seqs[i]));
    }
    std::vector<int> requests;
    for (size_t i = g0; i < g1; ++i) requests.push_back(policy.recorder ? policy.recorder->new_request() : -1);
    for (int l = 0; l < c.n_layers; ++l) {
      auto a = make_layer_attentions(policy, l, requests);
      if (!a.ok()) return a.status();
      for (size_t i = g0; i < g1; ++i) seqs[i].attention.push_back(std::move(a.value()[i - g0]));
    }
  }
  return seqs;
}

Result<Sequence> make_sequence(const Config& c, const AttentionPolicy& policy, int64_t max_tokens) {
  auto seqs = make_sequences(c, policy, std::span<const int64_t>(&max_tokens, 1));
  if (!seqs.ok()) return seqs.status();
  return std::move(seqs.value()[0]);
}

uint64_t next_model_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

PromptCache::PromptCache() : state_(std::make_unique<State>()) {}
PromptCache::PromptCache(PromptCache&&) noexcept = default;
PromptCache& PromptCache::operator=(PromptCache&&) noexcept = default;
PromptCache::~PromptCache() = default;
int64_t PromptCache::tokens() const { return state_ ? static_cast<int64_t>(state_->tokens.size()) : 0; }
int64_t PromptCache::last_reused() const { return state_ ? state_->last_reused : 0; }
void PromptCache::clear() {
  if (state_) *state_ = State{};
}

Result<int64_t> reuse_prompt_cache(const Model::Impl& m, const PromptCache::State& cache,
                                   std::span<const int32_t> prompt, int64_t max_blocks, Sequence& seq) {
  const Config& c = m.config;
  const int64_t B = c.block_size;
  if (cache.model != m.id || static_cast<int64_t>(cache.layers.size()) != c.n_layers ||
      static_cast<int64_t>(seq.cache.size()) != c.n_layers || seq.length() != 0) {
    return 0;
  }
  int64_t same = 0;  // leading tokens equal in the cache and the prompt
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(cache.tokens.size()), static_cast<int64_t>(prompt.size()));
  while (same < n && cache.tokens[static_cast<size_t>(same)] == prompt[static_cast<size_t>(same)]) ++same;
  const int64_t reuse = std::min(same / B, max_blocks) * B;
  if (reuse <= 0) return 0;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const PagedKVCache& from = cache.layers[static_cast<size_t>(l)];
    Tensor k = from.keys(), v = from.values();  // [1, heads_kv, length, head_dim]: the first `reuse`
    k.shape[2] = reuse;
    v.shape[2] = reuse;
    const Status st = seq.cache[static_cast<size_t>(l)].append(k, v);
    if (!st.ok()) {  // cannot fail on caches of one shape; start over without the cache if it does
      SPARSA_RETURN_IF_ERROR(reset_cache(c, seq));
      return int64_t{0};
    }
  }
  for (auto& a : seq.attention) a->on_commit();
  return reuse;
}

void keep_prompt_cache(const Model::Impl& m, PromptCache::State& cache, std::span<const int32_t> canvas, Sequence& seq) {
  const int64_t kept = std::min<int64_t>(seq.length(), static_cast<int64_t>(canvas.size()));
  cache.model = m.id;
  cache.tokens.assign(canvas.begin(), canvas.begin() + kept);
  cache.layers = std::move(seq.cache);
  seq.cache.clear();
}

Status reset_cache(const Config& c, Sequence& seq) {
  if (seq.device_cache) {
    for (auto& cache : *seq.device_cache) SPARSA_RETURN_IF_ERROR(cache.reset(seq.device_seq));
  } else {
    seq.cache.clear();
    for (int64_t l = 0; l < c.n_layers; ++l) {
      auto cache = PagedKVCache::create({c.n_kv_heads, c.head_dim, 16});
      if (!cache.ok()) return cache.status();
      seq.cache.push_back(std::move(cache.value()));
    }
  }
  for (auto& a : seq.attention) a->on_reset();
  return Status::Ok();
}

namespace {
// Rows [n, row_stride] holding `heads` heads of head_dim from column `col` as the [1, heads, n,
// head_dim] view attention takes.
Tensor heads_view(void* data, DType dtype, Device device, int64_t n, int64_t heads, int64_t head_dim,
                  int64_t row_stride, int64_t col) {
  Tensor t = Tensor::contiguous(static_cast<char*>(data) + col * dtype_size(dtype), dtype, {1, heads, n, head_dim},
                                device);
  t.strides[0] = n * row_stride;
  t.strides[1] = head_dim;
  t.strides[2] = row_stride;
  t.strides[3] = 1;
  return t;
}
}  // namespace

namespace {
// One chunk's attention call (its rows from row0 of s.qkv and s.att) over its sequence's cache.
Status chunk_call(const Config& c, State& s, Sequence& seq, int layer, int64_t row0, int64_t n,
                  const ForwardOptions& o, AttentionCall* out) {
  const DType act = s.ops->act_dtype();
  const Device dev = s.ops->device();
  const int64_t hd = c.head_dim, qd = c.n_heads * hd, kvd = c.n_kv_heads * hd, w = qkv_width(c);
  void* qkv = static_cast<char*>(s.qkv) + row0 * w * dtype_size(act);
  void* att = static_cast<char*>(s.att) + row0 * qd * dtype_size(act);
  AttentionCall call;
  call.layer = layer;
  call.pos0 = layer_length(seq, static_cast<size_t>(layer));
  call.q = heads_view(qkv, act, dev, n, c.n_heads, hd, w, 0);
  call.k = heads_view(qkv, act, dev, n, c.n_kv_heads, hd, w, qd);
  call.v = heads_view(qkv, act, dev, n, c.n_kv_heads, hd, w, qd + kvd);
  call.out = heads_view(att, act, dev, n, c.n_heads, hd, qd, 0);
  call.block_causal = o.block_causal;
  call.step = o.step;
  if (!seq.cache.empty()) {
    call.prefix = &seq.cache[layer];
    if (call.pos0 > 0) {
      call.prefix_k = seq.cache[layer].keys();
      call.prefix_v = seq.cache[layer].values();
    }
  } else if (seq.device_cache) {
    if (o.with_suffix) return invalid_argument("forward: the dual cache's suffix runs on the cpu backend");
    const DevicePagedKVCache& cache = (*seq.device_cache)[layer];
    call.device_prefix = &cache;
    call.device_seq = seq.device_seq;
    if (call.pos0 > 0) {
      auto k = cache.keys(seq.device_seq);
      auto v = cache.values(seq.device_seq);
      if (!k.ok()) return k.status();
      if (!v.ok()) return v.status();
      call.prefix_k = k.value();
      call.prefix_v = v.value();
    }
  }
  if (o.with_suffix) {
    if (static_cast<int64_t>(seq.suffix.size()) <= layer) {
      return invalid_argument("forward: with_suffix on a sequence whose suffix no forward kept (keep_suffix_from)");
    }
    if (!seq.attention[layer]->takes_suffix()) {
      return invalid_argument("attention: layer " + std::to_string(layer) +
                              "'s method does not take the dual cache's suffix (a prefix method: use dense or a "
                              "canvas method)");
    }
    if (seq.suffix[layer].length() > 0) {
      call.suffix_k = seq.suffix[layer].keys();
      call.suffix_v = seq.suffix[layer].values();
    }
  }
  *out = call;
  return Status::Ok();
}

// After the layer's attention: the K/V of the chunk's rows [from, n) as the sequence's dual-cache
// suffix of the layer (cpu), replacing what it held.
Status keep_suffix(const Config& c, State& s, Sequence& seq, int layer, int64_t row0, int64_t n,
                   const ForwardOptions& o) {
  if (o.keep_suffix_from < 0) return Status::Ok();
  if (seq.device_cache || seq.cache.empty()) {
    return invalid_argument("forward: the dual cache's suffix runs on the cpu backend, over a sequence with a cache");
  }
  const DType act = s.ops->act_dtype();
  const Device dev = s.ops->device();
  const int64_t hd = c.head_dim, qd = c.n_heads * hd, kvd = c.n_kv_heads * hd, w = qkv_width(c);
  if (seq.suffix.size() != seq.cache.size()) seq.suffix.resize(seq.cache.size());
  auto fresh = PagedKVCache::create(seq.cache[layer].config());
  if (!fresh.ok()) return fresh.status();
  seq.suffix[layer] = std::move(fresh.value());
  const int64_t m = n - o.keep_suffix_from;
  if (m == 0) return Status::Ok();
  void* qkv = static_cast<char*>(s.qkv) + (row0 + o.keep_suffix_from) * w * dtype_size(act);
  return seq.suffix[layer].append(heads_view(qkv, act, dev, m, c.n_kv_heads, hd, w, qd),
                                  heads_view(qkv, act, dev, m, c.n_kv_heads, hd, w, qd + kvd));
}

// After the layer's attention: the K/V of the chunk's first store_kv tokens appended to its cache.
Status store_chunk(const Config& c, State& s, Sequence& seq, int layer, int64_t row0, const ForwardOptions& o) {
  if (o.store_kv <= 0) return Status::Ok();
  const DType act = s.ops->act_dtype();
  const Device dev = s.ops->device();
  const int64_t hd = c.head_dim, qd = c.n_heads * hd, kvd = c.n_kv_heads * hd, w = qkv_width(c);
  void* qkv = static_cast<char*>(s.qkv) + row0 * w * dtype_size(act);
  const int64_t m = o.store_kv;
  const Tensor k = heads_view(qkv, act, dev, m, c.n_kv_heads, hd, w, qd);
  const Tensor v = heads_view(qkv, act, dev, m, c.n_kv_heads, hd, w, qd + kvd);
  if (!seq.cache.empty()) {
    SPARSA_RETURN_IF_ERROR(seq.cache[layer].append(k, v));
  } else if (seq.device_cache) {
    SPARSA_RETURN_IF_ERROR((*seq.device_cache)[layer].append(seq.device_seq, k, v, s.ops->stream()));
  } else {
    return Status(StatusCode::internal, "forward: store_kv on a sequence made without a cache");
  }
  seq.attention[layer]->on_commit();
  return Status::Ok();
}
}  // namespace

// Every chunk's call first; the chunks whose layer methods share a batched state (batch_state)
// then run together, in chunk order, the others alone; the K/V appends come last (each chunk's
// attention reads its own sequence's cache only).
Status attend(const Config& c, State& s, std::span<const Chunk> chunks, std::span<const ChunkRows> rows, int layer) {
  std::vector<AttentionCall> calls(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    SPARSA_RETURN_IF_ERROR(
        chunk_call(c, s, *chunks[i].seq, layer, rows[i].row0, rows[i].n, chunks[i].options, &calls[i]));
  }
  std::vector<bool> done(chunks.size(), false);
  std::vector<LayerAttention*> members;
  std::vector<AttentionCall> member_calls;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (done[i]) continue;
    LayerAttention* a = chunks[i].seq->attention[layer].get();
    const void* shared = a->batch_state();
    if (shared == nullptr) {
      SPARSA_RETURN_IF_ERROR(a->forward(calls[i]));
      continue;
    }
    members.clear();
    member_calls.clear();
    for (size_t j = i; j < chunks.size(); ++j) {
      LayerAttention* b = chunks[j].seq->attention[layer].get();
      if (!done[j] && b->batch_state() == shared) {
        members.push_back(b);
        member_calls.push_back(calls[j]);
        done[j] = true;
      }
    }
    SPARSA_RETURN_IF_ERROR(a->forward_batch(members, member_calls));
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    SPARSA_RETURN_IF_ERROR(keep_suffix(c, s, *chunks[i].seq, layer, rows[i].row0, rows[i].n, chunks[i].options));
    SPARSA_RETURN_IF_ERROR(store_chunk(c, s, *chunks[i].seq, layer, rows[i].row0, chunks[i].options));
  }
  return Status::Ok();
}

Result<std::vector<ChunkRows>> begin_forward(const Config& c, const Weights& w, State& s,
                                             std::span<const Chunk> chunks) {
  if (chunks.empty()) return invalid_argument("forward: no chunk");
  std::vector<ChunkRows> rows(chunks.size());
  int64_t total = 0, logit_rows = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& ch = chunks[i];
    if (ch.seq == nullptr) return invalid_argument("forward: a chunk without a sequence");
    for (size_t j = 0; j < i; ++j) {
      if (chunks[j].seq == ch.seq) return invalid_argument("forward: one sequence in two chunks of a batch");
    }
    SPARSA_RETURN_IF_ERROR(check_chunk(c, *ch.seq, ch.tokens, ch.options));
    rows[i] = {total, static_cast<int64_t>(ch.tokens.size()), ch.seq->length(), logit_rows};
    total += rows[i].n;
    logit_rows += ch.options.logits_count;
  }
  s.reserve(c, total, logit_rows);
  if (chunks.size() == 1) {
    s.ops->embed(s.x, w.embed, chunks[0].tokens);
  } else {
    std::vector<int32_t> tokens;
    tokens.reserve(static_cast<size_t>(total));
    for (const Chunk& ch : chunks) tokens.insert(tokens.end(), ch.tokens.begin(), ch.tokens.end());
    s.ops->embed(s.x, w.embed, tokens);
  }
  return rows;
}

void rope_chunks(const Config& c, State& s, std::span<const ChunkRows> rows, int64_t heads) {
  const int64_t w = qkv_width(c);
  const size_t row_bytes = static_cast<size_t>(w) * dtype_size(s.ops->act_dtype());
  for (const ChunkRows& r : rows) {
    s.ops->rope(static_cast<char*>(s.qkv) + r.row0 * row_bytes, r.n, heads, c.head_dim, w, r.pos0, c.rope);
  }
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
  // A shifted-logit model may ask for the position just past the chunk: its last row predicts it.
  const int64_t last = c.shifted_logits && o.logits_begin > 0 ? n + 1 : n;
  if (o.store_kv < 0 || o.store_kv > n || o.logits_begin < 0 || o.logits_count < 0 ||
      o.logits_begin + o.logits_count > last) {
    return invalid_argument("forward: store_kv / logits rows outside the chunk");
  }
  if (o.keep_suffix_from < -1 || o.keep_suffix_from > n ||
      (o.keep_suffix_from >= 0 && o.keep_suffix_from < o.store_kv)) {
    return invalid_argument("forward: keep_suffix_from outside [store_kv, n] of the chunk");
  }
  return Status::Ok();
}

// The Qwen2 / Qwen3 weight layout of sdar and dream (model_sdar.cpp and model_dream.cpp list the
// names): q_norm / k_norm when the config has QK norms (sdar), q / k / v biases when it has them
// (dream).
Result<Weights> load_qwen_weights(const Config& c, WeightSource& src) {
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
    if (c.qk_norm) {
      SPARSA_ASSIGN_WEIGHT(L.q_norm, src.vector(b + "self_attn.q_norm.weight", hd));
      SPARSA_ASSIGN_WEIGHT(L.k_norm, src.vector(b + "self_attn.k_norm.weight", hd));
    }
    if (c.qkv_bias) {
      SPARSA_ASSIGN_WEIGHT(L.q_bias, src.vector(b + "self_attn.q_proj.bias", qd));
      SPARSA_ASSIGN_WEIGHT(L.k_bias, src.vector(b + "self_attn.k_proj.bias", kvd));
      SPARSA_ASSIGN_WEIGHT(L.v_bias, src.vector(b + "self_attn.v_proj.bias", kvd));
    }
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

Status head(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks,
            std::span<const ChunkRows> rows, float* logits) {
  int64_t total = 0;
  const size_t row_bytes = static_cast<size_t>(c.dim) * dtype_size(s.ops->act_dtype());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ForwardOptions& o = chunks[i].options;
    if (o.logits_count == 0) continue;
    char* out = static_cast<char*>(s.xb) + rows[i].logit0 * row_bytes;
    int64_t from = rows[i].row0 + o.logits_begin, count = o.logits_count;
    if (c.shifted_logits) {  // dream: position p's logits come from the hidden state of p - 1 (p = 0: its own)
      if (o.logits_begin == 0) {
        if (rows[i].pos0 > 0) {
          return invalid_argument(std::string(arch_name(c.arch)) +
                                  ": the logits of a chunk's first row need the hidden state of the position before "
                                  "it, which a chunk over a cached prefix does not have");
        }
        s.ops->rms_norm(out, s.x + from * c.dim, w.final_norm, 1, c.dim, c.norm_eps);
        out += row_bytes;
        --count;
      } else {
        --from;
      }
    }
    if (count > 0) s.ops->rms_norm(out, s.x + from * c.dim, w.final_norm, count, c.dim, c.norm_eps);
    total += o.logits_count;
  }
  if (total == 0) return s.ops->check();
  s.ops->matmul_f32(s.logits, s.xb, total, w.lm_head);
  if (logits != nullptr) s.ops->to_host(logits, s.logits, total * c.vocab_size);
  return s.ops->check();
}

}  // namespace sparsa::dlm
