// The chat-template interpreter's values as Python shows and compares them (jinja_values.cpp).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "jinja_ast.h"

namespace sparsa::dlm::jinja {

// A string's characters (UTF-8 code points; a byte that does not start a valid sequence is one
// character of its own), and one character's code point.
std::vector<std::string_view> characters(std::string_view s);
uint32_t code_point(std::string_view ch);
bool is_python_space(uint32_t c);  // str.isspace() of one character

std::string type_name(const Value& v);  // Python's: "str", "int", "NoneType", ...
std::string python_float(double x);     // repr(float)
std::string str(const Value& v);        // str(v); an undefined value is ""
std::string repr(const Value& v);       // repr(v), as inside a printed list
bool truthy(const Value& v);
bool equal(const Value& a, const Value& b);           // Python's ==
bool less(const Value& a, const Value& b, int line);  // Python's <; types without an order fail
const Value* find(const Dict& d, const std::string& key);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys): transformers' tojson.
struct JsonStyle {
  int indent = -1;  // < 0: one line
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
std::string to_json(const Value& v, const JsonStyle& style, int line);

Value from_json(const nlohmann::ordered_json& j, int depth = 0);

}  // namespace sparsa::dlm::jinja
