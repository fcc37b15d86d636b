// A model's chat template (include/sparsa/dlm.h, ChatTemplate): where a Hugging Face model
// directory keeps it, the special tokens it is rendered with, and the context transformers'
// apply_chat_template gives it (messages, tools = documents = None, add_generation_prompt, the
// special tokens, the caller's extra variables). The rendering is jinja_render.cpp's.
#include <filesystem>

#include "jinja.h"
#include "sparsa/dlm.h"
#include "sparsa/io.h"

namespace sparsa::dlm {

using OrderedJson = nlohmann::ordered_json;

struct ChatTemplate::Impl {
  std::string source;
  jinja::Template compiled;
  OrderedJson special_tokens;  // an object
};

namespace {

// The special tokens transformers puts into every render (its special_tokens_map).
constexpr const char* kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                          "pad_token", "cls_token", "mask_token"};

Result<std::string> read_text(const std::filesystem::path& path) { return read_text_file(path.string()); }

// A token written as "text" or as an AddedToken object {"content": "text", ...}.
Result<std::string> token_text(const OrderedJson& v, const std::string& where) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return invalid_argument(where + ": expected a string or an object with a string 'content', got " + v.dump());
}

Result<OrderedJson> special_tokens_of(const OrderedJson& config, const std::string& where) {
  OrderedJson tokens = OrderedJson::object();
  for (const char* name : kSpecialTokens) {
    if (!config.contains(name) || config[name].is_null()) continue;
    auto text = token_text(config[name], where + ": " + name);
    if (!text.ok()) return text.status();
    tokens[name] = text.value();
  }
  if (config.contains("additional_special_tokens") && !config["additional_special_tokens"].is_null()) {
    const OrderedJson& list = config["additional_special_tokens"];
    if (!list.is_array()) return invalid_argument(where + ": additional_special_tokens: expected a list");
    OrderedJson texts = OrderedJson::array();
    for (size_t i = 0; i < list.size(); ++i) {
      auto text = token_text(list[i], where + ": additional_special_tokens[" + std::to_string(i) + "]");
      if (!text.ok()) return text.status();
      texts.push_back(text.value());
    }
    tokens["additional_special_tokens"] = std::move(texts);
  }
  return tokens;
}

// tokenizer_config.json's (or chat_template.json's) "chat_template": a string, or a list of
// named templates of which "default" is the chat one.
Result<std::string> template_field(const OrderedJson& config, const std::string& where) {
  const OrderedJson& t = config["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {
    for (size_t i = 0; i < t.size(); ++i) {
      const OrderedJson& e = t[i];
      if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") ||
          !e["template"].is_string()) {
        return invalid_argument(where + ": chat_template[" + std::to_string(i) +
                                "]: expected an object with string 'name' and 'template'");
      }
      if (e["name"] == "default") return e["template"].get<std::string>();
    }
    return invalid_argument(where + ": chat_template: a list of templates without one named 'default'");
  }
  return invalid_argument(where + ": chat_template: expected a string or a list of {name, template}, got " +
                          std::string(t.type_name()));
}

Result<OrderedJson> parse_object(const std::string& text, const std::string& where) {
  OrderedJson j = OrderedJson::parse(text, nullptr, false);
  if (j.is_discarded()) return invalid_argument(where + ": not valid JSON");
  if (!j.is_object()) return invalid_argument(where + ": expected a JSON object");
  return j;
}

}  // namespace

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(const ChatTemplate& other) : impl_(std::make_unique<Impl>(*other.impl_)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

Result<ChatTemplate> ChatTemplate::parse(const std::string& source, const std::string& special_tokens_json,
                                         const std::string& where) {
  auto tokens = parse_object(special_tokens_json, where + ": special tokens");
  if (!tokens.ok()) return tokens.status();
  auto compiled = jinja::Template::parse(source, where);
  if (!compiled.ok()) return compiled.status();
  return ChatTemplate(std::make_unique<Impl>(Impl{source, std::move(compiled.value()), std::move(tokens.value())}));
}

Result<ChatTemplate> ChatTemplate::load(const std::string& model_dir, const std::string& template_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  OrderedJson tokens = OrderedJson::object();
  std::string source, where;
  if (!template_path.empty()) {
    auto text = read_text(template_path);
    if (!text.ok()) return text.status();
    source = text.value();
    where = template_path;
  }
  if (!model_dir.empty()) {
    if (!fs::is_directory(model_dir, ec)) return Status(StatusCode::io_error, model_dir + ": not a model directory");
    const fs::path dir(model_dir);
    const fs::path config_path = dir / "tokenizer_config.json";
    if (fs::exists(config_path, ec)) {
      auto text = read_text(config_path);
      if (!text.ok()) return text.status();
      auto config = parse_object(text.value(), config_path.string());
      if (!config.ok()) return config.status();
      auto special = special_tokens_of(config.value(), config_path.string());
      if (!special.ok()) return special.status();
      tokens = std::move(special.value());
      if (where.empty() && config->contains("chat_template") && !(*config)["chat_template"].is_null()) {
        auto t = template_field(config.value(), config_path.string());
        if (!t.ok()) return t.status();
        source = t.value();
        where = config_path.string() + ": chat_template";
      }
    }
    const fs::path jinja_path = dir / "chat_template.jinja", json_path = dir / "chat_template.json";
    if (template_path.empty() && fs::exists(jinja_path, ec)) {  // transformers: the .jinja file wins
      auto text = read_text(jinja_path);
      if (!text.ok()) return text.status();
      source = text.value();
      where = jinja_path.string();
    } else if (where.empty() && fs::exists(json_path, ec)) {
      auto text = read_text(json_path);
      if (!text.ok()) return text.status();
      auto config = parse_object(text.value(), json_path.string());
      if (!config.ok()) return config.status();
      if (!config->contains("chat_template")) return invalid_argument(json_path.string() + ": no 'chat_template'");
      auto t = template_field(config.value(), json_path.string());
      if (!t.ok()) return t.status();
      source = t.value();
      where = json_path.string() + ": chat_template";
    }
  }
  if (where.empty()) {
    return invalid_argument((model_dir.empty() ? std::string("no model directory") : model_dir) +
                            ": no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
                            "a base model takes plain prompts");
  }
  auto compiled = jinja::Template::parse(source, where);
  if (!compiled.ok()) return compiled.status();
  return ChatTemplate(std::make_unique<Impl>(Impl{std::move(source), std::move(compiled.value()), std::move(tokens)}));
}

Result<std::string> ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                         const std::string& extra_json) const {
  OrderedJson context = OrderedJson::object();
  OrderedJson list = OrderedJson::array();
  for (const ChatMessage& m : messages) list.push_back(OrderedJson{{"role", m.role}, {"content", m.content}});
  context["messages"] = std::move(list);
  context["add_generation_prompt"] = add_generation_prompt;
  auto extra = parse_object(extra_json, "chat template variables");
  if (!extra.ok()) return extra.status();
  for (const auto& [k, v] : extra->items()) context[k] = v;
  return render_json(context.dump());
}

Result<std::string> ChatTemplate::render_json(const std::string& context_json) const {
  auto given = parse_object(context_json, "chat template context");
  if (!given.ok()) return given.status();
  if (!given->contains("messages") || !(*given)["messages"].is_array()) {
    return invalid_argument("chat template context: 'messages' must be a list");
  }
  // transformers' order: messages, tools, documents, add_generation_prompt, the special tokens,
  // then the caller's variables (which win).
  OrderedJson context = OrderedJson::object();
  context["messages"] = (*given)["messages"];
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = true;
  for (const auto& [k, v] : impl_->special_tokens.items()) context[k] = v;
  for (const auto& [k, v] : given->items()) context[k] = v;
  return impl_->compiled.render(context);
}

const std::string& ChatTemplate::source() const { return impl_->source; }

}  // namespace sparsa::dlm
