// sparsa/ba_att.h — Block Approximate Sparse Attention (BA-Att), the selector of
// "Efficient Long-Context Modeling in Diffusion Language Models via Block Approximate
// Sparse Attention" (Algorithm 1, Eq. 2-14); docs/ba_att.md has the math and choices.
//
// Per (batch, head):
//   1. optional norm sort of Q (per query head) and of K (per kv head): stable ascending
//      sort of ||x_i||_2, over the whole sequence or within windows of sort_window tokens
//      (Eq. 9-10), giving perm_q / perm_kv;
//   2. blocks of block_q / block_kv consecutive permuted tokens (the last may be partial);
//      per block the mean and the per-dimension population variance;
//   3. block logits l = scale * Qbar . Kbar (Eq. 2) and, when compensate, l' = l + beta*Delta
//      where Delta is one of (scale^2 = 1/d by default):
//        diagonal (Eq. 14): scale^2 * sum_t (VarQ_t Kbar_t^2 + VarK_t Qbar_t^2 + VarQ_t VarK_t)
//        exact:             scale^2 * (Kbar' SigmaQ Kbar + Qbar' SigmaK Qbar + tr(SigmaQ SigmaK)),
//                           the exact variance of the block pair's token logits, whose
//                           restriction to diagonal covariances is Eq. 14
//        trace (Eq. 13 as printed): scale^2 * tr(SigmaQ SigmaK)
//   4. per query block, softmax over key blocks and a budget (top-kappa, a density
//      fraction, or the smallest set reaching cumulative mass tau).
// GQA: query head h scores the key blocks of kv head h / (heads_q / heads_kv).
// The plan is a BlockIndexBuffer with perm_q / perm_kv; ba_att() runs it through
// sparsa::block_sparse, which returns O in the original token order.
// Backend::cuda (q, k on a cuda device) computes all four steps on the device and returns a
// plan in device memory (BlockIndexBuffer::on_device()); docs/ba_att.md says how its f32
// arithmetic differs from the CPU's f64.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "sparsa/attention.h"
#include "sparsa/index.h"
#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

// How many key blocks each query block keeps. Shared by every block selector.
//   top_kappa: the kappa highest-scoring key blocks (kappa >= 1; kappa > num_kv_blocks keeps all).
//   density:   kappa = ceil(fraction * num_kv_blocks - 1e-9), fraction in (0, 1] (the 1e-9
//              absorbs decimal fractions that are inexact in binary, e.g. 0.7 * 10).
//   mass:      the smallest prefix of key blocks, sorted by descending score, whose
//              cumulative softmax mass reaches tau * (total mass), tau in (0, 1].
// Ties in the score order: the lower key block index comes first. Kept indices are
// written ascending.
enum class BudgetKind : uint8_t { top_kappa, density, mass };

struct Budget {
  BudgetKind kind = BudgetKind::density;
  double value = 0.5;  // kappa (an integer), fraction or tau

  static Budget top_kappa(int64_t kappa) { return {BudgetKind::top_kappa, static_cast<double>(kappa)}; }
  static Budget density(double fraction) { return {BudgetKind::density, fraction}; }
  static Budget mass(double tau) { return {BudgetKind::mass, tau}; }
};

const char* budget_kind_name(BudgetKind kind);  // "top_kappa", "density", "mass"
std::string describe(const Budget& budget);     // "density=0.3", "top_kappa=8", "mass=0.9"
// "budget: ..." errors for a kappa < 1 or not an integer, a fraction or tau outside (0, 1], NaN.
Status validate(const Budget& budget);

enum class Compensation : uint8_t {
  diagonal,  // Eq. 14, O((Nq + Nk) d) extra; the default
  exact,     // the full-covariance variance of the token logits (Eq. 14 is its diagonal case), O(d^2)
  trace,     // Eq. 13 as printed: tr(SigmaQ SigmaK) only, O(d^2)
};
const char* compensation_name(Compensation c);  // "diagonal", "exact", "trace"
Result<Compensation> parse_compensation(const std::string& name);

struct BaAttOptions {
  int block_q = 64;
  int block_kv = 64;
  bool sort_q = true;
  bool sort_k = true;
  int64_t sort_window = 0;  // 0: one global sort; else a multiple of block_q and block_kv
  bool compensate = true;
  Compensation compensation = Compensation::diagonal;
  float beta = 1.0f;
  Budget budget = Budget::density(0.5);
  std::optional<float> scale;  // logit scale; default 1/sqrt(head_dim)
  Backend backend = Backend::cpu;
  int num_threads = 0;         // cpu backend; 0 = hardware concurrency
  bool check_finite = false;   // refuse NaN/Inf in q, k (and v in ba_att)
  // cuda backend: the stream (a cudaStream_t) the selection and the executor are ordered on (the
  // key side forks to a second stream and joins back to this one); null is the legacy default
  // stream. The plan's arrays are allocated on it (DeviceArray). One read-back at the end (the
  // selector's error word) synchronises this stream, not the device.
  void* stream = nullptr;
  // ba_att: the executor's per-element mask (sparsa/attention.h), on original token positions,
  // so a sorted plan is masked exactly too. Without mask_aware the selection does not see it: a
  // plan may spend its budget on key blocks the mask then hides (those cost nothing: the executor
  // skips them).
  Mask mask;
  // The selection sees the mask (causal prefill, block diffusion's block-causal prefill): per
  // query block, key blocks the mask hides from every query of the block are never chosen; the
  // blocks holding the last key some query of the block sees (the diagonal of a causal mask) are
  // always kept, so no query is left without keys; the budget counts the blocks the mask leaves
  // visible (density F keeps ceil(F * visible) blocks, the diagonal ones first). With mask none
  // nothing is hidden or forced: the plain selection. Needs sort_q = sort_k = false (a norm sort
  // moves tokens across the mask's blocks); the cpu and cpu_ref backends (the cuda selector does
  // not see the mask yet).
  bool mask_aware = false;
};

// The selector's intermediate results, for tests, evaluation and `sparsa plan`.
struct BaAttScores {
  int block_q = 0, block_kv = 0;
  int64_t num_q_blocks = 0, num_kv_blocks = 0;
  HostArray logits;   // f32 [batch, heads_q, num_q_blocks, num_kv_blocks]: l' (= l without compensation)
  HostArray perm_q;   // i32 [batch, heads_q, len_q]; empty() without sort_q
  HostArray perm_kv;  // i32 [batch, heads_kv, len_kv]; empty() without sort_k
};

// Steps 1-3 (no budget).
Result<BaAttScores> ba_att_scores(const Tensor& q, const Tensor& k, const BaAttOptions& options = {});
// Steps 1-4: the plan.
Result<BlockIndexBuffer> ba_att_plan(const Tensor& q, const Tensor& k, const BaAttOptions& options = {});
// Plan + block_sparse (same backend). O in the original order of q. With Backend::cuda, q, k,
// v live on one cuda device (bf16 or f16 for the executor), the plan is built on that device
// and the allocating form copies O and LSE back to the host.
Status ba_att(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
              const BaAttOptions& options = {});
Result<AttentionOutput> ba_att(const Tensor& q, const Tensor& k, const Tensor& v,
                               const BaAttOptions& options = {});

// The number of key blocks a top_kappa or density budget keeps of n (1 <= count <= n, n >= 1);
// 0 for a mass budget (its count depends on the scores).
int64_t fixed_block_count(const Budget& budget, int64_t n);

// Budget applied to one row of scores (exposed for xattention and tests).
// key[0..n): the order (descending, ties -> lower index); weight[0..n) >= 0: the mass used
// by BudgetKind::mass; forced[0..n) (may be null): blocks kept regardless, counted first
// against kappa and mass. Writes the kept indices ascending to out and returns their count.
int64_t select_blocks(const double* key, const double* weight, const bool* forced, int64_t n,
                      const Budget& budget, int32_t* out);

// How a mask leaves key block j to query block qb (unsorted blocks of block_q / block_kv tokens,
// queries aligned at the end of the keys as the mask defines): hidden (no query of the block sees
// a key of it), diagonal (it holds the last key some query of the block sees; none with mask
// none, where every key is visible) or visible (the others).
enum class BlockVisibility : uint8_t { hidden, visible, diagonal };
// out[0..ceil(len_kv / block_kv)): the visibility of every key block to query block qb.
void mask_block_visibility(const Mask& mask, int64_t qb, int block_q, int block_kv, int64_t len_q, int64_t len_kv,
                           BlockVisibility* out);

// select_blocks over the key blocks a mask leaves (mask_aware selections): hidden ones are out,
// diagonal ones forced (with forced[j], which may be null, for the others), the budget counted
// over the n' blocks not hidden. Writes block indices ascending to out; returns their count (0
// when every block is hidden).
int64_t select_visible_blocks(const double* key, const double* weight, const bool* forced,
                              const BlockVisibility* visibility, int64_t n, const Budget& budget, int32_t* out);

// The norm sort of step 1 for one sequence: perm[p] = original token at sorted position p.
// norms[0..len); window 0 = global. Stable: equal norms keep their original order.
void norm_sort(const double* norms, int64_t len, int64_t window, int32_t* perm);

}  // namespace sparsa
