// libFuzzer harness of the .safetensors reader (read_safetensors, read_safetensors_metadata
// and read_tensor): any bytes give arrays or a Status naming the file, never a crash,
// exception, hang or sanitizer report; what was read writes back and reads back identical.
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsa;
  const std::string& path = fuzz::scratch_path("in", ".safetensors");
  fuzz::write_file(path, data, size);
  Result<std::vector<std::pair<std::string, std::string>>> metadata = read_safetensors_metadata(path);
  fuzz::check_error(metadata.status(), path);
  Result<std::vector<NamedArray>> entries = read_safetensors(path);
  if (!entries.ok()) {
    fuzz::check_error(entries.status(), path);
    return 0;
  }
  if (entries->size() == 1) {
    Result<HostArray> single = read_tensor(path);
    if (!single.ok() || !fuzz::same(single.value(), entries->front().array)) {
      fuzz::contradiction("read_tensor of the only entry differs from read_safetensors");
    }
  }
  std::vector<std::pair<std::string, Tensor>> views;
  for (const NamedArray& e : *entries) views.emplace_back(e.name, e.array.view());
  const std::string& copy = fuzz::scratch_path("copy", ".safetensors");
  Status written = write_safetensors(copy, views);
  if (!written.ok()) {
    // The writer refuses names it cannot write (an empty name is legal in a file); nothing else.
    if (written.code() != StatusCode::invalid_argument) fuzz::contradiction("write failed: " + written.message());
    return 0;
  }
  Result<std::vector<NamedArray>> again = read_safetensors(copy);
  if (!again.ok() || again->size() != entries->size()) fuzz::contradiction("a written file does not read back");
  for (size_t i = 0; i < entries->size(); ++i) {
    if ((*again)[i].name != (*entries)[i].name || !fuzz::same((*again)[i].array, (*entries)[i].array)) {
      fuzz::contradiction("write_safetensors then read_safetensors changed entry " + std::to_string(i));
    }
  }
  return 0;
}
