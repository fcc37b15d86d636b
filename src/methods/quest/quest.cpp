// Page selection (QUEST, pooled) and attention over selected pages (sparsa/quest.h).
#include "sparsa/quest.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "core/attention_params.h"
#include "core/validate.h"
#include "cpu/parallel.h"

namespace sparsa {

const char* page_selector_name(PageSelector selector) {
  switch (selector) {
    case PageSelector::quest: return "quest";
    case PageSelector::pooled: return "pooled";
  }
  return "?";
}

Result<PageSelector> parse_page_selector(const std::string& name) {
  if (name == "quest") return PageSelector::quest;
  if (name == "pooled") return PageSelector::pooled;
  return invalid_argument("selector: expected quest or pooled, got '" + name + "'");
}

Status validate(const PageSelectOptions& options, int page_size) {
  if (page_size < 1) return invalid_argument("page_size: expected >= 1, got " + std::to_string(page_size));
  if (options.budget <= 0 || options.budget % page_size != 0) {
    return invalid_argument("budget: expected a positive multiple of the page size " + std::to_string(page_size) +
                            " (tokens per query), got " + std::to_string(options.budget));
  }
  const int64_t forced = int64_t{options.force_first} + int64_t{options.force_last};
  if (options.budget / page_size < forced) {
    return invalid_argument("budget: " + std::to_string(options.budget) + " tokens is " +
                            std::to_string(options.budget / page_size) + " page(s), fewer than the " +
                            std::to_string(forced) + " forced (first/last) pages");
  }
  if (options.group != GroupPolicy::per_head && options.group != GroupPolicy::shared) {
    return invalid_argument("group: expected per_head or shared, got " + std::to_string(static_cast<int>(options.group)));
  }
  if (options.selector != PageSelector::quest && options.selector != PageSelector::pooled) {
    return invalid_argument("selector: expected quest or pooled, got " +
                            std::to_string(static_cast<int>(options.selector)));
  }
  return {};
}

// Both scores accumulate in kLanes independent f32 partial sums (lane j takes dims
// j, j + kLanes, ...) added at the end, so the compiler vectorises the loop without
// reassociating; every backend uses this one order.
constexpr int kLanes = 16;

float quest_page_score(const float* q, const float* page_min, const float* page_max, int64_t head_dim) {
  float lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= head_dim; t += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float a = q[t + j] * page_max[t + j], b = q[t + j] * page_min[t + j];
      lanes[j] += a < b ? b : a;
    }
  }
  float score = 0.0f;
  for (int j = 0; j < kLanes; ++j) score += lanes[j];
  for (; t < head_dim; ++t) score += std::max(q[t] * page_max[t], q[t] * page_min[t]);
  return score;
}

float pooled_page_score(const float* q, const float* page_key_sum, int64_t page_length, int64_t head_dim) {
  float lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= head_dim; t += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += q[t + j] * page_key_sum[t + j];
  float dot = 0.0f;
  for (int j = 0; j < kLanes; ++j) dot += lanes[j];
  for (; t < head_dim; ++t) dot += q[t] * page_key_sum[t];
  return dot / static_cast<float>(page_length);
}

namespace {

Status check_query(const char* name, const Tensor& q, const PagedKVCache& cache) {
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor(name, q, Device{}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype(name, q, DType::f32));
  if (q.shape[0] != 1) {
    return invalid_argument(std::string(name) + ": expected batch 1 (one sequence per cache), got " +
                            std::to_string(q.shape[0]));
  }
  if (q.shape[3] != cache.head_dim()) {
    return invalid_argument(std::string(name) + ": head_dim " + std::to_string(q.shape[3]) +
                            " differs from the cache's head_dim " + std::to_string(cache.head_dim()));
  }
  if (cache.heads_kv() < 1 || q.shape[1] % cache.heads_kv() != 0) {
    return invalid_argument(std::string(name) + ": heads_q (" + std::to_string(q.shape[1]) +
                            ") must be a multiple of the cache's heads_kv (" + std::to_string(cache.heads_kv()) + ")");
  }
  return {};
}

// Score order: higher score first, then lower page index; NaN scores rank last.
struct ScoreOrder {
  const float* score;
  bool operator()(int32_t a, int32_t b) const {
    const float sa = score[a], sb = score[b];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa > sb;
    return a < b;
  }
};

}  // namespace

Result<PagePlan> select_pages(const Tensor& q, const PagedKVCache& cache, const PageSelectOptions& options,
                              int num_threads) {
  SPARSA_RETURN_IF_ERROR(check_query("q", q, cache));
  SPARSA_RETURN_IF_ERROR(validate(options, cache.page_size()));
  if (num_threads < 0 || num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) + " (0 = hardware concurrency), got " + std::to_string(num_threads));
  }
  const int64_t heads_q = q.shape[1], rows = q.shape[2], d = q.shape[3];
  const int64_t group = heads_q / cache.heads_kv();
  const int64_t num_pages = cache.num_pages();
  const int64_t keep = std::min<int64_t>(options.budget / cache.page_size(), num_pages);

  PagePlan plan;
  plan.heads_q = heads_q;
  plan.rows = rows;
  plan.capacity = keep;
  plan.counts.assign(heads_q * rows, static_cast<int32_t>(keep));
  plan.pages.assign(heads_q * rows * keep, 0);
  if (keep == 0) return plan;

  const int threads = cpu::resolve_threads(num_threads);
  std::vector<std::vector<float>> scores(threads, std::vector<float>(num_pages)), tmp(threads, std::vector<float>(num_pages));
  std::vector<std::vector<int32_t>> order(threads);
  std::vector<std::vector<float>> qrow(threads, std::vector<float>(d));
  auto score_row = [&](int64_t h, int64_t r, int thread, float* sc) {
    const int64_t h_kv = h / group;
    float* qr = qrow[thread].data();
    detail::load_row(q.data, DType::f32, q.offset({0, h, r, 0}), d, qr);
    for (int64_t p = 0; p < num_pages; ++p) {
      sc[p] = options.selector == PageSelector::quest
                  ? quest_page_score(qr, cache.page_min(h_kv, p), cache.page_max(h_kv, p), d)
                  : pooled_page_score(qr, cache.page_key_sum(h_kv, p), cache.page_length(p), d);
    }
  };
  // Forced pages, then the best of the rest by score; ascending. Returns the count.
  auto choose = [&](const float* sc, int thread, int32_t* out) -> int64_t {
    if (keep == num_pages) {  // the budget covers the whole prefix
      for (int64_t p = 0; p < num_pages; ++p) out[p] = static_cast<int32_t>(p);
      return keep;
    }
    int64_t n = 0;
    if (options.force_first) out[n++] = 0;
    if (options.force_last && !(options.force_first && num_pages == 1)) out[n++] = static_cast<int32_t>(num_pages - 1);
    std::vector<int32_t>& cand = order[thread];
    cand.clear();
    for (int64_t p = 0; p < num_pages; ++p) {
      const bool forced = (options.force_first && p == 0) || (options.force_last && p == num_pages - 1);
      if (!forced) cand.push_back(static_cast<int32_t>(p));
    }
    const int64_t take = std::min<int64_t>(keep - n, static_cast<int64_t>(cand.size()));
    std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), ScoreOrder{sc});
    for (int64_t i = 0; i < take; ++i) out[n++] = cand[i];
    std::sort(out, out + n);
    return n;
  };
  if (options.group == GroupPolicy::per_head) {
    cpu::parallel_for(heads_q * rows, threads, [&](int64_t item, int thread) {
      const int64_t h = item / rows, r = item % rows;
      float* sc = scores[thread].data();
      if (keep < num_pages) score_row(h, r, thread, sc);
      plan.counts[item] = static_cast<int32_t>(choose(sc, thread, plan.pages.data() + item * keep));
    });
    return plan;
  }
  // Shared per GQA group: the group's maximum score, one list copied to every head.
  cpu::parallel_for(cache.heads_kv() * rows, threads, [&](int64_t item, int thread) {
    const int64_t h_kv = item / rows, r = item % rows, h0 = h_kv * group;
    float* sc = scores[thread].data();
    float* one = tmp[thread].data();
    if (keep < num_pages) {
      score_row(h0, r, thread, sc);
      for (int64_t g = 1; g < group; ++g) {
        score_row(h0 + g, r, thread, one);
        for (int64_t p = 0; p < num_pages; ++p) sc[p] = std::max(sc[p], one[p]);
      }
    }
    int32_t* first = plan.pages.data() + (h0 * rows + r) * keep;
    const int64_t n = choose(sc, thread, first);
    for (int64_t g = 0; g < group; ++g) {
      plan.counts[(h0 + g) * rows + r] = static_cast<int32_t>(n);
      if (g > 0) std::copy_n(first, keep, plan.pages.data() + ((h0 + g) * rows + r) * keep);
    }
  });
  return plan;
}

std::vector<std::vector<int32_t>> page_union(const PagePlan& plan, int64_t heads_kv) {
  std::vector<std::vector<int32_t>> loaded(heads_kv);
  if (heads_kv <= 0 || plan.heads_q % heads_kv != 0) return loaded;
  const int64_t group = plan.heads_q / heads_kv;
  for (int64_t h_kv = 0; h_kv < heads_kv; ++h_kv) {
    std::vector<int32_t>& u = loaded[h_kv];
    for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h)
      for (int64_t r = 0; r < plan.rows; ++r) u.insert(u.end(), plan.row_pages(h, r), plan.row_pages(h, r) + plan.count(h, r));
    std::sort(u.begin(), u.end());
    u.erase(std::unique(u.begin(), u.end()), u.end());
  }
  return loaded;
}

namespace {

Status check_plan(const PagePlan& plan, int64_t heads_q, int64_t rows, int64_t num_pages) {
  if (plan.heads_q != heads_q || plan.rows != rows) {
    return invalid_argument("plan: built for [heads_q " + std::to_string(plan.heads_q) + ", rows " +
                            std::to_string(plan.rows) + "], q has [" + std::to_string(heads_q) + ", " +
                            std::to_string(rows) + "]");
  }
  if (plan.capacity < 0 || static_cast<int64_t>(plan.counts.size()) != heads_q * rows ||
      static_cast<int64_t>(plan.pages.size()) != heads_q * rows * plan.capacity) {
    return invalid_argument("plan: counts/pages sizes do not match heads_q x rows x capacity");
  }
  for (int64_t h = 0; h < heads_q; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t count = plan.count(h, r);
      if (count < 0 || count > plan.capacity) {
        return invalid_argument("plan.counts[" + std::to_string(h) + ", " + std::to_string(r) + "]: " +
                                std::to_string(count) + " is outside [0, " + std::to_string(plan.capacity) + "]");
      }
      int32_t prev = -1;
      for (int32_t s = 0; s < count; ++s) {
        const int32_t page = plan.row_pages(h, r)[s];
        if (page <= prev || page >= num_pages) {
          return invalid_argument("plan.pages[" + std::to_string(h) + ", " + std::to_string(r) + ", " +
                                  std::to_string(s) + "]: " + std::to_string(page) +
                                  " is not ascending within [0, num_pages = " + std::to_string(num_pages) + ")");
        }
        prev = page;
      }
    }
  }
  return {};
}

}  // namespace

Status paged_attention(const Tensor& q, const PagedKVCache& cache, const PagePlan& plan, const Tensor& out,
                       const Tensor& lse, const PagedAttentionOptions& options, PagedAttentionStats* stats) {
  SPARSA_RETURN_IF_ERROR(check_query("q", q, cache));
  const int64_t heads_q = q.shape[1], rows = q.shape[2], d = q.shape[3], heads_kv = cache.heads_kv();
  SPARSA_RETURN_IF_ERROR(detail::check_shape("out", out, {1, heads_q, rows, d}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("out", out, DType::f32));
  SPARSA_RETURN_IF_ERROR(detail::check_shape("lse", lse, {1, heads_q, rows}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("lse", lse, DType::f32));
  SPARSA_RETURN_IF_ERROR(check_plan(plan, heads_q, rows, cache.num_pages()));
  const int64_t P = cache.page_size(), group = heads_q / heads_kv;

  // The pages each kv head loads, once.
  std::vector<std::vector<int32_t>> loaded = page_union(plan, heads_kv);
  PagedAttentionStats local;
  for (const auto& u : loaded) {
    local.pages_loaded += static_cast<int64_t>(u.size());
    for (int32_t page : u) local.tokens_loaded += cache.page_length(page);
  }
  for (int64_t h = 0; h < heads_q; ++h)
    for (int64_t r = 0; r < rows; ++r)
      local.pages_attended += options.attend_union ? static_cast<int64_t>(loaded[h / group].size()) : plan.count(h, r);

  if (local.pages_loaded == 0) {  // nothing visible: O = 0, LSE = -inf
    for (int64_t h = 0; h < heads_q; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t t = 0; t < d; ++t) out.ptr<float>()[out.offset({0, h, r, t})] = 0.0f;
        lse.ptr<float>()[lse.offset({0, h, r})] = -std::numeric_limits<float>::infinity();
      }
    }
    local.loaded = std::move(loaded);
    if (stats) *stats = std::move(local);
    return {};
  }

  // Gather the unions into a compact [1, heads_kv, len, d] buffer. Full pages fill
  // slots 0.. in ascending page order; a partial last page (the highest page index)
  // goes to the one final slot, so the executor's length cut-off is exactly its end.
  const int64_t last_page = cache.num_pages() - 1;
  const int64_t last_len = cache.page_length(last_page);
  const bool last_partial = last_len < P;
  int64_t full_slots = 0;
  bool any_partial = false;
  for (const auto& u : loaded) {
    const bool has_partial = last_partial && !u.empty() && u.back() == last_page;
    any_partial = any_partial || has_partial;
    full_slots = std::max<int64_t>(full_slots, static_cast<int64_t>(u.size()) - (has_partial ? 1 : 0));
  }
  const int64_t gathered_len = full_slots * P + (any_partial ? last_len : 0);
  HostArray kg(DType::f32, {1, heads_kv, gathered_len, d}), vg(DType::f32, {1, heads_kv, gathered_len, d});
  std::vector<std::vector<int32_t>> slot_of(heads_kv, std::vector<int32_t>(cache.num_pages(), -1));
  for (int64_t h_kv = 0; h_kv < heads_kv; ++h_kv) {
    const auto& u = loaded[h_kv];
    for (size_t i = 0; i < u.size(); ++i) {
      const int32_t page = u[i];
      const int64_t slot = (last_partial && page == last_page) ? full_slots : static_cast<int64_t>(i);
      slot_of[h_kv][page] = static_cast<int32_t>(slot);
      const int64_t n = cache.page_length(page);
      float* kd = kg.ptr<float>() + (h_kv * gathered_len + slot * P) * d;
      float* vd = vg.ptr<float>() + (h_kv * gathered_len + slot * P) * d;
      std::copy_n(cache.key(h_kv, page * P), n * d, kd);
      std::copy_n(cache.value(h_kv, page * P), n * d, vd);
    }
  }

  // The plan over the gathered buffer: one query block per row (own pages), or one
  // query block per head holding every row (the kv head's union).
  const int block_q = options.attend_union ? static_cast<int>(rows) : 1;
  int64_t capacity = 0;
  for (int64_t h = 0; h < heads_q; ++h) {
    if (options.attend_union) capacity = std::max<int64_t>(capacity, loaded[h / group].size());
  }
  if (!options.attend_union) capacity = plan.capacity;
  BlockIndexBuffer index = BlockIndexBuffer::empty(1, heads_q, rows, gathered_len, block_q, static_cast<int>(P),
                                                   std::max<int64_t>(capacity, 1));
  int32_t* counts = index.counts.ptr<int32_t>();
  int32_t* indices = index.indices.ptr<int32_t>();
  const int64_t cap = index.indices.shape()[3];
  for (int64_t h = 0; h < heads_q; ++h) {
    const int64_t h_kv = h / group;
    if (options.attend_union) {
      const auto& u = loaded[h_kv];
      counts[h] = static_cast<int32_t>(u.size());
      for (size_t i = 0; i < u.size(); ++i) indices[h * cap + i] = slot_of[h_kv][u[i]];
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      counts[h * rows + r] = plan.count(h, r);
      for (int32_t s = 0; s < plan.count(h, r); ++s) {
        indices[(h * rows + r) * cap + s] = slot_of[h_kv][plan.row_pages(h, r)[s]];
      }
    }
  }
  SPARSA_RETURN_IF_ERROR(block_sparse(q, kg.view(), vg.view(), index.view(), out, lse, options.attention));
  local.loaded = std::move(loaded);
  if (stats) *stats = std::move(local);
  return {};
}

Result<QuestOutput> quest_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const PageSelectOptions& select, const PagedAttentionOptions& options,
                                    int page_size) {
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor(name, *t, Device{}));
  }
  SPARSA_RETURN_IF_ERROR(validate(select, page_size));
  const int64_t batch = q.shape[0], heads_q = q.shape[1], len_q = q.shape[2], d = q.shape[3];
  const int64_t heads_kv = k.shape[1], len_kv = k.shape[2];
  if (k.shape[0] != batch || k.shape[3] != d) {
    return invalid_argument("k: expected [" + std::to_string(batch) + ", heads_kv, len_kv, " + std::to_string(d) +
                            "] (batch and head_dim of q), got " + k.shape_string());
  }
  if (v.shape[0] != batch || v.shape[1] != heads_kv || v.shape[2] != len_kv || v.shape[3] != d) {
    return invalid_argument("v: expected the shape of k " + k.shape_string() + ", got " + v.shape_string());
  }
  if (heads_q % heads_kv != 0) {
    return invalid_argument("k: heads_q (" + std::to_string(heads_q) + ") must be a multiple of heads_kv (" +
                            std::to_string(heads_kv) + ") for grouped-query attention");
  }
  if (k.dtype != q.dtype || v.dtype != q.dtype) {
    return unsupported_dtype(std::string("k, v: dtypes must match q's ") + dtype_name(q.dtype));
  }
  if (options.attention.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k", k));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("v", v));
  }
  auto as_f32 = [](const Tensor& t) -> Result<HostArray> {
    return t.dtype == DType::f32 ? Result<HostArray>(HostArray::copy_of(t)) : convert(t, DType::f32);
  };
  auto q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v);
  if (!q32.ok()) return q32.status();
  if (!k32.ok()) return k32.status();
  if (!v32.ok()) return v32.status();

  HostArray out(DType::f32, {batch, heads_q, len_q, d}), lse(DType::f32, {batch, heads_q, len_q});
  QuestOutput result;
  double pairs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    auto slice = [b](const HostArray& a) {
      Tensor t = a.view();
      t.data = const_cast<float*>(a.ptr<float>()) + b * t.strides[0];
      t.shape[0] = 1;
      return t;
    };
    auto cache = PagedKVCache::create({heads_kv, d, page_size});
    if (!cache.ok()) return cache.status();
    SPARSA_RETURN_IF_ERROR(cache->append(slice(*k32), slice(*v32)));
    const auto t0 = std::chrono::steady_clock::now();
    auto plan = select_pages(slice(*q32), *cache, select, options.attention.num_threads);
    result.select_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!plan.ok()) return plan.status();
    PagedAttentionStats stats;
    SPARSA_RETURN_IF_ERROR(paged_attention(slice(*q32), *cache, *plan, slice(out), slice(lse), options, &stats));
    result.pages_loaded += stats.pages_loaded;
    const int64_t group = heads_q / heads_kv;
    for (int64_t h = 0; h < heads_q; ++h) {
      for (int64_t r = 0; r < len_q; ++r) {
        if (options.attend_union) {
          for (int32_t page : stats.loaded[h / group]) pairs += static_cast<double>(cache->page_length(page));
        } else {
          for (int32_t s = 0; s < plan->count(h, r); ++s) pairs += static_cast<double>(cache->page_length(plan->row_pages(h, r)[s]));
        }
      }
    }
  }
  result.density = pairs / (static_cast<double>(batch) * heads_q * len_q * len_kv);
  if (q.dtype == DType::f32) {
    result.attention.out = std::move(out);
  } else {
    auto o = convert(out.view(), q.dtype);
    if (!o.ok()) return o.status();
    result.attention.out = std::move(o).value();
  }
  result.attention.lse = std::move(lse);
  return result;
}

}  // namespace sparsa
