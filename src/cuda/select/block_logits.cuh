// Internal: step 3 of BA-Att's cuda selector (ba_att_kernels.cuh): compensated block logits, a
// batched NT product of feature matrices.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/wgmma.cuh"
#include "cuda/select/ba_att_common.cuh"

namespace sparsa::cuda::ba_att {

// ---- 4. block logits: a batched NT product of feature matrices -----------------------------------

constexpr int kTile = 64, kTileK = 16, kLogitThreads = 256;

// grid (ceil(nk / 64), ceil(nq / 64), batch * heads_q); logits [batch * heads_q, nq, nk]. Each
// thread computes a 4x4 patch (rows 4*ty.., columns 4*tx..), reading its operands from shared
// memory as float4; F % 4 == 0 (every kind when d % 4 == 0) loads the tiles as float4 too.
__global__ void __launch_bounds__(kLogitThreads)
    block_logits_kernel(const float* __restrict__ query_features, const float* __restrict__ key_features,
                        float* __restrict__ logits, int nq, int nk, int64_t F, int heads_q, int group, int heads_kv,
                        ErrorWord* err) {
  __shared__ __align__(16) float a_tile[kTileK][kTile + 4];
  __shared__ __align__(16) float b_tile[kTileK][kTile + 4];
  const int64_t z = blockIdx.z;
  const int64_t zk = (z / heads_q) * heads_kv + (z % heads_q) / group;
  const float* A = query_features + z * nq * F;
  const float* B = key_features + zk * nk * F;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int load_row = threadIdx.x / 4, load_col = (threadIdx.x % 4) * 4;
  const int ra = row0 + load_row, rb = col0 + load_row;
  const bool vector_loads = F % 4 == 0;
  float acc[4][4] = {};
  for (int64_t f0 = 0; f0 < F; f0 += kTileK) {
    float av[4] = {}, bv[4] = {};
    if (vector_loads) {  // f0 + load_col < F implies all four are in range
      if (f0 + load_col < F) {
        if (ra < nq) {
          const float4 x = *reinterpret_cast<const float4*>(A + ra * F + f0 + load_col);
          av[0] = x.x, av[1] = x.y, av[2] = x.z, av[3] = x.w;
        }
        if (rb < nk) {
          const float4 x = *reinterpret_cast<const float4*>(B + rb * F + f0 + load_col);
          bv[0] = x.x, bv[1] = x.y, bv[2] = x.z, bv[3] = x.w;
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const bool in_f = f0 + load_col + u < F;
        av[u] = ra < nq && in_f ? A[ra * F + f0 + load_col + u] : 0.0f;
        bv[u] = rb < nk && in_f ? B[rb * F + f0 + load_col + u] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      a_tile[load_col + u][load_row] = av[u];
      b_tile[load_col + u][load_row] = bv[u];
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      const float4 a4 = *reinterpret_cast<const float4*>(&a_tile[kk][4 * ty]);
      const float4 b4 = *reinterpret_cast<const float4*>(&b_tile[kk][4 * tx]);
      const float a[4] = {a4.x, a4.y, a4.z, a4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + 4 * ty + i;
    if (r >= nq) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = col0 + 4 * tx + j;
      if (c >= nk) continue;
      const int64_t flat = (z * nq + r) * nk + c;
      if (!isfinite(acc[i][j])) atomicMin(&err->first[kErrLogit], static_cast<unsigned long long>(flat));
      logits[flat] = acc[i][j];
    }
  }
}

// What both 128x128-tile kernels share. LogitTile: the tile's query-feature rows A, key-feature
// rows B (GQA: query head h reads kv head h / group) and the operands one thread brings per k step
// of 8: row t / 2, k (t % 2) * 4 .. + 3 of both tiles (F % 4 == 0: one float4 each, zeros past
// the edges). put_logit: one logit out, a non-finite one recorded (lowest flat index).
struct LogitTile {
  int64_t z, F;
  int row0, col0, load_row, load_k;
  bool a_in, b_in;
  const float* a_src;
  const float* b_src;
  __device__ __forceinline__ LogitTile(const float* query_features, const float* key_features, int nq, int nk,
                                       int64_t F_, int heads_q, int group, int heads_kv, int tile)
      : z(blockIdx.z), F(F_), row0(blockIdx.y * tile), col0(blockIdx.x * tile), load_row(threadIdx.x / 2),
        load_k((threadIdx.x % 2) * 4) {
    const int64_t zk = (z / heads_q) * heads_kv + (z % heads_q) / group;
    a_in = row0 + load_row < nq;
    b_in = col0 + load_row < nk;
    a_src = query_features + z * nq * F + static_cast<int64_t>(row0 + load_row) * F + load_k;
    b_src = key_features + zk * nk * F + static_cast<int64_t>(col0 + load_row) * F + load_k;
  }
  __device__ __forceinline__ void load(int64_t f0, float4& av, float4& bv) const {
    const bool in_f = f0 + load_k < F;  // F % 4 == 0: all four or none
    av = a_in && in_f ? *reinterpret_cast<const float4*>(a_src + f0) : make_float4(0.f, 0.f, 0.f, 0.f);
    bv = b_in && in_f ? *reinterpret_cast<const float4*>(b_src + f0) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
};
__device__ __forceinline__ void put_logit(float* logits, ErrorWord* err, int64_t flat, float x) {
  if (!isfinite(x)) atomicMin(&err->first[kErrLogit], static_cast<unsigned long long>(flat));
  logits[flat] = x;
}
// Logits (r, col) and (r, col + 1) of query head z, col even, as the tensor-core accumulators hold
// them: one 8-byte store when both are in range and nk is even (flat is even), else put_logit
// for each column in range. r < nq is the caller's.
__device__ __forceinline__ void put_logit_pair(float* logits, ErrorWord* err, int64_t z, int nq, int nk, int r,
                                               int col, float x0, float x1) {
  const int64_t flat = (z * nq + r) * nk + col;
  if (col + 1 < nk && nk % 2 == 0) {
    if (!isfinite(x0) || !isfinite(x1)) {
      atomicMin(&err->first[kErrLogit], static_cast<unsigned long long>(isfinite(x0) ? flat + 1 : flat));
    }
    *reinterpret_cast<float2*>(logits + flat) = make_float2(x0, x1);
  } else {
    if (col < nk) put_logit(logits, err, flat, x0);
    if (col + 1 < nk) put_logit(logits, err, flat + 1, x1);
  }
}

// F % 4 == 0 (every kind when d % 4 == 0): 128x128 tiles, 8x8 outputs per thread (rows 4 ty..
// and 64 + 4 ty.., columns 4 tx.. and 64 + 4 tx..), k in steps of 8 through two shared buffers: the
// next step's float4s are loaded into registers while this step's are multiplied, one barrier a
// step. Every logit is still fmaf over k = 0, 1, ..., F - 1 in order (zero-padded past F), the
// order of block_logits_kernel: the two give the same values (a zero logit may differ in sign,
// which order_key and the budgets ignore).
constexpr int kBigTile = 128, kBigTileK = 8, kBigLogitThreads = 256;

__global__ void __launch_bounds__(kBigLogitThreads, 2)
    block_logits_big_kernel(const float* __restrict__ query_features, const float* __restrict__ key_features,
                            float* __restrict__ logits, int nq, int nk, int64_t F, int heads_q, int group,
                            int heads_kv, ErrorWord* err) {
  __shared__ __align__(16) float a_tile[2][kBigTileK][kBigTile + 4];
  __shared__ __align__(16) float b_tile[2][kBigTileK][kBigTile + 4];
  const LogitTile tile(query_features, key_features, nq, nk, F, heads_q, group, heads_kv, kBigTile);
  const int64_t z = tile.z;
  const int row0 = tile.row0, col0 = tile.col0, load_row = tile.load_row, load_k = tile.load_k;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  auto load = [&](int64_t f0, float4& av, float4& bv) { tile.load(f0, av, bv); };
  auto store = [&](int buf, const float4& av, const float4& bv) {
    a_tile[buf][load_k + 0][load_row] = av.x;
    a_tile[buf][load_k + 1][load_row] = av.y;
    a_tile[buf][load_k + 2][load_row] = av.z;
    a_tile[buf][load_k + 3][load_row] = av.w;
    b_tile[buf][load_k + 0][load_row] = bv.x;
    b_tile[buf][load_k + 1][load_row] = bv.y;
    b_tile[buf][load_k + 2][load_row] = bv.z;
    b_tile[buf][load_k + 3][load_row] = bv.w;
  };
  float acc[8][8] = {};
  float4 av, bv;
  load(0, av, bv);
  store(0, av, bv);
  __syncthreads();
  const int64_t steps = (F + kBigTileK - 1) / kBigTileK;
  for (int64_t step = 0; step < steps; ++step) {
    const int buf = static_cast<int>(step & 1);
    const bool more = step + 1 < steps;
    if (more) load((step + 1) * kBigTileK, av, bv);
#pragma unroll
    for (int kk = 0; kk < kBigTileK; ++kk) {
      const float4 a0 = *reinterpret_cast<const float4*>(&a_tile[buf][kk][4 * ty]);
      const float4 a1 = *reinterpret_cast<const float4*>(&a_tile[buf][kk][64 + 4 * ty]);
      const float4 b0 = *reinterpret_cast<const float4*>(&b_tile[buf][kk][4 * tx]);
      const float4 b1 = *reinterpret_cast<const float4*>(&b_tile[buf][kk][64 + 4 * tx]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    if (more) store(buf ^ 1, av, bv);  // buf ^ 1 was last read in the previous step, before its barrier
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = row0 + (i < 4 ? 4 * ty + i : 64 + 4 * ty + i - 4);
    if (r >= nq) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = col0 + (j < 4 ? 4 * tx + j : 64 + 4 * tx + j - 4);
      if (c >= nk) continue;
      put_logit(logits, err, (z * nq + r) * nk + c, acc[i][j]);
    }
  }
}

// ---- 4b. the same product on the tensor cores: 3xTF32 ------------------------------------------
//
// mma.sync m16n8k8 with tf32 operands, f32 accumulation. One tf32 keeps 10 of f32's 23 mantissa
// bits, too few for logits the budgets compare; so every operand is split x = hi + lo with
// hi = tf32(x), lo = tf32(x - hi) (x - hi is exact in f32 and lo keeps its 11 leading bits), and
// a b is accumulated as lo_a hi_b + hi_a lo_b + hi_a hi_b (the small terms first; lo_a lo_b, below
// 2^-22 |a b|, is dropped). Each product is then within ~2^-21 |a b| of a b, and the f32
// accumulation adds at most 2^-24 per addition as before, so a logit stays inside the bound the
// tests check, 2 (block + F) 2^-24 M (tests/test_ba_att_cuda.cpp), though not bit-equal to the SIMT
// kernels' (a different order of additions). Three tensor-core products per term still run well
// above the SIMT kernel's FMAs (Ootomo and Yokota 2022, "Recovering single precision accuracy from
// Tensor Cores while surpassing the FP32 theoretical peak performance", arXiv 2203.03341).
//
// grid (ceil(nk / 128), ceil(nq / 128), batch * heads_q), 8 warps: warp w computes rows
// 32 (w % 4).. and columns 64 (w / 4).. of the 128x128 tile (2 x 8 m16n8 tiles, 64 accumulators
// per thread). k advances 8 at a time through two shared buffers (the next step's float4s are
// loaded into registers while this step's are multiplied, one barrier a step). Operands are split
// into hi and lo once, as they are stored to shared memory (each A element is read by two warps,
// each B element by four), so the inner loop is fragment loads and products only. Shared rows
// are padded to 12 floats: a fragment read (rows g = 0..7, column c = 0..3) touches banks
// 12 g + c mod 32, all different. F % 4 == 0; columns past F are zeros. 4 x 2 x 128 x 12 floats =
// 48 KiB of static shared memory. The default is now block_logits_wgmma_kernel (4c); this one
// stays reachable through set_wgmma_logits(false) (ba_att_hooks.h).
constexpr int kTcTile = 128, kTcTileK = 8, kTcPad = 12, kTcThreads = 256;

__device__ __forceinline__ uint32_t tf32_bits(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
// x = hi + lo to ~2^-22 relative: hi = tf32(x), lo = tf32(x - hi); both as f32 bit patterns.
__device__ __forceinline__ void split_tf32(const float4& x, float4& hi, float4& lo) {
  const float v[4] = {x.x, x.y, x.z, x.w};
  float h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[i] = __uint_as_float(tf32_bits(v[i]));
    l[i] = __uint_as_float(tf32_bits(v[i] - h[i]));
  }
  hi = make_float4(h[0], h[1], h[2], h[3]);
  lo = make_float4(l[0], l[1], l[2], l[3]);
}
// d += a b, m16n8k8, a row-major (4 x tf32), b column-major (2 x tf32), f32 accumulators.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__global__ void __launch_bounds__(kTcThreads, 2)
    block_logits_tf32_kernel(const float* __restrict__ query_features, const float* __restrict__ key_features,
                             float* __restrict__ logits, int nq, int nk, int64_t F, int heads_q, int group,
                             int heads_kv, ErrorWord* err) {
  // [part][buffer][row][k]: part 0 = hi, 1 = lo.
  __shared__ __align__(16) float a_tile[2][2][kTcTile][kTcPad];
  __shared__ __align__(16) float b_tile[2][2][kTcTile][kTcPad];
  const LogitTile tile(query_features, key_features, nq, nk, F, heads_q, group, heads_kv, kTcTile);
  const int64_t z = tile.z;
  const int row0 = tile.row0, col0 = tile.col0, load_row = tile.load_row, load_k = tile.load_k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wm = (warp % 4) * 32, wn = (warp / 4) * 64;
  auto load = [&](int64_t f0, float4& av, float4& bv) { tile.load(f0, av, bv); };
  auto store = [&](int buf, const float4& av, const float4& bv) {
    float4 hi, lo;
    split_tf32(av, hi, lo);
    *reinterpret_cast<float4*>(&a_tile[0][buf][load_row][load_k]) = hi;
    *reinterpret_cast<float4*>(&a_tile[1][buf][load_row][load_k]) = lo;
    split_tf32(bv, hi, lo);
    *reinterpret_cast<float4*>(&b_tile[0][buf][load_row][load_k]) = hi;
    *reinterpret_cast<float4*>(&b_tile[1][buf][load_row][load_k]) = lo;
  };
  auto bits = [](float x) { return __float_as_uint(x); };
  float acc[2][8][4] = {};
  float4 av, bv;
  load(0, av, bv);
  store(0, av, bv);
  __syncthreads();
  const int64_t steps = (F + kTcTileK - 1) / kTcTileK;
  for (int64_t step = 0; step < steps; ++step) {
    const int buf = static_cast<int>(step & 1);
    const bool more = step + 1 < steps;
    if (more) load((step + 1) * kTcTileK, av, bv);
    uint32_t a[2][2][4];  // [part][m tile]: rows g, g + 8 and columns c, c + 4 of the m16k8 tile
#pragma unroll
    for (int part = 0; part < 2; ++part) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int r = wm + mt * 16 + g;
        a[part][mt][0] = bits(a_tile[part][buf][r][c]);
        a[part][mt][1] = bits(a_tile[part][buf][r + 8][c]);
        a[part][mt][2] = bits(a_tile[part][buf][r][c + 4]);
        a[part][mt][3] = bits(a_tile[part][buf][r + 8][c + 4]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int n = wn + nt * 8 + g;
      const uint32_t bh0 = bits(b_tile[0][buf][n][c]), bh1 = bits(b_tile[0][buf][n][c + 4]);
      const uint32_t bl0 = bits(b_tile[1][buf][n][c]), bl1 = bits(b_tile[1][buf][n][c + 4]);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma_tf32(acc[mt][nt], a[1][mt], bh0, bh1);  // lo_a hi_b
        mma_tf32(acc[mt][nt], a[0][mt], bl0, bl1);  // hi_a lo_b
        mma_tf32(acc[mt][nt], a[0][mt], bh0, bh1);  // hi_a hi_b
      }
    }
    if (more) store(buf ^ 1, av, bv);  // buf ^ 1 was last read in the previous step, before its barrier
    __syncthreads();
  }
  // Accumulator e of tile (mt, nt): row g + 8 (e / 2), column 2 c + e % 2.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + wm + mt * 16 + g + 8 * half;
      if (r >= nq) continue;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        put_logit_pair(logits, err, z, nq, nk, r, col0 + wn + nt * 8 + 2 * c, acc[mt][nt][2 * half],
                       acc[mt][nt][2 * half + 1]);
      }
    }
  }
}

// ---- 4c. the same 3xTF32 product on Hopper's warpgroup tensor cores (wgmma) --------------------
//
// block_logits_tf32_kernel's arithmetic (the split x = hi + lo, the three products lo_a hi_b,
// hi_a lo_b, hi_a hi_b per k8 step in that order, f32 accumulation; its comment gives the accuracy
// argument and the bound the tests check) on wgmma m64n128k8 .tf32 (WgmmaTf32 in wgmma.cuh), which
// reads both operands straight from shared memory: no fragment loads, which kept the mma.sync
// kernel's shared-memory pipe 75% busy with its tensor pipe at 44% (ncu, bench/RESULTS.md), and
// wgmma's TF32 rate is the higher one. 3xTF32: Ootomo and Yokota 2022, arXiv 2203.03341.
//
// grid (ceil(nk / 128), ceil(nq / 128), batch * heads_q), 256 threads = two warpgroups; warpgroup
// w computes q rows 64 w.. of the 128x128 tile against all 128 k rows (64 accumulators per thread,
// wgmma.cuh's layout). K advances 32 floats at a time (one 128-byte swizzled row) through three
// stages of [A_hi, A_lo, B_hi, B_lo], each [128 rows][32 floats] = 16 KiB (192 KiB + 1 KiB to align
// the base to the 1024-byte swizzle atom; one CTA per SM). Every thread loads four float4s of A and
// four of B per chunk (row threadIdx.x / 8 + 32 u, 16-byte chunk threadIdx.x % 8; zeros past nq,
// nk and F, F % 4 == 0), splits them and stores hi and lo swizzled (WgLogitChunk). Per chunk t:
//   load chunk t + 1 into registers -> issue chunk t's 4 x 3 wgmmas (async) -> split and store
//   chunk t + 1 into its stage (last read by chunk t - 2, complete) -> wait for chunk t - 1 ->
//   fence.proxy.async and one barrier (chunk t + 1 visible; every warpgroup done with chunk t - 1)
// so one chunk's products are in flight while the next is stored and the barrier passes.
constexpr int kWgLogitTile = 128, kWgLogitChunk = 32, kWgLogitStages = 3, kWgLogitThreads = 256;
constexpr int kWgLogitPartBytes = kWgLogitTile * kWgLogitChunk * 4;  // one of A_hi, A_lo, B_hi, B_lo
constexpr int kWgLogitStageBytes = 4 * kWgLogitPartBytes;
constexpr int kWgLogitSmemBytes = kWgLogitStages * kWgLogitStageBytes + 1024;
constexpr int kWgLogitLoads = kWgLogitTile * kWgLogitChunk / 4 / kWgLogitThreads;  // float4s per operand

// One thread's share of a K chunk: float4 u of each operand is row `row` + 32 u of the tile,
// floats 4 chunk .. 4 chunk + 3 of the K chunk; stored at 16-byte chunk `chunk ^ (row % 8)` of its
// 128-byte row (Swizzle128; (row + 32 u) % 8 = row % 8).
struct WgLogitChunk {
  const float* a_src;  // A row (row0 + row), column 4 chunk; + 32 u F for float4 u
  const float* b_src;
  int64_t F;
  int row, chunk;
  unsigned a_rows = 0, b_rows = 0;  // bit u: row + 32 u is inside nq (A) / nk (B)
  float4 a[kWgLogitLoads], b[kWgLogitLoads];

  __device__ __forceinline__ WgLogitChunk(const float* query_features, const float* key_features, int nq, int nk,
                                          int64_t F_, int heads_q, int group, int heads_kv)
      : F(F_), row(threadIdx.x / 8), chunk(threadIdx.x % 8) {
    const int64_t z = blockIdx.z;
    const int64_t zk = (z / heads_q) * heads_kv + (z % heads_q) / group;
    const int row0 = blockIdx.y * kWgLogitTile, col0 = blockIdx.x * kWgLogitTile;
#pragma unroll
    for (int u = 0; u < kWgLogitLoads; ++u) {
      a_rows |= (row0 + row + 32 * u < nq ? 1u : 0u) << u;
      b_rows |= (col0 + row + 32 * u < nk ? 1u : 0u) << u;
    }
    a_src = query_features + (z * nq + row0 + row) * F + 4 * chunk;
    b_src = key_features + (zk * nk + col0 + row) * F + 4 * chunk;
  }
  // Chunk starting at column f0 into registers.
  __device__ __forceinline__ void load(int64_t f0) {
    const bool in_f = f0 + 4 * chunk < F;  // F % 4 == 0: all four or none
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < kWgLogitLoads; ++u) {
      const int64_t at = 32 * u * F + f0;
      a[u] = in_f && (a_rows >> u & 1u) ? *reinterpret_cast<const float4*>(a_src + at) : zero;
      b[u] = in_f && (b_rows >> u & 1u) ? *reinterpret_cast<const float4*>(b_src + at) : zero;
    }
  }
  // The registers, split into hi and lo, into the stage at `stage` ([A_hi, A_lo, B_hi, B_lo]).
  __device__ __forceinline__ void store(uint8_t* stage) const {
    float4 hi, lo;
#pragma unroll
    for (int u = 0; u < kWgLogitLoads; ++u) {
      const int r = row + 32 * u;
      const int offset = r * 128 + ((chunk ^ (r & 7)) << 4);
      split_tf32(a[u], hi, lo);
      *reinterpret_cast<float4*>(stage + 0 * kWgLogitPartBytes + offset) = hi;
      *reinterpret_cast<float4*>(stage + 1 * kWgLogitPartBytes + offset) = lo;
      split_tf32(b[u], hi, lo);
      *reinterpret_cast<float4*>(stage + 2 * kWgLogitPartBytes + offset) = hi;
      *reinterpret_cast<float4*>(stage + 3 * kWgLogitPartBytes + offset) = lo;
    }
  }
};

// K-major descriptor of `rows_from` .. of a [128][32]-float part at `part` (shared address), k8
// step kk (0..3): +32 bytes per step, 1024 bytes between 8-row groups.
__device__ __forceinline__ uint64_t wg_logit_desc(uint32_t part, int rows_from, int kk) {
  return cuda::detail::make_desc(part + rows_from * 128 + kk * 32, 16, 1024);
}

__global__ void __launch_bounds__(kWgLogitThreads, 1)
    block_logits_wgmma_kernel(const float* __restrict__ query_features, const float* __restrict__ key_features,
                              float* __restrict__ logits, int nq, int nk, int64_t F, int heads_q, int group,
                              int heads_kv, ErrorWord* err) {
  using cuda::detail::fence_proxy_async;
  using cuda::detail::fence_registers;
  using cuda::detail::wgmma_commit;
  using cuda::detail::wgmma_fence;
  using cuda::detail::wgmma_wait;
  using Mma = cuda::detail::WgmmaTf32<kWgLogitTile>;
  extern __shared__ __align__(128) uint8_t wg_logit_smem[];
  // Stages start 1024-byte aligned (the swizzle repeats every 8 rows of 128 bytes).
  uint8_t* stages = wg_logit_smem + ((1024u - (cuda::detail::smem_addr(wg_logit_smem) & 1023u)) & 1023u);
  const uint32_t stages_addr = cuda::detail::smem_addr(stages);
  const int warpgroup = threadIdx.x / 128;

  WgLogitChunk chunk(query_features, key_features, nq, nk, F, heads_q, group, heads_kv);
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

  chunk.load(0);
  chunk.store(stages);
  fence_proxy_async();
  __syncthreads();
  const int64_t chunks = (F + kWgLogitChunk - 1) / kWgLogitChunk;
  int stage = 0;  // of chunk t
  for (int64_t t = 0; t < chunks; ++t) {
    const bool more = t + 1 < chunks;
    if (more) chunk.load((t + 1) * kWgLogitChunk);
    const uint32_t base = stages_addr + stage * kWgLogitStageBytes;
    const uint32_t a_hi = base, a_lo = base + kWgLogitPartBytes;
    const uint32_t b_hi = base + 2 * kWgLogitPartBytes, b_lo = base + 3 * kWgLogitPartBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgLogitChunk / 8; ++kk) {
      const uint64_t ah = wg_logit_desc(a_hi, 64 * warpgroup, kk), al = wg_logit_desc(a_lo, 64 * warpgroup, kk);
      const uint64_t bh = wg_logit_desc(b_hi, 0, kk), bl = wg_logit_desc(b_lo, 0, kk);
      Mma::ss(acc, al, bh, 1);  // lo_a hi_b
      Mma::ss(acc, ah, bl, 1);  // hi_a lo_b
      Mma::ss(acc, ah, bh, 1);  // hi_a hi_b
    }
    wgmma_commit();
    const int next = stage + 1 == kWgLogitStages ? 0 : stage + 1;
    // Stage `next` was last read by chunk t - 2: complete in every warpgroup (previous barrier).
    if (more) chunk.store(stages + next * kWgLogitStageBytes);
    wgmma_wait<1>();  // this warpgroup's chunk t - 1 is complete (chunk t stays in flight)
    fence_proxy_async();
    __syncthreads();
    stage = next;
  }
  wgmma_wait<0>();
  fence_registers(acc);

  // Accumulator 4 i + e: row 16 warp + g + 8 (e / 2) of the tile (warp 0..7; warpgroup w's four
  // warps hold its rows 64 w..), column 8 i + 2 c + e % 2.
  const int64_t z = blockIdx.z;
  const int row0 = blockIdx.y * kWgLogitTile, col0 = blockIdx.x * kWgLogitTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + 16 * warp + g + 8 * half;
    if (r >= nq) continue;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      put_logit_pair(logits, err, z, nq, nk, r, col0 + 8 * i + 2 * c, acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
    }
  }
}

}  // namespace sparsa::cuda::ba_att
