// The diffusion-LM engine's commands (docs/dlm.md): generate, chat, logits, tokenize,
// chat-template, model info.
#include <chrono>
#include <climits>
#include <optional>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cmd_dlm.h"
#include "common.h"
#include "sparsa/dlm.h"
#include "sparsa/io.h"

namespace sparsa::cli {

namespace {

struct DlmOptions {
  std::string model, out, tokenizer, text, decode, backend = "cpu", loop, ids, eos_ids;
  std::vector<std::string> prompts, prompt_ids;
  std::string attention = "dense";
  std::vector<std::string> attention_layers;
  int64_t gen_len = 128, block_len = 32, steps = 0;
  double threshold = 0, factor = 0, temperature = 0;
  uint64_t seed = 0;
  int threads = 0;
  int64_t cached = 0;  // logits: ids run into the KV cache first
  std::string dump_dir, dump_layers, dump_forwards;
  int64_t dump_max = 256;
  std::string gemm = "cublas";
  bool json = false, no_stop = false, ban_eos = false, quiet = false, no_cuda_graphs = false;
  // The chat template (generate --chat, chat-template).
  bool chat = false, no_generation_prompt = false, show_ids = false, no_prompt_cache = false;
  std::string system, chat_template, chat_vars = "{}", messages;
  std::string confidence;  // "": the loop's default
  std::string unmask = "confidence";
  double eb_threshold = 0.35;
  double top_p = 1.0;
  int64_t top_k = 0;
  double alg_temp = 0;
  int64_t sub_block = 8;
};

Result<std::vector<int32_t>> parse_ids(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t j = std::min(text.find(',', i), text.size());
    const std::string item = text.substr(i, j - i);
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument("range");
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return invalid_argument(flag + ": expected comma-separated token ids, got '" + item + "'");
    }
    i = j + 1;
  }
  return ids;
}

std::string tokenizer_path(const DlmOptions& o) {
  if (!o.tokenizer.empty()) return o.tokenizer;
  return (std::filesystem::path(o.model) / "tokenizer.json").string();
}

// "0,3" into numbers of the flag (each in [0, INT32_MAX]).
Result<std::vector<int64_t>> parse_list(const std::string& flag, const std::string& text) {
  if (text.empty()) return std::vector<int64_t>{};
  auto ids = parse_ids(flag, text);
  if (!ids.ok()) return invalid_argument(flag + ": expected comma-separated integers >= 0, got '" + text + "'");
  return std::vector<int64_t>(ids->begin(), ids->end());
}

Result<dlm::Model> load_model(const DlmOptions& o) {
  dlm::LoadOptions lo;
  if (o.dump_dir.empty() && (!o.dump_layers.empty() || !o.dump_forwards.empty())) {
    return invalid_argument("--dump-layers/--dump-forwards: select what --dump-attention DIR captures; give it");
  }
  lo.dump_attention.dir = o.dump_dir;
  auto layers = parse_list("--dump-layers", o.dump_layers);
  if (!layers.ok()) return layers.status();
  lo.dump_attention.layers.assign(layers->begin(), layers->end());
  auto forwards = parse_list("--dump-forwards", o.dump_forwards);
  if (!forwards.ok()) return forwards.status();
  lo.dump_attention.forwards = forwards.value();
  lo.dump_attention.max_files = o.dump_max;
  lo.backend = o.backend;
  lo.num_threads = o.threads;
  lo.attention = o.attention;
  lo.attention_layers = o.attention_layers;
  lo.cuda_graphs = !o.no_cuda_graphs;
  lo.gemm = o.gemm;
  return dlm::Model::load(o.model, lo);
}

// The capture's summary line (stderr, so that --json output stays one document).
void print_dump(const DlmOptions& o, const dlm::Model& model) {
  if (o.dump_dir.empty()) return;
  const dlm::AttentionDumpCounts n = model.attention_dump_counts();
  std::fprintf(stderr, "attention dump: %lld files in %s", static_cast<long long>(n.written), o.dump_dir.c_str());
  if (n.skipped > 0) {
    std::fprintf(stderr, " (%lld more selected, over --dump-max %lld)", static_cast<long long>(n.skipped),
                 static_cast<long long>(o.dump_max));
  }
  std::fprintf(stderr, "\n");
}

// The loop's options from the command line (usage errors name their flag).
Result<dlm::GenerateOptions> generate_options(const DlmOptions& o, const dlm::Model& model) {
  dlm::GenerateOptions g;
  g.loop = model.default_loop();
  if (!o.loop.empty()) {
    auto loop = dlm::parse_loop(o.loop);
    if (!loop.ok()) return loop.status();
    g.loop = loop.value();
  }
  g.gen_len = o.gen_len;
  g.block_len = o.block_len;
  g.steps = o.steps > 0 ? o.steps
                        : (g.loop == dlm::Loop::block ? std::max<int64_t>(model.config().block_size, 1) : o.gen_len);
  g.threshold = o.threshold;
  g.factor = o.factor;
  g.temperature = o.temperature;
  g.confidence = dlm::default_confidence(g.loop);
  if (!o.confidence.empty()) {
    auto kind = dlm::parse_confidence(o.confidence);
    if (!kind.ok()) return invalid_argument("--confidence: " + kind.status().message());
    g.confidence = kind.value();
  }
  auto unmask = dlm::parse_unmask(o.unmask);
  if (!unmask.ok()) return invalid_argument("--unmask: " + unmask.status().message());
  g.unmask = unmask.value();
  g.eb_threshold = o.eb_threshold;
  g.top_p = o.top_p;
  g.top_k = o.top_k;
  g.alg_temp = o.alg_temp;
  g.sub_block = o.sub_block;
  g.seed = o.seed;
  g.stop_at_eos = !o.no_stop;
  g.ban_eos = o.ban_eos;
  if (!o.eos_ids.empty()) {
    auto eos = parse_ids("--eos-ids", o.eos_ids);
    if (!eos.ok()) return eos.status();
    g.eos_ids = eos.value();
  }
  return g;
}

// One request's text printed as it grows block by block. A block may end inside a multi-byte
// character (decoded as U+FFFD): those bytes wait for the next block.
struct TextStream {
  const dlm::Tokenizer& tok;
  std::string printed;

  void update(std::span<const int32_t> generated) {
    auto text = tok.decode(generated, true);
    if (!text.ok()) return;
    std::string t = text.value();
    while (t.size() >= 3 && t.compare(t.size() - 3, 3, "\xEF\xBF\xBD") == 0) t.resize(t.size() - 3);
    print_new(t);
  }
  void finish(std::span<const int32_t> generated) {  // the rest (held-back bytes, if any), a newline
    auto text = tok.decode(generated, true);
    if (text.ok()) print_new(text.value());
    std::cout << "\n" << std::flush;
  }

 private:
  void print_new(const std::string& t) {
    if (t.size() > printed.size() && t.compare(0, printed.size(), printed) == 0) {
      std::cout << t.substr(printed.size()) << std::flush;
      printed = t;
    }
  }
};

Outcome run_logits(const DlmOptions& o) {
  auto ids = parse_ids("--ids", o.ids);
  if (!ids.ok()) return usage_error(ids.status());
  if (Status st = check_output_path("--out", o.out, {".npy"}); !st.ok()) return usage_error(st);
  auto model = load_model(o);
  if (!model.ok()) return runtime_error(model.status());
  auto logits = model->logits(ids.value(), o.cached);
  if (!logits.ok()) return runtime_error(logits.status());
  const int64_t n = static_cast<int64_t>(ids->size()) - o.cached, vocab = model->config().vocab_size;
  const Tensor t = Tensor::contiguous(logits->data(), DType::f32, {n, vocab});
  if (Status st = write_npy(o.out, t); !st.ok()) return runtime_error(st);
  if (!o.quiet) {
    std::cout << "logits [" << n << ", " << vocab << "] f32 (" << dlm::arch_name(model->config().arch) << ", "
              << (dlm::block_causal_size(model->config()) > 0
                      ? "block-causal, block " + std::to_string(model->config().block_size)
                      : std::string("bidirectional"))
              << ") -> " << o.out << "\n";
  }
  print_dump(o, model.value());
  return success();
}

Outcome run_info(const DlmOptions& o) {
  auto model = load_model(o);
  if (!model.ok()) return runtime_error(model.status());
  const dlm::Config& c = model->config();
  nlohmann::json j = {{"dir", o.model},
                      {"arch", dlm::arch_name(c.arch)},
                      {"layers", c.n_layers},
                      {"dim", c.dim},
                      {"heads", c.n_heads},
                      {"kv_heads", c.n_kv_heads},
                      {"head_dim", c.head_dim},
                      {"hidden_dim", c.hidden_dim},
                      {"vocab_size", c.vocab_size},
                      {"max_seq_len", c.max_seq_len},
                      {"rope_theta", c.rope.theta},
                      {"rope_scaling", c.rope.scaling},
                      {"rope_factor", c.rope.factor},
                      {"mask_token_id", c.mask_token_id},
                      {"eos_token_ids", c.eos_token_ids},
                      {"block_size", c.block_size},
                      {"tied_embeddings", c.tied_embeddings},
                      {"parameters", model->parameter_count()},
                      {"weight_dtypes", model->weight_dtypes()},
                      {"default_loop", dlm::loop_name(model->default_loop())}};
  if (o.json) {
    std::cout << json_text(j) << "\n";
    return success();
  }
  for (const auto& [k, v] : j.items()) {
    std::cout << k << std::string(k.size() < 16 ? 16 - k.size() : 1, ' ')
              << (v.is_string() ? v.get<std::string>() : v.dump()) << "\n";
  }
  return success();
}

Outcome run_tokenize(const DlmOptions& o) {
  if (o.tokenizer.empty()) return usage_error(invalid_argument("--tokenizer: required"));
  if (o.text.empty() == o.decode.empty())
    return usage_error(invalid_argument("give exactly one of --text and --decode"));
  auto tok = dlm::Tokenizer::load(o.tokenizer);
  if (!tok.ok()) return runtime_error(tok.status());
  if (!o.decode.empty()) {
    auto ids = parse_ids("--decode", o.decode);
    if (!ids.ok()) return usage_error(ids.status());
    auto text = tok->decode(ids.value());
    if (!text.ok()) return runtime_error(text.status());
    if (o.json) {
      std::cout << json_text(nlohmann::json{{"text", text.value()}}, -1) << "\n";
    } else {
      std::cout << text.value() << "\n";
    }
    return success();
  }
  const std::vector<int32_t> ids = tok->encode(o.text);
  if (o.json) {
    std::cout << json_text(nlohmann::json{{"ids", ids}}, -1) << "\n";
    return success();
  }
  for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
  std::cout << "\n";
  return success();
}

Result<dlm::ChatTemplate> load_chat_template(const DlmOptions& o) {
  return dlm::ChatTemplate::load(o.model, o.chat_template);
}

// One request's prompt through the chat template: an optional system message, then the user's.
Result<std::string> chat_prompt(const dlm::ChatTemplate& t, const DlmOptions& o, const std::string& user) {
  std::vector<dlm::ChatMessage> messages;
  if (!o.system.empty()) messages.push_back({"system", o.system});
  messages.push_back({"user", user});
  return t.render(messages, !o.no_generation_prompt, o.chat_vars);
}

Outcome run_chat_template(const DlmOptions& o) {
  if (o.model.empty() && o.chat_template.empty()) {
    return usage_error(invalid_argument("give --model DIR or --template FILE"));
  }
  if (o.prompts.empty() == o.messages.empty()) {
    return usage_error(invalid_argument("give --prompt TEXT or --messages FILE, not both"));
  }
  auto t = load_chat_template(o);
  if (!t.ok()) return runtime_error(t.status());
  Result<std::string> text = std::string();
  if (!o.messages.empty()) {
    // A JSON list of messages, or a whole context object ({"messages": [...], "tools": [...]}).
    auto messages = read_text_file(o.messages);
    if (!messages.ok()) return runtime_error(messages.status());
    auto j = nlohmann::ordered_json::parse(messages.value(), nullptr, false);
    if (j.is_discarded()) return runtime_error(invalid_argument("--messages: " + o.messages + ": not valid JSON"));
    nlohmann::ordered_json context = j.is_array() ? nlohmann::ordered_json{{"messages", j}} : j;
    if (!context.is_object()) {
      return runtime_error(invalid_argument("--messages: expected a list of messages or an object"));
    }
    auto vars = nlohmann::ordered_json::parse(o.chat_vars, nullptr, false);
    if (vars.is_discarded() || !vars.is_object()) return usage_error(invalid_argument("--vars: expected a JSON object"));
    if (!context.contains("add_generation_prompt")) context["add_generation_prompt"] = !o.no_generation_prompt;
    for (const auto& [k, v] : vars.items()) context[k] = v;
    text = t->render_json(context.dump());
  } else {
    if (o.prompts.size() != 1) return usage_error(invalid_argument("--prompt: give one (a batch is generate's)"));
    text = chat_prompt(t.value(), o, o.prompts[0]);
  }
  if (!text.ok()) return runtime_error(text.status());
  std::vector<int32_t> ids;
  if (o.show_ids) {
    auto tok = dlm::Tokenizer::load(tokenizer_path(o));
    if (!tok.ok()) return runtime_error(tok.status());
    ids = tok->encode(text.value());
  }
  if (o.json) {
    nlohmann::json j{{"text", text.value()}};
    if (o.show_ids) j["ids"] = ids;
    std::cout << json_text(j, -1) << "\n";
    return success();
  }
  std::cout << text.value();
  if (o.show_ids) {
    std::cout << "\n";
    for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
    std::cout << "\n";
  }
  return success();
}

// A conversation with an instruct / chat model: each line of stdin is the user's turn; the
// whole conversation goes through the chat template every turn and the reply is streamed, then
// kept as the assistant's turn. A block-diffusion model on the cpu backend keeps the K/V of the
// conversation's whole blocks across turns (dlm::PromptCache), so a turn prefills only the blocks
// after those its tokens share with the last turn's; elsewhere each turn prefills the whole
// conversation. "/reset" forgets the turns (not --system), "/exit" ends; so does the input's end.
Outcome run_chat(const DlmOptions& o) {
  auto tok = dlm::Tokenizer::load(tokenizer_path(o));
  if (!tok.ok()) return runtime_error(tok.status());
  auto chat = load_chat_template(o);
  if (!chat.ok()) return runtime_error(chat.status());
  auto vars = nlohmann::ordered_json::parse(o.chat_vars, nullptr, false);
  if (vars.is_discarded() || !vars.is_object()) return usage_error(invalid_argument("--chat-vars: expected a JSON object"));
  auto model = load_model(o);
  if (!model.ok()) return runtime_error(model.status());
  auto options = generate_options(o, model.value());
  if (!options.ok()) return usage_error(options.status());
  dlm::GenerateOptions g = options.value();
  dlm::PromptCache cache;
  const bool use_cache = (g.loop == dlm::Loop::block || g.loop == dlm::Loop::fast_dllm) && o.backend == "cpu" &&
                         !o.no_prompt_cache;

  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!o.system.empty()) messages.push_back({{"role", "system"}, {"content", o.system}});
  const size_t kept = messages.size();
  const bool prompt_user = !o.json && ::isatty(STDIN_FILENO);
  std::string line;
  for (int64_t turn = 0;;) {
    if (prompt_user) std::cout << "> " << std::flush;
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages.erase(messages.begin() + static_cast<std::ptrdiff_t>(kept), messages.end());
      cache.clear();
      continue;
    }
    messages.push_back({{"role", "user"}, {"content", line}});
    nlohmann::ordered_json context = {{"messages", messages}, {"add_generation_prompt", true}};
    for (const auto& [k, v] : vars.items()) context[k] = v;
    auto rendered = chat->render_json(context.dump());
    if (!rendered.ok()) return runtime_error(rendered.status());
    const std::vector<int32_t> prompt = tok->encode(rendered.value());
    g.seed = o.seed + static_cast<uint64_t>(turn);  // sampled turns differ; a rerun repeats them
    std::optional<TextStream> streamed;
    if (!o.json) streamed.emplace(TextStream{tok.value(), {}});
    auto result = model->generate(
        {prompt}, g, [&](size_t, std::span<const int32_t> generated) {
          if (streamed) streamed->update(generated);
        },
        use_cache ? &cache : nullptr);
    if (!result.ok()) return runtime_error(result.status());
    const std::vector<int32_t>& reply_ids = result->tokens[0];
    auto reply = tok->decode(reply_ids, true);
    if (!reply.ok()) return runtime_error(reply.status());
    if (streamed) {
      streamed->finish(reply_ids);
    } else {
      std::cout << json_text(nlohmann::json{{"turn", turn},
                                            {"prompt_tokens", prompt.size()},
                                            {"reused_tokens", result->reused_tokens},
                                            {"forward_tokens", result->forward_tokens},
                                            {"seconds", result->seconds},
                                            {"tokens", reply_ids},
                                            {"text", reply.value()}},
                             -1)
                << "\n"
                << std::flush;
    }
    messages.push_back({{"role", "assistant"}, {"content", reply.value()}});
    ++turn;
  }
  return success();
}

Outcome run_generate(const DlmOptions& o) {
  if (o.prompts.empty() == o.prompt_ids.empty()) {
    return usage_error(
        invalid_argument("give --prompt TEXT or --prompt-ids IDS (each repeatable for a batch), not both"));
  }
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : o.prompt_ids) {
    auto ids = parse_ids("--prompt-ids", p);
    if (!ids.ok()) return usage_error(ids.status());
    prompts.push_back(ids.value());
  }
  std::optional<dlm::Tokenizer> tok;
  if (!o.prompts.empty() || !o.json) {
    auto t = dlm::Tokenizer::load(tokenizer_path(o));
    if (!t.ok()) {
      if (!o.prompts.empty()) return runtime_error(t.status());
    } else {
      tok.emplace(std::move(t.value()));
    }
  }
  if (o.chat && o.prompts.empty()) return usage_error(invalid_argument("--chat: needs --prompt TEXT"));
  std::optional<dlm::ChatTemplate> chat;
  if (o.chat) {
    auto t = load_chat_template(o);
    if (!t.ok()) return runtime_error(t.status());
    chat.emplace(std::move(t.value()));
  }
  for (const std::string& text : o.prompts) {
    if (!chat) {
      prompts.push_back(tok->encode(text));
      continue;
    }
    auto rendered = chat_prompt(*chat, o, text);
    if (!rendered.ok()) return runtime_error(rendered.status());
    prompts.push_back(tok->encode(rendered.value()));
  }
  auto model = load_model(o);
  if (!model.ok()) return runtime_error(model.status());
  auto options = generate_options(o, model.value());
  if (!options.ok()) return usage_error(options.status());
  const dlm::GenerateOptions& g = options.value();

  // Streaming: each request's text grows block by block (printed as it becomes final for a
  // single request; a batch prints at the end). The progress line goes to stderr.
  const auto start = std::chrono::steady_clock::now();
  std::vector<int64_t> made(prompts.size(), 0);
  bool progress_shown = false;
  const bool stream = !o.json && prompts.size() == 1 && tok.has_value();
  std::optional<TextStream> streamed;
  if (stream) streamed.emplace(TextStream{*tok, {}});
  auto on_block = [&](size_t r, std::span<const int32_t> generated) {
    made[r] = static_cast<int64_t>(generated.size());
    if (stream) streamed->update(generated);
    if (!o.quiet) {
      progress_shown = true;
      int64_t total = 0;
      for (int64_t m : made) total += m;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\r[sparsa generate] %lld tokens, %.1f tokens/s   ", static_cast<long long>(total),
                   s > 0 ? total / s : 0.0);
      std::fflush(stderr);
    }
  };
  auto result = model->generate(prompts, g, on_block);
  if (progress_shown) std::fprintf(stderr, "\n");
  if (!result.ok()) return runtime_error(result.status());
  print_dump(o, model.value());
  const double attention = result->attention_seconds;
  if (!o.quiet && result->steps > 0) {
    // The per-step breakdown: attention (selection, executors, merges) and the rest.
    const double ms = 1e3 * result->seconds / static_cast<double>(result->steps);
    std::fprintf(stderr, "[sparsa generate] %lld forward passes, %.2f ms each", static_cast<long long>(result->steps),
                 ms);
    if (attention >= 0) {
      const double a = 1e3 * attention / static_cast<double>(result->steps);
      std::fprintf(stderr, ": attention %.2f ms (%.0f%%), the rest %.2f ms", a,
                   result->seconds > 0 ? 100.0 * attention / result->seconds : 0.0, ms - a);
    }
    std::fprintf(stderr, "\n");
  }
  if (o.json) {
    nlohmann::json j = {{"loop", dlm::loop_name(g.loop)},
                        {"tokens", result->tokens},
                        {"steps", result->steps},
                        {"forward_tokens", result->forward_tokens},
                        {"seconds", result->seconds},
                        {"attention_seconds", attention >= 0 ? nlohmann::json(attention) : nlohmann::json(nullptr)}};
    if (tok) {
      nlohmann::json texts = nlohmann::json::array();
      for (const auto& t : result->tokens) {
        auto text = tok->decode(t, true);
        texts.push_back(text.ok() ? text.value() : std::string());
      }
      j["text"] = texts;
    }
    std::cout << json_text(j, -1) << "\n";
    return success();
  }
  if (stream) {
    streamed->finish(result->tokens[0]);
  } else {
    for (const auto& t : result->tokens) {
      if (tok) {
        auto text = tok->decode(t, true);
        std::cout << (text.ok() ? text.value() : std::string()) << "\n";
      } else {
        for (size_t i = 0; i < t.size(); ++i) std::cout << (i ? "," : "") << t[i];
        std::cout << "\n";
      }
    }
  }
  return success();
}

// The attention capture's flags (generate, logits).
void add_dump_flags(CLI::App* cmd, DlmOptions* o) {
  cmd->add_option("--dump-attention", o->dump_dir,
                  "cpu: write each selected layer's attention inputs (q, k, v, the prefix, the block plan) as "
                  "safetensors into this new or empty directory (docs/dlm.md)");
  cmd->add_option("--dump-layers", o->dump_layers, "layers to capture, e.g. 0,5 (default: all)");
  cmd->add_option("--dump-forwards", o->dump_forwards,
                  "forward passes of each request to capture, counted from 0, e.g. 0,3 (default: all)");
  cmd->add_option("--dump-max", o->dump_max, "tensor files written at most")->capture_default_str();
}

// The CUDA backend's GEMM choice (LoadOptions::gemm), for the commands that load a model.
void add_gemm_flag(CLI::App* cmd, DlmOptions* o) {
  cmd->add_option("--gemm", o->gemm,
                  "cuda GEMMs: cublas, streaming (sparsa's weight-streaming kernel up to 16 tokens, cuBLAS above) or "
                  "tuned (up to 64 tokens, each shape's kernel chosen by timing on first use: cuBLASLt's "
                  "algorithms, the streaming kernel)")
      ->capture_default_str();
}

}  // namespace

std::vector<Subcommand> add_dlm_commands(CLI::App& app) {
  auto o = std::make_shared<DlmOptions>();
  std::vector<Subcommand> out;

  CLI::App* gen = app.add_subcommand("generate", "generate text with a diffusion LM (model directory of HF files)");
  gen->add_option("--model", o->model, "model directory (config.json, safetensors, tokenizer.json)")->required();
  gen->add_option("--prompt", o->prompts, "prompt text (repeatable: a batch)")->allow_extra_args(false);
  gen->add_option("--prompt-ids", o->prompt_ids, "prompt token ids 1,2,3 (repeatable: a batch)")
      ->allow_extra_args(false);
  gen->add_option("--tokenizer", o->tokenizer, "tokenizer.json (default: the model directory's)");
  gen->add_option("--loop", o->loop,
                  "remask, prefix_cache, dual_cache, block, dream or fast_dllm (default: remask for llada, block for "
                  "sdar, dream for dream, fast_dllm for fast_dllm)");
  gen->add_option("--confidence", o->confidence,
                  "what decides the committed positions: probability, margin or entropy (default: entropy for the "
                  "dream loop, probability otherwise)");
  gen->add_option("--gen-len", o->gen_len, "tokens to generate")->capture_default_str();
  gen->add_option("--block-len", o->block_len, "tokens per block (remask, prefix_cache, dual_cache)")
      ->capture_default_str();
  gen->add_option("--steps", o->steps,
                  "remask, prefix_cache, dual_cache: total steps (default gen-len); block: steps per block "
                  "(default block_size)");
  gen->add_option("--threshold", o->threshold, "confidence threshold for parallel decoding (0: top-k schedule)")
      ->capture_default_str();
  gen->add_option("--unmask", o->unmask,
                  "block loop: how a step picks its positions: confidence (SDAR's low_confidence_dynamic with "
                  "--threshold, _static without), sequential (left to right) or entropy_bounded")
      ->capture_default_str();
  gen->add_option("--eb-threshold", o->eb_threshold,
                  "--unmask entropy_bounded: commit the lowest-entropy positions while their entropies sum below this")
      ->capture_default_str();
  gen->add_option("--factor", o->factor,
                  "remask, prefix_cache, dual_cache: Fast-dLLM's factor rule for parallel decoding instead (0: off)")
      ->capture_default_str();
  gen->add_option("--temperature", o->temperature, "0: argmax; > 0: Gumbel-max sampling")->capture_default_str();
  gen->add_option("--top-p", o->top_p, "< 1: pick among the most probable tokens holding this mass")
      ->capture_default_str();
  gen->add_option("--top-k", o->top_k, "> 0: pick among the k largest logits (after --top-p)")->capture_default_str();
  gen->add_option("--alg-temp", o->alg_temp,
                  "dream loop, > 0: draw each step's positions with weights softmax(confidence / alg-temp)")
      ->capture_default_str();
  gen->add_option("--sub-block", o->sub_block, "fast_dllm loop: tokens per sub-block, decoded in turn (a divisor of the block)")
      ->capture_default_str();
  gen->add_option("--seed", o->seed, "sampling seed")->capture_default_str();
  gen->add_option("--backend", o->backend, "cpu, cuda or cuda:N (bf16 on the GPU)")->capture_default_str();
  gen->add_option("--threads", o->threads, "attention threads (0 = all cores)");
  gen->add_option("--attention", o->attention,
                  "every layer's attention: dense, ba_att[:density=0.5,block=64,min_tokens=1024,sort=true], "
                  "mean_pool[:density=0.5], xattention[:density=0.5,stride=8], quest[:budget=256], "
                  "losa[:budget=256,k=4] (docs/dlm.md)")
      ->capture_default_str();
  gen->add_option("--attention-layers", o->attention_layers, "per-layer overrides LAYERS=METHOD, e.g. 0,1,31=dense")
      ->allow_extra_args(false);
  gen->add_flag("--no-stop-at-eos", o->no_stop,
                "decode every block even after an EOS (the output then keeps the EOS and what follows)");
  gen->add_flag("--ban-eos", o->ban_eos, "never sample EOS");
  gen->add_option("--eos-ids", o->eos_ids, "EOS ids 1,2 (default: config.json's eos_token_id)");
  gen->add_flag("--chat", o->chat,
                "wrap each --prompt as a user message in the model's chat template (instruct / chat models)");
  gen->add_option("--system", o->system, "--chat: a system message before the user's");
  gen->add_option("--chat-template", o->chat_template, "--chat: this .jinja file instead of the model's template");
  gen->add_option("--chat-vars", o->chat_vars, "--chat: more template variables as a JSON object, e.g. "
                                               "'{\"enable_thinking\": false}'")
      ->capture_default_str();
  gen->add_flag("--json", o->json, "print the generated ids (and text) as JSON");
  gen->add_flag("--quiet", o->quiet, "no progress line");
  gen->add_flag("--no-cuda-graphs", o->no_cuda_graphs, "cuda: run every step eagerly (no graph replay)");
  add_gemm_flag(gen, o.get());
  add_dump_flags(gen, o.get());
  out.push_back({gen, [o] { return run_generate(*o); }});

  CLI::App* lg = app.add_subcommand("logits", "logits of one forward pass over a canvas (f32 [len, vocab] .npy)");
  lg->add_option("--model", o->model, "model directory")->required();
  lg->add_option("--ids", o->ids, "the canvas as token ids 1,2,3")->required();
  lg->add_option("--out", o->out, "output .npy")->required();
  lg->add_option("--cached", o->cached,
                 "run the first N ids into the KV cache first, then the rest over it (the loops' cached steps); "
                 "the logits of the rest")
      ->capture_default_str();
  lg->add_option("--backend", o->backend, "cpu, cuda or cuda:N")->capture_default_str();
  lg->add_option("--threads", o->threads, "attention threads (0 = all cores)");
  lg->add_option("--attention", o->attention,
                  "every layer's attention: dense, ba_att[:density=0.5,block=64,min_tokens=1024,sort=true], "
                  "mean_pool[:density=0.5], xattention[:density=0.5,stride=8], quest[:budget=256], "
                  "losa[:budget=256,k=4] (docs/dlm.md)")
      ->capture_default_str();
  lg->add_option("--attention-layers", o->attention_layers, "per-layer overrides LAYERS=METHOD, e.g. 0,1,31=dense")
      ->allow_extra_args(false);
  lg->add_flag("--quiet", o->quiet, "no summary line");
  add_gemm_flag(lg, o.get());
  add_dump_flags(lg, o.get());
  out.push_back({lg, [o] { return run_logits(*o); }});

  CLI::App* tk = app.add_subcommand("tokenize", "encode text (or --decode ids) with a tokenizer.json");
  tk->add_option("--tokenizer", o->tokenizer, "tokenizer.json")->required();
  tk->add_option("--text", o->text, "text to encode");
  tk->add_option("--decode", o->decode, "ids 1,2,3 to decode");
  tk->add_flag("--json", o->json, "print JSON");
  out.push_back({tk, [o] { return run_tokenize(*o); }});

  CLI::App* chat = app.add_subcommand(
      "chat", "talk to an instruct / chat diffusion LM: each stdin line is a turn, through its chat template");
  chat->add_option("--model", o->model, "model directory (config.json, safetensors, tokenizer.json, chat template)")
      ->required();
  chat->add_option("--system", o->system, "a system message before the conversation");
  chat->add_option("--chat-template", o->chat_template, "this .jinja file instead of the model's template");
  chat->add_option("--chat-vars", o->chat_vars, "more template variables as a JSON object")->capture_default_str();
  chat->add_option("--tokenizer", o->tokenizer, "tokenizer.json (default: the model directory's)");
  chat->add_option("--loop", o->loop, "as generate's");
  chat->add_option("--confidence", o->confidence, "probability, margin or entropy (as generate's)");
  chat->add_option("--gen-len", o->gen_len, "tokens per reply at most")->capture_default_str();
  chat->add_option("--block-len", o->block_len, "tokens per block (remask, prefix_cache, dual_cache)")
      ->capture_default_str();
  chat->add_option("--steps", o->steps, "as generate's");
  chat->add_option("--threshold", o->threshold, "confidence threshold for parallel decoding")->capture_default_str();
  chat->add_option("--factor", o->factor, "as generate's")->capture_default_str();
  chat->add_option("--unmask", o->unmask, "as generate's")->capture_default_str();
  chat->add_option("--eb-threshold", o->eb_threshold, "as generate's")->capture_default_str();
  chat->add_option("--temperature", o->temperature, "0: argmax; > 0: Gumbel-max sampling")->capture_default_str();
  chat->add_option("--top-p", o->top_p, "as generate's")->capture_default_str();
  chat->add_option("--top-k", o->top_k, "as generate's")->capture_default_str();
  chat->add_option("--alg-temp", o->alg_temp, "as generate's")->capture_default_str();
  chat->add_option("--sub-block", o->sub_block, "as generate's")->capture_default_str();
  chat->add_option("--seed", o->seed, "sampling seed of the first turn (the next turns: seed + turn)")
      ->capture_default_str();
  chat->add_option("--backend", o->backend, "cpu, cuda or cuda:N")->capture_default_str();
  chat->add_option("--threads", o->threads, "attention threads (0 = all cores)");
  chat->add_option("--attention", o->attention, "every layer's attention (as generate's)")->capture_default_str();
  chat->add_option("--attention-layers", o->attention_layers, "per-layer overrides LAYERS=METHOD")
      ->allow_extra_args(false);
  chat->add_option("--eos-ids", o->eos_ids, "EOS ids 1,2 (default: config.json's eos_token_id)");
  chat->add_flag("--ban-eos", o->ban_eos, "never sample EOS");
  chat->add_flag("--json", o->json,
                 "one JSON line per turn (turn, prompt_tokens, reused_tokens, forward_tokens, seconds, tokens, text) "
                 "instead of the text");
  chat->add_flag("--no-prompt-cache", o->no_prompt_cache,
                 "prefill the whole conversation every turn (default: a block-diffusion model on the cpu reuses the "
                 "K/V of the blocks the turns share)");
  add_gemm_flag(chat, o.get());
  out.push_back({chat, [o] { return run_chat(*o); }});

  CLI::App* ct = app.add_subcommand("chat-template", "render a model's chat template (what generate --chat feeds it)");
  ct->add_option("--model", o->model, "model directory (its chat template, special tokens and tokenizer.json)");
  ct->add_option("--template", o->chat_template, "a .jinja file instead of the model's template");
  ct->add_option("--prompt", o->prompts, "the user's message")->allow_extra_args(false);
  ct->add_option("--system", o->system, "a system message before the user's");
  ct->add_option("--messages", o->messages,
                 "a JSON file: a list of {role, content, ...} messages, or a whole context "
                 "({\"messages\": [...], \"tools\": [...], ...})");
  ct->add_flag("--no-generation-prompt", o->no_generation_prompt, "do not open the assistant's turn");
  ct->add_option("--vars", o->chat_vars, "more template variables as a JSON object")->capture_default_str();
  ct->add_flag("--ids", o->show_ids, "also the token ids (the model's tokenizer.json, or --tokenizer)");
  ct->add_option("--tokenizer", o->tokenizer, "tokenizer.json for --ids");
  ct->add_flag("--json", o->json, "print JSON");
  out.push_back({ct, [o] { return run_chat_template(*o); }});

  CLI::App* model = app.add_subcommand("model", "inspect a model directory");
  CLI::App* info = model->add_subcommand("info", "architecture, shapes, dtypes and parameters of a model directory");
  model->require_subcommand(1);
  info->add_option("dir", o->model, "model directory")->required();
  info->add_flag("--json", o->json, "print JSON");
  out.push_back({model, [o] { return run_info(*o); }});
  return out;
}

}  // namespace sparsa::cli
