// libFuzzer harness of the .npy reader: any bytes give an array or a Status naming the
// file, never a crash, hang or sanitizer report; an array that was read writes back and
// reads back identical.
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsa;
  const std::string& path = fuzz::scratch_path("in", ".npy");
  fuzz::write_file(path, data, size);
  Result<HostArray> array = read_npy(path);
  if (!array.ok()) {
    fuzz::check_error(array.status(), path);
    return 0;
  }
  Result<HostArray> by_extension = read_tensor(path);
  if (!by_extension.ok() || !fuzz::same(*array, *by_extension)) fuzz::contradiction("read_tensor differs from read_npy");
  const std::string& copy = fuzz::scratch_path("copy", ".npy");
  Status written = write_npy(copy, array->view());
  if (!written.ok()) fuzz::contradiction("an array read back does not write: " + written.message());
  Result<HostArray> again = read_npy(copy);
  if (!again.ok() || !fuzz::same(*array, *again)) fuzz::contradiction("write_npy then read_npy changed the array");
  return 0;
}
