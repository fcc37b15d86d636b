// LLSA selection: pooling of q and k (f32) and coarse-to-fine top-K (llsa.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>

#include "core/attention_params.h"
#include "cpu/parallel.h"
#include "methods/llsa/internal.h"

namespace sparsa {

int llsa_auto_levels(int64_t n, int block) {
  if (block < 2) return 1;
  int levels = 0;
  int64_t span = block;  // B^(levels+1)
  while (span <= n / block) {  // B^(levels+2) <= n
    span *= block;
    ++levels;
  }
  // Now B^(levels+1) <= n < B^(levels+2) (for n >= B^2): the paper's L = floor(log_B n) - 1.
  return std::max(1, levels);
}

int64_t llsa_keys_per_query(int64_t n, const LlsaOptions& options) {
  const int L = options.levels > 0 ? options.levels : llsa_auto_levels(n, options.block);
  const int64_t kb = int64_t{options.topk} * options.block;
  if (!options.enrich) return kb;
  const auto len = llsa_detail::level_lengths(n, options.block, L);
  int64_t keys = kb + (L - 1) * kb + len[L];
  if (options.dedupe) keys -= int64_t{L} * options.topk;
  return keys;
}

int32_t LlsaPlan::pick(int level, int64_t b, int64_t h, int64_t i, int slot) const {
  const HostArray& a = picks[level - 1];
  return a.ptr<int32_t>()[((b * heads_q + h) * level_len[level] + i) * topk + slot];
}

int32_t LlsaPlan::pick_count(int level, int64_t b, int64_t h, int64_t i) const {
  return pick_counts[level - 1].ptr<int32_t>()[(b * heads_q + h) * level_len[level] + i];
}

int64_t LlsaPlan::token_count(int level, int64_t t) const {
  const int64_t region = llsa_detail::region_size(block, level, len);
  return std::min(region, len - t * region);
}

int64_t LlsaPlan::keys_for_block(int64_t b, int64_t h, int64_t qb) const {
  int64_t keys = 0;
  llsa_detail::for_each_key_run(*this, b, h, qb, [&](int, int64_t first, int64_t end) { keys += end - first; });
  return keys;
}

double LlsaPlan::mean_keys_per_query() const {
  if (len == 0 || level_len.size() < 2) return 0.0;
  double total = 0.0;
  for (int64_t qb = 0; qb < level_len[1]; ++qb) {
    const int64_t rows = std::min<int64_t>(block, len - qb * block);
    total += static_cast<double>(rows) * keys_for_block(0, 0, qb);
  }
  return total / static_cast<double>(len);
}

// Built with std::string appends rather than a std::ostringstream: the Python module may run in
// a process whose C++ runtime is another copy than the one it was linked with, and stream
// formatting goes through that runtime's locale state.
std::string LlsaPlan::to_string(int64_t b, int64_t h, int64_t max_rows) const {
  using std::to_string;
  std::string os = "llsa plan: len " + to_string(len) + ", block " + to_string(block) + ", topk " +
                   to_string(topk) + ", levels " + to_string(levels) + ", enrich " + (enrich ? "on" : "off") +
                   ", dedupe " + (dedupe ? "on" : "off") + "\n";
  os += "level lengths:";
  for (int64_t n : level_len) os += " " + to_string(n);
  os += "\nbatch " + to_string(b) + ", head " + to_string(h) + "\n";
  for (int l = levels; l >= 1; --l) {
    os += "level " + to_string(l) + " (" + to_string(level_len[l]) + " query tokens; " +
          (l == levels ? "top-k of all level tokens" : "top-k of the children of the parent's picks") +
          (l == 1 ? "; picks are fine key blocks" : "") + ")\n";
    const int64_t rows = max_rows > 0 ? std::min(max_rows, level_len[l]) : level_len[l];
    for (int64_t i = 0; i < rows; ++i) {
      os += "  q " + to_string(i) + ":";
      const int n = pick_count(l, b, h, i);
      for (int s = 0; s < n; ++s) os += " " + to_string(pick(l, b, h, i, s));
      os += "\n";
    }
    if (rows < level_len[l]) os += "  ... (" + to_string(level_len[l] - rows) + " more)\n";
  }
  if (b == 0 && h == 0) {
    char mean[32];
    std::snprintf(mean, sizeof mean, "%g", mean_keys_per_query());
    os += std::string("mean keys per query: ") + mean + "\n";
  }
  return os;
}

BlockIndexBuffer LlsaPlan::fine_index() const {
  BlockIndexBuffer ix = BlockIndexBuffer::empty(batch, heads_q, len, len, block, block, topk);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads_q; ++h)
      for (int64_t qb = 0; qb < level_len[1]; ++qb) {
        const int n = pick_count(1, b, h, qb);
        ix.counts.ptr<int32_t>()[(b * heads_q + h) * level_len[1] + qb] = n;
        for (int s = 0; s < n; ++s)
          ix.indices.ptr<int32_t>()[((b * heads_q + h) * level_len[1] + qb) * topk + s] = pick(1, b, h, qb, s);
      }
  return ix;
}

namespace llsa_detail {

namespace {

// f32 pyramid of one head of a [batch, heads, len, d] tensor: levels 1..L (level 0 is
// only read), each [n_l, d] contiguous.
std::vector<std::vector<float>> pool_head(const Tensor& t, int64_t b, int64_t h, const std::vector<int64_t>& len,
                                          int block) {
  const int64_t d = t.shape[3];
  const int L = static_cast<int>(len.size()) - 1;
  std::vector<std::vector<float>> levels(L + 1);
  levels[0].resize(len[0] * d);
  for (int64_t i = 0; i < len[0]; ++i)
    detail::load_row(t.data, t.dtype, b * t.strides[0] + h * t.strides[1] + i * t.strides[2], d,
                     levels[0].data() + i * d);
  for (int l = 1; l <= L; ++l) {
    levels[l].resize(len[l] * d);
    mean_pool(levels[l - 1].data(), len[l - 1], d, block, levels[l].data());
  }
  levels[0].clear();
  levels[0].shrink_to_fit();
  return levels;
}

// Keep the top `keep` of (score, token) candidates: larger score first, ties to the
// smaller token; NaN scores rank last. Writes the kept tokens ascending.
void top_k(std::vector<std::pair<float, int32_t>>& cand, int keep, int32_t* out) {
  for (auto& c : cand)
    if (std::isnan(c.first)) c.first = -std::numeric_limits<float>::infinity();
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), better);
  for (int s = 0; s < keep; ++s) out[s] = cand[s].second;
  std::sort(out, out + keep);
}

}  // namespace

LlsaPlan empty_plan(const Tensor& q, const Tensor& k, const LlsaOptions& options, int levels) {
  LlsaPlan plan;
  plan.block = options.block;
  plan.levels = levels;
  plan.enrich = options.enrich;
  plan.dedupe = options.dedupe;
  plan.batch = q.shape[0];
  plan.heads_q = q.shape[1];
  plan.heads_kv = k.shape[1];
  plan.len = q.shape[2];
  plan.level_len = level_lengths(plan.len, plan.block, levels);
  // No level has more candidates than level 1 has tokens: a larger topk only widens the
  // plan's arrays, so it is clipped there.
  plan.topk = static_cast<int>(std::min<int64_t>(options.topk, plan.level_len[1]));
  for (int l = 1; l <= levels; ++l) {
    plan.picks.emplace_back(DType::i32, std::vector<int64_t>{plan.batch, plan.heads_q, plan.level_len[l], plan.topk});
    plan.pick_counts.emplace_back(DType::i32, std::vector<int64_t>{plan.batch, plan.heads_q, plan.level_len[l]});
    std::fill_n(plan.picks.back().ptr<int32_t>(), plan.picks.back().numel(), -1);
    std::fill_n(plan.pick_counts.back().ptr<int32_t>(), plan.pick_counts.back().numel(), 0);
  }
  return plan;
}

LlsaPlan build_plan(const Tensor& q, const Tensor& k, const LlsaOptions& options, int levels) {
  LlsaPlan plan = empty_plan(q, k, options, levels);
  const int64_t d = q.shape[3], group = plan.heads_q / plan.heads_kv;
  const int B = plan.block, K = plan.topk;
  cpu::parallel_for(plan.batch * plan.heads_q, options.num_threads, [&](int64_t item, int) {
    const int64_t b = item / plan.heads_q, h = item % plan.heads_q;
    const auto pq = pool_head(q, b, h, plan.level_len, B);
    const auto pk = pool_head(k, b, h / group, plan.level_len, B);
    std::vector<std::pair<float, int32_t>> cand;
    auto score = [&](int l, int64_t i, int64_t j) {
      const float* a = pq[l].data() + i * d;
      const float* c = pk[l].data() + j * d;
      float s = 0.0f;
      for (int64_t t = 0; t < d; ++t) s += a[t] * c[t];
      return s;
    };
    for (int l = levels; l >= 1; --l) {
      const int64_t n = plan.level_len[l];
      int32_t* picks = plan.picks[l - 1].ptr<int32_t>() + (b * plan.heads_q + h) * n * K;
      int32_t* counts = plan.pick_counts[l - 1].ptr<int32_t>() + (b * plan.heads_q + h) * n;
      for (int64_t i = 0; i < n; ++i) {
        cand.clear();
        if (l == levels) {
          for (int64_t j = 0; j < n; ++j) cand.emplace_back(score(l, i, j), static_cast<int32_t>(j));
        } else {
          const int64_t parent = i / B;
          const int32_t* parent_picks = plan.picks[l].ptr<int32_t>() + ((b * plan.heads_q + h) * plan.level_len[l + 1] + parent) * K;
          const int parent_count = plan.pick_counts[l].ptr<int32_t>()[(b * plan.heads_q + h) * plan.level_len[l + 1] + parent];
          for (int s = 0; s < parent_count; ++s)
            for (int64_t j = int64_t{parent_picks[s]} * B; j < std::min<int64_t>((parent_picks[s] + 1) * int64_t{B}, n); ++j)
              cand.emplace_back(score(l, i, j), static_cast<int32_t>(j));
        }
        const int keep = static_cast<int>(std::min<int64_t>(K, static_cast<int64_t>(cand.size())));
        top_k(cand, keep, picks + i * K);
        counts[i] = keep;
      }
    }
  });
  return plan;
}

}  // namespace llsa_detail
}  // namespace sparsa
