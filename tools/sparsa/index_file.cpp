#include "index_file.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "sparsa/io.h"

namespace sparsa::cli {

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the safetensors format's own limit

// The header's __metadata__ (string -> string); an empty object when absent. The tensor
// data is read by read_safetensors, which checks the rest of the file.
Result<nlohmann::json> read_metadata(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return Status{StatusCode::io_error, path + ": cannot open for reading"};
  file.seekg(0, std::ios::end);
  const auto file_size = static_cast<uint64_t>(file.tellg());
  file.seekg(0);
  unsigned char len_bytes[8];
  if (file_size < 8 || !file.read(reinterpret_cast<char*>(len_bytes), 8)) {
    return Status{StatusCode::malformed_file, path + ": shorter than the 8-byte safetensors header length"};
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];  // little-endian
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8) {
    return Status{StatusCode::malformed_file, path + ": header length " + std::to_string(header_len) +
                                                  " exceeds the file (" + std::to_string(file_size) + " bytes)"};
  }
  std::string header(header_len, '\0');
  if (!file.read(header.data(), static_cast<std::streamsize>(header_len))) {
    return Status{StatusCode::io_error, path + ": cannot read the header"};
  }
  nlohmann::json json = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return Status{StatusCode::malformed_file, path + ": the header is not a JSON object"};
  }
  if (!json.contains("__metadata__")) return nlohmann::json::object();
  const nlohmann::json& meta = json["__metadata__"];
  if (!meta.is_object()) return Status{StatusCode::malformed_file, path + ": __metadata__ is not an object"};
  return meta;
}

Result<std::optional<int>> metadata_block(const std::string& path, const nlohmann::json& meta, const char* key) {
  if (!meta.contains(key)) return std::optional<int>{};
  const nlohmann::json& v = meta[key];
  std::string text = v.is_string() ? v.get<std::string>() : v.dump();
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || end != text.c_str() + text.size() || x <= 0 || x > (1 << 20)) {
    return invalid_argument("index: " + path + ": __metadata__ " + key + " must be an integer in [1, " +
                            std::to_string(1 << 20) + "], got '" + text + "'");
  }
  return std::optional<int>(static_cast<int>(x));
}

}  // namespace

Result<BlockIndexBuffer> read_index_file(const std::string& path, std::optional<int> block_q,
                                         std::optional<int> block_kv) {
  Result<nlohmann::json> meta = read_metadata(path);
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

Status write_index_file(const std::string& path, const BlockIndexBuffer& index) {
  std::vector<std::pair<std::string, Tensor>> entries = {{"counts", index.counts.view()},
                                                         {"indices", index.indices.view()}};
  if (!index.perm_q.empty()) entries.push_back({"perm_q", index.perm_q.view()});
  if (!index.perm_kv.empty()) entries.push_back({"perm_kv", index.perm_kv.view()});
  return write_safetensors(path, entries,
                           {{"block_q", std::to_string(index.block_q)}, {"block_kv", std::to_string(index.block_kv)}});
}

}  // namespace sparsa::cli
