// The model's tensor files: model.safetensors, or model.safetensors.index.json naming shards.
// Headers are validated by sparsa's safetensors reader (truncated data, overlapping or
// out-of-range offsets, bad dtypes are errors naming the file and the entry); the data is
// memory-mapped, never read into memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "engine.h"
#include "sparsa/io.h"

namespace sparsa::dlm {

struct MappedFile {
  void* base = nullptr;
  size_t size = 0;
  ~MappedFile() {
    if (base != nullptr && base != MAP_FAILED) munmap(base, size);
  }
};

namespace {

Result<std::shared_ptr<MappedFile>> map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status(StatusCode::io_error, path + ": cannot open");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return Status(StatusCode::io_error, path + ": cannot stat");
  }
  auto m = std::make_shared<MappedFile>();
  m->size = static_cast<size_t>(st.st_size);
  if (m->size > 0) {
    m->base = mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m->base == MAP_FAILED) {
      ::close(fd);
      m->base = nullptr;
      return Status(StatusCode::io_error, path + ": cannot map");
    }
  }
  ::close(fd);
  return m;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

}  // namespace

Result<TensorStore> TensorStore::open(const std::string& dir) {
  namespace fs = std::filesystem;
  TensorStore store;
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;
  std::error_code ec;
  if (fs::is_regular_file(index, ec)) {
    auto index_text = read_text_file(index);
    if (!index_text.ok()) return index_text.status();
    auto wm = parse_safetensors_index(index_text.value(), index);
    if (!wm.ok()) return wm.status();
    weight_map = std::move(wm.value());
    std::set<std::string> shards;
    for (const auto& [name, f] : weight_map) shards.insert(f);
    for (const std::string& f : shards) files.push_back((fs::path(dir) / f).string());
  } else if (fs::is_regular_file(single, ec)) {
    files.push_back(single);
  } else {
    return Status(StatusCode::io_error,
                  dir + ": no model.safetensors or model.safetensors.index.json in the model directory");
  }
  for (const std::string& path : files) {
    auto header = read_safetensors_header(path);
    if (!header.ok()) return header.status();
    auto mapped = map_file(path);
    if (!mapped.ok()) return mapped.status();
    const auto m = mapped.value();
    if (m->size < 8) return Status(StatusCode::malformed_file, path + ": truncated");
    store.files_.push_back(m);
    const std::string file_name = fs::path(path).filename().string();
    for (const SafetensorsEntry& e : header.value()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(e.name);
        if (it == weight_map.end() || it->second != file_name) continue;  // the index decides where a tensor lives
      }
      if (e.offset + e.nbytes > m->size) {
        return Status(StatusCode::malformed_file,
                      path + ": tensor '" + e.name + "' runs beyond the file (truncated shard)");
      }
      if (store.tensors_.count(e.name)) {
        return Status(StatusCode::malformed_file, path + ": tensor '" + e.name + "' appears in two files");
      }
      Tensor t = Tensor::contiguous(static_cast<char*>(m->base) + e.offset, e.dtype, e.shape);
      store.tensors_[e.name] = {t, path};
    }
  }
  for (const auto& [name, f] : weight_map) {
    if (!store.tensors_.count(name)) {
      return Status(StatusCode::malformed_file,
                    index + ": tensor '" + name + "' is listed in shard '" + f + "' but that shard does not hold it");
    }
  }
  return store;
}

Result<Tensor> TensorStore::get(const std::string& name, std::vector<int64_t> shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return invalid_argument("tensor '" + name + "' is missing from the model files");
  const Tensor& t = it->second.first;
  if (t.dtype == DType::i32) {
    return Status(StatusCode::unsupported_dtype,
                  it->second.second + ": tensor '" + name + "' has dtype i32, expected F32, F16 or BF16");
  }
  if (t.shape_vector() != shape) {
    return invalid_argument(it->second.second + ": tensor '" + name + "' has shape " + shape_text(t.shape_vector()) +
                            ", expected " + shape_text(shape));
  }
  return t;
}

std::string TensorStore::dtypes() const {
  std::set<std::string> d;
  for (const auto& [name, t] : tensors_) d.insert(dtype_name(t.first.dtype));
  std::string s;
  for (const std::string& x : d) s += (s.empty() ? "" : "+") + x;
  return s;
}

}  // namespace sparsa::dlm
