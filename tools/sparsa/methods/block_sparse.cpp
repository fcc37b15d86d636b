// `block_sparse`: the block-sparse executor over either a seeded random plan or a plan
// read from a file. The random plan is the executor's own benchmark: it has the cost
// of a real selector's plan of the same density, without a selector.
//
// Random plan: each query block keeps round(density * num_kv_blocks) key blocks (at
// least 1): its "diagonal" block (the key block at the same relative position, so
// the plan of Lq == Lk is the true diagonal) plus uniformly drawn others. Each
// (batch, head, query block) row draws from its own generator seeded by
// (seed, batch, head, query block), so the plan does not depend on thread count or order.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include "core/validate.h"
#include "index_file.h"
#include "methods.h"
#include "params.h"
#include "util.h"

namespace sparsa::cli {
namespace {

constexpr int64_t kMaxBlock = 1 << 20;
constexpr int64_t kMaxIndexEntries = int64_t{1} << 28;  // 1 GiB of i32 indices

// SplitMix64 (Steele, Lea, Flood 2014): a tiny, well-mixed generator whose output is
// the same on every platform (std:: distributions are not).
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n); the modulo bias is below n / 2^64.
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Result<BlockIndexBuffer> random_plan(int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_kv, int block_q,
                                     int block_kv, double density, uint64_t seed) {
  const int64_t nq = ceil_div(len_q, block_q), nkv = ceil_div(len_kv, block_kv);
  const int64_t keep = std::clamp<int64_t>(std::llround(density * static_cast<double>(nkv)), 1, nkv);
  const double entries = static_cast<double>(batch) * heads_q * nq * keep;
  if (entries > static_cast<double>(kMaxIndexEntries)) {
    return invalid_argument(format("params: block: a plan of %.3g entries is too large (limit %lld); use a larger "
                                   "block or a lower density",
                                   entries, static_cast<long long>(kMaxIndexEntries)));
  }
  BlockIndexBuffer plan = BlockIndexBuffer::empty(batch, heads_q, len_q, len_kv, block_q, block_kv, keep);
  int32_t* counts = plan.counts.ptr<int32_t>();
  int32_t* indices = plan.indices.ptr<int32_t>();
  std::vector<int32_t> candidates(static_cast<size_t>(nkv));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads_q; ++h) {
      for (int64_t qb = 0; qb < nq; ++qb) {
        const int64_t row = (b * heads_q + h) * nq + qb;
        SplitMix64 rng{seed};
        rng.state ^= SplitMix64{static_cast<uint64_t>(row) * 0x2545F4914F6CDD1Dull}.next();
        const auto diagonal = static_cast<int32_t>(std::min(nkv - 1, qb * nkv / nq));
        // Partial Fisher-Yates over the non-diagonal blocks.
        std::iota(candidates.begin(), candidates.end(), 0);
        std::swap(candidates[diagonal], candidates[nkv - 1]);
        const int64_t pool = nkv - 1;
        for (int64_t s = 0; s < keep - 1; ++s) {
          const int64_t pick = s + rng.below(pool - s);
          std::swap(candidates[s], candidates[pick]);
        }
        int32_t* slots = indices + row * keep;
        std::copy(candidates.begin(), candidates.begin() + (keep - 1), slots);
        slots[keep - 1] = diagonal;
        std::sort(slots, slots + keep);
        counts[row] = static_cast<int32_t>(keep);
      }
    }
  }
  return plan;
}

Result<MethodOutput> run_block_sparse(const MethodInputs& in) {
  const Params& p = in.params;
  SPARSA_RETURN_IF_ERROR(
      check_known_params("block_sparse", p, {"block", "block_q", "block_kv", "density", "seed", "index"}));
  auto index_path = param_string(p, "index", "");
  if (!index_path.ok()) return index_path.status();
  const bool from_file = !index_path->empty();
  const std::string kExtension = ".safetensors";
  if (from_file && (index_path->size() < kExtension.size() ||
                    index_path->compare(index_path->size() - kExtension.size(), kExtension.size(), kExtension) != 0)) {
    return invalid_argument("params: index: expected a .safetensors index file, got '" + *index_path + "'");
  }
  if (from_file && (p.contains("density") || p.contains("seed"))) {
    return invalid_argument("params: density and seed choose a random plan; they cannot be combined with an index file");
  }
  if (p.contains("block") && (p.contains("block_q") || p.contains("block_kv"))) {
    return invalid_argument("params: block sets both block_q and block_kv; give either block or block_q/block_kv");
  }
  auto block = param_int(p, "block", 64, 1, kMaxBlock);
  if (!block.ok()) return block.status();
  auto block_q = param_int(p, "block_q", *block, 1, kMaxBlock);
  if (!block_q.ok()) return block_q.status();
  auto block_kv = param_int(p, "block_kv", *block, 1, kMaxBlock);
  if (!block_kv.ok()) return block_kv.status();
  auto density = param_real(p, "density", 0.1, 0.0, 1.0, /*min_open=*/true);
  if (!density.ok()) return density.status();
  auto seed = param_int(p, "seed", 0, 0, INT64_MAX);
  if (!seed.ok()) return seed.status();

  // The plan is built from q's and k's shapes, so they are checked first; the executor
  // checks everything else (GQA ratio, dtypes, v) before it touches data.
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor("q", in.q, Device{}));
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor("k", in.k, Device{}));
  const int64_t batch = in.q.shape[0], heads_q = in.q.shape[1], len_q = in.q.shape[2], len_kv = in.k.shape[2];

  const double t0 = now_seconds();
  BlockIndexBuffer plan;
  nlohmann::json summary;
  if (from_file) {
    const bool explicit_sizes = p.contains("block") || p.contains("block_q") || p.contains("block_kv");
    auto loaded = read_index_file(*index_path, explicit_sizes ? std::optional<int>(*block_q) : std::nullopt,
                                  explicit_sizes ? std::optional<int>(*block_kv) : std::nullopt);
    if (!loaded.ok()) return loaded.status();
    plan = std::move(loaded).value();
    plan.num_kv_blocks = ceil_div(len_kv, plan.block_kv);
    summary["source"] = *index_path;
  } else {
    auto made = random_plan(batch, heads_q, len_q, len_kv, static_cast<int>(*block_q), static_cast<int>(*block_kv),
                            *density, static_cast<uint64_t>(*seed));
    if (!made.ok()) return made.status();
    plan = std::move(made).value();
    summary["source"] = "random";
    summary["seed"] = *seed;
  }
  const double t1 = now_seconds();

  BlockIndex view = plan.view();
  Result<AttentionOutput> attention = sparsa::block_sparse(in.q, in.k, in.v, view, in.options);
  if (!attention.ok()) return attention.status();
  MethodOutput output;
  output.attention = std::move(attention).value();
  output.density = block_index_density(view, len_q, len_kv);
  output.select_seconds = t1 - t0;
  summary["block_q"] = plan.block_q;
  summary["block_kv"] = plan.block_kv;
  summary["num_q_blocks"] = plan.num_q_blocks;
  summary["num_kv_blocks"] = plan.num_kv_blocks;
  summary["capacity"] = plan.indices.shape().size() == 4 ? plan.indices.shape()[3] : 0;
  summary["density"] = output.density;
  output.plan = std::move(summary);
  return output;
}

}  // namespace

SPARSA_REGISTER_METHOD(Method{
    .name = "block_sparse",
    .summary = "block-sparse executor over a seeded random plan (the executor's own benchmark) or an index file",
    .param_help = {"block=64       tokens per block (sets block_q and block_kv)",
                   "block_q, block_kv  query / key tokens per block (instead of block)",
                   "density=0.1    fraction of key blocks kept per query block, in (0, 1]; the diagonal block is "
                   "always kept",
                   "seed=0         seed of the random plan",
                   "index=FILE     read the plan from a .safetensors index file (same as --index)"},
    .run = run_block_sparse,
    .in_demo = true,
    .demo_params = Params{{"block", 64}, {"density", 0.1}},
    .takes_mask = true,
});

}  // namespace sparsa::cli
