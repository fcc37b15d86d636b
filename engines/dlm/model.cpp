// Model: load a model directory (config.json, the tensor files), logits of one canvas, and
// generate (validation of the requests, then the chosen loop).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "engine.h"
#include "model_common.h"
#include "sparsa/io.h"

namespace sparsa::dlm {

const char* loop_name(Loop loop) {
  switch (loop) {
    case Loop::remask:
      return "remask";
    case Loop::prefix_cache:
      return "prefix_cache";
    case Loop::dual_cache:
      return "dual_cache";
    case Loop::block:
      return "block";
    case Loop::dream:
      return "dream";
    case Loop::fast_dllm:
      return "fast_dllm";
  }
  return "?";
}

Result<Loop> parse_loop(const std::string& name) {
  if (name == "remask") return Loop::remask;
  if (name == "prefix_cache") return Loop::prefix_cache;
  if (name == "dual_cache") return Loop::dual_cache;
  if (name == "block") return Loop::block;
  if (name == "dream") return Loop::dream;
  if (name == "fast_dllm") return Loop::fast_dllm;
  return invalid_argument("loop: expected remask, prefix_cache, dual_cache, block, dream or fast_dllm, got '" + name +
                          "'");
}

const char* confidence_name(Confidence c) {
  switch (c) {
    case Confidence::probability: return "probability";
    case Confidence::margin: return "margin";
    case Confidence::entropy: return "entropy";
  }
  return "?";
}

Confidence default_confidence(Loop loop) { return loop == Loop::dream ? Confidence::entropy : Confidence::probability; }

Result<Confidence> parse_confidence(const std::string& name) {
  if (name == "probability") return Confidence::probability;
  if (name == "margin") return Confidence::margin;
  if (name == "entropy") return Confidence::entropy;
  return invalid_argument("confidence: expected probability, margin or entropy, got '" + name + "'");
}

const char* unmask_name(Unmask u) {
  switch (u) {
    case Unmask::confidence: return "confidence";
    case Unmask::sequential: return "sequential";
    case Unmask::entropy_bounded: return "entropy_bounded";
  }
  return "?";
}

Result<Unmask> parse_unmask(const std::string& name) {
  if (name == "confidence") return Unmask::confidence;
  if (name == "sequential") return Unmask::sequential;
  if (name == "entropy_bounded") return Unmask::entropy_bounded;
  return invalid_argument("unmask: expected confidence, sequential or entropy_bounded, got '" + name + "'");
}

Result<GemmChoice> parse_gemm_choice(const std::string& name) {
  if (name == "cublas") return GemmChoice::cublas;
  if (name == "streaming") return GemmChoice::streaming;
  if (name == "tuned") return GemmChoice::tuned;
  return invalid_argument("gemm: expected cublas, streaming or tuned, got '" + name + "'");
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const Config& Model::config() const { return impl_->config; }
const std::string& Model::dir() const { return impl_->dir; }
Loop Model::default_loop() const {
  switch (impl_->config.arch) {
    case Arch::sdar: return Loop::block;
    case Arch::dream: return Loop::dream;
    case Arch::fast_dllm: return Loop::fast_dllm;
    default: return Loop::remask;
  }
}
int64_t Model::parameter_count() const { return impl_->parameters; }
std::string Model::weight_dtypes() const { return impl_->store.dtypes(); }
AttentionDumpCounts Model::attention_dump_counts() const {
  return impl_->policy.recorder ? impl_->policy.recorder->counts() : AttentionDumpCounts{};
}

namespace {

// The backend's Ops and the attention policy of every layer (each layer's spec checked now, not
// at the first forward).
Status init_backend(Model::Impl& impl, const LoadOptions& options) {
  const Config& c = impl.config;
  auto gemm = parse_gemm_choice(options.gemm);
  if (!gemm.ok()) return gemm.status();
  if (options.backend == "cpu") {
    impl.ops = make_cpu_ops();
    impl.policy.backend = Backend::cpu;
  } else if (options.backend == "cuda" || options.backend.rfind("cuda:", 0) == 0) {
    int device = 0;
    if (options.backend.size() > 5) {
      const std::string id = options.backend.substr(5);
      char* end = nullptr;
      const long d = std::strtol(id.c_str(), &end, 10);
      if (id.empty() || end != id.c_str() + id.size() || d < 0 || d > 1023) {
        return invalid_argument("backend: expected cuda or cuda:N, got '" + options.backend + "'");
      }
      device = static_cast<int>(d);
    }
    if (c.arch == Arch::fast_dllm) {  // its loop's forwards (one position past a chunk) not run on a GPU yet
      return Status(StatusCode::unsupported, "backend: the cuda backend does not run fast_dllm models yet (use cpu)");
    }
    if (c.head_dim != 64 && c.head_dim != 128) {
      return Status(StatusCode::unsupported, "config head_dim " + std::to_string(c.head_dim) +
                                                 ": the cuda backend's attention kernels take head_dim 64 or 128");
    }
    auto ops = make_cuda_ops(device, c, gemm.value());
    if (!ops.ok()) return ops.status();
    impl.ops = std::move(ops.value());
    impl.policy.backend = Backend::cuda;
    impl.policy.device = device;
    impl.policy.stream = impl.ops->stream();
  } else {
    return invalid_argument("backend: expected cpu or cuda, got '" + options.backend + "'");
  }
  impl.policy.num_threads = options.num_threads;
  impl.policy.method = options.attention;
  SPARSA_RETURN_IF_ERROR(
      expand_layer_methods(options.attention_layers, static_cast<int>(c.n_layers), &impl.policy.layer_methods));
  for (int l = 0; l < c.n_layers; ++l) {
    auto a = make_layer_attention(impl.policy, l);
    if (!a.ok()) return a.status();
  }
  if (impl.policy.backend == Backend::cpu) {
    auto recorder = AttentionRecorder::create(options.dump_attention, static_cast<int>(c.n_layers));
    if (!recorder.ok()) return recorder.status();
    impl.policy.recorder = std::move(recorder).value();
  } else if (!options.dump_attention.dir.empty()) {
    return Status(StatusCode::unsupported, "dump_attention: the capture runs on the cpu backend only for now");
  }
  return Status::Ok();
}

}  // namespace

Status check_attention(const Config& config, const LoadOptions& options) {
  AttentionPolicy policy;
  if (options.backend == "cuda" || options.backend.rfind("cuda:", 0) == 0) {
    policy.backend = Backend::cuda;  // the device number is init_backend's to check
  } else if (options.backend != "cpu") {
    return invalid_argument("backend: expected cpu or cuda, got '" + options.backend + "'");
  }
  policy.num_threads = options.num_threads;
  policy.method = options.attention;
  SPARSA_RETURN_IF_ERROR(
      expand_layer_methods(options.attention_layers, static_cast<int>(config.n_layers), &policy.layer_methods));
  for (int l = 0; l < config.n_layers; ++l) {  // the methods' objects: host state only until their first call
    auto a = make_layer_attention(policy, l);
    if (!a.ok()) return a.status();
  }
  return Status::Ok();
}

namespace {

Status load_weights(Model::Impl& impl, WeightSource& source) {
  impl.graphs = impl.options.cuda_graphs && impl.policy.backend == Backend::cuda;
  for (int l = 0; l < impl.config.n_layers && impl.graphs; ++l) {  // host decisions inside a method: eager
    const std::string& m = l < static_cast<int>(impl.policy.layer_methods.size()) && !impl.policy.layer_methods[l].empty()
                               ? impl.policy.layer_methods[l]
                               : impl.policy.method;
    if (m != "dense") impl.graphs = false;
  }
  auto weights = impl.config.arch == Arch::llada ? load_llada_weights(impl.config, source)
                                                 : load_qwen_weights(impl.config, source);
  if (!weights.ok()) return weights.status();
  impl.weights = std::move(weights.value());
  SPARSA_RETURN_IF_ERROR(impl.ops->check());
  const Config& c = impl.config;
  const int64_t per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim +
                            3 * c.dim * c.hidden_dim + 2 * c.dim + (c.qk_norm ? 2 * c.head_dim : 0) +
                            (c.qkv_bias ? (c.n_heads + 2 * c.n_kv_heads) * c.head_dim : 0);
  impl.parameters = c.n_layers * per_layer + c.vocab_size * c.dim * (c.tied_embeddings ? 1 : 2) + c.dim;
  return Status::Ok();
}

}  // namespace

Status Model::Impl::forward(State& s, Sequence& seq, std::span<const int32_t> tokens, const ForwardOptions& o,
                            float* logits) const {
  // Eager: forwards that store K/V, and the dual cache's (its suffix arrays and length are not in the
  // graph's key).
  if (!graphs || o.store_kv > 0 || o.keep_suffix_from >= 0 || o.with_suffix) {
    return forward_eager(s, seq, tokens, o, logits);
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  SPARSA_RETURN_IF_ERROR(check_chunk(config, seq, tokens, o));
  s.reserve(config, n, o.logits_count);  // before the key: it names the buffers
  const GraphKey key{&seq, seq.length(), n, o.logits_begin, o.logits_count, o.block_causal, s.capacity, s.x, s.logits};
  auto& cache = s.graphs.graphs;
  auto hit = std::find_if(cache.begin(), cache.end(), [&](const auto& e) { return e.first == key; });
  std::shared_ptr<void> graph;
  if (hit != cache.end()) {
    graph = hit->second;
    cache.erase(hit);
  } else if (s.graphs.last_eager == key && ops->begin_capture()) {
    const Status recorded = forward_eager(s, seq, tokens, o, nullptr);
    graph = ops->end_capture();
    if (!recorded.ok() || graph == nullptr) {
      graph = nullptr;
      s.graphs.last_eager = GraphKey{};
      (void)ops->check();  // a failed capture is not an error: the forward runs eagerly
      return forward_eager(s, seq, tokens, o, logits);
    }
  }
  if (graph == nullptr) {
    s.graphs.last_eager = key;
    return forward_eager(s, seq, tokens, o, logits);
  }
  cache.emplace_back(key, graph);
  if (cache.size() > GraphCache::kMax) cache.erase(cache.begin());
  ops->stage_tokens(tokens);
  ops->replay(graph);
  if (logits != nullptr && o.logits_count > 0) ops->to_host(logits, s.logits, o.logits_count * config.vocab_size);
  return ops->check();
}

Result<Model> Model::load(const std::string& dir, const LoadOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status(StatusCode::io_error, dir + ": not a model directory");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  auto config_text = read_text_file(config_path);
  if (!config_text.ok()) {
    return Status(config_text.status().code(),
                  config_text.status().message() + " (a model directory needs config.json)");
  }
  auto config = parse_config(config_text.value(), config_path);
  if (!config.ok()) return config.status();

  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  impl->config = config.value();
  impl->options = options;
  SPARSA_RETURN_IF_ERROR(init_backend(*impl, options));
  auto store = TensorStore::open(dir);
  if (!store.ok()) return store.status();
  impl->store = std::move(store.value());
  auto source = file_weights(impl->store, *impl->ops);
  SPARSA_RETURN_IF_ERROR(load_weights(*impl, *source));
  return Model(std::move(impl));
}

Result<Model> Model::random(const Config& config, const LoadOptions& options, uint64_t seed) {
  const Config& c = config;
  auto positive = [](const char* field, int64_t v) -> Status {
    return v >= 1 ? Status::Ok() : invalid_argument(std::string("config: ") + field + ": expected >= 1, got " +
                                                    std::to_string(v));
  };
  SPARSA_RETURN_IF_ERROR(positive("dim", c.dim));
  SPARSA_RETURN_IF_ERROR(positive("n_layers", c.n_layers));
  SPARSA_RETURN_IF_ERROR(positive("n_heads", c.n_heads));
  SPARSA_RETURN_IF_ERROR(positive("n_kv_heads", c.n_kv_heads));
  SPARSA_RETURN_IF_ERROR(positive("head_dim", c.head_dim));
  SPARSA_RETURN_IF_ERROR(positive("hidden_dim", c.hidden_dim));
  SPARSA_RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  SPARSA_RETURN_IF_ERROR(positive("max_seq_len", c.max_seq_len));
  if (c.n_heads % c.n_kv_heads != 0) return invalid_argument("config: n_heads: expected a multiple of n_kv_heads");
  if (c.head_dim % 2 != 0) return invalid_argument("config: head_dim: expected an even number (RoPE pairs)");
  if (c.arch == Arch::sdar || c.arch == Arch::fast_dllm) SPARSA_RETURN_IF_ERROR(positive("block_size", c.block_size));
  auto impl = std::make_unique<Impl>();
  impl->dir = "(random weights)";
  impl->config = config;
  impl->options = options;
  SPARSA_RETURN_IF_ERROR(init_backend(*impl, options));
  auto source = random_weights(*impl->ops, seed);
  SPARSA_RETURN_IF_ERROR(load_weights(*impl, *source));
  return Model(std::move(impl));
}

Result<std::vector<float>> Model::logits(std::span<const int32_t> ids, int64_t cached) const {
  const Config& c = impl_->config;
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t block = block_causal_size(c);
  if (cached < 0 || cached >= n) {
    return invalid_argument("cached: expected in [0, " + std::to_string(n) + ") for " + std::to_string(n) +
                            " ids, got " + std::to_string(cached));
  }
  if (c.shifted_logits && cached > 0) {
    return invalid_argument(std::string("cached: ") + arch_name(c.arch) +
                            " predicts each position from the one before it, so its logits need the whole canvas "
                            "in one forward; got cached " + std::to_string(cached));
  }
  if (block > 0 && cached % block != 0) {
    return invalid_argument("cached: expected a multiple of the model's block_size " + std::to_string(block) +
                            ", got " + std::to_string(cached));
  }
  auto seq = make_sequence(c, impl_->policy, cached > 0 ? n : 0);
  if (!seq.ok()) return seq.status();
  State s;
  s.ops = impl_->ops.get();
  if (cached > 0) {
    ForwardOptions p;
    p.block_causal = block;
    p.store_kv = cached;
    SPARSA_RETURN_IF_ERROR(impl_->forward(s, seq.value(), ids.first(static_cast<size_t>(cached)), p, nullptr));
  }
  ForwardOptions o;
  o.block_causal = block;
  o.logits_count = n - cached;
  std::vector<float> out(static_cast<size_t>((n - cached) * c.vocab_size));
  SPARSA_RETURN_IF_ERROR(
      impl_->forward(s, seq.value(), ids.subspan(static_cast<size_t>(cached)), o, out.data()));
  return out;
}

Result<GenerateResult> Model::generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& o,
                                       const BlockCallback& on_block, PromptCache* cache) const {
  const Config& c = impl_->config;
  if (prompts.empty()) return invalid_argument("prompts: expected at least one request");
  if (cache != nullptr) {
    if (prompts.size() != 1) {
      return invalid_argument("cache: a prompt cache serves one request a call, got " + std::to_string(prompts.size()));
    }
    if (o.loop != Loop::block && o.loop != Loop::fast_dllm) {
      return invalid_argument("cache: the " + std::string(loop_name(o.loop)) +
                              " loop recomputes its canvas; a prompt cache serves the block and fast_dllm loops");
    }
    if (impl_->policy.backend != Backend::cpu) {
      return invalid_argument("cache: a prompt cache runs on the cpu backend only (for now)");
    }
  }
  if (o.gen_len < 1) return invalid_argument("gen_len: expected >= 1, got " + std::to_string(o.gen_len));
  if (o.steps < 1) return invalid_argument("steps: expected >= 1, got " + std::to_string(o.steps));
  if (!(o.temperature >= 0)) return invalid_argument("temperature: expected >= 0");
  if (!(o.threshold >= 0 && o.threshold <= 1)) return invalid_argument("threshold: expected in [0, 1]");
  if (!(o.factor >= 0 && std::isfinite(o.factor))) return invalid_argument("factor: expected a finite value >= 0");
  if (o.factor > 0) {
    if (o.loop != Loop::remask && o.loop != Loop::prefix_cache && o.loop != Loop::dual_cache) {
      return invalid_argument(
          "factor: Fast-dLLM's factor rule serves the remask, prefix_cache and dual_cache loops, not " +
          std::string(loop_name(o.loop)));
    }
    if (o.threshold > 0) {
      return invalid_argument("factor: a step commits by the factor rule or by the threshold, not both");
    }
    if (o.confidence != Confidence::probability) {
      return invalid_argument("factor: the rule's bounds 1 - factor / (i + 2) are probabilities; confidence " +
                              std::string(confidence_name(o.confidence)) + " is not one");
    }
  }
  if (!(o.top_p > 0 && o.top_p <= 1)) return invalid_argument("top_p: expected in (0, 1]");
  if (o.top_k < 0) return invalid_argument("top_k: expected >= 0 (0: off), got " + std::to_string(o.top_k));
  if (!(o.alg_temp >= 0 && std::isfinite(o.alg_temp))) return invalid_argument("alg_temp: expected a finite value >= 0");
  if (o.alg_temp > 0 && o.loop != Loop::dream) {
    return invalid_argument("alg_temp: draws the positions of Dream's schedule; the " +
                            std::string(loop_name(o.loop)) + " loop commits the most confident (use loop dream)");
  }
  if (o.unmask != Unmask::confidence) {
    const std::string name = unmask_name(o.unmask);
    if (o.loop != Loop::block) {
      return invalid_argument("unmask: " + name + " is a strategy of the block loop; the " +
                              std::string(loop_name(o.loop)) + " loop commits by confidence");
    }
    if (o.threshold > 0) {
      return invalid_argument("threshold: decides the confidence strategy's commits; unmask " + name +
                              " has its own rule");
    }
    // probability is every loop's default; entropy_bounded computes entropies whatever is asked.
    const bool applies = o.confidence == Confidence::probability ||
                         (o.unmask == Unmask::entropy_bounded && o.confidence == Confidence::entropy);
    if (!applies) {
      return invalid_argument("confidence: unmask " + name + (o.unmask == Unmask::sequential
                                                                  ? " takes positions in order; "
                                                                  : " ranks by entropy; ") +
                              "confidence " + confidence_name(o.confidence) + " does not apply");
    }
  }
  if (!(o.eb_threshold > 0 && std::isfinite(o.eb_threshold))) {
    return invalid_argument("eb_threshold: expected a finite value > 0");
  }
  if (o.loop == Loop::block && c.arch != Arch::sdar) {
    return invalid_argument("loop: block diffusion needs a block-diffusion model (sdar); this model is " +
                            std::string(arch_name(c.arch)));
  }
  if (o.loop != Loop::block && c.arch == Arch::sdar) {
    return invalid_argument("loop: " + std::string(loop_name(o.loop)) +
                            " runs a bidirectional canvas; an sdar model decodes with the block loop");
  }
  if ((o.loop == Loop::fast_dllm) != (c.arch == Arch::fast_dllm)) {
    return invalid_argument("loop: fast_dllm models decode with the fast_dllm loop and it runs only them; got the " +
                            std::string(loop_name(o.loop)) + " loop on a " + arch_name(c.arch) + " model");
  }
  if (o.loop == Loop::fast_dllm && (o.sub_block < 1 || c.block_size % o.sub_block != 0)) {
    return invalid_argument("sub_block: expected a divisor of the model's block size " + std::to_string(c.block_size) +
                            ", got " + std::to_string(o.sub_block));
  }
  if (o.loop == Loop::remask || o.loop == Loop::prefix_cache || o.loop == Loop::dual_cache) {
    if (o.block_len < 1 || o.gen_len % o.block_len != 0) {
      return invalid_argument("block_len: expected a divisor of gen_len (" + std::to_string(o.gen_len) + "), got " +
                              std::to_string(o.block_len));
    }
    const int64_t blocks = o.gen_len / o.block_len;
    if (o.threshold == 0 && o.factor == 0 && o.steps % blocks != 0) {  // else the blocks set the pace
      return invalid_argument("steps: expected a multiple of the number of blocks (" + std::to_string(blocks) +
                              "), got " + std::to_string(o.steps));
    }
  }
  for (int32_t t : o.eos_ids) {
    if (t < 0 || t >= c.vocab_size) {
      return invalid_argument("eos_ids: id " + std::to_string(t) + " outside [0, " + std::to_string(c.vocab_size) +
                              ")");
    }
  }
  for (size_t r = 0; r < prompts.size(); ++r) {
    const auto& p = prompts[r];
    const std::string who = "prompt " + std::to_string(r);
    if (p.empty()) return invalid_argument(who + ": empty");
    int64_t total = static_cast<int64_t>(p.size()) + o.gen_len;
    const bool whole_blocks = o.loop == Loop::block || o.loop == Loop::fast_dllm;
    if (whole_blocks) total = (total + c.block_size - 1) / c.block_size * c.block_size;
    if (total > c.max_seq_len) {
      return invalid_argument(who + ": " + std::to_string(p.size()) + " prompt tokens + " + std::to_string(o.gen_len) +
                              " generated" + (whole_blocks ? " (rounded up to whole blocks)" : "") + " = " +
                              std::to_string(total) + " exceed the model's context of " +
                              std::to_string(c.max_seq_len));
    }
    for (int32_t t : p) {
      if (t < 0 || t >= c.vocab_size) {
        return invalid_argument(who + ": token id " + std::to_string(t) + " outside [0, " +
                                std::to_string(c.vocab_size) + ")");
      }
    }
  }
  if (impl_->policy.recorder) impl_->policy.recorder->reset_seconds();
  const auto start = std::chrono::steady_clock::now();
  Result<GenerateResult> r = o.loop == Loop::remask         ? generate_remask(*impl_, prompts, o, on_block)
                             : o.loop == Loop::prefix_cache || o.loop == Loop::dual_cache
                                 ? generate_prefix_cache(*impl_, prompts, o, on_block)
                             : o.loop == Loop::dream        ? generate_dream(*impl_, prompts, o, on_block)
                             : o.loop == Loop::fast_dllm    ? generate_fast_dllm(*impl_, prompts, o, on_block, cache)
                                                            : generate_block(*impl_, prompts, o, on_block, cache);
  if (r.ok()) {
    if (cache != nullptr) cache->state().last_reused = r->reused_tokens;
    r->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (impl_->policy.recorder) r->attention_seconds = impl_->policy.recorder->attention_seconds();
  }
  return r;
}

}  // namespace sparsa::dlm
