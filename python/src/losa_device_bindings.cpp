// Block-diffusion decoding on a CUDA device in Python (sparsa._sparsa.DevicePagedKVCache,
// sparsa._sparsa.DevicePrefixAttention; sparsa/device_losa.h): torch or cupy CUDA arrays in and
// out through DLPack, zero copy. sparsa_ext.cpp calls bind_losa_device() from its module. A bad
// argument raises ValueError naming it; a capacity error MemoryError; the rest RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "sparsa/device_losa.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparsa {

namespace {

[[noreturn]] void raise_status(const Status& s) {
  switch (s.code()) {
    case StatusCode::invalid_argument: throw nb::value_error(s.message().c_str());
    case StatusCode::unsupported_dtype: throw nb::type_error(s.message().c_str());
    case StatusCode::out_of_memory: throw std::bad_alloc();
    default: throw std::runtime_error(s.message());
  }
}
void check_status(const Status& s) {
  if (!s.ok()) raise_status(s);
}
template <class T>
T take_value(Result<T>&& r) {
  if (!r.ok()) raise_status(r.status());
  return std::move(r).value();
}

// A DLPack array as a Tensor view (the library validates shape, dtype, device and strides).
Tensor view_of(const nb::ndarray<>& a, const char* name) {
  Tensor t;
  t.data = a.data();
  const nb::dlpack::dtype dt = a.dtype();
  if (dt == nb::dtype<float>()) {
    t.dtype = DType::f32;
  } else if (dt == nb::dtype<int32_t>()) {
    t.dtype = DType::i32;
  } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16) {
    t.dtype = DType::bf16;
  } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16) {
    t.dtype = DType::f16;
  } else {
    throw nb::type_error((std::string(name) + ": expected a float32, float16, bfloat16 or int32 array").c_str());
  }
  if (a.ndim() > static_cast<size_t>(kMaxDims)) throw nb::value_error((std::string(name) + ": too many dimensions").c_str());
  t.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.strides[d] = static_cast<int64_t>(a.stride(d));
  }
  t.device = a.device_type() == nb::device::cuda::value ? Device{DeviceType::cuda, a.device_id()} : Device{};
  return t;
}

DType dtype_named(const std::string& name) {
  if (name == "bfloat16" || name == "bf16") return DType::bf16;
  if (name == "float16" || name == "f16") return DType::f16;
  throw nb::type_error(("dtype: expected bfloat16 or float16, got '" + name + "'").c_str());
}

// A device array that owns its DeviceArray, for torch.from_dlpack / cupy.from_dlpack.
nb::ndarray<> owned_device_array(const DeviceArray& array) {
  auto* owned = new DeviceArray(array);  // shares the storage
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<DeviceArray*>(p); });
  std::vector<size_t> shape(owned->shape().begin(), owned->shape().end());
  nb::dlpack::dtype dt = nb::dtype<float>();
  switch (owned->dtype()) {
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::i32: dt = nb::dtype<int32_t>(); break;
    case DType::f16: dt = {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}; break;
    case DType::bf16: dt = {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}; break;
  }
  return nb::ndarray<>(owned->data(), shape.size(), shape.data(), owner, nullptr, dt, nb::device::cuda::value,
                       owned->device().id);
}

}  // namespace

void bind_losa_device(nb::module_& m) {
  nb::class_<DevicePagedKVCache>(m, "DevicePagedKVCache", "A pool of KV pages on a CUDA device (docs/losa.md §10).")
      .def_static(
          "create",
          [](int64_t heads_kv, int64_t head_dim, int64_t pool_pages, int page_size, const std::string& dtype,
             int device, uintptr_t stream) {
            DeviceKVCacheConfig c;
            c.stream = reinterpret_cast<void*>(stream);
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            c.pool_pages = pool_pages;
            c.page_size = page_size;
            c.dtype = dtype_named(dtype);
            c.device = device;
            return take_value(DevicePagedKVCache::create(c));
          },
          "heads_kv"_a, "head_dim"_a, "pool_pages"_a, "page_size"_a = 16, "dtype"_a = "bfloat16", "device"_a = 0,
          "stream"_a = 0)
      .def("add_sequence", [](DevicePagedKVCache& c, int64_t max_tokens) { return take_value(c.add_sequence(max_tokens)); },
           "max_tokens"_a)
      .def("remove_sequence", [](DevicePagedKVCache& c, int seq) { check_status(c.remove_sequence(seq)); }, "seq"_a)
      .def("reset", [](DevicePagedKVCache& c, int seq) { check_status(c.reset(seq)); }, "seq"_a)
      .def(
          "append",
          [](DevicePagedKVCache& c, int seq, nb::ndarray<> k, nb::ndarray<> v, uintptr_t stream) {
            const Tensor tk = view_of(k, "k"), tv = view_of(v, "v");
            nb::gil_scoped_release release;
            check_status(c.append(seq, tk, tv, reinterpret_cast<void*>(stream)));
          },
          "seq"_a, "k"_a, "v"_a, "stream"_a = 0)
      .def("length", [](const DevicePagedKVCache& c, int seq) { return take_value(c.length(seq)); }, "seq"_a)
      .def("capacity", [](const DevicePagedKVCache& c, int seq) { return take_value(c.capacity(seq)); }, "seq"_a)
      .def_prop_ro("free_pages", &DevicePagedKVCache::free_pages);

  nb::class_<DevicePrefixAttention>(m, "DevicePrefixAttention", "LoSA / QUEST / dense prefix attention on a device.")
      .def_static(
          "create",
          [](int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t block_size,
             const std::string& method, int64_t budget, bool force_first, bool force_last, int active_k,
             std::optional<double> mse_threshold, bool attend_union, std::optional<float> scale,
             const std::string& dtype, int device, uintptr_t stream) {
            DeviceLosaConfig c{batch, heads_q, heads_kv, head_dim, block_size};
            LosaOptions o;
            o.method = take_value(parse_prefix_method(method));
            o.select.budget = budget;
            o.select.force_first = force_first;
            o.select.force_last = force_last;
            o.active_k = active_k;
            o.mse_threshold = mse_threshold;
            o.attend_union = attend_union;
            o.attention.scale = scale;
            o.attention.backend = Backend::cuda;
            return take_value(
                DevicePrefixAttention::create(c, o, device, dtype_named(dtype), reinterpret_cast<void*>(stream)));
          },
          "batch"_a, "heads_q"_a, "heads_kv"_a, "head_dim"_a, "block_size"_a, "method"_a, "budget"_a, "force_first"_a,
          "force_last"_a, "active_k"_a, "mse_threshold"_a.none(), "attend_union"_a, "scale"_a.none(), "dtype"_a,
          "device"_a,
          "stream"_a = 0)
      .def(
          "step",
          [](DevicePrefixAttention& s, const DevicePagedKVCache& cache, const std::vector<int>& seqs, nb::ndarray<> q,
             nb::ndarray<> k, nb::ndarray<> v, nb::ndarray<> out, nb::ndarray<> lse, uintptr_t stream) {
            const Tensor tq = view_of(q, "q"), tk = view_of(k, "k_block"), tv = view_of(v, "v_block"),
                         to = view_of(out, "out"), tl = view_of(lse, "lse");
            nb::gil_scoped_release release;
            check_status(s.step(cache, seqs, tq, tk, tv, to, tl, reinterpret_cast<void*>(stream)));
          },
          "cache"_a, "seqs"_a, "q"_a, "k_block"_a, "v_block"_a, "out"_a, "lse"_a, "stream"_a = 0)
      .def(
          "commit",
          [](DevicePrefixAttention& s, DevicePagedKVCache& cache, const std::vector<int>& seqs, nb::ndarray<> k,
             nb::ndarray<> v, uintptr_t stream) {
            const Tensor tk = view_of(k, "k_block"), tv = view_of(v, "v_block");
            nb::gil_scoped_release release;
            check_status(s.commit(cache, seqs, tk, tv, reinterpret_cast<void*>(stream)));
          },
          "cache"_a, "seqs"_a, "k_block"_a, "v_block"_a, "stream"_a = 0)
      .def("begin_block", [](DevicePrefixAttention& s) { s.begin_block(); })
      .def_prop_ro("steps_in_block", [](const DevicePrefixAttention& s) { return s.steps_in_block(0); })
      .def("o_p", [](const DevicePrefixAttention& s) { return owned_device_array(s.o_p()); })
      .def("l_p", [](const DevicePrefixAttention& s) { return owned_device_array(s.l_p()); })
      .def("q_ref", [](const DevicePrefixAttention& s) { return owned_device_array(s.q_ref()); })
      .def("active_rows", [](const DevicePrefixAttention& s) { return owned_device_array(s.active_rows()); })
      .def("active_counts", [](const DevicePrefixAttention& s) { return owned_device_array(s.active_counts()); });
}

}  // namespace sparsa
