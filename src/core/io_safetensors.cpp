// .safetensors files, and the by-extension read_tensor / write_tensor.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {...}}
// (optionally padded with spaces), then the data section; offsets are relative to it.
#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/io_file.h"
#include "core/json_guard.h"
#include "sparsa/io.h"

namespace sparsa {

namespace {

using detail::malformed;
using Json = nlohmann::ordered_json;  // keeps the header's entry order

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit
constexpr char kMetadataKey[] = "__metadata__";
constexpr char kDefaultEntryName[] = "tensor";

struct EntryInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // in the data section
};

struct Header {
  std::vector<EntryInfo> entries;  // in header order
  uint64_t data_start = 0;         // file offset of the data section
  // "__metadata__" as key -> text (a string value as is, anything else as its JSON
  // text, clipped); metadata_error is set when "__metadata__" is present but not an object.
  std::vector<std::pair<std::string, std::string>> metadata;
  std::string metadata_error;
};

const char* st_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
  }
  return "?";
}

// A value from the file, for a message: its JSON text, clipped, with invalid UTF-8
// replaced (dump() would throw on it).
std::string brief(const Json& v) {
  return detail::clip(v.dump(-1, ' ', false, Json::error_handler_t::replace));
}

// The JSON value as an int64, or an explanation of why it is not one.
bool json_int64(const Json& v, int64_t* out, std::string* why) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      *why = "too large for int64: " + std::to_string(u);
      return false;
    }
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return true;
  }
  *why = "not an integer: " + brief(v);
  return false;
}

// The entry's name as it appears in messages: JSON-escaped, in single quotes.
std::string entry_label(const std::string& name) {
  std::string s = Json(name).dump(-1, ' ', false, Json::error_handler_t::replace);
  return detail::single_quoted(s.substr(1, s.size() - 2));
}

Result<EntryInfo> parse_entry(const std::string& path, const std::string& name, const Json& info,
                              uint64_t data_size) {
  const std::string where = "entry " + entry_label(name);
  if (!info.is_object()) return malformed(path, where + ": expected an object, got " + info.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(key)) return malformed(path, where + ": missing key '" + key + "'");
  }
  EntryInfo e;
  e.name = name;

  const Json& dtype = info["dtype"];
  if (!dtype.is_string()) return malformed(path, where + ": 'dtype' is not a string: " + brief(dtype));
  const std::string d = dtype.get<std::string>();
  if (d == "F32") {
    e.dtype = DType::f32;
  } else if (d == "F16") {
    e.dtype = DType::f16;
  } else if (d == "BF16") {
    e.dtype = DType::bf16;
  } else if (d == "I32") {
    e.dtype = DType::i32;
  } else {
    static const std::set<std::string> kKnown = {"BOOL", "U8",  "I8",  "I16", "U16",     "U32",     "F64",
                                                 "I64",  "U64", "C64", "F8_E5M2", "F8_E4M3", "F8_E8M0",
                                                 "F4",   "F6_E2M3", "F6_E3M2"};
    if (kKnown.count(d) == 0) {
      return malformed(path, where + ": unknown dtype " + entry_label(d) + ": expected F32, F16, BF16 or I32");
    }
    std::string hint;
    if (d == "F64") hint = "; convert to float32 before saving";
    if (d == "I64") hint = "; convert to int32 before saving";
    return detail::file_error(StatusCode::unsupported_dtype, path,
                              where + ": unsupported dtype " + d + ": expected F32, F16, BF16 or I32" + hint);
  }

  const Json& shape = info["shape"];
  if (!shape.is_array()) return malformed(path, where + ": 'shape' is not a list: " + brief(shape));
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t dim = 0;
    std::string why;
    if (!json_int64(shape[i], &dim, &why)) {
      return malformed(path, where + ": 'shape' entry " + std::to_string(i) + " is " + why);
    }
    if (dim < 0) return malformed(path, where + ": 'shape' entry " + std::to_string(i) + " is negative: " +
                                            std::to_string(dim));
    e.shape.push_back(dim);
  }
  if (e.shape.size() > static_cast<size_t>(kMaxDims)) {
    return detail::file_error(StatusCode::unsupported, path,
                              where + ": expected at most " + std::to_string(kMaxDims) + " dimensions, got " +
                                  std::to_string(e.shape.size()));
  }
  int64_t numel = 0, nbytes = 0;
  if (!detail::checked_nbytes(e.shape, dtype_size(e.dtype), &numel, &nbytes)) {
    return malformed(path, where + ": shape " + brief(shape) + " of " + d +
                               " overflows: its element count or byte size exceeds int64");
  }

  const Json& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return malformed(path, where + ": 'data_offsets' is not a pair [begin, end]: " + brief(offsets));
  }
  int64_t begin = 0, end = 0;
  std::string why;
  if (!json_int64(offsets[0], &begin, &why) || !json_int64(offsets[1], &end, &why)) {
    return malformed(path, where + ": 'data_offsets' entry is " + why);
  }
  if (begin < 0 || end < 0) return malformed(path, where + ": negative 'data_offsets' " + brief(offsets));
  if (end < begin) return malformed(path, where + ": 'data_offsets' end < begin: " + brief(offsets));
  if (static_cast<uint64_t>(end) > data_size) {
    return malformed(path, where + ": 'data_offsets' " + brief(offsets) + " run beyond the data section of " +
                               std::to_string(data_size) + " bytes (truncated data?)");
  }
  if (end - begin != nbytes) {
    return malformed(path, where + ": 'data_offsets' " + brief(offsets) + " span " + std::to_string(end - begin) +
                               " bytes but shape " + brief(shape) + " of " + d + " needs " +
                               std::to_string(nbytes));
  }
  e.begin = static_cast<uint64_t>(begin);
  e.end = static_cast<uint64_t>(end);
  return e;
}

Result<Header> read_header(detail::InputFile& file) {
  const std::string& path = file.path();
  const uint64_t size = file.size();
  if (size < 8) {
    return malformed(path, "truncated header: the file has " + std::to_string(size) +
                               " bytes, a .safetensors file starts with an 8-byte header length");
  }
  unsigned char length_bytes[8];
  SPARSA_RETURN_IF_ERROR(file.read_at(0, length_bytes, 8, "header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | length_bytes[i];
  if (header_len > size - 8) {
    return malformed(path, "header length " + std::to_string(header_len) + " runs beyond the file (" +
                               std::to_string(size) + " bytes; truncated header or not a .safetensors file)");
  }
  if (header_len > kMaxHeaderBytes) {
    return malformed(path, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                               std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_len < 2) {
    return malformed(path, "header length " + std::to_string(header_len) + " is too small for a JSON object");
  }
  std::string text(static_cast<size_t>(header_len), '\0');
  SPARSA_RETURN_IF_ERROR(file.read_at(8, text.data(), header_len, "header"));
  if (text[0] != '{') {
    return malformed(path, "header is not a JSON object (it does not start with '{'; bad magic or not a "
                           ".safetensors file)");
  }

  size_t too_deep_at = 0;
  if (detail::json_nesting_depth(text, detail::kMaxJsonDepth, &too_deep_at) > detail::kMaxJsonDepth) {
    return malformed(path, "JSON header nests deeper than " + std::to_string(detail::kMaxJsonDepth) +
                               " levels (at byte " + std::to_string(too_deep_at) + " of the header)");
  }

  // Duplicate keys are legal JSON but ambiguous here; the parser callback spots them.
  // It also keeps the key path, so an error names the field it happened in.
  std::vector<std::set<std::string>> open_objects;
  std::vector<std::string> key_path;  // the current key of each open object ("" before the first)
  std::string duplicate;
  auto on_event = [&](int /*depth*/, nlohmann::json::parse_event_t event, Json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      open_objects.emplace_back();
      key_path.emplace_back();
    } else if (event == E::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
      if (!key_path.empty()) key_path.pop_back();
    } else if (event == E::key && !open_objects.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second && duplicate.empty()) duplicate = key;
      key_path.back() = key;
    }
    return true;
  };
  auto field = [&]() {
    std::string where;
    for (const std::string& key : key_path) {
      if (key.empty()) break;
      where += where.empty() ? " (in " : " > ";
      where += entry_label(key);
    }
    return where.empty() ? where : where + ")";
  };
  Json header;
  try {
    header = Json::parse(text, on_event);
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = detail::printable(e.what());
    const size_t bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    const bool trailing = what.find("; expected end of input") != std::string::npos;
    what = detail::clip(what, 300);
    if (trailing) return malformed(path, "trailing garbage after the JSON header (" + what + ")");
    return malformed(path, "bad JSON header: " + what + field());
  } catch (const nlohmann::json::out_of_range& e) {
    // 406: a number beyond the range of a double (1e400).
    std::string what = detail::printable(e.what());
    const size_t bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    return malformed(path, "bad JSON header: " + detail::clip(what, 300) + field() +
                               ": expected a number that fits a double");
  } catch (const nlohmann::json::exception& e) {
    return malformed(path, "bad JSON header: " + detail::clip(detail::printable(e.what()), 200) + field());
  }
  if (!duplicate.empty()) return malformed(path, "duplicate key " + entry_label(duplicate) + " in the JSON header");
  if (!header.is_object()) {
    return malformed(path, std::string("header is not a JSON object, got ") + header.type_name());
  }

  Header h;
  h.data_start = 8 + header_len;
  const uint64_t data_size = size - h.data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == kMetadataKey) {  // string -> string metadata: kept for read_safetensors_metadata
      if (!info.is_object()) {
        h.metadata_error = std::string("'__metadata__' is not an object, got ") + info.type_name();
        continue;
      }
      for (const auto& [key, value] : info.items()) {
        h.metadata.emplace_back(key, value.is_string() ? value.get<std::string>() : brief(value));
      }
      continue;
    }
    auto entry = parse_entry(path, name, info, data_size);
    if (!entry.ok()) return entry.status();
    h.entries.push_back(std::move(entry.value()));
  }

  // No two tensors may share bytes (gaps are allowed).
  std::vector<const EntryInfo*> by_offset;
  for (const EntryInfo& e : h.entries) {
    if (e.end > e.begin) by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const EntryInfo* a, const EntryInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const EntryInfo& prev = *by_offset[i - 1];
    const EntryInfo& cur = *by_offset[i];
    if (cur.begin < prev.end) {
      return malformed(path, "entries " + entry_label(prev.name) + " [" + std::to_string(prev.begin) + ", " +
                                 std::to_string(prev.end) + ") and " + entry_label(cur.name) + " [" +
                                 std::to_string(cur.begin) + ", " + std::to_string(cur.end) +
                                 ") overlap in the data section");
    }
  }
  return h;
}

Result<HostArray> read_entry(detail::InputFile& file, const Header& header, const EntryInfo& e) {
  HostArray array(e.dtype, e.shape);  // size checked against the file in parse_entry
  SPARSA_RETURN_IF_ERROR(file.read_at(header.data_start + e.begin, array.data(), e.end - e.begin, "data"));
  return array;
}

std::string entry_list(const Header& h) {
  constexpr size_t kShown = 16;
  std::string s;
  for (size_t i = 0; i < h.entries.size() && i < kShown; ++i) {
    if (i) s += ", ";
    s += entry_label(h.entries[i].name);
  }
  if (h.entries.size() > kShown) s += ", ... (" + std::to_string(h.entries.size()) + " in all)";
  return s;
}

// "x.npy", "x.safetensors" or "x.safetensors:name".
struct TensorPath {
  bool safetensors = false;
  std::string file;
  std::string name;  // empty: none given
};

Result<TensorPath> split_tensor_path(const std::string& arg) {
  static const std::string kSt = ".safetensors";
  TensorPath p;
  if (arg.ends_with(kSt)) {
    p.safetensors = true;
    p.file = arg;
    return p;
  }
  const size_t at = arg.find(kSt + ":");
  if (at != std::string::npos) {
    p.safetensors = true;
    p.file = arg.substr(0, at + kSt.size());
    p.name = arg.substr(at + kSt.size() + 1);
    if (p.name.empty()) return invalid_argument("path: empty entry name after ':' in '" + arg + "'");
    return p;
  }
  if (arg.ends_with(".npy")) {
    p.file = arg;
    return p;
  }
  return invalid_argument("path: expected a file ending in .npy, .safetensors or .safetensors:NAME, got '" + arg + "'");
}

}  // namespace

Result<std::vector<NamedArray>> read_safetensors(const std::string& path) {
  auto opened = detail::InputFile::open(path);
  if (!opened.ok()) return opened.status();
  auto header = read_header(*opened);
  if (!header.ok()) return header.status();
  std::vector<NamedArray> out;
  for (const EntryInfo& e : header->entries) {
    auto array = read_entry(*opened, *header, e);
    if (!array.ok()) return array.status();
    out.push_back({e.name, std::move(array.value())});
  }
  return out;
}

Result<std::vector<SafetensorsEntry>> read_safetensors_header(const std::string& path) {
  auto opened = detail::InputFile::open(path);
  if (!opened.ok()) return opened.status();
  auto header = read_header(*opened);
  if (!header.ok()) return header.status();
  std::vector<SafetensorsEntry> out;
  for (const EntryInfo& e : header->entries) {
    out.push_back({e.name, e.dtype, e.shape, header->data_start + e.begin, e.end - e.begin});
  }
  return out;
}

Result<std::vector<std::pair<std::string, std::string>>> read_safetensors_metadata(const std::string& path) {
  auto opened = detail::InputFile::open(path);
  if (!opened.ok()) return opened.status();
  auto header = read_header(*opened);
  if (!header.ok()) return header.status();
  if (!header->metadata_error.empty()) return malformed(path, header->metadata_error);
  return std::move(header->metadata);
}

Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::vector<std::pair<std::string, std::string>>& metadata) {
  auto out = detail::write_safetensors_uncommitted(path, tensors, metadata);
  if (!out.ok()) return out.status();
  return out->commit();
}

Status write_block_index(const std::string& path, const BlockIndexBuffer& index) {
  std::vector<std::pair<std::string, Tensor>> entries = {{"counts", index.counts.view()},
                                                         {"indices", index.indices.view()}};
  if (!index.perm_q.empty()) entries.push_back({"perm_q", index.perm_q.view()});
  if (!index.perm_kv.empty()) entries.push_back({"perm_kv", index.perm_kv.view()});
  return write_safetensors(path, entries,
                           {{"block_q", std::to_string(index.block_q)}, {"block_kv", std::to_string(index.block_kv)}});
}

Result<detail::OutputFile> detail::write_safetensors_uncommitted(
    const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::string what = "tensors['" + name + "']";
    if (name.empty()) return invalid_argument("tensors: entry names must be non-empty");
    if (name == kMetadataKey) return invalid_argument("tensors: '__metadata__' is reserved and cannot name a tensor");
    if (!names.insert(name).second) return invalid_argument("tensors: duplicate name '" + name + "'");
    SPARSA_RETURN_IF_ERROR(detail::check_writable(what.c_str(), tensor));
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * dtype_size(tensor.dtype);
    header[name] = {{"dtype", st_dtype_name(tensor.dtype)},
                    {"shape", tensor.shape_vector()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();  // strict: throws on names that are not UTF-8
  } catch (const nlohmann::json::type_error&) {
    return invalid_argument("tensors: every name must be valid UTF-8");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  unsigned char length_bytes[8];
  const uint64_t header_len = text.size();
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(header_len >> (8 * i));

  auto out = detail::OutputFile::create(path);
  if (!out.ok()) return out.status();
  SPARSA_RETURN_IF_ERROR(out->write(length_bytes, 8));
  SPARSA_RETURN_IF_ERROR(out->write(text.data(), text.size()));
  for (const auto& [name, tensor] : tensors) SPARSA_RETURN_IF_ERROR(detail::write_c_order(*out, tensor));
  SPARSA_RETURN_IF_ERROR(out->finish());
  return out;
}

Result<HostArray> read_tensor(const std::string& path_and_name) {
  auto p = split_tensor_path(path_and_name);
  if (!p.ok()) return p.status();
  if (!p->safetensors) return read_npy(p->file);

  auto opened = detail::InputFile::open(p->file);
  if (!opened.ok()) return opened.status();
  auto header = read_header(*opened);
  if (!header.ok()) return header.status();
  const std::vector<EntryInfo>& entries = header->entries;
  if (p->name.empty()) {
    if (entries.empty()) return malformed(p->file, "the file holds no tensors");
    if (entries.size() > 1) {
      return invalid_argument("path: " + p->file + " holds " + std::to_string(entries.size()) +
                              " tensors; pick one with " + p->file + ":NAME (entries: " + entry_list(*header) + ")");
    }
    return read_entry(*opened, *header, entries[0]);
  }
  for (const EntryInfo& e : entries) {
    if (e.name == p->name) return read_entry(*opened, *header, e);
  }
  const std::string holds = entries.empty() ? " (it holds no tensors)" : " (entries: " + entry_list(*header) + ")";
  return invalid_argument("path: " + p->file + " has no entry " + entry_label(p->name) + holds);
}

Status write_tensor(const std::string& path, const Tensor& tensor) {
  auto p = split_tensor_path(path);
  if (!p.ok()) return p.status();
  if (!p->safetensors) return write_npy(p->file, tensor);
  return write_safetensors(p->file, {{p->name.empty() ? kDefaultEntryName : p->name, tensor}});
}

Status write_tensors(const std::vector<std::pair<std::string, Tensor>>& outputs, const char* const* labels) {
  auto label = [&](size_t i) { return labels ? std::string(labels[i]) : "outputs[" + std::to_string(i) + "]"; };
  // One group per file: an .npy takes one tensor, a .safetensors file the entries named for it.
  struct Group {
    TensorPath path;
    size_t first = 0;  // the output that opened the group (messages)
    std::vector<std::pair<std::string, Tensor>> entries;
  };
  std::vector<Group> groups;
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto p = split_tensor_path(outputs[i].first);
    if (!p.ok()) return Status{p.status().code(), label(i) + ": " + p.status().message()};
    Group* group = nullptr;
    for (Group& g : groups) {
      if (detail::same_file(g.path.file, p->file)) group = &g;
    }
    if (group != nullptr && (!group->path.safetensors || !p->safetensors || p->name.empty() ||
                             group->entries.front().first == kDefaultEntryName)) {
      return invalid_argument(label(i) + ": '" + outputs[i].first + "' is the same file as " + label(group->first) +
                              " ('" + outputs[group->first].first + "'); give each output its own file, or " +
                              "name entries of one .safetensors file (x.safetensors:a, x.safetensors:b)");
    }
    if (group == nullptr) {
      groups.push_back({p.value(), i, {}});
      group = &groups.back();
    }
    const std::string name = p->name.empty() ? kDefaultEntryName : p->name;
    for (const auto& entry : group->entries) {
      if (entry.first == name) {
        return invalid_argument(label(i) + ": entry " + entry_label(name) + " of " + p->file + " is given twice");
      }
    }
    group->entries.emplace_back(name, outputs[i].second);
  }
  // Every file is written (to its temporary) before any replaces what its path held.
  std::vector<detail::OutputFile> files;
  for (const Group& g : groups) {
    auto file = g.path.safetensors ? detail::write_safetensors_uncommitted(g.path.file, g.entries)
                                   : detail::write_npy_uncommitted(g.path.file, g.entries.front().second);
    if (!file.ok()) return Status{file.status().code(), label(g.first) + ": " + file.status().message()};
    files.push_back(std::move(file.value()));
  }
  for (size_t i = 0; i < files.size(); ++i) {
    Status s = files[i].commit();
    if (!s.ok()) return Status{s.code(), label(groups[i].first) + ": " + s.message()};
  }
  return Status::Ok();
}

}  // namespace sparsa
