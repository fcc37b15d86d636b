// The engine's internal pieces (llama2.c style): the mapped tensor files, Weights, the compute
// backend seam (Ops), the per-layer attention interface, a Sequence (one request: its KV cache
// and per-layer attention state), the State (scratch activations) and the forwards.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/dlm.h"
#include "sparsa/kv_cache.h"
#include "sparsa/tensor.h"

namespace sparsa::dlm {

// ---- files ------------------------------------------------------------------------------
// model.safetensors, or model.safetensors.index.json + shards, memory-mapped; tensors are
// views into the mappings (the files stay mapped as long as the store lives).
struct MappedFile;
class TensorStore {
 public:
  static Result<TensorStore> open(const std::string& dir);
  // The tensor `name` with exactly `shape`, a float dtype; the error names the tensor.
  Result<Tensor> get(const std::string& name, std::vector<int64_t> shape) const;
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  std::string dtypes() const;  // the dtypes present, "bf16+f32"

 private:
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, std::pair<Tensor, std::string>> tensors_;  // name -> (view, file)
};

// The weight map of model.safetensors.index.json: tensor name -> shard file name.
// Shard names must be plain file names (no directories, no "..").
Result<std::map<std::string, std::string>> parse_safetensors_index(const std::string& json_text,
                                                                   const std::string& where);

// ---- backend seam -------------------------------------------------------------------------
// Everything the forwards compute besides attention. The CPU backend keeps activations and
// weights in host f32 (weights converted once at load; f32 files stay views of the mapping) and
// runs GEMMs through OpenBLAS; a CUDA backend implements the same calls on device buffers
// (cuBLAS for matmul, small kernels for the rest). Pointers are the backend's memory.
struct Weight {
  const float* data = nullptr;  // [rows, cols] row-major, backend memory
  int64_t rows = 0, cols = 0;
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* name() const = 0;
  virtual Device device() const = 0;
  // The weight in the backend's layout (CPU: f32; a view when the file is f32 already).
  virtual Result<Weight> prepare(const Tensor& host_view) = 0;
  virtual float* alloc(int64_t floats) = 0;  // zeroed scratch owned by the caller through free()
  virtual void free(float* p) = 0;
  // y[n, w.rows] = x[n, w.cols] · wᵀ
  virtual void matmul(float* y, const float* x, int64_t n, const Weight& w) = 0;
  // out[rows, dim] = x / rms(x) * weight (weight [dim]); out may alias x.
  virtual void rms_norm(float* out, const float* x, const Weight& weight, int64_t rows, int64_t dim, double eps) = 0;
  // x[n, heads, head_dim] rotated in place, NeoX (rotate-half) pairing, positions pos0 + i.
  virtual void rope(float* x, int64_t n, int64_t heads, int64_t head_dim, int64_t pos0, const RopeConfig& rope) = 0;
  // gate[i] = silu(gate[i]) * up[i]
  virtual void swiglu(float* gate, const float* up, int64_t count) = 0;
  virtual void add(float* x, const float* y, int64_t count) = 0;  // x += y
  // out[n, dim] = table rows of tokens
  virtual void embed(float* out, const Weight& table, std::span<const int32_t> tokens) = 0;
  // dst[count] (host) = src[count] (backend memory): the sampler's read-back.
  virtual void to_host(float* dst, const float* src, int64_t count) = 0;
};
std::unique_ptr<Ops> make_cpu_ops();

// ---- attention ----------------------------------------------------------------------------
// Attention of one layer over one chunk of consecutive tokens at positions [pos0, pos0 + n):
// the chunk's queries see the prefix (cached keys of positions [0, pos0), all visible) and the
// chunk's own keys under `block_causal` (0: all visible; b > 0: key j visible to query i when
// j / b <= i / b in absolute positions, pos0 a multiple of b). The model code calls only this;
// which method runs (dense now; ba_att, quest, losa next) is the LayerAttention behind it.
struct AttentionCall {
  int layer = 0;
  int64_t pos0 = 0;
  Tensor q;                              // f32 [1, heads_q, n, head_dim], RoPE applied (strided views are fine)
  Tensor k, v;                           // f32 [1, heads_kv, n, head_dim]: the chunk's own keys and values
  const PagedKVCache* prefix = nullptr;  // positions [0, pos0); null or empty: none
  int64_t block_causal = 0;
  Tensor out;     // f32 [1, heads_q, n, head_dim]
  int step = -1;  // denoising step inside the current block (0 = first); -1: prefill, commit, logits
};

class LayerAttention {
 public:
  virtual ~LayerAttention() = default;
  virtual Status forward(const AttentionCall& call) = 0;
  // The chunk's K/V were appended to the prefix cache (a block was committed).
  virtual void on_commit() {}
  // The prefix cache was emptied (prefix_cache refreshes it every block): drop cached state.
  virtual void on_reset() {}
};
// The method of each layer: builds one LayerAttention per (sequence, layer). A method is a spec
// `name[:key=value,...]`: dense; ba_att[:density=|top_kappa=|tau=, block=64, min_tokens=1024,
// beta=1, compensate=true]; quest[:budget=256, force_first=false, force_last=true];
// losa[:budget=256, k=4, threshold=, force_first=false, force_last=true].
struct AttentionPolicy {
  std::string method = "dense";            // every layer's, unless layer_methods names it
  std::vector<std::string> layer_methods;  // optional: layer l runs layer_methods[l] when not empty
  Backend backend = Backend::cpu;
  int num_threads = 0;
};
Result<std::unique_ptr<LayerAttention>> make_layer_attention(const AttentionPolicy& policy, int layer);
// "0,1,31=dense" entries into one method per layer ("" where the policy's method applies).
Status expand_layer_methods(const std::vector<std::string>& overrides, int n_layers,
                            std::vector<std::string>* layer_methods);

// ---- weights, sequence, state --------------------------------------------------------------
struct LayerWeights {
  Weight attn_norm, wq, wk, wv, wo;       // wq [heads*hd, dim], wk/wv [kv_heads*hd, dim], wo [dim, heads*hd]
  Weight q_norm, k_norm;                  // sdar: [head_dim]
  Weight ffn_norm, w_gate, w_up, w_down;  // w_gate/w_up [hidden, dim], w_down [dim, hidden]
};
struct Weights {
  Weight embed;  // [vocab, dim]
  std::vector<LayerWeights> layers;
  Weight final_norm;  // [dim]
  Weight lm_head;     // [vocab, dim]
};
// The tensors of each architecture, by their Hugging Face names (model_llada.cpp, model_sdar.cpp).
Result<Weights> load_llada_weights(const Config& c, const TensorStore& store, Ops& ops);
Result<Weights> load_sdar_weights(const Config& c, const TensorStore& store, Ops& ops);

// One request: its KV cache (one PagedKVCache per layer, the prefix of positions [0, length))
// and the per-layer attention state.
struct Sequence {
  std::vector<PagedKVCache> cache;
  std::vector<std::unique_ptr<LayerAttention>> attention;
  int64_t length() const { return cache.empty() ? 0 : cache[0].length(); }
};
Result<Sequence> make_sequence(const Config& c, const AttentionPolicy& policy);
Status reset_cache(const Config& c, Sequence& seq);  // empty caches, keep the attention objects

// Scratch activations for chunks of up to `capacity` tokens (grown on demand).
struct State {
  Ops* ops = nullptr;
  int64_t capacity = 0;
  float *x = nullptr, *xb = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr;
  float *hb = nullptr, *hb2 = nullptr, *logits = nullptr;
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State();
  void reserve(const Config& c, int64_t tokens);
};

struct ForwardOptions {
  int64_t block_causal = 0;  // inside the chunk (see AttentionCall)
  int64_t store_kv = 0;      // append the K/V of the chunk's first store_kv tokens to the cache
  int64_t logits_begin = 0;  // logits of chunk rows [logits_begin, logits_begin + logits_count)
  int64_t logits_count = 0;
  int step = -1;
};
// Runs the chunk `tokens` at positions [seq.length(), seq.length() + n) over the cached
// prefix; writes logits [logits_count, vocab] (host f32) when logits is not null.
Status forward_llada(const Config& c, const Weights& w, State& s, Sequence& seq, std::span<const int32_t> tokens,
                     const ForwardOptions& options, float* logits);
Status forward_sdar(const Config& c, const Weights& w, State& s, Sequence& seq, std::span<const int32_t> tokens,
                    const ForwardOptions& options, float* logits);

struct Model::Impl {
  std::string dir;
  Config config;
  LoadOptions options;
  TensorStore store;
  std::unique_ptr<Ops> ops;
  Weights weights;
  AttentionPolicy policy;
  int64_t parameters = 0;

  Status forward(State& s, Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o,
                 float* logits) const {
    return config.arch == Arch::llada ? forward_llada(config, weights, s, seq, tokens, o, logits)
                                      : forward_sdar(config, weights, s, seq, tokens, o, logits);
  }
};

// ---- the shared pieces of the loops (sampler.cpp) ------------------------------------------
struct Pick {
  int32_t token = 0;
  double confidence = 0;  // softmax probability of the token under the (unnoised) logits
};
// Argmax (temperature 0) or Gumbel-max at `temperature`; ban_eos sets EOS logits to -inf first.
Pick sample(const float* logits, int64_t vocab, double temperature, uint64_t* rng, const Config& c, bool ban_eos);
// LLaDA's schedule: `masks` tokens over `steps` steps, equal shares, the remainder to the first.
std::vector<int64_t> transfer_schedule(int64_t masks, int64_t steps);
// Indices (into conf) of the k largest confidences; ties to the lower index.
std::vector<int64_t> top_k(const std::vector<double>& conf, int64_t k);
bool is_eos(const Config& c, int32_t token);

// The loops (one file each): requests already validated by Model::generate.
Result<GenerateResult> generate_remask(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                       const GenerateOptions& o, const BlockCallback& cb);
Result<GenerateResult> generate_prefix_cache(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                             const GenerateOptions& o, const BlockCallback& cb);
Result<GenerateResult> generate_block(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                      const GenerateOptions& o, const BlockCallback& cb);

}  // namespace sparsa::dlm
