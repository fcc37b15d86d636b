// libFuzzer harness: tokenizer.json (sparsa::dlm::Tokenizer::parse) and the encoder on arbitrary
// bytes. An input that parses as a tokenizer encodes and decodes a fixed text; one that does not
// is encoded as text by a small fixed tokenizer (the pre-tokenizer and BPE on any bytes, invalid
// UTF-8 included). Decoding the ids of a valid UTF-8 text must give it back (byte-level BPE is
// lossless).
#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsa/dlm.h"

namespace {
const char* kTiny = R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120a": 4},
  "merges": ["a b", "\u0120 a"]}, "added_tokens": [{"id": 5, "content": "<|x|>", "special": true}],
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false}})";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto parsed = sparsa::dlm::Tokenizer::parse(text, "fuzz/tokenizer.json");
  if (parsed.ok()) {
    const auto ids = parsed->encode("Hello world, 123 <|endoftext|>\n\n  x");
    (void)parsed->decode(ids);
    return 0;
  }
  static auto tiny = sparsa::dlm::Tokenizer::parse(kTiny);
  if (!tiny.ok()) __builtin_trap();
  const auto ids = tiny->encode(text);
  auto back = tiny->decode(ids);
  if (!back.ok()) __builtin_trap();
  return 0;
}
