// sparsa/io.h — tensor files: NumPy .npy and .safetensors.
//
// .npy: f32 ('<f4'), f16 ('<f2'), i32 ('<i4'), C order, versions 1.0-3.0 read,
// 1.0 written (byte for byte what np.save writes). '=' and '|' byte orders read as
// little-endian.
// .safetensors: F32, F16, BF16, I32; "__metadata__" is accepted (read_safetensors_metadata).
// A header nesting deeper than 32 levels is refused (malformed_file) before it is parsed.
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
// Every message starts with the file's path. Writers replace a file atomically (a
// temporary in the same folder, then a rename): a failed write leaves the path as it was. Nothing is allocated from a size that
// has not been checked against the file's real size.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "sparsa/index.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

// The whole of a text file (a config, a tokenizer, a chat template): io_error when it is missing,
// a directory or unreadable, malformed_file above 512 MiB.
Result<std::string> read_text_file(const std::string& path);

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
// The header's "__metadata__" in header order (empty when absent); the whole header is
// checked as read_safetensors checks it. Values are strings in the format; any other
// value is given as its JSON text. malformed_file when "__metadata__" is not an object.
Result<std::vector<std::pair<std::string, std::string>>> read_safetensors_metadata(const std::string& path);
// Entries are written in the given order, back to back after a header padded to 8
// bytes. Names must be non-empty, unique, valid UTF-8 and not "__metadata__". metadata: the
// header's free-form "__metadata__" strings (omitted when empty).
Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::vector<std::pair<std::string, std::string>>& metadata = {});

// A BlockIndex file (docs/cli.md, "Index files"): entries counts, indices and, when the plan has
// them, perm_q and perm_kv (host arrays, i32), the block sizes as __metadata__ block_q and
// block_kv. What `sparsa plan --index` and the DLM engine's attention capture write and
// `sparsa run --index` reads.
Status write_block_index(const std::string& path, const BlockIndexBuffer& index);

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
// Several outputs (path as for write_tensor, tensor), all or nothing: outputs naming
// entries of one .safetensors file (the same file by identity, however spelt) become
// one file of those entries; two outputs that would otherwise land in one file are
// refused (invalid_argument) before anything is written. Every file is written to a
// temporary next to it, and the temporaries replace the paths only once all were
// written. labels (optional, one per output, e.g. "--out") name the outputs in messages.
Status write_tensors(const std::vector<std::pair<std::string, Tensor>>& outputs, const char* const* labels = nullptr);

}  // namespace sparsa
