// sparsa/io.h — tensor files: NumPy .npy and .safetensors.
//
// .npy: f32 ('<f4'), f16 ('<f2'), i32 ('<i4'), C order, versions 1.0-3.0.
// .safetensors: F32, F16, BF16, I32.
// Every malformed file (truncated data, a header that is not what it claims, shapes
// whose product overflows or disagrees with the bytes present, unknown dtypes,
// Fortran order, overlapping or out-of-range offsets) is refused with a Status of
// code malformed_file whose message names the file and the problem. Nothing is
// allocated from an unchecked size.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

Result<HostArray> read_npy(const std::string& path);
// Writes any CPU tensor (strided views are copied to C order). Dtypes f32, f16, i32;
// bf16 has no NumPy dtype and is refused (use .safetensors).
Status write_npy(const std::string& path, const Tensor& tensor);

struct NamedArray {
  std::string name;
  HostArray array;
};
// Entries in file order.
Result<std::vector<NamedArray>> read_safetensors(const std::string& path);
Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors);

// By extension: "x.npy", "x.safetensors" (the single entry) or "x.safetensors:name".
Result<HostArray> read_tensor(const std::string& path_and_name);
Status write_tensor(const std::string& path, const Tensor& tensor);

}  // namespace sparsa
