// sparsa/dlm.h — the diffusion-LM engine: load a Hugging Face model directory, run one
// forward pass over a canvas (logits), generate with one of three denoising loops, and the
// byte-level BPE tokenizer of tokenizer.json. docs/dlm.md is the guide.
//
// A model directory holds config.json, model.safetensors or model.safetensors.index.json
// plus its shards (F32, F16 or BF16), and usually tokenizer.json. Three architectures:
//   llada — LLaDA-8B and its family (model_type "llada"): MHA, fully bidirectional.
//   sdar  — SDAR / TraDo block diffusion (model_type "sdar", Qwen3 shape): GQA, per-head QK
//           RMSNorm, causal across blocks of block_size tokens, bidirectional inside one.
//   dream — Dream 7B and its family (model_type "Dream", Qwen2 shape: DiffuCoder, Dream-Coder):
//           GQA, QKV biases, fully bidirectional, logits shifted by one position.
// Every failure is a Status whose message names the file, field or tensor at fault.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsa/status.h"

namespace sparsa::dlm {

enum class Arch : uint8_t { llada, sdar, dream, fast_dllm };
const char* arch_name(Arch arch);

// RoPE as the config asks for it. rope_scaling {"rope_type"/"type": "linear", "factor": f}
// divides positions by f; "dynamic"/"ntk" multiplies theta by f^(d/(d-2)) (NTK-aware, fixed);
// absent, null or "default": plain RoPE. LongLLaDA-style variants change rope_theta itself.
struct RopeConfig {
  double theta = 10000.0;
  std::string scaling = "default";  // default | linear | ntk
  double factor = 1.0;
};

// The fields the engine runs on, named after the HF fields in the comments (llada / sdar).
struct Config {
  Arch arch = Arch::llada;
  int64_t dim = 0;          // d_model / hidden_size
  int64_t n_layers = 0;     // n_layers / num_hidden_layers
  int64_t n_heads = 0;      // n_heads / num_attention_heads
  int64_t n_kv_heads = 0;   // n_kv_heads (null: n_heads) / num_key_value_heads
  int64_t head_dim = 0;     // d_model / n_heads / head_dim (default hidden_size / heads)
  int64_t hidden_dim = 0;   // mlp_hidden_size / intermediate_size
  int64_t vocab_size = 0;   // embedding_size (else vocab_size) / vocab_size: rows of the embedding and the head
  double norm_eps = 1e-5;   // rms_norm_eps
  RopeConfig rope;          // rope_theta, rope_scaling
  int64_t max_seq_len = 0;  // max_sequence_length / max_position_embeddings
  int32_t mask_token_id = -1;
  std::vector<int32_t> eos_token_ids;  // eos_token_id (an id or a list); may be empty
  int64_t block_size = 0;              // sdar: block_size; fast_dllm: bd_size; llada, dream: 0 (no blocks)
  bool qk_norm = false;                // sdar: true (q_norm / k_norm per head)
  bool qkv_bias = false;               // dream, fast_dllm: true (q_proj / k_proj / v_proj biases)
  bool shifted_logits = false;         // dream, fast_dllm: true (position i is predicted from position i - 1's logits)
  bool tied_embeddings = false;        // weight_tying / tie_word_embeddings: the head is the embedding
};

// Parses and validates config.json's text; `where` prefixes messages ("DIR/config.json").
Result<Config> parse_config(const std::string& json_text, const std::string& where = "config.json");
// The block of a block-causal architecture (sdar, fast_dllm: causal across blocks of this many
// tokens, bidirectional inside one); 0 for the bidirectional ones (llada, dream).
inline int64_t block_causal_size(const Config& c) {
  return c.arch == Arch::sdar || c.arch == Arch::fast_dllm ? c.block_size : 0;
}

// The engine's compute backend for GEMMs and elementwise work: "cpu" (f32, OpenBLAS) or "cuda"
// / "cuda:N" (bf16 activations and weights with f32 accumulation, cuBLAS, one stream; docs/dlm.md).
// Capture of the attention inputs on the cpu backend (docs/dlm.md, "Capturing attention"): with
// `dir` set, each selected (request, layer, forward pass) writes DIR/r<R>-l<L>-f<F>.safetensors
// holding q [1, heads, n, head_dim] (RoPE applied), k and v [1, kv_heads, n, head_dim] (the
// chunk's own keys and values) and, when the chunk runs over a cached prefix, prefix_k and
// prefix_v [1, kv_heads, pos0, head_dim], all f32, with the call in __metadata__ (request,
// layer, forward, step, pos0, tokens, block_causal, method). A layer whose method built a block
// plan (ba_att) also writes that plan as DIR/r<R>-l<L>-f<F>-plan.safetensors, the index file
// `sparsa plan --index` writes, and names in the metadata the `sparsa plan` parameters that
// rebuild it from q and k. R counts the requests (sequences) the model has made, F the forward
// passes of request R (prefill chunks, denoising steps, commits).
struct AttentionDumpOptions {
  std::string dir;                // empty: no capture; created if missing, refused if not empty
  std::vector<int> layers;        // empty: every layer
  std::vector<int64_t> forwards;  // empty: every forward pass
  int64_t max_files = 256;        // tensor files written at most; the rest are counted only
};
struct AttentionDumpCounts {
  int64_t written = 0;  // tensor files (plans not counted)
  int64_t skipped = 0;  // selected beyond max_files
};

struct LoadOptions {
  std::string backend = "cpu";
  int num_threads = 0;  // attention threads on the CPU; 0 = all cores
  // Every layer's attention method, `name[:key=value,...]`: dense (exact), ba_att[:density=0.5 |
  // top_kappa=K | tau=T, block=64, min_tokens=1024, beta=1, compensate=true, sort=true] (the
  // chunk's own keys of bidirectional canvases of at least min_tokens), mean_pool[...] (BA-Att's
  // selector without sorts and compensation), xattention[..., stride=8] (cpu backend; the same
  // canvases), quest[:budget=256, force_first=false,
  // force_last=true] (the cached prefix), losa[:budget=256, k=4, threshold=X, ...] (the prefix on
  // a block's denoising steps; docs/dlm.md).
  std::string attention = "dense";
  // Per-layer overrides "LAYERS=METHOD", e.g. "0,1,31=dense".
  std::vector<std::string> attention_layers;
  // cuda, every layer dense: a denoising step that repeats (the same request, cached length and
  // chunk size; the tokens may differ) is captured into a CUDA graph the second time and replayed
  // after that, which removes the launch overhead of its few hundred kernels.
  bool cuda_graphs = true;
  // cuda: the GEMMs' kernel. "cublas": cuBLAS for every GEMM (the fastest in a denoising step on
  // the H200); "streaming": sparsa's weight-streaming kernel for chunks of up to 16 tokens
  // (docs/dlm.md says how it compares), cuBLAS for larger ones; "tuned": for chunks of up to 64
  // tokens, each product shape's kernel chosen by timing the first time it runs, among cuBLASLt's
  // algorithms and (up to 16 tokens) the weight-streaming kernel (a process keeps its choice;
  // another process may choose differently where two kernels time within noise, and then its
  // logits differ in rounding), cuBLAS for larger ones.
  std::string gemm = "cublas";
  AttentionDumpOptions dump_attention;
};

// The errors Model::load would give for options.attention and options.attention_layers on a
// model of this config and options.backend ("cpu", "cuda" or "cuda:N"), without weights or a
// device: a command that runs several methods checks them all before loading one model at a time.
Status check_attention(const Config& config, const LoadOptions& options);

// Denoising loops (one file each in engines/dlm/).
enum class Loop : uint8_t {
  remask,        // LLaDA: semi-autoregressive low-confidence remasking, full canvas every step
  prefix_cache,  // Fast-dLLM: prefix KV refreshed once per block, confidence-threshold decoding
  dual_cache,    // Fast-dLLM: prefix and suffix KV refreshed once per block, each step runs the block alone (cpu)
  block,         // block diffusion (SDAR): exact prefix KV cache, block by block
  dream,         // Dream: the whole canvas every step, Dream's timestep schedule (1 - s/t of the masks)
  fast_dllm,     // Fast-dLLM v2: exact block cache, sub-blocks decoded in turn, the next block's first token AR
};
const char* loop_name(Loop loop);
Result<Loop> parse_loop(const std::string& name);

// How sure the model is of a masked position's pick, which decides the positions a step commits:
// probability: the pick's softmax probability (LLaDA's low_confidence, Dream's maskgit_plus);
// margin: top-1 minus top-2 probability (Dream's topk_margin); entropy: minus the entropy of the
// position's distribution (Dream's entropy, its recommended choice).
enum class Confidence : uint8_t { probability, margin, entropy };
const char* confidence_name(Confidence c);
Result<Confidence> parse_confidence(const std::string& name);
// The loop's own choice: entropy for dream (Dream's recommended alg), probability for the rest.
Confidence default_confidence(Loop loop);

// How the block loop picks the positions a step commits (SDAR's remasking strategies):
// confidence: by GenerateOptions::confidence (with threshold > 0 SDAR's low_confidence_dynamic,
// with 0 its low_confidence_static); sequential: the step's scheduled count of masked positions,
// left to right; entropy_bounded: the masked positions of lowest entropy (of the pick's
// distribution, as the entropy confidence) while the running sum of their entropies stays below
// eb_threshold, at least one.
enum class Unmask : uint8_t { confidence, sequential, entropy_bounded };
const char* unmask_name(Unmask u);
Result<Unmask> parse_unmask(const std::string& name);

struct GenerateOptions {
  Loop loop = Loop::remask;  // Model::default_loop(): remask for llada, block for sdar
  int64_t gen_len = 128;     // tokens generated after the prompt
  int64_t block_len = 32;    // remask / prefix_cache: tokens per block (gen_len a multiple of it);
                             // block: ignored, the model's block_size rules
  int64_t steps = 128;       // remask: total steps (a multiple of gen_len / block_len; unused with a threshold);
                             // prefix_cache: the same schedule when threshold is 0;
                             // block: steps per block
  double threshold = 0;      // > 0: commit every masked token of the block whose confidence is
                             // >= threshold (remask, prefix_cache: and at least the most confident
                             // one, Fast-dLLM; block: > threshold, and at least the step's scheduled
                             // count, SDAR's low_confidence_dynamic; fast_dllm: > threshold, and
                             // the most confident of the sub-block); 0: the scheduled top-k
                             // (fast_dllm: the most confident only, its generate()'s default)
  double factor = 0;         // remask, prefix_cache, dual_cache, > 0: Fast-dLLM's factor rule instead (its
                             // get_transfer_index_dynamic): with the block's confidences sorted,
                             // c_0 >= c_1 >= ..., the count is the first i > 0 with c_i < 1 - factor /
                             // (i + 2) (the last index if none), plus one when that is the last
                             // index (as Fast-dLLM counts); probability confidence, no threshold
  double temperature = 0;    // 0: argmax; > 0: Gumbel-max sampling at this temperature
  Confidence confidence = Confidence::probability;  // margin / entropy: of softmax(logits / temperature)
  double top_p = 1.0;        // < 1: a pick only among the most probable tokens holding this mass (Dream's top_p)
  int64_t top_k = 0;         // > 0: a pick only among the k largest logits (Dream's top_k; after top_p)
  Unmask unmask = Unmask::confidence;  // block loop: how a step picks its positions (others: confidence)
  double eb_threshold = 0.35;  // unmask entropy_bounded: the bound on the committed entropies' sum (SDAR's default)
  int64_t sub_block = 8;     // fast_dllm loop: the sub-blocks decoded in turn inside a block (its small_block_size)
  double alg_temp = 0;       // dream loop, > 0: a step's positions drawn at random, without replacement, with
                             // weights softmax(confidence / alg_temp) (Dream's alg_temp); 0: the most confident
  uint64_t seed = 0;
  bool stop_at_eos = true;       // after a block holding an EOS is done, stop; the output ends before the EOS
  bool ban_eos = false;          // EOS logits set to -inf before sampling (LLaDA's logits_eos_inf)
  std::vector<int32_t> eos_ids;  // when not empty, the EOS ids instead of config.json's eos_token_id
                                 // (e.g. LLaDA-Instruct's EOS 126081 and EoT 126348)
};

struct GenerateResult {
  std::vector<std::vector<int32_t>> tokens;  // per request: the generated ids (after the prompt)
  int64_t forward_tokens = 0;                // tokens pushed through the model (all requests)
  int64_t reused_tokens = 0;                 // prompt tokens whose K/V came from a PromptCache
  int64_t steps = 0;                         // forward passes (all requests)
  double seconds = 0;
  // cpu backend: the wall time spent inside the layers' attention (selection, executors,
  // merges; -1 where not measured: the cuda backend's kernels run asynchronously).
  double attention_seconds = -1;
};

// Called when a block of a request is final: the request, its generated ids so far.
using BlockCallback = std::function<void(size_t request, std::span<const int32_t> generated)>;

// The K/V of whole blocks kept from one generate() call to the next, for a conversation: the
// block and fast_dllm loops (block-causal models), one request a call, the cpu backend. A call
// reuses the longest run of leading blocks whose tokens equal its prompt's (the last call's prompt
// and output, as a chat's next turn starts), prefills only the prompt's blocks after them, and
// leaves the blocks it ends with in the cache. Under dense attention the result is the same as
// without the cache (a block's K/V depend only on its tokens and those before it); under a sparse
// method the reused K/V are those the last call computed. `sparsa chat` keeps one across turns.
class PromptCache {
 public:
  PromptCache();
  PromptCache(PromptCache&&) noexcept;
  PromptCache& operator=(PromptCache&&) noexcept;
  ~PromptCache();
  int64_t tokens() const;       // positions whose K/V it holds (whole blocks)
  int64_t last_reused() const;  // prompt tokens the last call that took it reused
  void clear();

  struct State;
  State& state() { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

class Model {
 public:
  static Result<Model> load(const std::string& dir, const LoadOptions& options = {});
  // A model of this shape with random weights made by the backend itself (uniform in
  // ±1/sqrt(fan-in), norms 1), for benchmarks and smoke tests: the engine's speed does not
  // depend on the weights. weight_dtypes() is "" (no files).
  static Result<Model> random(const Config& config, const LoadOptions& options = {}, uint64_t seed = 0);
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const Config& config() const;
  const std::string& dir() const;
  Loop default_loop() const;
  int64_t parameter_count() const;
  std::string weight_dtypes() const;  // "bf16", "f32", "bf16+f32", ...
  // The attention capture so far (LoadOptions::dump_attention; zeros without one).
  AttentionDumpCounts attention_dump_counts() const;

  // One forward pass over the canvas `ids` with the architecture's own attention pattern
  // (bidirectional for llada, block-causal with block_size for sdar): f32 [len, vocab_size].
  // cached > 0: ids[0, cached) run first into the KV cache (one pass, which for llada sees only
  // itself), then ids[cached, len) over that cache, as the loops' cached steps do: the logits of
  // those len - cached rows (sdar: cached a multiple of block_size).
  Result<std::vector<float>> logits(std::span<const int32_t> ids, int64_t cached = 0) const;

  // A batch of requests (each its own prompt and KV cache) through the chosen loop. cache (see
  // PromptCache): one request, the block or fast_dllm loop, the cpu backend; refused otherwise.
  Result<GenerateResult> generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
                                  const BlockCallback& on_block = {}, PromptCache* cache = nullptr) const;

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Hugging Face tokenizer.json, byte-level BPE (GPT-2 / Qwen / Llama-3 style pre-tokenizers).
class Tokenizer {
 public:
  static Result<Tokenizer> load(const std::string& path);
  static Result<Tokenizer> parse(const std::string& json_text, const std::string& where = "tokenizer.json");
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(const std::string& text) const;
  // Ids outside the vocabulary are refused; skip_special drops added tokens marked special.
  Result<std::string> decode(std::span<const int32_t> ids, bool skip_special = false) const;
  int64_t vocab_size() const;  // largest id + 1

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  static Result<Tokenizer> parse_json(const std::string& json_text, const std::string& where);
  std::unique_ptr<Impl> impl_;
};

// A model's chat template (docs/dlm.md, "Chat templates"): the Jinja template a Hugging Face
// tokenizer carries, rendered by sparsa's own interpreter of the part of Jinja chat templates use,
// as transformers' apply_chat_template renders it. Instruct and chat models expect their prompts
// in this form.
struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

class ChatTemplate {
 public:
  // The template of a model directory: DIR/chat_template.jinja if present, else
  // tokenizer_config.json's "chat_template" (a string, or a list of {name, template}: the one
  // named "default"), else chat_template.json's; the special tokens (bos_token, eos_token, ...)
  // from tokenizer_config.json. A directory without one is an error saying so. template_path, if
  // given, is a .jinja file used instead of the directory's template (model_dir may then be "":
  // no special tokens).
  static Result<ChatTemplate> load(const std::string& model_dir, const std::string& template_path = "");
  // A template's text; special_tokens_json: a JSON object of the variables every render gets
  // (e.g. {"bos_token": "<s>"}).
  static Result<ChatTemplate> parse(const std::string& source, const std::string& special_tokens_json = "{}",
                                    const std::string& where = "chat template");
  ChatTemplate(const ChatTemplate&);
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  // The prompt for `messages`; add_generation_prompt opens the assistant's turn; extra_json: a
  // JSON object of more variables (e.g. {"enable_thinking": false}), which win over the others.
  Result<std::string> render(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true,
                             const std::string& extra_json = "{}") const;
  // The whole context as a JSON object ({"messages": [...], "tools": [...], ...}), for messages
  // with more than a role and a text; the special tokens, tools = documents = null and
  // add_generation_prompt = true are filled in where it leaves them out.
  Result<std::string> render_json(const std::string& context_json) const;
  const std::string& source() const;

  struct Impl;

 private:
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsa::dlm
