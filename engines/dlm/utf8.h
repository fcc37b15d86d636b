// UTF-8 of one code point, shared by the tokenizer (its byte-to-character map, its pre-tokenizer's
// character classes) and the chat-template interpreter (\x, \u and \U escapes; strings by code
// point).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace sparsa::dlm {

// A byte that starts no valid sequence decodes to kInvalidUtf8 + the byte, one byte long.
inline constexpr uint32_t kInvalidUtf8 = 0x110000u;

// Decodes the code point at s[i] and sets *len to its length in bytes (1 for an invalid byte).
inline uint32_t decode_utf8(std::string_view s, size_t i, size_t* len) {
  const auto b = [&](size_t j) { return static_cast<unsigned char>(s[j]); };
  const unsigned char c = b(i);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  *len = 1;
  if (n == 0 || i + n > s.size()) return kInvalidUtf8 + c;
  uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t j = 1; j < n; ++j) {
    if ((b(i + j) & 0xC0) != 0x80) return kInvalidUtf8 + c;
    cp = (cp << 6) | (b(i + j) & 0x3F);
  }
  *len = n;
  return cp;
}

inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace sparsa::dlm
