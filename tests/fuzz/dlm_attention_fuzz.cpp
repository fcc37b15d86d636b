// libFuzzer harness: the DLM engine's per-layer attention specs (`--attention METHOD` and
// `--attention-layers LAYERS=METHOD`; engines/dlm/attention.cpp's parse_spec, Params and
// expand_layer_methods). The input's first line is the method, every further line one override.
// Any input must build every layer's method or give one Status naming the spec ("attention
// (layer L): ..." or "attention_layers: ..."), never a crash, a hang or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> lines;
  size_t i = 0;
  while (i <= text.size() && lines.size() < 8) {
    const size_t j = std::min(text.find('\n', i), text.size());
    lines.push_back(text.substr(i, j - i));
    i = j + 1;
  }
  using namespace sparsa::dlm;
  constexpr int kLayers = 4;
  AttentionPolicy policy;
  policy.method = lines[0];
  const std::vector<std::string> overrides(lines.begin() + 1, lines.end());
  sparsa::Status st = expand_layer_methods(overrides, kLayers, &policy.layer_methods);
  if (!st.ok()) {
    if (st.message().rfind("attention_layers: ", 0) != 0) __builtin_trap();
    return 0;
  }
  if (policy.layer_methods.size() != kLayers) __builtin_trap();
  for (int l = 0; l < kLayers; ++l) {
    auto a = make_layer_attention(policy, l);
    if (a.ok()) {
      if (!a.value()) __builtin_trap();
    } else if (a.status().message().rfind("attention (layer " + std::to_string(l) + "): ", 0) != 0) {
      __builtin_trap();
    }
  }
  return 0;
}
