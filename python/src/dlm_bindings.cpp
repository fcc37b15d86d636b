// The DLM engine's part of the binding (sparsa._sparsa.Model, Tokenizer, ChatTemplate): kept in
// its own file so the engine's bindings do not grow the attention ones; sparsa_ext.cpp calls
// bind_dlm() from its module. Status errors become ValueError (bad input) or RuntimeError (files).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "sparsa/dlm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparsa {

namespace {

[[noreturn]] void raise_dlm(const Status& s) {
  if (s.code() == StatusCode::io_error || s.code() == StatusCode::malformed_file ||
      s.code() == StatusCode::unsupported) {
    throw std::runtime_error(s.message());
  }
  throw nb::value_error(s.message().c_str());
}

template <class T>
T take(Result<T>&& r) {
  if (!r.ok()) raise_dlm(r.status());
  return std::move(r).value();
}

nb::dict config_dict(const dlm::Config& c) {
  nb::dict d;
  d["arch"] = dlm::arch_name(c.arch);
  d["dim"] = c.dim;
  d["layers"] = c.n_layers;
  d["heads"] = c.n_heads;
  d["kv_heads"] = c.n_kv_heads;
  d["head_dim"] = c.head_dim;
  d["hidden_dim"] = c.hidden_dim;
  d["vocab_size"] = c.vocab_size;
  d["max_seq_len"] = c.max_seq_len;
  d["rope_theta"] = c.rope.theta;
  d["rope_scaling"] = c.rope.scaling;
  d["rope_factor"] = c.rope.factor;
  d["mask_token_id"] = c.mask_token_id;
  d["eos_token_ids"] = c.eos_token_ids;
  d["block_size"] = c.block_size;
  d["tied_embeddings"] = c.tied_embeddings;
  return d;
}

}  // namespace

void bind_dlm(nb::module_& m) {
  nb::class_<dlm::Model>(m, "Model", "A diffusion LM loaded from a Hugging Face model directory (docs/dlm.md).")
      .def_static(
          "load",
          [](const std::string& dir, const std::string& backend, int num_threads, const std::string& attention,
             const std::vector<std::string>& attention_layers, const std::string& dump_attention,
             const std::vector<int>& dump_layers, const std::vector<int64_t>& dump_forwards, int64_t dump_max) {
            dlm::LoadOptions o;
            o.backend = backend;
            o.num_threads = num_threads;
            o.attention = attention;
            o.attention_layers = attention_layers;
            o.dump_attention.dir = dump_attention;
            o.dump_attention.layers = dump_layers;
            o.dump_attention.forwards = dump_forwards;
            o.dump_attention.max_files = dump_max;
            return take(dlm::Model::load(dir, o));
          },
          "dir"_a, "backend"_a = "cpu", "num_threads"_a = 0, "attention"_a = "dense",
          "attention_layers"_a = std::vector<std::string>{}, "dump_attention"_a = "",
          "dump_layers"_a = std::vector<int>{}, "dump_forwards"_a = std::vector<int64_t>{}, "dump_max"_a = 256,
          "Load config.json and model.safetensors (or the sharded index) from `dir`. dump_attention: a new or "
          "empty directory that receives the attention inputs of the selected layers and forward passes "
          "(cpu backend; docs/dlm.md).")
      .def_prop_ro("attention_dump_counts",
                   [](const dlm::Model& m) {
                     const dlm::AttentionDumpCounts n = m.attention_dump_counts();
                     return std::make_pair(n.written, n.skipped);
                   },
                   "(files written, selected beyond dump_max) of the attention capture")
      .def_prop_ro("config", [](const dlm::Model& m) { return config_dict(m.config()); })
      .def_prop_ro("default_loop", [](const dlm::Model& m) { return std::string(dlm::loop_name(m.default_loop())); })
      .def(
          "logits",
          [](const dlm::Model& m, const std::vector<int32_t>& ids, int64_t cached) {
            std::vector<float> v;
            {
              nb::gil_scoped_release release;
              auto r = m.logits(ids, cached);
              if (!r.ok()) {
                nb::gil_scoped_acquire acquire;
                raise_dlm(r.status());
              }
              v = std::move(r.value());
            }
            auto* owned = new std::vector<float>(std::move(v));
            nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
            const size_t shape[2] = {ids.size() - static_cast<size_t>(cached), static_cast<size_t>(m.config().vocab_size)};
            return nb::ndarray<nb::numpy, float, nb::ndim<2>>(owned->data(), 2, shape, owner);
          },
          "ids"_a, "cached"_a = 0,
          "Logits f32 [len(ids) - cached, vocab] of one forward pass with the architecture's own attention pattern "
          "(cached > 0: the first ids run into the KV cache first).")
      .def(
          "generate",
          [](const dlm::Model& m, const std::vector<std::vector<int32_t>>& prompts, int64_t gen_len, int64_t block_len,
             int64_t steps, double threshold, double temperature, uint64_t seed, const std::string& loop,
             bool stop_at_eos, bool ban_eos, const std::vector<int32_t>& eos_ids, const std::string& confidence,
             double top_p, int64_t top_k, double alg_temp, int64_t sub_block, dlm::PromptCache* cache,
             double factor, const std::string& unmask, double eb_threshold) {
            dlm::GenerateOptions o;
            o.loop = loop.empty() ? m.default_loop() : take(dlm::parse_loop(loop));
            o.confidence = confidence.empty() ? dlm::default_confidence(o.loop) : take(dlm::parse_confidence(confidence));
            o.gen_len = gen_len;
            o.block_len = block_len;
            o.steps = steps > 0 ? steps
                                : (o.loop == dlm::Loop::block ? std::max<int64_t>(m.config().block_size, 1) : gen_len);
            o.threshold = threshold;
            o.factor = factor;
            o.unmask = take(dlm::parse_unmask(unmask));
            o.eb_threshold = eb_threshold;
            o.temperature = temperature;
            o.top_p = top_p;
            o.top_k = top_k;
            o.alg_temp = alg_temp;
            o.sub_block = sub_block;
            o.seed = seed;
            o.stop_at_eos = stop_at_eos;
            o.ban_eos = ban_eos;
            o.eos_ids = eos_ids;
            Result<dlm::GenerateResult> r = Status(StatusCode::internal, "not run");
            {
              nb::gil_scoped_release release;
              r = m.generate(prompts, o, {}, cache);
            }
            return take(std::move(r)).tokens;
          },
          "prompts"_a, "gen_len"_a = 128, "block_len"_a = 32, "steps"_a = 0, "threshold"_a = 0.0, "temperature"_a = 0.0,
          "seed"_a = 0, "loop"_a = "", "stop_at_eos"_a = true, "ban_eos"_a = false,
          "eos_ids"_a = std::vector<int32_t>{}, "confidence"_a = "", "top_p"_a = 1.0, "top_k"_a = 0, "alg_temp"_a = 0.0, "sub_block"_a = 8,
          "cache"_a.none() = nb::none(), "factor"_a = 0.0, "unmask"_a = "confidence", "eb_threshold"_a = 0.35,
          "Generate for a batch of prompts (lists of ids); returns the generated ids of each. cache: a "
          "PromptCache (one prompt; block and fast_dllm loops; cpu backend).");

  nb::class_<dlm::PromptCache>(m, "PromptCache",
                               "The K/V of whole blocks kept from one generate call to the next (a conversation).")
      .def(nb::init<>())
      .def_prop_ro("tokens", &dlm::PromptCache::tokens, "positions whose K/V it holds")
      .def_prop_ro("last_reused", &dlm::PromptCache::last_reused, "prompt tokens the last call reused")
      .def("clear", &dlm::PromptCache::clear);

  nb::class_<dlm::Tokenizer>(m, "Tokenizer", "Hugging Face tokenizer.json, byte-level BPE.")
      .def_static(
          "load", [](const std::string& path) { return take(dlm::Tokenizer::load(path)); }, "path"_a)
      .def("encode", &dlm::Tokenizer::encode, "text"_a)
      .def(
          "decode",
          [](const dlm::Tokenizer& t, const std::vector<int32_t>& ids, bool skip_special) {
            return take(t.decode(ids, skip_special));
          },
          "ids"_a, "skip_special"_a = false)
      .def_prop_ro("vocab_size", &dlm::Tokenizer::vocab_size);

  nb::class_<dlm::ChatTemplate>(m, "ChatTemplate",
                                "A model's chat template (Jinja), rendered by sparsa's interpreter (docs/dlm.md).")
      .def_static(
          "load",
          [](const std::string& dir, const std::string& template_path) {
            return take(dlm::ChatTemplate::load(dir, template_path));
          },
          "dir"_a, "template_path"_a = "")
      .def_static(
          "parse",
          [](const std::string& source, const std::string& special_tokens_json) {
            return take(dlm::ChatTemplate::parse(source, special_tokens_json));
          },
          "source"_a, "special_tokens_json"_a = "{}")
      .def(
          "render_json", [](const dlm::ChatTemplate& t, const std::string& context) { return take(t.render_json(context)); },
          "context_json"_a)
      .def_prop_ro("source", &dlm::ChatTemplate::source);
}

}  // namespace sparsa
