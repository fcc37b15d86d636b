// cpu_ref attention: the specification of dense and block-sparse attention.
//
// Plain loops, f64 accumulation, no tiling, no online softmax. For one query row:
//   s_j   = scale * <q, k_j>                 for every visible key j
//   lse   = log(sum_j exp(s_j))              (-inf when no key is visible)
//   o     = sum_j exp(s_j - lse) * v_j       (0 when no key is visible)
// Block-sparse: the visible keys of query (permuted) position p in block qb are the
// tokens of key blocks indices[b, h, qb, 0..counts), read through perm_kv; the row is
// written at original position perm_q[p].
// Masks: of those keys, query i keeps the j with mask_visible(mask, i, j, len_q, len_kv)
// (sparsa/attention.h), on original positions local to the sequence.
// Variable-length batches: sequence b has its own len_q, len_kv (p.seq_len_q(b), p.seq_len_kv(b))
// and its own rows of the plan; the offsets are in the params' q_off / k_off / ...
#include <cmath>
#include <cstdio>
#include <string>
#include <limits>
#include <vector>

#include "core/backends.h"

namespace sparsa::cpu_ref {

using detail::AttentionParams;

// One query row against a list of key positions (original token indices).
// q_row: [head_dim]; keys: positions into K/V of kv head h_kv; writes out row and lse.
bool attend_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i_q, const std::vector<int64_t>& keys) {
  const int64_t d = p.head_dim;
  const int64_t h_kv = h / p.group();
  std::vector<double> q(d), logits(keys.size()), o(d, 0.0);
  for (int64_t t = 0; t < d; ++t) q[t] = detail::load_element(p.q, p.dtype, p.q_off(b, h, i_q) + t);

  double max_logit = -std::numeric_limits<double>::infinity();
  for (size_t n = 0; n < keys.size(); ++n) {
    double dot = 0.0;
    for (int64_t t = 0; t < d; ++t) dot += q[t] * detail::load_element(p.k, p.dtype, p.k_off(b, h_kv, keys[n]) + t);
    logits[n] = static_cast<double>(p.scale) * dot;
    max_logit = std::max(max_logit, logits[n]);
  }
  double lse = -std::numeric_limits<double>::infinity();
  if (!keys.empty()) {
    double sum = 0.0;
    for (double s : logits) sum += std::exp(s - max_logit);
    lse = max_logit + std::log(sum);
    for (size_t n = 0; n < keys.size(); ++n) {
      const double w = std::exp(logits[n] - lse);
      for (int64_t t = 0; t < d; ++t) o[t] += w * detail::load_element(p.v, p.dtype, p.v_off(b, h_kv, keys[n]) + t);
    }
  }
  for (int64_t t = 0; t < d; ++t) detail::store_element(p.out, p.dtype, p.out_off(b, h, i_q) + t, static_cast<float>(o[t]));
  p.lse_at(b, h, i_q) = static_cast<float>(lse);
  // f64 holds every logit of finite f32 inputs (|s| <= scale * d * FLT_MAX^2 < 1e120), so an
  // LSE beyond f32 is the only way finite inputs have no finite answer. NaN stays NaN.
  return !(lse > static_cast<double>(std::numeric_limits<float>::max()));
}

Status lse_overflow(const AttentionParams& p, int64_t b, int64_t h, int64_t i_q) {
  char scale[32];
  std::snprintf(scale, sizeof scale, "%g", static_cast<double>(p.scale));
  return {StatusCode::non_finite,
          "lse[" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(i_q) +
              "]: the log-sum-exp of the scaled logits exceeds the f32 range (3.4e38): the logits overflow "
              "(scale " + std::string(scale) + "); lower the scale or the magnitude of q and k"};
}

Status attention(const AttentionParams& p) {
  std::vector<int64_t> keys;
  int64_t bad[3] = {-1, -1, -1};  // the first row whose LSE overflowed
  auto row = [&](int64_t b, int64_t h, int64_t i) {
    if (!attend_row(p, b, h, i, keys) && bad[0] < 0) {
      bad[0] = b;
      bad[1] = h;
      bad[2] = i;
    }
  };
  std::vector<int64_t> block_keys;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len_q = p.seq_len_q(b), len_kv = p.seq_len_kv(b);
    // The keys of `candidates` that query i sees under the mask.
    auto visible = [&](int64_t i, const std::vector<int64_t>& candidates) {
      keys.clear();
      for (int64_t j : candidates)
        if (mask_visible(p.mask, i, j, len_q, len_kv)) keys.push_back(j);
    };
    for (int64_t h = 0; h < p.heads_q; ++h) {
      if (p.index == nullptr) {  // dense: every key is a candidate
        block_keys.resize(len_kv);
        for (int64_t j = 0; j < len_kv; ++j) block_keys[j] = j;
        for (int64_t i = 0; i < len_q; ++i) {
          visible(i, block_keys);
          row(b, h, i);
        }
        continue;
      }
      const BlockIndex& ix = *p.index;
      const int64_t h_kv = h / p.group();
      const int64_t num_q_blocks = (len_q + ix.block_q - 1) / ix.block_q;
      for (int64_t qb = 0; qb < num_q_blocks; ++qb) {
        block_keys.clear();
        const int32_t count = detail::index_count(ix, b, h, qb);
        for (int32_t s = 0; s < count; ++s) {
          const int64_t kb = detail::index_block(ix, b, h, qb, s);
          for (int64_t pk = kb * ix.block_kv; pk < std::min<int64_t>((kb + 1) * ix.block_kv, len_kv); ++pk) {
            block_keys.push_back(detail::perm_kv_at(ix, b, h_kv, pk));
          }
        }
        for (int64_t pq = qb * ix.block_q; pq < std::min<int64_t>((qb + 1) * ix.block_q, len_q); ++pq) {
          const int64_t i = detail::perm_q_at(ix, b, h, pq);
          visible(i, block_keys);
          row(b, h, i);
        }
      }
    }
  }
  if (bad[0] >= 0) return lse_overflow(p, bad[0], bad[1], bad[2]);
  return {};
}

Status merge(const detail::MergeParams& p) {
  const Tensor& o1 = p.o1;
  const int64_t B = o1.shape[0], H = o1.shape[1], L = o1.shape[2], D = o1.shape[3];
  const double neg_inf = -std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        const double l1 = p.lse1.ptr<const float>()[p.lse1.offset({b, h, i})];
        const double l2 = p.lse2.ptr<const float>()[p.lse2.offset({b, h, i})];
        const double m = std::max(l1, l2);
        double w1 = 0.0, w2 = 0.0, l = neg_inf;
        if (m != neg_inf) {
          w1 = std::exp(l1 - m);
          w2 = std::exp(l2 - m);
          l = m + std::log(w1 + w2);
        }
        for (int64_t t = 0; t < D; ++t) {
          double o = 0.0;
          if (m != neg_inf) {
            // A side of weight 0 (L = -inf) contributes nothing, even if its O is not finite.
            const double a = w1 > 0 ? w1 * detail::load_element(o1.data, o1.dtype, o1.offset({b, h, i, t})) : 0.0;
            const double c = w2 > 0 ? w2 * detail::load_element(p.o2.data, p.o2.dtype, p.o2.offset({b, h, i, t})) : 0.0;
            o = (a + c) / (w1 + w2);
          }
          detail::store_element(p.out.data, p.out.dtype, p.out.offset({b, h, i, t}), static_cast<float>(o));
        }
        p.lse.ptr<float>()[p.lse.offset({b, h, i})] = static_cast<float>(l);
      }
    }
  }
  return {};
}

}  // namespace sparsa::cpu_ref
