// LoSA and its baselines: the per-layer prefix-attention state machine (sparsa/losa.h).
//
// Every attention in here is one of the library's executors: dense() for dense prefix
// and intra-block attention, paged_attention() (block_sparse over the gathered union)
// for sparse prefix attention, merge() for the LSE merge. The backend option picks
// cpu_ref or cpu for all of them; the bookkeeping (MSE, active rows, scatter of the
// recomputed rows) is plain code shared by both.
#include "sparsa/losa.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/attention_params.h"
#include "core/validate.h"

namespace sparsa {

const char* prefix_method_name(PrefixMethod method) {
  switch (method) {
    case PrefixMethod::dense: return "dense";
    case PrefixMethod::quest: return "quest";
    case PrefixMethod::losa: return "losa";
    case PrefixMethod::reuse: return "reuse";
  }
  return "?";
}

Result<PrefixMethod> parse_prefix_method(const std::string& name) {
  if (name == "dense") return PrefixMethod::dense;
  if (name == "quest") return PrefixMethod::quest;
  if (name == "losa") return PrefixMethod::losa;
  if (name == "reuse") return PrefixMethod::reuse;
  return invalid_argument("method: expected dense, quest, losa or reuse, got '" + name + "'");
}

Status validate(const LosaConfig& c, const LosaOptions& o, int page_size) {
  if (c.heads_q < 1) return invalid_argument("heads_q: expected >= 1, got " + std::to_string(c.heads_q));
  if (c.heads_kv < 1) return invalid_argument("heads_kv: expected >= 1, got " + std::to_string(c.heads_kv));
  if (c.heads_q % c.heads_kv != 0) {
    return invalid_argument("heads_kv: heads_q (" + std::to_string(c.heads_q) + ") must be a multiple of heads_kv (" +
                            std::to_string(c.heads_kv) + ")");
  }
  if (c.head_dim < 1 || c.head_dim > 1024) {
    return invalid_argument("head_dim: expected 1 to 1024, got " + std::to_string(c.head_dim));
  }
  if (c.block_size < 1 || c.block_size > 1024) {
    return invalid_argument("block_size: expected 1 to 1024 tokens, got " + std::to_string(c.block_size));
  }
  const int m = static_cast<int>(o.method);
  if (m < 0 || m > static_cast<int>(PrefixMethod::reuse)) {
    return invalid_argument("method: expected dense, quest, losa or reuse, got " + std::to_string(m));
  }
  if (o.method == PrefixMethod::losa || o.method == PrefixMethod::reuse) {
    if (o.mse_threshold) {
      if (!std::isfinite(*o.mse_threshold) || *o.mse_threshold < 0) {
        return invalid_argument("mse_threshold: expected a finite number >= 0, got " + std::to_string(*o.mse_threshold));
      }
    } else if (o.active_k < 0 || o.active_k > c.block_size) {
      return invalid_argument("active_k: expected 0 to block_size (" + std::to_string(c.block_size) +
                              ") active tokens per step, got " + std::to_string(o.active_k));
    }
  }
  if (o.method == PrefixMethod::losa || o.method == PrefixMethod::quest) {
    SPARSA_RETURN_IF_ERROR(validate(o.select, page_size));
  }
  if (o.attention.backend != Backend::cpu_ref && o.attention.backend != Backend::cpu) {
    return Status(StatusCode::unsupported, std::string("backend: prefix attention state runs on cpu_ref or cpu, got ") +
                                               backend_name(o.attention.backend));
  }
  if (o.attention.num_threads < 0 || o.attention.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(o.attention.num_threads));
  }
  return {};
}

std::vector<double> query_mse(const Tensor& q, const Tensor& q_ref) {
  const int64_t H = q.shape[1], B = q.shape[2], D = q.shape[3];
  std::vector<double> mse(B, 0.0);
  for (int64_t i = 0; i < B; ++i) {
    double sum = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const float* a = q.ptr<const float>() + q.offset({0, h, i, 0});
      const float* b = q_ref.ptr<const float>() + q_ref.offset({0, h, i, 0});
      for (int64_t t = 0; t < D; ++t) {
        const double diff = static_cast<double>(a[t]) - b[t];
        sum += diff * diff;
      }
    }
    mse[i] = sum / static_cast<double>(H * D);
  }
  return mse;
}

std::vector<int64_t> active_rows(const std::vector<double>& mse, int active_k, std::optional<double> threshold) {
  const int64_t n = static_cast<int64_t>(mse.size());
  std::vector<int64_t> rows;
  if (threshold) {
    for (int64_t i = 0; i < n; ++i)
      if (mse[i] > *threshold || std::isnan(mse[i])) rows.push_back(i);
    return rows;
  }
  rows.resize(n);
  std::iota(rows.begin(), rows.end(), 0);
  const int64_t k = std::clamp<int64_t>(active_k, 0, n);
  // Larger MSE first (NaN first: a broken query must not hide as stable), ties to the lower row.
  auto before = [&](int64_t a, int64_t b) {
    const bool na = std::isnan(mse[a]), nb = std::isnan(mse[b]);
    if (na != nb) return na;
    if (!na && mse[a] != mse[b]) return mse[a] > mse[b];
    return a < b;
  };
  std::partial_sort(rows.begin(), rows.begin() + k, rows.end(), before);
  rows.resize(k);
  std::sort(rows.begin(), rows.end());
  return rows;
}

Result<PrefixAttention> PrefixAttention::create(const LosaConfig& config, const LosaOptions& options) {
  SPARSA_RETURN_IF_ERROR(validate(config, options));
  SPARSA_RETURN_IF_ERROR(backend_status(options.attention.backend));
  PrefixAttention pa;
  pa.config_ = config;
  pa.options_ = options;
  const int64_t H = config.heads_q, B = config.block_size, D = config.head_dim;
  pa.o_p_ = HostArray(DType::f32, {1, H, B, D});
  pa.l_p_ = HostArray(DType::f32, {1, H, B});
  pa.q_ref_ = HostArray(DType::f32, {1, H, B, D});
  pa.o_b_ = HostArray(DType::f32, {1, H, B, D});
  pa.l_b_ = HostArray(DType::f32, {1, H, B});
  return pa;
}

Status PrefixAttention::check_step_inputs(const PagedKVCache& cache, const Tensor& q, const Tensor& k_block,
                                          const Tensor& v_block, const Tensor& out, const Tensor& lse) const {
  if (config_.heads_q < 1) return invalid_argument("PrefixAttention: not created (use PrefixAttention::create)");
  const int64_t H = config_.heads_q, Hkv = config_.heads_kv, B = config_.block_size, D = config_.head_dim;
  if (cache.heads_kv() != Hkv || cache.head_dim() != D) {
    return invalid_argument("cache: expected heads_kv " + std::to_string(Hkv) + " and head_dim " + std::to_string(D) +
                            ", got " + std::to_string(cache.heads_kv()) + " and " + std::to_string(cache.head_dim()));
  }
  if (options_.method == PrefixMethod::losa || options_.method == PrefixMethod::quest) {
    SPARSA_RETURN_IF_ERROR(validate(options_.select, cache.page_size()));
  }
  struct Want { const char* name; const Tensor* t; int64_t heads; };
  for (Want w : {Want{"q", &q, H}, Want{"k_block", &k_block, Hkv}, Want{"v_block", &v_block, Hkv}}) {
    SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor(w.name, *w.t, Device{}));
    SPARSA_RETURN_IF_ERROR(detail::check_dtype(w.name, *w.t, DType::f32));
    if (w.t->shape[2] != B) {
      return invalid_argument(std::string(w.name) + ": expected block_size " + std::to_string(B) +
                              " tokens (dim 2), got " + std::to_string(w.t->shape[2]));
    }
    SPARSA_RETURN_IF_ERROR(detail::check_shape(w.name, *w.t, {1, w.heads, B, D}));
  }
  SPARSA_RETURN_IF_ERROR(detail::check_shape("out", out, {1, H, B, D}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("out", out, DType::f32));
  SPARSA_RETURN_IF_ERROR(detail::check_shape("lse", lse, {1, H, B}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("lse", lse, DType::f32));
  if (options_.attention.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k_block", k_block));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("v_block", v_block));
  }
  return {};
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// q rows `rows` of q into a contiguous f32 [1, H, n, D].
HostArray gather_rows(const Tensor& q, const std::vector<int64_t>& rows) {
  const int64_t H = q.shape[1], D = q.shape[3], n = static_cast<int64_t>(rows.size());
  HostArray sub(DType::f32, {1, H, n, D});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i)
      detail::load_row(q.data, DType::f32, q.offset({0, h, rows[i], 0}), D, sub.ptr<float>() + (h * n + i) * D);
  return sub;
}

// Writes the recomputed rows' O_p, L_p and Q_ref from sub-results over `rows`.
void scatter_rows(const HostArray& o_sub, const HostArray& l_sub, const Tensor& q,
                         const std::vector<int64_t>& rows, HostArray& o_p, HostArray& l_p, HostArray& q_ref) {
  const int64_t H = o_p.shape()[1], B = o_p.shape()[2], D = o_p.shape()[3], n = static_cast<int64_t>(rows.size());
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[i];
      std::memcpy(o_p.ptr<float>() + (h * B + r) * D, o_sub.ptr<float>() + (h * n + i) * D, D * sizeof(float));
      l_p.ptr<float>()[h * B + r] = l_sub.ptr<float>()[h * n + i];
      detail::load_row(q.data, DType::f32, q.offset({0, h, r, 0}), D, q_ref.ptr<float>() + (h * B + r) * D);
    }
  }
}

}  // namespace

Status PrefixAttention::prefix_dense(const PagedKVCache& cache, const Tensor& q, const std::vector<int64_t>& rows,
                                     StepStats* s) {
  const int64_t H = config_.heads_q, D = config_.head_dim, n = static_cast<int64_t>(rows.size());
  s->dense_prefix = true;
  if (n == 0) return {};
  HostArray o_sub(DType::f32, {1, H, n, D}), l_sub(DType::f32, {1, H, n});
  if (cache.length() == 0) {  // no prefix: O = 0, LSE = -inf
    std::fill_n(l_sub.ptr<float>(), H * n, -std::numeric_limits<float>::infinity());
  } else {
    HostArray q_sub = gather_rows(q, rows);
    SPARSA_RETURN_IF_ERROR(dense(q_sub.view(), cache.keys(), cache.values(), o_sub.view(), l_sub.view(), options_.attention));
    s->pages_loaded = cache.num_pages() * cache.heads_kv();
    s->tokens_loaded = cache.length() * cache.heads_kv();
    s->pages_attended = cache.num_pages() * H * n;
  }
  scatter_rows(o_sub, l_sub, q, rows, o_p_, l_p_, q_ref_);
  return {};
}

Status PrefixAttention::prefix_sparse(const PagedKVCache& cache, const Tensor& q, const std::vector<int64_t>& rows,
                                      StepStats* s) {
  const int64_t H = config_.heads_q, D = config_.head_dim, n = static_cast<int64_t>(rows.size());
  if (n == 0) return {};
  HostArray q_sub = gather_rows(q, rows);
  auto t0 = Clock::now();
  auto plan = select_pages(q_sub.view(), cache, options_.select, options_.attention.num_threads);
  if (!plan.ok()) return plan.status();
  s->select_ms = ms_since(t0);
  HostArray o_sub(DType::f32, {1, H, n, D}), l_sub(DType::f32, {1, H, n});
  PagedAttentionOptions po;
  po.attention = options_.attention;
  po.attend_union = options_.attend_union;
  PagedAttentionStats ps;
  SPARSA_RETURN_IF_ERROR(paged_attention(q_sub.view(), cache, *plan, o_sub.view(), l_sub.view(), po, &ps));
  s->pages_loaded = ps.pages_loaded;
  s->tokens_loaded = ps.tokens_loaded;
  s->pages_attended = ps.pages_attended;
  s->loaded = std::move(ps.loaded);
  s->plan = std::move(*plan);
  scatter_rows(o_sub, l_sub, q, rows, o_p_, l_p_, q_ref_);
  return {};
}

Status PrefixAttention::step(const PagedKVCache& cache, const Tensor& q, const Tensor& k_block, const Tensor& v_block,
                             const Tensor& out, const Tensor& lse, StepStats* stats) {
  const auto t_start = Clock::now();
  SPARSA_RETURN_IF_ERROR(check_step_inputs(cache, q, k_block, v_block, out, lse));
  const int64_t B = config_.block_size;
  StepStats local;
  StepStats& s = stats ? *stats : local;
  s = StepStats{};
  s.block = blocks_committed_;
  s.step = steps_in_block_;
  s.prefix_pages = cache.num_pages();
  const bool first = steps_in_block_ == 0;

  std::vector<int64_t> all(B);
  std::iota(all.begin(), all.end(), 0);
  const PrefixMethod m = options_.method;
  if (first || m == PrefixMethod::dense || m == PrefixMethod::quest) {
    s.mse.assign(B, 0.0);
    s.recomputed = all;
  } else {
    s.mse = query_mse(q, q_ref_.view());
    s.recomputed = active_rows(s.mse, options_.active_k, options_.mse_threshold);
  }

  auto t0 = Clock::now();
  const bool sparse = m == PrefixMethod::quest || (m == PrefixMethod::losa && !first);
  if (sparse) {
    SPARSA_RETURN_IF_ERROR(prefix_sparse(cache, q, s.recomputed, &s));
  } else {
    SPARSA_RETURN_IF_ERROR(prefix_dense(cache, q, s.recomputed, &s));
  }
  s.prefix_ms = ms_since(t0);

  // Intra-block attention over the block's own keys, every step, merged by LSE.
  t0 = Clock::now();
  SPARSA_RETURN_IF_ERROR(dense(q, k_block, v_block, o_b_.view(), l_b_.view(), options_.attention));
  SPARSA_RETURN_IF_ERROR(merge(o_p_.view(), l_p_.view(), o_b_.view(), l_b_.view(), out, lse, options_.attention.backend));
  s.block_ms = ms_since(t0);

  ++steps_in_block_;
  s.total_ms = ms_since(t_start);
  return {};
}

Status PrefixAttention::commit(PagedKVCache& cache, const Tensor& k_block, const Tensor& v_block) {
  if (config_.heads_q < 1) return invalid_argument("PrefixAttention: not created (use PrefixAttention::create)");
  const int64_t Hkv = config_.heads_kv, B = config_.block_size, D = config_.head_dim;
  for (auto [name, t] : {std::pair{"k_block", &k_block}, std::pair{"v_block", &v_block}}) {
    SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor(name, *t, Device{}));
    SPARSA_RETURN_IF_ERROR(detail::check_shape(name, *t, {1, Hkv, B, D}));
  }
  SPARSA_RETURN_IF_ERROR(cache.append(k_block, v_block));
  ++blocks_committed_;
  steps_in_block_ = 0;
  return {};
}

}  // namespace sparsa
