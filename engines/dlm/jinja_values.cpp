// The chat-template interpreter's values as Python shows them (jinja.h): str() and repr(), the
// json.dumps text of tojson, truth, equality and order, and strings by code point (Python counts,
// indexes and strips characters, not bytes).
#include "jinja_values.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "utf8.h"

namespace sparsa::dlm::jinja {

namespace {
constexpr size_t kMaxShown = size_t{16} << 20;  // str() or tojson of one value
}  // namespace

std::vector<std::string_view> characters(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t i = 0, n = 0; i < s.size(); i += n) {
    decode_utf8(s, i, &n);  // an ill-formed sequence (its maximal subpart) is one character
    out.push_back(s.substr(i, n));
  }
  return out;
}

uint32_t code_point(std::string_view ch) {
  size_t n = 0;
  const uint32_t cp = decode_utf8(ch, 0, &n);
  return cp >= kInvalidUtf8 ? cp - kInvalidUtf8 : cp;  // an ill-formed one stands for its first byte
}

bool is_python_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined: return "Undefined";
    case Value::Kind::none: return "NoneType";
    case Value::Kind::boolean: return "bool";
    case Value::Kind::integer: return "int";
    case Value::Kind::real: return "float";
    case Value::Kind::string: return "str";
    case Value::Kind::list: return "list";
    case Value::Kind::tuple: return "tuple";
    case Value::Kind::dict: return "dict";
    case Value::Kind::ns: return "Namespace";
    case Value::Kind::function: return "function";
  }
  return "?";
}

// Python's repr of a float: the shortest digits that read back, fixed notation for exponents
// -4..15 (with ".0" when integral), scientific ("1e+16", "1.5e-05") outside.
std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);
  const size_t e_at = sci.find('e');
  std::string mantissa = sci.substr(0, e_at);
  const int exponent = std::stoi(sci.substr(e_at + 1));
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent >= 0) {
      const size_t whole = static_cast<size_t>(exponent) + 1;
      if (digits.size() <= whole) {
        out += digits + std::string(whole - digits.size(), '0') + ".0";
      } else {
        out += digits.substr(0, whole) + "." + digits.substr(whole);
      }
    } else {
      out += "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out + ebuf;
}

namespace {

std::string python_string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (std::string_view ch : characters(s)) {
    const uint32_t c = code_point(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || (ch.size() == 1 && c >= 0x80)) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else if (c == 0x2028 || c == 0x2029) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + quote;
}

}  // namespace

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::string: return python_string_repr(v.text);
    case Value::Kind::undefined: return "";
    default: return str(v);
  }
}

std::string str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined: return "";
    case Value::Kind::none: return "None";
    case Value::Kind::boolean: return v.boolean ? "True" : "False";
    case Value::Kind::integer: return std::to_string(v.integer);
    case Value::Kind::real: return python_float(v.real);
    case Value::Kind::string: return v.text;
    case Value::Kind::list:
    case Value::Kind::tuple: {
      const bool tuple = v.kind == Value::Kind::tuple;
      std::string out = tuple ? "(" : "[";
      for (size_t i = 0; i < v.items->size(); ++i) {
        out += (i ? ", " : "") + repr((*v.items)[i]);
        if (out.size() > kMaxShown) fail(0, "a value prints longer than 16 MiB");
      }
      if (tuple && v.items->size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Value::Kind::dict:
    case Value::Kind::ns: {
      std::string out = v.kind == Value::Kind::ns ? "<Namespace {" : "{";
      for (size_t i = 0; i < v.dict->size(); ++i) {
        out += (i ? ", " : "") + python_string_repr((*v.dict)[i].first) + ": " + repr((*v.dict)[i].second);
        if (out.size() > kMaxShown) fail(0, "a value prints longer than 16 MiB");
      }
      return out + (v.kind == Value::Kind::ns ? "}>" : "}");
    }
    case Value::Kind::function: return "<function " + v.text + ">";
  }
  return "";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined:
    case Value::Kind::none: return false;
    case Value::Kind::boolean: return v.boolean;
    case Value::Kind::integer: return v.integer != 0;
    case Value::Kind::real: return v.real != 0;
    case Value::Kind::string: return !v.text.empty();
    case Value::Kind::list:
    case Value::Kind::tuple: return !v.items->empty();
    case Value::Kind::dict: return !v.dict->empty();
    default: return true;
  }
}

namespace {
double as_real(const Value& v) {
  return v.kind == Value::Kind::real ? v.real : v.kind == Value::Kind::boolean ? (v.boolean ? 1.0 : 0.0)
                                                                               : static_cast<double>(v.integer);
}
int64_t as_int(const Value& v) { return v.kind == Value::Kind::boolean ? (v.boolean ? 1 : 0) : v.integer; }
}  // namespace

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::real || b.kind == Value::Kind::real) return as_real(a) == as_real(b);
    return as_int(a) == as_int(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::undefined:
    case Value::Kind::none: return true;
    case Value::Kind::string: return a.text == b.text;
    case Value::Kind::list:
    case Value::Kind::tuple:
      if (a.items->size() != b.items->size()) return false;
      for (size_t i = 0; i < a.items->size(); ++i) {
        if (!equal((*a.items)[i], (*b.items)[i])) return false;
      }
      return true;
    case Value::Kind::dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [key, value] : *a.dict) {
        const Value* other = find(*b.dict, key);
        if (other == nullptr || !equal(value, *other)) return false;
      }
      return true;
    case Value::Kind::ns: return a.dict == b.dict;
    case Value::Kind::function: return a.function == b.function;
    default: return false;
  }
}

bool less(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::real || b.kind == Value::Kind::real) return as_real(a) < as_real(b);
    return as_int(a) < as_int(b);
  }
  if (a.kind == Value::Kind::string && b.kind == Value::Kind::string) return a.text < b.text;  // UTF-8 order is code point order
  if (a.is_sequence() && a.kind == b.kind) {
    const size_t n = std::min(a.items->size(), b.items->size());
    for (size_t i = 0; i < n; ++i) {
      if (!equal((*a.items)[i], (*b.items)[i])) return less((*a.items)[i], (*b.items)[i], line);
    }
    return a.items->size() < b.items->size();
  }
  fail(line, "'<' is not supported between '" + type_name(a) + "' and '" + type_name(b) + "'");
}

const Value* find(const Dict& d, const std::string& key) {
  for (const auto& [k, v] : d) {
    if (k == key) return &v;
  }
  return nullptr;
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (std::string_view ch : characters(s)) {
    const uint32_t c = code_point(ch);
    char buf[16];
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E && c != 0x7F)) {
      if (c > 0xFFFF) {
        const uint32_t u = c - 0x10000;
        std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (u >> 10), 0xDC00 + (u & 0x3FF));
      } else {
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      }
      out += buf;
    } else {
      out += ch;
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, const JsonStyle& style, int level, int line) {
  if (level > 512) fail(line, "tojson: the value nests too deeply");
  if (out.size() > kMaxShown) fail(line, "tojson: the text grows beyond 16 MiB");
  const bool pretty = style.indent >= 0;
  auto newline = [&](int depth) {
    out += '\n';
    out.append(static_cast<size_t>(style.indent) * static_cast<size_t>(depth), ' ');
  };
  switch (v.kind) {
    case Value::Kind::none: out += "null"; return;
    case Value::Kind::boolean: out += v.boolean ? "true" : "false"; return;
    case Value::Kind::integer: out += std::to_string(v.integer); return;
    case Value::Kind::real:
      if (std::isnan(v.real)) {
        out += "NaN";
      } else if (std::isinf(v.real)) {
        out += v.real < 0 ? "-Infinity" : "Infinity";
      } else {
        out += python_float(v.real);
      }
      return;
    case Value::Kind::string: json_string(out, v.text, style.ensure_ascii); return;
    case Value::Kind::list:
    case Value::Kind::tuple:
      if (v.items->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.items->size(); ++i) {
        if (i) out += style.item_separator;
        if (pretty) newline(level + 1);
        json_value(out, (*v.items)[i], style, level + 1, line);
      }
      if (pretty) newline(level);
      out += ']';
      return;
    case Value::Kind::dict: {
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : *v.dict) entries.push_back(&e);
      if (style.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += style.item_separator;
        if (pretty) newline(level + 1);
        json_string(out, entries[i]->first, style.ensure_ascii);
        out += style.key_separator;
        json_value(out, entries[i]->second, style, level + 1, line);
      }
      if (pretty) newline(level);
      out += '}';
      return;
    }
    default: fail(line, "tojson: a value of type '" + type_name(v) + "' is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style, int line) {
  std::string out;
  json_value(out, v, style, 0, line);
  return out;
}

Value from_json(const nlohmann::ordered_json& j, int depth) {
  if (depth > 512) fail(0, "the context nests too deeply");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::of(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::of(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::of(static_cast<double>(u));
      return Value::of(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::of(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::of(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      for (const auto& e : j) items.push_back(from_json(e, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, e] : j.items()) d.emplace_back(k, from_json(e, depth + 1));
      return Value::of_dict(std::move(d));
    }
    default: fail(0, "the context holds a value that is not JSON");
  }
}

}  // namespace sparsa::dlm::jinja
