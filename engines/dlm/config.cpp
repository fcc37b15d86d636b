// config.json: parsed and validated once; every error names the field.
//
// llada (LLaDA's OLMo-derived config):  d_model, n_layers, n_heads, n_kv_heads (null: MHA),
//   mlp_hidden_size, vocab_size, embedding_size (optional), rms_norm_eps (optional, 1e-5),
//   rope_theta, rope_scaling (optional), max_sequence_length, mask_token_id, eos_token_id,
//   weight_tying; the features the engine does not implement (alibi, biases, QK layer norm,
//   non-llama blocks, non-RMS norms, non-SiLU activations, rope off) are refused by name.
// sdar (Qwen3 shape):  hidden_size, num_hidden_layers, num_attention_heads,
//   num_key_value_heads, head_dim (optional: hidden_size / heads), intermediate_size,
//   vocab_size, rms_norm_eps, rope_theta, rope_scaling, max_position_embeddings, block_size,
//   mask_token_id, eos_token_id, tie_word_embeddings, attention_bias (must be false).
// dream (Qwen2 shape, model_type "Dream"):  hidden_size, num_hidden_layers, num_attention_heads,
//   num_key_value_heads, intermediate_size, vocab_size, rms_norm_eps, rope_theta, rope_scaling,
//   max_position_embeddings, mask_token_id, eos_token_id, tie_word_embeddings; biases on q, k,
//   v; hidden_act silu; no sliding window.
// fast_dllm (Fast-dLLM v2, model_type "Fast_dLLM_Qwen"): dream's fields, bd_size (optional, 32:
//   the block), mask_token_id (optional, 151665: the id its generate() uses); block-causal.
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "sparsa/dlm.h"

namespace sparsa::dlm {

namespace {

using Json = nlohmann::json;

struct Fields {
  const Json& j;
  std::string where;

  Status error(const std::string& field, const std::string& problem) const {
    return invalid_argument(where + ": '" + field + "' " + problem);
  }
  bool has(const char* f) const { return j.contains(f) && !j[f].is_null(); }

  // An integer in [lo, hi].
  Status integer(const char* f, int64_t* out, int64_t lo = 1, int64_t hi = std::numeric_limits<int32_t>::max()) const {
    if (!j.contains(f)) return error(f, "is missing (expected an integer)");
    const Json& v = j[f];
    if (!v.is_number_integer()) return error(f, "must be an integer, got " + v.dump());
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
      return error(f, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v.dump());
    }
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) {
      return error(f, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v.dump());
    }
    *out = x;
    return Status::Ok();
  }
  Status number(const char* f, double* out, bool positive = true) const {
    if (!j.contains(f)) return error(f, "is missing (expected a number)");
    const Json& v = j[f];
    if (!v.is_number()) return error(f, "must be a number, got " + v.dump());
    const double x = v.get<double>();
    if (!std::isfinite(x) || (positive && !(x > 0))) return error(f, "must be a finite number > 0, got " + v.dump());
    *out = x;
    return Status::Ok();
  }
  Status boolean(const char* f, bool* out) const {
    if (!j.contains(f)) return error(f, "is missing (expected true or false)");
    if (!j[f].is_boolean()) return error(f, "must be true or false, got " + j[f].dump());
    *out = j[f].get<bool>();
    return Status::Ok();
  }
  // An optional field that must, when present, hold `expected` (a feature the engine lacks).
  Status must_be(const char* f, const Json& expected, const std::string& why) const {
    if (!has(f)) return Status::Ok();
    if (j[f] != expected) {
      return Status(StatusCode::unsupported, where + ": '" + f + "' = " + j[f].dump() + " is not supported (expected " +
                                                 expected.dump() + "): " + why);
    }
    return Status::Ok();
  }
  Status string(const char* f, std::string* out) const {
    if (!j.contains(f)) return error(f, "is missing (expected a string)");
    if (!j[f].is_string()) return error(f, "must be a string, got " + j[f].dump());
    *out = j[f].get<std::string>();
    return Status::Ok();
  }
};

Status parse_rope(const Fields& f, Config* c) {
  SPARSA_RETURN_IF_ERROR(f.number("rope_theta", &c->rope.theta));
  if (!f.has("rope_scaling")) return Status::Ok();
  const Json& rs = f.j["rope_scaling"];
  if (!rs.is_object()) return f.error("rope_scaling", "must be an object or null, got " + rs.dump());
  const Fields sf{rs, f.where + ": rope_scaling"};
  std::string type;
  if (rs.contains("rope_type")) {
    SPARSA_RETURN_IF_ERROR(sf.string("rope_type", &type));
  } else if (rs.contains("type")) {
    SPARSA_RETURN_IF_ERROR(sf.string("type", &type));
  } else {
    return f.error("rope_scaling", "has neither 'rope_type' nor 'type'");
  }
  if (type == "default") return Status::Ok();
  if (type != "linear" && type != "dynamic" && type != "ntk") {
    return Status(StatusCode::unsupported, f.where + ": 'rope_scaling.rope_type' = \"" + type +
                                               "\" is not supported (expected default, linear, dynamic or ntk)");
  }
  SPARSA_RETURN_IF_ERROR(sf.number("factor", &c->rope.factor));
  c->rope.scaling = type == "linear" ? "linear" : "ntk";
  return Status::Ok();
}

Status parse_eos(const Fields& f, Config* c) {
  if (!f.has("eos_token_id")) return Status::Ok();
  const Json& v = f.j["eos_token_id"];
  auto one = [&](const Json& x) -> Status {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= c->vocab_size) {
      return f.error("eos_token_id", "must be ids in [0, vocab_size), got " + v.dump());
    }
    c->eos_token_ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
    return Status::Ok();
  };
  if (v.is_array()) {
    for (const Json& x : v) SPARSA_RETURN_IF_ERROR(one(x));
    return Status::Ok();
  }
  return one(v);
}

Status parse_llada(const Fields& f, Config* c) {
  c->arch = Arch::llada;
  SPARSA_RETURN_IF_ERROR(f.integer("d_model", &c->dim));
  SPARSA_RETURN_IF_ERROR(f.integer("n_layers", &c->n_layers, 1, 4096));
  SPARSA_RETURN_IF_ERROR(f.integer("n_heads", &c->n_heads, 1, 4096));
  if (f.has("n_kv_heads")) {
    SPARSA_RETURN_IF_ERROR(f.integer("n_kv_heads", &c->n_kv_heads, 1, 4096));
  } else {
    c->n_kv_heads = c->n_heads;
  }
  SPARSA_RETURN_IF_ERROR(f.integer("mlp_hidden_size", &c->hidden_dim));
  SPARSA_RETURN_IF_ERROR(f.integer("vocab_size", &c->vocab_size));
  if (f.has("embedding_size")) {
    int64_t e = 0;
    SPARSA_RETURN_IF_ERROR(f.integer("embedding_size", &e));
    if (e < c->vocab_size)
      return f.error("embedding_size", "must be >= vocab_size (" + std::to_string(c->vocab_size) + ")");
    c->vocab_size = e;
  }
  if (f.j.contains("rms_norm_eps")) SPARSA_RETURN_IF_ERROR(f.number("rms_norm_eps", &c->norm_eps));
  SPARSA_RETURN_IF_ERROR(f.integer("max_sequence_length", &c->max_seq_len));
  if (f.j.contains("weight_tying")) SPARSA_RETURN_IF_ERROR(f.boolean("weight_tying", &c->tied_embeddings));
  if (c->dim % c->n_heads != 0) {
    return f.error("n_heads",
                   "must divide d_model (" + std::to_string(c->dim) + "), got " + std::to_string(c->n_heads));
  }
  c->head_dim = c->dim / c->n_heads;
  SPARSA_RETURN_IF_ERROR(f.must_be("rope", true, "the engine implements RoPE models only"));
  SPARSA_RETURN_IF_ERROR(f.must_be("alibi", false, "ALiBi is not implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("include_bias", false, "linear biases are not implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("include_qkv_bias", false, "QKV biases are not implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("attention_layer_norm", false, "QK layer norm is not implemented for llada"));
  SPARSA_RETURN_IF_ERROR(f.must_be("block_type", "llama", "only LLaDA's llama block is implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("layer_norm_type", "rms", "only RMSNorm is implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("activation_type", "silu", "only SwiGLU (silu) is implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("scale_logits", false, "logit scaling is not implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("input_emb_norm", false, "embedding norm is not implemented"));
  return Status::Ok();
}

Status parse_sdar(const Fields& f, Config* c) {
  c->arch = Arch::sdar;
  c->qk_norm = true;
  SPARSA_RETURN_IF_ERROR(f.integer("hidden_size", &c->dim));
  SPARSA_RETURN_IF_ERROR(f.integer("num_hidden_layers", &c->n_layers, 1, 4096));
  SPARSA_RETURN_IF_ERROR(f.integer("num_attention_heads", &c->n_heads, 1, 4096));
  SPARSA_RETURN_IF_ERROR(f.integer("num_key_value_heads", &c->n_kv_heads, 1, 4096));
  if (f.has("head_dim")) {
    SPARSA_RETURN_IF_ERROR(f.integer("head_dim", &c->head_dim, 1, 4096));
  } else {
    if (c->dim % c->n_heads != 0)
      return f.error("num_attention_heads", "must divide hidden_size when head_dim is absent");
    c->head_dim = c->dim / c->n_heads;
  }
  SPARSA_RETURN_IF_ERROR(f.integer("intermediate_size", &c->hidden_dim));
  SPARSA_RETURN_IF_ERROR(f.integer("vocab_size", &c->vocab_size));
  SPARSA_RETURN_IF_ERROR(f.number("rms_norm_eps", &c->norm_eps));
  SPARSA_RETURN_IF_ERROR(f.integer("max_position_embeddings", &c->max_seq_len));
  SPARSA_RETURN_IF_ERROR(f.integer("block_size", &c->block_size, 1, 1 << 20));
  if (f.j.contains("tie_word_embeddings"))
    SPARSA_RETURN_IF_ERROR(f.boolean("tie_word_embeddings", &c->tied_embeddings));
  SPARSA_RETURN_IF_ERROR(f.must_be("attention_bias", false, "attention biases are not implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("hidden_act", "silu", "only SwiGLU (silu) is implemented"));
  return Status::Ok();
}

Status parse_dream(const Fields& f, Config* c) {
  c->arch = Arch::dream;
  c->qkv_bias = true;
  c->shifted_logits = true;
  SPARSA_RETURN_IF_ERROR(f.integer("hidden_size", &c->dim));
  SPARSA_RETURN_IF_ERROR(f.integer("num_hidden_layers", &c->n_layers, 1, 4096));
  SPARSA_RETURN_IF_ERROR(f.integer("num_attention_heads", &c->n_heads, 1, 4096));
  SPARSA_RETURN_IF_ERROR(f.integer("num_key_value_heads", &c->n_kv_heads, 1, 4096));
  if (c->dim % c->n_heads != 0) return f.error("num_attention_heads", "must divide hidden_size");
  c->head_dim = c->dim / c->n_heads;
  SPARSA_RETURN_IF_ERROR(f.integer("intermediate_size", &c->hidden_dim));
  SPARSA_RETURN_IF_ERROR(f.integer("vocab_size", &c->vocab_size));
  SPARSA_RETURN_IF_ERROR(f.number("rms_norm_eps", &c->norm_eps));
  SPARSA_RETURN_IF_ERROR(f.integer("max_position_embeddings", &c->max_seq_len));
  if (f.j.contains("tie_word_embeddings"))
    SPARSA_RETURN_IF_ERROR(f.boolean("tie_word_embeddings", &c->tied_embeddings));
  SPARSA_RETURN_IF_ERROR(f.must_be("hidden_act", "silu", "only SwiGLU (silu) is implemented"));
  SPARSA_RETURN_IF_ERROR(f.must_be("use_sliding_window", false, "sliding-window attention is not implemented"));
  return Status::Ok();
}

Status parse_fast_dllm(const Fields& f, Config* c) {
  SPARSA_RETURN_IF_ERROR(parse_dream(f, c));
  c->arch = Arch::fast_dllm;
  c->block_size = 32;  // Fast_dLLM_QwenConfig's default bd_size
  if (f.j.contains("bd_size")) SPARSA_RETURN_IF_ERROR(f.integer("bd_size", &c->block_size, 1, 1 << 20));
  return Status::Ok();
}

}  // namespace

const char* arch_name(Arch arch) {
  switch (arch) {
    case Arch::llada: return "llada";
    case Arch::sdar: return "sdar";
    case Arch::dream: return "dream";
    case Arch::fast_dllm: return "fast_dllm";
  }
  return "?";
}

namespace {
Result<Config> parse_config_json(const std::string& json_text, const std::string& where) {
  Json j;
  try {
    j = Json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) return invalid_argument(where + ": expected a JSON object, got " + std::string(j.type_name()));
  const Fields f{j, where};
  std::string model_type;
  SPARSA_RETURN_IF_ERROR(f.string("model_type", &model_type));
  Config c;
  if (model_type == "llada") {
    SPARSA_RETURN_IF_ERROR(parse_llada(f, &c));
  } else if (model_type == "sdar") {
    SPARSA_RETURN_IF_ERROR(parse_sdar(f, &c));
  } else if (model_type == "Dream" || model_type == "dream") {
    SPARSA_RETURN_IF_ERROR(parse_dream(f, &c));
  } else if (model_type == "Fast_dLLM_Qwen" || model_type == "fast_dllm") {
    SPARSA_RETURN_IF_ERROR(parse_fast_dllm(f, &c));
  } else {
    return Status(StatusCode::unsupported, where + ": 'model_type' = \"" + model_type +
                                               "\" is not supported (expected llada, sdar, Dream or Fast_dLLM_Qwen)");
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return f.error(
        c.arch == Arch::llada ? "n_kv_heads" : "num_key_value_heads",
        "must divide the query heads (" + std::to_string(c.n_heads) + "), got " + std::to_string(c.n_kv_heads));
  }
  if (c.head_dim % 2 != 0) return f.error("head_dim", "must be even for RoPE, got " + std::to_string(c.head_dim));
  SPARSA_RETURN_IF_ERROR(parse_rope(f, &c));
  int64_t mask = 0;
  if (c.arch == Arch::fast_dllm && !f.j.contains("mask_token_id")) {
    mask = 151665;  // Fast-dLLM v2's generate() default: its configs carry no mask id
    if (mask >= c.vocab_size) return f.error("mask_token_id", "is missing, and the default 151665 is outside the vocabulary");
  } else {
    SPARSA_RETURN_IF_ERROR(f.integer("mask_token_id", &mask, 0, c.vocab_size - 1));
  }
  c.mask_token_id = static_cast<int32_t>(mask);
  SPARSA_RETURN_IF_ERROR(parse_eos(f, &c));
  return c;
}
}  // namespace

Result<Config> parse_config(const std::string& json_text, const std::string& where) {
  try {
    return parse_config_json(json_text, where);
  } catch (const nlohmann::json::exception& e) {  // a value of an unexpected type deep inside
    return invalid_argument(where + ": malformed: " + e.what());
  }
}

}  // namespace sparsa::dlm
