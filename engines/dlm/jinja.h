// A Jinja interpreter for the part of the language Hugging Face chat templates use
// (docs/dlm.md, "Chat templates"), written for sparsa. It renders as transformers'
// apply_chat_template does: trim_blocks and lstrip_blocks on, one trailing newline of the source
// dropped, {% break %} / {% continue %}, undefined names render empty, no autoescape, tojson with
// Python's json.dumps spacing, and the sandbox's limits (range() at most 100,000 items).
//
// Covered: {{ }}, {% %} and {# #} with - / + whitespace control; if / elif / else, for (tuple
// targets, an `if` filter, else, the loop variable), set (names, tuples, namespace attributes,
// block set), macro, raw, generation; literals, lists, dicts, tuples; attribute, item and slice
// access; the operators with Jinja's precedence; the usual filters, tests, str / dict methods, and
// the globals namespace(), range(), raise_exception(), strftime_now(). Anything else is an error
// naming the template line, never a silent empty render.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "sparsa/status.h"

namespace sparsa::dlm::jinja {

struct Program;  // the parsed template (jinja.cpp)

class Template {
 public:
  // `where` prefixes every message ("DIR/tokenizer_config.json: chat_template line 3: ...").
  static Result<Template> parse(const std::string& source, const std::string& where);
  // `context`: a JSON object whose members are the template's variables.
  Result<std::string> render(const nlohmann::ordered_json& context) const;

 private:
  Template(std::shared_ptr<const Program> program, std::string where);
  std::shared_ptr<const Program> program_;
  std::string where_;
};

}  // namespace sparsa::dlm::jinja
