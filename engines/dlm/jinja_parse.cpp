// The chat-template interpreter's lexer and parser (jinja.h): Jinja's grammar and operator
// precedence, with the whitespace rules transformers renders chat templates under
// (trim_blocks: the newline after a block or comment tag is dropped; lstrip_blocks: spaces and
// tabs between a line's start and a block or comment tag are dropped; `-` strips, `+` keeps).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "jinja_ast.h"
#include "utf8.h"

namespace sparsa::dlm::jinja {
namespace {

// Nesting deeper than this (parentheses, filters, blocks) is refused: a chat template nests a
// few levels, and a bound keeps hostile input from exhausting the stack.
constexpr int kMaxDepth = 128;

// Python's str.splitlines() boundaries become "\n" and one trailing newline goes, as Jinja's
// "\n".join(source.splitlines()) does.
std::string normalise_newlines(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\r') {
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
      out += '\n';
    } else if (c == '\v' || c == '\f' || c == 0x1c || c == 0x1d || c == 0x1e) {
      out += '\n';
    } else if (c == 0xC2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) == 0x85) {
      out += '\n';
      ++i;
    } else if (c == 0xE2 && i + 2 < s.size() && static_cast<unsigned char>(s[i + 1]) == 0x80 &&
               (static_cast<unsigned char>(s[i + 2]) == 0xA8 || static_cast<unsigned char>(s[i + 2]) == 0xA9)) {
      out += '\n';
      i += 2;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

struct Token {
  enum class Type { text, var_begin, var_end, block_begin, block_end, name, string, integer, real, op, eof };
  Type type;
  std::string text;
  int line;
  int64_t integer = 0;
  double real = 0;
};
using T = Token::Type;

class Lexer {
 public:
  explicit Lexer(std::string source) : s_(std::move(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;  // the last tag's match ended a line (or nothing came yet)
    while (pos_ < s_.size()) {
      size_t start = pos_;
      while (start + 1 < s_.size() && !(s_[start] == '{' && (s_[start + 1] == '{' || s_[start + 1] == '%' ||
                                                             s_[start + 1] == '#'))) {
        ++start;
      }
      if (start + 1 >= s_.size()) {
        emit_text(s_.substr(pos_), line_);
        break;
      }
      std::string text = s_.substr(pos_, start - pos_);
      const int text_line = line_;
      line_ += count_newlines(text);
      const char kind = s_[start + 1];
      size_t p = start + 2;
      const char control = p < s_.size() && (s_[p] == '-' || s_[p] == '+') ? s_[p] : 0;
      if (control == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (control != '+' && kind != '{') {
        const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if (line_start > 0 || line_starting) {
          bool blank = line_start < text.size();
          for (size_t i = line_start; i < text.size(); ++i) blank = blank && is_space(text[i]);
          if (blank) text.resize(line_start);
        }
      }
      if (control) ++p;
      emit_text(std::move(text), text_line);
      pos_ = p;
      if (kind == '#') {
        const size_t end = s_.find("#}", pos_);
        if (end == std::string::npos) fail(line_, "a comment is not closed ('#}' missing)");
        line_ += count_newlines(s_.substr(pos_, end - pos_));
        const char end_control = end > pos_ && (s_[end - 1] == '-' || s_[end - 1] == '+') ? s_[end - 1] : 0;
        pos_ = end + 2;
        line_starting = finish_tag(end_control, true);
        continue;
      }
      const bool block = kind == '%';
      tokens_.push_back({block ? T::block_begin : T::var_begin, "", line_});
      const size_t first = tokens_.size();
      const char end_control = lex_tag(block);
      line_starting = finish_tag(end_control, block);
      if (block && tokens_.size() == first + 2 && tokens_[first].type == T::name && tokens_[first].text == "raw") {
        lex_raw();
        line_starting = false;
      }
    }
    tokens_.push_back({T::eof, "", line_});
    return std::move(tokens_);
  }

 private:
  static int count_newlines(const std::string& t) {
    int n = 0;
    for (char c : t) n += c == '\n';
    return n;
  }

  void emit_text(std::string text, int line) {
    if (!text.empty()) tokens_.push_back({T::text, std::move(text), line});
  }

  // After a tag's closing delimiter: `-` eats the whitespace that follows; a block or comment
  // (not `+`) eats one newline. Returns whether what was eaten ended a line.
  bool finish_tag(char end_control, bool block) {
    if (end_control == '-') {
      bool newline = false;
      while (pos_ < s_.size() && is_space(s_[pos_])) {
        newline = s_[pos_] == '\n';
        line_ += s_[pos_] == '\n';
        ++pos_;
      }
      return newline;
    }
    if (block && end_control != '+' && pos_ < s_.size() && s_[pos_] == '\n') {
      ++pos_;
      ++line_;
      return true;
    }
    return false;
  }

  // The tokens of one {{ }} or {% %} up to its closing delimiter; returns its control character.
  char lex_tag(bool block) {
    const char close = block ? '%' : '}';
    std::vector<char> brackets;
    while (true) {
      while (pos_ < s_.size() && is_space(s_[pos_])) {
        line_ += s_[pos_] == '\n';
        ++pos_;
      }
      if (pos_ >= s_.size()) fail(line_, block ? "a block tag is not closed ('%}' missing)"
                                               : "an expression is not closed ('}}' missing)");
      if (brackets.empty()) {
        if ((s_[pos_] == '-' || s_[pos_] == '+') && s_.compare(pos_ + 1, 2, std::string{close, '}'}) == 0 &&
            (block || s_[pos_] == '-')) {
          const char control = s_[pos_];
          pos_ += 3;
          tokens_.push_back({block ? T::block_end : T::var_end, "", line_});
          return control;
        }
        if (s_.compare(pos_, 2, std::string{close, '}'}) == 0) {
          pos_ += 2;
          tokens_.push_back({block ? T::block_end : T::var_end, "", line_});
          return 0;
        }
      }
      const char c = s_[pos_];
      if (c == '\'' || c == '"') {
        lex_string(c);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number();
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[e])) || s_[e] == '_')) ++e;
        tokens_.push_back({T::name, s_.substr(pos_, e - pos_), line_});
        pos_ = e;
      } else {
        static const char* const kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* two : kTwo) {
          if (s_.compare(pos_, 2, two) == 0) op = two;
        }
        if (op.empty()) {
          if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) == std::string_view::npos) {
            fail(line_, std::string("unexpected character '") + c + "' in a tag");
          }
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") {
          if (brackets.size() >= kMaxDepth) fail(line_, "brackets nested too deeply");
          brackets.push_back(op[0]);
        } else if (op == ")" || op == "]" || op == "}") {
          const char open = op == ")" ? '(' : op == "]" ? '[' : '{';
          if (brackets.empty() || brackets.back() != open) fail(line_, "unbalanced '" + op + "'");
          brackets.pop_back();
        }
        tokens_.push_back({T::op, op, line_});
        pos_ += op.size();
      }
    }
  }

  void lex_string(char quote) {
    const int line = line_;
    std::string out;
    ++pos_;
    while (true) {
      if (pos_ >= s_.size()) fail(line, "a string literal is not closed");
      const char c = s_[pos_++];
      if (c == quote) break;
      line_ += c == '\n';
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail(line, "a string literal is not closed");
      const char e = s_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '0': out += '\0'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '\n': ++line_; break;  // a backslash-newline joins the lines
        case 'x': case 'u': case 'U': {
          const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t code = 0;
          for (int i = 0; i < digits; ++i) {
            if (pos_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[pos_]))) {
              fail(line, std::string("a \\") + e + " escape needs " + std::to_string(digits) + " hex digits");
            }
            const char h = s_[pos_++];
            code = code * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                                                                                                 : std::tolower(h) - 'a' + 10);
          }
          if (code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) fail(line, "an escape outside Unicode");
          append_utf8(out, code);
          break;
        }
        default: out += '\\'; out += e;  // Python keeps unknown escapes as written
      }
    }
    tokens_.push_back({T::string, std::move(out), line});
  }

  void lex_number() {
    size_t e = pos_;
    auto digits = [&] {
      while (e < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[e])) || s_[e] == '_')) ++e;
    };
    digits();
    bool real = false;
    if (e + 1 < s_.size() && s_[e] == '.' && std::isdigit(static_cast<unsigned char>(s_[e + 1]))) {
      real = true;
      ++e;
      digits();
    }
    if (e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t x = e + 1;
      if (x < s_.size() && (s_[x] == '+' || s_[x] == '-')) ++x;
      if (x < s_.size() && std::isdigit(static_cast<unsigned char>(s_[x]))) {
        real = true;
        e = x;
        digits();
      }
    }
    std::string text;
    for (size_t i = pos_; i < e; ++i) {
      if (s_[i] != '_') text += s_[i];
    }
    Token t{real ? T::real : T::integer, text, line_};
    if (real) {
      t.real = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
      if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX)) fail(line_, "integer literal too large");
      t.integer = static_cast<int64_t>(v);
    }
    tokens_.push_back(std::move(t));
    pos_ = e;
  }

  // {% raw %}: the text up to {% endraw %} as it stands.
  void lex_raw() {
    tokens_.resize(tokens_.size() - 3);  // block_begin, "raw", block_end
    size_t at = pos_;
    while (true) {
      const size_t open = s_.find("{%", at);
      if (open == std::string::npos) fail(line_, "{% raw %} is not closed ({% endraw %} missing)");
      size_t p = open + 2;
      const bool strip_before = p < s_.size() && s_[p] == '-';
      if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) ++p;
      while (p < s_.size() && is_space(s_[p])) ++p;
      if (s_.compare(p, 6, "endraw") != 0) {
        at = open + 2;
        continue;
      }
      p += 6;
      while (p < s_.size() && is_space(s_[p])) ++p;
      char control = 0;
      if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) control = s_[p++];
      if (s_.compare(p, 2, "%}") != 0) {
        at = open + 2;
        continue;
      }
      std::string text = s_.substr(pos_, open - pos_);
      if (strip_before) {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      }
      const int text_line = line_;
      line_ += count_newlines(s_.substr(pos_, p + 2 - pos_));
      emit_text(std::move(text), text_line);
      pos_ = p + 2;
      finish_tag(control, true);
      return;
    }
  }

  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Program run() {
    Program p;
    std::string end;
    p.body = parse_body({}, end);
    return p;
  }

 private:
  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool at_op(const char* op) const { return cur().type == T::op && cur().text == op; }
  bool at_name(const char* name) const { return cur().type == T::name && cur().text == name; }
  const Token& next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case T::eof: return "the end of the template";
      case T::block_end: return "the end of the tag";
      case T::var_end: return "'}}'";
      case T::string: return "a string";
      case T::integer: case T::real: return "a number";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!at_op(op)) fail(cur().line, std::string("expected '") + op + "', found " + describe(cur()));
    next();
  }
  std::string expect_name(const char* what) {
    if (cur().type != T::name) fail(cur().line, std::string("expected ") + what + ", found " + describe(cur()));
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != T::block_end) fail(cur().line, "expected the end of the tag, found " + describe(cur()));
    next();
  }

  struct Depth {
    explicit Depth(Parser& p) : p(p) {
      if (++p.depth_ > kMaxDepth) fail(p.cur().line, "the template nests too deeply");
    }
    ~Depth() { --p.depth_; }
    Parser& p;
  };

  static NodePtr node(Node::Kind kind, int line) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = line;
    return n;
  }

  // Statements up to a block tag named in `ends` (its name returned in `end`, the parser left
  // after the name) or, with no `ends`, to the end of the template.
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
    Depth depth(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == T::eof) {
        if (!ends.empty()) fail(t.line, "the template ends inside a block ({% " + ends.back() + " %} missing)");
        return body;
      }
      if (t.type == T::text) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::text;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == T::var_begin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::output;
        s->line = t.line;
        s->expr = parse_tuple(true);
        if (cur().type != T::var_end) fail(cur().line, "expected '}}', found " + describe(cur()));
        next();
        body.push_back(std::move(s));
      } else if (t.type == T::block_begin) {
        next();
        const int line = cur().line;
        const std::string name = expect_name("a tag name");
        for (const std::string& e : ends) {
          if (name == e) {
            end = name;
            return body;
          }
        }
        if (name.rfind("end", 0) == 0 || name == "elif" || name == "else") {
          fail(line, ends.empty() ? "{% " + name + " %} outside a block"
                                  : "unexpected {% " + name + " %}: the open block ends with {% " + ends.back() + " %}");
        }
        body.push_back(parse_statement(name, line));
      } else {
        fail(t.line, "unexpected " + describe(t));
      }
    }
  }

  std::unique_ptr<Stmt> parse_statement(const std::string& name, int line) {
    auto s = std::make_unique<Stmt>();
    s->line = line;
    std::string end;
    if (name == "if") {
      s->kind = Stmt::Kind::if_;
      NodePtr cond = parse_tuple(true);
      expect_block_end();
      while (true) {
        Body body = parse_body({"elif", "else", "endif"}, end);
        s->branches.emplace_back(std::move(cond), std::move(body));
        if (end == "elif") {
          cond = parse_tuple(true);
          expect_block_end();
          continue;
        }
        if (end == "else") {
          expect_block_end();
          s->branches.emplace_back(nullptr, parse_body({"endif"}, end));
        }
        expect_block_end();
        return s;
      }
    }
    if (name == "for") {
      s->kind = Stmt::Kind::for_;
      s->targets = parse_targets();
      if (!at_name("in")) fail(cur().line, "expected 'in' in a for tag, found " + describe(cur()));
      next();
      s->expr = parse_tuple(false);
      if (at_name("if")) {
        next();
        s->condition = parse_expression(true);
      }
      if (at_name("recursive")) fail(cur().line, "recursive for loops are not supported");
      expect_block_end();
      ++loops_;
      s->body = parse_body({"else", "endfor"}, end);
      --loops_;
      if (end == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"}, end);
      }
      expect_block_end();
      return s;
    }
    if (name == "set") {
      s->targets = parse_targets();
      if (s->targets.size() == 1 && at_op(".")) {
        next();
        s->attribute = expect_name("an attribute name");
      }
      if (at_op("=")) {
        next();
        s->kind = Stmt::Kind::set;
        s->expr = parse_tuple(true);
        expect_block_end();
        return s;
      }
      if (s->targets.size() != 1 || !s->attribute.empty()) fail(line, "a block set takes one name");
      expect_block_end();
      s->kind = Stmt::Kind::set_block;
      s->body = parse_body({"endset"}, end);
      expect_block_end();
      return s;
    }
    if (name == "macro") {
      s->kind = Stmt::Kind::macro;
      s->targets.push_back(expect_name("a macro name"));
      expect_op("(");
      while (!at_op(")")) {
        std::string param = expect_name("a parameter name");
        NodePtr fallback;
        if (at_op("=")) {
          next();
          fallback = parse_expression(true);
        }
        s->params.emplace_back(std::move(param), std::move(fallback));
        if (!at_op(",")) break;
        next();
      }
      expect_op(")");
      expect_block_end();
      const int loops = loops_;
      loops_ = 0;  // a loop outside the macro is not the macro's to break
      s->body = parse_body({"endmacro"}, end);
      loops_ = loops;
      expect_block_end();
      return s;
    }
    if (name == "call") {  // {% call m(args) %}body{% endcall %}: m's caller() renders body
      s->kind = Stmt::Kind::call_block;
      if (at_op("(")) fail(line, "{% call(args) %} (a caller with parameters) is not supported");
      s->expr = parse_expression(true);
      if (s->expr->kind != Node::Kind::call) fail(line, "{% call %} takes a macro call");
      expect_block_end();
      const int loops = loops_;
      loops_ = 0;
      s->body = parse_body({"endcall"}, end);
      loops_ = loops;
      expect_block_end();
      return s;
    }
    if (name == "break" || name == "continue") {
      if (loops_ == 0) fail(line, "{% " + name + " %} outside a for loop");
      s->kind = name == "break" ? Stmt::Kind::break_ : Stmt::Kind::continue_;
      expect_block_end();
      return s;
    }
    if (name == "filter") {  // the body's text through a chain of filters
      s->kind = Stmt::Kind::filter_block;
      auto n = node(Node::Kind::name, line);
      n->text = kFilterBody;
      NodePtr chain = std::move(n);
      while (true) {
        auto f = node(Node::Kind::filter, cur().line);
        f->text = expect_name("a filter name");
        f->kids.push_back(std::move(chain));
        if (at_op("(")) parse_arguments(*f);
        chain = std::move(f);
        if (!at_op("|")) break;
        next();
      }
      s->expr = std::move(chain);
      expect_block_end();
      s->body = parse_body({"endfilter"}, end);
      expect_block_end();
      return s;
    }
    if (name == "with") {  // names bound for the body only, their values evaluated outside
      s->kind = Stmt::Kind::with_;
      while (cur().type != T::block_end) {
        std::string target = expect_name("a variable name");
        expect_op("=");
        s->params.emplace_back(std::move(target), parse_expression(true));
        if (!at_op(",")) break;
        next();
      }
      expect_block_end();
      s->body = parse_body({"endwith"}, end);
      expect_block_end();
      return s;
    }
    if (name == "generation") {  // transformers' marker of the assistant's tokens: renders its body
      s->kind = Stmt::Kind::generation;
      expect_block_end();
      s->body = parse_body({"endgeneration"}, end);
      expect_block_end();
      return s;
    }
    fail(line, "unknown or unsupported tag '" + name + "'");
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = at_op("(");
    if (paren) next();
    names.push_back(expect_name("a variable name"));
    while (at_op(",")) {
      next();
      if (paren && at_op(")")) break;
      if (!paren && cur().type != T::name) break;
      names.push_back(expect_name("a variable name"));
    }
    if (paren) expect_op(")");
    return names;
  }

  // An expression, or several separated by commas (a tuple), as {{ }}, set and for take.
  NodePtr parse_tuple(bool with_condition) {
    const int line = cur().line;
    NodePtr first = parse_expression(with_condition);
    if (!at_op(",")) return first;
    auto tuple = node(Node::Kind::tuple, line);
    tuple->kids.push_back(std::move(first));
    while (at_op(",")) {
      next();
      if (cur().type == T::var_end || cur().type == T::block_end || at_op("=")) break;
      tuple->kids.push_back(parse_expression(with_condition));
    }
    return tuple;
  }

  NodePtr parse_expression(bool with_condition) {
    Depth depth(*this);
    NodePtr e = parse_or();
    if (!with_condition) return e;
    while (at_name("if")) {
      const int line = next().line;
      auto cond = node(Node::Kind::cond, line);
      NodePtr test = parse_or();
      NodePtr otherwise;
      if (at_name("else")) {
        next();
        otherwise = parse_expression(true);
      }
      cond->kids.push_back(std::move(e));
      cond->kids.push_back(std::move(test));
      cond->kids.push_back(std::move(otherwise));
      e = std::move(cond);
    }
    return e;
  }

  NodePtr binary(Node::Kind kind, std::string op, NodePtr left, NodePtr right, int line) {
    auto n = node(kind, line);
    n->text = std::move(op);
    n->kids.push_back(std::move(left));
    n->kids.push_back(std::move(right));
    return n;
  }

  NodePtr parse_or() {
    NodePtr left = parse_and();
    while (at_name("or")) {
      const int line = next().line;
      left = binary(Node::Kind::or_, "or", std::move(left), parse_and(), line);
    }
    return left;
  }

  NodePtr parse_and() {
    NodePtr left = parse_not();
    while (at_name("and")) {
      const int line = next().line;
      left = binary(Node::Kind::and_, "and", std::move(left), parse_not(), line);
    }
    return left;
  }

  NodePtr parse_not() {
    if (at_name("not")) {
      Depth depth(*this);
      auto n = node(Node::Kind::not_, next().line);
      n->kids.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  NodePtr parse_compare() {
    const int line = cur().line;
    NodePtr first = parse_math1();
    NodePtr cmp;
    while (true) {
      std::string op;
      if (cur().type == T::op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                  cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = next().text;
      } else if (at_name("in")) {
        next();
        op = "in";
      } else if (at_name("not") && peek().type == T::name && peek().text == "in") {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(Node::Kind::compare, line);
        cmp->kids.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  NodePtr parse_math1() {
    NodePtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      const Token& op = next();
      left = binary(Node::Kind::binary, op.text, std::move(left), parse_concat(), op.line);
    }
    return left;
  }

  NodePtr parse_concat() {
    NodePtr left = parse_math2();
    while (at_op("~")) {
      const int line = next().line;
      left = binary(Node::Kind::binary, "~", std::move(left), parse_math2(), line);
    }
    return left;
  }

  NodePtr parse_math2() {
    NodePtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& op = next();
      left = binary(Node::Kind::binary, op.text, std::move(left), parse_pow(), op.line);
    }
    return left;
  }

  NodePtr parse_pow() {
    NodePtr left = parse_unary(true);
    while (at_op("**")) {
      const int line = next().line;
      left = binary(Node::Kind::binary, "**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  NodePtr parse_unary(bool with_filter) {
    Depth depth(*this);
    NodePtr n;
    if (at_op("-") || at_op("+")) {
      n = node(at_op("-") ? Node::Kind::neg : Node::Kind::pos, cur().line);
      next();
      n->kids.push_back(parse_unary(false));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filters(std::move(n));
    return n;
  }

  NodePtr literal(Value v, int line) {
    auto n = node(Node::Kind::literal, line);
    n->value = std::move(v);
    return n;
  }

  NodePtr parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    switch (t.type) {
      case T::name: {
        next();
        if (t.text == "true" || t.text == "True") return literal(Value::of(true), line);
        if (t.text == "false" || t.text == "False") return literal(Value::of(false), line);
        if (t.text == "none" || t.text == "None") return literal(Value::none(), line);
        auto n = node(Node::Kind::name, line);
        n->text = t.text;
        return n;
      }
      case T::string: {
        std::string s;
        while (cur().type == T::string) s += next().text;  // adjacent literals join, as in Python
        return literal(Value::of(std::move(s)), line);
      }
      case T::integer: next(); return literal(Value::of(t.integer), line);
      case T::real: next(); return literal(Value::of(t.real), line);
      case T::op:
        if (t.text == "(") {
          next();
          if (at_op(")")) {
            next();
            return node(Node::Kind::tuple, line);
          }
          NodePtr first = parse_expression(true);
          if (at_op(")")) {
            next();
            return first;
          }
          auto tuple = node(Node::Kind::tuple, line);
          tuple->kids.push_back(std::move(first));
          while (at_op(",")) {
            next();
            if (at_op(")")) break;
            tuple->kids.push_back(parse_expression(true));
          }
          expect_op(")");
          return tuple;
        }
        if (t.text == "[") {
          next();
          auto list = node(Node::Kind::list, line);
          while (!at_op("]")) {
            list->kids.push_back(parse_expression(true));
            if (!at_op(",")) break;
            next();
          }
          expect_op("]");
          return list;
        }
        if (t.text == "{") {
          next();
          auto dict = node(Node::Kind::dict, line);
          while (!at_op("}")) {
            dict->kids.push_back(parse_expression(true));
            expect_op(":");
            dict->kids.push_back(parse_expression(true));
            if (!at_op(",")) break;
            next();
          }
          expect_op("}");
          return dict;
        }
        break;
      default: break;
    }
    fail(line, "unexpected " + describe(t) + " in an expression");
  }

  NodePtr parse_postfix(NodePtr n) {
    while (true) {
      const int line = cur().line;
      if (at_op(".")) {
        next();
        if (cur().type == T::integer) {  // x.0 is x[0]
          auto item = node(Node::Kind::item, line);
          item->kids.push_back(std::move(n));
          item->kids.push_back(literal(Value::of(next().integer), line));
          n = std::move(item);
          continue;
        }
        auto attr = node(Node::Kind::attr, line);
        attr->text = expect_name("an attribute name");
        attr->kids.push_back(std::move(n));
        n = std::move(attr);
      } else if (at_op("[")) {
        next();
        NodePtr parts[3];
        bool slice = false;
        if (!at_op(":")) parts[0] = parse_expression(true);
        if (at_op(":")) {
          slice = true;
          next();
          if (!at_op("]") && !at_op(":")) parts[1] = parse_expression(true);
          if (at_op(":")) {
            next();
            if (!at_op("]")) parts[2] = parse_expression(true);
          }
        }
        expect_op("]");
        auto access = node(slice ? Node::Kind::slice : Node::Kind::item, line);
        access->kids.push_back(std::move(n));
        for (int k = 0; k < (slice ? 3 : 1); ++k) access->kids.push_back(std::move(parts[k]));
        n = std::move(access);
      } else if (at_op("(")) {
        auto call = node(Node::Kind::call, line);
        call->kids.push_back(std::move(n));
        parse_arguments(*call);
        n = std::move(call);
      } else {
        return n;
      }
    }
  }

  // `( positional..., name=value... )` into kids[1..] and keyword.
  void parse_arguments(Node& n) {
    expect_op("(");
    while (!at_op(")")) {
      if (at_op("*") || at_op("**")) {  // *xs or **d: the items or entries become arguments
        const bool entries = at_op("**");
        auto unpack = node(Node::Kind::unpack, next().line);
        unpack->kids.push_back(parse_expression(true));
        if (entries) {
          n.keyword.emplace_back("**", std::move(unpack));
        } else {
          if (!n.keyword.empty()) fail(cur().line, "*args follows a keyword argument");
          n.kids.push_back(std::move(unpack));
        }
      } else if (cur().type == T::name && peek().type == T::op && peek().text == "=") {
        std::string key = next().text;
        next();
        n.keyword.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!n.keyword.empty()) fail(cur().line, "a positional argument follows a keyword argument");
        n.kids.push_back(parse_expression(true));
      }
      if (!at_op(",")) break;
      next();
    }
    expect_op(")");
  }

  NodePtr parse_filters(NodePtr n) {
    while (true) {
      const int line = cur().line;
      if (at_op("|")) {
        next();
        auto f = node(Node::Kind::filter, line);
        f->text = expect_name("a filter name");
        f->kids.push_back(std::move(n));
        if (at_op("(")) parse_arguments(*f);
        n = std::move(f);
      } else if (at_name("is")) {
        next();
        auto test = node(Node::Kind::test, line);
        if (at_name("not")) {
          next();
          test->negated = true;
        }
        test->text = expect_name("a test name");
        test->kids.push_back(std::move(n));
        if (at_op("(")) {
          parse_arguments(*test);
        } else if ((cur().type == T::name || cur().type == T::string || cur().type == T::integer ||
                    cur().type == T::real || at_op("(") || at_op("[") || at_op("{")) &&
                   !at_name("else") && !at_name("or") && !at_name("and")) {
          if (at_name("is")) fail(cur().line, "tests cannot be chained with 'is'");
          test->kids.push_back(parse_postfix(parse_primary()));
        }
        n = std::move(test);
      } else {
        return n;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loops_ = 0;
};

}  // namespace

Program parse_program(const std::string& source) {
  return Parser(Lexer(normalise_newlines(source)).run()).run();
}

}  // namespace sparsa::dlm::jinja
