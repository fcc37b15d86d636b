// libFuzzer harness: chat templates (sparsa::dlm::ChatTemplate::parse and render, the Jinja
// interpreter of engines/dlm/jinja_*.cpp) on arbitrary bytes. Whatever the template, parsing and
// rendering end in text or in an error that names where it is (never a crash, a hang past the
// step limit, or a render longer than its 16 MiB bound); a render is deterministic.
#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsa/dlm.h"

namespace {
// A conversation with the fields chat templates read: a system turn, tool calls, a tool answer.
const char* kContext = R"({"messages": [
  {"role": "system", "content": "  be brief  "},
  {"role": "user", "content": "What is 2+2? <think>hm</think>"},
  {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
     "function": {"name": "add", "arguments": {"a": 2, "b": 2.5, "c": [null, true, "é"]}}}]},
  {"role": "tool", "content": "4"},
  {"role": "assistant", "content": "<think>\nsum\n</think>\n\n4", "reasoning_content": "sum"},
  {"role": "user", "content": "thanks"}],
 "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
 "add_generation_prompt": true, "enable_thinking": false})";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  auto parsed = sparsa::dlm::ChatTemplate::parse(source, R"({"bos_token": "<s>", "eos_token": "</s>"})", "fuzz");
  if (!parsed.ok()) {
    if (parsed.status().message().find("fuzz") == std::string::npos) __builtin_trap();
    return 0;
  }
  auto first = parsed->render_json(kContext);
  auto second = parsed->render_json(kContext);
  if (first.ok() != second.ok()) __builtin_trap();
  if (first.ok()) {
    if (first.value() != second.value() || first.value().size() > (size_t{16} << 20)) __builtin_trap();
  } else if (first.status().message().find("fuzz") == std::string::npos) {
    __builtin_trap();
  }
  return 0;
}
