// The chat-template interpreter's insides (jinja.h is its interface): the values a template
// computes with, the syntax tree the parser builds (jinja_parse.cpp) and the renderer walks
// (jinja_render.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sparsa::dlm::jinja {

// The first error unwinds the parser or the renderer; Template::parse / render turn it into a
// Status naming `line` (a template line, 1-based; 0 when no line applies).
struct Error {
  int line;
  std::string message;
};
[[noreturn]] inline void fail(int line, std::string message) { throw Error{line, std::move(message)}; }

// Python's values as Jinja sees them. Lists and dicts are shared (a template reads what it was
// given and builds small values; only a namespace is changed in place). A dict keeps its keys in
// insertion order, as Python's does, so that tojson writes the order the caller gave.
struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;
struct Args;
using Function = std::function<Value(Args&, int line)>;

// While a render runs, copying a long string spends its budget of copied bytes
// (jinja_render.cpp): a hostile template that copies one long string into many places ([s, s, s,
// ...]) fails instead of exhausting memory.
inline thread_local int64_t* copy_budget = nullptr;

struct Value {
  enum class Kind { undefined, none, boolean, integer, real, string, list, tuple, dict, ns, function };

  Value() = default;
  Value(const Value& o)
      : kind(o.kind), boolean(o.boolean), integer(o.integer), real(o.real), text((charge(o), o.text)), items(o.items),
        dict(o.dict), function(o.function) {}
  Value(Value&&) noexcept = default;
  Value& operator=(const Value& o) {
    if (this != &o) {
      charge(o);
      kind = o.kind, boolean = o.boolean, integer = o.integer, real = o.real, text = o.text;
      items = o.items, dict = o.dict, function = o.function;
    }
    return *this;
  }
  Value& operator=(Value&&) noexcept = default;
  ~Value() = default;

  Kind kind = Kind::undefined;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;             // string; undefined: the name that was not found; function: its name
  std::shared_ptr<List> items;  // list, tuple
  std::shared_ptr<Dict> dict;   // dict, ns
  std::shared_ptr<Function> function;

  static Value undefined(std::string name) {
    Value v;
    v.text = std::move(name);
    return v;
  }
  static Value none() { return make(Kind::none); }
  static Value of(bool b) {
    Value v = make(Kind::boolean);
    v.boolean = b;
    return v;
  }
  static Value of(int64_t i) {
    Value v = make(Kind::integer);
    v.integer = i;
    return v;
  }
  static Value of(double d) {
    Value v = make(Kind::real);
    v.real = d;
    return v;
  }
  static Value of(std::string s) {
    Value v = make(Kind::string);
    v.text = std::move(s);
    return v;
  }
  static Value list(List l, Kind kind = Kind::list) {
    Value v = make(kind);
    v.items = std::make_shared<List>(std::move(l));
    return v;
  }
  static Value of_dict(Dict d, Kind kind = Kind::dict) {
    Value v = make(kind);
    v.dict = std::make_shared<Dict>(std::move(d));
    return v;
  }
  static Value of_function(std::string name, Function f) {
    Value v = make(Kind::function);
    v.text = std::move(name);
    v.function = std::make_shared<Function>(std::move(f));
    return v;
  }

  static void charge(const Value& o) {
    if (copy_budget != nullptr && o.text.size() > 64) {
      *copy_budget -= static_cast<int64_t>(o.text.size());
      if (*copy_budget < 0) fail(0, "the template copies more than 256 MiB of text");
    }
  }

  bool is(Kind k) const { return kind == k; }
  bool is_sequence() const { return kind == Kind::list || kind == Kind::tuple; }
  bool is_number() const { return kind == Kind::integer || kind == Kind::real || kind == Kind::boolean; }

 private:
  static Value make(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// An expression. Which fields a kind uses:
//   literal: value; name: text; attr: kids[0], text; item: kids[0..1]; slice: kids[0], then
//   start / stop / step (each may be null); call: kids[0] the callee, kids[1..] positional,
//   keyword; filter: kids[0] the operand, text the filter, kids[1..] and keyword its arguments;
//   test: the same with negated (`is not`); neg / pos / not_: kids[0]; binary: text the
//   operator, kids[0..1]; and_ / or_: kids[0..1]; compare: kids[0], then ops[i] with kids[i+1];
//   cond: kids[0] if kids[1] else kids[2] (may be null); list / tuple: kids; dict: keys and values
//   alternating in kids; unpack: kids[0], an argument written *xs (its items become positional
//   arguments) or, as a keyword argument named "**", **d (its entries keyword arguments).
struct Node {
  enum class Kind { literal, name, attr, item, slice, call, filter, test, neg, pos, not_, binary, and_, or_,
                    compare, cond, list, tuple, dict, unpack };
  Kind kind;
  int line;
  Value value;
  std::string text;
  std::vector<std::unique_ptr<Node>> kids;
  std::vector<std::string> ops;
  std::vector<std::pair<std::string, std::unique_ptr<Node>>> keyword;
  bool negated = false;
};
using NodePtr = std::unique_ptr<Node>;

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

// A statement. text: literal text; output: expr; if_: branches (a null condition is the else);
// for_: targets, expr (the iterable), condition (`for x in xs if c`, may be null), body,
// else_body; set: targets (several: unpacking) or targets[0] + attribute (`set ns.a = ...`),
// expr; set_block: targets[0], body; macro: targets[0] the name, params (default may be null),
// body (extra arguments reach it as `varargs` and `kwargs`); call_block (`{% call m(args)
// %}body{% endcall %}`): expr the call, body what the macro's caller() renders; break_ /
// continue_; generation: body; filter_block (`{% filter f(args)|g %}body{% endfilter %}`): expr
// the filter chain applied to the name kFilterBody, which holds the body's text; with_ (`{% with
// a = x, b = y %}body{% endwith %}`): params the names and values (evaluated outside), body.
struct Stmt {
  enum class Kind {
    text, output, if_, for_, set, set_block, macro, call_block, break_, continue_, generation, filter_block, with_
  };
  Kind kind;
  int line;
  std::string text;
  NodePtr expr;
  NodePtr condition;
  std::vector<std::pair<NodePtr, Body>> branches;
  std::vector<std::string> targets;
  std::string attribute;
  std::vector<std::pair<std::string, NodePtr>> params;
  Body body, else_body;
};

// The name a filter block's chain reads its body's text from: not a name a template can write.
inline constexpr const char* kFilterBody = "(filter body)";

struct Program {
  Body body;
};

// jinja_parse.cpp: the source as Jinja reads it (newlines normalised, one trailing newline
// dropped), lexed and parsed.
Program parse_program(const std::string& source);

}  // namespace sparsa::dlm::jinja
