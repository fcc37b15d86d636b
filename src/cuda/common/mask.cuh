// Internal: the per-element masks of sparsa/attention.h in the kernels' form, and their index
// arithmetic, shared by the executors (the flash and split-KV kernels' mask hook) and BA-Att's
// mask-aware selection. Everything here is __host__ __device__, so that
// tests/test_cuda_mask_logic.cu checks it on the host against core/mask.cpp and
// mask_block_visibility (methods/ba_att/select.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "sparsa/attention.h"

namespace sparsa::cuda::detail {

// MaskArgs::kind (mask_args maps sparsa::MaskKind onto these).
constexpr int kMaskNone = 0, kMaskCausal = 1, kMaskBlockCausal = 2, kMaskSlidingWindow = 3;
// Blocks and windows beyond any sequence act as this (as in core/mask.cpp).
constexpr int64_t kMaskUnbounded = int64_t{1} << 42;

// A mask as the kernels read it; the block and windows bounded by kMaskUnbounded, so that no
// position arithmetic overflows.
struct MaskArgs {
  int mask_kind = kMaskNone;
  int64_t mask_block = 0, mask_left = 0, mask_right = 0;
};

// A sparsa::Mask into *a (host).
inline void mask_args(const Mask& m, MaskArgs* a) {
  switch (m.kind) {
    case MaskKind::none: a->mask_kind = kMaskNone; break;
    case MaskKind::causal: a->mask_kind = kMaskCausal; break;
    case MaskKind::block_causal: a->mask_kind = kMaskBlockCausal; break;
    case MaskKind::sliding_window: a->mask_kind = kMaskSlidingWindow; break;
  }
  a->mask_block = std::min(m.block, kMaskUnbounded);
  a->mask_left = std::min(m.window_left, kMaskUnbounded);
  a->mask_right = std::min(m.window_right, kMaskUnbounded);
}

// floor(a / b) for b > 0 and any sign of a.
__host__ __device__ __forceinline__ int64_t floor_div64(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
__host__ __device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}

// The keys query i (original position, 0 <= i < len_q) sees: [*kb, *ke), clipped to [0, len_kv]
// (kb >= ke: none). Queries are end-aligned: query i stands at key position i + len_kv - len_q.
__host__ __device__ __forceinline__ void mask_window(const MaskArgs& p, int64_t i, int len_q, int len_kv, int& kb,
                                                     int& ke) {
  const int64_t pos = i + (len_kv - len_q);
  int64_t begin = 0, end = len_kv;
  if (p.mask_kind == kMaskCausal) {
    end = pos + 1;
  } else if (p.mask_kind == kMaskBlockCausal) {
    end = (floor_div64(pos, p.mask_block) + 1) * p.mask_block;
  } else if (p.mask_kind == kMaskSlidingWindow) {
    begin = pos - p.mask_left;
    end = pos + p.mask_right + 1;
  }
  kb = static_cast<int>(clamp64(begin, 0, len_kv));
  ke = static_cast<int>(clamp64(end, 0, len_kv));
}

// The keys some query of the in-order positions [begin, end) may see (windows do not decrease
// along the queries: the first query's begin, the last query's end).
__host__ __device__ __forceinline__ void tile_key_range(const MaskArgs& p, int begin, int end, int len_q, int len_kv,
                                                        int& key_min, int& key_max) {
  int unused;
  mask_window(p, begin, len_q, len_kv, key_min, unused);
  mask_window(p, end - 1, len_q, len_kv, unused, key_max);
}

// The keys every query of the in-order positions [begin, end) sees: [*core_lo, *core_hi) (empty
// when core_lo >= core_hi): the last query's begin, the first query's end (windows do not
// decrease along the queries). A key tile inside it needs no per-element mask for any of these
// rows (the flash kernels compute such tiles without the mask hook).
__host__ __device__ __forceinline__ void tile_key_core(const MaskArgs& p, int begin, int end, int len_q, int len_kv,
                                                       int& core_lo, int& core_hi) {
  int unused;
  mask_window(p, end - 1, len_q, len_kv, core_lo, unused);
  mask_window(p, begin, len_q, len_kv, unused, core_hi);
}

// BA-Att's mask-aware selection: how query block qb (queries [qb bq, (qb + 1) bq) of len_q) sees
// key block kb (keys [kb bkv, (kb + 1) bkv) of len_kv), as mask_block_visibility states it: 0
// hidden (no query sees a key of it), 2 diagonal (it holds some query's last visible key; never
// without a mask), 1 visible otherwise. The rows that see no key are the first ones (end-aligned
// windows are empty only before the keys start), and consecutive windows touch or overlap, so the
// keys the block's queries see are one range [first non-empty row's begin, last row's end), and
// the blocks of the rows' last keys are found by a binary search over the rows' ends.
__host__ __device__ __forceinline__ int block_visibility(const MaskArgs& p, int qb, int kb, int bq, int bkv,
                                                          int len_q, int len_kv) {
  const int r0 = qb * bq, r1 = (qb + 1) * bq < len_q ? (qb + 1) * bq : len_q;
  int lo = r0, hi = r1;  // first non-empty row in [r0, r1] (r1: none)
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    int b, e;
    mask_window(p, mid, len_q, len_kv, b, e);
    if (b < e) hi = mid;
    else lo = mid + 1;
  }
  if (lo >= r1) return 0;
  int begin, end, unused;
  mask_window(p, lo, len_q, len_kv, begin, unused);
  mask_window(p, r1 - 1, len_q, len_kv, unused, end);
  const int k0 = kb * bkv, k1 = (kb + 1) * bkv < len_kv ? (kb + 1) * bkv : len_kv;
  if (k1 <= begin || k0 >= end) return 0;
  if (p.mask_kind == kMaskNone) return 1;
  // The first non-empty row whose last key is at or past k0; diagonal if that key is in the block.
  int a = lo, z = r1;
  while (a < z) {
    const int mid = a + (z - a) / 2;
    int b, e;
    mask_window(p, mid, len_q, len_kv, b, e);
    if (e - 1 >= k0) z = mid;
    else a = mid + 1;
  }
  if (a >= r1) return 1;
  int b, e;
  mask_window(p, a, len_q, len_kv, b, e);
  return e - 1 < k1 ? 2 : 1;
}

}  // namespace sparsa::cuda::detail
