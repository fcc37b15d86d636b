// NumPy .npy files (format versions 1.0, 2.0 and 3.0).
//
// Layout: the magic "\x93NUMPY", major and minor version bytes, the header length
// (2 bytes little-endian in 1.0, 4 bytes in 2.0/3.0), then the header: a Python dict
// literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with
// spaces and a newline, then the raw elements. The header is read with a small
// parser of Python literals (strings, ints, True/False/None, tuples, lists, dicts);
// nothing in it is evaluated.
#include <bit>
#include <cctype>
#include <cstring>

#include "core/io_file.h"
#include "sparsa/io.h"

namespace sparsa {

static_assert(std::endian::native == std::endian::little, "the tensor file code assumes a little-endian host");

namespace {

using detail::malformed;

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// numpy refuses headers above 10 000 bytes by default; ours never exceed a few hundred.
constexpr uint64_t kMaxHeaderBytes = 1 << 20;
constexpr size_t kArrayAlign = 64;          // numpy pads magic + length + header to this
constexpr size_t kGrowthAxisMaxDigits = 21;  // numpy's spare room for growing the first axis

// ---- Python literal parser ------------------------------------------------------------

struct PyDictEntry;  // a vector of pair<string, PyValue> inside PyValue would need it complete (clang refuses)

struct PyValue {
  enum class Kind { string, boolean, none, integer, non_integer, tuple, list, dict };
  Kind kind = Kind::none;
  std::string text;  // string contents, or the source text of a number
  bool boolean = false;
  int64_t integer = 0;
  bool integer_overflow = false;  // an integer literal beyond int64
  std::vector<PyValue> items;                           // tuple, list
  std::vector<PyDictEntry> entries;  // dict (string keys only)
};

struct PyDictEntry {
  std::string key;
  PyValue value;
};

class PyLiteralParser {
 public:
  explicit PyLiteralParser(const std::string& text) : s_(text) {}

  // Parses one value that must span the whole text (up to trailing whitespace).
  bool parse_all(PyValue* out) {
    skip_space();
    if (!parse_value(out, 0)) return false;
    skip_space();
    if (pos_ != s_.size()) {
      return fail("trailing garbage after the header dict: '" + printable(s_.substr(pos_, 24)) + "'");
    }
    return true;
  }
  const std::string& error() const { return error_; }

  // A short, printable excerpt of header bytes for messages.
  static std::string printable(const std::string& bytes) {
    std::string out;
    for (unsigned char c : bytes) {
      if (c >= 0x20 && c < 0x7F) {
        out += static_cast<char>(c);
      } else {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        out += buf;
      }
    }
    return out;
  }

 private:
  static constexpr int kMaxDepth = 8;

  bool fail(const std::string& message) {
    if (error_.empty()) error_ = message;
    return false;
  }
  bool fail_at(const std::string& what) {
    const std::string found = pos_ < s_.size() ? detail::single_quoted(printable(s_.substr(pos_, 1))) : "the end";
    return fail("expected " + what + " at header byte " + std::to_string(pos_) + ", found " + found);
  }
  void skip_space() {
    while (pos_ < s_.size() && std::strchr(" \t\n\r\f\v", s_[pos_]) != nullptr && s_[pos_] != '\0') ++pos_;
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool at_word(const char* word) const {
    const size_t n = std::strlen(word);
    if (s_.compare(pos_, n, word) != 0) return false;
    const size_t end = pos_ + n;
    return end == s_.size() || !(std::isalnum(static_cast<unsigned char>(s_[end])) || s_[end] == '_');
  }

  bool parse_value(PyValue* out, int depth) {
    if (depth > kMaxDepth) return fail("header nests deeper than " + std::to_string(kMaxDepth) + " levels");
    skip_space();
    if (pos_ >= s_.size()) return fail_at("a value");
    const char c = s_[pos_];
    if (c == '\'' || c == '"') return parse_string(out);
    if (c == '(' || c == '[') return parse_sequence(out, depth);
    if (c == '{') return parse_dict(out, depth);
    if (c == '-' || c == '+' || std::isdigit(static_cast<unsigned char>(c)) || c == '.') return parse_number(out);
    for (const char* word : {"True", "False", "None"}) {
      if (at_word(word)) {
        pos_ += std::strlen(word);
        out->kind = word[0] == 'N' ? PyValue::Kind::none : PyValue::Kind::boolean;
        out->boolean = word[0] == 'T';
        out->text = word;
        return true;
      }
    }
    return fail_at("a Python literal");
  }

  bool parse_string(PyValue* out) {
    const char quote = s_[pos_++];
    std::string value;
    while (pos_ < s_.size() && s_[pos_] != quote) {
      char c = s_[pos_++];
      if (c == '\n') return fail("unterminated string in header");
      if (c == '\\') {
        if (pos_ >= s_.size()) break;
        c = s_[pos_++];  // \\ \' \" keep the character; other escapes are not used by numpy
      }
      value += c;
    }
    if (pos_ >= s_.size()) return fail("unterminated string in header");
    ++pos_;  // closing quote
    out->kind = PyValue::Kind::string;
    out->text = std::move(value);
    return true;
  }

  bool parse_number(PyValue* out) {
    const size_t start = pos_;
    if (s_[pos_] == '-' || s_[pos_] == '+') ++pos_;
    const size_t digits_start = pos_;
    // The maximal run that could belong to a Python number (floats, exponents, hex, 'L').
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      const bool exponent_sign = (c == '-' || c == '+') && pos_ > digits_start &&
                                 (s_[pos_ - 1] == 'e' || s_[pos_ - 1] == 'E');
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || exponent_sign) {
        ++pos_;
      } else {
        break;
      }
    }
    out->text = s_.substr(start, pos_ - start);
    std::string body = s_.substr(digits_start, pos_ - digits_start);
    if (!body.empty() && (body.back() == 'L' || body.back() == 'l')) body.pop_back();  // Python 2 long
    const bool all_digits = !body.empty() && body.find_first_not_of("0123456789") == std::string::npos;
    if (!all_digits) {
      out->kind = PyValue::Kind::non_integer;
      return true;
    }
    out->kind = PyValue::Kind::integer;
    const bool negative = s_[start] == '-';
    int64_t v = 0;
    for (char d : body) {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, d - '0', &v)) {
        out->integer_overflow = true;
        break;
      }
    }
    out->integer = negative ? -v : v;
    return true;
  }

  bool parse_sequence(PyValue* out, int depth) {
    const char open = s_[pos_++];
    const char close = open == '(' ? ')' : ']';
    std::vector<PyValue> items;
    bool trailing_comma = false;
    while (true) {
      if (consume(close)) break;
      PyValue item;
      if (!parse_value(&item, depth + 1)) return false;
      items.push_back(std::move(item));
      trailing_comma = consume(',');
      if (!trailing_comma) {
        if (consume(close)) break;
        return fail_at(std::string("',' or '") + close + "'");
      }
    }
    if (open == '(' && items.size() == 1 && !trailing_comma) {
      *out = std::move(items[0]);  // "(5)" is the int 5 in Python, not a tuple
      return true;
    }
    out->kind = open == '(' ? PyValue::Kind::tuple : PyValue::Kind::list;
    out->items = std::move(items);
    return true;
  }

  bool parse_dict(PyValue* out, int depth) {
    ++pos_;  // '{'
    out->kind = PyValue::Kind::dict;
    while (true) {
      if (consume('}')) return true;
      PyValue key;
      skip_space();
      if (!parse_value(&key, depth + 1)) return false;
      if (key.kind != PyValue::Kind::string) return fail("header dict key " + key.text + " is not a string");
      for (const auto& [name, value] : out->entries) {
        if (name == key.text) return fail("duplicate key '" + key.text + "' in header");
      }
      if (!consume(':')) return fail_at("':'");
      PyValue value;
      if (!parse_value(&value, depth + 1)) return false;
      out->entries.push_back({key.text, std::move(value)});
      if (!consume(',')) {
        if (consume('}')) return true;
        return fail_at("',' or '}'");
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
  std::string error_;
};

// ---- dtype -----------------------------------------------------------------------

std::string describe(const PyValue& v) {
  switch (v.kind) {
    case PyValue::Kind::string: return detail::single_quoted(PyLiteralParser::printable(v.text));
    case PyValue::Kind::tuple: return "a tuple";
    case PyValue::Kind::list: return "a list";
    case PyValue::Kind::dict: return "a dict";
    default: return v.text;
  }
}

Result<DType> npy_dtype(const std::string& path, const PyValue& descr) {
  if (descr.kind == PyValue::Kind::list) {
    return detail::file_error(StatusCode::unsupported_dtype, path,
                              "structured dtypes (a list as 'descr') are not supported; "
                              "expected '<f4', '<f2' or '<i4'");
  }
  if (descr.kind != PyValue::Kind::string) {
    return malformed(path, "header 'descr': expected a dtype string such as '<f4', got " + describe(descr));
  }
  const std::string& d = descr.text;
  char order = '=';
  std::string code = d;
  if (!d.empty() && std::strchr("<>|=", d[0]) != nullptr) {
    order = d[0];
    code = d.substr(1);
  }
  const std::string quoted = detail::single_quoted(PyLiteralParser::printable(d));
  // A NumPy type code: a kind letter, then an item size (or a unit for datetimes).
  const bool known_kind = !code.empty() && code[0] != '\0' && std::strchr("biufcmMOSUV?", code[0]) != nullptr &&
                          (code.find_first_not_of("0123456789", 1) == std::string::npos || code[0] == 'm' ||
                           code[0] == 'M');
  if (!known_kind) return malformed(path, "unknown dtype " + quoted);
  // '|' (byte order not applicable) and '=' (native) both mean little-endian here.
  if (order == '>' && code != "b1" && code != "i1" && code != "u1") {
    return detail::file_error(StatusCode::unsupported_dtype, path,
                              "big-endian dtype " + quoted + " is not supported; convert with a.astype('<" +
                                  code + "')");
  }
  if (code == "f4") return DType::f32;
  if (code == "f2") return DType::f16;
  if (code == "i4") return DType::i32;
  std::string hint;
  if (code == "f8" || code == "f16" || code == "f12") hint = "; convert with a.astype(np.float32)";
  if (code == "i8" || code == "i2" || code == "i1" || code == "u1" || code == "u2" || code == "u4" ||
      code == "u8" || code == "b1") {
    hint = "; convert with a.astype(np.int32)";
  }
  return detail::file_error(StatusCode::unsupported_dtype, path,
                            "unsupported dtype " + quoted + ": expected '<f4', '<f2' or '<i4'" + hint);
}

const char* npy_descr(DType dtype) {
  switch (dtype) {
    case DType::f32: return "<f4";
    case DType::f16: return "<f2";
    case DType::i32: return "<i4";
    case DType::bf16: return nullptr;
  }
  return nullptr;
}

uint64_t read_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

Result<HostArray> read_npy(const std::string& path) {
  auto opened = detail::InputFile::open(path);
  if (!opened.ok()) return opened.status();
  detail::InputFile& file = opened.value();
  const uint64_t size = file.size();

  // Magic and version.
  unsigned char prefix[12] = {};
  const uint64_t have = std::min<uint64_t>(size, sizeof prefix);
  SPARSA_RETURN_IF_ERROR(file.read_at(0, prefix, have, "header"));
  if (std::memcmp(prefix, kMagic, std::min<uint64_t>(have, kMagicLen)) != 0) {
    return malformed(path, "bad magic: not a .npy file (expected it to start with \\x93NUMPY, found '" +
                               PyLiteralParser::printable(std::string(reinterpret_cast<char*>(prefix),
                                                                      std::min<uint64_t>(have, kMagicLen))) +
                               "')");
  }
  if (size < 10) {
    return malformed(path, "truncated header: the file has " + std::to_string(size) +
                               " bytes, a .npy file needs at least 10 before its header");
  }
  const int major = prefix[6], minor = prefix[7];
  if (major < 1 || major > 3 || minor != 0) {
    return malformed(path, "unknown .npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                               ": expected 1.0, 2.0 or 3.0");
  }
  const int length_bytes = major == 1 ? 2 : 4;
  const uint64_t header_start = kMagicLen + 2 + length_bytes;
  if (size < header_start) {
    return malformed(path, "truncated header: the file has " + std::to_string(size) + " bytes, version " +
                               std::to_string(major) + ".0 needs " + std::to_string(header_start) +
                               " before its header");
  }
  const uint64_t header_len = read_le(prefix + 8, length_bytes);
  if (header_len > size - header_start) {
    return malformed(path, "header length " + std::to_string(header_len) + " runs beyond the file (" +
                               std::to_string(size) + " bytes; truncated header)");
  }
  if (header_len > kMaxHeaderBytes) {
    return malformed(path, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                               std::to_string(kMaxHeaderBytes) + " bytes");
  }
  std::string header(static_cast<size_t>(header_len), '\0');
  SPARSA_RETURN_IF_ERROR(file.read_at(header_start, header.data(), header_len, "header"));

  // The header dict.
  PyValue dict;
  PyLiteralParser parser(header);
  if (!parser.parse_all(&dict)) return malformed(path, "bad header: " + parser.error());
  if (dict.kind != PyValue::Kind::dict) {
    return malformed(path, "header is not a dict: expected {'descr': ..., 'fortran_order': ..., 'shape': ...}, got " +
                               describe(dict));
  }
  const PyValue* descr = nullptr;
  const PyValue* fortran_order = nullptr;
  const PyValue* shape_value = nullptr;
  for (const auto& [key, value] : dict.entries) {
    if (key == "descr") {
      descr = &value;
    } else if (key == "fortran_order") {
      fortran_order = &value;
    } else if (key == "shape") {
      shape_value = &value;
    } else {
      return malformed(path, "unexpected header key '" + PyLiteralParser::printable(key) +
                                 "': expected exactly 'descr', 'fortran_order' and 'shape'");
    }
  }
  for (auto [value, name] : {std::pair{descr, "descr"}, {fortran_order, "fortran_order"}, {shape_value, "shape"}}) {
    if (value == nullptr) return malformed(path, std::string("header is missing the key '") + name + "'");
  }

  auto dtype = npy_dtype(path, *descr);
  if (!dtype.ok()) return dtype.status();

  if (fortran_order->kind != PyValue::Kind::boolean) {
    return malformed(path, "header 'fortran_order': expected True or False, got " + describe(*fortran_order));
  }
  if (shape_value->kind != PyValue::Kind::tuple) {
    return malformed(path, "header 'shape': expected a tuple of integers, got " + describe(*shape_value));
  }
  std::vector<int64_t> shape;
  for (size_t i = 0; i < shape_value->items.size(); ++i) {
    const PyValue& dim = shape_value->items[i];
    const std::string where = "header 'shape' entry " + std::to_string(i);
    if (dim.kind != PyValue::Kind::integer) return malformed(path, where + " is not an integer: " + describe(dim));
    if (dim.integer_overflow) return malformed(path, where + " (" + dim.text + ") does not fit int64");
    if (dim.integer < 0) return malformed(path, where + " is negative: " + dim.text);
    shape.push_back(dim.integer);
  }
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    return detail::file_error(StatusCode::unsupported, path,
                              "expected at most " + std::to_string(kMaxDims) + " dimensions, got " +
                                  std::to_string(shape.size()) + " " + detail::shape_text(shape));
  }
  if (fortran_order->boolean) {
    // Fortran and C order are the same bytes when at most one dimension exceeds 1.
    int big_dims = 0;
    for (int64_t d : shape) big_dims += d > 1;
    if (big_dims > 1) {
      return detail::file_error(StatusCode::unsupported, path,
                                "Fortran-order (fortran_order: True) arrays are not supported; save a C-order "
                                "copy with np.save(path, np.ascontiguousarray(a))");
    }
  }

  // The data must be exactly what the shape claims.
  int64_t numel = 0, nbytes = 0;
  if (!detail::checked_nbytes(shape, dtype_size(*dtype), &numel, &nbytes)) {
    return malformed(path, "shape " + detail::shape_text(shape) + " of " + dtype_name(*dtype) +
                               " overflows: its element count or byte size exceeds int64");
  }
  const uint64_t data_start = header_start + header_len;
  const uint64_t data_bytes = size - data_start;
  if (static_cast<uint64_t>(nbytes) > data_bytes) {
    return malformed(path, "truncated data: shape " + detail::shape_text(shape) + " of " + dtype_name(*dtype) +
                               " needs " + std::to_string(nbytes) + " bytes, the file has " +
                               std::to_string(data_bytes) + " after the header");
  }
  if (static_cast<uint64_t>(nbytes) < data_bytes) {
    return malformed(path, std::to_string(data_bytes - nbytes) + " unexpected bytes after the data of shape " +
                               detail::shape_text(shape) + " of " + dtype_name(*dtype));
  }
  HostArray array(*dtype, std::move(shape));
  SPARSA_RETURN_IF_ERROR(file.read_at(data_start, array.data(), static_cast<uint64_t>(nbytes), "data"));
  return array;
}

Status write_npy(const std::string& path, const Tensor& tensor) {
  auto out = detail::write_npy_uncommitted(path, tensor);
  if (!out.ok()) return out.status();
  return out->commit();
}

Result<detail::OutputFile> detail::write_npy_uncommitted(const std::string& path, const Tensor& tensor) {
  SPARSA_RETURN_IF_ERROR(detail::check_writable("tensor", tensor));
  const char* descr = npy_descr(tensor.dtype);
  if (descr == nullptr) {
    return unsupported_dtype(std::string("tensor: ") + dtype_name(tensor.dtype) +
                             " has no NumPy dtype; write it to a .safetensors file instead (" + path + ")");
  }
  // Byte for byte what numpy's np.save writes for a C-order array (format 1.0).
  const std::vector<int64_t> shape = tensor.shape_vector();
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " +
                       detail::shape_text(shape) + ", }";
  if (!shape.empty()) {  // spare room so the first axis can grow in place
    const size_t digits = std::to_string(shape[0]).size();
    header.append(kGrowthAxisMaxDigits > digits ? kGrowthAxisMaxDigits - digits : 0, ' ');
  }
  const size_t prefix_len = kMagicLen + 2 + 2;
  const size_t padding = kArrayAlign - (prefix_len + header.size() + 1) % kArrayAlign;
  header.append(padding, ' ');
  header += '\n';
  const size_t header_len = header.size();  // < 400 bytes for any kMaxDims shape

  std::string prefix(kMagic, kMagicLen);
  prefix += '\x01';
  prefix += '\x00';
  prefix += static_cast<char>(header_len & 0xFF);
  prefix += static_cast<char>(header_len >> 8);

  auto out = detail::OutputFile::create(path);
  if (!out.ok()) return out.status();
  SPARSA_RETURN_IF_ERROR(out->write(prefix.data(), prefix.size()));
  SPARSA_RETURN_IF_ERROR(out->write(header.data(), header.size()));
  SPARSA_RETURN_IF_ERROR(detail::write_c_order(*out, tensor));
  SPARSA_RETURN_IF_ERROR(out->finish());
  return out;
}

}  // namespace sparsa
