// A user's program against the installed package: dense attention of a tiny input on the CPU,
// checked against a softmax written here; exit status 0 when they agree.
#include <cmath>
#include <cstdio>
#include <vector>

#include "sparsa/attention.h"

int main() {
  constexpr int64_t n = 5, d = 4;
  std::vector<float> q(n * d), k(n * d), v(n * d);
  for (int64_t i = 0; i < n * d; ++i) {
    q[i] = std::sin(0.3f * i);
    k[i] = std::cos(0.7f * i);
    v[i] = 0.1f * static_cast<float>(i % 7);
  }
  const sparsa::Tensor tq = sparsa::Tensor::contiguous(q.data(), sparsa::DType::f32, {1, 1, n, d});
  const sparsa::Tensor tk = sparsa::Tensor::contiguous(k.data(), sparsa::DType::f32, {1, 1, n, d});
  const sparsa::Tensor tv = sparsa::Tensor::contiguous(v.data(), sparsa::DType::f32, {1, 1, n, d});
  auto r = sparsa::dense(tq, tk, tv);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().to_string().c_str());
    return 1;
  }
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    double w[n], m = -1e300, sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t t = 0; t < d; ++t) s += double(q[i * d + t]) * k[j * d + t];
      w[j] = s / std::sqrt(double(d));
      m = std::max(m, w[j]);
    }
    for (int64_t j = 0; j < n; ++j) sum += (w[j] = std::exp(w[j] - m));
    for (int64_t t = 0; t < d; ++t) {
      double o = 0;
      for (int64_t j = 0; j < n; ++j) o += w[j] / sum * v[j * d + t];
      worst = std::max(worst, std::abs(o - r->out.ptr<float>()[i * d + t]));
    }
  }
  std::printf("sparsa: dense attention through the installed package, max error %.2e\n", worst);
  return worst < 1e-5 ? 0 : 1;  // f32 against f64 over 5 keys: ~1e-7
}
