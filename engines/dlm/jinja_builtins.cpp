// The chat-template interpreter's library (jinja_builtins.h): Jinja's filters and tests, the
// globals transformers' chat templates call, Python's str / dict methods and operators, and the
// lookups the renderer shares with them, all on values alone (no frames). Semantics are Python's
// and Jinja's; where a template would change a value in place or grow past a limit, an error.
#include "jinja_builtins.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "utf8.h"

namespace sparsa::dlm::jinja {
namespace {

// Keyword arguments by name, positional ones by place, as a Python signature binds them.
struct Bound {
  Args& args;
  int line;
  std::string what;  // "filter 'join'", for messages
  const Value* get(size_t position, const char* name) const {
    if (position < args.positional.size()) return &args.positional[position];
    for (const auto& [k, v] : args.keyword) {
      if (k == name) return &v;
    }
    return nullptr;
  }
  void allow(size_t positional, std::initializer_list<const char*> names) const {
    if (args.positional.size() > positional) {
      fail(line, what + " takes at most " + std::to_string(positional) + " positional arguments");
    }
    for (const auto& [k, v] : args.keyword) {
      bool known = false;
      for (const char* n : names) known = known || k == n;
      if (!known) fail(line, what + " has no argument '" + k + "'");
    }
  }
  std::string text(size_t position, const char* name, const std::string& fallback) const {
    const Value* v = get(position, name);
    if (v == nullptr || v->is(Value::Kind::none)) return fallback;
    if (!v->is(Value::Kind::string)) fail(line, what + ": '" + name + "' must be a string, got " + type_name(*v));
    return v->text;
  }
  int64_t integer(size_t position, const char* name, int64_t fallback) const {
    const Value* v = get(position, name);
    if (v == nullptr || v->is(Value::Kind::none)) return fallback;
    if (v->is(Value::Kind::boolean)) return v->boolean ? 1 : 0;
    if (!v->is(Value::Kind::integer)) fail(line, what + ": '" + name + "' must be an integer, got " + type_name(*v));
    return v->integer;
  }
  bool flag(size_t position, const char* name, bool fallback) const {
    const Value* v = get(position, name);
    return v == nullptr ? fallback : truthy(*v);
  }
};

std::string strip_chars(const std::string& s, const std::string* chars, bool left, bool right) {
  const auto cs = characters(s);
  std::vector<std::string_view> set;
  if (chars != nullptr) set = characters(*chars);
  auto strippable = [&](std::string_view ch) {
    if (chars == nullptr) return is_python_space(code_point(ch));
    return std::find(set.begin(), set.end(), ch) != set.end();
  };
  size_t b = 0, e = cs.size();
  if (left) {
    while (b < e && strippable(cs[b])) ++b;
  }
  if (right) {
    while (e > b && strippable(cs[e - 1])) --e;
  }
  std::string out;
  for (size_t i = b; i < e; ++i) out += cs[i];
  return out;
}

std::string ascii_case(std::string s, bool upper) {
  for (char& c : s) c = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(c))
                                               : std::tolower(static_cast<unsigned char>(c)));
  return s;
}

List split(const std::string& s, const std::string& sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (!from_right) {
    size_t at = 0;
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      const size_t hit = s.find(sep, at);
      if (hit == std::string::npos) break;
      parts.push_back(s.substr(at, hit - at));
      at = hit + sep.size();
    }
    parts.push_back(s.substr(at));
  } else {
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      if (end < sep.size()) break;
      const size_t hit = s.rfind(sep, end - sep.size());
      if (hit == std::string::npos) break;
      parts.push_back(s.substr(hit + sep.size(), end - hit - sep.size()));
      end = hit;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  List out;
  for (auto& p : parts) out.push_back(Value::of(std::move(p)));
  return out;
}

// str.split() / rsplit() without a separator: runs of whitespace, no empty parts.
List split_space(const std::string& s, int64_t maxsplit, bool from_right) {
  const auto cs = characters(s);
  std::vector<std::pair<size_t, size_t>> words;  // [begin, end) in characters
  size_t i = 0;
  while (i < cs.size()) {
    while (i < cs.size() && is_python_space(code_point(cs[i]))) ++i;
    if (i == cs.size()) break;
    size_t e = i;
    while (e < cs.size() && !is_python_space(code_point(cs[e]))) ++e;
    words.emplace_back(i, e);
    i = e;
  }
  auto join = [&](size_t b, size_t e) {
    std::string t;
    for (size_t k = b; k < e; ++k) t += cs[k];
    return t;
  };
  List out;
  if (maxsplit < 0 || static_cast<int64_t>(words.size()) <= maxsplit) {
    for (const auto& [b, e] : words) out.push_back(Value::of(join(b, e)));
    return out;
  }
  const size_t keep = static_cast<size_t>(maxsplit);
  if (!from_right) {
    for (size_t k = 0; k < keep; ++k) out.push_back(Value::of(join(words[k].first, words[k].second)));
    // The rest: from the next word to the end, trailing whitespace kept (as Python's).
    out.push_back(Value::of(join(words[keep].first, cs.size())));
  } else {
    const size_t first_kept = words.size() - keep;
    out.push_back(Value::of(join(0, words[first_kept - 1].second)));
    for (size_t k = first_kept; k < words.size(); ++k) out.push_back(Value::of(join(words[k].first, words[k].second)));
  }
  return out;
}

std::string replace(const std::string& s, const std::string& old, const std::string& with, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `with` around every character
    const auto cs = characters(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cs.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < cs.size()) out += cs[i];
      if (out.size() > kMaxText) break;
    }
    return out;
  }
  size_t at = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old, at);
    if (hit == std::string::npos) break;
    out.append(s, at, hit - at);
    out += with;
    at = hit + old.size();
    ++done;
    if (out.size() > kMaxText) return out;
  }
  out.append(s, at, std::string::npos);
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out = ascii_case(s, false);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

// Jinja's title: each word's first character upper, the rest lower (words split at whitespace,
// '-', '(', '[', '{' and '<').
std::string title(const std::string& s) {
  std::string out;
  bool word_start = true;
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    const bool boundary = std::isspace(u) || c == '-' || c == '(' || c == '[' || c == '{' || c == '<';
    out += static_cast<char>(word_start && !boundary ? std::toupper(u) : std::tolower(u));
    word_start = boundary;
  }
  return out;
}
}  // namespace

// A string a template built: at most kMaxText, and its bytes spent from the copy budget (so
// that building long strings over and over is bounded too).
std::string checked(std::string s, int line) {
  if (s.size() > kMaxText) fail(line, "a string grows beyond 16 MiB");
  if (copy_budget != nullptr && s.size() > 64) {
    *copy_budget -= static_cast<int64_t>(s.size());
    if (*copy_budget < 0) fail(line, "the template copies more than 256 MiB of text");
  }
  return s;
}

[[noreturn]] void undefined_error(const Value& v, int line) {
  fail(line, "'" + v.text + "' is undefined");
}

// What `for` walks: a list's items, a dict's keys, a string's characters; an undefined value
// walks nothing (as Jinja's Undefined).
List iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::undefined: return {};
    case Value::Kind::list:
    case Value::Kind::tuple: return *v.items;
    case Value::Kind::dict: {
      List keys;
      for (const auto& e : *v.dict) keys.push_back(Value::of(e.first));
      return keys;
    }
    case Value::Kind::string: {
      if (v.text.size() > kMaxItems) fail(line, "a string of more than 1,000,000 bytes is not iterated here");
      List chars;
      for (std::string_view c : characters(v.text)) chars.push_back(Value::of(std::string(c)));
      return chars;
    }
    default: fail(line, "'" + type_name(v) + "' object is not iterable");
  }
}

namespace {
int64_t index_of(int64_t i, size_t size) { return i < 0 ? i + static_cast<int64_t>(size) : i; }
}  // namespace

Value item(const Value& obj, const Value& key, int line) {
  if (obj.is(Value::Kind::undefined)) undefined_error(obj, line);
  if ((obj.is(Value::Kind::dict) || obj.is(Value::Kind::ns)) && key.is(Value::Kind::string)) {
    if (const Value* v = find(*obj.dict, key.text)) return *v;
    return Value::undefined(key.text);
  }
  if (key.is(Value::Kind::integer) || key.is(Value::Kind::boolean)) {
    const int64_t raw = key.is(Value::Kind::boolean) ? int64_t{key.boolean} : key.integer;
    if (obj.is_sequence()) {
      const int64_t i = index_of(raw, obj.items->size());
      if (i >= 0 && i < static_cast<int64_t>(obj.items->size())) return (*obj.items)[static_cast<size_t>(i)];
    } else if (obj.is(Value::Kind::string)) {
      const auto cs = characters(obj.text);
      const int64_t i = index_of(raw, cs.size());
      if (i >= 0 && i < static_cast<int64_t>(cs.size())) return Value::of(std::string(cs[static_cast<size_t>(i)]));
    }
  }
  return Value::undefined(str(key));
}

Value global(const std::string& name) {
  if (name == "range") {
    return Value::of_function(name, [](Args& a, int line) {
      Bound b{a, line, "range()"};
      b.allow(3, {});
      if (a.positional.empty()) fail(line, "range() needs an argument");
      int64_t start = 0, stop = 0, step = 1;
      if (a.positional.size() == 1) {
        stop = b.integer(0, "stop", 0);
      } else {
        start = b.integer(0, "start", 0);
        stop = b.integer(1, "stop", 0);
        step = b.integer(2, "step", 1);
      }
      if (step == 0) fail(line, "range() step must not be zero");
      const double count = step > 0 ? std::ceil((static_cast<double>(stop) - static_cast<double>(start)) / step)
                                    : std::ceil((static_cast<double>(start) - static_cast<double>(stop)) / -static_cast<double>(step));
      if (count > kMaxRange) fail(line, "range() of more than 100,000 items (the sandbox's limit)");
      List items;
      for (int64_t k = 0; k < static_cast<int64_t>(std::max(count, 0.0)); ++k) items.push_back(Value::of(start + k * step));
      return Value::list(std::move(items));
    });
  }
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Value::of_function(name, [ns, name](Args& a, int line) {
      Dict d;
      if (a.positional.size() > 1) fail(line, name + "() takes at most one positional argument");
      if (!a.positional.empty()) {
        if (!a.positional[0].is(Value::Kind::dict)) fail(line, name + "(): the positional argument must be a dict");
        d = *a.positional[0].dict;
      }
      for (auto& kv : a.keyword) {
        auto at = std::find_if(d.begin(), d.end(), [&](const auto& e) { return e.first == kv.first; });
        if (at != d.end()) {
          at->second = kv.second;
        } else {
          d.emplace_back(kv.first, kv.second);
        }
      }
      return Value::of_dict(std::move(d), ns ? Value::Kind::ns : Value::Kind::dict);
    });
  }
  if (name == "raise_exception") {
    return Value::of_function(name, [](Args& a, int line) -> Value {
      fail(line, "the template raised an error: " + (a.positional.empty() ? std::string() : str(a.positional[0])));
    });
  }
  if (name == "strftime_now") {
    return Value::of_function(name, [](Args& a, int line) {
      Bound b{a, line, "strftime_now()"};
      b.allow(1, {});
      const std::string format = b.text(0, "format", "");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      if (format.size() >= 128) fail(line, "strftime_now(): the format is longer than 127 characters");
      const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &tm);
      return Value::of(std::string(buf, n));
    });
  }
  return Value::undefined(name);
}

// Python's str / dict methods; lists and dicts are not changed in place (the sandbox's rule).
std::optional<Value> call_method(const Value& obj, const std::string& name, Args& a, int line) {
  Bound b{a, line, name + "()"};
  if (obj.is(Value::Kind::string)) {
    const std::string& s = obj.text;
    if (name == "startswith" || name == "endswith") {
      if (a.positional.size() != 1) fail(line, name + "() takes one argument");
      const Value& p = a.positional[0];
      List options = p.is(Value::Kind::tuple) ? *p.items : List{p};
      for (const Value& o : options) {
        if (!o.is(Value::Kind::string)) fail(line, name + "(): the argument must be a str or a tuple of str");
        const bool hit = name == "startswith" ? s.compare(0, o.text.size(), o.text) == 0
                                              : s.size() >= o.text.size() &&
                                                    s.compare(s.size() - o.text.size(), o.text.size(), o.text) == 0;
        if (hit) return Value::of(true);
      }
      return Value::of(false);
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      b.allow(1, {});
      const Value* chars = b.get(0, "chars");
      const bool given = chars != nullptr && !chars->is(Value::Kind::none);
      if (given && !chars->is(Value::Kind::string)) fail(line, name + "(): the argument must be a str");
      return Value::of(strip_chars(s, given ? &chars->text : nullptr, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      b.allow(2, {"sep", "maxsplit"});
      const Value* sep = b.get(0, "sep");
      const int64_t maxsplit = b.integer(1, "maxsplit", -1);
      if (sep != nullptr && !sep->is(Value::Kind::none)) {
        if (!sep->is(Value::Kind::string)) fail(line, name + "(): sep must be a str");
        if (sep->text.empty()) fail(line, name + "(): empty separator");
        return Value::list(split(s, sep->text, maxsplit, name == "rsplit"));
      }
      return Value::list(split_space(s, maxsplit, name == "rsplit"));
    }
    if (name == "replace") {
      b.allow(3, {});
      if (a.positional.size() < 2) fail(line, "replace() takes two or three arguments");
      return Value::of(checked(replace(s, b.text(0, "old", ""), b.text(1, "new", ""), b.integer(2, "count", -1)), line));
    }
    if (name == "upper" || name == "lower") return Value::of(ascii_case(s, name == "upper"));
    if (name == "title") return Value::of(title(s));
    if (name == "capitalize") return Value::of(capitalize(s));
    if (name == "find" || name == "count") {
      b.allow(1, {});
      const std::string sub = b.text(0, "sub", "");
      if (name == "find") {
        const size_t at = s.find(sub);
        return Value::of(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(characters(s.substr(0, at)).size()));
      }
      if (sub.empty()) return Value::of(static_cast<int64_t>(characters(s).size() + 1));
      int64_t count = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++count;
      return Value::of(count);
    }
    if (name == "join") {
      if (a.positional.size() != 1) fail(line, "join() takes one argument");
      std::string out;
      const List parts = iterate(a.positional[0], line);
      for (size_t i = 0; i < parts.size(); ++i) {
        if (!parts[i].is(Value::Kind::string)) fail(line, "join(): item " + std::to_string(i) + " is not a str");
        out += (i ? s : "") + parts[i].text;
        if (out.size() > kMaxText) fail(line, "a string grows beyond 16 MiB");
      }
      return Value::of(std::move(out));
    }
    if (name == "isdigit" || name == "isspace") {
      const auto cs = characters(s);
      bool all = !cs.empty();
      for (std::string_view c : cs) {
        const uint32_t p = code_point(c);
        all = all && (name == "isdigit" ? (p >= '0' && p <= '9') : is_python_space(p));
      }
      return Value::of(all);
    }
    return std::nullopt;
  }
  if (obj.is(Value::Kind::dict)) {
    if (name == "items" || name == "keys" || name == "values") {
      b.allow(0, {});
      List out;
      for (const auto& [k, v] : *obj.dict) {
        if (name == "items") {
          out.push_back(Value::list({Value::of(k), v}, Value::Kind::tuple));
        } else {
          out.push_back(name == "keys" ? Value::of(k) : v);
        }
      }
      return Value::list(std::move(out));
    }
    if (name == "get") {
      b.allow(2, {});
      if (a.positional.empty()) fail(line, "get() needs a key");
      const Value& key = a.positional[0];
      if (key.is(Value::Kind::string)) {
        if (const Value* v = find(*obj.dict, key.text)) return *v;
      }
      return a.positional.size() > 1 ? a.positional[1] : Value::none();
    }
  }
  static const char* const kChanging[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort",
                                          "reverse", "update", "setdefault", "popitem", "add", "discard"};
  if (obj.is_sequence() || obj.is(Value::Kind::dict)) {
    for (const char* c : kChanging) {
      if (name == c) fail(line, "'" + name + "' would change a " + type_name(obj) +
                                    "; a chat template cannot (use a namespace() or a new value)");
    }
  }
  return std::nullopt;
}

namespace {

// Python's printf-style formatting, `fmt % args` (and Jinja's `format` filter): a tuple gives the
// positional values, a dict the mapping of `%(key)s`, anything else is the one value. Conversions
// s r a d i u x X o e E f F g G c %, flags # 0 - + space, width and precision (digits or *).
std::string percent_format(const std::string& fmt, const Value& args, int line) {
  const bool mapping = args.is(Value::Kind::dict);
  List positional;
  if (args.is(Value::Kind::tuple)) {
    positional = *args.items;
  } else {
    positional.push_back(args);  // a dict too: `%s` shows it, `%(key)s` reads it
  }
  size_t next_arg = 0;
  auto take = [&]() -> const Value& {
    if (next_arg >= positional.size()) fail(line, "not enough arguments for format string");
    return positional[next_arg++];
  };
  auto as_int = [&](const Value& v, char conv) -> int64_t {
    if (v.is(Value::Kind::integer)) return v.integer;
    if (v.is(Value::Kind::boolean)) return v.boolean;
    if (v.is(Value::Kind::real) && (conv == 'd' || conv == 'i' || conv == 'u' || conv == '*')) {
      if (!std::isfinite(v.real) || std::fabs(v.real) >= 9.2e18) fail(line, "cannot convert float " + str(v) + " to integer");
      return static_cast<int64_t>(v.real);
    }
    fail(line, std::string("%") + conv + " format: " +
                   (conv == 'd' || conv == 'i' || conv == 'u' ? "a real number" : "an integer") + " is required, not " +
                   type_name(v));
  };
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) fail(line, "incomplete format");
    const Value* arg = nullptr;
    if (fmt[i] == '(') {
      if (!mapping) fail(line, "format requires a mapping");
      const size_t close = fmt.find(')', i);
      if (close == std::string::npos) fail(line, "incomplete format key");
      const std::string key = fmt.substr(i + 1, close - i - 1);
      for (const auto& [k, v] : *args.dict) {
        if (k == key) arg = &v;
      }
      if (arg == nullptr) fail(line, "format key '" + key + "' is not in the mapping");
      i = close + 1;
    }
    bool alt = false, zero = false, left = false, plus = false, space = false;
    for (; i < fmt.size() && std::strchr("#0- +", fmt[i]) != nullptr; ++i) {
      alt |= fmt[i] == '#', zero |= fmt[i] == '0', left |= fmt[i] == '-', plus |= fmt[i] == '+', space |= fmt[i] == ' ';
    }
    auto number = [&](int64_t fallback) {
      if (i < fmt.size() && fmt[i] == '*') {
        ++i;
        const int64_t n = as_int(take(), '*');
        if (n > 100000 || n < -100000) fail(line, "a format width or precision above 100,000");
        return n;
      }
      if (i >= fmt.size() || !std::isdigit(static_cast<unsigned char>(fmt[i]))) return fallback;
      int64_t n = 0;
      for (; i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i])); ++i) {
        n = n * 10 + (fmt[i] - '0');
        if (n > 100000) fail(line, "a format width or precision above 100,000");
      }
      return n;
    };
    int64_t width = number(0);
    if (width < 0) left = true, width = -width;
    int64_t precision = -1;
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      precision = std::max<int64_t>(number(0), 0);
    }
    while (i < fmt.size() && std::strchr("hlL", fmt[i]) != nullptr) ++i;
    if (i >= fmt.size()) fail(line, "incomplete format");
    const char conv = fmt[i];
    if (conv == '%') {
      out += '%';
      continue;
    }
    const Value& v = arg != nullptr ? *arg : take();
    std::string body, sign;
    bool numeric = true;
    switch (conv) {
      case 's': case 'r': case 'a': {
        numeric = false;
        body = conv == 's' ? str(v) : repr(v);
        if (precision >= 0) {
          const auto chars = characters(body);
          if (static_cast<int64_t>(chars.size()) > precision) {
            body = std::string(body.data(), static_cast<size_t>(chars[static_cast<size_t>(precision)].data() - body.data()));
          }
        }
        break;
      }
      case 'c': {
        numeric = false;
        if (v.is(Value::Kind::string)) {
          if (characters(v.text).size() != 1) fail(line, "%c requires an int or a unicode character, not a string of length " + std::to_string(characters(v.text).size()));
          body = v.text;
        } else {
          const int64_t cp = as_int(v, 'c');
          if (cp < 0 || cp > 0x10FFFF) fail(line, "%c arg not in range(0x110000)");
          append_utf8(body, static_cast<uint32_t>(cp));
        }
        break;
      }
      case 'd': case 'i': case 'u': case 'x': case 'X': case 'o': {
        const int64_t n = as_int(v, conv);
        const uint64_t mag = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
        char buf[32];
        std::snprintf(buf, sizeof buf, conv == 'x' ? "%llx" : conv == 'X' ? "%llX" : conv == 'o' ? "%llo" : "%llu",
                      static_cast<unsigned long long>(mag));
        body = buf;
        if (precision >= 0 && static_cast<int64_t>(body.size()) < precision) {
          body.insert(0, static_cast<size_t>(precision) - body.size(), '0');
        }
        if (alt && conv != 'd' && conv != 'i' && conv != 'u') body.insert(0, conv == 'o' ? "0o" : conv == 'x' ? "0x" : "0X");
        sign = n < 0 ? "-" : plus ? "+" : space ? " " : "";
        break;
      }
      case 'e': case 'E': case 'f': case 'F': case 'g': case 'G': {
        double x = 0;
        if (v.is(Value::Kind::real)) {
          x = v.real;
        } else if (v.is(Value::Kind::integer) || v.is(Value::Kind::boolean)) {
          x = static_cast<double>(as_int(v, 'd'));
        } else {
          fail(line, std::string("%") + conv + " format: a real number is required, not " + type_name(v));
        }
        const std::string spec = std::string("%") + (alt ? "#" : "") + "." + std::to_string(precision < 0 ? 6 : precision) + conv;
        std::vector<char> buf(static_cast<size_t>(precision) + 400);
        std::snprintf(buf.data(), buf.size(), spec.c_str(), std::fabs(x));
        body = buf.data();
        sign = std::signbit(x) && !std::isnan(x) ? "-" : plus ? "+" : space ? " " : "";
        break;
      }
      default:
        fail(line, std::string("unsupported format character '") + conv + "'");
    }
    const int64_t len = static_cast<int64_t>(characters(sign + body).size());
    if (len < width) {
      const size_t pad = static_cast<size_t>(width - len);
      const bool finite_number = numeric && body.find_first_not_of("0123456789abcdefABCDEFxXo.+-") == std::string::npos;
      if (left) {
        body = sign + body + std::string(pad, ' ');
      } else if (zero && finite_number) {  // zeros go after the sign and any 0x / 0o prefix
        const size_t prefix = alt && (conv == 'x' || conv == 'X' || conv == 'o') ? 2 : 0;
        body = sign + body.substr(0, prefix) + std::string(pad, '0') + body.substr(prefix);
      } else {
        body = std::string(pad, ' ') + sign + body;
      }
      out += body;
    } else {
      out += sign + body;
    }
    if (out.size() > kMaxText) fail(line, "the formatted text grows beyond 16 MiB");
  }
  if (!mapping && next_arg < positional.size()) fail(line, "not all arguments converted during string formatting");
  return out;
}

}  // namespace

Value binary(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "~") return Value::of(checked(str(a) + str(b), line));
  if (a.is(Value::Kind::undefined)) undefined_error(a, line);
  if (b.is(Value::Kind::undefined)) undefined_error(b, line);
  auto bad = [&]() -> Value {
    fail(line, "unsupported operand types for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  if (op == "+") {
    if (a.is(Value::Kind::string) && b.is(Value::Kind::string)) return Value::of(checked(a.text + b.text, line));
    if (a.is_sequence() && a.kind == b.kind) {
      if (a.items->size() + b.items->size() > kMaxItems) fail(line, "a list grows beyond 1,000,000 items");
      List items = *a.items;
      items.insert(items.end(), b.items->begin(), b.items->end());
      return Value::list(std::move(items), a.kind);
    }
  }
  if (op == "%" && a.is(Value::Kind::string)) return Value::of(checked(percent_format(a.text, b, line), line));
  if (op == "*") {
    const Value* seq = a.is(Value::Kind::string) || a.is_sequence() ? &a : &b;
    const Value* times = seq == &a ? &b : &a;
    if ((seq->is(Value::Kind::string) || seq->is_sequence()) &&
        (times->is(Value::Kind::integer) || times->is(Value::Kind::boolean))) {
      const int64_t n = times->is(Value::Kind::boolean) ? int64_t{times->boolean} : times->integer;
      const size_t unit = seq->is(Value::Kind::string) ? seq->text.size() : seq->items->size();
      const size_t limit = seq->is(Value::Kind::string) ? kMaxText : kMaxItems;
      if (n > 0 && unit > 0 && static_cast<uint64_t>(n) > limit / unit) fail(line, "a repetition grows too large");
      if (seq->is(Value::Kind::string)) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq->text;
        return Value::of(std::move(out));
      }
      List items;
      for (int64_t i = 0; i < n; ++i) items.insert(items.end(), seq->items->begin(), seq->items->end());
      return Value::list(std::move(items), seq->kind);
    }
  }
  if (!a.is_number() || !b.is_number()) return bad();
  const bool reals = a.is(Value::Kind::real) || b.is(Value::Kind::real);
  const double x = a.is(Value::Kind::real) ? a.real : static_cast<double>(a.is(Value::Kind::boolean) ? a.boolean : a.integer);
  const double y = b.is(Value::Kind::real) ? b.real : static_cast<double>(b.is(Value::Kind::boolean) ? b.boolean : b.integer);
  const int64_t i = a.is(Value::Kind::boolean) ? int64_t{a.boolean} : a.integer;
  const int64_t j = b.is(Value::Kind::boolean) ? int64_t{b.boolean} : b.integer;
  int64_t r = 0;
  if (op == "/") {
    if (y == 0) fail(line, "division by zero");
    return Value::of(x / y);
  }
  if (op == "//" || op == "%") {
    if (y == 0) fail(line, op == "//" ? "integer division by zero" : "modulo by zero");
    if (reals) {
      const double m = std::fmod(x, y);
      const double mod = (m != 0 && ((m < 0) != (y < 0))) ? m + y : m;
      return Value::of(op == "%" ? mod : std::floor(x / y));
    }
    if (i == INT64_MIN && j == -1) fail(line, "integer overflow");
    int64_t q = i / j, m = i % j;
    if (m != 0 && ((m < 0) != (j < 0))) {
      --q;
      m += j;
    }
    return Value::of(op == "%" ? m : q);
  }
  if (op == "**") {
    if (reals || j < 0) return Value::of(std::pow(x, y));
    int64_t result = 1;
    for (int64_t k = 0; k < j; ++k) {
      if (__builtin_mul_overflow(result, i, &result)) fail(line, "integer overflow");
      if (result == 0 || result == 1) break;
      if (result == -1) {
        result = ((j - k - 1) % 2 == 0) ? -1 : 1;
        break;
      }
    }
    return Value::of(result);
  }
  if (reals) {
    if (op == "+") return Value::of(x + y);
    if (op == "-") return Value::of(x - y);
    if (op == "*") return Value::of(x * y);
    return bad();
  }
  bool overflow = false;
  if (op == "+") {
    overflow = __builtin_add_overflow(i, j, &r);
  } else if (op == "-") {
    overflow = __builtin_sub_overflow(i, j, &r);
  } else if (op == "*") {
    overflow = __builtin_mul_overflow(i, j, &r);
  } else {
    return bad();
  }
  if (overflow) fail(line, "integer overflow");
  return Value::of(r);
}

namespace {

// Python's `v in container`.
bool contains(const Value& container, const Value& v, int line) {
  switch (container.kind) {
    case Value::Kind::string:
      if (!v.is(Value::Kind::string)) fail(line, "'in <string>' requires a string as the left operand, not " + type_name(v));
      return container.text.find(v.text) != std::string::npos;
    case Value::Kind::list:
    case Value::Kind::tuple:
      for (const Value& e : *container.items) {
        if (equal(e, v)) return true;
      }
      return false;
    case Value::Kind::dict:
    case Value::Kind::ns: return v.is(Value::Kind::string) && find(*container.dict, v.text) != nullptr;
    case Value::Kind::undefined: return false;  // Jinja's Undefined iterates as nothing
    default: fail(line, "argument of type '" + type_name(container) + "' is not iterable");
  }
}

}  // namespace

bool compare(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "in") return contains(b, a, line);
  if (op == "not in") return !contains(b, a, line);
  if (op == "<") return less(a, b, line);
  if (op == ">") return less(b, a, line);
  if (op == "<=") return !less(b, a, line);
  return !less(a, b, line);  // >=
}

namespace {

// An item's attribute by a dotted path ("function.name"; numbers index lists), as map() and
// selectattr() take it.
Value path(const Value& v, const std::string& dotted, int line) {
  Value cur = v;
  size_t at = 0;
  while (true) {
    const size_t dot = dotted.find('.', at);
    const std::string part = dotted.substr(at, dot == std::string::npos ? std::string::npos : dot - at);
    const bool number = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (cur.is(Value::Kind::undefined)) return cur;
    cur = number && part.size() < 18 ? item(cur, Value::of(static_cast<int64_t>(std::stoll(part))), line)
                                     : item(cur, Value::of(part), line);
    if (dot == std::string::npos) return cur;
    at = dot + 1;
  }
}

}  // namespace

bool apply_test(const std::string& name, const Value& v, Args& a, int line) {
  Bound b{a, line, "test '" + name + "'"};
  const Value* arg = b.get(0, "value");
  auto need_arg = [&]() -> const Value& {
    if (arg == nullptr) fail(line, "test '" + name + "' needs an argument");
    return *arg;
  };
  using K = Value::Kind;
  if (name == "defined") return !v.is(K::undefined);
  if (name == "undefined") return v.is(K::undefined);
  if (name == "none") return v.is(K::none);
  if (name == "boolean") return v.is(K::boolean);
  if (name == "true") return v.is(K::boolean) && v.boolean;
  if (name == "false") return v.is(K::boolean) && !v.boolean;
  if (name == "integer") return v.is(K::integer);
  if (name == "float") return v.is(K::real);
  if (name == "number") return v.is_number();
  if (name == "string") return v.is(K::string);
  if (name == "mapping") return v.is(K::dict);
  if (name == "sequence") return v.is(K::string) || v.is_sequence() || v.is(K::dict);
  if (name == "iterable") return v.is(K::string) || v.is_sequence() || v.is(K::dict) || v.is(K::undefined);
  if (name == "callable") return v.is(K::function);
  if (name == "even" || name == "odd") {
    if (!v.is(K::integer) && !v.is(K::boolean)) fail(line, "test '" + name + "' needs an integer, got " + type_name(v));
    const int64_t i = v.is(K::boolean) ? int64_t{v.boolean} : v.integer;
    return (i % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    const int64_t d = b.integer(0, "num", 0);
    if (d == 0) fail(line, "divisibleby(0)");
    if (!v.is(K::integer)) fail(line, "test 'divisibleby' needs an integer, got " + type_name(v));
    return d == -1 || v.integer % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, need_arg());
  if (name == "ne" || name == "!=") return !equal(v, need_arg());
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, need_arg(), line);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(need_arg(), v, line);
  if (name == "le" || name == "<=") return !less(need_arg(), v, line);
  if (name == "ge" || name == ">=") return !less(v, need_arg(), line);
  if (name == "in") return contains(need_arg(), v, line);
  if (name == "sameas") {
    const Value& o = need_arg();
    if (v.kind != o.kind) return false;
    if (v.is(K::none) || v.is(K::undefined)) return true;
    if (v.is(K::boolean)) return v.boolean == o.boolean;
    return equal(v, o) && (v.items == o.items) && (v.dict == o.dict);
  }
  if (name == "lower" || name == "upper") {
    if (!v.is(K::string)) return false;
    return v.text == ascii_case(v.text, name == "upper");
  }
  fail(line, "unknown test '" + name + "'");
}

// filter `name` applied to `v` (map / select take another filter or test by name).
Value apply_filter(const std::string& name, Value v, Args& a, int line) {
  Bound b{a, line, "filter '" + name + "'"};
  using K = Value::Kind;
  if (name == "default" || name == "d") {
    b.allow(2, {"default_value", "boolean"});
    const Value* fallback = b.get(0, "default_value");
    const bool boolean = b.flag(1, "boolean", false);
    if (v.is(K::undefined) || (boolean && !truthy(v))) return fallback ? *fallback : Value::of(std::string());
    return v;
  }
  // An undefined value reads as "" or as nothing to iterate, except where Python would fail.
  if (v.is(K::undefined) && (name == "int" || name == "float" || name == "abs" || name == "round" || name == "items")) {
    undefined_error(v, line);
  }
  if (name == "safe") return v;
  if (name == "string") return Value::of(str(v));
  if (name == "length" || name == "count") {
    switch (v.kind) {
      case K::string: return Value::of(static_cast<int64_t>(characters(v.text).size()));
      case K::list:
      case K::tuple: return Value::of(static_cast<int64_t>(v.items->size()));
      case K::dict: return Value::of(static_cast<int64_t>(v.dict->size()));
      case K::undefined: return Value::of(int64_t{0});
      default: fail(line, "object of type '" + type_name(v) + "' has no len()");
    }
  }
  if (name == "trim") {
    b.allow(1, {"chars"});
    if (!v.is(K::string)) v = Value::of(str(v));
    const Value* chars = b.get(0, "chars");
    const bool given = chars != nullptr && chars->is(K::string);
    return Value::of(strip_chars(v.text, given ? &chars->text : nullptr, true, true));
  }
  if (name == "upper" || name == "lower") return Value::of(ascii_case(str(v), name == "upper"));
  if (name == "capitalize") return Value::of(capitalize(str(v)));
  if (name == "title") return Value::of(title(str(v)));
  if (name == "replace") {
    b.allow(3, {"old", "new", "count"});
    return Value::of(checked(replace(str(v), b.text(0, "old", ""), b.text(1, "new", ""), b.integer(2, "count", -1)), line));
  }
  if (name == "escape" || name == "e") {
    std::string out;
    for (char c : str(v)) {
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
      }
    }
    return Value::of(std::move(out));
  }
  if (name == "indent") {  // Jinja's: lines after the first padded, blank ones only with blank=true
    b.allow(3, {"width", "first", "blank"});
    const Value* width_value = b.get(0, "width");
    std::string pad(4, ' ');
    if (width_value != nullptr && width_value->is(K::string)) {
      pad = width_value->text;
    } else {
      const int64_t width = b.integer(0, "width", 4);
      if (width < 0 || width > 4096) fail(line, "indent: width must be in [0, 4096]");
      pad.assign(static_cast<size_t>(width), ' ');
    }
    const bool first = b.flag(1, "first", false), blank = b.flag(2, "blank", false);
    const std::string s = str(v);
    std::string out = first ? pad : std::string();
    size_t at = 0;
    for (bool is_first = true;; is_first = false) {
      const size_t nl = s.find('\n', at);
      const std::string piece = s.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
      if (!is_first && (blank || !piece.empty())) out += pad;
      out += piece;
      if (out.size() > kMaxText) fail(line, "a string grows beyond 16 MiB");
      if (nl == std::string::npos) break;
      out += '\n';
      at = nl + 1;
    }
    return Value::of(std::move(out));
  }
  if (name == "tojson") {
    b.allow(1, {"indent", "separators", "sort_keys", "ensure_ascii"});
    JsonStyle style;
    const Value* indent = b.get(0, "indent");
    if (indent != nullptr && !indent->is(K::none)) {
      if (!indent->is(K::integer) || indent->integer < 0 || indent->integer > 64) {
        fail(line, "tojson: indent must be an integer in [0, 64]");
      }
      style.indent = static_cast<int>(indent->integer);
      style.item_separator = ",";
    }
    if (const Value* sep = b.get(99, "separators"); sep != nullptr && !sep->is(K::none)) {
      if (!sep->is_sequence() || sep->items->size() != 2 || !(*sep->items)[0].is(K::string) ||
          !(*sep->items)[1].is(K::string)) {
        fail(line, "tojson: separators must be a pair of strings");
      }
      style.item_separator = (*sep->items)[0].text;
      style.key_separator = (*sep->items)[1].text;
    }
    style.sort_keys = b.flag(99, "sort_keys", false);
    style.ensure_ascii = b.flag(99, "ensure_ascii", false);
    return Value::of(checked(to_json(v, style, line), line));
  }
  if (name == "first" || name == "last") {
    const List items = iterate(v, line);
    if (items.empty()) return Value::undefined(name);
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") return Value::list(iterate(v, line));
  if (name == "items") {
    if (!v.is(K::dict)) fail(line, "filter 'items' needs a dict, got " + type_name(v));
    List out;
    for (const auto& [k, e] : *v.dict) out.push_back(Value::list({Value::of(k), e}, K::tuple));
    return Value::list(std::move(out));
  }
  if (name == "reverse") {
    if (v.is(K::string)) {
      auto cs = characters(v.text);
      std::string out;
      for (size_t i = cs.size(); i-- > 0;) out += cs[i];
      return Value::of(std::move(out));
    }
    List items = iterate(v, line);
    std::reverse(items.begin(), items.end());
    return Value::list(std::move(items));
  }
  if (name == "join") {
    b.allow(2, {"d", "attribute"});
    const std::string sep = b.text(0, "d", "");
    const Value* attr = b.get(1, "attribute");
    std::string out;
    const List items = iterate(v, line);
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += sep;
      out += str(attr != nullptr && !attr->is(K::none) ? path(items[i], str(*attr), line) : items[i]);
      if (out.size() > kMaxText) fail(line, "a string grows beyond 16 MiB");
    }
    return Value::of(std::move(out));
  }
  if (name == "map") {
    List out;
    const List items = iterate(v, line);
    for (const auto& [k, e] : a.keyword) {
      if (k == "attribute") {
        const Value* fallback = nullptr;
        for (const auto& [k2, e2] : a.keyword) {
          if (k2 == "default") fallback = &e2;
        }
        for (const Value& x : items) {
          Value got = path(x, str(e), line);
          out.push_back(got.is(K::undefined) && fallback != nullptr ? *fallback : got);
        }
        return Value::list(std::move(out));
      }
    }
    if (a.positional.empty() || !a.positional[0].is(K::string)) {
      fail(line, "filter 'map' needs attribute= or a filter name");
    }
    Args rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.keyword = a.keyword;
    for (const Value& x : items) {
      Args each = rest;
      out.push_back(apply_filter(a.positional[0].text, x, each, line));
    }
    return Value::list(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool by_attribute = name == "selectattr" || name == "rejectattr";
    const bool keep = name == "select" || name == "selectattr";
    size_t next = 0;
    std::string attr;
    if (by_attribute) {
      if (a.positional.empty() || !a.positional[0].is(K::string)) fail(line, "filter '" + name + "' needs an attribute name");
      attr = a.positional[next++].text;
    }
    std::string test_name;
    if (next < a.positional.size()) {
      if (!a.positional[next].is(K::string)) fail(line, "filter '" + name + "': the test must be named by a string");
      test_name = a.positional[next++].text;
    }
    Args test_args;
    test_args.positional.assign(a.positional.begin() + static_cast<std::ptrdiff_t>(next), a.positional.end());
    test_args.keyword = a.keyword;
    List out;
    for (const Value& x : iterate(v, line)) {
      const Value subject = by_attribute ? path(x, attr, line) : x;
      Args each = test_args;
      const bool pass = test_name.empty() ? truthy(subject) : apply_test(test_name, subject, each, line);
      if (pass == keep) out.push_back(x);
    }
    return Value::list(std::move(out));
  }
  if (name == "unique") {
    List out;
    for (const Value& x : iterate(v, line)) {
      bool seen = false;
      for (const Value& y : out) seen = seen || equal(x, y);
      if (!seen) out.push_back(x);
    }
    return Value::list(std::move(out));
  }
  if (name == "sort") {
    b.allow(3, {"reverse", "case_sensitive", "attribute"});
    const bool reverse = b.flag(0, "reverse", false), case_sensitive = b.flag(1, "case_sensitive", false);
    const Value* attr = b.get(2, "attribute");
    List items = iterate(v, line);
    auto key = [&](const Value& x) {
      Value k = attr != nullptr && !attr->is(K::none) ? path(x, str(*attr), line) : x;
      if (!case_sensitive && k.is(K::string)) k.text = ascii_case(k.text, false);
      return k;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      return reverse ? less(key(y), key(x), line) : less(key(x), key(y), line);
    });
    return Value::list(std::move(items));
  }
  if (name == "format") {  // Jinja's: str(value) % (the positional arguments, or the keywords)
    if (!a.positional.empty() && !a.keyword.empty()) fail(line, "format: positional and keyword arguments cannot be mixed");
    Value args;
    if (!a.keyword.empty()) {
      args = Value::of_dict(Dict(a.keyword.begin(), a.keyword.end()));
    } else {
      args = Value::list(a.positional, K::tuple);
    }
    return Value::of(checked(percent_format(str(v), args, line), line));
  }
  if (name == "dictsort") {  // a dict's (key, value) pairs sorted by key or value
    b.allow(3, {"case_sensitive", "by", "reverse"});
    const bool case_sensitive = b.flag(0, "case_sensitive", false), reverse = b.flag(2, "reverse", false);
    const std::string by = b.text(1, "by", "key");
    if (by != "key" && by != "value") fail(line, "dictsort: 'by' must be 'key' or 'value', got '" + by + "'");
    if (!v.is(K::dict)) fail(line, "dictsort: expected a dict, got " + type_name(v));
    List items;
    for (const auto& [k, x] : *v.dict) items.push_back(Value::list({Value::of(k), x}, Value::Kind::tuple));
    const size_t at = by == "key" ? 0 : 1;
    auto key = [&](const Value& pair) {
      Value k = (*pair.items)[at];
      if (!case_sensitive && k.is(K::string)) k.text = ascii_case(k.text, false);
      return k;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      return reverse ? less(key(y), key(x), line) : less(key(x), key(y), line);
    });
    return Value::list(std::move(items));
  }
  if (name == "int") {
    b.allow(2, {"default", "base"});
    const int64_t fallback = b.integer(0, "default", 0);
    if (v.is(K::integer)) return v;
    if (v.is(K::boolean)) return Value::of(int64_t{v.boolean});
    if (v.is(K::real)) {
      if (!std::isfinite(v.real) || std::fabs(v.real) >= 9.2e18) return Value::of(fallback);
      return Value::of(static_cast<int64_t>(v.real));
    }
    if (v.is(K::string)) {
      const std::string t = strip_chars(v.text, nullptr, true, true);
      char* end = nullptr;
      errno = 0;
      const long long i = std::strtoll(t.c_str(), &end, 10);
      if (!t.empty() && end == t.c_str() + t.size() && errno == 0) return Value::of(static_cast<int64_t>(i));
      const double d = std::strtod(t.c_str(), &end);
      if (!t.empty() && end == t.c_str() + t.size() && std::isfinite(d) && std::fabs(d) < 9.2e18) {
        return Value::of(static_cast<int64_t>(d));
      }
    }
    return Value::of(fallback);
  }
  if (name == "float") {
    if (v.is_number()) return Value::of(v.is(K::real) ? v.real : static_cast<double>(v.is(K::boolean) ? v.boolean : v.integer));
    if (v.is(K::string)) {
      const std::string t = strip_chars(v.text, nullptr, true, true);
      char* end = nullptr;
      const double d = std::strtod(t.c_str(), &end);
      if (!t.empty() && end == t.c_str() + t.size()) return Value::of(d);
    }
    return Value::of(0.0);
  }
  if (name == "abs") {
    if (v.is(K::real)) return Value::of(std::fabs(v.real));
    if (v.is(K::integer)) {
      if (v.integer == INT64_MIN) fail(line, "integer overflow");
      return Value::of(v.integer < 0 ? -v.integer : v.integer);
    }
    fail(line, "bad operand type for abs(): '" + type_name(v) + "'");
  }
  if (name == "round") {
    b.allow(2, {"precision", "method"});
    const int64_t precision = b.integer(0, "precision", 0);
    const std::string how = b.text(1, "method", "common");
    if (!v.is_number()) fail(line, "filter 'round' needs a number, got " + type_name(v));
    const double x = v.is(K::real) ? v.real : static_cast<double>(v.is(K::boolean) ? v.boolean : v.integer);
    if (precision < 0 || precision > 15) fail(line, "round: precision must be in [0, 15]");
    const double scale = std::pow(10.0, static_cast<double>(precision));
    double r;
    if (how == "common") {
      if (v.is(K::integer)) return v;  // round(int, n) stays an int
      // Python's round: the exact binary value rounded to `precision` decimals, ties to even;
      // printf rounds the same way (2.675 is 2.67499..., so 2.67).
      char buf[512];
      std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), x);
      r = std::isfinite(x) ? std::strtod(buf, nullptr) : x;
    } else if (how == "ceil") {
      r = std::ceil(x * scale) / scale;
    } else if (how == "floor") {
      r = std::floor(x * scale) / scale;
    } else {
      fail(line, "round: method must be common, ceil or floor");
    }
    return Value::of(r);
  }
  if (name == "sum" || name == "min" || name == "max") {
    const List items = iterate(v, line);
    if (name == "sum") {
      Value total = Value::of(int64_t{0});
      for (const Value& x : items) total = binary("+", total, x, line);
      return total;
    }
    if (items.empty()) return Value::undefined(name);
    Value best = items[0];
    for (const Value& x : items) {
      if (name == "min" ? less(x, best, line) : less(best, x, line)) best = x;
    }
    return best;
  }
  fail(line, "unknown filter '" + name + "'");
}

}  // namespace sparsa::dlm::jinja
