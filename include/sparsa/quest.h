// sparsa/quest.h — page selection over a paged prefix cache (QUEST and a pooled-score
// selector), and the executor that attends over the selected pages.
//
// QUEST (Tang et al., ICML 2024): the score of page p for query q is the upper bound
// of q·k over the page's keys,
//     score(q, p) = sum_d max(q_d * max_d(p), q_d * min_d(p)),
// and each (query head, query row) keeps the top budget/page_size pages. Forced pages
// (first, last) count against the budget, as in QUEST's reference code (last page on).
// Pooled (BA-Att style): score(q, p) = q · mean_k(p), the page-mean logit.
//
// Plan, then run: select_pages() returns a PagePlan that can be inspected and
// tested; paged_attention() follows it. Query head h reads kv head h / (heads_q /
// heads_kv). The executor loads, per kv head, the union of the pages its query heads
// and rows selected (once), then each (head, row) attends over its own pages of that
// union — or, with attend_union, over the whole union of its kv head.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsa/attention.h"
#include "sparsa/kv_cache.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

enum class PageSelector : uint8_t {
  quest,   // sum_d max(q_d * max_d, q_d * min_d)
  pooled,  // q · page-mean key
};
const char* page_selector_name(PageSelector selector);
Result<PageSelector> parse_page_selector(const std::string& name);

// How the query heads of a GQA group choose: each its own pages (the kv head loads the
// union), or one shared list per (kv head, row) by the group's maximum score (the
// maximum of upper bounds still bounds every head's logits).
enum class GroupPolicy : uint8_t { per_head, shared };

struct PageSelectOptions {
  PageSelector selector = PageSelector::quest;
  GroupPolicy group = GroupPolicy::per_head;
  int64_t budget = 256;      // tokens per query; a positive multiple of the page size
  bool force_first = false;  // always keep page 0 (attention sinks)
  bool force_last = true;    // always keep the last (newest, possibly partial) page
};

// Budget and flags against a page size ("budget: expected a positive multiple of the
// page size 16, got 100").
Status validate(const PageSelectOptions& options, int page_size);

// The plan: for every (query head, row), its pages ascending and distinct.
struct PagePlan {
  int64_t heads_q = 0;
  int64_t rows = 0;
  int64_t capacity = 0;          // pages per (head, row) at most
  std::vector<int32_t> counts;   // [heads_q, rows]
  std::vector<int32_t> pages;    // [heads_q, rows, capacity]

  int32_t count(int64_t h, int64_t r) const { return counts[h * rows + r]; }
  const int32_t* row_pages(int64_t h, int64_t r) const { return pages.data() + (h * rows + r) * capacity; }
};

// Score of one page for one query (f32 accumulation in 16 interleaved partial sums, the
// one order every backend uses).
float quest_page_score(const float* q, const float* page_min, const float* page_max, int64_t head_dim);
float pooled_page_score(const float* q, const float* page_key_sum, int64_t page_length, int64_t head_dim);

// Selects pages for every row of q: f32 [1, heads_q, rows, head_dim]; heads_q a multiple
// of the cache's heads_kv. Ties go to the lower page index. An empty cache gives empty rows.
Result<PagePlan> select_pages(const Tensor& q, const PagedKVCache& cache, const PageSelectOptions& options,
                              int num_threads = 0);

// The pages each kv head must load: the union over its query heads and all rows, ascending.
std::vector<std::vector<int32_t>> page_union(const PagePlan& plan, int64_t heads_kv);

struct PagedAttentionOptions {
  AttentionOptions attention;  // backend, scale, threads
  bool attend_union = false;   // each row attends over its kv head's whole union
};

struct PagedAttentionStats {
  int64_t pages_loaded = 0;   // sum over kv heads of the union size
  int64_t tokens_loaded = 0;  // tokens in those pages
  int64_t pages_attended = 0; // sum over (head, row) of the pages attended
  std::vector<std::vector<int32_t>> loaded;  // per kv head, ascending
};

// Attention of q (f32 [1, heads_q, rows, head_dim]) over the pages of `plan`, into
// out (f32, same shape as q) and lse (f32 [1, heads_q, rows]). A row with no page gets
// O = 0 and LSE = -inf.
Status paged_attention(const Tensor& q, const PagedKVCache& cache, const PagePlan& plan, const Tensor& out,
                       const Tensor& lse, const PagedAttentionOptions& options = {},
                       PagedAttentionStats* stats = nullptr);

// The one-call form: QUEST-style attention of q over k, v (no mask; every key is prefix).
// Per batch element, k and v are paged into a cache (pages of page_size), every (head,
// query row) selects its pages and attends over them. Any float dtype; computed in f32,
// O returned in q's dtype. density: attended (query, key) pairs / all pairs.
struct QuestOutput {
  AttentionOutput attention;
  double density = 0;
  int64_t pages_loaded = 0;  // sum over batch and kv heads of the union
  double select_seconds = 0; // wall time of select_pages (the plan), all batch elements
};
Result<QuestOutput> quest_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const PageSelectOptions& select, const PagedAttentionOptions& options = {},
                                    int page_size = 16);

}  // namespace sparsa
