// Internal pieces of LLSA shared by the plan, the f64 reference and the fast CPU path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sparsa/llsa.h"

namespace sparsa::llsa_detail {

// B^level, saturated at `cap` (regions larger than the sequence cover all of it).
inline int64_t region_size(int block, int level, int64_t cap) {
  int64_t r = 1;
  for (int l = 0; l < level; ++l) {
    if (r > cap / block) return cap;
    r *= block;
  }
  return std::min(r, cap);
}

// Level lengths n_0 = n, n_l = ceil(n_{l-1} / B).
inline std::vector<int64_t> level_lengths(int64_t n, int block, int levels) {
  std::vector<int64_t> len(levels + 1);
  len[0] = n;
  for (int l = 1; l <= levels; ++l) len[l] = (len[l - 1] + block - 1) / block;
  return len;
}

// Mean pool by `block` of src [n_src, d] (contiguous) into dst [ceil(n_src / block), d]:
// each coarse row is the mean of its (up to block) valid children, accumulated in T in
// child order (the same order everywhere, so the plan and the executor agree bit for bit).
template <class T>
void mean_pool(const T* src, int64_t n_src, int64_t d, int block, T* dst) {
  const int64_t n_dst = (n_src + block - 1) / block;
  for (int64_t t = 0; t < n_dst; ++t) {
    T* out = dst + t * d;
    std::fill(out, out + d, T(0));
    const int64_t first = t * block, last = std::min<int64_t>(first + block, n_src);
    for (int64_t u = first; u < last; ++u)
      for (int64_t c = 0; c < d; ++c) out[c] += src[u * d + c];
    const T inv = T(1) / static_cast<T>(last - first);
    for (int64_t c = 0; c < d; ++c) out[c] *= inv;
  }
}

// Pooling backward: each child of coarse token t receives grad[t] / children(t).
template <class T>
void mean_pool_backward(const T* grad_dst, int64_t n_src, int64_t d, int block, T* grad_src) {
  const int64_t n_dst = (n_src + block - 1) / block;
  for (int64_t t = 0; t < n_dst; ++t) {
    const int64_t first = t * block, last = std::min<int64_t>(first + block, n_src);
    const T inv = T(1) / static_cast<T>(last - first);
    for (int64_t u = first; u < last; ++u)
      for (int64_t c = 0; c < d; ++c) grad_src[u * d + c] += grad_dst[t * d + c] * inv;
  }
}

// The keys of fine query block qb of (b, h), as runs [first, end) of tokens of one
// level; a run never crosses an aligned group of `block` tokens of its level.
// f(level, first, end). This is the definition of which keys LLSA visits (llsa.h).
template <class F>
void for_each_key_run(const LlsaPlan& plan, int64_t b, int64_t h, int64_t qb, F&& f) {
  const int B = plan.block, L = plan.levels;
  // Ancestor of qb at level l (level 1 is qb itself).
  auto ancestor = [&](int l) {
    int64_t a = qb;
    for (int i = 1; i < l; ++i) a /= B;
    return a;
  };
  // Emit [first, end) of `level`, leaving out the picks of `excluded_level`'s ancestor
  // (dedupe), split at aligned groups of B.
  auto emit = [&](int level, int64_t first, int64_t end, int excluded_level) {
    const int64_t a = excluded_level > 0 ? ancestor(excluded_level) : 0;
    const int count = excluded_level > 0 ? plan.pick_count(excluded_level, b, h, a) : 0;
    int slot = 0;
    for (int64_t g = first; g < end;) {
      const int64_t group_end = std::min(end, (g / B + 1) * B);
      int64_t run = g;
      for (int64_t t = g; t < group_end; ++t) {
        bool skip = false;
        if (excluded_level > 0) {
          while (slot < count && plan.pick(excluded_level, b, h, a, slot) < t) ++slot;
          skip = slot < count && plan.pick(excluded_level, b, h, a, slot) == t;
        }
        if (skip) {
          if (t > run) f(level, run, t);
          run = t + 1;
        }
      }
      if (group_end > run) f(level, run, group_end);
      g = group_end;
    }
  };
  // Level 0: the tokens of qb's picked key blocks.
  const int fine = plan.pick_count(1, b, h, qb);
  for (int s = 0; s < fine; ++s) {
    const int64_t kb = plan.pick(1, b, h, qb, s);
    emit(0, kb * B, std::min<int64_t>((kb + 1) * B, plan.level_len[0]), 0);
  }
  if (!plan.enrich) return;
  // Levels 1..L-1: the candidates of a_l, i.e. the children of a_{l+1}'s picks.
  for (int l = 1; l < L; ++l) {
    const int64_t parent = ancestor(l + 1);
    const int n = plan.pick_count(l + 1, b, h, parent);
    for (int s = 0; s < n; ++s) {
      const int64_t p = plan.pick(l + 1, b, h, parent, s);
      emit(l, p * B, std::min<int64_t>((p + 1) * B, plan.level_len[l]), plan.dedupe ? l : 0);
    }
  }
  // Level L: every token.
  emit(L, 0, plan.level_len[L], plan.dedupe ? L : 0);
}

// A plan's shape for q and k with its pick arrays allocated (picks -1, counts 0).
LlsaPlan empty_plan(const Tensor& q, const Tensor& k, const LlsaOptions& options, int levels);
// Pooling (f32) and coarse-to-fine selection; inputs validated, levels resolved.
LlsaPlan build_plan(const Tensor& q, const Tensor& k, const LlsaOptions& options, int levels);

// ---- the f64 reference (the specification), on contiguous double arrays ----------
// q [batch, heads_q, len, d], k/v [batch, heads_kv, len, d], out like q, lse [batch,
// heads_q, len]; the plan fixes the selection (not differentiated).
struct RefShape {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len = 0, head_dim = 0;
  double scale = 1.0;
};
void ref_forward(const RefShape& shape, const LlsaPlan& plan, const double* q, const double* k,
                 const double* v, double* out, double* lse);
// Writes (overwrites) dq, dk, dv.
void ref_backward(const RefShape& shape, const LlsaPlan& plan, const double* q, const double* k,
                  const double* v, const double* out, const double* lse, const double* d_o, double* dq,
                  double* dk, double* dv);

// ---- the fast CPU path --------------------------------------------------------------
// Inputs as validated tensors; scale resolved.
struct CpuArgs {
  Tensor q, k, v, out, lse, d_o, dq, dk, dv;
  float scale = 1.0f;
  int num_threads = 0;
};
// *not_finite is set when some row's f32 result is not finite (logits beyond f32, or a NaN
// input): the caller then computes the forward in f64 (ref_forward), as cpu_ref does.
Status cpu_forward(const CpuArgs& args, const LlsaPlan& plan, bool* not_finite);
Status cpu_backward(const CpuArgs& args, const LlsaPlan& plan);

}  // namespace sparsa::llsa_detail

// ---- the cuda backend (src/cuda/llsa/llsa.cu) ------------------------------------------
namespace sparsa::llsa_cuda {
// One call's validated tensors (every one on q's CUDA device), levels and scale resolved.
struct Call {
  Tensor q, k, v, out, lse;  // out, lse: the forward's outputs, the backward's inputs
  Tensor d_o, dq, dk, dv;    // the backward
  float scale = 1.0f;
  int levels = 1;
  LlsaOptions options;
};
// What the cuda backend cannot run (dtype, head_dim, topk, sizes): a clear error.
Status check(const Tensor& q, const Tensor& k, int levels, const LlsaOptions& options);
// The plan built on the device, copied into host arrays (synchronises options.stream).
Status plan(const Tensor& q, const Tensor& k, const LlsaOptions& options, int levels, LlsaPlan* out);
// host_plan null: the plan is built on the device (no round trip); else its picks are uploaded.
Status forward(const Call& call, const LlsaPlan* host_plan);
Status backward(const Call& call, const LlsaPlan* host_plan);
// The forward rung this thread's last cuda forward ran (1: per-warp streams, 2: shared coarse
// keys, 3: the coarsest level through the dense executor, 4: the coarsest level in a kernel with
// its keys resident in shared memory; 0: none yet).
// SPARSA_LLSA_FORWARD_RUNG=1, 2, 3 or 4 in the environment forces a rung (3 and 4 where exact).
int last_forward_rung();
// The keys a softmax step of that forward's fine blocks took: 16, or 64 with
// SPARSA_LLSA_FINE_STEP=64 (head_dim 64, rung 2 or more); 0: none yet.
int last_forward_fine_keys();
}  // namespace sparsa::llsa_cuda
