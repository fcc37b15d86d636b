// UTF-8 of one code point, shared by the tokenizer (its byte-to-character map, its pre-tokenizer's
// character classes) and the chat-template interpreter (\x, \u and \U escapes; strings by code
// point).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace sparsa::dlm {

// An ill-formed sequence decodes to kInvalidUtf8 + its first byte.
inline constexpr uint32_t kInvalidUtf8 = 0x110000u;

// Decodes the code point at s[i] and sets *len to its length in bytes. Well-formed means the
// Unicode standard's table of UTF-8 byte sequences (no overlong forms, no surrogates, nothing
// above U+10FFFF); an ill-formed one is its maximal subpart (the longest start of a well-formed
// sequence, at least one byte), which Rust's from_utf8_lossy (the tokenizers package) and Python
// each replace by one U+FFFD.
inline uint32_t decode_utf8(std::string_view s, size_t i, size_t* len) {
  const auto b = [&](size_t j) { return static_cast<unsigned char>(s[j]); };
  const unsigned char c = b(i);
  *len = 1;
  if (c < 0x80) return c;
  size_t n = 0;
  uint32_t cp = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;  // overlong below
    if (c == 0xED) hi = 0x9F;  // surrogates above
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;  // overlong below
    if (c == 0xF4) hi = 0x8F;  // beyond U+10FFFF above
  } else {
    return kInvalidUtf8 + c;  // a continuation byte, C0, C1, F5..FF
  }
  for (size_t j = 1; j < n; ++j) {
    const unsigned char x = i + j < s.size() ? b(i + j) : 0;
    if (i + j >= s.size() || x < (j == 1 ? lo : 0x80) || x > (j == 1 ? hi : 0xBF)) {
      *len = j;
      return kInvalidUtf8 + c;
    }
    cp = (cp << 6) | (x & 0x3F);
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
