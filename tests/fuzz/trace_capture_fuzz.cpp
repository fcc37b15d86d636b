// libFuzzer harness: DecodeTrace::from_capture (include/sparsa/decode_trace.h), the reader of
// the engine's attention capture as a decode trace (`sparsa trace --capture`). The input
// describes a capture directory: a sequence of forward passes, each with its metadata (step,
// pos0, tokens, possibly not an integer or missing), its tensors (possibly one left out or of
// the wrong shape) and its keys' values, written for layer 1 and for layer 0 (which may be
// missing). Any capture must give a trace or a Status (invalid_argument, malformed_file or
// io_error), never a crash, a hang or a sanitizer report; what is accepted must be a
// consistent trace.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "sparsa/decode_trace.h"
#include "sparsa/io.h"

namespace {

class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t next() { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const uint8_t* data_;
  size_t size_, pos_ = 0;
};

const std::string& scratch_dir() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/sparsa-trace-capture-fuzz-XXXXXX";
    const char* made = mkdtemp(tmpl);
    if (made == nullptr) std::abort();
    return std::string(made);
  }();
  static const bool cleanup = [] {  // removed when the fuzzer exits normally
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    });
    return true;
  }();
  (void)cleanup;
  return dir;
}

sparsa::HostArray filled(std::vector<int64_t> shape, Bytes& in) {
  sparsa::HostArray a(sparsa::DType::f32, std::move(shape));
  const uint8_t seed = in.next();
  float* p = a.ptr<float>();
  for (int64_t i = 0; i < a.view().numel(); ++i) p[i] = static_cast<float>((seed + i * 7) % 5);
  return a;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  const std::string& dir = scratch_dir();
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) fs::remove(e.path(), ec);
  Bytes in(data, size);
  const int forwards = in.next() % 12 + 1;
  const bool layer0 = in.next() % 8 != 0;
  for (int f = 0; f < forwards; ++f) {
    const int64_t step = static_cast<int64_t>(in.next() % 6) - 1;  // -1 (prefill, commit) .. 4
    const int64_t pos0 = static_cast<int64_t>(in.next() % 8) * 4;
    const uint8_t t = in.next();
    const int64_t tokens = t % 5 == 0 ? 3 : (t % 5 == 1 ? 8 : 4);
    const uint8_t flaw = in.next();  // 0..: what is wrong with this file, if anything
    for (int layer : {1, 0}) {
      if (layer == 0 && !layer0) continue;
      std::vector<std::pair<std::string, sparsa::HostArray>> arrays;
      arrays.emplace_back("q", filled({1, 2, tokens, 2}, in));
      if (flaw % 16 == 8) {
        arrays.emplace_back("k", filled({tokens, 2}, in));  // not [1, heads, tokens, d]
      } else if (flaw % 16 == 9) {
        arrays.emplace_back("k", sparsa::HostArray(sparsa::DType::i32, {1, 1, tokens, 2}));  // not f32
      } else {
        arrays.emplace_back("k", filled({1, 1, flaw % 16 == 5 ? tokens + 1 : tokens, 2}, in));
      }
      arrays.emplace_back("v", filled({1, 1, tokens, 2}, in));
      if (pos0 > 0) {
        arrays.emplace_back("prefix_k", filled({1, 1, flaw % 16 == 6 ? pos0 + 1 : pos0, 2}, in));
        arrays.emplace_back("prefix_v", filled({1, 1, pos0, 2}, in));
      }
      if (flaw % 16 == 7) arrays.erase(arrays.begin() + in.next() % arrays.size());
      std::vector<std::pair<std::string, sparsa::Tensor>> tensors;
      for (auto& [name, a] : arrays) tensors.emplace_back(name, a.view());
      std::vector<std::pair<std::string, std::string>> meta = {
          {"step", flaw % 16 == 1 ? "x" : std::to_string(step)},
          {"pos0", std::to_string(pos0)},
          {"tokens", flaw % 16 == 2 ? std::to_string(tokens) + " " : std::to_string(tokens)}};
      if (flaw % 16 == 3) meta.erase(meta.begin() + in.next() % 3);
      const std::string path = dir + "/r0-l" + std::to_string(layer) + "-f" + std::to_string(f) + ".safetensors";
      if (flaw % 16 == 4 && layer == 1) continue;  // a forward left out
      if (!sparsa::write_safetensors(path, tensors, meta).ok()) std::abort();
    }
  }
  int64_t skipped = -1;
  auto trace = sparsa::DecodeTrace::from_capture(dir, 0, 1, &skipped);
  if (trace.ok()) {
    if (skipped < 0 || trace->steps_per_block() < 1 || trace->config().num_blocks < 1) __builtin_trap();
    for (int64_t b = 0; b < trace->config().num_blocks; ++b)
      for (int64_t s = 0; s < trace->steps_per_block(); ++s) {
        if (!trace->q(b, s).defined() || trace->k(b, s).shape[2] != trace->config().block_size) __builtin_trap();
      }
  } else {
    const sparsa::StatusCode c = trace.status().code();
    if (c != sparsa::StatusCode::invalid_argument && c != sparsa::StatusCode::malformed_file &&
        c != sparsa::StatusCode::io_error) {
      __builtin_trap();
    }
  }
  return 0;
}
