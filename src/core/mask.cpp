// The attention masks (sparsa/attention.h): their names, their parser, and the visible key range
// of a query. Every mask shows each query one contiguous range of keys, so the per-element rule
// (mask_visible) and the range (mask_key_begin / mask_key_end) are the same statement; the tests
// check that they agree element by element.
#include <algorithm>
#include <cctype>
#include <limits>
#include <string>

#include "sparsa/attention.h"

namespace sparsa {

namespace {

// floor(a / b) for b > 0 and any sign of a (C++ division truncates toward zero).
int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Query i's position on the key axis: the queries are the last len_q tokens (end alignment).
int64_t query_position(int64_t i, int64_t len_q, int64_t len_kv) { return i + (len_kv - len_q); }

// Blocks and windows beyond any sequence length act as this (so that no arithmetic overflows):
// 2^42 tokens is beyond any tensor this library can hold.
constexpr int64_t kUnbounded = int64_t{1} << 42;
int64_t bounded(int64_t x) { return std::min(x, kUnbounded); }

// A non-negative decimal integer that fits int64 (no sign, no spaces), or -1.
int64_t parse_count(const std::string& text) {
  if (text.empty() || text.size() > 18) return -1;
  int64_t value = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
    value = value * 10 + (c - '0');
  }
  return value;
}

}  // namespace

std::string mask_string(const Mask& mask) {
  switch (mask.kind) {
    case MaskKind::none: return "none";
    case MaskKind::causal: return "causal";
    case MaskKind::block_causal: return "block_causal(" + std::to_string(mask.block) + ")";
    case MaskKind::sliding_window:
      if (mask.window_left == mask.window_right) return "sliding_window(" + std::to_string(mask.window_left) + ")";
      return "sliding_window(" + std::to_string(mask.window_left) + "," + std::to_string(mask.window_right) + ")";
  }
  return "?";
}

Result<Mask> parse_mask(const std::string& text, const char* what) {
  auto bad = [&]() {
    return invalid_argument(std::string(what) +
                            ": expected none, causal, block_causal(B), sliding_window(W) or sliding_window(L,R) "
                            "(B > 0, W, L, R >= 0; also written block_causal:B, sliding_window:W), got '" +
                            text + "'");
  };
  if (text == "none" || text.empty()) return Mask::none();
  if (text == "causal") return Mask::causal();
  // name(args) or name:args
  std::string name, args;
  if (const size_t open = text.find('('); open != std::string::npos) {
    if (text.back() != ')') return bad();
    name = text.substr(0, open);
    args = text.substr(open + 1, text.size() - open - 2);
  } else if (const size_t colon = text.find(':'); colon != std::string::npos) {
    name = text.substr(0, colon);
    args = text.substr(colon + 1);
  } else {
    return bad();
  }
  if (name == "block_causal") {
    const int64_t block = parse_count(args);
    if (block <= 0) return bad();
    return Mask::block_causal(block);
  }
  if (name == "sliding_window") {
    const size_t comma = args.find(',');
    const int64_t left = parse_count(args.substr(0, comma));
    const int64_t right = comma == std::string::npos ? left : parse_count(args.substr(comma + 1));
    if (left < 0 || right < 0) return bad();
    return Mask::sliding_window(left, right);
  }
  return bad();
}

Status validate_mask(const Mask& mask, const char* what) {
  const std::string name(what);
  switch (mask.kind) {
    case MaskKind::none:
    case MaskKind::causal: return {};
    case MaskKind::block_causal:
      if (mask.block <= 0) {
        return invalid_argument(name + ".block: block_causal expects a block of at least 1 token, got " +
                                std::to_string(mask.block));
      }
      return {};
    case MaskKind::sliding_window:
      if (mask.window_left < 0 || mask.window_right < 0) {
        return invalid_argument(name + ": sliding_window expects windows >= 0, got (" +
                                std::to_string(mask.window_left) + ", " + std::to_string(mask.window_right) + ")");
      }
      return {};
  }
  return invalid_argument(name + ".kind: unknown mask kind " + std::to_string(static_cast<int>(mask.kind)));
}

bool mask_visible(const Mask& mask, int64_t i, int64_t j, int64_t len_q, int64_t len_kv) {
  const int64_t pos = query_position(i, len_q, len_kv);
  switch (mask.kind) {
    case MaskKind::none: return true;
    case MaskKind::causal: return j <= pos;
    case MaskKind::block_causal: return floor_div(j, bounded(mask.block)) <= floor_div(pos, bounded(mask.block));
    case MaskKind::sliding_window: return pos - bounded(mask.window_left) <= j && j <= pos + bounded(mask.window_right);
  }
  return true;
}

int64_t mask_key_begin(const Mask& mask, int64_t i, int64_t len_q, int64_t len_kv) {
  if (mask.kind != MaskKind::sliding_window) return 0;
  const int64_t pos = query_position(i, len_q, len_kv);
  return std::clamp<int64_t>(pos - bounded(mask.window_left), 0, len_kv);
}

int64_t mask_key_end(const Mask& mask, int64_t i, int64_t len_q, int64_t len_kv) {
  const int64_t pos = query_position(i, len_q, len_kv);
  int64_t end = len_kv;
  switch (mask.kind) {
    case MaskKind::none: break;
    case MaskKind::causal: end = pos + 1; break;
    case MaskKind::block_causal: end = (floor_div(pos, bounded(mask.block)) + 1) * bounded(mask.block); break;
    case MaskKind::sliding_window: end = pos + bounded(mask.window_right) + 1; break;
  }
  return std::clamp<int64_t>(end, 0, len_kv);
}

}  // namespace sparsa
