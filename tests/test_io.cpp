// Tensor files: .npy and .safetensors round trips, numpy's exact header bytes, and a
// catalogue of malformed files that must be refused with the right code and message.
#include <gtest/gtest.h>

#include <csignal>
#include <cstring>
#include <sys/resource.h>
#include <sys/stat.h>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "sparsa/io.h"

using namespace sparsa;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the system temp directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    const std::string name = "sparsa_test_io_" + std::to_string(::getpid()) + "_" + std::to_string(rd());
    path_ = fs::temp_directory_path() / name;
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string le_bytes(uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A .npy file with the given header text (used as is: no padding) and data bytes.
std::string npy_file(const std::string& header, const std::string& data = "", int major = 1) {
  std::string s = "\x93NUMPY";
  s += static_cast<char>(major);
  s += '\0';
  s += le_bytes(header.size(), major == 1 ? 2 : 4);
  return s + header + data;
}

std::string npy_dict(const std::string& descr, const std::string& shape, const std::string& fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }\n";
}

// A .safetensors file with the given JSON header text and data bytes.
std::string st_file(const std::string& json, const std::string& data = "") {
  return le_bytes(json.size(), 8) + json + data;
}

// A host array of the given dtype and shape filled with distinct, seeded values.
HostArray filled(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  HostArray a(dtype, std::move(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < a.numel(); ++i) {
    switch (dtype) {
      case DType::f32: a.ptr<float>()[i] = nd(rng); break;
      case DType::f16: a.ptr<uint16_t>()[i] = float_to_half(nd(rng)); break;
      case DType::bf16: a.ptr<uint16_t>()[i] = float_to_bf16(nd(rng)); break;
      case DType::i32: a.ptr<int32_t>()[i] = static_cast<int32_t>(rng()); break;
    }
  }
  return a;
}

std::string bytes_of(const HostArray& a) {
  return std::string(static_cast<const char*>(a.data()), a.nbytes());
}

void expect_same(const HostArray& expected, const HostArray& got) {
  EXPECT_EQ(expected.dtype(), got.dtype());
  EXPECT_EQ(expected.shape(), got.shape());
  EXPECT_EQ(bytes_of(expected), bytes_of(got));
}

const std::vector<std::vector<int64_t>> kShapes = {
    {}, {0}, {1}, {17}, {3, 0, 2}, {2, 3}, {1, 3, 17, 2}, {2, 1, 3, 1, 2, 5}};

}  // namespace

// ---- .npy -------------------------------------------------------------------------------

TEST(Npy, RoundTripEveryDtypeAndShape) {
  TempDir dir;
  uint32_t seed = 1;
  for (DType dtype : {DType::f32, DType::f16, DType::i32}) {
    for (const auto& shape : kShapes) {
      const HostArray a = filled(dtype, shape, seed++);
      const std::string path = dir.file("a.npy");
      ASSERT_TRUE(write_npy(path, a.view()).ok());
      auto back = read_npy(path);
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      expect_same(a, *back);
      // numpy aligns the data to 64 bytes; so do we.
      EXPECT_EQ((fs::file_size(path) - a.nbytes()) % 64, 0u) << dtype_name(dtype);
    }
  }
}

// np.save(f, np.arange(6, dtype=np.float32).reshape(2, 3)) with numpy 2.x, byte for byte.
TEST(Npy, WritesNumpysExactBytes) {
  TempDir dir;
  float values[6] = {0, 1, 2, 3, 4, 5};
  const std::string path = dir.file("arange.npy");
  ASSERT_TRUE(write_npy(path, Tensor::contiguous(values, DType::f32, {2, 3})).ok());
  const std::string expected =
      std::string("\x93NUMPY\x01\x00\x76\x00", 10) +  // magic, version 1.0, header length 118
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" + std::string(58, ' ') + "\n" +
      std::string("\x00\x00\x00\x00" "\x00\x00\x80\x3f" "\x00\x00\x00\x40"
                  "\x00\x00\x40\x40" "\x00\x00\x80\x40" "\x00\x00\xa0\x40", 24);
  EXPECT_EQ(read_bytes(path), expected);

  // np.save(f, np.int32(7)): a 0-d array has no growth-axis padding.
  int32_t seven = 7;
  ASSERT_TRUE(write_npy(path, Tensor::contiguous(&seven, DType::i32, {})).ok());
  const std::string expected_0d = std::string("\x93NUMPY\x01\x00\x76\x00", 10) +
                                  "{'descr': '<i4', 'fortran_order': False, 'shape': (), }" +
                                  std::string(62, ' ') + "\n" + std::string("\x07\x00\x00\x00", 4);
  EXPECT_EQ(read_bytes(path), expected_0d);

  // numpy leaves room for the first axis to grow (up to 21 digits) before padding; for
  // any shape whose size fits int64 the header still comes to 128 bytes, as above.
}

TEST(Npy, StridedViewsAreWrittenInCOrder) {
  TempDir dir;
  // A [4, 6] f32 buffer; views: its transpose, every other column, a reversed row.
  HostArray base = filled(DType::f32, {4, 6}, 7);
  const float* b = base.ptr<float>();
  Tensor transposed = base.view();
  std::swap(transposed.shape[0], transposed.shape[1]);
  std::swap(transposed.strides[0], transposed.strides[1]);  // [6, 4], strides {1, 6}
  Tensor every_other = base.view();
  every_other.shape[1] = 3;
  every_other.strides[1] = 2;  // [4, 3], strides {6, 2}
  Tensor reversed_row = base.view();
  reversed_row.ndim = 1;
  reversed_row.shape[0] = 6;
  reversed_row.strides[0] = -1;
  reversed_row.data = base.ptr<float>() + 5;  // row 0 backwards

  struct Case {
    const char* name;
    Tensor view;
    std::vector<float> expected;
  };
  std::vector<Case> cases = {{"transposed", transposed, {}}, {"every_other", every_other, {}},
                             {"reversed_row", reversed_row, {}}};
  for (int j = 0; j < 6; ++j)
    for (int i = 0; i < 4; ++i) cases[0].expected.push_back(b[i * 6 + j]);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) cases[1].expected.push_back(b[i * 6 + 2 * j]);
  for (int j = 5; j >= 0; --j) cases[2].expected.push_back(b[j]);

  for (const Case& c : cases) {
    for (const char* ext : {".npy", ".safetensors"}) {
      const std::string path = dir.file(std::string(c.name) + ext);
      ASSERT_TRUE(write_tensor(path, c.view).ok()) << c.name;
      auto back = read_tensor(path);
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      EXPECT_EQ(back->shape(), c.view.shape_vector()) << c.name;
      ASSERT_EQ(back->numel(), static_cast<int64_t>(c.expected.size()));
      for (size_t i = 0; i < c.expected.size(); ++i) EXPECT_EQ(back->ptr<float>()[i], c.expected[i]) << c.name << ext;
    }
  }
}

TEST(Npy, LargeStridedViewCrossesTheGatherChunk) {
  // More elements than one gather chunk (65536), with a non-unit last stride.
  TempDir dir;
  HostArray base = filled(DType::i32, {300, 2 * 301}, 3);
  Tensor view = base.view();
  view.shape[1] = 301;
  view.strides[1] = 2;
  const std::string path = dir.file("big.npy");
  ASSERT_TRUE(write_npy(path, view).ok());
  auto back = read_npy(path);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  for (int i = 0; i < 300; ++i)
    for (int j = 0; j < 301; ++j) ASSERT_EQ(back->ptr<int32_t>()[i * 301 + j], base.ptr<int32_t>()[i * 602 + 2 * j]);
}

TEST(Npy, ReadsVersions2And3AndHeaderVariants) {
  TempDir dir;
  const std::string data = std::string("\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00", 12);
  struct Case {
    const char* name;
    std::string bytes;
    std::vector<int64_t> shape;
  };
  const std::vector<Case> cases = {
      {"v2", npy_file(npy_dict("<i4", "(3,)"), data, 2), {3}},
      {"v3", npy_file(npy_dict("<i4", "(1, 3)"), data, 3), {1, 3}},
      {"native order", npy_file(npy_dict("=i4", "(3,)"), data), {3}},
      {"no order", npy_file(npy_dict("|i4", "(3, 1)"), data), {3, 1}},
      {"double quotes, no trailing comma",
       npy_file("{\"shape\": (3,), \"fortran_order\": False, \"descr\": \"<i4\"}", data), {3}},
      {"python 2 longs", npy_file(npy_dict("<i4", "(3L,)"), data), {3}},
      {"fortran 1-d", npy_file(npy_dict("<i4", "(3,)", "True"), data), {3}},
      {"fortran with unit dims", npy_file(npy_dict("<i4", "(1, 3, 1)", "True"), data), {1, 3, 1}},
  };
  for (const Case& c : cases) {
    const std::string path = dir.file("v.npy");
    write_bytes(path, c.bytes);
    auto a = read_npy(path);
    ASSERT_TRUE(a.ok()) << c.name << ": " << a.status().to_string();
    EXPECT_EQ(a->dtype(), DType::i32) << c.name;
    EXPECT_EQ(a->shape(), c.shape) << c.name;
    EXPECT_EQ(bytes_of(*a), data) << c.name;
  }
}

TEST(Npy, WriteRefusals) {
  TempDir dir;
  HostArray b = filled(DType::bf16, {2, 2}, 1);
  Status s = write_npy(dir.file("b.npy"), b.view());
  EXPECT_EQ(s.code(), StatusCode::unsupported_dtype);
  EXPECT_NE(s.message().find(".safetensors"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(dir.file("b.npy")));

  HostArray f = filled(DType::f32, {2, 2}, 1);
  Tensor on_gpu = f.view();
  on_gpu.device = {DeviceType::cuda, 0};
  s = write_npy(dir.file("g.npy"), on_gpu);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_NE(s.message().find("cuda:0"), std::string::npos) << s.message();

  Tensor negative = f.view();
  negative.shape[0] = -2;
  EXPECT_EQ(write_npy(dir.file("n.npy"), negative).code(), StatusCode::invalid_argument);

  Tensor empty_but_huge;  // numel 0, yet its strides would overflow
  empty_but_huge.ndim = 3;
  empty_but_huge.shape[1] = empty_but_huge.shape[2] = int64_t{1} << 40;
  EXPECT_EQ(write_npy(dir.file("e.npy"), empty_but_huge).code(), StatusCode::invalid_argument);

  Tensor no_data = f.view();
  no_data.data = nullptr;
  EXPECT_EQ(write_npy(dir.file("z.npy"), no_data).code(), StatusCode::invalid_argument);

  s = write_npy(dir.file("no_such_dir/a.npy"), f.view());
  EXPECT_EQ(s.code(), StatusCode::io_error);
  EXPECT_NE(s.message().find("no_such_dir"), std::string::npos) << s.message();
}

TEST(Io, MissingOrUnreadableFilesAreIoErrors) {
  TempDir dir;
  for (const std::string& path : {dir.file("absent.npy"), dir.file("absent.safetensors")}) {
    auto r = read_tensor(path);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::io_error);
    EXPECT_NE(r.status().message().find("absent"), std::string::npos);
  }
  fs::create_directories(dir.file("dir.npy"));
  auto r = read_npy(dir.file("dir.npy"));
  EXPECT_EQ(r.status().code(), StatusCode::io_error);
  EXPECT_NE(r.status().message().find("directory"), std::string::npos) << r.status().message();
}

// A config, a tokenizer or a chat template: read whole, byte for byte (NUL and CR included); a
// missing path, a directory or an empty name is an io_error naming the path, never an empty text.
TEST(Io, ReadTextFile) {
  TempDir dir;
  const std::string bytes = std::string("{\"a\": 1}\r\n\0tail\xC3", 14);
  write_bytes(dir.file("config.json"), bytes);
  auto r = read_text_file(dir.file("config.json"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value(), bytes);
  write_bytes(dir.file("empty.json"), "");
  ASSERT_TRUE(read_text_file(dir.file("empty.json")).ok());
  EXPECT_EQ(read_text_file(dir.file("empty.json")).value(), "");
  for (const std::string& path : {dir.file("absent.json"), dir.path().string(), std::string()}) {
    auto bad = read_text_file(path);
    ASSERT_FALSE(bad.ok()) << path;
    EXPECT_EQ(bad.status().code(), StatusCode::io_error) << path;
  }
  EXPECT_NE(read_text_file(dir.path().string()).status().message().find("directory"), std::string::npos);
  EXPECT_NE(read_text_file(dir.file("absent.json")).status().message().find("absent.json"), std::string::npos);
}

// ---- .safetensors -------------------------------------------------------------------------

TEST(Safetensors, RoundTripEveryDtypeInFileOrder) {
  TempDir dir;
  std::vector<HostArray> arrays;
  std::vector<std::pair<std::string, Tensor>> entries;
  uint32_t seed = 11;
  // Names deliberately out of alphabetical order: the file keeps ours.
  const char* names[] = {"zeta", "alpha", "mid.weight", "b"};
  int n = 0;
  for (DType dtype : {DType::f32, DType::f16, DType::bf16, DType::i32}) {
    for (const auto& shape : kShapes) arrays.push_back(filled(dtype, shape, seed++));
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    entries.emplace_back(std::string(names[n++ % 4]) + "_" + std::to_string(i), arrays[i].view());
  }
  const std::string path = dir.file("all.safetensors");
  ASSERT_TRUE(write_safetensors(path, entries).ok());
  auto back = read_safetensors(path);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_EQ(back->size(), arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    EXPECT_EQ((*back)[i].name, entries[i].first);
    expect_same(arrays[i], (*back)[i].array);
  }
  // The header is padded so the data section starts 8-byte aligned.
  const std::string bytes = read_bytes(path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(header_len % 8, 0u);
}

TEST(Safetensors, HandBuiltFileWithMetadataAndPadding) {
  TempDir dir;
  const std::string json =
      R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]},)"
      R"( "x": {"dtype": "I32", "shape": [], "data_offsets": [0, 4]}}    )";
  const std::string path = dir.file("h.safetensors");
  write_bytes(path, st_file(json, std::string("\x2a\x00\x00\x00\x80\x3f\x00\xc0", 8) + "gap"));
  auto r = read_safetensors(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].name, "w");
  EXPECT_EQ((*r)[0].array.dtype(), DType::bf16);
  EXPECT_EQ(bf16_to_float((*r)[0].array.ptr<uint16_t>()[0]), 1.0f);
  EXPECT_EQ(bf16_to_float((*r)[0].array.ptr<uint16_t>()[1]), -2.0f);
  EXPECT_EQ((*r)[1].name, "x");
  EXPECT_TRUE((*r)[1].array.shape().empty());
  EXPECT_EQ((*r)[1].array.ptr<int32_t>()[0], 42);
}

TEST(Safetensors, WriteRefusals) {
  TempDir dir;
  HostArray a = filled(DType::f32, {2}, 1);
  const std::string path = dir.file("w.safetensors");
  EXPECT_EQ(write_safetensors(path, {{"a", a.view()}, {"a", a.view()}}).code(), StatusCode::invalid_argument);
  EXPECT_EQ(write_safetensors(path, {{"__metadata__", a.view()}}).code(), StatusCode::invalid_argument);
  EXPECT_EQ(write_safetensors(path, {{"", a.view()}}).code(), StatusCode::invalid_argument);
  EXPECT_EQ(write_safetensors(path, {{"\xff\xfe", a.view()}}).code(), StatusCode::invalid_argument);
  EXPECT_FALSE(fs::exists(path));
}

// ---- read_tensor / write_tensor -----------------------------------------------------------

TEST(Io, ReadAndWriteTensorByExtension) {
  TempDir dir;
  HostArray q = filled(DType::f16, {2, 3}, 5), k = filled(DType::bf16, {4}, 6);

  ASSERT_TRUE(write_tensor(dir.file("q.npy"), q.view()).ok());
  auto r = read_tensor(dir.file("q.npy"));
  ASSERT_TRUE(r.ok());
  expect_same(q, *r);

  ASSERT_TRUE(write_tensor(dir.file("k.safetensors"), k.view()).ok());
  r = read_tensor(dir.file("k.safetensors"));
  ASSERT_TRUE(r.ok());
  expect_same(k, *r);

  ASSERT_TRUE(write_tensor(dir.file("n.safetensors:keys"), k.view()).ok());
  auto named = read_safetensors(dir.file("n.safetensors"));
  ASSERT_TRUE(named.ok());
  ASSERT_EQ(named->size(), 1u);
  EXPECT_EQ((*named)[0].name, "keys");

  const std::string both = dir.file("qk.safetensors");
  ASSERT_TRUE(write_safetensors(both, {{"q", q.view()}, {"k", k.view()}}).ok());
  r = read_tensor(both + ":k");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  expect_same(k, *r);
  r = read_tensor(both + ":q");
  ASSERT_TRUE(r.ok());
  expect_same(q, *r);

  // Without a name, a file of two entries is ambiguous: the message lists them.
  r = read_tensor(both);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(r.status().message().find("'q', 'k'"), std::string::npos) << r.status().message();

  r = read_tensor(both + ":v");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::invalid_argument);
  EXPECT_NE(r.status().message().find("no entry 'v'"), std::string::npos) << r.status().message();

  r = read_tensor(dir.file("q.txt"));
  EXPECT_EQ(r.status().code(), StatusCode::invalid_argument);
  EXPECT_EQ(write_tensor(dir.file("q.txt"), q.view()).code(), StatusCode::invalid_argument);
  EXPECT_EQ(write_tensor(dir.file("k.npy"), k.view()).code(), StatusCode::unsupported_dtype);  // bf16

  write_bytes(dir.file("empty.safetensors"), st_file("{}"));
  r = read_tensor(dir.file("empty.safetensors"));
  EXPECT_EQ(r.status().code(), StatusCode::malformed_file);
  EXPECT_NE(r.status().message().find("no tensors"), std::string::npos);
}

// ---- malformed files ----------------------------------------------------------------------

struct BadFile {
  const char* name;
  const char* ext;  // ".npy" or ".safetensors"
  std::string bytes;
  StatusCode code;
  const char* fragment;  // expected in the message
};

std::vector<BadFile> bad_files() {
  const std::string f32x6(24, '\x01');
  auto entry = [](const std::string& body) { return "{\"t\": {" + body + "}}"; };
  auto entry_body = [](const std::string& body) { return "\"t\": {" + body + "}"; };
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  std::string deep_objects;
  for (int i = 0; i < 50000; ++i) deep_objects += "{\"a\": ";
  deep_objects += "1" + std::string(50000, '}');
  std::string long_list = "0";
  for (int i = 1; i < 10000; ++i) long_list += ", " + std::to_string(i);
  return {
      // .npy
      {"empty file", ".npy", "", StatusCode::malformed_file, "truncated header"},
      {"bad magic", ".npy", "PK\x03\x04 this is a zip file", StatusCode::malformed_file, "bad magic"},
      {"magic only", ".npy", "\x93NUMPY\x01", StatusCode::malformed_file, "truncated header"},
      {"v2 length cut", ".npy", std::string("\x93NUMPY\x02\x00\x10\x00", 10), StatusCode::malformed_file,
       "truncated header"},
      {"header length beyond file", ".npy", std::string("\x93NUMPY\x01\x00\xff\x7f{'descr'", 17),
       StatusCode::malformed_file, "runs beyond the file"},
      {"unknown version", ".npy", npy_file(npy_dict("<f4", "(6,)"), f32x6, 4), StatusCode::malformed_file,
       "version 4.0"},
      {"header not a dict", ".npy", npy_file("[1, 2, 3]\n", f32x6), StatusCode::malformed_file, "not a dict"},
      {"missing shape", ".npy", npy_file("{'descr': '<f4', 'fortran_order': False}\n", f32x6),
       StatusCode::malformed_file, "missing the key 'shape'"},
      {"extra key", ".npy",
       npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}\n", f32x6),
       StatusCode::malformed_file, "unexpected header key 'x'"},
      {"duplicate key", ".npy",
       npy_file("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}\n", f32x6),
       StatusCode::malformed_file, "duplicate key 'descr'"},
      {"unknown dtype", ".npy", npy_file(npy_dict("<q9", "(6,)"), f32x6), StatusCode::malformed_file,
       "unknown dtype '<q9'"},
      {"float64", ".npy", npy_file(npy_dict("<f8", "(3,)"), f32x6), StatusCode::unsupported_dtype,
       "astype(np.float32)"},
      {"big-endian", ".npy", npy_file(npy_dict(">f4", "(6,)"), f32x6), StatusCode::unsupported_dtype,
       "big-endian"},
      {"fortran order", ".npy", npy_file(npy_dict("<f4", "(2, 3)", "True"), f32x6), StatusCode::unsupported,
       "Fortran-order"},
      {"fortran order not a bool", ".npy", npy_file(npy_dict("<f4", "(6,)", "0"), f32x6),
       StatusCode::malformed_file, "'fortran_order': expected True or False"},
      {"negative dim", ".npy", npy_file(npy_dict("<f4", "(-2, 3)"), f32x6), StatusCode::malformed_file,
       "is negative: -2"},
      {"float dim", ".npy", npy_file(npy_dict("<f4", "(2.5, 3)"), f32x6), StatusCode::malformed_file,
       "entry 0 is not an integer: 2.5"},
      {"string dim", ".npy", npy_file(npy_dict("<f4", "(2, '3')"), f32x6), StatusCode::malformed_file,
       "entry 1 is not an integer: '3'"},
      {"shape not a tuple", ".npy", npy_file(npy_dict("<f4", "[2, 3]"), f32x6), StatusCode::malformed_file,
       "expected a tuple of integers, got a list"},
      {"dim beyond int64", ".npy", npy_file(npy_dict("<f4", "(99999999999999999999,)"), f32x6),
       StatusCode::malformed_file, "does not fit int64"},
      {"huge dims overflow", ".npy", npy_file(npy_dict("<f4", "(1099511627776, 1099511627776)"), f32x6),
       StatusCode::malformed_file, "overflows"},
      {"empty but huge dims", ".npy", npy_file(npy_dict("<f4", "(0, 1099511627776, 1099511627776)")),
       StatusCode::malformed_file, "overflows"},
      {"lying shape", ".npy", npy_file(npy_dict("<f4", "(1048576, 1048576)"), f32x6), StatusCode::malformed_file,
       "truncated data"},
      {"truncated data", ".npy", npy_file(npy_dict("<f4", "(7,)"), f32x6), StatusCode::malformed_file,
       "needs 28 bytes, the file has 24"},
      {"extra data", ".npy", npy_file(npy_dict("<f4", "(5,)"), f32x6), StatusCode::malformed_file,
       "4 unexpected bytes after the data"},
      {"too many dims", ".npy", npy_file(npy_dict("<f4", "(1, 1, 1, 1, 1, 1, 6)"), f32x6), StatusCode::unsupported,
       "at most 6 dimensions"},
      {"trailing garbage in header", ".npy", npy_file(npy_dict("<f4", "(6,)") + "garbage", f32x6),
       StatusCode::malformed_file, "trailing garbage"},
      {"unterminated string", ".npy", npy_file("{'descr': '<f4}\n", f32x6), StatusCode::malformed_file,
       "unterminated string"},
      {"missing colon", ".npy", npy_file("{'descr' '<f4'}\n", f32x6), StatusCode::malformed_file, "expected ':'"},
      {"unclosed dict", ".npy", npy_file("{'descr': '<f4',", f32x6), StatusCode::malformed_file, "found the end"},
      {"deep nesting", ".npy", npy_file("{'shape': " + std::string(5000, '('), f32x6), StatusCode::malformed_file,
       "nests deeper"},
      // .safetensors
      {"short file", ".safetensors", std::string("\x10\x00\x00", 3), StatusCode::malformed_file, "truncated header"},
      {"header length beyond file", ".safetensors", le_bytes(1000, 8) + "{}", StatusCode::malformed_file,
       "runs beyond the file"},
      {"header length 2^63", ".safetensors", le_bytes(uint64_t{1} << 63, 8) + "{}", StatusCode::malformed_file,
       "runs beyond the file"},
      {"empty header", ".safetensors", le_bytes(0, 8), StatusCode::malformed_file, "too small"},
      {"not an object", ".safetensors", st_file("[1, 2]"), StatusCode::malformed_file, "not a JSON object"},
      {"bad json", ".safetensors", st_file("{\"t\": }"), StatusCode::malformed_file, "bad JSON header"},
      {"trailing garbage", ".safetensors", st_file("{} extra"), StatusCode::malformed_file, "trailing garbage"},
      {"unterminated json", ".safetensors", st_file(R"({"t": [[[)"), StatusCode::malformed_file,
       "bad JSON header: parse error"},
      {"duplicate name", ".safetensors",
       st_file(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
               R"( "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
               std::string(4, '\0')),
       StatusCode::malformed_file, "duplicate key 't'"},
      {"entry not an object", ".safetensors", st_file(R"({"t": [1, 2]})"), StatusCode::malformed_file,
       "expected an object"},
      {"missing offsets", ".safetensors", st_file(entry(R"("dtype": "F32", "shape": [6])"), f32x6),
       StatusCode::malformed_file, "missing key 'data_offsets'"},
      {"unknown dtype", ".safetensors",
       st_file(entry(R"("dtype": "Q7", "shape": [6], "data_offsets": [0, 24])"), f32x6), StatusCode::malformed_file,
       "unknown dtype 'Q7'"},
      {"float64", ".safetensors", st_file(entry(R"("dtype": "F64", "shape": [3], "data_offsets": [0, 24])"), f32x6),
       StatusCode::unsupported_dtype, "unsupported dtype F64"},
      {"negative dim", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [-6], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "is negative: -6"},
      {"float dim", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [6.0], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "not an integer"},
      {"dim beyond int64", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "too large for int64"},
      {"huge dims overflow", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "overflows"},
      {"lying shape", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [1048576, 1048576], "data_offsets": [0, 4398046511104])"), f32x6),
       StatusCode::malformed_file, "beyond the data section"},
      {"offsets disagree with shape", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20])"), f32x6),
       StatusCode::malformed_file, "needs 24"},
      {"end before begin", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [0], "data_offsets": [8, 4])"), f32x6), StatusCode::malformed_file,
       "end < begin"},
      {"offsets not a pair", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [6], "data_offsets": [0])"), f32x6), StatusCode::malformed_file,
       "not a pair"},
      {"overlap", ".safetensors",
       st_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
               R"( "b": {"dtype": "I32", "shape": [2], "data_offsets": [12, 20]}})",
               f32x6),
       StatusCode::malformed_file, "overlap"},
      {"too many dims", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [1, 1, 1, 1, 1, 1, 6], "data_offsets": [0, 24])"), f32x6),
       StatusCode::unsupported, "at most 6 dimensions"},
      // Deep nesting (issue 14): 100,000 levels overflowed the stack while parsing, copying an
      // earlier member, or dumping a nested value into a message; now refused before parsing.
      {"deep earlier member", ".safetensors",
       st_file("{\"a\": " + deep + ", " + entry_body(R"("dtype": "F32", "shape": [6], "data_offsets": [0, 24])") + "}",
               f32x6),
       StatusCode::malformed_file, "nests deeper than 32 levels"},
      {"deep dtype", ".safetensors",
       st_file(entry(R"("dtype": )" + deep + R"(, "shape": [6], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "nests deeper than 32 levels"},
      {"deep shape", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": )" + deep + R"(, "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "nests deeper than 32 levels"},
      {"deep offsets", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [6], "data_offsets": )" + deep), f32x6), StatusCode::malformed_file,
       "nests deeper than 32 levels"},
      {"deep metadata", ".safetensors", st_file(R"({"__metadata__": {"k": )" + deep_objects + "}}"),
       StatusCode::malformed_file, "nests deeper than 32 levels"},
      {"deep unclosed", ".safetensors", st_file("{\"a\": " + std::string(100000, '[')), StatusCode::malformed_file,
       "nests deeper than 32 levels"},
      {"33 levels", ".safetensors", st_file("{\"a\": " + std::string(32, '[') + std::string(32, ']') + "}"),
       StatusCode::malformed_file, "nests deeper than 32 levels"},
      // Brackets inside strings do not count as nesting: this is only a bad dtype.
      {"brackets in a string", ".safetensors",
       st_file(entry(R"("dtype": ")" + std::string(1000, '[') + R"(\"[", "shape": [6], "data_offsets": [0, 24])"),
               f32x6),
       StatusCode::malformed_file, "unknown dtype"},
      // A nested value in a message is clipped, and invalid UTF-8 in it does not throw.
      {"nested dtype", ".safetensors",
       st_file(entry(R"("dtype": [[[[1, 2, 3]]]], "shape": [6], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "'dtype' is not a string: [[[[1,2,3]]]]"},
      {"long dtype list", ".safetensors",
       st_file(entry(R"("dtype": [)" + long_list + R"(], "shape": [6], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "..."},
      {"bad utf-8 in a dtype list", ".safetensors",
       st_file(entry("\"dtype\": [\"\xff\"], \"shape\": [6], \"data_offsets\": [0, 24]"), f32x6),
       StatusCode::malformed_file, "bad JSON header"},
      {"bad utf-8 dtype", ".safetensors",
       st_file(entry("\"dtype\": \"F\xc3\", \"shape\": [6], \"data_offsets\": [0, 24]"), f32x6),
       StatusCode::malformed_file, "bad JSON header"},
      {"shape an object", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": {"a": [1]}, "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "'shape' is not a list: {\"a\":[1]}"},
      {"offsets nested", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [6], "data_offsets": [[0], [24]])"), f32x6),
       StatusCode::malformed_file, "'data_offsets' entry is not an integer: [0]"},
      // Numbers beyond a double (issue 14): nlohmann threw out_of_range out of the Status API.
      {"1e400 in shape", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [1e400], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "(in 't' > 'shape'): expected a number that fits a double"},
      {"-1e400 in shape", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [-1e400], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "expected a number that fits a double"},
      {"1e400 in offsets", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [6], "data_offsets": [0, 1e400])"), f32x6),
       StatusCode::malformed_file, "(in 't' > 'data_offsets')"},
      {"1e400 as dtype", ".safetensors", st_file(entry(R"("dtype": 1e400, "shape": [6], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "(in 't' > 'dtype')"},
      {"1e400 in metadata", ".safetensors", st_file(R"({"__metadata__": {"block_q": 1e400}})"),
       StatusCode::malformed_file, "(in '__metadata__' > 'block_q')"},
      {"1e400 as a member", ".safetensors", st_file(R"({"x": 1e400})"), StatusCode::malformed_file,
       "(in 'x')"},
      {"1e99999 in shape", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [1e99999], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "fits a double"},
      {"integer of 400 digits", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [)" + std::string(400, '9') + R"(], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "fits a double"},
      {"huge exponent in offsets", ".safetensors",
       st_file(entry(R"("dtype": "F32", "shape": [6], "data_offsets": [0e-99999, 24])"), f32x6),
       StatusCode::malformed_file, "not an integer"},
      {"nan literal", ".safetensors", st_file(entry(R"("dtype": "F32", "shape": [NaN], "data_offsets": [0, 24])"), f32x6),
       StatusCode::malformed_file, "bad JSON header"},
  };
}

TEST(Io, MalformedFilesAreRefusedWithCodeAndReason) {
  TempDir dir;
  int count = 0;
  for (const BadFile& bad : bad_files()) {
    SCOPED_TRACE(std::string(bad.name) + bad.ext);
    const std::string path = dir.file("bad_" + std::to_string(count++) + bad.ext);
    write_bytes(path, bad.bytes);
    const Status status = std::string(bad.ext) == ".npy" ? read_npy(path).status() : read_safetensors(path).status();
    EXPECT_EQ(status.code(), bad.code) << status.to_string();
    EXPECT_NE(status.message().find(bad.fragment), std::string::npos)
        << "expected '" << bad.fragment << "' in: " << status.message();
    // The message names the file.
    EXPECT_EQ(status.message().rfind(path, 0), 0u) << status.message();
    // read_tensor takes the same path and refuses the same way.
    EXPECT_EQ(read_tensor(path).status().code(), bad.code);
  }
  EXPECT_GE(count, 15);
}

TEST(Io, TruncationAtEveryByteIsRefused) {
  // Every proper prefix of a valid file is refused as malformed, never read or crashed on.
  TempDir dir;
  HostArray a = filled(DType::f32, {2, 3}, 9);
  for (const char* ext : {".npy", ".safetensors"}) {
    const std::string path = dir.file(std::string("whole") + ext);
    ASSERT_TRUE(write_tensor(path, a.view()).ok());
    const std::string whole = read_bytes(path);
    for (size_t n = 0; n < whole.size(); ++n) {
      const std::string cut = dir.file(std::string("cut") + ext);
      write_bytes(cut, whole.substr(0, n));
      auto r = read_tensor(cut);
      ASSERT_FALSE(r.ok()) << ext << " prefix of " << n << " bytes was accepted";
      EXPECT_EQ(r.status().code(), StatusCode::malformed_file) << ext << " " << n << ": " << r.status().to_string();
    }
  }
}

// ---- atomic writes, write_tensors, metadata (issue 14) -------------------------------------

namespace {

// Runs f with the file-size limit set to `bytes` (a write beyond it fails with EFBIG: a
// stand-in for a full disk), then restores the limit.
template <class F>
void with_file_size_limit(rlim_t bytes, F&& f) {
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = bytes;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  f();
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
}

std::vector<std::string> temporaries_in(const fs::path& dir) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().find(".tmp-") != std::string::npos) found.push_back(e.path().string());
  }
  return found;
}

}  // namespace

TEST(Io, FailedWriteKeepsTheExistingFile) {
  TempDir dir;
  HostArray big = filled(DType::f32, {256, 256}, 3);  // 256 KiB
  for (const char* name : {"o.npy", "o.safetensors"}) {
    SCOPED_TRACE(name);
    const std::string path = dir.file(name);
    write_bytes(path, "the old contents");
    with_file_size_limit(64 * 1024, [&] {
      Status s = write_tensor(path, big.view());
      EXPECT_EQ(s.code(), StatusCode::io_error) << s.to_string();
      EXPECT_EQ(s.message().rfind(path, 0), 0u) << s.message();
    });
    EXPECT_EQ(read_bytes(path), "the old contents");
    EXPECT_TRUE(temporaries_in(dir.path()).empty());
    // A new file that fails leaves nothing.
    const std::string fresh = dir.file(std::string("new_") + name);
    with_file_size_limit(64 * 1024, [&] { EXPECT_FALSE(write_tensor(fresh, big.view()).ok()); });
    EXPECT_FALSE(fs::exists(fresh));
  }
  // Without the limit the same write replaces the file.
  ASSERT_TRUE(write_tensor(dir.file("o.npy"), big.view()).ok());
  EXPECT_EQ(read_npy(dir.file("o.npy")).value().nbytes(), big.nbytes());
}

TEST(Io, WriteTensorsIsAllOrNothing) {
  TempDir dir;
  HostArray small = filled(DType::f32, {4}, 1), big = filled(DType::f32, {256, 256}, 2);
  write_bytes(dir.file("a.npy"), "old a");
  write_bytes(dir.file("b.npy"), "old b");
  with_file_size_limit(64 * 1024, [&] {
    // a (small) is written to its temporary, b fails: neither replaces its path.
    const char* labels[] = {"--out", "--lse"};
    Status s = write_tensors({{dir.file("a.npy"), small.view()}, {dir.file("b.npy"), big.view()}}, labels);
    EXPECT_EQ(s.code(), StatusCode::io_error);
    EXPECT_EQ(s.message().rfind("--lse: ", 0), 0u) << s.message();
  });
  EXPECT_EQ(read_bytes(dir.file("a.npy")), "old a");
  EXPECT_EQ(read_bytes(dir.file("b.npy")), "old b");
  EXPECT_TRUE(temporaries_in(dir.path()).empty());
}

TEST(Io, WriteTensorsGroupsEntriesOfOneSafetensorsFile) {
  TempDir dir;
  HostArray o = filled(DType::f32, {2, 3}, 4), lse = filled(DType::f32, {2}, 5);
  const std::string file = dir.file("r.safetensors");
  ASSERT_TRUE(write_tensors({{file + ":o", o.view()}, {dir.path().string() + "/./r.safetensors:lse", lse.view()}}).ok());
  auto entries = read_safetensors(file);
  ASSERT_TRUE(entries.ok()) << entries.status().to_string();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[0].name, "o");
  EXPECT_EQ((*entries)[1].name, "lse");
  EXPECT_EQ(std::memcmp((*entries)[1].array.data(), lse.data(), lse.nbytes()), 0);
}

TEST(Io, WriteTensorsRefusesTwoOutputsInOneFile) {
  TempDir dir;
  HostArray a = filled(DType::f32, {3}, 6);
  write_bytes(dir.file("x.npy"), "keep");
  fs::create_directories(dir.path() / "sub");
  fs::create_hard_link(dir.file("x.npy"), dir.file("x_hard.npy"));
  fs::create_symlink(dir.file("x.npy"), dir.file("x_link.npy"));
  const std::string d = dir.path().string();
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {d + "/x.npy", d + "/x.npy"},
      {d + "/x.npy", d + "/./x.npy"},
      {d + "/x.npy", d + "/sub/../x.npy"},
      {d + "/x.npy", d + "/x_hard.npy"},
      {d + "/x.npy", d + "/x_link.npy"},
      {d + "/n.npy", d + "/./n.npy"},  // neither exists yet
      {d + "/r.safetensors", d + "/r.safetensors"},
      {d + "/r.safetensors:a", d + "/r.safetensors"},
      {d + "/r.safetensors:a", d + "/./r.safetensors:a"},
  };
  for (const auto& [first, second] : pairs) {
    SCOPED_TRACE(first + " / " + second);
    Status s = write_tensors({{first, a.view()}, {second, a.view()}});
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
    EXPECT_NE(s.message().find("outputs[1]: "), std::string::npos) << s.message();
  }
  EXPECT_EQ(read_bytes(dir.file("x.npy")), "keep");
  EXPECT_FALSE(fs::exists(dir.file("n.npy")));
  EXPECT_FALSE(fs::exists(dir.file("r.safetensors")));
}

TEST(Io, WriteThroughASymlinkReplacesItsTarget) {
  TempDir dir;
  HostArray a = filled(DType::f32, {5}, 7);
  write_bytes(dir.file("target.npy"), "old");
  fs::create_symlink(dir.file("target.npy"), dir.file("link.npy"));
  ASSERT_TRUE(write_tensor(dir.file("link.npy"), a.view()).ok());
  EXPECT_TRUE(fs::is_symlink(dir.file("link.npy")));
  EXPECT_EQ(read_npy(dir.file("target.npy")).value().nbytes(), a.nbytes());
}

TEST(Io, ReplacedFilesKeepTheirModeAndNewOnesFollowTheUmask) {
  TempDir dir;
  HostArray a = filled(DType::f32, {5}, 8);
  const mode_t mask = ::umask(022);
  ASSERT_TRUE(write_tensor(dir.file("new.npy"), a.view()).ok());
  struct stat st;
  ASSERT_EQ(::stat(dir.file("new.npy").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);  // 0666 & ~umask, as for any new file (not mkstemp's 0600)
  ASSERT_EQ(::chmod(dir.file("new.npy").c_str(), 0640), 0);
  ASSERT_TRUE(write_tensor(dir.file("new.npy"), a.view()).ok());
  ASSERT_EQ(::stat(dir.file("new.npy").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ::umask(mask);
}

TEST(Safetensors, Metadata) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_bytes(path, st_file(R"({"__metadata__": {"block_q": "64", "n": 16, "x": [1, 2]}})"));
  auto meta = read_safetensors_metadata(path);
  ASSERT_TRUE(meta.ok()) << meta.status().to_string();
  ASSERT_EQ(meta->size(), 3u);
  EXPECT_EQ((*meta)[0], (std::pair<std::string, std::string>{"block_q", "64"}));
  EXPECT_EQ((*meta)[1], (std::pair<std::string, std::string>{"n", "16"}));
  EXPECT_EQ((*meta)[2], (std::pair<std::string, std::string>{"x", "[1,2]"}));
  write_bytes(path, st_file(R"({"__metadata__": [1]})"));
  EXPECT_EQ(read_safetensors_metadata(path).status().code(), StatusCode::malformed_file);
  EXPECT_TRUE(read_safetensors(path).ok());  // read_safetensors ignores __metadata__
  write_bytes(path, st_file("{}"));
  EXPECT_TRUE(read_safetensors_metadata(path).value().empty());
  EXPECT_EQ(read_safetensors_metadata(dir.file("none.safetensors")).status().code(), StatusCode::io_error);
}

