// Internal: the kernels of BA-Att's cuda selector (Algorithm 1 of the BA-Att paper, steps 1-4;
// docs/ba_att.md). The launcher is ba_att.cu; the CPU reference is src/methods/ba_att/cpu_ref.cpp.
//
//   1a. norm_keys_*_kernel   a few lanes per token: ||x||_2 in f32, and the 64-bit radix key
//                            (segment | norm bits | index in the window, norm_key) that makes one
//                            stable keys-only cub::DeviceRadixSort of all tokens equal to a stable
//                            per-(batch, head, window) sort by norm (norms are >= 0, so their
//                            IEEE bits order as the values do);
//   1b. (cub::DeviceRadixSort::SortKeys, in the launcher), then perm_from_keys_kernel;
//   2. block_features_kernel one CTA per (batch, head, block) of permuted tokens: f32 mean and
//                            population variance (two passes, as cpu.cpp) and, for exact / trace,
//                            the covariance; written as the feature vector of cpu.cpp's header, so
//                            that every compensated logit is one inner product;
//   3. block_logits_*kernel  per (batch, query head): logits = A [nq, F] x B [nk, F]' (GQA: query
//                            head h reads kv head h / group): on the tensor cores with f32
//                            accuracy (3xTF32 on wgmma, 128x128 tiles) when F % 4 == 0, else an
//                            f32 SIMT product in 64x64 tiles (the 3xTF32 mma.sync kernel and the
//                            SIMT 128x128 kernel stay reachable through ba_att_hooks.h);
//   4. select_top_warp_kernel fixed budgets (kappa, density), rows of up to 2048 key blocks: one
//                            warp per query-block row, a radix select of the kappa-th (logit desc,
//                            index asc) key and a compaction of the kept indices, ascending;
//      select_top_kernel     the same for rows of up to 8192 key blocks, one CTA per row;
//      select_kernel         mass budgets (and rows over kMaxTopBlocks): a bitonic sort of those
//                            keys, the f64 cumulative mass, then the kept indices ascending.
// Non-finite norms and logits are recorded (lowest flat index) in an ErrorWord that the launcher
// reads back once at the end and turns into a Status.
// One file per step: norm_keys.cuh (1), block_features.cuh (2), block_logits.cuh (3),
// select_blocks.cuh (4); ba_att_common.cuh holds what they share.
#pragma once

#include "cuda/select/ba_att_common.cuh"
#include "cuda/select/norm_keys.cuh"
#include "cuda/select/block_features.cuh"
#include "cuda/select/block_logits.cuh"
#include "cuda/select/select_blocks.cuh"
