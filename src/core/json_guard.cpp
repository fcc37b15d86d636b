#include "core/json_guard.h"

namespace sparsa::detail {

int json_nesting_depth(std::string_view text, int max_depth, size_t* at) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (deepest > max_depth) {
        *at = i;
        return deepest;
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  *at = text.size();
  return deepest;
}

std::string clip(const std::string& s, size_t max_chars) {
  if (s.size() <= max_chars) return s;
  return s.substr(0, max_chars) + "...";
}

}  // namespace sparsa::detail
