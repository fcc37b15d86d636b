// cpu_ref LLSA: the specification, f64 end to end, plain loops.
//
// For fine query i of (b, h), in block qb = i / B, with the visited keys (level l,
// token t) of for_each_key_run and c = count_l(t) original tokens under t:
//   s_t  = scale * <q_i, K_l[t]> + log(c)
//   lse  = log(sum_t exp(s_t))
//   o_i  = sum_t exp(s_t - lse) * V_l[t]
// where K_l, V_l are the mean pools (llsa.h). Backward, with P_t = exp(s_t - lse) and
// D_i = <dO_i, O_i>:
//   dV_l[t] += P_t dO_i;   dS_t = P_t (<dO_i, V_l[t]> - D_i)
//   dQ_i += scale dS_t K_l[t];   dK_l[t] += scale dS_t q_i
// then the pooled gradients flow down level by level (mean_pool_backward).
#include <cmath>
#include <limits>

#include "methods/llsa/internal.h"

namespace sparsa::llsa_detail {

namespace {

// Pyramid of one head: levels[l] is [n_l, d] (level 0 a copy of the head).
std::vector<std::vector<double>> pyramid(const double* head, const LlsaPlan& plan, int64_t d) {
  std::vector<std::vector<double>> levels(plan.levels + 1);
  levels[0].assign(head, head + plan.len * d);
  for (int l = 1; l <= plan.levels; ++l) {
    levels[l].resize(plan.level_len[l] * d);
    mean_pool(levels[l - 1].data(), plan.level_len[l - 1], d, plan.block, levels[l].data());
  }
  return levels;
}

struct Key {
  int level;
  int64_t token;
};

std::vector<Key> visited_keys(const LlsaPlan& plan, int64_t b, int64_t h, int64_t qb) {
  std::vector<Key> keys;
  for_each_key_run(plan, b, h, qb, [&](int level, int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t) keys.push_back({level, t});
  });
  return keys;
}

double dot(const double* a, const double* b, int64_t d) {
  double s = 0.0;
  for (int64_t t = 0; t < d; ++t) s += a[t] * b[t];
  return s;
}

}  // namespace

void ref_forward(const RefShape& shape, const LlsaPlan& plan, const double* q, const double* k, const double* v,
                 double* out, double* lse) {
  const int64_t N = shape.len, d = shape.head_dim, group = shape.heads_q / shape.heads_kv;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads_q; ++h) {
      const int64_t h_kv = h / group;
      const auto K = pyramid(k + (b * shape.heads_kv + h_kv) * N * d, plan, d);  // [level][n_l, d]
      const auto V = pyramid(v + (b * shape.heads_kv + h_kv) * N * d, plan, d);
      for (int64_t i = 0; i < N; ++i) {
        const double* q_i = q + ((b * shape.heads_q + h) * N + i) * d;  // [d]
        double* o_i = out + ((b * shape.heads_q + h) * N + i) * d;        // [d]
        const auto keys = visited_keys(plan, b, h, i / plan.block);
        std::vector<double> s(keys.size());
        double m = -std::numeric_limits<double>::infinity();
        for (size_t n = 0; n < keys.size(); ++n) {
          const Key& key = keys[n];
          s[n] = shape.scale * dot(q_i, K[key.level].data() + key.token * d, d) +
                 std::log(static_cast<double>(plan.token_count(key.level, key.token)));
          m = std::max(m, s[n]);
        }
        double sum = 0.0;
        for (double x : s) sum += std::exp(x - m);
        const double l = keys.empty() ? -std::numeric_limits<double>::infinity() : m + std::log(sum);
        for (int64_t t = 0; t < d; ++t) o_i[t] = 0.0;
        for (size_t n = 0; n < keys.size(); ++n) {
          const double p = std::exp(s[n] - l);
          const double* v_t = V[keys[n].level].data() + keys[n].token * d;
          for (int64_t t = 0; t < d; ++t) o_i[t] += p * v_t[t];
        }
        lse[(b * shape.heads_q + h) * N + i] = l;
      }
    }
  }
}

void ref_backward(const RefShape& shape, const LlsaPlan& plan, const double* q, const double* k, const double* v,
                  const double* out, const double* lse, const double* d_o, double* dq, double* dk, double* dv) {
  const int64_t N = shape.len, d = shape.head_dim, group = shape.heads_q / shape.heads_kv;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h_kv = 0; h_kv < shape.heads_kv; ++h_kv) {
      const auto K = pyramid(k + (b * shape.heads_kv + h_kv) * N * d, plan, d);
      const auto V = pyramid(v + (b * shape.heads_kv + h_kv) * N * d, plan, d);
      std::vector<std::vector<double>> dK(plan.levels + 1), dV(plan.levels + 1);  // [level][n_l, d]
      for (int l = 0; l <= plan.levels; ++l) {
        dK[l].assign(plan.level_len[l] * d, 0.0);
        dV[l].assign(plan.level_len[l] * d, 0.0);
      }
      for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
        for (int64_t i = 0; i < N; ++i) {
          const int64_t row = (b * shape.heads_q + h) * N + i;
          const double* q_i = q + row * d;
          const double* o_i = out + row * d;
          const double* do_i = d_o + row * d;
          double* dq_i = dq + row * d;
          for (int64_t t = 0; t < d; ++t) dq_i[t] = 0.0;
          const double l = lse[row];
          if (std::isinf(l)) continue;  // no key visited: no gradient
          const double delta = dot(do_i, o_i, d);
          for (const Key& key : visited_keys(plan, b, h, i / plan.block)) {
            const double* k_t = K[key.level].data() + key.token * d;
            const double* v_t = V[key.level].data() + key.token * d;
            const double s = shape.scale * dot(q_i, k_t, d) +
                             std::log(static_cast<double>(plan.token_count(key.level, key.token)));
            const double p = std::exp(s - l);
            const double ds = p * (dot(do_i, v_t, d) - delta);
            double* dk_t = dK[key.level].data() + key.token * d;
            double* dv_t = dV[key.level].data() + key.token * d;
            for (int64_t t = 0; t < d; ++t) {
              dv_t[t] += p * do_i[t];
              dq_i[t] += shape.scale * ds * k_t[t];
              dk_t[t] += shape.scale * ds * q_i[t];
            }
          }
        }
      }
      for (int l = plan.levels; l >= 1; --l) {
        mean_pool_backward(dK[l].data(), plan.level_len[l - 1], d, plan.block, dK[l - 1].data());
        mean_pool_backward(dV[l].data(), plan.level_len[l - 1], d, plan.block, dV[l - 1].data());
      }
      std::copy(dK[0].begin(), dK[0].end(), dk + (b * shape.heads_kv + h_kv) * N * d);
      std::copy(dV[0].begin(), dV[0].end(), dv + (b * shape.heads_kv + h_kv) * N * d);
    }
  }
}

}  // namespace sparsa::llsa_detail
