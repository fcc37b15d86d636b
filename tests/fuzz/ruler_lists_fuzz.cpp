// libFuzzer harness: the command-line lists of `sparsa eval-model` / `sparsa ruler`
// (sparsa::eval::parse_task_list, parse_length_list, parse_method_list; include/sparsa/ruler.h).
// The input is split at its first two newlines into the three lists. Any input must give a
// list or a Status naming the flag, never a crash, a hang or a sanitizer report, and what is
// accepted must hold what the parsers promise.
#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsa/ruler.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const size_t a = text.find('\n');
  const size_t b = a == std::string::npos ? std::string::npos : text.find('\n', a + 1);
  const std::string tasks = text.substr(0, a);
  const std::string lengths = a == std::string::npos ? text : text.substr(a + 1, b == std::string::npos ? b : b - a - 1);
  const std::string methods = b == std::string::npos ? text : text.substr(b + 1);
  using namespace sparsa::eval;
  auto t = parse_task_list("--tasks", tasks);
  if (t.ok()) {
    if (t->empty()) __builtin_trap();
    for (const std::string& name : t.value()) {
      if (!find_task(name)) __builtin_trap();
    }
  } else if (t.status().message().rfind("--tasks: ", 0) != 0) {
    __builtin_trap();
  }
  auto l = parse_length_list("--lengths", lengths);
  if (l.ok()) {
    if (l->empty()) __builtin_trap();
    for (int64_t v : l.value()) {
      if (v < 64 || v > (int64_t{1} << 24)) __builtin_trap();
      if (length_label(v).empty()) __builtin_trap();
    }
  } else if (l.status().message().rfind("--lengths: ", 0) != 0) {
    __builtin_trap();
  }
  auto m = parse_method_list("--attention", methods);
  if (m.ok()) {
    for (const std::string& spec : m.value()) {
      if (spec.empty() || spec.find(';') != std::string::npos) __builtin_trap();
    }
  } else if (m.status().message().rfind("--attention: ", 0) != 0) {
    __builtin_trap();
  }
  return 0;
}
