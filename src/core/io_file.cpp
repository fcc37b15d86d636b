#include "core/io_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <utility>

namespace sparsa::detail {

namespace fs = std::filesystem;

Status file_error(StatusCode code, const std::string& path, const std::string& problem) {
  return {code, path + ": " + problem};
}

// ---- InputFile ------------------------------------------------------------------

Result<InputFile> InputFile::open(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return file_error(StatusCode::io_error, path, "no such file");
  if (ec) return file_error(StatusCode::io_error, path, "cannot stat: " + ec.message());
  if (st.type() == fs::file_type::directory) {
    return file_error(StatusCode::io_error, path, "is a directory, expected a file");
  }
  if (st.type() != fs::file_type::regular) {
    return file_error(StatusCode::io_error, path, "not a regular file");
  }
  InputFile f;
  f.path_ = path;
  f.file_ = std::fopen(path.c_str(), "rb");
  if (f.file_ == nullptr) {
    return file_error(StatusCode::io_error, path, std::string("cannot open for reading: ") + std::strerror(errno));
  }
  if (fseeko(f.file_, 0, SEEK_END) != 0) {
    return file_error(StatusCode::io_error, path, std::string("cannot seek: ") + std::strerror(errno));
  }
  const off_t end = ftello(f.file_);
  if (end < 0) return file_error(StatusCode::io_error, path, std::string("cannot tell size: ") + std::strerror(errno));
  f.size_ = static_cast<uint64_t>(end);
  return f;
}

InputFile::InputFile(InputFile&& other) noexcept
    : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)), size_(other.size_) {}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (file_) std::fclose(file_);
    path_ = std::move(other.path_);
    file_ = std::exchange(other.file_, nullptr);
    size_ = other.size_;
  }
  return *this;
}

InputFile::~InputFile() {
  if (file_) std::fclose(file_);
}

Status InputFile::read_at(uint64_t offset, void* dst, uint64_t n, const char* what) {
  if (offset > size_ || n > size_ - offset) {
    return malformed(path_, std::string("truncated ") + what + ": needs bytes [" + std::to_string(offset) + ", " +
                                std::to_string(offset + n) + ") but the file has " + std::to_string(size_) +
                                " bytes");
  }
  if (n == 0) return Status::Ok();
  if (fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0) {
    return file_error(StatusCode::io_error, path_, std::string("cannot seek: ") + std::strerror(errno));
  }
  const size_t got = std::fread(dst, 1, static_cast<size_t>(n), file_);
  if (got != n) {
    if (std::ferror(file_)) {
      return file_error(StatusCode::io_error, path_, std::string("read failed: ") + std::strerror(errno));
    }
    // The file shrank after it was opened.
    return malformed(path_, std::string("truncated ") + what + ": read " + std::to_string(got) + " of " +
                                std::to_string(n) + " bytes");
  }
  return Status::Ok();
}

// ---- OutputFile -----------------------------------------------------------------

Result<OutputFile> OutputFile::create(const std::string& path) {
  OutputFile f;
  f.path_ = path;
  std::error_code ec;
  fs::path target(path);
  const fs::file_status link = fs::symlink_status(target, ec);
  if (link.type() == fs::file_type::symlink) {
    target = fs::weakly_canonical(target, ec);
    if (ec) return file_error(StatusCode::io_error, path, "cannot resolve the symlink: " + ec.message());
  }
  const fs::file_status st = fs::status(target, ec);
  if (st.type() == fs::file_type::directory) {
    return file_error(StatusCode::io_error, path, "is a directory, expected a file name");
  }
  f.target_ = target.string();
  if (st.type() != fs::file_type::not_found && st.type() != fs::file_type::regular) {
    // A device or FIFO cannot be replaced by a rename; write into it.
    f.file_ = std::fopen(f.target_.c_str(), "wb");
    if (f.file_ == nullptr) {
      return file_error(StatusCode::io_error, path, std::string("cannot open for writing: ") + std::strerror(errno));
    }
    return f;
  }
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  // A fresh name next to the target, created exclusively with mode 0666 so the process's
  // umask applies as for any new file (mkstemp would make it 0600); an existing target's
  // own mode is kept.
  static std::atomic<unsigned> counter{0};
  std::random_device entropy;
  int fd = -1;
  std::string temp;
  for (int attempt = 0; attempt < 64 && fd < 0; ++attempt) {
    temp = (dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                   std::to_string(counter++) + "-" + std::to_string(entropy() % 1000000)))
               .string();
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    return file_error(StatusCode::io_error, path,
                      std::string("cannot create a temporary file in its folder: ") + std::strerror(errno));
  }
  f.temporary_ = temp;
  struct stat existing;
  if (::stat(f.target_.c_str(), &existing) == 0) (void)::fchmod(fd, existing.st_mode & 07777);
  f.file_ = ::fdopen(fd, "wb");
  if (f.file_ == nullptr) {
    const std::string reason = std::strerror(errno);
    ::close(fd);
    f.remove_temporary();
    return file_error(StatusCode::io_error, path, "cannot open for writing: " + reason);
  }
  return f;
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : path_(std::move(other.path_)),
      target_(std::move(other.target_)),
      temporary_(std::exchange(other.temporary_, std::string())),
      file_(std::exchange(other.file_, nullptr)),
      finished_(other.finished_) {}

OutputFile::~OutputFile() {
  if (file_) std::fclose(file_);
  remove_temporary();  // never committed: the path keeps what it held
}

void OutputFile::remove_temporary() {
  if (temporary_.empty()) return;
  std::error_code ec;
  fs::remove(temporary_, ec);
  temporary_.clear();
}

Status OutputFile::write(const void* src, uint64_t n) {
  if (n == 0) return Status::Ok();
  if (file_ == nullptr) return file_error(StatusCode::io_error, path_, "write after close");
  if (std::fwrite(src, 1, static_cast<size_t>(n), file_) != n) {
    return file_error(StatusCode::io_error, path_, std::string("write failed: ") + std::strerror(errno));
  }
  return Status::Ok();
}

Status OutputFile::finish() {
  if (finished_) return Status::Ok();
  if (file_ == nullptr) return file_error(StatusCode::io_error, path_, "finish after a failed write");
  const bool failed = std::ferror(file_) != 0;
  const int flushed = std::fflush(file_);
  const int rc = std::fclose(file_);
  file_ = nullptr;
  if (failed || flushed != 0 || rc != 0) {
    const std::string reason = std::strerror(errno);
    remove_temporary();
    return file_error(StatusCode::io_error, path_, "write failed on close: " + reason);
  }
  finished_ = true;
  return Status::Ok();
}

Status OutputFile::commit() {
  SPARSA_RETURN_IF_ERROR(finish());
  if (temporary_.empty()) return Status::Ok();  // written in place
  if (std::rename(temporary_.c_str(), target_.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    remove_temporary();
    return file_error(StatusCode::io_error, path_, "cannot replace the file: " + reason);
  }
  temporary_.clear();
  return Status::Ok();
}

Status OutputFile::close() { return commit(); }

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec_a, ec_b;
  if (fs::exists(a, ec_a) && fs::exists(b, ec_b)) {
    std::error_code ec;
    const bool same = fs::equivalent(a, b, ec);
    if (!ec) return same;
  }
  std::error_code ec;
  const fs::path ca = fs::weakly_canonical(fs::absolute(a, ec), ec);
  const fs::path cb = fs::weakly_canonical(fs::absolute(b, ec), ec);
  return ca.lexically_normal() == cb.lexically_normal();
}

// ---- shapes and tensors ---------------------------------------------------------

bool checked_nbytes(const std::vector<int64_t>& shape, size_t elem_size, int64_t* numel, int64_t* nbytes) {
  // The product of the non-zero dimensions must fit too (as numpy requires): strides,
  // which multiply trailing dimensions, are then representable even for empty arrays.
  int64_t nonzero_product = 1;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(nonzero_product, d, &nonzero_product)) {
      return false;
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(nonzero_product, static_cast<int64_t>(elem_size), &bytes)) return false;
  *numel = empty ? 0 : nonzero_product;
  *nbytes = empty ? 0 : bytes;
  return true;
}

std::string single_quoted(const std::string& text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '\'';
  out += text;
  out += '\'';
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

Status check_writable(const char* what, const Tensor& t) {
  if (t.device.type != DeviceType::cpu) {
    return invalid_argument(std::string(what) + ": expected a cpu tensor, got one on " + device_name(t.device));
  }
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    return invalid_argument(std::string(what) + ": expected 0.." + std::to_string(kMaxDims) +
                            " dimensions, got " + std::to_string(t.ndim));
  }
  int64_t numel = 0, nbytes = 0;
  if (!checked_nbytes(t.shape_vector(), dtype_size(t.dtype), &numel, &nbytes)) {
    return invalid_argument(std::string(what) + ": expected non-negative dimensions whose byte size fits int64, got " +
                            t.shape_string());
  }
  if (numel > 0 && t.data == nullptr) {
    return invalid_argument(std::string(what) + ": data is null for a tensor of shape " + t.shape_string());
  }
  return Status::Ok();
}

Status write_c_order(OutputFile& out, const Tensor& t) {
  const int64_t numel = t.numel();
  const size_t elem = dtype_size(t.dtype);
  if (numel == 0) return Status::Ok();
  if (t.is_contiguous()) return out.write(t.data, static_cast<uint64_t>(numel) * elem);

  // Gather in row-major order through a bounded buffer (an odometer over the indices).
  constexpr int64_t kChunkElems = 1 << 16;
  std::vector<std::byte> buffer(static_cast<size_t>(std::min(numel, kChunkElems)) * elem);
  const auto* src = static_cast<const std::byte*>(t.data);
  int64_t index[kMaxDims] = {};
  int64_t offset = 0;  // element offset of `index`
  size_t filled = 0;
  for (int64_t flat = 0; flat < numel; ++flat) {
    std::memcpy(buffer.data() + filled, src + offset * static_cast<int64_t>(elem), elem);
    filled += elem;
    if (filled == buffer.size()) {
      SPARSA_RETURN_IF_ERROR(out.write(buffer.data(), filled));
      filled = 0;
    }
    for (int d = t.ndim - 1; d >= 0; --d) {
      ++index[d];
      offset += t.strides[d];
      if (index[d] < t.shape[d]) break;
      offset -= index[d] * t.strides[d];
      index[d] = 0;
    }
  }
  return out.write(buffer.data(), filled);
}

}  // namespace sparsa::detail

namespace sparsa {

Result<std::string> read_text_file(const std::string& path) {
  constexpr uint64_t kMaxText = uint64_t{512} << 20;
  auto file = detail::InputFile::open(path);
  if (!file.ok()) return file.status();
  if (file.value().size() > kMaxText) {
    return Status(StatusCode::malformed_file,
                  path + ": " + std::to_string(file.value().size()) + " bytes, larger than the 512 MiB a text file may have");
  }
  std::string text(static_cast<size_t>(file.value().size()), '\0');
  SPARSA_RETURN_IF_ERROR(file.value().read_at(0, text.data(), text.size(), "text"));
  return text;
}

}  // namespace sparsa
