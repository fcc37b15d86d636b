// sparsa/io.h — tensor files: NumPy .npy and .safetensors.
//
// .npy: f32 ('<f4'), f16 ('<f2'), i32 ('<i4'), C order, versions 1.0-3.0 read,
// 1.0 written (byte for byte what np.save writes). '=' and '|' byte orders read as
// little-endian.
// .safetensors: F32, F16, BF16, I32; "__metadata__" is accepted and ignored.
//
// Errors (docs/io.md lists them):
//  - io_error: the file is missing, a directory, or cannot be read or written.
//  - malformed_file: the file lies about itself or is broken — truncated header or
//    data, bad magic, a header length beyond the file, a header that is not a dict
//    or not valid JSON, missing or duplicate keys, unknown dtypes, negative or
//    non-integer dimensions, shapes whose size overflows int64 or disagrees with the
//    bytes present, out-of-range or overlapping data offsets.
//  - unsupported_dtype: a well-formed file of a dtype sparsa does not take ('<f8',
//    big-endian, F64, ...); the message suggests the conversion.
//  - unsupported: Fortran order (with more than one dimension above 1), more than
//    kMaxDims dimensions.
// Every message starts with the file's path. Nothing is allocated from a size that
// has not been checked against the file's real size.
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
// Entries in the order of the file's header.
Result<std::vector<NamedArray>> read_safetensors(const std::string& path);
// Entries are written in the given order, back to back after a header padded to 8
// bytes. Names must be non-empty, unique, valid UTF-8 and not "__metadata__". metadata: the
// header's free-form "__metadata__" strings (omitted when empty).
Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::vector<std::pair<std::string, std::string>>& metadata = {});

// The validated header of a .safetensors file (the same checks as read_safetensors) without
// reading the data, for callers that map the file: offset is from the start of the file and
// [offset, offset + nbytes) lies inside it. Entries in the order of the header.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};
Result<std::vector<SafetensorsEntry>> read_safetensors_header(const std::string& path);

// By extension: "x.npy", "x.safetensors" (the single entry; a file of several entries
// is refused with invalid_argument naming them) or "x.safetensors:name".
Result<HostArray> read_tensor(const std::string& path_and_name);
// "x.npy", "x.safetensors:name", or "x.safetensors" (one entry named "tensor").
Status write_tensor(const std::string& path, const Tensor& tensor);

}  // namespace sparsa
