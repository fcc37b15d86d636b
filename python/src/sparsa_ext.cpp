// The one binding file (only it knows Python): turns DLPack arrays (numpy, torch, cupy, jax)
// into the core's Tensor views without copying, and the core's Status into Python
// exceptions carrying its message. Output allocation by array type lives in the
// Python package (sparsa/__init__.py); this file only sees views.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "core/backends.h"
#include "sparsa/attention.h"
#include "sparsa/ba_att.h"
#include "sparsa/index.h"
#include "sparsa/io.h"
#include "sparsa/kv_cache.h"
#include "sparsa/layout.h"
#include "sparsa/losa.h"
#include "sparsa/quest.h"
#include "sparsa/llsa.h"
#include "sparsa/oracle.h"
#include "sparsa/workload.h"
#include "sparsa/xattention.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sparsa {
namespace {

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

// The message as valid UTF-8 (Python decodes exception text as UTF-8; a path or a file's
// bytes quoted in a message may not be): each byte of an invalid sequence becomes \xNN.
std::string utf8_message(const std::string& m) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(m.size());
  for (size_t i = 0; i < m.size();) {
    const auto c = static_cast<unsigned char>(m[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = n > 0 && i + n <= m.size() && !(n == 2 && c < 0xc2);
    for (size_t j = 1; ok && j < n; ++j) ok = (static_cast<unsigned char>(m[i + j]) >> 6) == 0x2;
    if (ok) {
      out.append(m, i, n);
      i += n;
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
      ++i;
    }
  }
  return out;
}

[[noreturn]] void raise(const Status& s) {
  const std::string m = utf8_message(s.message());
  switch (s.code()) {
    case StatusCode::unsupported_dtype: throw nb::type_error(m.c_str());
    case StatusCode::io_error: throw std::runtime_error(m);  // RuntimeError
    case StatusCode::unsupported: throw nb::builtin_exception(nb::exception_type::runtime_error, m.c_str());
    default: throw nb::value_error(m.c_str());
  }
}
void check(const Status& s) {
  if (!s.ok()) raise(s);
}
template <class T>
T take(Result<T> r) {
  if (!r.ok()) raise(r.status());
  return std::move(r).value();
}

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  const char* kind = dt.code == uint8_t(nb::dlpack::dtype_code::Float)    ? "float"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::Int)    ? "int"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::UInt)   ? "uint"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                     : dt.code == uint8_t(nb::dlpack::dtype_code::Bool)   ? "bool"
                                                                          : "complex";
  return std::string(kind) + std::to_string(dt.bits);
}

template <class A>
Tensor to_tensor(const A& a, const char* name) {
  Tensor t;
  const nb::dlpack::dtype dt = a.dtype();
  if (dt.lanes != 1) throw nb::type_error((std::string(name) + ": vector dtypes are not supported").c_str());
  if (dt == nb::dtype<float>()) {
    t.dtype = DType::f32;
  } else if (dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 16) {
    t.dtype = DType::f16;
  } else if (dt.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16) {
    t.dtype = DType::bf16;
  } else if (dt == nb::dtype<int32_t>()) {
    t.dtype = DType::i32;
  } else {
    throw nb::type_error((std::string(name) + ": unsupported dtype " + dlpack_dtype_name(dt) +
                          " (attention tensors: float32, float16 or bfloat16; plan arrays: int32)")
                             .c_str());
  }
  if (a.ndim() > static_cast<size_t>(kMaxDims)) {
    throw nb::value_error((std::string(name) + ": more than " + std::to_string(kMaxDims) + " dimensions").c_str());
  }
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.strides[d] = static_cast<int64_t>(a.stride(d));
  }
  if (a.device_type() == nb::device::cpu::value) {
    t.device = Device{DeviceType::cpu, 0};
  } else if (a.device_type() == nb::device::cuda::value) {
    t.device = Device{DeviceType::cuda, a.device_id()};
  } else {
    throw nb::value_error((std::string(name) + ": arrays on device type " + std::to_string(a.device_type()) +
                           " are not supported (cpu or cuda)")
                              .c_str());
  }
  return t;
}

std::optional<Tensor> to_optional(const std::optional<InArray>& a, const char* name) {
  if (!a) return std::nullopt;
  return to_tensor(*a, name);
}

// "auto": the cuda backend for arrays on a CUDA device, else cpu.
Backend resolve_backend(const std::string& backend, const Tensor& q) {
  if (backend == "auto") return q.device.type == DeviceType::cuda ? Backend::cuda : Backend::cpu;
  return take(parse_backend(backend));
}

// `stream`: a cudaStream_t as an integer (the Python package passes torch's or cupy's current
// stream of the inputs' device; 0 is the legacy default stream).
AttentionOptions make_options(std::optional<float> scale, const std::string& backend, bool check_finite,
                              int num_threads, const Tensor& q, uintptr_t stream = 0) {
  AttentionOptions o;
  o.stream = reinterpret_cast<void*>(stream);
  o.scale = scale;
  o.backend = resolve_backend(backend, q);
  o.check_finite = check_finite;
  o.num_threads = num_threads;
  return o;
}

// A numpy array that owns a HostArray.
nb::ndarray<nb::numpy> to_numpy(HostArray&& array) {
  auto* owned = new HostArray(std::move(array));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<HostArray*>(p); });
  std::vector<size_t> shape(owned->shape().begin(), owned->shape().end());
  nb::dlpack::dtype dt;
  switch (owned->dtype()) {
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::i32: dt = nb::dtype<int32_t>(); break;
    case DType::f16: dt = {uint8_t(nb::dlpack::dtype_code::Float), 16, 1}; break;
    // numpy has no bfloat16 (an array of that dtype arrives as a 0-d object): the raw bits as
    // uint16, which the package views as bf16 in the caller's framework (_host_result).
    case DType::bf16: dt = nb::dtype<uint16_t>(); break;
  }
  return nb::ndarray<nb::numpy>(owned->data(), shape.size(), shape.data(), owner, nullptr, dt);
}

BlockIndex make_index(const InArray& counts, const InArray& indices, const std::optional<InArray>& perm_q,
                      const std::optional<InArray>& perm_kv, int block_q, int block_kv) {
  BlockIndex ix;
  ix.block_q = block_q;
  ix.block_kv = block_kv;
  ix.counts = to_tensor(counts, "index.counts");
  ix.indices = to_tensor(indices, "index.indices");
  if (ix.counts.ndim != 3) {
    throw nb::value_error(("index.counts: expected 3 dimensions [batch, heads_q, num_q_blocks], got " +
                           ix.counts.shape_string()).c_str());
  }
  ix.num_q_blocks = ix.counts.shape[2];
  if (auto t = to_optional(perm_q, "index.perm_q")) ix.perm_q = *t;
  if (auto t = to_optional(perm_kv, "index.perm_kv")) ix.perm_kv = *t;
  return ix;
}

// A DLPack array over device memory that owns its DeviceArray (the Python package hands it to
// torch.from_dlpack / cupy.from_dlpack, zero copy).
nb::ndarray<> to_device_ndarray(DeviceArray&& array) {
  auto* owned = new DeviceArray(std::move(array));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<DeviceArray*>(p); });
  std::vector<size_t> shape(owned->shape().begin(), owned->shape().end());
  const nb::dlpack::dtype dt = nb::dtype<int32_t>();  // plans are int32
  return nb::ndarray<>(owned->data(), shape.size(), shape.data(), owner, nullptr, dt, nb::device::cuda::value,
                       owned->device().id);
}

// A selector's plan as a dict of numpy arrays (perm_q / perm_kv None when absent); a plan built
// on a cuda device gives DLPack device arrays and on_device = True.
nb::dict plan_dict(BlockIndexBuffer&& plan) {
  nb::dict d;
  if (plan.on_device()) {
    d["block_q"] = plan.block_q;
    d["block_kv"] = plan.block_kv;
    d["on_device"] = true;
    d["counts"] = to_device_ndarray(std::move(plan.device_counts));
    d["indices"] = to_device_ndarray(std::move(plan.device_indices));
    d["perm_q"] = plan.device_perm_q.empty() ? nb::none()
                                             : nb::object(nb::cast(to_device_ndarray(std::move(plan.device_perm_q))));
    d["perm_kv"] = plan.device_perm_kv.empty()
                       ? nb::none()
                       : nb::object(nb::cast(to_device_ndarray(std::move(plan.device_perm_kv))));
    return d;
  }
  d["on_device"] = false;
  d["block_q"] = plan.block_q;
  d["block_kv"] = plan.block_kv;
  d["counts"] = to_numpy(std::move(plan.counts));
  d["indices"] = to_numpy(std::move(plan.indices));
  d["perm_q"] = plan.perm_q.empty() ? nb::none() : nb::object(nb::cast(to_numpy(std::move(plan.perm_q))));
  d["perm_kv"] = plan.perm_kv.empty() ? nb::none() : nb::object(nb::cast(to_numpy(std::move(plan.perm_kv))));
  return d;
}

// budget_kind: "top_kappa", "density" or "mass" (the Python keywords top_kappa, density, tau).
Budget make_budget(const std::string& kind, double value) {
  if (kind == "top_kappa") return {BudgetKind::top_kappa, value};
  if (kind == "density") return Budget::density(value);
  if (kind == "mass") return Budget::mass(value);
  throw nb::value_error(("budget: expected top_kappa, density or mass, got '" + kind + "'").c_str());
}

// The metrics read host memory element by element: refuse device arrays before they do.
template <class A>
Tensor host_tensor(const A& a, const char* name) {
  Tensor t = to_tensor(a, name);
  if (t.device.type != DeviceType::cpu) {
    throw nb::value_error((std::string(name) + ": expected an array on cpu, got one on " +
                           device_name(t.device)).c_str());
  }
  return t;
}

}  // namespace

void bind_dlm(nb::module_& m);  // dlm_bindings.cpp: the DLM engine's Model and Tokenizer
void bind_losa_device(nb::module_& m);  // losa_device_bindings.cpp: the device paged cache and LoSA

NB_MODULE(_sparsa, m) {
  m.doc() = "sparsa core (C++): attention executors on DLPack arrays, zero copy";
  bind_dlm(m);
  bind_losa_device(m);

  m.def(
      "dense",
      [](InArray q, InArray k, InArray v, OutArray out, OutArray lse, std::optional<float> scale,
         const std::string& backend, bool check_finite, int num_threads, uintptr_t stream, const std::string& mask) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        AttentionOptions o = make_options(scale, backend, check_finite, num_threads, tq, stream);
        o.mask = take(parse_mask(mask));
        nb::gil_scoped_release release;
        check(dense(tq, tk, tv, to, tl, o));
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "scale"_a = nb::none(), "backend"_a = "auto",
      "check_finite"_a = false, "num_threads"_a = 0, "stream"_a = 0, "mask"_a = "none",
      "Dense attention into caller-provided out [b, hq, lq, d] and lse f32 [b, hq, lq]; mask as parse_mask reads it.");

  m.def(
      "dense_varlen",
      [](InArray q, InArray k, InArray v, InArray cu_seqlens_q, InArray cu_seqlens_kv, OutArray out, OutArray lse,
         std::optional<float> scale, const std::string& backend, bool check_finite, int num_threads, uintptr_t stream,
         const std::string& mask) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const Tensor cq = to_tensor(cu_seqlens_q, "cu_seqlens_q"), ckv = to_tensor(cu_seqlens_kv, "cu_seqlens_kv");
        const Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        AttentionOptions o = make_options(scale, backend, check_finite, num_threads, tq, stream);
        o.mask = take(parse_mask(mask));
        nb::gil_scoped_release release;
        check(dense_varlen(tq, tk, tv, cq, ckv, to, tl, o));
      },
      "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_kv"_a, "out"_a, "lse"_a, "scale"_a = nb::none(),
      "backend"_a = "auto", "check_finite"_a = false, "num_threads"_a = 0, "stream"_a = 0, "mask"_a = "none",
      "Variable-length dense attention: q [total_q, hq, d], k/v [total_kv, hkv, d], int32 offsets; out like q, "
      "lse f32 [hq, total_q].");

  m.def(
      "masked_full_plan",
      [](int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv, int block_q, int block_kv,
         const std::string& mask) {
        const Mask parsed = take(parse_mask(mask));
        for (auto [name, value] : {std::pair{"batch", batch}, std::pair{"heads_q", heads_q},
                                   std::pair{"len_q", len_q}, std::pair{"len_kv", len_kv},
                                   std::pair{"block_q", int64_t{block_q}}, std::pair{"block_kv", int64_t{block_kv}}}) {
          if (value <= 0) throw nb::value_error((std::string(name) + ": expected > 0, got " + std::to_string(value)).c_str());
        }
        return plan_dict(masked_full_plan(batch, heads_q, len_q, len_kv, block_q, block_kv, parsed));
      },
      "batch"_a, "heads_q"_a, "len_q"_a, "len_kv"_a, "block_q"_a, "block_kv"_a, "mask"_a,
      "The plan of every key block the mask leaves a visible pair in, per query block.");

  m.def(
      "mask_visible",
      [](const std::string& mask, int64_t i, int64_t j, int64_t len_q, int64_t len_kv) {
        return mask_visible(take(parse_mask(mask)), i, j, len_q, len_kv);
      },
      "mask"_a, "i"_a, "j"_a, "len_q"_a, "len_kv"_a, "Whether query i sees key j under the mask.");
  m.def(
      "mask_string", [](const std::string& mask) { return mask_string(take(parse_mask(mask))); }, "mask"_a,
      "The canonical text of a mask (checks it).");

  m.def(
      "block_sparse",
      [](InArray q, InArray k, InArray v, InArray counts, InArray indices, std::optional<InArray> perm_q,
         std::optional<InArray> perm_kv, int block_q, int block_kv, OutArray out, OutArray lse,
         std::optional<float> scale, const std::string& backend, bool check_finite, int num_threads,
         bool check_index, uintptr_t stream, const std::string& mask) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        BlockIndex ix = make_index(counts, indices, perm_q, perm_kv, block_q, block_kv);
        if (tk.ndim == 4) ix.num_kv_blocks = (tk.shape[2] + block_kv - 1) / std::max(block_kv, 1);
        AttentionOptions o = make_options(scale, backend, check_finite, num_threads, tq, stream);
        o.check_index = check_index;
        o.mask = take(parse_mask(mask));
        nb::gil_scoped_release release;
        check(block_sparse(tq, tk, tv, ix, to, tl, o));
      },
      "q"_a, "k"_a, "v"_a, "counts"_a, "indices"_a, "perm_q"_a.none(), "perm_kv"_a.none(), "block_q"_a,
      "block_kv"_a, "out"_a, "lse"_a, "scale"_a = nb::none(), "backend"_a = "auto", "check_finite"_a = false,
      "num_threads"_a = 0, "check_index"_a = true, "stream"_a = 0, "mask"_a = "none",
      "Block-sparse attention over a BlockIndex into caller-provided out and lse.");

  m.def(
      "block_sparse_varlen",
      [](InArray q, InArray k, InArray v, InArray cu_seqlens_q, InArray cu_seqlens_kv, InArray counts,
         InArray indices, std::optional<InArray> perm_q, std::optional<InArray> perm_kv, int block_q, int block_kv,
         OutArray out, OutArray lse, std::optional<float> scale, const std::string& backend, bool check_finite,
         int num_threads, uintptr_t stream, const std::string& mask) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const Tensor cq = to_tensor(cu_seqlens_q, "cu_seqlens_q"), ckv = to_tensor(cu_seqlens_kv, "cu_seqlens_kv");
        const Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        BlockIndex ix = make_index(counts, indices, perm_q, perm_kv, block_q, block_kv);
        // The key blocks of the longest sequence (host offsets; on a device the call is refused).
        if (ckv.device.type == DeviceType::cpu && ckv.dtype == DType::i32 && ckv.ndim == 1 && ckv.strides[0] == 1) {
          int64_t longest = 0;
          for (int64_t s = 0; s + 1 < ckv.shape[0]; ++s)
            longest = std::max<int64_t>(longest, ckv.ptr<int32_t>()[s + 1] - ckv.ptr<int32_t>()[s]);
          ix.num_kv_blocks = (longest + block_kv - 1) / std::max(block_kv, 1);
        }
        AttentionOptions o = make_options(scale, backend, check_finite, num_threads, tq, stream);
        o.mask = take(parse_mask(mask));
        nb::gil_scoped_release release;
        check(block_sparse_varlen(tq, tk, tv, cq, ckv, ix, to, tl, o));
      },
      "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_kv"_a, "counts"_a, "indices"_a, "perm_q"_a.none(),
      "perm_kv"_a.none(), "block_q"_a, "block_kv"_a, "out"_a, "lse"_a, "scale"_a = nb::none(), "backend"_a = "auto",
      "check_finite"_a = false, "num_threads"_a = 0, "stream"_a = 0, "mask"_a = "none",
      "Variable-length block-sparse attention (the index's batch dimension is the sequence).");

  m.def(
      "merge",
      [](InArray o1, InArray lse1, InArray o2, InArray lse2, OutArray out, OutArray lse, const std::string& backend,
         uintptr_t stream) {
        const Tensor a = to_tensor(o1, "o1"), la = to_tensor(lse1, "lse1"), b = to_tensor(o2, "o2"),
                     lb = to_tensor(lse2, "lse2"), to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        const Backend be = resolve_backend(backend, a);
        nb::gil_scoped_release release;
        check(merge(a, la, b, lb, to, tl, be, reinterpret_cast<void*>(stream)));
      },
      "o1"_a, "lse1"_a, "o2"_a, "lse2"_a, "out"_a, "lse"_a, "backend"_a = "auto", "stream"_a = 0,
      "Merge two partial results over disjoint key sets by log-sum-exp.");

  // ---- LLSA ----
  auto llsa_options = [](int block, int topk, int levels, bool enrich, bool dedupe, std::optional<float> scale,
                         const std::string& backend, int num_threads, bool check_finite, const Tensor& q,
                         uintptr_t stream = 0) {
    LlsaOptions o;
    o.stream = reinterpret_cast<void*>(stream);
    o.block = block;
    o.topk = topk;
    o.levels = levels;
    o.enrich = enrich;
    o.dedupe = dedupe;
    o.scale = scale;
    o.backend = resolve_backend(backend, q);
    o.num_threads = num_threads;
    o.check_finite = check_finite;
    return o;
  };
  m.def(
      "llsa_forward",
      [llsa_options](InArray q, InArray k, InArray v, OutArray out, OutArray lse, int block, int topk, int levels,
                     bool enrich, bool dedupe, std::optional<float> scale, const std::string& backend,
                     int num_threads, bool check_finite, uintptr_t stream) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse");
        const LlsaOptions o = llsa_options(block, topk, levels, enrich, dedupe, scale, backend, num_threads,
                                           check_finite, tq, stream);
        nb::gil_scoped_release release;
        check(llsa_forward(tq, tk, tv, to, tl, o));
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "block"_a = 16, "topk"_a = 8, "levels"_a = -1, "enrich"_a = true,
      "dedupe"_a = false, "scale"_a = nb::none(), "backend"_a = "auto", "num_threads"_a = 0,
      "check_finite"_a = false, "stream"_a = 0,
      "LLSA forward (O and LSE) into caller-provided outputs; on cuda the plan is built on the device.");
  m.def(
      "llsa_backward",
      [llsa_options](InArray q, InArray k, InArray v, InArray out, InArray lse, InArray d_o, OutArray dq,
                     OutArray dk, OutArray dv, int block, int topk, int levels, bool enrich, bool dedupe,
                     std::optional<float> scale, const std::string& backend, int num_threads, uintptr_t stream) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const Tensor to = to_tensor(out, "out"), tl = to_tensor(lse, "lse"), tdo = to_tensor(d_o, "d_o");
        const Tensor tdq = to_tensor(dq, "dq"), tdk = to_tensor(dk, "dk"), tdv = to_tensor(dv, "dv");
        const LlsaOptions o =
            llsa_options(block, topk, levels, enrich, dedupe, scale, backend, num_threads, false, tq, stream);
        nb::gil_scoped_release release;
        check(llsa_backward(tq, tk, tv, to, tl, tdo, tdq, tdk, tdv, o));
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "d_o"_a, "dq"_a, "dk"_a, "dv"_a, "block"_a = 16, "topk"_a = 8,
      "levels"_a = -1, "enrich"_a = true, "dedupe"_a = false, "scale"_a = nb::none(), "backend"_a = "auto",
      "num_threads"_a = 0, "stream"_a = 0, "LLSA backward: dq, dk, dv given the forward's out, lse and d_o.");
  m.def(
      "llsa_plan",
      [llsa_options](InArray q, InArray k, int block, int topk, int levels, bool enrich, bool dedupe,
                     int64_t max_rows, uintptr_t stream) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        const LlsaOptions o =
            llsa_options(block, topk, levels, enrich, dedupe, std::nullopt, "auto", 0, false, tq, stream);
        LlsaPlan plan = take(llsa_plan(tq, tk, o));
        BlockIndexBuffer fine = plan.fine_index();
        nb::dict d;
        d["block"] = plan.block;
        d["topk"] = plan.topk;
        d["levels"] = plan.levels;
        d["level_len"] = plan.level_len;
        d["keys_per_query"] = plan.mean_keys_per_query();
        d["text"] = plan.to_string(0, 0, max_rows);
        d["counts"] = to_numpy(std::move(fine.counts));
        d["indices"] = to_numpy(std::move(fine.indices));
        return d;
      },
      "q"_a, "k"_a, "block"_a = 16, "topk"_a = 8, "levels"_a = -1, "enrich"_a = true, "dedupe"_a = false,
      "max_rows"_a = 8, "stream"_a = 0, "The LLSA selection plan: levels, keys per query, the fine BlockIndex, a printout.");

  // ---- block selectors: BA-Att and XAttention (CPU or cuda) ----
  auto ba_att_options = [](int block_q, int block_kv, bool sort_q, bool sort_k, int64_t sort_window,
                           bool compensate, const std::string& compensation, float beta,
                           const std::string& budget_kind, double budget_value, std::optional<float> scale,
                           const std::string& backend, int num_threads, bool check_finite, const Tensor& q,
                           uintptr_t stream) {
    BaAttOptions o;
    o.stream = reinterpret_cast<void*>(stream);
    o.block_q = block_q;
    o.block_kv = block_kv;
    o.sort_q = sort_q;
    o.sort_k = sort_k;
    o.sort_window = sort_window;
    o.compensate = compensate;
    o.compensation = take(parse_compensation(compensation));
    o.beta = beta;
    o.budget = make_budget(budget_kind, budget_value);
    o.scale = scale;
    o.backend = resolve_backend(backend, q);
    o.num_threads = num_threads;
    o.check_finite = check_finite;
    return o;
  };
  m.def(
      "ba_att_plan",
      [ba_att_options](InArray q, InArray k, int block_q, int block_kv, bool sort_q, bool sort_k, int64_t sort_window,
                       bool compensate, const std::string& compensation, float beta, const std::string& budget_kind,
                       double budget_value, std::optional<float> scale, const std::string& backend, int num_threads,
                       bool check_finite, uintptr_t stream, const std::string& mask, bool mask_aware) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        BaAttOptions o = ba_att_options(block_q, block_kv, sort_q, sort_k, sort_window, compensate, compensation,
                                        beta, budget_kind, budget_value, scale, backend, num_threads, check_finite, tq,
                                        stream);
        o.mask = take(parse_mask(mask));
        o.mask_aware = mask_aware;
        Result<BlockIndexBuffer> plan = [&] {
          nb::gil_scoped_release release;
          return ba_att_plan(tq, tk, o);
        }();
        return plan_dict(take(std::move(plan)));
      },
      "q"_a, "k"_a, "block_q"_a, "block_kv"_a, "sort_q"_a, "sort_k"_a, "sort_window"_a, "compensate"_a,
      "compensation"_a, "beta"_a, "budget_kind"_a, "budget_value"_a, "scale"_a.none(), "backend"_a,
      "num_threads"_a, "check_finite"_a, "stream"_a = 0, "mask"_a = "none", "mask_aware"_a = false,
      "The BA-Att plan (Algorithm 1) as a dict of numpy arrays (DLPack device arrays with backend cuda); with "
      "mask_aware the selection sees mask.");
  m.def(
      "ba_att_scores",
      [ba_att_options](InArray q, InArray k, int block_q, int block_kv, bool sort_q, bool sort_k, int64_t sort_window,
                       bool compensate, const std::string& compensation, float beta, std::optional<float> scale,
                       const std::string& backend, int num_threads, bool check_finite, uintptr_t stream) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        const BaAttOptions o = ba_att_options(block_q, block_kv, sort_q, sort_k, sort_window, compensate, compensation,
                                              beta, "density", 1.0, scale, backend, num_threads, check_finite, tq,
                                              stream);
        Result<BaAttScores> r = [&] {
          nb::gil_scoped_release release;
          return ba_att_scores(tq, tk, o);
        }();
        BaAttScores s = take(std::move(r));
        nb::dict d;
        d["block_q"] = s.block_q;
        d["block_kv"] = s.block_kv;
        d["logits"] = to_numpy(std::move(s.logits));
        d["perm_q"] = s.perm_q.empty() ? nb::none() : nb::object(nb::cast(to_numpy(std::move(s.perm_q))));
        d["perm_kv"] = s.perm_kv.empty() ? nb::none() : nb::object(nb::cast(to_numpy(std::move(s.perm_kv))));
        return d;
      },
      "q"_a, "k"_a, "block_q"_a, "block_kv"_a, "sort_q"_a, "sort_k"_a, "sort_window"_a, "compensate"_a,
      "compensation"_a, "beta"_a, "scale"_a.none(), "backend"_a, "num_threads"_a, "check_finite"_a,
      "stream"_a = 0, "BA-Att steps 1-3: block logits (compensated) and the norm-sort permutations.");

  auto xattention_options = [](int block_q, int block_kv, int stride, const std::string& budget_kind,
                               double budget_value, bool force_first, bool force_diagonal,
                               std::optional<float> scale, const std::string& backend, int num_threads,
                               bool check_finite, const Tensor& q, uintptr_t stream) {
    XAttentionOptions o;
    o.stream = reinterpret_cast<void*>(stream);
    o.block_q = block_q;
    o.block_kv = block_kv;
    o.stride = stride;
    o.budget = make_budget(budget_kind, budget_value);
    o.force_first = force_first;
    o.force_diagonal = force_diagonal;
    o.scale = scale;
    o.backend = resolve_backend(backend, q);
    o.num_threads = num_threads;
    o.check_finite = check_finite;
    return o;
  };
  m.def(
      "xattention_plan",
      [xattention_options](InArray q, InArray k, int block_q, int block_kv, int stride, const std::string& budget_kind,
                           double budget_value, bool force_first, bool force_diagonal, std::optional<float> scale,
                           const std::string& backend, int num_threads, bool check_finite, const std::string& mask,
                           bool mask_aware, uintptr_t stream) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        XAttentionOptions o = xattention_options(block_q, block_kv, stride, budget_kind, budget_value, force_first,
                                                 force_diagonal, scale, backend, num_threads, check_finite, tq,
                                                 stream);
        o.mask = take(parse_mask(mask));
        o.mask_aware = mask_aware;
        Result<BlockIndexBuffer> plan = [&] {
          nb::gil_scoped_release release;
          return xattention_plan(tq, tk, o);
        }();
        return plan_dict(take(std::move(plan)));
      },
      "q"_a, "k"_a, "block_q"_a, "block_kv"_a, "stride"_a, "budget_kind"_a, "budget_value"_a, "force_first"_a,
      "force_diagonal"_a, "scale"_a.none(), "backend"_a, "num_threads"_a, "check_finite"_a, "mask"_a = "none",
      "mask_aware"_a = false, "stream"_a = 0,
      "The XAttention plan as a dict of numpy arrays (DLPack device arrays with backend cuda; no permutations); "
      "with mask_aware the selection sees mask.");
  m.def(
      "xattention_scores",
      [xattention_options](InArray q, InArray k, int block_q, int block_kv, int stride, std::optional<float> scale,
                           const std::string& backend, int num_threads, bool check_finite, uintptr_t stream) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        const XAttentionOptions o = xattention_options(block_q, block_kv, stride, "mass", 0.9, true, true, scale,
                                                       backend, num_threads, check_finite, tq, stream);
        Result<HostArray> r = [&] {
          nb::gil_scoped_release release;
          return xattention_scores(tq, tk, o);
        }();
        return to_numpy(take(std::move(r)));
      },
      "q"_a, "k"_a, "block_q"_a, "block_kv"_a, "stride"_a, "scale"_a.none(), "backend"_a, "num_threads"_a,
      "check_finite"_a, "stream"_a = 0,
      "XAttention block masses X f32 [batch, heads_q, num_q_blocks, num_kv_blocks] (host memory).");

  // ---- oracle metrics (evaluation: dense O(L^2 d) per head) ----
  m.def(
      "oracle_blocks",
      [](InArray q, InArray k, int block_q, int block_kv, std::optional<InArray> perm_q,
         std::optional<InArray> perm_kv, std::optional<float> scale, const std::string& backend, int num_threads) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        BlockPartition part;
        part.block_q = block_q;
        part.block_kv = block_kv;
        if (perm_q) part.perm_q = host_tensor(*perm_q, "partition.perm_q");
        if (perm_kv) part.perm_kv = host_tensor(*perm_kv, "partition.perm_kv");
        OracleOptions o;
        o.scale = scale;
        o.backend = resolve_backend(backend, tq);
        o.num_threads = num_threads;
        Result<OracleBlocks> r = [&] {
          nb::gil_scoped_release release;
          return oracle_blocks(tq, tk, part, o);
        }();
        OracleBlocks ob = take(std::move(r));
        nb::dict d;
        d["block_q"] = ob.block_q;
        d["block_kv"] = ob.block_kv;
        d["mass"] = to_numpy(std::move(ob.mass));
        d["logit_max"] = to_numpy(std::move(ob.logit_max));
        d["logit_min"] = to_numpy(std::move(ob.logit_min));
        return d;
      },
      "q"_a, "k"_a, "block_q"_a, "block_kv"_a, "perm_q"_a.none(), "perm_kv"_a.none(), "scale"_a.none(),
      "backend"_a, "num_threads"_a, "Dense block mass (Eq. 3) and logit range per block pair of a partition.");
  m.def(
      "deviation_bound",
      [](InArray q, InArray k, int block_q, int block_kv, std::optional<InArray> perm_q,
         std::optional<InArray> perm_kv, InArray mass, InArray logit_max, InArray logit_min, int oracle_block_q,
         int oracle_block_kv, std::optional<float> scale, const std::string& backend, int num_threads) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k");
        BlockPartition part;
        part.block_q = block_q;
        part.block_kv = block_kv;
        if (perm_q) part.perm_q = host_tensor(*perm_q, "partition.perm_q");
        if (perm_kv) part.perm_kv = host_tensor(*perm_kv, "partition.perm_kv");
        // The core indexes the oracle's three arrays by the mass's shape: they must agree.
        const Tensor tm = host_tensor(mass, "oracle.mass");
        OracleBlocks ob;
        ob.block_q = oracle_block_q;
        ob.block_kv = oracle_block_kv;
        const std::pair<const char*, const InArray*> arrays[] = {
            {"oracle.mass", &mass}, {"oracle.logit_max", &logit_max}, {"oracle.logit_min", &logit_min}};
        HostArray* owned[] = {&ob.mass, &ob.logit_max, &ob.logit_min};
        for (int i = 0; i < 3; ++i) {
          const Tensor t = host_tensor(*arrays[i].second, arrays[i].first);
          if (t.ndim != 4 || t.dtype != DType::f32 || t.shape_vector() != tm.shape_vector()) {
            throw nb::value_error((std::string(arrays[i].first) +
                                   ": expected f32 [batch, heads_q, num_q_blocks, num_kv_blocks] equal in shape to "
                                   "oracle.mass " + tm.shape_string() + ", got " + dtype_name(t.dtype) + " " +
                                   t.shape_string()).c_str());
          }
          *owned[i] = HostArray::copy_of(t);
        }
        ob.num_q_blocks = tm.shape[2];
        ob.num_kv_blocks = tm.shape[3];
        OracleOptions o;
        o.scale = scale;
        o.backend = resolve_backend(backend, tq);
        o.num_threads = num_threads;
        Result<DeviationBound> r = [&] {
          nb::gil_scoped_release release;
          return deviation_bound(tq, tk, part, ob, o);
        }();
        DeviationBound db = take(std::move(r));
        nb::dict d;
        d["bound"] = to_numpy(std::move(db.bound));
        d["deviation"] = to_numpy(std::move(db.deviation));
        d["pearson_per_head"] = db.pearson_per_head;
        d["pearson_overall"] = db.pearson_overall;
        d["violations"] = db.violations;
        d["mean_bound"] = db.mean_bound;
        d["mean_deviation"] = db.mean_deviation;
        return d;
      },
      "q"_a, "k"_a, "block_q"_a, "block_kv"_a, "perm_q"_a.none(), "perm_kv"_a.none(), "mass"_a, "logit_max"_a,
      "logit_min"_a, "oracle_block_q"_a, "oracle_block_kv"_a, "scale"_a.none(), "backend"_a, "num_threads"_a,
      "BA-Att Eq. 8: the bound U on the token-logit deviation from the block logit, against the observed one.");
  m.def(
      "mass_recall",
      [](InArray counts, InArray indices, int block_q, int block_kv, InArray mass, int oracle_block_q,
         int oracle_block_kv) {
        const Tensor tm = host_tensor(mass, "oracle.mass");
        if (tm.ndim != 4 || tm.dtype != DType::f32) {
          throw nb::value_error(("oracle.mass: expected f32 [batch, heads_q, num_q_blocks, num_kv_blocks], got " +
                                 std::string(dtype_name(tm.dtype)) + " " + tm.shape_string()).c_str());
        }
        if (block_q != oracle_block_q || block_kv != oracle_block_kv) {
          throw nb::value_error(("plan: blocks " + std::to_string(block_q) + "x" + std::to_string(block_kv) +
                                 " differ from the oracle's " + std::to_string(oracle_block_q) + "x" +
                                 std::to_string(oracle_block_kv) + "; compute the oracle on the plan's partition")
                                    .c_str());
        }
        BlockIndex ix = make_index(counts, indices, std::nullopt, std::nullopt, block_q, block_kv);
        OracleBlocks ob;
        ob.block_q = oracle_block_q;
        ob.block_kv = oracle_block_kv;
        ob.num_q_blocks = ix.num_q_blocks = tm.shape[2];
        ob.num_kv_blocks = ix.num_kv_blocks = tm.shape[3];
        // The core reads the plan's arrays unchecked: validate them against the oracle's grid.
        if (block_q > 0 && block_kv > 0) {
          check(validate_block_index(ix, tm.shape[0], tm.shape[1], tm.shape[1], ob.num_q_blocks * block_q,
                                     ob.num_kv_blocks * block_kv));
        }
        ob.mass = HostArray::copy_of(tm);
        return take(mass_recall(ix, ob));
      },
      "counts"_a, "indices"_a, "block_q"_a, "block_kv"_a, "mass"_a, "oracle_block_q"_a, "oracle_block_kv"_a,
      "Mean over (batch, head, query block) of the oracle mass a plan keeps.");
  m.def(
      "mass_recall_from_lse",
      [](InArray lse_plan, InArray lse_dense) {
        // One declaration per argument: checks run (and name arguments) in order.
        const Tensor plan_lse = host_tensor(lse_plan, "lse_plan");
        const Tensor dense_lse = host_tensor(lse_dense, "lse_dense");
        return take(mass_recall_from_lse(plan_lse, dense_lse));
      },
      "lse_plan"_a, "lse_dense"_a, "mean_i exp(lse_plan_i - lse_dense_i): the softmax mass a plan's keys hold.");
  m.def(
      "relative_error",
      [](InArray out, InArray reference) {
        const Tensor t_out = host_tensor(out, "out");
        const Tensor t_reference = host_tensor(reference, "reference");
        return take(relative_error(t_out, t_reference));
      },
      "out"_a, "reference"_a, "||out - reference||_F / ||reference||_F (f64 sums).");

  // ---- block-diffusion decoding: the paged prefix cache, QUEST pages, LoSA state ----
  nb::class_<PagedKVCache>(m, "PagedKVCache",
                           "The paged prefix K/V cache of block-diffusion decoding (one sequence, float32, CPU).\n\n"
                           "PagedKVCache(heads_kv, head_dim, page_size=16). append(k, v) copies f32 [1, heads_kv, n, "
                           "head_dim] keys and values in and updates each page's key min / max / sum (QUEST's "
                           "metadata); page p holds tokens [p * page_size, (p + 1) * page_size), the last page may "
                           "be partial. length, num_pages, page_size, heads_kv, head_dim; keys() / values() return "
                           "numpy copies [1, heads_kv, length, head_dim]. quest_plan and LosaState read it.")
      .def(
          "__init__",
          [](PagedKVCache* self, int64_t heads_kv, int64_t head_dim, int page_size) {
            KVCacheConfig c;
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            c.page_size = page_size;
            PagedKVCache cache = take(PagedKVCache::create(c));
            new (self) PagedKVCache(std::move(cache));
          },
          "heads_kv"_a, "head_dim"_a, "page_size"_a = 16)
      .def(
          "append",
          [](PagedKVCache& cache, InArray k, InArray v) {
            const Tensor tk = to_tensor(k, "k");
            const Tensor tv = to_tensor(v, "v");
            check(cache.append(tk, tv));
          },
          "k"_a, "v"_a, "Append f32 [1, heads_kv, n, head_dim] keys and values (copied into the cache).")
      .def_prop_ro("heads_kv", &PagedKVCache::heads_kv)
      .def_prop_ro("head_dim", &PagedKVCache::head_dim)
      .def_prop_ro("page_size", &PagedKVCache::page_size)
      .def_prop_ro("length", &PagedKVCache::length)
      .def_prop_ro("num_pages", &PagedKVCache::num_pages)
      .def("keys", [](const PagedKVCache& c) { return to_numpy(c.length() ? HostArray::copy_of(c.keys())
                                                                          : HostArray(DType::f32, {1, c.heads_kv(), 0, c.head_dim()})); })
      .def("values", [](const PagedKVCache& c) { return to_numpy(c.length() ? HostArray::copy_of(c.values())
                                                                            : HostArray(DType::f32, {1, c.heads_kv(), 0, c.head_dim()})); });

  auto page_options = [](int64_t budget, const std::string& selector, const std::string& group, bool force_first,
                         bool force_last) {
    PageSelectOptions o;
    o.selector = take(parse_page_selector(selector));
    if (group == "per_head") {
      o.group = GroupPolicy::per_head;
    } else if (group == "shared") {
      o.group = GroupPolicy::shared;
    } else {
      throw nb::value_error(("group: expected per_head or shared, got '" + group + "'").c_str());
    }
    o.budget = budget;
    o.force_first = force_first;
    o.force_last = force_last;
    return o;
  };
  m.def(
      "quest_plan",
      [page_options](InArray q, const PagedKVCache& cache, int64_t budget, const std::string& selector,
                     const std::string& group, bool force_first, bool force_last, int num_threads) {
        const Tensor tq = to_tensor(q, "q");
        const PageSelectOptions o = page_options(budget, selector, group, force_first, force_last);
        check(validate(o, cache.page_size()));
        PagePlan plan = take(select_pages(tq, cache, o, num_threads));
        HostArray counts(DType::i32, {plan.heads_q, plan.rows});
        HostArray pages(DType::i32, {plan.heads_q, plan.rows, plan.capacity});
        std::copy(plan.counts.begin(), plan.counts.end(), counts.ptr<int32_t>());
        std::copy(plan.pages.begin(), plan.pages.end(), pages.ptr<int32_t>());
        return nb::make_tuple(to_numpy(std::move(counts)), to_numpy(std::move(pages)));
      },
      "q"_a, "cache"_a, "budget"_a, "selector"_a, "group"_a, "force_first"_a, "force_last"_a, "num_threads"_a,
      "Pages per (query head, row) of q f32 [1, heads_q, rows, d] over a PagedKVCache: (counts, pages).");

  m.def(
      "quest_attention",
      [page_options](InArray q, InArray k, InArray v, int64_t budget, int page_size, const std::string& selector,
                     const std::string& group, bool force_first, bool force_last, bool attend_union,
                     std::optional<float> scale, const std::string& backend, int num_threads) {
        const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k, "k"), tv = to_tensor(v, "v");
        const PageSelectOptions s = page_options(budget, selector, group, force_first, force_last);
        PagedAttentionOptions o;
        o.attention = make_options(scale, backend, false, num_threads, tq);
        o.attend_union = attend_union;
        Result<QuestOutput> r = [&] {
          nb::gil_scoped_release release;
          return quest_attention(tq, tk, tv, s, o, page_size);
        }();
        QuestOutput out = take(std::move(r));
        return nb::make_tuple(to_numpy(std::move(out.attention.out)), to_numpy(std::move(out.attention.lse)),
                              out.density, out.pages_loaded);
      },
      "q"_a, "k"_a, "v"_a, "budget"_a, "page_size"_a, "selector"_a, "group"_a, "force_first"_a, "force_last"_a,
      "attend_union"_a, "scale"_a.none(), "backend"_a, "num_threads"_a,
      "QUEST attention of q over k, v paged per batch element: (out, lse, density, pages_loaded).");

  nb::class_<PrefixAttention>(m, "PrefixAttention")
      .def(
          "__init__",
          [page_options](PrefixAttention* self, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t block_size,
                         const std::string& method, int64_t budget, const std::string& selector,
                         const std::string& group, bool force_first, bool force_last, int active_k,
                         std::optional<double> mse_threshold, bool attend_union, std::optional<float> scale,
                         const std::string& backend, int num_threads, bool check_finite) {
            LosaConfig c;
            c.heads_q = heads_q;
            c.heads_kv = heads_kv;
            c.head_dim = head_dim;
            c.block_size = block_size;
            LosaOptions o;
            o.method = take(parse_prefix_method(method));
            o.select = page_options(budget, selector, group, force_first, force_last);
            o.active_k = active_k;
            o.mse_threshold = mse_threshold;
            o.attend_union = attend_union;
            o.attention.scale = scale;
            o.attention.backend = backend == "auto" ? Backend::cpu : take(parse_backend(backend));
            o.attention.num_threads = num_threads;
            o.attention.check_finite = check_finite;
            PrefixAttention state = take(PrefixAttention::create(c, o));
            new (self) PrefixAttention(std::move(state));
          },
          "heads_q"_a, "heads_kv"_a, "head_dim"_a, "block_size"_a, "method"_a, "budget"_a, "selector"_a, "group"_a,
          "force_first"_a, "force_last"_a, "active_k"_a, "mse_threshold"_a.none(), "attend_union"_a,
          "scale"_a.none(), "backend"_a, "num_threads"_a, "check_finite"_a)
      .def(
          "step",
          [](PrefixAttention& state, const PagedKVCache& cache, InArray q, InArray k_block, InArray v_block,
             OutArray out, OutArray lse) {
            const Tensor tq = to_tensor(q, "q"), tk = to_tensor(k_block, "k_block"), tv = to_tensor(v_block, "v_block");
            const Tensor to = host_tensor(out, "out"), tl = host_tensor(lse, "lse");
            StepStats s;
            check(state.step(cache, tq, tk, tv, to, tl, &s));
            nb::dict d;
            d["block"] = s.block;
            d["step"] = s.step;
            d["dense_prefix"] = s.dense_prefix;
            d["recomputed"] = s.recomputed;
            d["mse"] = s.mse;
            d["prefix_pages"] = s.prefix_pages;
            d["pages_loaded"] = s.pages_loaded;
            d["tokens_loaded"] = s.tokens_loaded;
            d["pages_attended"] = s.pages_attended;
            d["loaded"] = s.loaded;
            // The selector's pages for the recomputed rows (sparse steps): [heads_q, len(recomputed), capacity].
            HostArray plan_counts(DType::i32, {s.plan.heads_q, s.plan.rows});
            HostArray plan_pages(DType::i32, {s.plan.heads_q, s.plan.rows, s.plan.capacity});
            std::copy(s.plan.counts.begin(), s.plan.counts.end(), plan_counts.ptr<int32_t>());
            std::copy(s.plan.pages.begin(), s.plan.pages.end(), plan_pages.ptr<int32_t>());
            d["plan_counts"] = to_numpy(std::move(plan_counts));
            d["plan_pages"] = to_numpy(std::move(plan_pages));
            d["select_ms"] = s.select_ms;
            d["prefix_ms"] = s.prefix_ms;
            d["block_ms"] = s.block_ms;
            d["total_ms"] = s.total_ms;
            return d;
          },
          "cache"_a, "q"_a, "k_block"_a, "v_block"_a, "out"_a, "lse"_a)
      .def(
          "commit",
          [](PrefixAttention& state, PagedKVCache& cache, InArray k_block, InArray v_block) {
            const Tensor tk = to_tensor(k_block, "k_block");
            const Tensor tv = to_tensor(v_block, "v_block");
            check(state.commit(cache, tk, tv));
          },
          "cache"_a, "k_block"_a, "v_block"_a)
      .def("begin_block", &PrefixAttention::begin_block)
      .def_prop_ro("steps_in_block", &PrefixAttention::steps_in_block)
      .def_prop_ro("blocks_committed", &PrefixAttention::blocks_committed)
      .def_prop_ro("o_p", [](const PrefixAttention& s) { return nb::cast(to_numpy(HostArray::copy_of(s.o_p().view()))); })
      .def_prop_ro("l_p", [](const PrefixAttention& s) { return nb::cast(to_numpy(HostArray::copy_of(s.l_p().view()))); })
      .def_prop_ro("q_ref", [](const PrefixAttention& s) { return nb::cast(to_numpy(HostArray::copy_of(s.q_ref().view()))); });

  m.def(
      "block_index_density",
      [](InArray counts, InArray indices, int block_q, int block_kv, int64_t len_q, int64_t len_kv) {
        BlockIndex ix = make_index(counts, indices, std::nullopt, std::nullopt, block_q, block_kv);
        ix.num_kv_blocks = (len_kv + block_kv - 1) / std::max(block_kv, 1);
        const int64_t b = ix.counts.shape[0], h = ix.counts.shape[1];
        check(validate_block_index(ix, b, h, h, len_q, len_kv));
        return block_index_density(ix, len_q, len_kv);
      },
      "counts"_a, "indices"_a, "block_q"_a, "block_kv"_a, "len_q"_a, "len_kv"_a,
      "Fraction of (query, key) token pairs a BlockIndex visits.");

  m.def(
      "read_tensor", [](const std::string& path) { return to_numpy(take(read_tensor(path))); }, "path"_a,
      "Read a .npy or .safetensors[:name] file into a numpy array.");
  m.def(
      "read_safetensors",
      [](const std::string& path) {
        // The library's reader (fuzzed: tests/fuzz/fuzz_safetensors) checks the whole file first.
        std::vector<NamedArray> entries = take(read_safetensors(path));
        nb::dict arrays, metadata;
        for (NamedArray& entry : entries) arrays[entry.name.c_str()] = to_numpy(std::move(entry.array));
        for (const auto& [key, value] : take(read_safetensors_metadata(path))) metadata[key.c_str()] = value;
        return nb::make_tuple(arrays, metadata);
      },
      "path"_a, "Every entry of a .safetensors file ({name: numpy array}) and its __metadata__ ({key: string}).");
  m.def(
      "write_safetensors",
      [](const std::string& path, const std::vector<std::string>& names, const std::vector<InArray>& arrays,
         const std::vector<std::string>& metadata_keys, const std::vector<std::string>& metadata_values) {
        if (names.size() != arrays.size() || metadata_keys.size() != metadata_values.size()) {
          throw nb::value_error("write_safetensors: names and arrays (and metadata keys and values) pair up");
        }
        std::vector<std::pair<std::string, Tensor>> entries;
        for (size_t i = 0; i < names.size(); ++i) entries.emplace_back(names[i], to_tensor(arrays[i], "array"));
        std::vector<std::pair<std::string, std::string>> metadata;
        for (size_t i = 0; i < metadata_keys.size(); ++i) metadata.emplace_back(metadata_keys[i], metadata_values[i]);
        // The library's writer: a temporary file, then a rename (a failed write leaves the path as it was).
        check(write_safetensors(path, entries, metadata));
      },
      "path"_a, "names"_a, "arrays"_a, "metadata_keys"_a, "metadata_values"_a,
      "Write CPU arrays as the entries of a .safetensors file, with __metadata__ strings.");
  m.def(
      "write_tensor",
      [](const std::string& path, InArray a) { check(write_tensor(path, to_tensor(a, "array"))); }, "path"_a,
      "array"_a, "Write a CPU array to .npy or .safetensors.");

  m.def(
      "generate_workload",
      [](uint64_t seed, int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t len_q, int64_t len_kv,
         int64_t head_dim, const std::string& dtype) {
        WorkloadConfig c;
        c.seed = seed;
        c.batch = batch;
        c.heads_q = heads_q;
        c.heads_kv = heads_kv;
        c.len_q = len_q;
        c.len_kv = len_kv;
        c.head_dim = head_dim;
        c.dtype = take(parse_dtype(dtype));
        Workload w = take(generate_workload(c));
        return nb::make_tuple(to_numpy(std::move(w.q)), to_numpy(std::move(w.k)), to_numpy(std::move(w.v)));
      },
      "seed"_a = 0, "batch"_a = 1, "heads_q"_a = 8, "heads_kv"_a = 2, "len_q"_a = 4096, "len_kv"_a = 4096,
      "head_dim"_a = 64, "dtype"_a = "f32", "The seeded default workload (q, k, v) as numpy arrays.");

  m.def("version", [] { return std::string(SPARSA_VERSION); });
  m.def("backends", [] {
    std::vector<std::string> names;
    for (Backend b : {Backend::cpu_ref, Backend::cpu, Backend::cuda})
      if (backend_available(b)) names.push_back(backend_name(b));
    return names;
  });
  // The backends compiled into this build, whether or not they can run here (cuda without a device).
  m.def("compiled_backends", [] {
    std::vector<std::string> names{backend_name(Backend::cpu_ref), backend_name(Backend::cpu)};
#if defined(SPARSA_WITH_CUDA) && SPARSA_WITH_CUDA
    names.push_back(backend_name(Backend::cuda));
#endif
    return names;
  });
  m.def(
      "token_permutation",
      [](int64_t height, int64_t width, const std::string& layout) {
        const std::vector<int32_t> perm = take(layout_permutation(height, width, take(parse_token_layout(layout))));
        HostArray out(DType::i32, {static_cast<int64_t>(perm.size())});
        std::copy(perm.begin(), perm.end(), out.ptr<int32_t>());
        return to_numpy(std::move(out));
      },
      "height"_a, "width"_a, "layout"_a = "z_order",
      "perm[p] = row-major index of the token at position p of the layout (row_major, z_order, hilbert).");
  m.def("backend_status", [](const std::string& name) {
    return backend_status(take(parse_backend(name))).message();
  });
  m.def("cuda_device_count", [] { return cuda::device_count(); });
}

}  // namespace sparsa
