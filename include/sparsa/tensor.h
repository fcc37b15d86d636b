// sparsa/tensor.h — a non-owning, DLPack-shaped view of an n-d array, and a small
// owning host array for outputs and files.
//
// Strides are in elements (as in DLPack), not bytes. Attention inputs are
// [batch, heads, seq, head_dim] with the last dimension contiguous; the other
// dimensions may be strided (a view into a larger buffer, a transposed layout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsa/status.h"

namespace sparsa {

enum class DType : uint8_t { f32, f16, bf16, i32 };

const char* dtype_name(DType dtype);   // "f32", "f16", "bf16", "i32"
size_t dtype_size(DType dtype);        // bytes per element
Result<DType> parse_dtype(const std::string& name);

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int id = 0;
  bool operator==(const Device&) const = default;
};

std::string device_name(Device device);  // "cpu", "cuda:0"

inline constexpr int kMaxDims = 6;
// The most CPU threads any call takes (num_threads; 0 = hardware concurrency). Each
// thread gets its own scratch, so an unbounded request would allocate without bound.
inline constexpr int kMaxNumThreads = 256;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements

  // A contiguous (row-major) view of `data` with the given shape.
  static Tensor contiguous(void* data, DType dtype, std::span<const int64_t> shape,
                           Device device = {});
  static Tensor contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           Device device = {}) {
    return contiguous(data, dtype, std::span<const int64_t>(shape.begin(), shape.size()), device);
  }

  bool defined() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::vector<int64_t> shape_vector() const { return {shape, shape + ndim}; }
  std::string shape_string() const;  // "[2, 8, 1024, 64]"

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
  // Element offset of a multi-index (no bounds check).
  int64_t offset(std::initializer_list<int64_t> index) const {
    int64_t off = 0;
    int d = 0;
    for (int64_t i : index) off += i * strides[d++];
    return off;
  }
};

// An owning, contiguous host array; view() hands out a Tensor over it.
class HostArray {
 public:
  HostArray() = default;
  HostArray(DType dtype, std::vector<int64_t> shape);  // zero-filled

  static HostArray zeros(DType dtype, std::vector<int64_t> shape) { return {dtype, std::move(shape)}; }
  // A contiguous copy of any CPU tensor (same dtype).
  static HostArray copy_of(const Tensor& t);

  Tensor view() const;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  size_t nbytes() const { return bytes_.size(); }
  bool empty() const { return shape_.empty() && bytes_.empty(); }  // default-constructed (absent); a 0-d array is not empty

  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <class T> T* ptr() { return reinterpret_cast<T*>(bytes_.data()); }
  template <class T> const T* ptr() const { return reinterpret_cast<const T*>(bytes_.data()); }

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::vector<std::byte> bytes_;  // aligned enough for every dtype (operator new)
};

// An owning, contiguous array in the memory of a CUDA device (what the cuda backend's
// selectors return their plans in). Allocated from sparsa's stream-ordered pool of that device on
// `stream` (a cudaStream_t; null is the legacy default stream), and freed on that same stream when
// the last copy goes (no device-wide synchronisation): the array is usable by work on `stream`,
// and that stream must outlive it; work on other streams orders itself against `stream` as for
// any CUDA memory. Copies share the storage (unlike HostArray, whose copies are deep). In a build
// without CUDA allocate() reports `unsupported`.
class DeviceArray {
 public:
  DeviceArray() = default;
  // Uninitialised unless zero_fill (a fill ordered on `stream`).
  static Result<DeviceArray> allocate(DType dtype, std::vector<int64_t> shape, Device device, bool zero_fill = false,
                                      void* stream = nullptr);

  Tensor view() const;
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  size_t nbytes() const { return numel() * dtype_size(dtype_); }
  bool empty() const { return storage_ == nullptr; }  // default-constructed (absent)
  void* data() const { return storage_.get(); }
  template <class T> T* ptr() const { return static_cast<T*>(storage_.get()); }
  void* stream() const { return stream_; }  // the stream it was allocated on
  // A host copy, ordered on the array's stream (waits for the work queued there).
  Result<HostArray> to_host() const;
  // A device copy of a host array (same dtype and shape), allocated and copied on `stream`; returns
  // once the copy is done.
  static Result<DeviceArray> from_host(const HostArray& host, Device device, void* stream = nullptr);

 private:
  DType dtype_ = DType::f32;
  Device device_{DeviceType::cuda, 0};
  std::vector<int64_t> shape_;
  std::shared_ptr<void> storage_;
  void* stream_ = nullptr;
};

// Conversions between storage dtypes and f32 (round to nearest even).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

// Element i (flat, row-major over shape, honouring strides) of a CPU float tensor, as f32/f64.
double load_as_double(const Tensor& t, int64_t flat_index);

// A copy of a CPU tensor converted to another dtype (f32 <-> f16 <-> bf16; i32 <-> i32).
Result<HostArray> convert(const Tensor& t, DType to);

}  // namespace sparsa
