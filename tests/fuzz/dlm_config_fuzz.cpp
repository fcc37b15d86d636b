// libFuzzer harness: config.json of the DLM engine (sparsa::dlm::parse_config).
// Any input must give a Config or a Status, never a crash, a hang or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsa/dlm.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = sparsa::dlm::parse_config(text, "fuzz/config.json");
  if (config.ok()) {
    // a valid config is self-consistent
    const auto& c = config.value();
    if (c.n_heads % c.n_kv_heads != 0 || c.head_dim % 2 != 0 || c.mask_token_id >= c.vocab_size) __builtin_trap();
  }
  return 0;
}
