// LLSA's cuda backend (selection, forward, backward) against cpu_ref (the specification).
//
// Runs where a CUDA device is visible (scripts/gpu-check); elsewhere the device cases skip and only
// the argument contracts are checked.
//
// What is compared, and the bounds:
//  - Plans. The device pools in f32 in the CPU's child order (the same pooled values bit for bit)
//    but sums the d products of a score in another order (fmaf), so a near-tie may fall the other
//    way. Each device row is checked to be a valid top-K of its candidates (those of its own
//    parent picks): every kept token scores (f64, from the f32 pools) at least the best dropped one
//    minus the f32 dot product's error bound d * 2^-24 * sum |q_c k_c| (twice: either score may
//    err); counts are min(K, candidates), picks ascending and distinct. Against the CPU's plan
//    (same inputs) at least 98% of the rows must be identical: a wrong selection is not a near-tie.
//  - Outputs. The reference is cpu_ref (f64) on the exact values of the bf16/f16 inputs, with the
//    DEVICE's plan (the selection is not differentiated; both then visit the same keys). As for the
//    dense executor, a "naive" half-precision LLSA is the yardstick: it rounds what the device
//    rounds — the pooled keys and values (the tensor cores read them in the input dtype), the
//    logits, the probabilities (and dS in the backward) and the results — to the input dtype, with
//    f32 accumulation. The device's relative L2 error must be at most twice the naive one.
//  - LSE. It is a smooth maximum of the logits, so its error is at most the largest logit error:
//    the pooled key's rounding (unit roundoff u of the dtype) plus f32 accumulation (d * 2^-24),
//    times scale * sum |q_c k_c|, plus 2^-18 (1 + |lse|) for ex2.approx / log2f.
//  - Determinism. The backward runs twice: dq, dk and dv equal bit for bit (no float atomics).
//  - A plan passed from the host gives the device-built plan's output bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "methods/llsa/internal.h"
#include "sparsa/llsa.h"
#include "test_util.h"

#if defined(SPARSA_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace sparsa;

TEST(CudaLlsa, RefusesHostTensorsAndReportsAvailability) {
  HostArray q(DType::bf16, {1, 1, 32, 64}), out(DType::bf16, {1, 1, 32, 64}), lse(DType::f32, {1, 1, 32});
  LlsaOptions o;
  o.backend = Backend::cuda;
  const Status st = llsa_forward(q.view(), q.view(), q.view(), out.view(), lse.view(), o);
  ASSERT_FALSE(st.ok());
  if (!backend_available(Backend::cuda)) {
    EXPECT_EQ(st.code(), StatusCode::unsupported) << st.to_string();
  } else {
    EXPECT_NE(st.message().find("q:"), std::string::npos) << st.to_string();
  }
  // The allocating form returns host arrays: never on cuda.
  EXPECT_FALSE(llsa_forward(q.view(), q.view(), q.view(), o).ok());
}

#if defined(SPARSA_WITH_CUDA)

namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 16)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
};

struct Case {
  std::string name;
  DType dtype = DType::bf16;
  int64_t batch = 1, heads_q = 2, heads_kv = 2, len = 1000, head_dim = 64;
  int block = 16, topk = 8, levels = -1;
  bool enrich = true, dedupe = false;
  bool backward = true;
  int64_t seq_pad = 0;  // extra elements between token rows (strided views)
  float amplitude = 1.0f;
  uint32_t seed = 1;
  int rung = 0;         // forward rung: 0 the library's choice, else forced (SPARSA_LLSA_FORWARD_RUNG=rung)
  int expect_rung = 0;  // the rung the forward must have run (0: unchecked)
  int expect_fine_keys = 0;  // the keys of the forward's fine softmax steps by default, 16 or 64 (0: unchecked)
  bool expect_wide = false;  // SPARSA_LLSA_FINE_STEP=64 must run 64-key steps
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

double unit_roundoff(DType t) { return t == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11); }
float round_to(DType t, float x) { return t == DType::bf16 ? bf16_to_float(float_to_bf16(x)) : half_to_float(float_to_half(x)); }
uint16_t encode(DType t, float x) { return t == DType::bf16 ? float_to_bf16(x) : float_to_half(x); }
float decode(DType t, uint16_t x) { return t == DType::bf16 ? bf16_to_float(x) : half_to_float(x); }

// Values of a [batch, heads, len, d] tensor, rounded to the dtype.
std::vector<float> values(const Case& c, int64_t heads, uint32_t seed, float amplitude) {
  HostArray a = sparsa_test::randn({c.batch, heads, c.len, c.head_dim}, seed);
  std::vector<float> x(a.ptr<float>(), a.ptr<float>() + a.numel());
  for (float& e : x) e = round_to(c.dtype, e * amplitude);
  return x;
}

// A device copy (strided by seq_pad) of dense host values, or an uninitialised one (poisoned).
struct DeviceTensor {
  std::unique_ptr<DeviceBuffer> buf;
  Tensor t;
  int64_t row = 0;
  DeviceTensor(const Case& c, int64_t heads, const std::vector<float>* x, DType dtype) {
    const int64_t D = c.head_dim;
    row = D + c.seq_pad;
    const int64_t rows = c.batch * heads * c.len;
    buf = std::make_unique<DeviceBuffer>(std::max<int64_t>(rows * row, 1) * 2);
    std::vector<uint16_t> h(static_cast<size_t>(rows * row), 0x7fc1);
    if (x)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < D; ++e) h[r * row + e] = encode(dtype, (*x)[r * D + e]);
    cudaMemcpy(buf->ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
    t.data = buf->ptr;
    t.dtype = dtype;
    t.device = Device{DeviceType::cuda, 0};
    t.ndim = 4;
    const int64_t shape[4] = {c.batch, heads, c.len, D}, strides[4] = {heads * c.len * row, c.len * row, row, 1};
    std::copy(shape, shape + 4, t.shape);
    std::copy(strides, strides + 4, t.strides);
  }
  std::vector<float> download(const Case& c) const {
    const int64_t D = c.head_dim, rows = t.shape[0] * t.shape[1] * t.shape[2];
    std::vector<uint16_t> h(static_cast<size_t>(rows * row));
    cudaMemcpy(h.data(), buf->ptr, h.size() * 2, cudaMemcpyDeviceToHost);
    std::vector<float> x(static_cast<size_t>(rows * D));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < D; ++e) x[r * D + e] = decode(t.dtype, h[r * row + e]);
    return x;
  }
  std::vector<uint16_t> raw() const {
    std::vector<uint16_t> h(buf->bytes / 2);
    cudaMemcpy(h.data(), buf->ptr, buf->bytes, cudaMemcpyDeviceToHost);
    return h;
  }
};

struct DeviceLse {
  DeviceBuffer buf;
  Tensor t;
  explicit DeviceLse(const Case& c) : buf(std::max<int64_t>(c.batch * c.heads_q * c.len, 1) * 4) {
    t = Tensor::contiguous(buf.ptr, DType::f32, {c.batch, c.heads_q, c.len}, Device{DeviceType::cuda, 0});
  }
  std::vector<float> download() const {
    std::vector<float> x(t.numel());
    cudaMemcpy(x.data(), buf.ptr, x.size() * 4, cudaMemcpyDeviceToHost);
    return x;
  }
};

Tensor host_view(std::vector<float>& x, const Case& c, int64_t heads) {
  return Tensor::contiguous(x.data(), DType::f32, {c.batch, heads, c.len, c.head_dim});
}

// The f32 pyramid of one [len, d] slice, levels 0..L (the CPU's mean_pool).
std::vector<std::vector<float>> pyramid(const float* x, const LlsaPlan& plan, int64_t d) {
  std::vector<std::vector<float>> lv(plan.levels + 1);
  lv[0].assign(x, x + plan.len * d);
  for (int l = 1; l <= plan.levels; ++l) {
    lv[l].resize(plan.level_len[l] * d);
    llsa_detail::mean_pool(lv[l - 1].data(), plan.level_len[l - 1], d, plan.block, lv[l].data());
  }
  return lv;
}

// Every device row is a valid top-K of its candidates (see the header).
void check_plan_valid(const Case& c, const LlsaPlan& gp, const std::vector<float>& q, const std::vector<float>& k) {
  const int64_t D = c.head_dim, group = c.heads_q / c.heads_kv;
  int bad = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h) {
      const auto pq = pyramid(&q[((b * c.heads_q + h) * c.len) * D], gp, D);
      const auto pk = pyramid(&k[((b * c.heads_kv + h / group) * c.len) * D], gp, D);
      for (int l = gp.levels; l >= 1; --l) {
        const int64_t n = gp.level_len[l];
        for (int64_t i = 0; i < n; ++i) {
          std::vector<int64_t> cand;
          if (l == gp.levels) {
            for (int64_t j = 0; j < n; ++j) cand.push_back(j);
          } else {
            const int64_t parent = i / gp.block;
            for (int s = 0; s < gp.pick_count(l + 1, b, h, parent); ++s)
              for (int64_t j = int64_t{gp.pick(l + 1, b, h, parent, s)} * gp.block;
                   j < std::min<int64_t>((gp.pick(l + 1, b, h, parent, s) + 1) * int64_t{gp.block}, n); ++j)
                cand.push_back(j);
          }
          const int keep = static_cast<int>(std::min<int64_t>(gp.topk, cand.size()));
          const int count = gp.pick_count(l, b, h, i);
          if (count != keep) {
            ADD_FAILURE() << "level " << l << " row " << i << ": count " << count << ", expected " << keep;
            return;
          }
          auto score = [&](int64_t j, double* tol) {
            double s = 0, a = 0;
            for (int64_t e = 0; e < D; ++e) {
              const double x = double(pq[l][i * D + e]) * pk[l][j * D + e];
              s += x;
              a += std::abs(x);
            }
            *tol = 2.0 * D * std::ldexp(1.0, -24) * a;
            return s;
          };
          std::vector<char> kept(n, 0);
          double worst_kept = INFINITY, worst_tol = 0;
          for (int s = 0; s < count; ++s) {
            const int32_t t = gp.pick(l, b, h, i, s);
            const bool in = std::find(cand.begin(), cand.end(), t) != cand.end();
            if (!in || (s > 0 && t <= gp.pick(l, b, h, i, s - 1))) {
              ADD_FAILURE() << "level " << l << " row " << i << ": pick " << t << " not an ascending candidate";
              return;
            }
            kept[t] = 1;
            double tol;
            const double sc = score(t, &tol);
            if (sc < worst_kept) worst_kept = sc, worst_tol = tol;
          }
          for (int64_t j : cand) {
            if (kept[j]) continue;
            double tol;
            const double sc = score(j, &tol);
            if (sc > worst_kept + worst_tol + tol) ++bad;
          }
        }
      }
    }
  EXPECT_EQ(bad, 0) << "dropped candidates that beat a kept one beyond the f32 error bound";
}

// One row's visited keys: (level, token, log count).
struct Key {
  int level;
  int64_t t;
  double log_count;
};
std::vector<Key> keys_of(const LlsaPlan& plan, int64_t b, int64_t h, int64_t qb) {
  std::vector<Key> keys;
  llsa_detail::for_each_key_run(plan, b, h, qb, [&](int level, int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t)
      keys.push_back({level, t, level == 0 ? 0.0 : std::log(static_cast<double>(plan.token_count(level, t)))});
  });
  return keys;
}

double rel_l2(const std::vector<float>& x, const std::vector<double>& ref) {
  double e = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e += (x[i] - ref[i]) * (x[i] - ref[i]);
    n += ref[i] * ref[i];
  }
  return n > 0 ? std::sqrt(e / n) : std::sqrt(e);
}

struct Naive {  // the naive half-precision LLSA's results (see the header)
  std::vector<double> out, dq, dk, dv;
  std::vector<double> lse_tol;  // per row: the LSE bound
};

// The naive half-precision forward and backward with the device's plan. out_in / lse_in: the
// forward values the backward is given (the device's).
Naive naive(const Case& c, const LlsaPlan& plan, const std::vector<float>& q, const std::vector<float>& k,
            const std::vector<float>& v, const std::vector<float>& d_o, const std::vector<float>& out_in,
            const std::vector<float>& lse_in) {
  const int64_t D = c.head_dim, N = c.len, group = c.heads_q / c.heads_kv;
  const double u = unit_roundoff(c.dtype), scale = 1.0 / std::sqrt(double(D));
  auto r = [&](double x) { return double(round_to(c.dtype, float(x))); };
  Naive nv;
  nv.out.assign(q.size(), 0.0);
  nv.dq.assign(q.size(), 0.0);
  nv.dk.assign(k.size(), 0.0);
  nv.dv.assign(k.size(), 0.0);
  nv.lse_tol.assign(c.batch * c.heads_q * N, 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t hk = 0; hk < c.heads_kv; ++hk) {
      auto pk = pyramid(&k[((b * c.heads_kv + hk) * N) * D], plan, D);
      auto pv = pyramid(&v[((b * c.heads_kv + hk) * N) * D], plan, D);
      for (int l = 1; l <= plan.levels; ++l)
        for (float& x : pk[l]) x = round_to(c.dtype, x);
      for (int l = 1; l <= plan.levels; ++l)
        for (float& x : pv[l]) x = round_to(c.dtype, x);
      std::vector<std::vector<double>> gk(plan.levels + 1), gv(plan.levels + 1);
      for (int l = 0; l <= plan.levels; ++l) gk[l].assign(plan.level_len[l] * D, 0.0), gv[l].assign(plan.level_len[l] * D, 0.0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t qb = 0; qb < plan.level_len[1]; ++qb) {
          const auto keys = keys_of(plan, b, h, qb);
          for (int64_t i = qb * plan.block; i < std::min<int64_t>((qb + 1) * plan.block, N); ++i) {
            const int64_t row = (b * c.heads_q + h) * N + i;
            const float* qi = &q[row * D];
            std::vector<double> s(keys.size());
            double m = -INFINITY, max_abs = 0;
            for (size_t j = 0; j < keys.size(); ++j) {
              const float* kj = &pk[keys[j].level][keys[j].t * D];
              float dot = 0;
              double a = 0;
              for (int64_t e = 0; e < D; ++e) dot += qi[e] * kj[e], a += std::abs(double(qi[e]) * kj[e]);
              max_abs = std::max(max_abs, a);
              s[j] = r(dot * scale) + keys[j].log_count;
              m = std::max(m, s[j]);
            }
            double sum = 0;
            for (double x : s) sum += std::exp(x - m);
            const double lse = m + std::log(sum);
            nv.lse_tol[row] = (u + D * std::ldexp(1.0, -24)) * scale * max_abs + std::ldexp(1.0, -18) * (1 + std::abs(lse));
            std::vector<double> p(keys.size());
            for (size_t j = 0; j < keys.size(); ++j) p[j] = r(std::exp(s[j] - lse));
            for (int64_t e = 0; e < D; ++e) {
              double o = 0;
              for (size_t j = 0; j < keys.size(); ++j) o += p[j] * pv[keys[j].level][keys[j].t * D + e];
              nv.out[row * D + e] = r(o);
            }
            if (!c.backward) continue;
            // Backward from the device's O and LSE, as the device and the reference get them.
            const float* doi = &d_o[row * D];
            double delta = 0;
            for (int64_t e = 0; e < D; ++e) delta += double(doi[e]) * out_in[row * D + e];
            std::vector<double> dq(D, 0.0);
            for (size_t j = 0; j < keys.size(); ++j) {
              const Key& key = keys[j];
              const double pj = r(std::exp(s[j] - lse_in[row]));
              double dp = 0;
              for (int64_t e = 0; e < D; ++e) dp += double(doi[e]) * pv[key.level][key.t * D + e];
              const double ds = r(pj * (dp - delta));
              for (int64_t e = 0; e < D; ++e) {
                dq[e] += ds * pk[key.level][key.t * D + e];
                gk[key.level][key.t * D + e] += scale * ds * qi[e];
                gv[key.level][key.t * D + e] += pj * doi[e];
              }
            }
            for (int64_t e = 0; e < D; ++e) nv.dq[row * D + e] = r(scale * dq[e]);
          }
        }
      if (!c.backward) continue;
      for (int l = plan.levels; l >= 1; --l) {
        llsa_detail::mean_pool_backward(gk[l].data(), plan.level_len[l - 1], D, plan.block, gk[l - 1].data());
        llsa_detail::mean_pool_backward(gv[l].data(), plan.level_len[l - 1], D, plan.block, gv[l - 1].data());
      }
      for (int64_t x = 0; x < N * D; ++x) {
        nv.dk[(b * c.heads_kv + hk) * N * D + x] = r(gk[0][x]);
        nv.dv[(b * c.heads_kv + hk) * N * D + x] = r(gv[0][x]);
      }
    }
  return nv;
}

std::vector<double> to_double(const HostArray& a) {
  return std::vector<double>(a.ptr<float>(), a.ptr<float>() + a.numel());
}

class CudaLlsaCase : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLlsaCase, MatchesCpuRef) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  const int64_t D = c.head_dim;
  std::vector<float> q = values(c, c.heads_q, c.seed, c.amplitude), k = values(c, c.heads_kv, c.seed + 1, 1.0f),
                     v = values(c, c.heads_kv, c.seed + 2, 1.0f), d_o = values(c, c.heads_q, c.seed + 3, 1.0f);
  DeviceTensor dq_in(c, c.heads_q, &q, c.dtype), dk_in(c, c.heads_kv, &k, c.dtype), dv_in(c, c.heads_kv, &v, c.dtype);
  LlsaOptions o;
  o.block = c.block, o.topk = c.topk, o.levels = c.levels, o.enrich = c.enrich, o.dedupe = c.dedupe;
  o.backend = Backend::cuda;

  // The plan.
  Result<LlsaPlan> gp = llsa_plan(dq_in.t, dk_in.t, o);
  ASSERT_TRUE(gp.ok()) << gp.status().to_string();
  check_plan_valid(c, *gp, q, k);
  // The selection's rungs 1 (a warp per query token, candidates from L2) and 2 (a warp per token,
  // candidates shared in shared memory) pick the same tokens, bit for bit, as the default (rung 3
  // where it applies: a thread per token and part of its candidates, the query in registers), at
  // every level.
  for (const char* select_rung : {"1", "2"}) {
    setenv("SPARSA_LLSA_SELECT_RUNG", select_rung, 1);
    Result<LlsaPlan> gp1 = llsa_plan(dq_in.t, dk_in.t, o);
    unsetenv("SPARSA_LLSA_SELECT_RUNG");
    ASSERT_TRUE(gp1.ok()) << gp1.status().to_string();
    for (int l = 1; l <= gp->levels; ++l) {
      const auto& a = gp->picks[l - 1];
      const auto& b = gp1->picks[l - 1];
      ASSERT_EQ(a.numel(), b.numel());
      EXPECT_TRUE(std::equal(a.ptr<int32_t>(), a.ptr<int32_t>() + a.numel(), b.ptr<int32_t>()))
          << "level " << l << ": selection rung " << select_rung << " picks otherwise than the default";
      const auto& ca = gp->pick_counts[l - 1];
      const auto& cb = gp1->pick_counts[l - 1];
      EXPECT_TRUE(std::equal(ca.ptr<int32_t>(), ca.ptr<int32_t>() + ca.numel(), cb.ptr<int32_t>()))
          << "level " << l << ": selection rung " << select_rung << " counts otherwise than the default";
    }
  }
  LlsaOptions ho = o;
  ho.backend = Backend::cpu;
  Result<LlsaPlan> cp = llsa_plan(host_view(q, c, c.heads_q), host_view(k, c, c.heads_kv), ho);
  ASSERT_TRUE(cp.ok());
  int64_t rows = 0, same = 0;
  for (int l = 1; l <= gp->levels; ++l) {
    const int64_t n = gp->level_len[l];
    for (int64_t bh = 0; bh < c.batch * c.heads_q; ++bh)
      for (int64_t i = 0; i < n; ++i, ++rows) {
        const int32_t* a = gp->picks[l - 1].ptr<int32_t>() + (bh * n + i) * gp->topk;
        const int32_t* b = cp->picks[l - 1].ptr<int32_t>() + (bh * n + i) * gp->topk;
        same += std::equal(a, a + gp->topk, b);
      }
  }
  EXPECT_GE(same, rows * 98 / 100) << same << " of " << rows << " rows equal the CPU plan";

  // The forward, plan built on the device.
  DeviceTensor out(c, c.heads_q, nullptr, c.dtype);
  DeviceLse lse(c);
  if (c.rung != 0) setenv("SPARSA_LLSA_FORWARD_RUNG", std::to_string(c.rung).c_str(), 1);
  Status st = llsa_forward(dq_in.t, dk_in.t, dv_in.t, out.t, lse.t, o);
  const int rung = llsa_cuda::last_forward_rung(), fine_keys = llsa_cuda::last_forward_fine_keys();
  unsetenv("SPARSA_LLSA_FORWARD_RUNG");
  ASSERT_TRUE(st.ok()) << st.to_string();
  if (c.expect_rung) EXPECT_EQ(rung, c.expect_rung);
  if (c.expect_fine_keys) EXPECT_EQ(fine_keys, c.expect_fine_keys);
  const std::vector<float> o_dev = out.download(c), lse_dev = lse.download();
  // The same with the plan from the host: bit for bit.
  DeviceTensor out2(c, c.heads_q, nullptr, c.dtype);
  DeviceLse lse2(c);
  if (c.rung != 0) setenv("SPARSA_LLSA_FORWARD_RUNG", std::to_string(c.rung).c_str(), 1);
  st = llsa_forward(dq_in.t, dk_in.t, dv_in.t, *gp, out2.t, lse2.t, o);
  unsetenv("SPARSA_LLSA_FORWARD_RUNG");
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(out.raw(), out2.raw()) << "a host plan gives another output than the device-built one";
  // Padding between rows untouched.
  if (c.seq_pad > 0) {
    const auto raw = out.raw();
    for (int64_t r = 0; r < c.batch * c.heads_q * c.len; ++r)
      for (int64_t e = D; e < out.row; ++e) ASSERT_EQ(raw[r * out.row + e], 0x7fc1) << "padding written";
  }

  LlsaOptions ro = o;
  ro.backend = Backend::cpu_ref;
  HostArray ref_out(DType::f32, {c.batch, c.heads_q, c.len, D}), ref_lse(DType::f32, {c.batch, c.heads_q, c.len});
  st = llsa_forward(host_view(q, c, c.heads_q), host_view(k, c, c.heads_kv), host_view(v, c, c.heads_kv), *gp,
                    ref_out.view(), ref_lse.view(), ro);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const Naive nv = naive(c, *gp, q, k, v, d_o, o_dev, lse_dev);
  const auto ref_o = to_double(ref_out);
  const double err = rel_l2(o_dev, ref_o), naive_err = rel_l2(std::vector<float>(nv.out.begin(), nv.out.end()), ref_o);
  EXPECT_LE(err, 2.0 * naive_err + 1e-7) << "out: device " << err << ", naive " << naive_err;
  for (size_t i = 0; i < lse_dev.size(); ++i) {
    ASSERT_NEAR(lse_dev[i], ref_lse.ptr<float>()[i], nv.lse_tol[i]) << "lse row " << i;
  }
  // The fine blocks in 64-key steps (SPARSA_LLSA_FINE_STEP=64) where they apply, within the same
  // bound: the two step sizes differ only in the order of the online softmax's rescales.
  DeviceTensor out64(c, c.heads_q, nullptr, c.dtype);
  DeviceLse lse64(c);
  setenv("SPARSA_LLSA_FINE_STEP", "64", 1);
  if (c.rung != 0) setenv("SPARSA_LLSA_FORWARD_RUNG", std::to_string(c.rung).c_str(), 1);
  st = llsa_forward(dq_in.t, dk_in.t, dv_in.t, out64.t, lse64.t, o);
  const int keys64 = llsa_cuda::last_forward_fine_keys();
  unsetenv("SPARSA_LLSA_FORWARD_RUNG");
  unsetenv("SPARSA_LLSA_FINE_STEP");
  ASSERT_TRUE(st.ok()) << st.to_string();
  if (c.expect_wide) EXPECT_EQ(keys64, 64);
  if (keys64 == 64) {
    const std::vector<float> o64 = out64.download(c), lse64_dev = lse64.download();
    const double err64 = rel_l2(o64, ref_o);
    EXPECT_LE(err64, 2.0 * naive_err + 1e-7) << "out, 64-key fine steps: device " << err64 << ", naive " << naive_err;
    for (size_t i = 0; i < lse64_dev.size(); ++i) {
      ASSERT_NEAR(lse64_dev[i], ref_lse.ptr<float>()[i], nv.lse_tol[i]) << "lse row " << i << ", 64-key fine steps";
    }
  }
  // A negative control: the reference without enrichment is far outside the bound.
  if (c.enrich && c.name.find("control") != std::string::npos) {
    LlsaPlan fine = *gp;
    fine.enrich = false;
    HostArray f_out(DType::f32, {c.batch, c.heads_q, c.len, D}), f_lse(DType::f32, {c.batch, c.heads_q, c.len});
    ASSERT_TRUE(llsa_forward(host_view(q, c, c.heads_q), host_view(k, c, c.heads_kv), host_view(v, c, c.heads_kv),
                             fine, f_out.view(), f_lse.view(), ro)
                    .ok());
    EXPECT_GT(rel_l2(o_dev, to_double(f_out)), 4.0 * naive_err) << "the bound cannot tell enrichment from none";
  }
  std::printf("[ %s ] rung %d, fine steps of %d keys, out err %.3g (naive %.3g)", c.name.c_str(), rung, fine_keys, err,
              naive_err);
  if (!c.backward) {
    std::printf("\n");
    return;
  }

  // The backward (plan built on the device), twice: bit for bit.
  DeviceTensor ddo(c, c.heads_q, &d_o, c.dtype);
  DeviceTensor gq(c, c.heads_q, nullptr, c.dtype), gk(c, c.heads_kv, nullptr, c.dtype), gv(c, c.heads_kv, nullptr, c.dtype);
  st = llsa_backward(dq_in.t, dk_in.t, dv_in.t, out.t, lse.t, ddo.t, gq.t, gk.t, gv.t, o);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const auto gq1 = gq.raw(), gk1 = gk.raw(), gv1 = gv.raw();
  st = llsa_backward(dq_in.t, dk_in.t, dv_in.t, out.t, lse.t, ddo.t, gq.t, gk.t, gv.t, o);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(gq1, gq.raw()) << "dq differs run to run";
  EXPECT_EQ(gk1, gk.raw()) << "dk differs run to run";
  EXPECT_EQ(gv1, gv.raw()) << "dv differs run to run";

  std::vector<float> o_in = o_dev, l_in = lse_dev;
  HostArray rq(DType::f32, {c.batch, c.heads_q, c.len, D}), rk(DType::f32, {c.batch, c.heads_kv, c.len, D}),
      rv(DType::f32, {c.batch, c.heads_kv, c.len, D});
  st = llsa_backward(host_view(q, c, c.heads_q), host_view(k, c, c.heads_kv), host_view(v, c, c.heads_kv), *gp,
                     host_view(o_in, c, c.heads_q),
                     Tensor::contiguous(l_in.data(), DType::f32, {c.batch, c.heads_q, c.len}),
                     host_view(d_o, c, c.heads_q), rq.view(), rk.view(), rv.view(), ro);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const struct {
    const char* name;
    std::vector<float> dev;
    std::vector<double> ref, nv;
  } grads[] = {{"dq", gq.download(c), to_double(rq), nv.dq},
               {"dk", gk.download(c), to_double(rk), nv.dk},
               {"dv", gv.download(c), to_double(rv), nv.dv}};
  for (const auto& g : grads) {
    const double e = rel_l2(g.dev, g.ref), ne = rel_l2(std::vector<float>(g.nv.begin(), g.nv.end()), g.ref);
    EXPECT_LE(e, 2.0 * ne + 1e-7) << g.name << ": device " << e << ", naive " << ne;
    std::printf(", %s err %.3g (naive %.3g)", g.name, e, ne);
  }
  std::printf("\n");
  // Where the forward ran 64-key steps, dQ in 64-key steps too (SPARSA_LLSA_FINE_STEP=64) within
  // the same bound; dK and dV come from other kernels and stay the same bit for bit.
  if (keys64 == 64) {
    DeviceTensor gq64(c, c.heads_q, nullptr, c.dtype), gk64(c, c.heads_kv, nullptr, c.dtype),
        gv64(c, c.heads_kv, nullptr, c.dtype);
    setenv("SPARSA_LLSA_FINE_STEP", "64", 1);
    st = llsa_backward(dq_in.t, dk_in.t, dv_in.t, out.t, lse.t, ddo.t, gq64.t, gk64.t, gv64.t, o);
    unsetenv("SPARSA_LLSA_FINE_STEP");
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(gk64.raw(), gk1) << "dk moved with dQ's fine step";
    EXPECT_EQ(gv64.raw(), gv1) << "dv moved with dQ's fine step";
    const double e = rel_l2(gq64.download(c), grads[0].ref);
    const double ne = rel_l2(std::vector<float>(grads[0].nv.begin(), grads[0].nv.end()), grads[0].ref);
    EXPECT_LE(e, 2.0 * ne + 1e-7) << "dq, 64-key fine steps: device " << e << ", naive " << ne;
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({.name = "N1", .len = 1});
  v.push_back({.name = "N17_block4_toy", .len = 17, .block = 4, .topk = 2});
  v.push_back({.name = "N1000_control", .len = 1000, .expect_rung = 2, .expect_fine_keys = 16, .expect_wide = true});
  v.push_back({.name = "N1000_rung1", .len = 1000, .rung = 1, .expect_rung = 1});
  v.push_back({.name = "N4099_rung1_dedupe_gqa", .heads_q = 4, .heads_kv = 1, .len = 4099, .dedupe = true, .rung = 1,
               .expect_rung = 1});
  v.push_back({.name = "N500_block6_rung1", .len = 500, .block = 6, .topk = 3, .levels = 2, .expect_rung = 1});
  v.push_back({.name = "N1000_levels1", .len = 1000, .levels = 1});
  v.push_back({.name = "N1000_dedupe_levels2", .len = 1000, .levels = 2, .dedupe = true});
  v.push_back({.name = "N1000_no_enrich", .len = 1000, .enrich = false});
  v.push_back({.name = "N1000_f16_d128_gqa", .dtype = DType::f16, .heads_q = 4, .heads_kv = 2, .len = 1000,
               .head_dim = 128});
  v.push_back({.name = "N4099_gqa_levels3_strided", .batch = 2, .heads_q = 4, .heads_kv = 2, .len = 4099, .topk = 4,
               .levels = 3, .seq_pad = 8});
  v.push_back({.name = "N4099_block64_d128", .len = 4099, .head_dim = 128, .block = 64, .topk = 4, .levels = 1,
               .expect_fine_keys = 16});
  // 64-key fine steps over blocks of four tiles each, and over blocks cut into partial tiles.
  // Two levels of blocks of 64: the selection's rung 3 below the top with 64 sibling tokens of 2
  // lanes each.
  v.push_back({.name = "N8192_block64_levels2", .len = 8192, .block = 64, .topk = 4, .levels = 2});
  v.push_back({.name = "N4099_block64_wide", .len = 4099, .block = 64, .topk = 3, .levels = 1, .expect_rung = 2,
               .expect_fine_keys = 16, .expect_wide = true});
  v.push_back({.name = "N4099_topk32_dedupe", .len = 4099, .topk = 32, .levels = 2, .dedupe = true});
  v.push_back({.name = "N2000_block20_peaky", .len = 2000, .block = 20, .topk = 6, .amplitude = 4.0f,
               .rung = 3, .expect_rung = 3, .expect_fine_keys = 16, .expect_wide = true});  // one level of 100 tokens through the dense executor (forced: under 256), peaky logits
  v.push_back({.name = "N300_unaligned_pad", .len = 300, .seq_pad = 3});
  // Fewer valid candidates than K below the top (the level's last block partial): level 2 of
  // 100/25/7/2 tokens has 7 candidates under two parent picks of 4 children each; counts 7.
  v.push_back({.name = "N100_block4_topk16_levels3_few_candidates", .len = 100, .block = 4, .topk = 16, .levels = 3});
  v.push_back({.name = "N100_block2_topk16_few_candidates", .len = 100, .block = 2, .topk = 16});
  // Rungs 3 and 4: the coarsest level ahead of the row-wise kernel, merged by LSE (N a multiple of
  // B^L, no dedupe), through the dense executor (rung 3: by default from 256 coarsest tokens) or
  // with its keys resident in shared memory (rung 4: by default from 64 tokens where they fit;
  // either forced at any length): one level and two, GQA, a batch, f16 at d 128, strided and
  // unaligned rows, a partial 64-key step; each with rung 3 beside it; one where dedupe keeps the
  // level in the kernel, one whose coarsest level is too short to leave it, and one too long for
  // shared memory (the executor by default).
  v.push_back({.name = "N4096_rung4_levels1", .len = 4096, .levels = 1, .expect_rung = 4});
  v.push_back({.name = "N4096_rung3_levels1", .len = 4096, .levels = 1, .rung = 3, .expect_rung = 3});
  v.push_back({.name = "N4096_rung4_batch3_gqa", .batch = 3, .heads_q = 4, .heads_kv = 2, .len = 4096, .levels = 1,
               .backward = false, .expect_rung = 4});
  v.push_back({.name = "N16384_rung4_levels2_gqa", .heads_q = 2, .heads_kv = 1, .len = 16384, .levels = 2,
               .expect_rung = 4});  // 64 coarsest tokens: the resident kernel's shortest default
  v.push_back({.name = "N16384_rung3_levels2_gqa", .heads_q = 2, .heads_kv = 1, .len = 16384, .levels = 2,
               .rung = 3, .expect_rung = 3});
  v.push_back({.name = "N4096_levels2_short_coarsest_keeps_rung2", .len = 4096, .levels = 2, .expect_rung = 2});
  v.push_back({.name = "N4096_rung4_f16_d128_strided", .dtype = DType::f16, .len = 4096, .head_dim = 128,
               .levels = 1, .seq_pad = 8, .expect_rung = 4});
  v.push_back({.name = "N4096_rung3_f16_d128_strided", .dtype = DType::f16, .len = 4096, .head_dim = 128,
               .levels = 1, .seq_pad = 8, .rung = 3, .expect_rung = 3});
  v.push_back({.name = "N4096_rung4_unaligned", .len = 4096, .levels = 1, .backward = false, .seq_pad = 3, .rung = 4,
               .expect_rung = 4});
  v.push_back({.name = "N2000_block20_peaky_rung4", .len = 2000, .block = 20, .topk = 6, .backward = false,
               .amplitude = 4.0f, .rung = 4, .expect_rung = 4});  // 100 tokens: one whole 64-key step, one partial
  v.push_back({.name = "N8192_block8_coarsest_too_big_takes_rung3", .len = 8192, .block = 8, .levels = 1,
               .backward = false, .expect_rung = 3});  // 1,024 tokens: 288 KiB of K and V at d 64
  v.push_back({.name = "N4096_rung2_forced", .len = 4096, .levels = 1, .rung = 2, .expect_rung = 2});
  v.push_back({.name = "N4096_dedupe_keeps_rung2", .len = 4096, .levels = 1, .dedupe = true, .expect_rung = 2});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaLlsaCase, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(CudaLlsa, ClearErrors) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Case c;
  c.len = 64;
  std::vector<float> x = values(c, 2, 1, 1.0f);
  DeviceTensor q(c, 2, &x, DType::bf16), out(c, 2, nullptr, DType::bf16);
  DeviceLse lse(c);
  LlsaOptions o;
  o.backend = Backend::cuda;
  o.topk = 65;
  Status st = llsa_forward(q.t, q.t, q.t, out.t, lse.t, o);
  EXPECT_EQ(st.code(), StatusCode::unsupported);
  EXPECT_NE(st.message().find("topk"), std::string::npos) << st.to_string();
  o.topk = 8;
  Case c32 = c;
  c32.head_dim = 32;
  std::vector<float> x32 = values(c32, 2, 1, 1.0f);
  DeviceTensor q32(c32, 2, &x32, DType::bf16), out32(c32, 2, nullptr, DType::bf16);
  st = llsa_forward(q32.t, q32.t, q32.t, out32.t, lse.t, o);
  EXPECT_NE(st.message().find("head_dim"), std::string::npos) << st.to_string();
  // lse on the host.
  HostArray hl(DType::f32, {1, 2, 64});
  st = llsa_forward(q.t, q.t, q.t, out.t, hl.view(), o);
  EXPECT_NE(st.message().find("lse"), std::string::npos) << st.to_string();
  o.check_finite = true;
  st = llsa_forward(q.t, q.t, q.t, out.t, lse.t, o);
  EXPECT_NE(st.message().find("check_finite"), std::string::npos) << st.to_string();
  o.check_finite = false;
  // Host memory labelled as a cuda tensor: refused by the pointer check, naming the argument.
  HostArray host_k(DType::bf16, {1, 2, 64, 64});
  Tensor fake = host_k.view();
  fake.device = Device{DeviceType::cuda, 0};
  st = llsa_forward(q.t, fake, q.t, out.t, lse.t, o);
  EXPECT_EQ(st.message().rfind("k:", 0), 0u) << st.to_string();
  HostArray host_dq(DType::bf16, {1, 2, 64, 64});
  Tensor fake_dq = host_dq.view();
  fake_dq.device = Device{DeviceType::cuda, 0};
  ASSERT_TRUE(llsa_forward(q.t, q.t, q.t, out.t, lse.t, o).ok());
  DeviceTensor gk(c, 2, nullptr, DType::bf16), gv(c, 2, nullptr, DType::bf16);
  st = llsa_backward(q.t, q.t, q.t, out.t, lse.t, q.t, fake_dq, gk.t, gv.t, o);
  EXPECT_EQ(st.message().rfind("dq:", 0), 0u) << st.to_string();
}

}  // namespace

#endif
