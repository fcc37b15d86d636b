// Page selection (QUEST, pooled) and attention over selected pages (sparsa/quest.h).
#include "sparsa/quest.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <type_traits>
#include <string>

#include "core/attention_params.h"
#include "core/validate.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"

namespace sparsa {

namespace simd = cpu::simd;

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

// QUEST scores of W = simd::kLanes pages at once (pages in vector lanes), bit for bit those
// of quest_page_score: lane accumulator j takes dims j, j + kLanes, ..., the accumulators are
// added in order 0..15, then the tail dims. Scoring one page at a time spends most of its time
// in that ordered 16-term horizontal sum (a dependent chain per page); with pages in lanes it
// is 16 vector adds per W pages. The page bounds are transposed once per call:
// [heads_kv][page group][d][W].
//
// Each term max(q_t * max_t, q_t * min_t) is q_t * max_t when q_t >= 0 and q_t * min_t
// otherwise (rounding is monotonic and max_t >= min_t), so one product per term is computed;
// the product is kept apart from the add (no fused multiply-add) so it is rounded as there.
// That identity needs bounds without NaN: a kv head whose bounds hold a NaN takes both products.
struct TransposedBounds {
  int64_t groups = 0, d = 0;
  std::vector<float> bounds;  // [heads_kv][page group][d][max, min][W]
  std::vector<char> has_nan;  // per kv head

  explicit TransposedBounds(const PagedKVCache& cache)
      : groups((cache.num_pages() + simd::kLanes - 1) / simd::kLanes), d(cache.head_dim()) {
    constexpr int W = simd::kLanes;
    const int64_t H = cache.heads_kv(), pages = cache.num_pages();
    bounds.assign(H * groups * d * 2 * W, 0.0f);
    has_nan.assign(H, 0);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t p = 0; p < pages; ++p) {
        const int64_t base = (h * groups + p / W) * d * 2 * W + p % W;
        const float *mn = cache.page_min(h, p), *mx = cache.page_max(h, p);
        for (int64_t t = 0; t < d; ++t) {
          bounds[base + t * 2 * W] = mx[t];
          bounds[base + t * 2 * W + W] = mn[t];
          has_nan[h] |= std::isnan(mn[t]) || std::isnan(mx[t]);
        }
      }
    }
  }

  // sc[r][0 .. num_pages) for R query rows q[r] (head_dim d) against kv head h_kv.
  //
  // Lane accumulator j is complete after its d / kLanes terms, so the ordered sum of the
  // lanes can take lane j as soon as it is done: per row two registers (the lane being summed
  // and the total) instead of sixteen, which lets R rows share every bound vector while it
  // is in L1 (the bounds of a kv head do not fit in L1, and streaming them once per row was
  // the scoring's limit).
  template <int R>
  void score(const float* const* q, int64_t h_kv, int64_t num_pages, float* const* sc) const {
    if (has_nan[h_kv]) {
      score_rows<R, true>(q, h_kv, num_pages, sc);
    } else {
      score_rows<R, false>(q, h_kv, num_pages, sc);
    }
  }

  template <int R, bool kExactMax>
  void score_rows(const float* const* q, int64_t h_kv, int64_t num_pages, float* const* sc) const {
    constexpr int W = simd::kLanes;
    using simd::Vec;
    const int64_t full = d / kLanes * kLanes;
    // Where each row's chosen bound of dim t sits in a group: t * 2W (max) or t * 2W + W (min).
    std::vector<int32_t> offset(R * d);
    for (int r = 0; r < R; ++r)
      for (int64_t t = 0; t < d; ++t) offset[r * d + t] = static_cast<int32_t>(t * 2 * W + (q[r][t] >= 0.0f ? 0 : W));
    auto term = [&](const float* b, int r, int64_t t) {
      const Vec qv = simd::splat(q[r][t]);
      if constexpr (kExactMax) {
        const Vec x = qv * simd::load(b + t * 2 * W), y = qv * simd::load(b + t * 2 * W + W);
        return x < y ? y : x;
      } else {
        Vec product = qv * simd::load(b + offset[r * d + t]);
        asm("" : "+v"(product));  // a rounded product: keeps the add below from fusing with it
        return product;
      }
    };
    for (int64_t g = 0; g < groups; ++g) {
      const float* b = bounds.data() + (h_kv * groups + g) * d * 2 * W;
      Vec total[R] = {};
      for (int j = 0; j < kLanes && j < full; ++j) {
        Vec lane[R] = {};
        for (int64_t t = j; t < full; t += kLanes)
          for (int r = 0; r < R; ++r) lane[r] += term(b, r, t);
        for (int r = 0; r < R; ++r) total[r] += lane[r];
      }
      for (int64_t t = full; t < d; ++t)
        for (int r = 0; r < R; ++r) total[r] += term(b, r, t);
      const int64_t n = std::min<int64_t>(W, num_pages - g * W);
      for (int r = 0; r < R; ++r) {
        alignas(64) float out[W];
        simd::store(out, total[r]);
        std::copy_n(out, n, sc[r] + g * W);
      }
    }
  }
};

// Per-thread scratch of the page choice.
struct ChoiceScratch {
  std::vector<int32_t> survivors;
  std::vector<float> chunk_max, scores, rows;
  std::vector<uint64_t> bits;
};

// The best `take` of the candidate pages [lo, hi) by ScoreOrder, when no score is NaN. Deal
// the candidates round-robin into C chunks (C a multiple of the vector width and about twice
// `take`, so the chunk maxima are element-wise vector maxima): the chunk maxima are
// distinct candidates, so the take-th largest of them is a score that `take` candidates reach,
// and any candidate below it cannot be among the best. Of what survives that threshold
// (usually little more than `take`) the best `take` are found exactly (nth_element). Appends
// the picks to out (unordered).
int64_t top_pages_no_nan(const float* sc, int64_t lo, int64_t hi, int64_t take, ChoiceScratch& scratch,
                         int32_t* out) {
  const int64_t m = hi - lo;
  if (take <= 0 || m <= 0) return 0;
  if (take >= m) {
    for (int64_t p = lo; p < hi; ++p) *out++ = static_cast<int32_t>(p);
    return m;
  }
  float threshold = -std::numeric_limits<float>::infinity();
  const int64_t C = (2 * take + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
  if (m >= C) {
    std::vector<float>& cmax = scratch.chunk_max;
    cmax.assign(sc + lo, sc + lo + C);
    const int64_t full = m / C;
    for (int64_t i = 1; i < full; ++i) {
      const float* x = sc + lo + i * C;
      for (int64_t c = 0; c < C; ++c) cmax[c] = x[c] > cmax[c] ? x[c] : cmax[c];
    }
    std::nth_element(cmax.begin(), cmax.begin() + (take - 1), cmax.end(), std::greater<float>());
    threshold = cmax[take - 1];
  }
  std::vector<int32_t>& survivors = scratch.survivors;
  survivors.resize(m);
  int64_t kept = 0, p = lo;
  // Most candidates fall below the threshold: a vector of W of them is skipped by one test.
  const simd::Vec t = simd::splat(threshold);
  for (; p + simd::kLanes <= hi; p += simd::kLanes) {
    const simd::Vec x = simd::load(sc + p);
    if (!simd::any(x >= t)) continue;
    for (int64_t w = p; w < p + simd::kLanes; ++w)
      if (sc[w] >= threshold) survivors[kept++] = static_cast<int32_t>(w);
  }
  for (; p < hi; ++p)
    if (sc[p] >= threshold) survivors[kept++] = static_cast<int32_t>(p);
  // Only the set matters (the caller orders it by page): higher score, then lower page.
  const auto better = [sc](int32_t a, int32_t b) { return sc[a] != sc[b] ? sc[a] > sc[b] : a < b; };
  std::nth_element(survivors.begin(), survivors.begin() + (take - 1), survivors.begin() + kept, better);
  std::copy_n(survivors.begin(), take, out);
  return take;
}

// Sorts n distinct pages in [0, num_pages) ascending through a bitmap.
void sort_pages(int32_t* pages, int64_t n, int64_t num_pages, std::vector<uint64_t>& bits) {
  bits.assign((num_pages + 63) / 64, 0);
  for (int64_t i = 0; i < n; ++i) bits[pages[i] >> 6] |= uint64_t{1} << (pages[i] & 63);
  int64_t k = 0;
  for (size_t w = 0; w < bits.size(); ++w) {
    for (uint64_t word = bits[w]; word != 0; word &= word - 1) {
      pages[k++] = static_cast<int32_t>(w * 64 + std::countr_zero(word));
    }
  }
}

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
  std::vector<ChoiceScratch> choice(threads);
  std::vector<std::vector<float>> qrow(threads, std::vector<float>(d));
  const bool transposed = options.selector == PageSelector::quest && keep < num_pages;
  std::optional<TransposedBounds> bounds;
  if (transposed) bounds.emplace(cache);
  auto score_row = [&](int64_t h, int64_t r, int thread, float* sc) {
    const int64_t h_kv = h / group;
    float* qr = qrow[thread].data();
    detail::load_row(q.data, DType::f32, q.offset({0, h, r, 0}), d, qr);
    if (transposed) {
      const float* qs[1] = {qr};
      float* scs[1] = {sc};
      bounds->score<1>(qs, h_kv, num_pages, scs);
      return;
    }
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
    int32_t nans = 0;
    for (int64_t p = 0; p < num_pages; ++p) nans += sc[p] != sc[p];
    if (nans == 0) {
      // The candidates are a range: the forced pages are the first and the last.
      const int64_t lo = options.force_first ? 1 : 0, hi = options.force_last ? num_pages - 1 : num_pages;
      n += top_pages_no_nan(sc, lo, std::max(lo, hi), keep - n, choice[thread], out + n);
      sort_pages(out, n, num_pages, choice[thread].bits);
      return n;
    }
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
    // Work items of kRows consecutive rows of one head: the quest scores of a full item are
    // computed together (they share the kv head's bounds, see TransposedBounds::score).
    constexpr int kRows = 8;
    const int64_t blocks = (rows + kRows - 1) / kRows;
    for (ChoiceScratch& c : choice) c.scores.resize(kRows * num_pages), c.rows.resize(kRows * d);
    cpu::parallel_for(heads_q * blocks, threads, [&](int64_t item, int thread) {
      const int64_t h = item / blocks, r0 = (item % blocks) * kRows, n = std::min<int64_t>(kRows, rows - r0);
      ChoiceScratch& c = choice[thread];
      const float* qs[kRows];
      float* scs[kRows];
      for (int64_t i = 0; i < n; ++i) {
        qs[i] = c.rows.data() + i * d;
        scs[i] = c.scores.data() + i * num_pages;
      }
      if (keep < num_pages) {
        if (transposed && n == kRows) {
          for (int64_t i = 0; i < n; ++i) detail::load_row(q.data, DType::f32, q.offset({0, h, r0 + i, 0}), d, c.rows.data() + i * d);
          bounds->score<kRows>(qs, h / group, num_pages, scs);
        } else {
          for (int64_t i = 0; i < n; ++i) score_row(h, r0 + i, thread, scs[i]);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = h * rows + r0 + i;
        plan.counts[row] = static_cast<int32_t>(choose(scs[i], thread, plan.pages.data() + row * keep));
      }
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
  // A page mark per page seen (plans over long prefixes list millions of (row, page) pairs:
  // marking is linear where sorting them was not).
  int32_t highest = -1;
  for (int64_t h = 0; h < plan.heads_q; ++h)
    for (int64_t r = 0; r < plan.rows; ++r)
      for (int32_t s = 0; s < plan.count(h, r); ++s) highest = std::max(highest, plan.row_pages(h, r)[s]);
  std::vector<char> seen;
  for (int64_t h_kv = 0; h_kv < heads_kv; ++h_kv) {
    seen.assign(static_cast<size_t>(highest) + 1, 0);
    for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h)
      for (int64_t r = 0; r < plan.rows; ++r)
        for (int32_t s = 0; s < plan.count(h, r); ++s) {
          const int32_t page = plan.row_pages(h, r)[s];
          if (page >= 0) seen[page] = 1;  // an unchecked plan's negative entries are not pages
        }
    std::vector<int32_t>& u = loaded[h_kv];
    for (int32_t page = 0; page <= highest; ++page)
      if (seen[page]) u.push_back(page);
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

// The cpu backend's executor for page plans. block_sparse's mainloop works on tiles of query
// rows that share one key list; here every (head, row) has its own pages, so through it each
// row became a one-row tile padded to a vector of rows (most of its work wasted) over keys
// gathered anew. This path keeps one query row per work item and its W = simd::kLanes keys in
// vector lanes: the loaded pages' keys are transposed once per call ([page][d][W-padded page]),
// a page's logits are d broadcast FMAs, the softmax is exact over the row's few hundred logits
// (no online rescaling), and values are read in place from the cache.
Status paged_attention_cpu(const Tensor& q, const PagedKVCache& cache, const PagePlan& plan,
                           const std::vector<std::vector<int32_t>>& loaded, const Tensor& out, const Tensor& lse,
                           const PagedAttentionOptions& options) {
  using simd::Vec;
  constexpr int W = simd::kLanes;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  const int64_t heads_q = q.shape[1], rows = q.shape[2], d = q.shape[3], heads_kv = cache.heads_kv();
  const int64_t group = heads_q / heads_kv, P = cache.page_size(), Pp = (P + W - 1) / W * W;
  if (options.attention.check_finite) {
    SPARSA_RETURN_IF_ERROR(detail::check_finite("q", q));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("k", cache.keys()));
    SPARSA_RETURN_IF_ERROR(detail::check_finite("v", cache.values()));
  }
  const float scale = options.attention.scale.value_or(1.0f / std::sqrt(static_cast<float>(d))) * kLog2e;
  const int threads = cpu::resolve_threads(options.attention.num_threads);

  // Keys of the loaded pages, transposed: kt[h_kv][slot][t][w], pad keys 0.
  int64_t max_union = 0;
  for (const auto& u : loaded) max_union = std::max<int64_t>(max_union, static_cast<int64_t>(u.size()));
  std::vector<float> kt(heads_kv * max_union * d * Pp, 0.0f);
  std::vector<std::vector<int32_t>> slot_of(heads_kv, std::vector<int32_t>(cache.num_pages(), -1));
  cpu::parallel_for(heads_kv * max_union, threads, [&](int64_t item, int) {
    const int64_t h_kv = item / max_union, slot = item % max_union;
    if (slot >= static_cast<int64_t>(loaded[h_kv].size())) return;
    const int32_t page = loaded[h_kv][slot];
    slot_of[h_kv][page] = static_cast<int32_t>(slot);
    float* dst = kt.data() + (h_kv * max_union + slot) * d * Pp;
    for (int64_t w = 0; w < cache.page_length(page); ++w) {
      const float* key = cache.key(h_kv, page * P + w);
      for (int64_t t = 0; t < d; ++t) dst[t * Pp + w] = key[t];
    }
  });

  int64_t most_pages = plan.capacity;
  if (options.attend_union) most_pages = max_union;
  struct Scratch {
    std::vector<float> q, logits, o;
  };
  std::vector<Scratch> scratch(threads);
  for (Scratch& sc : scratch) {
    sc.q.resize(d);
    sc.logits.resize(std::max<int64_t>(most_pages, 1) * Pp);
    sc.o.resize((d + W - 1) / W * W);
  }
  const int64_t dv = d / W * W;
  cpu::parallel_for(heads_q * rows, threads, [&](int64_t item, int thread) {
    const int64_t h = item / rows, r = item % rows, h_kv = h / group;
    Scratch& sc = scratch[thread];
    const int32_t* pages = options.attend_union ? loaded[h_kv].data() : plan.row_pages(h, r);
    const int64_t count = options.attend_union ? static_cast<int64_t>(loaded[h_kv].size()) : plan.count(h, r);
    detail::load_row(q.data, DType::f32, q.offset({0, h, r, 0}), d, sc.q.data());
    for (int64_t t = 0; t < d; ++t) sc.q[t] *= scale;
    float* logits = sc.logits.data();
    const float* qs = sc.q.data();
    // Logits, W keys per vector: kPar key vectors at a time, so that kPar independent FMA
    // chains hide the FMA latency (one chain over d would wait on it at every step).
    constexpr int kPar = 4;
    const int64_t per_page = Pp / W, vectors = count * per_page;
    auto key_vector = [&](int64_t i) {
      return kt.data() + (h_kv * max_union + slot_of[h_kv][pages[i / per_page]]) * d * Pp + (i % per_page) * W;
    };
    int64_t i = 0;
    for (; i + kPar <= vectors; i += kPar) {
      const float* kp[kPar];
      Vec acc[kPar] = {};
      for (int u = 0; u < kPar; ++u) kp[u] = key_vector(i + u);
      for (int64_t t = 0; t < d; ++t) {
        const Vec qv = simd::splat(qs[t]);
        for (int u = 0; u < kPar; ++u) acc[u] += qv * simd::load(kp[u] + t * Pp);
      }
      for (int u = 0; u < kPar; ++u) simd::store(logits + (i + u) * W, acc[u]);
    }
    for (; i < vectors; ++i) {
      const float* kp = key_vector(i);
      Vec acc = {};
      for (int64_t t = 0; t < d; ++t) acc += simd::splat(qs[t]) * simd::load(kp + t * Pp);
      simd::store(logits + i * W, acc);
    }
    // Pad keys of a partial page (and of a page size that is not a multiple of W) see -inf.
    Vec vmax = simd::splat(-std::numeric_limits<float>::infinity());
    for (int64_t s = 0; s < count; ++s) {
      const int64_t n = cache.page_length(pages[s]);
      for (int64_t w = n; w < Pp; ++w) logits[s * Pp + w] = -std::numeric_limits<float>::infinity();
      for (int64_t w0 = 0; w0 < Pp; w0 += W) vmax = simd::max(vmax, simd::load(logits + s * Pp + w0));
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < W; ++j) m = std::max(m, vmax[j]);
    float* o = out.ptr<float>() + out.offset({0, h, r, 0});
    float& row_lse = lse.ptr<float>()[lse.offset({0, h, r})];
    if (m == -std::numeric_limits<float>::infinity()) {  // no key: O = 0, LSE = -inf
      for (int64_t t = 0; t < d; ++t) o[t] = 0.0f;
      row_lse = -std::numeric_limits<float>::infinity();
      return;
    }
    Vec vsum = {};
    const Vec vm = simd::splat(m), ninf = simd::splat(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < count * Pp; j += W) {
      const Vec l = simd::load(logits + j);
      const Vec e = l == ninf ? Vec{} : simd::exp2_nonpositive(l - vm);
      simd::store(logits + j, e);
      vsum += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < W; ++j) sum += vsum[j];
    // O = sum_j p_j v_j: the row's accumulator stays in registers for the common head_dims.
    auto accumulate = [&]<int NV>(std::integral_constant<int, NV>) {
      Vec acc[NV] = {};
      for (int64_t s = 0; s < count; ++s) {
        const int64_t n = cache.page_length(pages[s]);
        const float* v = cache.value(h_kv, pages[s] * P);
        for (int64_t w = 0; w < n; ++w) {
          const Vec pv = simd::splat(logits[s * Pp + w]);
          for (int c = 0; c < NV; ++c) acc[c] += pv * simd::load(v + w * d + c * W);
        }
      }
      const Vec inv = simd::splat(1.0f / sum);
      for (int c = 0; c < NV; ++c) simd::store(o + c * W, acc[c] * inv);
    };
    if (d == 4 * W) {
      accumulate(std::integral_constant<int, 4>{});
    } else if (d == 8 * W) {
      accumulate(std::integral_constant<int, 8>{});
    } else {
      float* acc = sc.o.data();
      std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      for (int64_t s = 0; s < count; ++s) {
        const int64_t n = cache.page_length(pages[s]);
        for (int64_t w = 0; w < n; ++w) {
          const float pw = logits[s * Pp + w];
          const float* v = cache.value(h_kv, pages[s] * P + w);
          const Vec pv = simd::splat(pw);
          for (int64_t t = 0; t < dv; t += W) simd::store(acc + t, simd::load(acc + t) + pv * simd::load(v + t));
          for (int64_t t = dv; t < d; ++t) acc[t] += pw * v[t];
        }
      }
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < d; ++t) o[t] = acc[t] * inv;
    }
    row_lse = (m + std::log2(sum)) * kLn2;
  });
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
  // The executors below check these too, but the cpu fast path runs before any of them.
  const float scale = options.attention.scale.value_or(1.0f / std::sqrt(static_cast<float>(d)));
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return invalid_argument("scale: expected a finite positive number, got " + std::to_string(scale));
  }
  if (options.attention.num_threads < 0 || options.attention.num_threads > kMaxNumThreads) {
    return invalid_argument("num_threads: expected 0.." + std::to_string(kMaxNumThreads) +
                            " (0 = hardware concurrency), got " + std::to_string(options.attention.num_threads));
  }
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

  if (options.attention.backend == Backend::cpu) {
    SPARSA_RETURN_IF_ERROR(paged_attention_cpu(q, cache, plan, loaded, out, lse, options));
    // A row whose f32 result overflowed (O or LSE not finite although it saw keys: a row with
    // keys has a finite LSE) takes the general path below, whose cpu executor redoes such rows
    // in f64 as cpu_ref computes them, or reports the LSE beyond f32 as cpu_ref does.
    bool finite = true;
    for (int64_t h = 0; h < heads_q && finite; ++h) {
      for (int64_t r = 0; r < rows && finite; ++r) {
        const bool has_keys = options.attend_union ? !loaded[h / group].empty() : plan.count(h, r) > 0;
        if (!has_keys) continue;
        finite = std::isfinite(lse.ptr<float>()[lse.offset({0, h, r})]);
        for (int64_t t = 0; t < d && finite; ++t) finite = std::isfinite(out.ptr<float>()[out.offset({0, h, r, t})]);
      }
    }
    if (finite) {
      local.loaded = std::move(loaded);
      if (stats) *stats = std::move(local);
      return {};
    }
  }

  // cpu_ref (the specification), any other backend, and the cpu backend's overflowing calls:
  // block_sparse over a gathered copy.
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
  // f32 inputs are read in place (the cache copies k and v anyway); others are converted once.
  HostArray converted[3];
  auto as_f32 = [&converted](const Tensor& t, int i) -> Result<Tensor> {
    if (t.dtype == DType::f32) return t;
    auto c = convert(t, DType::f32);
    if (!c.ok()) return c.status();
    converted[i] = std::move(c).value();
    return converted[i].view();
  };
  auto q32 = as_f32(q, 0), k32 = as_f32(k, 1), v32 = as_f32(v, 2);
  if (!q32.ok()) return q32.status();
  if (!k32.ok()) return k32.status();
  if (!v32.ok()) return v32.status();

  HostArray out(DType::f32, {batch, heads_q, len_q, d}), lse(DType::f32, {batch, heads_q, len_q});
  QuestOutput result;
  double pairs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    auto slice = [b](Tensor t) {
      t.data = static_cast<float*>(t.data) + b * t.strides[0];
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
    SPARSA_RETURN_IF_ERROR(
        paged_attention(slice(*q32), *cache, *plan, slice(out.view()), slice(lse.view()), options, &stats));
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
