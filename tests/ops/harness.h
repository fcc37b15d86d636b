// test-ops: one harness that checks every backend against cpu_ref, and cpu_ref
// against independent f64 oracles written here from the definitions (docs/testing.md).
//
// A case is a name, a printable parameter string and a seeded `prepare()` that
// builds the inputs and returns how to run the op on a backend into caller-provided
// (guarded, strided) outputs, the oracle, the error bound and the FLOPs/bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "sparsa/attention.h"

namespace ops {

using sparsa::Backend;
using sparsa::DType;
using sparsa::Status;
using sparsa::Tensor;

// ---- seeded randomness (our own generator: identical streams on every platform) ----
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {}
  uint64_t next();                       // splitmix64
  double uniform();                      // [0, 1)
  int64_t below(int64_t n);              // [0, n)
  int64_t range(int64_t lo, int64_t hi);  // [lo, hi]
  double normal();                       // N(0, 1), Box-Muller
  template <class T>
  T pick(std::initializer_list<T> options) {
    return options.begin()[below(static_cast<int64_t>(options.size()))];
  }

 private:
  uint64_t state_;
};

// ---- layouts: where a logical [b, h, s, d] (or [b, h, s]) tensor lives in its buffer ----
enum class Layout {
  bhsd,  // contiguous
  bshd,  // sequence-major, heads interleaved ([b, seq, heads, d] storage)
  pad,   // bhsd with padded rows (odd row stride) and gaps between heads and batches
};
const char* layout_name(Layout layout);
// Strides (elements) of `shape` (3 or 4 dims) in the layout, and the span in elements.
std::vector<int64_t> layout_strides(Layout layout, const std::vector<int64_t>& shape);
int64_t layout_span(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides);

// Decode one stored element to f64 (our own f16/bf16 decoding, independent of the library's).
double decode(const void* base, DType dtype, int64_t offset);
double half_ulp(DType dtype);  // relative half-ulp of a storage dtype: 2^-24, 2^-11, 2^-8

// An input tensor in a strided layout. Gaps between elements hold NaN, so a backend
// that reads padding poisons its result and fails.
struct HostTensor {
  std::vector<std::byte> bytes;
  Tensor view;
  std::vector<int64_t> shape;
  double at(std::initializer_list<int64_t> index) const { return decode(view.data, view.dtype, view.offset(index)); }
};
// From logical row-major f32 values (rounded to `dtype` when stored).
HostTensor make_tensor(DType dtype, const std::vector<int64_t>& shape, Layout layout, const std::vector<float>& values);
std::vector<float> normal_values(Rng& rng, int64_t n, double amplitude);

// An output inside a larger buffer: guard bytes before and after and in every gap of
// the strided layout hold a position-dependent sentinel; the elements are pre-filled
// with a NaN payload that no computation produces.
class GuardedOutput {
 public:
  GuardedOutput(DType dtype, const std::vector<int64_t>& shape, Layout layout);
  const Tensor& view() const { return view_; }
  // "" when every guard byte is intact and every element was written; else the reason.
  std::string check(const char* what) const;
  // Logical row-major values as f64.
  std::vector<double> values() const;

 private:
  std::vector<std::byte> bytes_;
  std::vector<uint8_t> is_element_;  // per byte of bytes_
  std::vector<int64_t> shape_;
  Tensor view_;
  size_t guard_ = 0;
};

// Results in logical order: o [b, h, l, d], lse [b, h, l].
struct Results {
  std::vector<double> o, lse;
};

// Error bounds (see docs/testing.md and bound() in harness.cpp for the reasoning).
struct Bound {
  double o;    // on |got - want| / max|want O|
  double lse;  // on |got - want| / max(1, |want LSE|)
};
// sides: 1 when one result is an unrounded f64 oracle, 2 when both are rounded outputs.
// roundings: how many times the op rounds O to its storage dtype on the way (1; 2 for
// attention-then-merge pipelines).
// logit_bound: an upper bound on |scale * <q, k>| over the case (0 for merge).
Bound bound(DType out_dtype, int roundings, int sides, double logit_bound);

struct Shape {
  int64_t batch = 0, heads = 0, len = 0, head_dim = 0;
};

// "" when got matches want within the bound; else the reason (error, bound, where).
// NaN in either never passes; a want LSE of -inf requires got LSE = -inf exactly and
// O = 0 exactly in both.
std::string compare(const Shape& shape, const Results& want, const Results& got, const Bound& b, double* o_err,
                    double* lse_err);

// What a case hands the runner.
struct Prepared {
  Shape shape;
  DType out_dtype = DType::f32;
  Layout out_layout = Layout::bhsd;
  int roundings = 1;
  double logit_bound = 0;  // scale * max|q_i| * max|k_j| (Cauchy-Schwarz bound on every logit)
  // Run the op on a backend into out [b, h, l, d] (dtype out_dtype) and lse f32 [b, h, l].
  std::function<Status(Backend backend, const Tensor& out, const Tensor& lse)> run;
  std::function<Results()> oracle;  // the independent f64 oracle (may be empty)
  const char* oracle_name = "";
  double flops = 0, bytes = 0;      // for perf mode
  std::shared_ptr<void> keep;       // owns the inputs the closures point at
};

struct Case {
  std::string op;      // "dense", "block_sparse", ...
  std::string params;  // "dense(b=2,hq=8,...)": unique, printable, a regex filter target
  bool perf_only = false;
  std::function<Prepared()> prepare;
};

// All cases; `seed` drives the fuzzed part, `full` adds more and larger ones.
std::vector<Case> make_cases(uint64_t seed, bool full, bool perf);

// ---- oracles (oracle.cpp): f64, plain loops, straight from the definitions ----
// Attention over the keys j with mask[b, h, i, j] != 0 (mask empty: every key visible).
Results oracle_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                         const std::vector<uint8_t>& mask);
// The merge formula (docs/architecture.md, Contracts) in f64.
Results oracle_merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2);

}  // namespace ops
