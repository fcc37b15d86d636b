// Internal: the file plumbing shared by the .npy and .safetensors readers and writers.
//
// Every size that comes from a file is checked against the file's real size before
// anything is allocated from it; every product of dimensions is checked for overflow.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa::detail {

// "<path>: <problem>" with the given code.
Status file_error(StatusCode code, const std::string& path, const std::string& problem);
inline Status malformed(const std::string& path, const std::string& problem) {
  return file_error(StatusCode::malformed_file, path, problem);
}

// A file opened for reading, with its size known up front.
class InputFile {
 public:
  // io_error if the file is missing, a directory or unreadable.
  static Result<InputFile> open(const std::string& path);
  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Reads exactly n bytes at offset into dst. A range past the end is malformed_file
  // ("truncated <what>"); a failing read is io_error.
  Status read_at(uint64_t offset, void* dst, uint64_t n, const char* what);

 private:
  InputFile() = default;
  std::string path_;
  std::FILE* file_ = nullptr;
  uint64_t size_ = 0;
};

// A file written atomically: the bytes go to a temporary file in the same folder, which
// commit() renames over the path only when every write succeeded, so an existing file
// is never truncated or lost by a failed write (disk full), and a reader never sees a
// half-written file. A file that was not committed is removed; the path is untouched.
// A symlink is followed (the file it points to is replaced). A path that exists and is
// not a regular file (/dev/null, a FIFO) is written in place.
class OutputFile {
 public:
  static Result<OutputFile> create(const std::string& path);
  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&&) = delete;
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  Status write(const void* src, uint64_t n);
  // Flushes and closes the temporary file, reporting deferred write errors; the path is
  // not touched yet.
  Status finish();
  // Renames the finished temporary file over the path.
  Status commit();
  // finish(), then commit().
  Status close();

 private:
  OutputFile() = default;
  void remove_temporary();
  std::string path_;       // as given (messages)
  std::string target_;     // the file replaced: path_ with symlinks resolved
  std::string temporary_;  // empty when writing in place
  std::FILE* file_ = nullptr;
  bool finished_ = false;
};

// The writers' bodies: the file written to its temporary and finished, not committed
// (write_tensors commits several together).
Result<OutputFile> write_npy_uncommitted(const std::string& path, const Tensor& tensor);
Result<OutputFile> write_safetensors_uncommitted(
    const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata = {});

// Whether two paths name the same file: by identity (device and inode) when both exist,
// else by their absolute paths with symlinks, "." and ".." resolved. Used to refuse an
// output that would replace an input, or two outputs that would replace each other.
bool same_file(const std::string& a, const std::string& b);

// numel of `shape` and its size in bytes at elem_size bytes per element; false if a
// dimension is negative, or the product of the non-zero dimensions times elem_size
// overflows int64 (so an empty (0, 2^40, 2^40) is refused too).
bool checked_nbytes(const std::vector<int64_t>& shape, size_t elem_size, int64_t* numel, int64_t* nbytes);

// 'text' for messages (built by appending: GCC 12 warns falsely on "'" + std::string&&).
std::string single_quoted(const std::string& text);

// "(2, 3)" for messages.
std::string shape_text(const std::vector<int64_t>& shape);

// Checks a tensor handed to a writer: CPU, 0..kMaxDims dims, non-negative shape,
// data present when non-empty, byte size representable. `what` names the argument.
Status check_writable(const char* what, const Tensor& t);
// Bytes of t in C (row-major) order: contiguous tensors in one write, strided views
// gathered in bounded chunks.
Status write_c_order(OutputFile& out, const Tensor& t);

}  // namespace sparsa::detail
