// The two shared pieces of every block selector: the budget applied to one row of
// block scores, and the norm sort of BA-Att's step 1 (Eq. 9-10). Both backends of
// ba_att (and xattention) call these, so plans agree wherever the scores agree.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "sparsa/ba_att.h"

namespace sparsa {

const char* budget_kind_name(BudgetKind kind) {
  switch (kind) {
    case BudgetKind::top_kappa: return "top_kappa";
    case BudgetKind::density: return "density";
    case BudgetKind::mass: return "mass";
  }
  return "?";
}

std::string describe(const Budget& budget) {
  std::string value = budget.kind == BudgetKind::top_kappa ? std::to_string(static_cast<int64_t>(budget.value))
                                                           : std::to_string(budget.value);
  if (budget.kind != BudgetKind::top_kappa) {  // trim trailing zeros: 0.300000 -> 0.3
    while (value.size() > 1 && value.back() == '0') value.pop_back();
    if (value.back() == '.') value.pop_back();
  }
  return std::string(budget_kind_name(budget.kind)) + "=" + value;
}

Status validate(const Budget& budget) {
  const double v = budget.value;
  switch (budget.kind) {
    case BudgetKind::top_kappa:
      if (!(v >= 1.0) || v != std::floor(v) || v > 2147483647.0) {
        return invalid_argument("budget: top_kappa expects an integer kappa >= 1 key blocks per query block, got " +
                                std::to_string(v));
      }
      return {};
    case BudgetKind::density:
      if (!(v > 0.0 && v <= 1.0)) {
        return invalid_argument("budget: density expects a fraction of key blocks in (0, 1], got " + std::to_string(v));
      }
      return {};
    case BudgetKind::mass:
      if (!(v > 0.0 && v <= 1.0)) {
        return invalid_argument("budget: mass expects a cumulative-mass threshold tau in (0, 1], got " +
                                std::to_string(v));
      }
      return {};
  }
  return invalid_argument("budget: unknown kind " + std::to_string(static_cast<int>(budget.kind)));
}

int64_t fixed_block_count(const Budget& budget, int64_t n) {
  int64_t kappa = 0;
  if (budget.kind == BudgetKind::top_kappa) {
    kappa = static_cast<int64_t>(budget.value);
  } else if (budget.kind == BudgetKind::density) {
    kappa = static_cast<int64_t>(std::ceil(budget.value * static_cast<double>(n) - 1e-9));
  } else {
    return 0;
  }
  return std::clamp<int64_t>(kappa, 1, n);
}

int64_t select_blocks(const double* key, const double* weight, const bool* forced, int64_t n, const Budget& budget,
                      int32_t* out) {
  // Visit order: forced blocks (ascending index), then the rest by descending key,
  // ties to the lower index.
  std::vector<int32_t> order;
  order.reserve(n);
  int64_t num_forced = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (forced != nullptr && forced[j]) {
      order.push_back(static_cast<int32_t>(j));
      ++num_forced;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    if (forced == nullptr || !forced[j]) order.push_back(static_cast<int32_t>(j));
  }
  std::stable_sort(order.begin() + num_forced, order.end(),
                   [key](int32_t a, int32_t b) { return key[a] > key[b]; });

  int64_t keep = 0;  // length of the kept prefix of `order`
  if (budget.kind == BudgetKind::mass) {
    // Smallest prefix with cumulative mass >= tau * total, where total is the sum in the
    // same order (so tau = 1 is always reached, at the latest by the full row).
    std::vector<double> cumulative(n + 1, 0.0);
    for (int64_t p = 0; p < n; ++p) cumulative[p + 1] = cumulative[p] + weight[order[p]];
    const double required = budget.value * cumulative[n];
    while (keep < n && cumulative[keep] < required) ++keep;
  } else {
    keep = fixed_block_count(budget, n);
  }
  keep = std::max(keep, num_forced);
  std::copy(order.begin(), order.begin() + keep, out);
  std::sort(out, out + keep);
  return keep;
}

void mask_block_visibility(const Mask& mask, int64_t qb, int block_q, int block_kv, int64_t len_q, int64_t len_kv,
                           BlockVisibility* out) {
  const int64_t nk = (len_kv + block_kv - 1) / block_kv;
  std::fill(out, out + nk, BlockVisibility::hidden);
  // Each query sees one interval of keys, [begin, end) (empty when begin >= end); both ends move
  // forward with the query, so every block is marked once: blocks before `next` already are.
  int64_t next = 0;
  for (int64_t i = qb * block_q; i < std::min(len_q, (qb + 1) * block_q); ++i) {
    const int64_t begin = mask_key_begin(mask, i, len_q, len_kv), end = mask_key_end(mask, i, len_q, len_kv);
    if (begin >= end) continue;
    const int64_t last = (end - 1) / block_kv;
    for (int64_t j = std::max(begin / block_kv, next); j <= last; ++j) {
      if (out[j] == BlockVisibility::hidden) out[j] = BlockVisibility::visible;
    }
    next = std::max(next, last + 1);
    if (!mask.is_none()) out[last] = BlockVisibility::diagonal;
  }
}

int64_t select_visible_blocks(const double* key, const double* weight, const bool* forced,
                              const BlockVisibility* visibility, int64_t n, const Budget& budget, int32_t* out) {
  std::vector<int32_t> column;  // slot c of the compacted row holds block column[c]
  std::vector<double> k, w;
  std::unique_ptr<bool[]> f(new bool[n]());
  for (int64_t j = 0; j < n; ++j) {
    if (visibility[j] == BlockVisibility::hidden) continue;
    f[column.size()] = visibility[j] == BlockVisibility::diagonal || (forced != nullptr && forced[j]);
    column.push_back(static_cast<int32_t>(j));
    k.push_back(key[j]);
    w.push_back(weight[j]);
  }
  if (column.empty()) return 0;
  const int64_t count = select_blocks(k.data(), w.data(), f.get(), static_cast<int64_t>(column.size()), budget, out);
  for (int64_t c = 0; c < count; ++c) out[c] = column[out[c]];  // ascending slots -> ascending blocks
  return count;
}

void norm_sort(const double* norms, int64_t len, int64_t window, int32_t* perm) {
  std::iota(perm, perm + len, 0);
  const int64_t w = window > 0 ? window : std::max<int64_t>(len, 1);
  for (int64_t begin = 0; begin < len; begin += w) {
    const int64_t end = std::min(begin + w, len);
    std::stable_sort(perm + begin, perm + end, [norms](int32_t a, int32_t b) { return norms[a] < norms[b]; });
  }
}

}  // namespace sparsa
