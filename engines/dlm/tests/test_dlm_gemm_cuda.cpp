// The CUDA backend's weight-streaming GEMM (engines/dlm/cuda/skinny_gemm.cu) against an f64
// product of the same bf16 values: every rung the benchmark compares, every row count it takes
// (partial m16 tiles), column counts that are not multiples of the CTA's columns, K with a
// partial 32-wide step, the three output modes; no write outside y; the same bits run to run;
// what it refuses. Skipped without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

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

class DlmGemmCuda : public testing::TestWithParam<Case> {};

TEST_P(DlmGemmCuda, MatchesF64Product) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.n * 131 + c.rows * 7 + c.cols));
  const auto x = random_bf16(c.n * c.cols, rng), w = random_bf16(c.rows * c.cols, rng);
  const bool f32 = c.out != Out::bf16, acc = c.out == Out::f32_accumulate;
  const size_t esize = f32 ? 4 : 2;
  const int64_t count = c.n * c.rows, guard = 64;  // guard elements after y: never written
  // y's start (accumulate) or a sentinel that every output must overwrite (NaN's bits).
  std::vector<float> y0(static_cast<size_t>(count + guard));
  std::normal_distribution<float> d(0.f, 4.f);
  for (auto& v : y0) v = acc ? d(rng) : std::nanf("");
  std::vector<uint8_t> y_init(static_cast<size_t>(count + guard) * esize);
  for (int64_t i = 0; i < count + guard; ++i) {
    if (f32) std::memcpy(&y_init[i * 4], &y0[i], 4);
    else {
      const uint16_t b = 0x7fc1;  // a bf16 NaN
      std::memcpy(&y_init[i * 2], &b, 2);
    }
  }
  // The reference and its bound: inputs exact in bf16, so the only error is the f32 accumulation
  // of K products (a worst-case (K + 8) * 2^-24 * sum |x_k w_k|: the k loop plus the 8 partial
  // sums), then the final add (accumulate: 2^-24 of the result) or the bf16 rounding (2^-8 of it).
  std::vector<double> ref(static_cast<size_t>(count)), bound(static_cast<size_t>(count));
  for (int64_t r = 0; r < c.n; ++r) {
    for (int64_t o = 0; o < c.rows; ++o) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < c.cols; ++k) {
        const double p = double(bf16_to_float(x[r * c.cols + k])) * double(bf16_to_float(w[o * c.cols + k]));
        s += p;
        a += std::fabs(p);
      }
      const int64_t i = r * c.rows + o;
      if (acc) s += y0[i];
      ref[i] = s;
      bound[i] = double(c.cols + 8) * std::ldexp(1.0, -24) * a + std::ldexp(1.0, f32 ? -23 : -8) * std::fabs(s) + 1e-30;
    }
  }

  DeviceBuffer dx(x.size() * 2), dw(w.size() * 2), dy(y_init.size());
  ASSERT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  SkinnyGemm g;
  g.y = dy.p;
  g.y_f32 = f32;
  g.accumulate = acc;
  g.x = dx.p;
  g.w = dw.p;
  g.n = c.n;
  g.rows = c.rows;
  g.cols = c.cols;
  ASSERT_TRUE(skinny_gemm_supported(g));
  std::vector<uint8_t> first;
  for (int v = -1; v < skinny_gemm_variants(); ++v) {  // -1: skinny_gemm(), the engine's rung
    SCOPED_TRACE(v < 0 ? std::string("skinny_gemm") : skinny_gemm_variant_name(v));
    g.overlap_previous = v % 2 != 0;  // both launch kinds (nothing runs before it here)
    ASSERT_EQ(cudaMemcpy(dy.p, y_init.data(), y_init.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(v < 0 ? skinny_gemm(g, nullptr) : skinny_gemm_variant(g, v, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> got(y_init.size());
    ASSERT_EQ(cudaMemcpy(got.data(), dy.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
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
    EXPECT_EQ(std::memcmp(got.data() + count * esize, y_init.data() + count * esize, guard * esize), 0)
        << "written past y";
    if (v < 0) {
      first = got;
      // Deterministic: the same call again gives the same bits.
      ASSERT_EQ(cudaMemcpy(dy.p, y_init.data(), y_init.size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(skinny_gemm(g, nullptr), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got.data(), dy.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(got, first) << "two runs differ";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DlmGemmCuda, testing::ValuesIn(cases()), case_name);

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
