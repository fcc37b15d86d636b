// libFuzzer harness: the mask parser (sparsa::parse_mask; include/sparsa/attention.h), the text of
// `sparsa run --mask` and of Python's mask= strings. Any input must give a Mask or a Status naming
// the argument, never a crash, a hang or a sanitizer report; an accepted mask must be valid, print
// to a text that parses back to itself, and its key ranges must say what its element rule says
// (over small lengths, including len_q != len_kv both ways).
#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsa/attention.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto mask = sparsa::parse_mask(text, "--mask");
  if (!mask.ok()) {
    if (mask.status().message().rfind("--mask: ", 0) != 0) __builtin_trap();
    return 0;
  }
  if (!sparsa::validate_mask(*mask).ok()) __builtin_trap();
  auto again = sparsa::parse_mask(sparsa::mask_string(*mask));
  if (!again.ok() || sparsa::mask_string(*again) != sparsa::mask_string(*mask)) __builtin_trap();
  for (int64_t len_q = 1; len_q <= 6; ++len_q) {
    for (int64_t len_kv = 1; len_kv <= 6; ++len_kv) {
      int64_t prev_begin = 0, prev_end = 0;
      for (int64_t i = 0; i < len_q; ++i) {
        const int64_t begin = sparsa::mask_key_begin(*mask, i, len_q, len_kv);
        const int64_t end = sparsa::mask_key_end(*mask, i, len_q, len_kv);
        if (begin < 0 || end < 0 || begin > len_kv || end > len_kv) __builtin_trap();
        if (begin < prev_begin || end < prev_end) __builtin_trap();
        prev_begin = begin;
        prev_end = end;
        for (int64_t j = 0; j < len_kv; ++j) {
          if (sparsa::mask_visible(*mask, i, j, len_q, len_kv) != (begin <= j && j < end)) __builtin_trap();
        }
      }
    }
  }
  return 0;
}
