// The engine's internal pieces (llama2.c style): the mapped tensor files, Weights, the compute
// backend seam (Ops), the per-layer attention interface, a Sequence (one request: its KV cache
// and per-layer attention state), the State (scratch activations) and the forwards.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/device_losa.h"
#include "sparsa/dlm.h"
#include "sparsa/index.h"
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
// Everything the forwards compute besides attention. Buffers are the backend's memory: the
// residual stream is f32 everywhere; every other activation (the normed rows, q/k/v, attention
// output, the MLP's hidden rows) is in the backend's act_dtype(): f32 on the CPU (weights
// converted to f32 once at load, f32 files stay views of the mapping, GEMMs through OpenBLAS),
// bf16 on CUDA (weights uploaded as bf16, GEMMs through cuBLAS with f32 accumulation, small
// kernels for the rest, everything ordered on the backend's one stream).
struct Pick {
  int32_t token = 0;
  double confidence = 0;  // softmax probability of the token under the (unnoised) logits
};

struct Weight {
  const void* data = nullptr;  // [rows, cols] row-major, backend memory
  DType dtype = DType::f32;    // CPU: f32; CUDA: bf16 (matrices), f32 (norm vectors)
  int64_t rows = 0, cols = 0;
  template <class T>
  const T* ptr() const { return static_cast<const T*>(data); }
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual const char* name() const = 0;
  virtual Device device() const = 0;
  virtual DType act_dtype() const = 0;
  virtual void* stream() const { return nullptr; }  // CUDA: the cudaStream_t of every call
  // The matrix stacking `parts` by rows (one part: the tensor itself; CPU f32: a view when the file
  // is f32 already). Host views of the mapped files, all with the same number of columns.
  virtual Result<Weight> prepare(std::span<const Tensor> parts) = 0;
  // A norm's weight [dim] (kept in f32 on every backend).
  virtual Result<Weight> prepare_vector(const Tensor& part) = 0;
  // Random weights made by the backend itself (benchmarks: the engine does not care what the
  // weights are): a [rows, cols] matrix uniform in [-scale, scale), and a norm's weight of `dim`
  // copies of `value`.
  virtual Result<Weight> random(int64_t rows, int64_t cols, double scale, uint64_t seed) = 0;
  virtual Result<Weight> constant_vector(int64_t dim, float value) = 0;
  virtual void* alloc(int64_t elements, DType dtype) = 0;  // zeroed scratch, released by free()
  virtual void free(void* p) = 0;
  // y[n, w.rows] = x[n, w.cols] · wᵀ (act -> act).
  virtual void matmul(void* y, const void* x, int64_t n, const Weight& w) = 0;
  // The residual update r[n, w.rows] += x[n, w.cols] · wᵀ (r f32).
  virtual void matmul_add(float* r, const void* x, int64_t n, const Weight& w) = 0;
  // y[n, w.rows] = x · wᵀ into f32 (the logits).
  virtual void matmul_f32(float* y, const void* x, int64_t n, const Weight& w) = 0;
  // out[rows, dim] (act) = x / rms(x) * weight, x f32 [rows, dim].
  virtual void rms_norm(void* out, const float* x, const Weight& weight, int64_t rows, int64_t dim, double eps) = 0;
  // The same over every head of an act matrix, in place: row t's head h is x[t * row_stride +
  // h * head_dim, + head_dim) (sdar's q_norm / k_norm).
  virtual void head_norm(void* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, const Weight& weight,
                         double eps) = 0;
  // The heads of x (laid out as in head_norm) rotated in place, NeoX (rotate-half) pairing,
  // positions pos0 + t.
  virtual void rope(void* x, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t pos0,
                    const RopeConfig& rope) = 0;
  // h[n, hidden] = silu(gu[:, :hidden]) * gu[:, hidden:], gu [n, 2 * hidden] (act).
  virtual void swiglu(void* h, const void* gu, int64_t n, int64_t hidden) = 0;
  // x[t, col0 + i] += bias[i] for rows t < n of an act matrix with row_stride columns (dream's
  // q / k / v biases). false: this backend does not have it (the forward refuses the model).
  virtual bool add_bias(void* x, int64_t n, int64_t row_stride, int64_t col0, const Weight& bias) { return false; }
  // x[n, dim] (f32) = rows `tokens` of the table.
  virtual void embed(float* x, const Weight& table, std::span<const int32_t> tokens) = 0;
  // dst[count] (host) = src[count] (backend f32): the sampler's read-back.
  virtual void to_host(float* dst, const float* src, int64_t count) = 0;
  // `rows` rows of row_bytes each from src (src_stride bytes apart) to dst, packed: backend memory
  // to backend memory, ordered with the other calls (the dual cache's suffix on a device). false:
  // this backend does not have it (the cpu keeps its suffix in a host cache instead).
  virtual bool copy_rows(void* dst, const void* src, int64_t rows, int64_t row_bytes, int64_t src_stride) {
    return false;
  }
  // The greedy sampler where the logits are (temperature 0): per row of logits [rows, vocab]
  // (backend f32) the argmax, lowest index on ties, skipping `banned` ids, and its softmax
  // probability without them, as sample() computes it on the host; only the picks come back.
  // false: this backend leaves sampling to the host (read the logits back).
  virtual bool greedy(const float* logits, int64_t rows, int64_t vocab, std::span<const int32_t> banned,
                      Pick* picks) {
    return false;
  }
  // The first error any call since the last check met (CUDA: launches and cuBLAS), then cleared.
  virtual Status check() { return Status::Ok(); }
  // Graphs of whole forwards (CUDA graphs): begin_capture() before a forward's calls and
  // end_capture() after them record the calls instead of running them and return the graph (null
  // when the backend has none or the capture failed: the caller runs eagerly; the failure is
  // cleared). replay() runs one; stage_tokens() sets the tokens its embedding reads (the staging
  // a captured embed() copies from).
  virtual bool begin_capture() { return false; }
  virtual std::shared_ptr<void> end_capture() { return nullptr; }
  virtual void replay(const std::shared_ptr<void>& graph) {}
  virtual void stage_tokens(std::span<const int32_t> tokens) {}
};
std::unique_ptr<Ops> make_cpu_ops();
// The CUDA backend's GEMMs: cublas = cuBLAS for every product (the default); streaming = sparsa's
// weight-streaming kernel (cuda/skinny_gemm.h) for chunks of up to 16 rows, cuBLAS above; tuned =
// for chunks of up to 64 rows, each shape's kernel chosen by timing on first use among cuBLASLt's
// algorithms and (up to 16 rows) the weight-streaming kernel (cuda/lt_gemm.h), cuBLAS above.
enum class GemmChoice : uint8_t { cublas, streaming, tuned };
Result<GemmChoice> parse_gemm_choice(const std::string& name);
// CUDA (a build with the cuda backend; otherwise the error says so). `device` is the CUDA device.
Result<std::unique_ptr<Ops>> make_cuda_ops(int device, const Config& c, GemmChoice gemm);

// ---- attention ----------------------------------------------------------------------------
// Attention of one layer over one chunk of consecutive tokens at positions [pos0, pos0 + n):
// the chunk's queries see the prefix (cached keys of positions [0, pos0), all visible) and the
// chunk's own keys under `block_causal` (0: all visible; b > 0: key j visible to query i when
// j / b <= i / b in absolute positions, pos0 a multiple of b). The model code calls only this;
// which method runs (dense now; ba_att, quest, losa next) is the LayerAttention behind it.
struct AttentionCall {
  int layer = 0;
  int64_t pos0 = 0;
  Tensor q;     // act dtype [1, heads_q, n, head_dim] on the backend's device, RoPE applied (strided views)
  Tensor k, v;  // [1, heads_kv, n, head_dim]: the chunk's own keys and values
  // The cached prefix, positions [0, pos0): its K/V as [1, heads_kv, pos0, head_dim] views on the
  // backend's device (undefined when pos0 is 0), and the cache itself for the methods that read
  // its pages (CPU: prefix; CUDA: device_prefix, whose sequence device_seq this request is).
  Tensor prefix_k, prefix_v;
  // The dual cache's suffix (ForwardOptions::with_suffix; cpu): the K/V of positions after the
  // chunk, kept by an earlier forward, which every query also sees (undefined: none).
  Tensor suffix_k, suffix_v;
  const PagedKVCache* prefix = nullptr;
  const DevicePagedKVCache* device_prefix = nullptr;
  int device_seq = 0;
  int64_t block_causal = 0;
  Tensor out;     // like q
  int step = -1;  // denoising step inside the current block (0 = first); -1: prefill, commit, logits
};

// The block plan a method built for a call, for the attention capture: the plan, and the
// `sparsa plan` method and parameters ("kappa=2 block=4 ...") that rebuild it from the call's q, k.
struct CallPlan {
  BlockIndexBuffer plan;
  std::string method, params;
};

class LayerAttention {
 public:
  virtual ~LayerAttention() = default;
  virtual Status forward(const AttentionCall& call) = 0;
  // The block plan forward(call) ran over, where its method builds one (ba_att); nullopt
  // otherwise. Called after forward with the same call; recomputes it (selection is deterministic).
  virtual Result<std::optional<CallPlan>> plan_of(const AttentionCall& call) {
    (void)call;
    return std::optional<CallPlan>{};
  }
  // Where a method steps several sequences together (QUEST and LoSA on the cuda backend), the
  // state its sequences' objects share for one layer (nullptr: none). attend() hands the calls of
  // a forward's chunks whose objects share one to forward_batch at once.
  virtual const void* batch_state() const { return nullptr; }
  // members[i]'s call calls[i], for members sharing this object's batch_state (this among them);
  // the default runs each member's forward.
  virtual Status forward_batch(std::span<LayerAttention* const> members, std::span<const AttentionCall> calls) {
    for (size_t i = 0; i < members.size(); ++i) SPARSA_RETURN_IF_ERROR(members[i]->forward(calls[i]));
    return Status::Ok();
  }
  // Whether forward() also attends over call.suffix_k / suffix_v (the dual cache's suffix); a
  // method that does not is refused such calls by name.
  virtual bool takes_suffix() const { return false; }
  // The chunk's K/V were appended to the prefix cache (a block was committed).
  virtual void on_commit() {}
  // The prefix cache was emptied (prefix_cache refreshes it every block): drop cached state.
  virtual void on_reset() {}
};
// The method of each layer: builds one LayerAttention per (sequence, layer). A method is a spec
// `name[:key=value,...]`: dense; ba_att[:density=|top_kappa=|tau=, block=B, min_tokens=1024,
// beta=1, compensate=true, sort=true | sort_q=, sort_k=]; mean_pool[:density=|top_kappa=|tau=,
// block=B, min_tokens=1024]; xattention[:density=|..., block=B, min_tokens=1024, stride=8,
// force_first=true, force_diagonal=true] (cpu); quest[:budget=256, force_first=false,
// force_last=true]; losa[:budget=256, k=4, threshold=, force_first=false, force_last=true].
// B (both sides of a block) defaults to canvas_block_default(policy.backend): 128 on the cuda
// backend, whose block-sparse executor runs tiles of 128 query rows by 128 keys (a 64-token block
// fills half of each; docs/dlm.md gives the measurement), 64 on the cpu.
int64_t canvas_block_default(Backend backend);
class AttentionRecorder;  // attention_recorder.cpp: attention time and the capture (cpu backend)
struct AttentionPolicy {
  std::string method = "dense";            // every layer's, unless layer_methods names it
  std::vector<std::string> layer_methods;  // optional: layer l runs layer_methods[l] when not empty
  Backend backend = Backend::cpu;
  int num_threads = 0;
  int device = 0;           // cuda: the device
  void* stream = nullptr;   // cuda: the engine's stream
  // cpu: times every layer's attention and writes the capture (LoadOptions::dump_attention).
  std::shared_ptr<AttentionRecorder> recorder;
};
// request >= 0 (a sequence's layers): wrapped by the policy's recorder, if any, as that request.
Result<std::unique_ptr<LayerAttention>> make_layer_attention(const AttentionPolicy& policy, int layer,
                                                             int request = -1);
// Layer `layer`'s methods for a batch of sequences made together (make_sequences), one per
// request; on the cuda backend QUEST and LoSA objects share one device state, sequence i being
// its entry i (at most kDeviceLosaMaxBatch sequences).
Result<std::vector<std::unique_ptr<LayerAttention>>> make_layer_attentions(const AttentionPolicy& policy, int layer,
                                                                           std::span<const int> requests);
// "0,1,31=dense" entries into one method per layer ("" where the policy's method applies).
Status expand_layer_methods(const std::vector<std::string>& overrides, int n_layers,
                            std::vector<std::string>* layer_methods);

// The attention recorder of the cpu backend: the wall time inside every layer's attention, and
// the capture of LoadOptions::dump_attention (whose options it validates).
class AttentionRecorder {
 public:
  static Result<std::shared_ptr<AttentionRecorder>> create(const AttentionDumpOptions& dump, int n_layers);
  // A new request's id (0, 1, ...), for the capture's file names.
  int new_request() { return requests_.fetch_add(1); }
  // `inner` wrapped: timed, and captured where selected.
  std::unique_ptr<LayerAttention> wrap(std::unique_ptr<LayerAttention> inner, int layer, int request,
                                       std::string method);
  double attention_seconds() const { return seconds_.load(); }
  void reset_seconds() { seconds_ = 0; }
  AttentionDumpCounts counts() const { return {written_.load(), skipped_.load()}; }

 private:
  friend class RecordedAttention;
  bool selected(int layer, int64_t forward) const;
  Status capture(const AttentionCall& call, LayerAttention& inner, int request, int64_t forward,
                 const std::string& method);
  Status write_capture(const AttentionCall& call, LayerAttention& inner, int request, int64_t forward,
                       const std::string& method);

  // Atomic: one Model may generate on several threads (each call has its own sequences).
  AttentionDumpOptions dump_;
  std::atomic<int> requests_{0};
  std::atomic<double> seconds_{0};
  std::atomic<int64_t> written_{0}, skipped_{0};
};

// ---- weights, sequence, state --------------------------------------------------------------
// The projections of one layer are stacked so that each is one GEMM: wqkv = [q; k; v] rows
// [heads*hd + 2*kv_heads*hd, dim], w_gate_up = [gate; up] rows [2*hidden, dim].
struct LayerWeights {
  Weight attn_norm, wqkv, wo;   // wo [dim, heads*hd]
  Weight q_norm, k_norm;        // sdar: [head_dim]
  Weight q_bias, k_bias, v_bias;  // dream: [heads*hd], [kv_heads*hd], [kv_heads*hd]
  Weight ffn_norm, w_gate_up, w_down;  // w_down [dim, hidden]
};
struct Weights {
  Weight embed;  // [vocab, dim]
  std::vector<LayerWeights> layers;
  Weight final_norm;  // [dim]
  Weight lm_head;     // [vocab, dim]
};
// Where the loaders take each weight from: the model's files (by their Hugging Face names,
// each tensor checked against its shape) or random weights made by the backend.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The matrices `names` (each [rows[i], cols]) stacked by rows.
  virtual Result<Weight> matrix(std::span<const std::string> names, std::span<const int64_t> rows, int64_t cols) = 0;
  virtual Result<Weight> vector(const std::string& name, int64_t dim) = 0;
  Result<Weight> matrix(const std::string& name, int64_t rows, int64_t cols) {
    return matrix(std::span<const std::string>(&name, 1), std::span<const int64_t>(&rows, 1), cols);
  }
};
std::unique_ptr<WeightSource> file_weights(const TensorStore& store, Ops& ops);
std::unique_ptr<WeightSource> random_weights(Ops& ops, uint64_t seed);
// The tensors of each architecture (model_llada.cpp, model_sdar.cpp).
Result<Weights> load_llada_weights(const Config& c, WeightSource& source);
Result<Weights> load_qwen_weights(const Config& c, WeightSource& source);  // sdar, dream

// One request: its KV cache of the prefix of positions [0, length) (one cache per layer: CPU
// PagedKVCache, or on CUDA a DevicePagedKVCache per layer shared by the sequences made together,
// this one being its sequence device_seq) and the per-layer attention state.
struct Sequence {
  std::vector<PagedKVCache> cache;
  std::vector<PagedKVCache> suffix;  // per layer (cpu): the dual cache's suffix (ForwardOptions::keep_suffix_from)
  // The same on the cuda backend, per layer: the suffix's K and V rows [len, kv_heads * head_dim]
  // (the act dtype) in device memory, grown only.
  struct DeviceSuffix {
    DeviceArray k, v;
    int64_t len = 0;
  };
  std::vector<DeviceSuffix> device_suffix;
  std::shared_ptr<std::vector<DevicePagedKVCache>> device_cache;
  int device_seq = 0;
  std::vector<std::unique_ptr<LayerAttention>> attention;
  int64_t length() const;
};
// A sequence whose caches hold up to max_tokens tokens (the CUDA caches reserve them up front;
// 0: no cache, for forwards that store nothing).
Result<Sequence> make_sequence(const Config& c, const AttentionPolicy& policy, int64_t max_tokens);
// Sequences decoded together, sequence i holding up to max_tokens[i] tokens: on the cuda backend
// each group of up to kDeviceLosaMaxBatch shares one device cache per layer and the layer
// methods' batched state (make_layer_attentions), so that a batched forward steps the group's
// chunks in one launch sequence per layer. On the cpu the sequences share nothing.
Result<std::vector<Sequence>> make_sequences(const Config& c, const AttentionPolicy& policy,
                                             std::span<const int64_t> max_tokens);
Status reset_cache(const Config& c, Sequence& seq);  // empty caches, keep the attention objects

// Scratch activations for chunks of up to `capacity` tokens (grown on demand): x the f32
// residual stream [n, dim]; the rest in the backend's act dtype: xb [n, dim] (normed rows),
// qkv [n, heads*hd + 2*kv_heads*hd], att [n, heads*hd], gu [n, 2*hidden], h [n, hidden]; logits
// f32 [logit_rows, vocab].
// The graphs of a State's recent forwards, by what a forward's recorded calls depend on: the
// sequence and its cached length (the prefix views, RoPE's positions), the chunk's size and the
// options, the State's buffers. Only the tokens change between replays.
struct GraphKey {
  const void* seq = nullptr;
  int64_t pos0 = -1, n = 0, logits_begin = 0, logits_count = 0, block_causal = 0, capacity = 0;
  const void* x = nullptr;
  const void* logits = nullptr;
  bool operator==(const GraphKey&) const = default;
};
struct GraphCache {
  static constexpr size_t kMax = 8;
  std::vector<std::pair<GraphKey, std::shared_ptr<void>>> graphs;  // most recent last
  GraphKey last_eager;  // a forward seen twice in a row is captured the second time
};

struct State {
  Ops* ops = nullptr;
  int64_t capacity = 0, logit_rows = 0;
  float* x = nullptr;
  void *xb = nullptr, *qkv = nullptr, *att = nullptr, *gu = nullptr, *h = nullptr;
  float* logits = nullptr;
  GraphCache graphs;
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State();
  void reserve(const Config& c, int64_t tokens, int64_t logit_rows);
};

struct ForwardOptions {
  int64_t block_causal = 0;  // inside the chunk (see AttentionCall)
  int64_t store_kv = 0;      // append the K/V of the chunk's first store_kv tokens to the cache
  int64_t logits_begin = 0;  // logits of chunk rows [logits_begin, logits_begin + logits_count)
  int64_t logits_count = 0;
  int step = -1;
  // The dual cache: >= 0: the K/V of the chunk's rows [keep_suffix_from, n) replace the
  // sequence's suffix; with_suffix: the chunk's queries also see that suffix (the positions after
  // the chunk, whose K/V an earlier forward kept), so a step can run a block alone.
  int64_t keep_suffix_from = -1;
  bool with_suffix = false;
};
// One request's part of a forward: the chunk `tokens` at positions [seq->length(),
// seq->length() + n) of its own sequence, over that sequence's cached prefix, with its options.
// A forward runs one chunk or a batch of them (requests decoded together): every layer's GEMMs,
// norms and MLP over all the chunks' rows at once, RoPE and attention per chunk.
struct Chunk {
  Sequence* seq = nullptr;
  std::span<const int32_t> tokens;
  ForwardOptions options;
};
// The logits of every chunk's requested rows, chunk after chunk, are left in s.logits (backend
// f32 [sum of logits_count, vocab]) and also read back to `logits` (host) when it is not null.
Status forward_llada(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks, float* logits);
Status forward_sdar(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks, float* logits);
Status forward_dream(const Config& c, const Weights& w, State& s, std::span<const Chunk> chunks, float* logits);

// A process-unique id for each model made (Model::Impl::id).
uint64_t next_model_id();

struct Model::Impl {
  const uint64_t id = next_model_id();  // whose K/V a PromptCache holds
  std::string dir;
  Config config;
  LoadOptions options;
  TensorStore store;  // empty for Model::random
  std::unique_ptr<Ops> ops;
  Weights weights;
  AttentionPolicy policy;
  int64_t parameters = 0;

  bool graphs = false;  // forwards that store no K/V are replayed from CUDA graphs (model.cpp)

  Status forward_eager(State& s, std::span<const Chunk> chunks, float* logits) const {
    switch (config.arch) {
      case Arch::llada: return forward_llada(config, weights, s, chunks, logits);
      case Arch::sdar: return forward_sdar(config, weights, s, chunks, logits);
      case Arch::dream:  // fast_dllm: dream's layers, block-causal through its loop's chunks
      case Arch::fast_dllm: return forward_dream(config, weights, s, chunks, logits);
    }
    return invalid_argument("config: unknown architecture");
  }
  Status forward_eager(State& s, Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o,
                       float* logits) const {
    const Chunk one{&seq, tokens, o};
    return forward_eager(s, std::span<const Chunk>(&one, 1), logits);
  }
  // forward_eager, or the replay of its graph (model.cpp).
  Status forward(State& s, Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o,
                 float* logits) const;
  // A batch of chunks: one chunk as forward() above (graphs), more eagerly.
  Status forward(State& s, std::span<const Chunk> chunks, float* logits) const {
    if (chunks.size() == 1) return forward(s, *chunks[0].seq, chunks[0].tokens, chunks[0].options, logits);
    return forward_eager(s, chunks, logits);
  }
};

// ---- the shared pieces of the loops (sampler.cpp) ------------------------------------------
// The tokens a position may take under the options' filters (1 = allowed): every token but
// EOS when banned, narrowed by top_p (the most probable tokens of softmax(logits / T), T = 0: of
// the logits, while the mass before them is <= top_p; ties by the lower id) and then top_k (the
// k largest logits, ties with the k-th kept), as Dream's sample_tokens filters. Empty when no
// filter is on: every unbanned token.
std::vector<char> allowed_tokens(const float* logits, int64_t vocab, const GenerateOptions& o, const Config& c);
// Argmax (temperature 0) or Gumbel-max at o.temperature among the allowed tokens; confidence: the
// pick's softmax probability among them (of the unscaled logits, as LLaDA).
Pick sample(const float* logits, int64_t vocab, const GenerateOptions& o, std::span<const char> allowed,
            uint64_t* rng, const Config& c);
// A position's confidence of kind o.confidence (margin or entropy; probability: the top one) from
// its logits row: of softmax(logits / temperature) (temperature 0: of softmax(logits)) among the
// allowed tokens.
double confidence_of(const float* logits, int64_t vocab, const GenerateOptions& o, std::span<const char> allowed,
                     const Config& c);
// LLaDA's schedule: `masks` tokens over `steps` steps, equal shares, the remainder to the first.
std::vector<int64_t> transfer_schedule(int64_t masks, int64_t steps);
// Indices (into conf) of the k largest confidences; ties to the lower index.
std::vector<int64_t> top_k(const std::vector<double>& conf, int64_t k);
// k indices drawn without replacement with weights softmax(conf / temperature) (Dream's
// multinomial over positions at alg_temp), as the k largest of conf / temperature plus a Gumbel
// draw each (the Gumbel-top-k identity; one draw per entry, in order, from rng).
std::vector<int64_t> sample_k(const std::vector<double>& conf, int64_t k, double temperature, uint64_t* rng);
bool is_eos(const Config& c, int32_t token);

// What a PromptCache holds: the K/V of its `tokens` (whole blocks) per layer, made by the model
// with id `model`.
struct PromptCache::State {
  uint64_t model = 0;
  std::vector<int32_t> tokens;
  std::vector<PagedKVCache> layers;
  int64_t last_reused = 0;
};
// The prompt cache in a loop (model_common.cpp). reuse_prompt_cache: copies into the empty cpu
// sequence `seq` the K/V of the longest run of the cache's leading whole blocks (of block_size
// tokens) whose tokens equal the prompt's, at most max_blocks of them; returns the tokens reused
// (0 when the cache holds another model's; an error only if emptying seq's caches after a failed
// copy fails). keep_prompt_cache: the cache takes seq's K/V and the canvas tokens they are of.
Result<int64_t> reuse_prompt_cache(const Model::Impl& m, const PromptCache::State& cache,
                                   std::span<const int32_t> prompt, int64_t max_blocks, Sequence& seq);
void keep_prompt_cache(const Model::Impl& m, PromptCache::State& cache, std::span<const int32_t> canvas, Sequence& seq);

// The loops (one file each): requests already validated by Model::generate.
Result<GenerateResult> generate_remask(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                       const GenerateOptions& o, const BlockCallback& cb);
Result<GenerateResult> generate_prefix_cache(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                             const GenerateOptions& o, const BlockCallback& cb);
Result<GenerateResult> generate_block(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                      const GenerateOptions& o, const BlockCallback& cb, PromptCache* cache);
Result<GenerateResult> generate_fast_dllm(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                          const GenerateOptions& o, const BlockCallback& cb, PromptCache* cache);
Result<GenerateResult> generate_dream(const Model::Impl& m, const std::vector<std::vector<int32_t>>& prompts,
                                      const GenerateOptions& o, const BlockCallback& cb);

}  // namespace sparsa::dlm
