// libFuzzer harness: model.safetensors.index.json (sparsa::dlm::parse_safetensors_index).
// A parsed index names only plain file names (no directory parts), never empty.
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto index = sparsa::dlm::parse_safetensors_index(text, "fuzz/model.safetensors.index.json");
  if (index.ok()) {
    if (index->empty()) __builtin_trap();
    for (const auto& [name, file] : index.value()) {
      if (file.empty() || file.find('/') != std::string::npos || file == "..") __builtin_trap();
    }
  }
  return 0;
}
