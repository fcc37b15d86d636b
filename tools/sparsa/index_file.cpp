#include "index_file.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <utility>
#include <vector>

#include "sparsa/io.h"

namespace sparsa::cli {

namespace {

using Metadata = std::vector<std::pair<std::string, std::string>>;

Result<std::optional<int>> metadata_block(const std::string& path, const Metadata& meta, const char* key) {
  auto found = std::find_if(meta.begin(), meta.end(), [&](const auto& kv) { return kv.first == key; });
  if (found == meta.end()) return std::optional<int>{};
  const std::string& text = found->second;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || end != text.c_str() + text.size() || x <= 0 || x > (1 << 20)) {
    return invalid_argument("index: " + path + ": __metadata__ " + key + " must be an integer in [1, " +
                            std::to_string(1 << 20) + "], got '" +
                            (text.size() > 80 ? text.substr(0, 80) + "..." : text) + "'");
  }
  return std::optional<int>(static_cast<int>(x));
}

}  // namespace

Result<BlockIndexBuffer> read_index_file(const std::string& path, std::optional<int> block_q,
                                         std::optional<int> block_kv) {
  // The library's reader checks the whole header (nesting depth, numbers, offsets) and
  // hands back the metadata as strings: nothing from the file is copied recursively.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status{StatusCode::io_error, "index: " + path + ": is a directory, expected a .safetensors index file"};
  }
  Result<Metadata> meta = read_safetensors_metadata(path);
  if (!meta.ok()) return Status{meta.status().code(), "index: " + meta.status().message()};
  auto meta_q = metadata_block(path, *meta, "block_q");
  if (!meta_q.ok()) return meta_q.status();
  auto meta_kv = metadata_block(path, *meta, "block_kv");
  if (!meta_kv.ok()) return meta_kv.status();
  if (!block_q) block_q = *meta_q;
  if (!block_kv) block_kv = *meta_kv;
  if (!block_q || !block_kv) {
    return invalid_argument("index: " + path + ": block sizes unknown; give -P block_q=N -P block_kv=N (or -P block=N) "
                            "or store block_q and block_kv in the file's __metadata__");
  }

  Result<std::vector<NamedArray>> entries = read_safetensors(path);
  if (!entries.ok()) return Status{entries.status().code(), "index: " + entries.status().message()};
  BlockIndexBuffer index;
  index.block_q = *block_q;
  index.block_kv = *block_kv;
  bool have_counts = false, have_indices = false;
  for (NamedArray& entry : entries.value()) {
    HostArray* slot = nullptr;
    if (entry.name == "counts") {
      slot = &index.counts;
      have_counts = true;
    } else if (entry.name == "indices") {
      slot = &index.indices;
      have_indices = true;
    } else if (entry.name == "perm_q") {
      slot = &index.perm_q;
    } else if (entry.name == "perm_kv") {
      slot = &index.perm_kv;
    } else {
      return invalid_argument("index: " + path + ": unknown entry '" + entry.name +
                              "' (expected counts, indices, perm_q, perm_kv)");
    }
    if (entry.array.dtype() != DType::i32) {
      return invalid_argument("index." + entry.name + ": expected dtype i32, got " + dtype_name(entry.array.dtype()));
    }
    *slot = std::move(entry.array);
  }
  if (!have_counts || !have_indices) {
    return invalid_argument("index: " + path + ": missing entry '" + std::string(have_counts ? "indices" : "counts") +
                            "'");
  }
  if (index.counts.shape().size() != 3) {
    return invalid_argument("index.counts: expected 3 dimensions [batch, heads_q, num_q_blocks], got " +
                            std::to_string(index.counts.shape().size()));
  }
  if (index.indices.shape().size() != 4) {
    return invalid_argument("index.indices: expected 4 dimensions [batch, heads_q, num_q_blocks, capacity], got " +
                            std::to_string(index.indices.shape().size()));
  }
  index.num_q_blocks = index.counts.shape()[2];
  // num_kv_blocks is a property of len_kv; the caller sets it from K before validating.
  index.num_kv_blocks = 0;
  return index;
}

}  // namespace sparsa::cli
