// The chat-template interpreter's renderer (jinja.h): walks the tree jinja_parse.cpp builds with
// Python's semantics (jinja_values.cpp), Jinja's scoping (a for loop's iteration and a macro call
// get their own frame; `set` inside them does not leak out, which is why templates use
// namespace()), and hard limits on the work one render may do.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <optional>

#include "jinja.h"
#include "jinja_builtins.h"
#include "jinja_values.h"

namespace sparsa::dlm::jinja {
namespace {

constexpr int64_t kCopyBudget = int64_t{256} << 20;  // bytes of long strings a render may copy (jinja_ast.h)
constexpr int64_t kMaxSteps = 1000000;  // statements, expressions and iterations (a chat turn takes ~50)
constexpr int kMaxDepth = 256;          // nested evaluation, macro calls included

struct Frame {
  Frame* parent = nullptr;
  Dict vars;

  Value* find(const std::string& name) {
    for (Frame* f = this; f != nullptr; f = f->parent) {
      for (auto& [k, v] : f->vars) {
        if (k == name) return &v;
      }
    }
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};

class Renderer {
 public:
  explicit Renderer(Frame& root) : root_(root) {}

  void run(const Body& body, std::string& out) {
    int64_t budget = kCopyBudget;
    struct Arm {  // the copy budget counts during this render only
      explicit Arm(int64_t* b) { copy_budget = b; }
      ~Arm() { copy_budget = nullptr; }
    } arm(&budget);
    exec_body(body, root_, out);
  }

 private:
  enum class Flow { normal, break_, continue_ };

  struct Depth {
    explicit Depth(Renderer& r, int line) : r(r) {
      if (++r.depth_ > kMaxDepth) fail(line, "the template recurses too deeply");
      if (++r.steps_ > kMaxSteps) fail(line, "the template takes too many steps (more than 1,000,000)");
    }
    ~Depth() { --r.depth_; }
    Renderer& r;
  };

  Flow exec_body(const Body& body, Frame& f, std::string& out) {
    for (const auto& s : body) {
      const Flow flow = exec(*s, f, out);
      if (flow != Flow::normal) return flow;
    }
    return Flow::normal;
  }

  void emit(std::string& out, const std::string& text, int line) {
    out += text;
    if (out.size() > kMaxText) fail(line, "the rendered text grows beyond 16 MiB");
  }

  Flow exec(const Stmt& s, Frame& f, std::string& out) {
    Depth depth(*this, s.line);
    switch (s.kind) {
      case Stmt::Kind::text: emit(out, s.text, s.line); return Flow::normal;
      case Stmt::Kind::output: emit(out, checked(str(eval(*s.expr, f)), s.line), s.line); return Flow::normal;
      case Stmt::Kind::if_:
        for (const auto& [cond, body] : s.branches) {
          if (cond == nullptr || truthy(eval(*cond, f))) return exec_body(body, f, out);
        }
        return Flow::normal;
      case Stmt::Kind::for_: exec_for(s, f, out); return Flow::normal;
      case Stmt::Kind::set: assign(s, eval(*s.expr, f), f); return Flow::normal;
      case Stmt::Kind::set_block: {  // a break or continue inside leaves the loop around it before
        std::string text;              // the name is set, as in Jinja
        const Flow flow = exec_body(s.body, f, text);
        if (flow == Flow::normal) f.set(s.targets[0], Value::of(std::move(text)));
        return flow;
      }
      case Stmt::Kind::macro: define_macro(s, f); return Flow::normal;
      case Stmt::Kind::call_block: exec_call_block(s, f, out); return Flow::normal;
      case Stmt::Kind::break_: return Flow::break_;
      case Stmt::Kind::continue_: return Flow::continue_;
      case Stmt::Kind::generation: return exec_body(s.body, f, out);
      case Stmt::Kind::filter_block: {  // the body in its own scope, its text through the chain (a
        Frame scope{&f, {}};            // break or continue inside leaves before any of it is output)
        std::string text;
        const Flow flow = exec_body(s.body, scope, text);
        if (flow != Flow::normal) return flow;
        scope.set(kFilterBody, Value::of(std::move(text)));
        emit(out, checked(str(eval(*s.expr, scope)), s.line), s.line);
        return Flow::normal;
      }
      case Stmt::Kind::with_: {
        Frame scope{&f, {}};
        std::vector<Value> values;
        for (const auto& [name, value] : s.params) values.push_back(eval(*value, f));
        for (size_t i = 0; i < values.size(); ++i) scope.set(s.params[i].first, std::move(values[i]));
        return exec_body(s.body, scope, out);
      }
    }
    return Flow::normal;
  }

  void bind(const std::vector<std::string>& targets, const Value& v, Frame& f, int line) {
    if (targets.size() == 1) {
      f.set(targets[0], v);
      return;
    }
    List parts = iterate(v, line);
    if (parts.size() != targets.size()) {
      fail(line, "cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(targets.size()) +
                     " names");
    }
    for (size_t i = 0; i < targets.size(); ++i) f.set(targets[i], parts[i]);
  }

  void assign(const Stmt& s, Value v, Frame& f) {
    if (s.attribute.empty()) {
      bind(s.targets, v, f, s.line);
      return;
    }
    Value* ns = f.find(s.targets[0]);
    if (ns == nullptr || !ns->is(Value::Kind::ns)) {
      fail(s.line, "cannot set '" + s.attribute + "' on '" + s.targets[0] + "': only a namespace() takes attributes");
    }
    for (auto& [k, old] : *ns->dict) {
      if (k == s.attribute) {
        old = std::move(v);
        return;
      }
    }
    ns->dict->emplace_back(s.attribute, std::move(v));
  }

  void exec_for(const Stmt& s, Frame& f, std::string& out) {
    List all = iterate(eval(*s.expr, f), s.line);
    List items;
    if (s.condition) {
      for (Value& v : all) {
        Frame scope{&f, {}};
        bind(s.targets, v, scope, s.line);
        if (truthy(eval(*s.condition, scope))) items.push_back(std::move(v));
      }
    } else {
      items = std::move(all);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      if (++steps_ > kMaxSteps) fail(s.line, "the template takes too many steps (more than 1,000,000)");
      Frame scope{&f, {}};
      Dict loop{{"index", Value::of(i + 1)},
                {"index0", Value::of(i)},
                {"revindex", Value::of(n - i)},
                {"revindex0", Value::of(n - i - 1)},
                {"first", Value::of(i == 0)},
                {"last", Value::of(i == n - 1)},
                {"length", Value::of(n)},
                {"depth", Value::of(int64_t{1})},
                {"depth0", Value::of(int64_t{0})},
                {"previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("previtem")},
                {"nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value::undefined("nextitem")},
                {"cycle", Value::of_function("cycle", [i](Args& a, int line) {
                   if (a.positional.empty()) fail(line, "loop.cycle() needs at least one value");
                   return a.positional[static_cast<size_t>(i) % a.positional.size()];
                 })}};
      scope.set("loop", Value::of_dict(std::move(loop)));
      bind(s.targets, items[static_cast<size_t>(i)], scope, s.line);
      if (exec_body(s.body, scope, out) == Flow::break_) break;
    }
    if (n == 0) exec_body(s.else_body, f, out);
  }

  void define_macro(const Stmt& s, Frame& f) {
    const Stmt* macro = &s;
    f.set(s.targets[0], Value::of_function(s.targets[0], [this, macro](Args& args, int line) {
            // The macro sees the template's variables (the root frame), not the caller's. Arguments
            // beyond its parameters reach it as `varargs` and `kwargs`; a {% call %} block's as
            // `caller`.
            Frame scope{&root_, {}};
            List varargs;
            for (size_t i = macro->params.size(); i < args.positional.size(); ++i) varargs.push_back(args.positional[i]);
            Dict kwargs;
            for (const auto& [k, v] : args.keyword) {
              bool known = false;
              for (const auto& p : macro->params) known = known || p.first == k;
              if (k == "caller") {
                scope.set("caller", v);
              } else if (!known) {
                kwargs.emplace_back(k, v);
              }
            }
            scope.set("varargs", Value::list(std::move(varargs), Value::Kind::tuple));
            scope.set("kwargs", Value::of_dict(std::move(kwargs)));
            for (size_t i = 0; i < macro->params.size(); ++i) {
              const auto& [name, fallback] = macro->params[i];
              const Value* given = i < args.positional.size() ? &args.positional[i] : nullptr;
              for (const auto& [k, v] : args.keyword) {
                if (k == name) given = &v;
              }
              scope.set(name, given != nullptr ? *given : fallback ? eval(*fallback, scope) : Value::undefined(name));
            }
            std::string text;
            exec_body(macro->body, scope, text);
            return Value::of(std::move(text));
          }));
  }

  Value eval(const Node& n, Frame& f) {
    Depth depth(*this, n.line);
    switch (n.kind) {
      case Node::Kind::literal: return n.value;
      case Node::Kind::unpack: fail(n.line, "* and ** unpack only a call's arguments");
      case Node::Kind::name: {
        if (Value* v = f.find(n.text)) return *v;
        return global(n.text);
      }
      case Node::Kind::attr: return attribute(eval(*n.kids[0], f), n.text, n.line);
      case Node::Kind::item: return item(eval(*n.kids[0], f), eval(*n.kids[1], f), n.line);
      case Node::Kind::slice: return slice(n, f);
      case Node::Kind::call: return call(n, f);
      case Node::Kind::filter: {
        Value v = eval(*n.kids[0], f);
        Args args = arguments(n, f);
        return apply_filter(n.text, std::move(v), args, n.line);
      }
      case Node::Kind::test: {
        Value v = eval(*n.kids[0], f);
        Args args = arguments(n, f);
        return Value::of(apply_test(n.text, v, args, n.line) != n.negated);
      }
      case Node::Kind::neg:
      case Node::Kind::pos: {
        Value v = eval(*n.kids[0], f);
        if (!v.is_number()) fail(n.line, "bad operand type for unary " + std::string(n.kind == Node::Kind::neg ? "-" : "+") +
                                             ": '" + type_name(v) + "'");
        if (n.kind == Node::Kind::pos) return v.is(Value::Kind::boolean) ? Value::of(int64_t{v.boolean}) : v;
        if (v.is(Value::Kind::real)) return Value::of(-v.real);
        const int64_t i = v.is(Value::Kind::boolean) ? int64_t{v.boolean} : v.integer;
        if (i == INT64_MIN) fail(n.line, "integer overflow");
        return Value::of(-i);
      }
      case Node::Kind::not_: return Value::of(!truthy(eval(*n.kids[0], f)));
      case Node::Kind::and_: {
        Value a = eval(*n.kids[0], f);
        return truthy(a) ? eval(*n.kids[1], f) : a;
      }
      case Node::Kind::or_: {
        Value a = eval(*n.kids[0], f);
        return truthy(a) ? a : eval(*n.kids[1], f);
      }
      case Node::Kind::binary: return binary(n.text, eval(*n.kids[0], f), eval(*n.kids[1], f), n.line);
      case Node::Kind::compare: {
        Value left = eval(*n.kids[0], f);
        for (size_t i = 0; i < n.ops.size(); ++i) {
          Value right = eval(*n.kids[i + 1], f);
          if (!compare(n.ops[i], left, right, n.line)) return Value::of(false);
          left = std::move(right);
        }
        return Value::of(true);
      }
      case Node::Kind::cond:
        if (truthy(eval(*n.kids[1], f))) return eval(*n.kids[0], f);
        return n.kids[2] ? eval(*n.kids[2], f) : Value::undefined("the else branch");
      case Node::Kind::list:
      case Node::Kind::tuple: {
        List items;
        for (const auto& k : n.kids) items.push_back(eval(*k, f));
        return Value::list(std::move(items), n.kind == Node::Kind::list ? Value::Kind::list : Value::Kind::tuple);
      }
      case Node::Kind::dict: {
        Dict d;
        for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
          Value key = eval(*n.kids[i], f);
          if (!key.is(Value::Kind::string)) fail(n.line, "dict keys must be strings here, got " + type_name(key));
          Value value = eval(*n.kids[i + 1], f);
          auto at = std::find_if(d.begin(), d.end(), [&](const auto& e) { return e.first == key.text; });
          if (at != d.end()) {
            at->second = std::move(value);
          } else {
            d.emplace_back(std::move(key.text), std::move(value));
          }
        }
        return Value::of_dict(std::move(d));
      }
    }
    return Value::undefined("");
  }

  // A call's arguments, *xs and **d spread.
  Args arguments(const Node& n, Frame& f) {
    Args a;
    for (size_t i = 1; i < n.kids.size(); ++i) {
      const Node& k = *n.kids[i];
      if (k.kind != Node::Kind::unpack) {
        a.positional.push_back(eval(k, f));
        continue;
      }
      for (Value& v : iterate(eval(*k.kids[0], f), k.line)) a.positional.push_back(std::move(v));
    }
    for (const auto& [name, e] : n.keyword) {
      if (name != "**") {
        a.keyword.emplace_back(name, eval(*e, f));
        continue;
      }
      const Value d = eval(*e->kids[0], f);
      if (!d.is(Value::Kind::dict)) fail(e->line, "** takes a dict, got " + type_name(d));
      for (const auto& entry : *d.dict) a.keyword.push_back(entry);
    }
    return a;
  }

  Value attribute(const Value& obj, const std::string& name, int line) {
    switch (obj.kind) {
      case Value::Kind::undefined: undefined_error(obj, line);
      case Value::Kind::dict:
      case Value::Kind::ns:
        if (const Value* v = find(*obj.dict, name)) return *v;
        return Value::undefined(name);
      default: return Value::undefined(name);
    }
  }

  // Python's slice of a list, tuple or string.
  Value slice(const Node& n, Frame& f) {
    const Value obj = eval(*n.kids[0], f);
    auto bound = [&](int k) -> std::optional<int64_t> {
      if (!n.kids[static_cast<size_t>(k)]) return std::nullopt;
      Value v = eval(*n.kids[static_cast<size_t>(k)], f);
      if (v.is(Value::Kind::none)) return std::nullopt;
      if (v.is(Value::Kind::boolean)) return int64_t{v.boolean};
      if (!v.is(Value::Kind::integer)) fail(n.line, "slice indices must be integers or None, got " + type_name(v));
      return v.integer;
    };
    const auto start = bound(1), stop = bound(2), step_given = bound(3);
    const int64_t step = step_given.value_or(1);
    if (step == 0) fail(n.line, "slice step cannot be zero");
    if (step == INT64_MIN) fail(n.line, "slice step out of range");
    std::vector<std::string_view> chars;
    size_t size = 0;
    if (obj.is_sequence()) {
      size = obj.items->size();
    } else if (obj.is(Value::Kind::string)) {
      chars = characters(obj.text);
      size = chars.size();
    } else if (obj.is(Value::Kind::undefined)) {
      undefined_error(obj, n.line);
    } else {
      return Value::undefined("slice");
    }
    const int64_t len = static_cast<int64_t>(size);
    auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
      if (!v) return fallback;
      int64_t i = *v < 0 ? std::max<int64_t>(*v, -len - 1) + len : *v;
      return step > 0 ? std::clamp<int64_t>(i, 0, len) : std::clamp<int64_t>(i, -1, len - 1);
    };
    const int64_t b = clamp(start, step > 0 ? 0 : len - 1), e = clamp(stop, step > 0 ? len : -1);
    List items;
    std::string text;
    for (int64_t i = b; step > 0 ? i < e : i > e; i += step) {
      if (obj.is(Value::Kind::string)) {
        text += chars[static_cast<size_t>(i)];
      } else {
        items.push_back((*obj.items)[static_cast<size_t>(i)]);
      }
      if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
    }
    if (obj.is(Value::Kind::string)) return Value::of(std::move(text));
    return Value::list(std::move(items), obj.kind);
  }

  // A call; `caller`, when given, is passed as the keyword argument a macro reads as caller().
  Value call(const Node& n, Frame& f, const Value* caller = nullptr) {
    const Node& callee = *n.kids[0];
    if (callee.kind == Node::Kind::attr) {
      Value obj = eval(*callee.kids[0], f);
      if (obj.is(Value::Kind::undefined)) undefined_error(obj, n.line);
      Args args = arguments(n, f);
      if (caller != nullptr) args.keyword.emplace_back("caller", *caller);
      if (std::optional<Value> r = call_method(obj, callee.text, args, n.line)) return *r;
      return call_value(attribute(obj, callee.text, n.line), args, n.line, callee.text);
    }
    Value fn = eval(callee, f);
    Args args = arguments(n, f);
    if (caller != nullptr) args.keyword.emplace_back("caller", *caller);
    return call_value(fn, args, n.line, callee.kind == Node::Kind::name ? callee.text : "the expression");
  }

  // {% call m(args) %}body{% endcall %}: m runs with caller() rendering body in this scope. The
  // caller lives as long as the statement: a template that keeps it and calls it later gets an
  // error, not a frame that is gone.
  void exec_call_block(const Stmt& s, Frame& f, std::string& out) {
    auto alive = std::make_shared<bool>(true);
    Frame* where = &f;
    const Body* body = &s.body;
    const Value caller = Value::of_function("caller", [this, alive, where, body](Args&, int line) {
      if (!*alive) fail(line, "caller() outside its {% call %} block");
      Frame scope{where, {}};
      std::string text;
      exec_body(*body, scope, text);
      return Value::of(std::move(text));
    });
    struct Expire {
      std::shared_ptr<bool> alive;
      ~Expire() { *alive = false; }
    } expire{alive};
    emit(out, checked(str(call(*s.expr, f, &caller)), s.line), s.line);
  }

  static Value call_value(const Value& fn, Args& args, int line, const std::string& name) {
    if (fn.is(Value::Kind::function)) return (*fn.function)(args, line);
    if (fn.is(Value::Kind::undefined)) fail(line, "'" + name + "' is undefined");
    fail(line, std::string("'").append(type_name(fn)).append("' object is not callable"));
  }

  Frame& root_;
  int depth_ = 0;
  int64_t steps_ = 0;
};

}  // namespace

Template::Template(std::shared_ptr<const Program> program, std::string where)
    : program_(std::move(program)), where_(std::move(where)) {}

namespace {
Status error_at(const std::string& where, const Error& e) {
  return invalid_argument(where + (e.line > 0 ? " line " + std::to_string(e.line) : std::string()) + ": " + e.message);
}
}  // namespace

Result<Template> Template::parse(const std::string& source, const std::string& where) {
  try {
    return Template(std::make_shared<const Program>(parse_program(source)), where);
  } catch (const Error& e) {
    return error_at(where, e);
  } catch (const std::exception& e) {
    return invalid_argument(where + ": " + e.what());
  }
}

Result<std::string> Template::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) return invalid_argument(where_ + ": the context must be a JSON object");
  try {
    Frame root;
    for (const auto& [k, v] : context.items()) root.set(k, from_json(v));
    std::string out;
    Renderer(root).run(program_->body, out);
    return out;
  } catch (const Error& e) {
    return error_at(where_, e);
  } catch (const std::exception& e) {
    return invalid_argument(where_ + ": " + e.what());
  }
}

}  // namespace sparsa::dlm::jinja
