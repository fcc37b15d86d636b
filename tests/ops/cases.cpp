// The cases: dense, block_sparse (random plans, full plans, empty rows, permutations),
// dense_split_merge (two disjoint key sets merged by LSE) and merge. A fixed list of
// required and hand-picked cases plus fuzzed shapes drawn from a seed.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <set>

#include "harness.h"

namespace ops {

using sparsa::AttentionOptions;
using sparsa::BlockIndex;
using sparsa::BlockIndexBuffer;
using sparsa::HostArray;

namespace {

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// ---- attention shapes and inputs ----
struct AttnSpec {
  int64_t b = 1, hq = 1, hkv = 1, lq = 1, lk = 1, d = 64;
  DType dtype = DType::f32;
  Layout layout = Layout::bhsd;  // of q, k, v
  Layout out = Layout::bhsd;     // of O and LSE
  double scale = 0;              // 0: the default 1/sqrt(d)
  uint64_t seed = 1;
  int threads = 0;               // AttentionOptions::num_threads (0: the library's default)
  sparsa::Mask mask;             // AttentionOptions::mask

  std::string params() const {
    return "b=" + std::to_string(b) + ",hq=" + std::to_string(hq) + ",hkv=" + std::to_string(hkv) +
           ",lq=" + std::to_string(lq) + ",lk=" + std::to_string(lk) + ",d=" + std::to_string(d) +
           ",dtype=" + sparsa::dtype_name(dtype) + ",layout=" + layout_name(layout) + ",out=" + layout_name(out) +
           ",scale=" + (scale > 0 ? fmt(scale) : std::string("def")) +
           (threads > 0 ? ",threads=" + std::to_string(threads) : std::string()) +
           (mask.is_none() ? std::string() : ",mask=" + sparsa::mask_string(mask));
  }
  double effective_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)); }
  double io_bytes() const {
    const double e = static_cast<double>(sparsa::dtype_size(dtype));
    return e * (2.0 * b * hq * lq * d + 2.0 * b * hkv * lk * d) + 4.0 * b * hq * lq;
  }
};

struct AttnInputs {
  std::vector<float> q_values, k_values, v_values;  // logical row-major, before rounding
  HostTensor q, k, v;
  AttentionOptions options(Backend backend, const AttnSpec& s) const {
    AttentionOptions o;
    o.backend = backend;
    if (s.scale > 0) o.scale = static_cast<float>(s.scale);
    o.num_threads = s.threads;
    o.mask = s.mask;
    return o;
  }
};

// Q, K, V ~ N(0, 1): logits of std ~1 at the default scale, so the softmax is neither
// flat nor one-hot; custom scales push it towards either end.
std::shared_ptr<AttnInputs> make_inputs(const AttnSpec& s) {
  Rng rng(s.seed);
  auto in = std::make_shared<AttnInputs>();
  in->q_values = normal_values(rng, s.b * s.hq * s.lq * s.d, 1.0);
  in->k_values = normal_values(rng, s.b * s.hkv * s.lk * s.d, 1.0);
  in->v_values = normal_values(rng, s.b * s.hkv * s.lk * s.d, 1.0);
  in->q = make_tensor(s.dtype, {s.b, s.hq, s.lq, s.d}, s.layout, in->q_values);
  in->k = make_tensor(s.dtype, {s.b, s.hkv, s.lk, s.d}, s.layout, in->k_values);
  in->v = make_tensor(s.dtype, {s.b, s.hkv, s.lk, s.d}, s.layout, in->v_values);
  return in;
}

// Largest Euclidean norm of the rows of a logical [..., d] array.
double max_row_norm(const std::vector<float>& values, int64_t d) {
  double best = 0;
  for (size_t row = 0; row < values.size() / d; ++row) {
    double sum = 0;
    for (int64_t t = 0; t < d; ++t) sum += double{values[row * d + t]} * values[row * d + t];
    best = std::max(best, std::sqrt(sum));
  }
  return best;
}

Prepared attention_prepared(const AttnSpec& s, const AttnInputs& in) {
  Prepared p;
  p.logit_bound = s.effective_scale() * max_row_norm(in.q_values, s.d) * max_row_norm(in.k_values, s.d);
  p.shape = {s.b, s.hq, s.lq, s.d};
  p.out_dtype = s.dtype;
  p.out_layout = s.out;
  p.bytes = s.io_bytes();
  return p;
}

// The spec's mask as a dense [b, hq, lq, lk] mask, written here from the definitions in
// sparsa/attention.h (not with the library's mask_visible): query i stands at key position
// i + lk - lq; causal j <= pos; block_causal floor(j / B) <= floor(pos / B); sliding_window
// pos - L <= j <= pos + R.
std::vector<uint8_t> rule_mask(const AttnSpec& s) {
  std::vector<uint8_t> mask(static_cast<size_t>(s.b * s.hq * s.lq * s.lk), 1);
  const sparsa::Mask& m = s.mask;
  for (int64_t i = 0; i < s.lq; ++i) {
    const int64_t pos = i + s.lk - s.lq;
    for (int64_t j = 0; j < s.lk; ++j) {
      bool visible = true;
      switch (m.kind) {
        case sparsa::MaskKind::none: break;
        case sparsa::MaskKind::causal: visible = j <= pos; break;
        case sparsa::MaskKind::block_causal:
          visible = std::floor(static_cast<double>(j) / m.block) <= std::floor(static_cast<double>(pos) / m.block);
          break;
        case sparsa::MaskKind::sliding_window: visible = pos - m.window_left <= j && j <= pos + m.window_right; break;
      }
      for (int64_t bh = 0; bh < s.b * s.hq; ++bh) mask[(bh * s.lq + i) * s.lk + j] = visible;
    }
  }
  return mask;
}

// ---- dense ----
Case dense_case(const AttnSpec& s) {
  Case c;
  c.op = "dense";
  c.params = "dense(" + s.params() + ",seed=" + std::to_string(s.seed) + ")";
  c.prepare = [s] {
    auto in = make_inputs(s);
    Prepared p = attention_prepared(s, *in);
    p.run = [in, s](Backend backend, const Tensor& out, const Tensor& lse) {
      return sparsa::dense(in->q.view, in->k.view, in->v.view, out, lse, in->options(backend, s));
    };
    if (s.mask.is_none()) {
      p.oracle = [in, s] { return oracle_attention(in->q.view, in->k.view, in->v.view, s.effective_scale(), {}); };
      p.oracle_name = "f64 dense oracle";
    } else {
      p.oracle = [in, s] {
        return oracle_attention(in->q.view, in->k.view, in->v.view, s.effective_scale(), rule_mask(s));
      };
      p.oracle_name = "f64 masked-dense oracle (the mask's rule)";
    }
    p.flops = sparsa::attention_flops(static_cast<double>(s.b * s.hq * s.lq * s.lk), s.d);
    p.keep = in;
    return p;
  };
  return c;
}

// ---- block_sparse ----
struct SparseSpec {
  int bq = 16, bkv = 16;
  double density = 0.5;  // probability that a key block is listed
  double empty = 0;      // probability that a query block lists nothing
  bool perm = false;     // random perm_q / perm_kv
  bool full = false;     // every key block listed (must equal dense)
  bool strided = false;  // counts, indices, perm_q, perm_kv as strided views (padded, stride 2 inside)
};

struct IndexData {
  BlockIndexBuffer buffer;
  BlockIndex view;
  std::vector<int32_t> perm_q, perm_kv;  // [b, hq, lq], [b, hkv, lk] (empty: identity)
  std::vector<std::vector<int32_t>> strided_storage;  // backs the views when SparseSpec::strided
  double pairs = 0;           // visible (query, key) pairs
};

std::vector<int32_t> random_permutation(Rng& rng, int64_t n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rng.below(i + 1)]);
  return p;
}

// A copy of a contiguous i32 tensor as a strided view: element stride 2 in the last
// dimension and one spare element per outer row. Gaps hold 0, an in-range value, so a
// backend that ignores the strides computes a wrong result rather than crashing.
Tensor strided_copy(const Tensor& t, std::vector<int32_t>* storage) {
  Tensor v = t;
  v.strides[t.ndim - 1] = 2;
  for (int d = t.ndim - 2; d >= 0; --d) v.strides[d] = v.strides[d + 1] * t.shape[d + 1] + 1;
  storage->assign(static_cast<size_t>(v.strides[0] * t.shape[0]), 0);
  v.data = storage->data();
  const int64_t n = t.numel();
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t src = 0, dst = 0;
    for (int64_t d = t.ndim - 1, rest = flat; d >= 0; rest /= t.shape[d], --d) {
      src += (rest % t.shape[d]) * t.strides[d];
      dst += (rest % t.shape[d]) * v.strides[d];
    }
    (*storage)[dst] = t.ptr<const int32_t>()[src];
  }
  return v;
}

// A seeded plan: each query block lists each key block with probability `density`
// (nothing with probability `empty`), ascending; spare slots hold in-range junk.
std::shared_ptr<IndexData> make_index(const AttnSpec& s, const SparseSpec& sp) {
  Rng rng(s.seed * 7919 + 17);
  auto ix = std::make_shared<IndexData>();
  const int64_t nq = (s.lq + sp.bq - 1) / sp.bq, nkv = (s.lk + sp.bkv - 1) / sp.bkv;
  const int64_t capacity = nkv + 2;  // reading past counts picks junk blocks: a wrong result, not a crash
  BlockIndexBuffer& buf = ix->buffer;
  buf.block_q = sp.bq;
  buf.block_kv = sp.bkv;
  buf.num_q_blocks = nq;
  buf.num_kv_blocks = nkv;
  buf.counts = HostArray(DType::i32, {s.b, s.hq, nq});
  buf.indices = HostArray(DType::i32, {s.b, s.hq, nq, capacity});
  int32_t* counts = buf.counts.ptr<int32_t>();
  int32_t* indices = buf.indices.ptr<int32_t>();
  for (int64_t row = 0; row < s.b * s.hq * nq; ++row) {
    int32_t n = 0;
    const bool empty_row = !sp.full && rng.uniform() < sp.empty;
    for (int64_t kb = 0; kb < nkv && !empty_row; ++kb) {
      if (sp.full || rng.uniform() < sp.density) indices[row * capacity + n++] = static_cast<int32_t>(kb);
    }
    counts[row] = n;
    for (int64_t slot = n; slot < capacity; ++slot) indices[row * capacity + slot] = static_cast<int32_t>(rng.below(nkv));
  }
  std::vector<int32_t> perm_q, perm_kv;  // [b, hq, lq], [b, hkv, lk]
  if (sp.perm) {
    buf.perm_q = HostArray(DType::i32, {s.b, s.hq, s.lq});
    buf.perm_kv = HostArray(DType::i32, {s.b, s.hkv, s.lk});
    for (int64_t r = 0; r < s.b * s.hq; ++r) {
      const auto p = random_permutation(rng, s.lq);
      perm_q.insert(perm_q.end(), p.begin(), p.end());
    }
    for (int64_t r = 0; r < s.b * s.hkv; ++r) {
      const auto p = random_permutation(rng, s.lk);
      perm_kv.insert(perm_kv.end(), p.begin(), p.end());
    }
    std::copy(perm_q.begin(), perm_q.end(), buf.perm_q.ptr<int32_t>());
    std::copy(perm_kv.begin(), perm_kv.end(), buf.perm_kv.ptr<int32_t>());
  }
  ix->view = buf.view();
  if (sp.strided) {
    for (Tensor* t : {&ix->view.counts, &ix->view.indices, &ix->view.perm_q, &ix->view.perm_kv}) {
      if (t->defined()) *t = strided_copy(*t, &ix->strided_storage.emplace_back());
    }
  }
  ix->perm_q = std::move(perm_q);
  ix->perm_kv = std::move(perm_kv);
  for (int64_t row = 0; row < s.b * s.hq * nq; ++row) {
    const int64_t qb = row % nq, q_rows = std::min<int64_t>(sp.bq, s.lq - qb * sp.bq);
    for (int32_t slot = 0; slot < counts[row]; ++slot) {
      const int64_t kb = indices[row * capacity + slot];
      ix->pairs += static_cast<double>(q_rows * std::min<int64_t>(sp.bkv, s.lk - kb * sp.bkv));
    }
  }
  return ix;
}

// The equivalent dense mask [b, hq, lq, lk] of a plan, from the definition in index.h:
// query block qb of (b, h) holds permuted positions [qb*bq, (qb+1)*bq) ∩ [0, lq), i.e.
// tokens perm_q[b, h, p]; it sees the tokens perm_kv[b, h/g, p'] of its listed key blocks.
std::vector<uint8_t> index_mask(const AttnSpec& s, const SparseSpec& sp, const IndexData& ix) {
  std::vector<uint8_t> mask(static_cast<size_t>(s.b * s.hq * s.lq * s.lk), 0);
  const int64_t group = s.hq / s.hkv, nq = ix.buffer.num_q_blocks, capacity = ix.buffer.indices.shape()[3];
  const int32_t* counts = ix.buffer.counts.ptr<int32_t>();
  const int32_t* indices = ix.buffer.indices.ptr<int32_t>();
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t h = 0; h < s.hq; ++h) {
      for (int64_t qb = 0; qb < nq; ++qb) {
        const int64_t row = (b * s.hq + h) * nq + qb;
        for (int32_t slot = 0; slot < counts[row]; ++slot) {
          const int64_t kb = indices[row * capacity + slot];
          for (int64_t pq = qb * sp.bq; pq < std::min<int64_t>((qb + 1) * sp.bq, s.lq); ++pq) {
            const int64_t i = sp.perm ? ix.perm_q[(b * s.hq + h) * s.lq + pq] : pq;
            for (int64_t pk = kb * sp.bkv; pk < std::min<int64_t>((kb + 1) * sp.bkv, s.lk); ++pk) {
              const int64_t j = sp.perm ? ix.perm_kv[(b * s.hkv + h / group) * s.lk + pk] : pk;
              mask[((b * s.hq + h) * s.lq + i) * s.lk + j] = 1;
            }
          }
        }
      }
    }
  }
  return mask;
}

Case block_sparse_case(const AttnSpec& s, const SparseSpec& sp) {
  Case c;
  c.op = sp.full ? "block_sparse_full" : "block_sparse";
  c.params = c.op + "(" + s.params() + ",bq=" + std::to_string(sp.bq) + ",bkv=" + std::to_string(sp.bkv);
  if (!sp.full) c.params += ",density=" + fmt(sp.density) + ",empty=" + fmt(sp.empty);
  c.params += ",perm=" + std::to_string(sp.perm ? 1 : 0) + (sp.strided ? ",ix=strided" : "") +
              ",seed=" + std::to_string(s.seed) + ")";
  c.prepare = [s, sp] {
    auto in = make_inputs(s);
    auto ix = make_index(s, sp);
    Prepared p = attention_prepared(s, *in);
    p.run = [in, ix, s](Backend backend, const Tensor& out, const Tensor& lse) {
      return sparsa::block_sparse(in->q.view, in->k.view, in->v.view, ix->view, out, lse, in->options(backend, s));
    };
    if (!s.mask.is_none()) {  // the plan's pairs that the mask leaves visible
      p.oracle = [in, ix, s, sp] {
        std::vector<uint8_t> mask = index_mask(s, sp, *ix);
        const std::vector<uint8_t> rule = rule_mask(s);
        for (size_t e = 0; e < mask.size(); ++e) mask[e] = mask[e] && rule[e];
        return oracle_attention(in->q.view, in->k.view, in->v.view, s.effective_scale(), mask);
      };
      p.oracle_name = "f64 masked-dense oracle (plan and mask)";
    } else if (sp.full) {  // every block listed: must equal dense attention, whatever the permutations
      p.oracle = [in, s] { return oracle_attention(in->q.view, in->k.view, in->v.view, s.effective_scale(), {}); };
      p.oracle_name = "f64 dense oracle";
    } else {
      p.oracle = [in, ix, s, sp] {
        return oracle_attention(in->q.view, in->k.view, in->v.view, s.effective_scale(), index_mask(s, sp, *ix));
      };
      p.oracle_name = "f64 masked-dense oracle";
    }
    p.flops = sparsa::attention_flops(ix->pairs, s.d);
    p.keep = std::make_shared<std::pair<decltype(in), decltype(ix)>>(in, ix);
    return p;
  };
  return c;
}

// ---- dense over two disjoint key sets, merged by LSE ----
struct SplitInputs {
  std::shared_ptr<AttnInputs> in;
  HostTensor k1, v1, k2, v2;
};

Case split_merge_case(const AttnSpec& s, bool random_split) {
  Case c;
  c.op = "dense_split_merge";
  c.params = "dense_split_merge(" + s.params() + ",split=" + (random_split ? "random" : "contig") +
             ",seed=" + std::to_string(s.seed) + ")";
  c.prepare = [s, random_split] {
    auto sp = std::make_shared<SplitInputs>();
    sp->in = make_inputs(s);
    Rng rng(s.seed * 31 + 5);
    std::vector<int64_t> keys1, keys2;  // both non-empty (lk >= 2)
    if (random_split) {
      for (int64_t j = 0; j < s.lk; ++j) (rng.uniform() < 0.5 ? keys1 : keys2).push_back(j);
      if (keys1.empty()) keys1.push_back(keys2.back()), keys2.pop_back();
      if (keys2.empty()) keys2.push_back(keys1.back()), keys1.pop_back();
    } else {
      const int64_t n1 = rng.range(1, s.lk - 1);
      for (int64_t j = 0; j < s.lk; ++j) (j < n1 ? keys1 : keys2).push_back(j);
    }
    auto gather = [&](const std::vector<float>& values, const std::vector<int64_t>& keys) {
      std::vector<float> g;
      for (int64_t bh = 0; bh < s.b * s.hkv; ++bh)
        for (int64_t j : keys) g.insert(g.end(), values.begin() + (bh * s.lk + j) * s.d, values.begin() + (bh * s.lk + j + 1) * s.d);
      return make_tensor(s.dtype, {s.b, s.hkv, static_cast<int64_t>(keys.size()), s.d}, s.layout, g);
    };
    sp->k1 = gather(sp->in->k_values, keys1);
    sp->v1 = gather(sp->in->v_values, keys1);
    sp->k2 = gather(sp->in->k_values, keys2);
    sp->v2 = gather(sp->in->v_values, keys2);
    Prepared p = attention_prepared(s, *sp->in);
    p.roundings = 2;  // O1, O2 are stored in the input dtype, then the merged O again
    p.run = [sp, s](Backend backend, const Tensor& out, const Tensor& lse) -> Status {
      const auto opt = sp->in->options(backend, s);
      HostArray o1(s.dtype, {s.b, s.hq, s.lq, s.d}), o2(s.dtype, {s.b, s.hq, s.lq, s.d});
      HostArray l1(DType::f32, {s.b, s.hq, s.lq}), l2(DType::f32, {s.b, s.hq, s.lq});
      SPARSA_RETURN_IF_ERROR(sparsa::dense(sp->in->q.view, sp->k1.view, sp->v1.view, o1.view(), l1.view(), opt));
      SPARSA_RETURN_IF_ERROR(sparsa::dense(sp->in->q.view, sp->k2.view, sp->v2.view, o2.view(), l2.view(), opt));
      return sparsa::merge(o1.view(), l1.view(), o2.view(), l2.view(), out, lse, backend);
    };
    p.oracle = [sp, s] {
      return oracle_attention(sp->in->q.view, sp->in->k.view, sp->in->v.view, s.effective_scale(), {});
    };
    p.oracle_name = "f64 dense oracle over all keys";
    p.flops = sparsa::attention_flops(static_cast<double>(s.b * s.hq * s.lq * s.lk), s.d);
    p.keep = sp;
    return p;
  };
  return c;
}

// ---- merge ----
enum class LsePattern { finite, far, one_inf, both_inf, inf_nan, mixed };
const char* pattern_name(LsePattern p) {
  switch (p) {
    case LsePattern::finite: return "finite";
    case LsePattern::far: return "far";
    case LsePattern::one_inf: return "one_inf";
    case LsePattern::both_inf: return "both_inf";
    case LsePattern::inf_nan: return "inf_nan";
    case LsePattern::mixed: return "mixed";
  }
  return "?";
}

struct MergeSpec {
  int64_t b = 1, h = 1, l = 1, d = 64;
  DType dtype = DType::f32;
  Layout layout = Layout::bhsd, out = Layout::bhsd;
  LsePattern lse = LsePattern::finite;
  bool alias = false;  // out, lse are o1, lse1
  uint64_t seed = 1;
};

struct MergeInputs {
  std::vector<float> o1_values, lse1_values;
  HostTensor o1, lse1, o2, lse2;
};

Case merge_case(const MergeSpec& m) {
  Case c;
  c.op = "merge";
  c.params = "merge(b=" + std::to_string(m.b) + ",h=" + std::to_string(m.h) + ",l=" + std::to_string(m.l) +
             ",d=" + std::to_string(m.d) + ",dtype=" + sparsa::dtype_name(m.dtype) + ",layout=" + layout_name(m.layout) +
             ",out=" + layout_name(m.out) + ",lse=" + pattern_name(m.lse) + ",alias=" + (m.alias ? "1" : "0") +
             ",seed=" + std::to_string(m.seed) + ")";
  c.prepare = [m] {
    Rng rng(m.seed);
    auto in = std::make_shared<MergeInputs>();
    const int64_t rows = m.b * m.h * m.l;
    in->o1_values = normal_values(rng, rows * m.d, 1.0);
    std::vector<float> o2_values = normal_values(rng, rows * m.d, 1.0);
    std::vector<float> lse2_values(static_cast<size_t>(rows));
    in->lse1_values.resize(static_cast<size_t>(rows));
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      float l1 = static_cast<float>(-20 + 60 * rng.uniform());
      float l2 = static_cast<float>(l1 + 4 * rng.normal());
      LsePattern pattern = m.lse;
      if (pattern == LsePattern::mixed) {
        pattern = rng.pick({LsePattern::finite, LsePattern::far, LsePattern::one_inf, LsePattern::both_inf, LsePattern::inf_nan});
      }
      if (pattern == LsePattern::far) l2 = l1 + static_cast<float>(rng.pick({-1, 1}) * (80 + 40 * rng.uniform()));  // one weight underflows
      // A -inf side keeps its (finite) O values: the contract is that it contributes nothing.
      if (pattern == LsePattern::one_inf) (rng.uniform() < 0.5 ? l1 : l2) = neg_inf;
      if (pattern == LsePattern::both_inf) l1 = l2 = neg_inf;
      // A -inf side whose O is NaN (a partial result that saw no key and left O unwritten):
      // it still contributes nothing.
      if (pattern == LsePattern::inf_nan) {
        const int64_t sides = rng.range(1, 3);  // 1: o1, 2: o2, 3: both
        for (int64_t t = 0; t < m.d; ++t) {
          if (sides & 1) in->o1_values[r * m.d + t] = std::numeric_limits<float>::quiet_NaN();
          if (sides & 2) o2_values[r * m.d + t] = std::numeric_limits<float>::quiet_NaN();
        }
        if (sides & 1) l1 = neg_inf;
        if (sides & 2) l2 = neg_inf;
      }
      in->lse1_values[r] = l1;
      lse2_values[r] = l2;
    }
    const Layout o1_layout = m.alias ? m.out : m.layout;
    in->o1 = make_tensor(m.dtype, {m.b, m.h, m.l, m.d}, o1_layout, in->o1_values);
    in->lse1 = make_tensor(DType::f32, {m.b, m.h, m.l}, o1_layout, in->lse1_values);
    in->o2 = make_tensor(m.dtype, {m.b, m.h, m.l, m.d}, m.layout, o2_values);
    in->lse2 = make_tensor(DType::f32, {m.b, m.h, m.l}, m.layout, lse2_values);
    Prepared p;
    p.shape = {m.b, m.h, m.l, m.d};
    p.out_dtype = m.dtype;
    p.out_layout = m.out;
    p.run = [in, m](Backend backend, const Tensor& out, const Tensor& lse) -> Status {
      if (!m.alias) return sparsa::merge(in->o1.view, in->lse1.view, in->o2.view, in->lse2.view, out, lse, backend);
      // Aliasing: o1/lse1 live in the output buffers (same layout), merged in place.
      for (int64_t i = 0; i < m.b * m.h * m.l * m.d; ++i) {
        const int64_t t = i % m.d, r = i / m.d;
        const int64_t l = r % m.l, h = (r / m.l) % m.h, b = r / (m.l * m.h);
        std::memcpy(static_cast<std::byte*>(out.data) + out.offset({b, h, l, t}) * sparsa::dtype_size(m.dtype),
                    static_cast<const std::byte*>(in->o1.view.data) + in->o1.view.offset({b, h, l, t}) * sparsa::dtype_size(m.dtype),
                    sparsa::dtype_size(m.dtype));
        if (t == 0) static_cast<float*>(lse.data)[lse.offset({b, h, l})] = in->lse1_values[r];
      }
      return sparsa::merge(out, lse, in->o2.view, in->lse2.view, out, lse, backend);
    };
    p.oracle = [in] { return oracle_merge(in->o1.view, in->lse1.view, in->o2.view, in->lse2.view); };
    p.oracle_name = "f64 merge formula";
    p.flops = 4.0 * rows * m.d;
    p.bytes = 3.0 * rows * m.d * sparsa::dtype_size(m.dtype) + 12.0 * rows;
    p.keep = in;
    return p;
  };
  return c;
}

// ---- the lists ----
const DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};
const Layout kLayouts[] = {Layout::bhsd, Layout::bshd, Layout::pad};

// Awkward lengths: 1, 3, 17, 113 and random; 1023 rarely (it costs the f64 oracles most).
int64_t fuzz_length(Rng& rng, int64_t max_random) {
  const double u = rng.uniform();
  if (u < 0.4) return rng.pick<int64_t>({1, 3, 17, 113});
  if (u < 0.45) return 1023;
  return rng.range(1, max_random);
}

AttnSpec fuzz_attn(Rng& rng, uint64_t seed, bool full) {
  AttnSpec s;
  s.seed = seed;
  s.hkv = rng.pick<int64_t>({1, 1, 2, 3});
  s.hq = s.hkv * rng.pick<int64_t>({1, 2, 4, 8});
  s.b = rng.pick<int64_t>({1, 1, 2, 3});
  s.lq = fuzz_length(rng, full ? 600 : 200);
  s.lk = fuzz_length(rng, full ? 600 : 200);
  s.d = rng.pick<int64_t>({16, 40, 64, 64, 72, 128, 8, 3});
  s.dtype = rng.pick({DType::f32, DType::f32, DType::f16, DType::bf16});
  s.layout = kLayouts[rng.below(3)];
  s.out = kLayouts[rng.below(3)];
  if (rng.uniform() < 0.3) s.scale = rng.pick({0.02, 0.3, 0.5, 1.0});
  // Keep one case under ~60M multiply-adds per pass (cpu_ref and the oracle are plain f64 loops).
  const double budget = full ? 2e8 : 6e7;
  while (s.b * s.hq * s.lq * s.lk * s.d > budget && (s.b > 1 || s.hq > s.hkv)) {
    if (s.b > 1) --s.b;
    else s.hq = s.hkv;
  }
  while (s.b * s.hq * s.lq * s.lk * s.d > budget && s.hkv > 1) s.hq = s.hkv = 1;
  while (s.b * s.hq * s.lq * s.lk * s.d > budget && s.d > 16) s.d /= 2;
  return s;
}

SparseSpec fuzz_sparse(Rng& rng) {
  SparseSpec sp;
  sp.bq = rng.pick({16, 64, 128, 48, 1, 7, 200, static_cast<int>(rng.range(2, 100))});
  sp.bkv = rng.pick({16, 64, 128, 48, 1, 7, 200, static_cast<int>(rng.range(2, 100))});
  sp.density = rng.pick({0.1, 0.3, 0.5, 0.9});
  sp.empty = rng.pick({0.0, 0.0, 0.2, 0.5});
  sp.perm = rng.uniform() < 0.5;
  sp.strided = rng.uniform() < 0.3;
  return sp;
}

}  // namespace

std::vector<Case> make_cases(uint64_t seed, bool full, bool perf) {
  std::vector<Case> cases;
  uint64_t next_seed = 1;  // fixed cases: their own seeds, independent of --seed

  // dense: every pair of awkward lengths, GQA ratios, head dims, dtypes, layouts, scales.
  for (int64_t lq : {1, 3, 17, 113})
    for (int64_t lk : {1, 3, 17, 113, 1023}) {
      AttnSpec s{.b = 1, .hq = 2, .hkv = 1, .lq = lq, .lk = lk, .d = 64, .seed = next_seed++};
      cases.push_back(dense_case(s));
    }
  cases.push_back(dense_case({.b = 1, .hq = 1, .hkv = 1, .lq = 1023, .lk = 1023, .d = 64, .seed = next_seed++}));
  for (auto [hq, hkv] : {std::pair{1, 1}, {2, 1}, {4, 1}, {8, 1}, {8, 2}, {8, 4}, {6, 3}, {4, 4}})
    cases.push_back(dense_case({.b = 2, .hq = hq, .hkv = hkv, .lq = 33, .lk = 70, .d = 64, .seed = next_seed++}));
  for (int64_t d : {1, 3, 16, 40, 64, 72, 128, 256})
    for (DType dt : kDTypes)
      cases.push_back(dense_case({.b = 1, .hq = 2, .hkv = 2, .lq = 19, .lk = 67, .d = d, .dtype = dt, .seed = next_seed++}));
  for (Layout in : kLayouts)
    for (Layout out : kLayouts)
      for (DType dt : kDTypes)
        cases.push_back(dense_case({.b = 2, .hq = 4, .hkv = 2, .lq = 37, .lk = 45, .d = 40, .dtype = dt,
                                    .layout = in, .out = out, .seed = next_seed++}));
  for (double scale : {1e-4, 0.01, 0.3, 1.0, 4.0, 50.0})
    cases.push_back(dense_case({.b = 1, .hq = 2, .hkv = 1, .lq = 17, .lk = 113, .d = 64, .scale = scale, .seed = next_seed++}));
  for (int threads : {1, 3, 7})  // more threads than work items, and fewer
    cases.push_back(dense_case({.b = 1, .hq = 2, .hkv = 1, .lq = 200, .lk = 90, .d = 64, .seed = next_seed++, .threads = threads}));
  cases.push_back(dense_case({.b = 2, .hq = 8, .hkv = 2, .lq = 113, .lk = 1023, .d = 64, .dtype = DType::f16,
                              .layout = Layout::bshd, .out = Layout::pad, .seed = 7}));

  // (1) block_sparse with every block listed equals dense (with and without permutations).
  for (auto [bq, bkv] : {std::pair{16, 16}, {64, 64}, {128, 128}, {48, 16}, {7, 200}, {1, 1}, {200, 3}})
    for (bool perm : {false, true}) {
      AttnSpec s{.b = 1, .hq = 4, .hkv = 2, .lq = 113, .lk = 131, .d = 64, .layout = Layout::bshd, .seed = next_seed++};
      cases.push_back(block_sparse_case(s, {.bq = bq, .bkv = bkv, .perm = perm, .full = true, .strided = perm}));
    }
  cases.push_back(block_sparse_case({.b = 1, .hq = 2, .hkv = 1, .lq = 300, .lk = 1023, .d = 128, .dtype = DType::bf16,
                                     .out = Layout::pad, .seed = next_seed++},
                                    {.bq = 64, .bkv = 128, .perm = true, .full = true}));

  // (2) random plans against the masked-dense oracle; (4) empty rows: empty=1 lists nothing at all.
  for (auto [bq, bkv] : {std::pair{16, 16}, {64, 64}, {128, 128}, {48, 48}, {16, 64}, {64, 16}, {7, 13}, {1, 5}})
    for (bool perm : {false, true})
      for (DType dt : {DType::f32, DType::bf16}) {
        AttnSpec s{.b = 2, .hq = 4, .hkv = 1, .lq = 150, .lk = 211, .d = 64, .dtype = dt, .layout = Layout::pad,
                   .out = Layout::bshd, .seed = next_seed++};
        cases.push_back(block_sparse_case(
            s, {.bq = bq, .bkv = bkv, .density = 0.4, .empty = 0.2, .perm = perm, .strided = dt == DType::bf16}));
      }
  for (int threads : {1, 5})
    cases.push_back(block_sparse_case({.b = 1, .hq = 2, .hkv = 1, .lq = 130, .lk = 130, .d = 40, .seed = next_seed++,
                                       .threads = threads},
                                      {.bq = 32, .bkv = 16, .density = 0.3, .empty = 0.3, .perm = true}));
  for (double empty : {0.5, 1.0})
    for (bool perm : {false, true})
      cases.push_back(block_sparse_case({.b = 1, .hq = 2, .hkv = 2, .lq = 100, .lk = 77, .d = 16, .seed = next_seed++},
                                        {.bq = 16, .bkv = 16, .density = 0.5, .empty = empty, .perm = perm}));
  for (DType dt : kDTypes)
    cases.push_back(block_sparse_case({.b = 1, .hq = 8, .hkv = 2, .lq = 1023, .lk = 1023, .d = 64, .dtype = dt,
                                       .layout = Layout::bshd, .out = Layout::pad, .seed = next_seed++},
                                      {.bq = 64, .bkv = 64, .density = 0.15, .empty = 0.1, .perm = true}));

  // (6) masks (docs/masks.md), dense and over plans (permuted too): lengths off every tile and
  // block, len_q != len_kv both ways (causal with lq > lk leaves empty rows), every dtype,
  // head_dim 64 / 128 / 256, strided layouts.
  for (sparsa::Mask mask : {sparsa::Mask::causal(), sparsa::Mask::block_causal(16), sparsa::Mask::block_causal(5),
                            sparsa::Mask::sliding_window(20), sparsa::Mask::sliding_window(17, 0)}) {
    int variant = 0;
    for (auto [lq, lk] : {std::pair<int64_t, int64_t>{113, 113}, {37, 150}, {150, 37}}) {
      for (DType dt : kDTypes) {
        const int64_t d = std::array<int64_t, 3>{64, 128, 256}[variant++ % 3];
        cases.push_back(dense_case({.b = 2, .hq = 4, .hkv = 2, .lq = lq, .lk = lk, .d = d, .dtype = dt,
                                    .layout = dt == DType::f32 ? Layout::bshd : Layout::bhsd, .out = Layout::pad,
                                    .seed = next_seed++, .mask = mask}));
      }
      for (bool perm : {false, true})
        cases.push_back(block_sparse_case({.b = 1, .hq = 4, .hkv = 1, .lq = lq, .lk = lk, .d = 64, .dtype = DType::bf16,
                                           .layout = Layout::pad, .seed = next_seed++, .mask = mask},
                                          {.bq = 32, .bkv = 16, .density = 0.6, .empty = 0.1, .perm = perm}));
    }
  }

  // (3) dense over two disjoint key sets, merged, equals dense over all keys.
  for (bool random_split : {false, true})
    for (DType dt : kDTypes) {
      cases.push_back(split_merge_case({.b = 2, .hq = 4, .hkv = 2, .lq = 57, .lk = 301, .d = 64, .dtype = dt,
                                        .layout = Layout::bshd, .out = Layout::pad, .seed = next_seed++}, random_split));
      cases.push_back(split_merge_case({.b = 1, .hq = 1, .hkv = 1, .lq = 3, .lk = 2, .d = 16, .dtype = dt, .seed = next_seed++},
                                       random_split));
    }

  // (5) merge: finite, far apart (a weight underflows), one side -inf, both -inf, mixed; aliasing.
  for (LsePattern pattern :
       {LsePattern::finite, LsePattern::far, LsePattern::one_inf, LsePattern::both_inf, LsePattern::inf_nan, LsePattern::mixed})
    for (DType dt : kDTypes)
      for (bool alias : {false, true})
        cases.push_back(merge_case({.b = 2, .h = 3, .l = 37, .d = 72, .dtype = dt, .layout = Layout::pad,
                                    .out = alias ? Layout::bshd : Layout::pad, .lse = pattern, .alias = alias, .seed = next_seed++}));
  cases.push_back(merge_case({.b = 1, .h = 1, .l = 1, .d = 1, .lse = LsePattern::mixed, .seed = next_seed++}));

  // Fuzzed shapes and plans from the seed.
  const int fuzz = full ? 600 : 110;
  for (int n = 0; n < fuzz; ++n) {
    const uint64_t case_seed = seed * 1000003 + static_cast<uint64_t>(n);
    Rng rng(case_seed);
    const double u = rng.uniform();
    AttnSpec s = fuzz_attn(rng, case_seed, full);
    if (u < 0.3) {
      cases.push_back(dense_case(s));
    } else if (u < 0.75) {
      cases.push_back(block_sparse_case(s, fuzz_sparse(rng)));
    } else if (u < 0.83) {
      SparseSpec sp = fuzz_sparse(rng);
      sp.full = true;
      cases.push_back(block_sparse_case(s, sp));
    } else if (u < 0.92) {
      s.lk = std::max<int64_t>(s.lk, 2);
      cases.push_back(split_merge_case(s, rng.uniform() < 0.5));
    } else {
      cases.push_back(merge_case({.b = s.b, .h = s.hq, .l = s.lq, .d = s.d, .dtype = s.dtype, .layout = s.layout,
                                  .out = s.out, .lse = LsePattern::mixed, .alias = rng.uniform() < 0.3, .seed = case_seed}));
    }
  }

  // Perf: shapes the fast path is meant for (not run in test mode: cpu_ref would take minutes).
  if (perf) {
    for (int64_t d : {64, 128})
      for (DType dt : {DType::f32, DType::bf16}) {
        AttnSpec s{.b = 1, .hq = 8, .hkv = 8, .lq = 2048, .lk = 2048, .d = d, .dtype = dt, .seed = 1};
        Case c = dense_case(s);
        c.perf_only = true;
        cases.push_back(c);
        c = block_sparse_case(s, {.bq = 64, .bkv = 64, .density = 0.2});
        c.perf_only = true;
        cases.push_back(c);
      }
    Case c = merge_case({.b = 1, .h = 32, .l = 2048, .d = 128, .lse = LsePattern::finite, .seed = 1});
    c.perf_only = true;
    cases.push_back(c);
  }

  // Parameter strings name a case on the command line; equal strings are the same case.
  std::set<std::string> seen;
  std::erase_if(cases, [&](const Case& c) { return !seen.insert(c.params).second; });
  return cases;
}

}  // namespace ops
