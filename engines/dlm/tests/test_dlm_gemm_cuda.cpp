// The CUDA backend's GEMMs against an f64 product of the same bf16 values: the weight-streaming
// kernel (engines/dlm/cuda/skinny_gemm.cu): every rung the benchmark compares, every row count it takes
// (partial m16 tiles), column counts that are not multiples of the CTA's columns, K with a
// partial 32-wide step, the three output modes; no write outside y; the same bits run to run;
// what it refuses; and cuBLASLt's algorithms for gemm "tuned" (lt_gemm.cpp), every one the
// heuristic lists, over the same cases. Skipped without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/lt_gemm.h"
#include "cuda/skinny_gemm.h"
#include "sparsa/tensor.h"

using namespace sparsa;
using namespace sparsa::dlm;

namespace {

bool have_device() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

enum class Out { bf16, f32, f32_accumulate };
const char* out_name(Out o) { return o == Out::bf16 ? "bf16" : o == Out::f32 ? "f32" : "f32acc"; }

struct Case {
  int64_t n, rows, cols;
  Out out;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "n" + std::to_string(c.n) + "_rows" + std::to_string(c.rows) + "_cols" + std::to_string(c.cols) + "_" +
         out_name(c.out);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  // (rows, cols): one column; a partial 8-column group; a partial CTA of 32; the 8B shapes' K with
  // a partial 32-wide step (4104 = 128 * 32 + 8, 12296 = 384 * 32 + 8).
  const std::pair<int64_t, int64_t> shapes[] = {{1, 8}, {13, 40}, {100, 264}, {1000, 4104}, {40, 12296}};
  for (const auto& [rows, cols] : shapes) {
    for (int64_t n : {1, 5, 16, 17, 33, 64}) {
      for (Out o : {Out::bf16, Out::f32, Out::f32_accumulate}) v.push_back({n, rows, cols, o});
    }
  }
  return v;
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
};

std::vector<uint16_t> random_bf16(int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<uint16_t> v(static_cast<size_t>(count));
  for (auto& x : v) x = float_to_bf16(d(rng));
  return v;
}

// One product's inputs, y's starting bytes, and the f64 reference with its bound.
struct Problem {
  Case c;
  bool f32 = false, acc = false;
  size_t esize = 2;
  int64_t count = 0;
  static constexpr int64_t kGuard = 64;  // guard elements after y: never written
  std::vector<uint16_t> x, w;
  std::vector<uint8_t> y_init;
  std::vector<double> ref, bound;

  // unit: the f32 adds' unit roundoff, 2^-24 for round-to-nearest adds; 2^-23 for a tensor-core
  // accumulation whose adds may truncate (cuBLASLt's kernels; the bound must hold for any of them).
  Problem(const Case& cs, double unit) : c(cs) {
    std::mt19937 rng(static_cast<uint32_t>(c.n * 131 + c.rows * 7 + c.cols));
    x = random_bf16(c.n * c.cols, rng);
    w = random_bf16(c.rows * c.cols, rng);
    f32 = c.out != Out::bf16;
    acc = c.out == Out::f32_accumulate;
    esize = f32 ? 4 : 2;
    count = c.n * c.rows;
    // y's start (accumulate) or a sentinel that every output must overwrite (NaN's bits).
    std::vector<float> y0(static_cast<size_t>(count + kGuard));
    std::normal_distribution<float> d(0.f, 4.f);
    for (auto& v : y0) v = acc ? d(rng) : std::nanf("");
    y_init.resize(static_cast<size_t>(count + kGuard) * esize);
    for (int64_t i = 0; i < count + kGuard; ++i) {
      if (f32) std::memcpy(&y_init[i * 4], &y0[i], 4);
      else {
        const uint16_t b = 0x7fc1;  // a bf16 NaN
        std::memcpy(&y_init[i * 2], &b, 2);
      }
    }
    // The reference and its bound: inputs exact in bf16, so the only error is the f32
    // accumulation of K products (a worst-case (K + 8) * unit * sum |x_k w_k| for any order of
    // the adds: the k loop plus up to 8 partial sums or split-K parts), then the final add
    // (accumulate: 2^-23 of the result) or the bf16 rounding (2^-8 of it).
    ref.resize(static_cast<size_t>(count));
    bound.resize(static_cast<size_t>(count));
    for (int64_t r = 0; r < c.n; ++r) {
      for (int64_t o = 0; o < c.rows; ++o) {
        double sum = 0, a = 0;
        for (int64_t k = 0; k < c.cols; ++k) {
          const double p = double(bf16_to_float(x[r * c.cols + k])) * double(bf16_to_float(w[o * c.cols + k]));
          sum += p;
          a += std::fabs(p);
        }
        const int64_t i = r * c.rows + o;
        if (acc) sum += y0[i];
        ref[i] = sum;
        bound[i] = double(c.cols + 8) * unit * a + std::ldexp(1.0, f32 ? -23 : -8) * std::fabs(sum) + 1e-30;
      }
    }
  }

  // The weight-streaming kernel's parameters for this product over device buffers.
  SkinnyGemm skinny(void* y, const void* dx, const void* dw) const {
    SkinnyGemm g;
    g.y = y;
    g.y_f32 = f32;
    g.accumulate = acc;
    g.x = dx;
    g.w = dw;
    g.n = c.n;
    g.rows = c.rows;
    g.cols = c.cols;
    return g;
  }

  // got: y's bytes read back (y_init's size): every output within its bound, the guard untouched.
  void check(const std::vector<uint8_t>& got) const {
    int bad = 0;
    for (int64_t i = 0; i < count && bad < 5; ++i) {
      double value;
      if (f32) {
        float f;
        std::memcpy(&f, &got[i * 4], 4);
        value = f;
      } else {
        uint16_t b;
        std::memcpy(&b, &got[i * 2], 2);
        value = bf16_to_float(b);
      }
      if (!(std::fabs(value - ref[i]) <= bound[i])) {
        ADD_FAILURE() << "y[" << i / c.rows << ", " << i % c.rows << "] = " << value << ", f64 " << ref[i]
                      << ", bound " << bound[i];
        ++bad;
      }
    }
    EXPECT_EQ(std::memcmp(got.data() + count * esize, y_init.data() + count * esize, kGuard * esize), 0)
        << "written past y";
  }
};

// y's bytes after `call` from y_init.
template <class Call>
std::vector<uint8_t> run_from_init(const Problem& pb, void* dy, Call&& call) {
  std::vector<uint8_t> got(pb.y_init.size());
  EXPECT_EQ(cudaMemcpy(dy, pb.y_init.data(), pb.y_init.size(), cudaMemcpyHostToDevice), cudaSuccess);
  call();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(got.data(), dy, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return got;
}

class DlmGemmCuda : public testing::TestWithParam<Case> {};

TEST_P(DlmGemmCuda, MatchesF64Product) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Problem pb(GetParam(), std::ldexp(1.0, -24));
  DeviceBuffer dx(pb.x.size() * 2), dw(pb.w.size() * 2), dy(pb.y_init.size());
  ASSERT_EQ(cudaMemcpy(dx.p, pb.x.data(), pb.x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.p, pb.w.data(), pb.w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  SkinnyGemm g = pb.skinny(dy.p, dx.p, dw.p);
  ASSERT_TRUE(skinny_gemm_supported(g));
  for (int v = -1; v < skinny_gemm_variants(); ++v) {  // -1: skinny_gemm(), the engine's rung
    SCOPED_TRACE(v < 0 ? std::string("skinny_gemm") : skinny_gemm_variant_name(v));
    g.overlap_previous = v % 2 != 0;  // both launch kinds (nothing runs before it here)
    const auto got = run_from_init(pb, dy.p, [&] {
      EXPECT_EQ(v < 0 ? skinny_gemm(g, nullptr) : skinny_gemm_variant(g, v, nullptr), cudaSuccess);
    });
    pb.check(got);
    if (v < 0) {
      // Deterministic: the same call again gives the same bits.
      EXPECT_EQ(run_from_init(pb, dy.p, [&] { EXPECT_EQ(skinny_gemm(g, nullptr), cudaSuccess); }), got)
          << "two runs differ";
    }
  }
}

// gemm "tuned": every algorithm cuBLASLt's heuristic lists is within the bound, and so is the
// weight-streaming kernel (above), so whichever the timing picks is; the tuned call runs the
// chosen one (the same bits as running it directly) and gives the same bits again; offered the
// weight-streaming kernel or not, a shape keeps a choice of its own.
class DlmLtGemmCuda : public testing::TestWithParam<Case> {};

TEST_P(DlmLtGemmCuda, EveryCandidateMatchesF64Product) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Problem pb(GetParam(), std::ldexp(1.0, -23));
  const Case& c = pb.c;
  DeviceBuffer dx(pb.x.size() * 2), dw(pb.w.size() * 2), dy(pb.y_init.size()), ws(size_t{32} << 20);
  ASSERT_EQ(cudaMemcpy(dx.p, pb.x.data(), pb.x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.p, pb.w.data(), pb.w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  LtGemm lt;
  ASSERT_EQ(lt.init(ws.p, size_t{32} << 20), CUBLAS_STATUS_SUCCESS);
  const LtShape shape =
      LtGemm::shape(c.n, c.rows, c.cols, pb.f32 ? CUDA_R_32F : CUDA_R_16BF, pb.acc, dy.p, dx.p, dw.p);
  SkinnyGemm g = pb.skinny(dy.p, dx.p, dw.p);
  g.overlap_previous = true;  // as the engine launches it
  ASSERT_TRUE(skinny_gemm_supported(g));
  std::vector<LtCandidate> list;
  ASSERT_EQ(lt.candidates(shape, 16, &list), CUBLAS_STATUS_SUCCESS);
  ASSERT_FALSE(list.empty());
  for (const LtCandidate& cand : list) {
    SCOPED_TRACE(cand.describe());
    pb.check(run_from_init(pb, dy.p, [&] { EXPECT_EQ(lt.run(shape, cand, dy.p, dx.p, dw.p, nullptr), CUBLAS_STATUS_SUCCESS); }));
  }
  for (const bool offer : {false, true}) {
    const SkinnyGemm* skinny = offer ? &g : nullptr;
    const auto tuned = run_from_init(pb, dy.p, [&] {
      EXPECT_EQ(lt.tuned(shape, dy.p, dx.p, dw.p, nullptr, skinny), CUBLAS_STATUS_SUCCESS);
    });
    const LtCandidate* chosen = lt.chosen(shape, offer);
    ASSERT_NE(chosen, nullptr);
    EXPECT_TRUE(offer || !chosen->skinny) << "the weight-streaming kernel chosen without being offered";
    SCOPED_TRACE(std::string(offer ? "offered the weight-streaming kernel; " : "") + "chosen: " + chosen->describe());
    pb.check(tuned);
    EXPECT_EQ(run_from_init(pb, dy.p, [&] {
                EXPECT_EQ(lt.run(shape, *chosen, dy.p, dx.p, dw.p, nullptr, skinny), CUBLAS_STATUS_SUCCESS);
              }),
              tuned)
        << "the tuned call is not its chosen kernel";
    EXPECT_EQ(run_from_init(pb, dy.p, [&] {
                EXPECT_EQ(lt.tuned(shape, dy.p, dx.p, dw.p, nullptr, skinny), CUBLAS_STATUS_SUCCESS);
              }),
              tuned)
        << "two tuned runs differ";
  }
  LtCandidate skinny_only;
  skinny_only.skinny = true;
  EXPECT_EQ(lt.run(shape, skinny_only, dy.p, dx.p, dw.p, nullptr, nullptr), CUBLAS_STATUS_INVALID_VALUE)
      << "the weight-streaming candidate without its product";
}

INSTANTIATE_TEST_SUITE_P(Shapes, DlmGemmCuda, testing::ValuesIn(cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Shapes, DlmLtGemmCuda, testing::ValuesIn(cases()), case_name);

TEST(DlmGemmCudaRefuses, WhatItCannotTake) {
  // Support is decided on the host, from the shapes and the addresses alone.
  alignas(16) static uint16_t buf[64];
  SkinnyGemm g;
  g.y = buf;
  g.x = buf;
  g.w = buf;
  g.n = 16;
  g.rows = 16;
  g.cols = 64;
  EXPECT_TRUE(skinny_gemm_supported(g));
  SkinnyGemm b = g;
  b.n = 0;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "no rows";
  b = g;
  b.n = kSkinnyMaxRows + 1;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "more rows than four m16 tiles";
  b = g;
  b.cols = 60;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "K not a multiple of 8";
  b = g;
  b.x = buf + 1;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "x not 16-byte aligned";
  b = g;
  b.w = buf + 4;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "w not 16-byte aligned";
  b = g;
  b.accumulate = true;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "accumulate into bf16";
  b = g;
  b.y = nullptr;
  EXPECT_FALSE(skinny_gemm_supported(b)) << "no output";
  if (have_device()) {
    b = g;
    b.cols = 60;
    EXPECT_EQ(skinny_gemm(b, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(skinny_gemm_variant(g, skinny_gemm_variants(), nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a refusal launches nothing and leaves no error";
  }
}

// A chain as the engine runs it: the second product reads the first one's output and is a
// programmatic dependent launch, so its CTAs start (and load weights) while the first still
// runs; it must still see all of the first's output. Each round first poisons that output with
// NaN, so a read before the wait would show. Shapes large enough that the first product runs
// for tens of microseconds.
TEST(DlmGemmCudaChain, DependentLaunchSeesThePreviousOutput) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 16, k0 = 4096, r1 = 2048, r2 = 1000;
  std::mt19937 rng(11);
  const auto x = random_bf16(n * k0, rng), w1 = random_bf16(r1 * k0, rng), w2 = random_bf16(r2 * r1, rng);
  DeviceBuffer dx(x.size() * 2), dw1(w1.size() * 2), dw2(w2.size() * 2), dy1(n * r1 * 2), dy2(n * r2 * 4);
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw1.p, w1.data(), w1.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw2.p, w2.data(), w2.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  // The copies went on the legacy stream and may still be landing (pageable sources); the kernels
  // below run on a non-blocking stream, which does not wait for it.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  SkinnyGemm a;
  a.y = dy1.p;
  a.x = dx.p;
  a.w = dw1.p;
  a.n = n;
  a.rows = r1;
  a.cols = k0;
  SkinnyGemm b;
  b.y = dy2.p;
  b.y_f32 = true;
  b.x = dy1.p;
  b.w = dw2.p;
  b.n = n;
  b.rows = r2;
  b.cols = r1;
  b.overlap_previous = true;
  std::vector<uint16_t> y1(static_cast<size_t>(n * r1));
  std::vector<float> y2(static_cast<size_t>(n * r2)), first;
  for (int round = 0; round < 20; ++round) {
    ASSERT_EQ(cudaMemsetAsync(dy1.p, 0xff, n * r1 * 2, stream), cudaSuccess);  // NaN in bf16
    ASSERT_EQ(skinny_gemm(a, stream), cudaSuccess);
    ASSERT_EQ(skinny_gemm(b, stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(y2.data(), dy2.p, y2.size() * 4, cudaMemcpyDeviceToHost, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (round == 0) {
      first = y2;
      continue;
    }
    ASSERT_EQ(std::memcmp(y2.data(), first.data(), y2.size() * 4), 0) << "round " << round << " differs";
  }
  // The first round against f64 over the first product's own output.
  ASSERT_EQ(cudaMemcpy(y1.data(), dy1.p, y1.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < r2; o += 37) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < r1; ++k) {
        const double p = double(bf16_to_float(y1[r * r1 + k])) * double(bf16_to_float(w2[o * r1 + k]));
        s += p;
        mag += std::fabs(p);
      }
      ASSERT_LE(std::fabs(first[r * r2 + o] - s), double(r1 + 8) * std::ldexp(1.0, -24) * mag + 1e-30)
          << "y2[" << r << ", " << o << "]";
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace
