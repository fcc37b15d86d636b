// The chat-template interpreter's library (jinja_builtins.cpp): what a template can call and the
// operators and lookups on values, shared by the renderer (jinja_render.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "jinja_values.h"

namespace sparsa::dlm::jinja {

// The limits of one render, beyond the renderer's own (steps, nesting).
inline constexpr int64_t kMaxRange = 100000;         // range() items (Jinja's sandbox limit)
inline constexpr size_t kMaxText = size_t{16} << 20;  // the output, and any one string
inline constexpr size_t kMaxItems = 1000000;          // any one list a template builds

// A string a template built: at most kMaxText, its bytes spent from the copy budget (jinja_ast.h).
std::string checked(std::string s, int line);
[[noreturn]] void undefined_error(const Value& v, int line);  // "'x' is undefined"

List iterate(const Value& v, int line);                    // what `for` walks
Value item(const Value& obj, const Value& key, int line);  // obj[key]; a miss is undefined

Value global(const std::string& name);  // range, namespace, dict, raise_exception, strftime_now
// Python's str / dict methods; nullopt when `obj` has no such method.
std::optional<Value> call_method(const Value& obj, const std::string& name, Args& a, int line);
Value apply_filter(const std::string& name, Value v, Args& a, int line);
bool apply_test(const std::string& name, const Value& v, Args& a, int line);

// The binary operators (+ - * / // % ** ~) and the comparisons (== != < > <= >= in, not in).
Value binary(const std::string& op, const Value& a, const Value& b, int line);
bool compare(const std::string& op, const Value& a, const Value& b, int line);

}  // namespace sparsa::dlm::jinja
