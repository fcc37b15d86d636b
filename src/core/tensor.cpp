#include "sparsa/tensor.h"

#include "core/backends.h"

#include <bit>
#include <cstring>
#include <stdexcept>

namespace sparsa {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
  }
  return 0;
}

Result<DType> parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return DType::f32;
  if (name == "f16" || name == "float16") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "i32" || name == "int32") return DType::i32;
  return invalid_argument("dtype: expected one of f32, f16, bf16, i32, got '" + name + "'");
}

std::string device_name(Device device) {
  if (device.type == DeviceType::cpu) return "cpu";
  return "cuda:" + std::to_string(device.id);
}

Tensor Tensor::contiguous(void* data, DType dtype, std::span<const int64_t> shape, Device device) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  if (t.ndim > kMaxDims) throw std::invalid_argument("Tensor: more than kMaxDims dimensions");
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d];
  }
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + "]";
}

HostArray::HostArray(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  bytes_.assign(static_cast<size_t>(numel()) * dtype_size(dtype_), std::byte{0});
}

int64_t HostArray::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

Tensor HostArray::view() const {
  return Tensor::contiguous(const_cast<std::byte*>(bytes_.data()), dtype_, shape_);
}

Result<DeviceArray> DeviceArray::allocate(DType dtype, std::vector<int64_t> shape, Device device, bool zero_fill,
                                          void* stream) {
  if (device.type != DeviceType::cuda) {
    return invalid_argument("DeviceArray: expected a cuda device, got " + device_name(device));
  }
  DeviceArray a;
  a.dtype_ = dtype;
  a.device_ = device;
  a.shape_ = std::move(shape);
  for (int64_t s : a.shape_) {
    if (s < 0) return invalid_argument("DeviceArray: negative extent in shape");
  }
  void* ptr = nullptr;
  SPARSA_RETURN_IF_ERROR(cuda::malloc_device(device.id, a.nbytes(), zero_fill, stream, &ptr));
  const int id = device.id;
  a.stream_ = stream;
  a.storage_ = std::shared_ptr<void>(ptr, [id, stream](void* p) { cuda::free_device(id, p, stream); });
  return a;
}

int64_t DeviceArray::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

Tensor DeviceArray::view() const { return Tensor::contiguous(storage_.get(), dtype_, shape_, device_); }

Result<HostArray> DeviceArray::to_host() const {
  HostArray h(dtype_, shape_);
  if (nbytes() > 0) SPARSA_RETURN_IF_ERROR(cuda::copy_to_host(device_.id, storage_.get(), nbytes(), h.data(), stream_));
  return h;
}

Result<DeviceArray> DeviceArray::from_host(const HostArray& host, Device device, void* stream) {
  auto a = allocate(host.dtype(), host.shape(), device, /*zero_fill=*/false, stream);
  if (!a.ok()) return a.status();
  if (host.nbytes() > 0) SPARSA_RETURN_IF_ERROR(cuda::copy_to_device(device.id, host.data(), host.nbytes(), a->data(), stream));
  return a;
}

namespace {
// Calls f(flat, element_offset) for every element of t in row-major order.
template <class F>
void for_each_offset(const Tensor& t, F&& f) {
  const int64_t n = t.numel();
  if (n == 0) return;
  int64_t idx[kMaxDims] = {};
  int64_t off = 0;
  for (int64_t flat = 0; flat < n; ++flat) {
    f(flat, off);
    for (int d = t.ndim - 1; d >= 0; --d) {
      ++idx[d];
      off += t.strides[d];
      if (idx[d] < t.shape[d]) break;
      off -= idx[d] * t.strides[d];
      idx[d] = 0;
    }
  }
}
}  // namespace

HostArray HostArray::copy_of(const Tensor& t) {
  HostArray a(t.dtype, t.shape_vector());
  const size_t es = dtype_size(t.dtype);
  auto* dst = static_cast<std::byte*>(a.data());
  const auto* src = static_cast<const std::byte*>(t.data);
  for_each_offset(t, [&](int64_t flat, int64_t off) {
    std::memcpy(dst + flat * es, src + off * static_cast<int64_t>(es), es);
  });
  return a;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FFu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7FFFFFFFu;
  if (absx >= 0x7F800000u) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7C00u | (absx > 0x7F800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: Inf
  if (absx < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to 0
    const uint32_t exp = absx >> 23;
    const uint32_t mant = (absx & 0x7FFFFFu) | 0x800000u;
    const uint32_t s = 126 - exp;  // value = mant * 2^(exp-150); the subnormal unit is 2^-24
    uint32_t h = mant >> s;
    const uint32_t rem = mant & ((1u << s) - 1);
    const uint32_t halfway = 1u << (s - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((absx - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const uint32_t rem = absx & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

double load_as_double(const Tensor& t, int64_t flat_index) {
  int64_t off = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    off += (flat_index % t.shape[d]) * t.strides[d];
    flat_index /= t.shape[d];
  }
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[off];
    case DType::f16: return half_to_float(static_cast<const uint16_t*>(t.data)[off]);
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(t.data)[off]);
    case DType::i32: return static_cast<const int32_t*>(t.data)[off];
  }
  return 0;
}

Result<HostArray> convert(const Tensor& t, DType to) {
  if ((t.dtype == DType::i32) != (to == DType::i32)) {
    return unsupported_dtype(std::string("convert: cannot convert ") + dtype_name(t.dtype) + " to " +
                             dtype_name(to));
  }
  HostArray a(to, t.shape_vector());
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double x = load_as_double(t, i);
    switch (to) {
      case DType::f32: a.ptr<float>()[i] = static_cast<float>(x); break;
      case DType::f16: a.ptr<uint16_t>()[i] = float_to_half(static_cast<float>(x)); break;
      case DType::bf16: a.ptr<uint16_t>()[i] = float_to_bf16(static_cast<float>(x)); break;
      case DType::i32: a.ptr<int32_t>()[i] = static_cast<int32_t>(x); break;
    }
  }
  return a;
}

}  // namespace sparsa
