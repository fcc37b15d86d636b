// Internal: typed wrappers over Hopper's warpgroup tensor-core path (wgmma.mma_async, sm_90a),
// so the flash kernel reads like the algorithm. PTX ISA, "Asynchronous Warpgroup
// Level Matrix Multiply-Accumulate".
//
// A warpgroup (4 consecutive warps, 128 threads) computes D[64 x N] (+)= A[64 x 16] * B[16 x N]
// (b16 inputs; WgmmaTf32 below: A[64 x 8] * B[8 x N] of tf32):
//  - D (f32, N/2 registers per thread): warp w of the group owns rows 16w..16w+15, and within the
//    warp the layout is mma.m16n8k16's accumulator repeated over N: d[4i + e] is row g + 8(e/2),
//    column 8i + 2c + (e%2), where g = lane/4, c = lane%4.
//  - A from registers: per warp, the mma.m16n8k16 A fragment of its 16 rows (4 x b32).
//  - A or B from shared memory through a 64-bit descriptor (make_desc).
//
// Shared-memory operands use the 128-byte swizzle: a tile is stored as sub-tiles of 64 b16 columns
// (128-byte rows); within each 1024-byte group of 8 rows, 16-byte chunk j of row r sits at chunk
// j ^ (r % 8). Sub-tiles start 1024-byte aligned. The same bytes serve as
//  - K-major (rows = M or N, the 64 columns = K): start at row 0 of the group, +32 bytes per k16
//    step; stride between 8-row groups (SBO) 1024 bytes; the leading offset is unused;
//  - MN-major (rows = K, the 64 columns = N; e.g. V [keys][head_dim] as the B of P V): start at
//    key row 16 * step; SBO 1024 bytes between 8-key groups; LBO = the byte distance from one
//    64-column sub-tile to the next along N.
// A row of 128 bytes holds 32 f32 / tf32 values just as it holds 64 b16 ones, so a tf32 tile
// [ROWS][32] uses the same bytes with chunk j = k / 4, and its k8 step is the same +32 bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace sparsa::cuda::detail {

// Byte offset of 16-byte chunk `chunk` (of D/8) of row `row` in a 128-byte-swizzled [ROWS][D] b16
// tile made of D/64 sub-tiles of [ROWS][64].
template <int ROWS>
struct Swizzle128 {
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
    return static_cast<uint32_t>((chunk >> 3) * ROWS * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  }
};

// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t desc = (smem_addr & 0x3ffffu) >> 4;
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3fffu) << 16;
  desc |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3fffu) << 32;
  desc |= 1ull << 62;
  return desc;
}

// Orders this warpgroup's register accesses before the wgmma that follows (required when the
// accumulator or the A registers were written by ordinary instructions).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across a wait.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the async
// proxy that wgmma reads shared memory through; followed by a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Inline PTX needs every accumulator register named; these spell the D operand out once. D32 / D64 /
// D88: the "{%0,...}" list of the first 32 / 64 / 88 operands; D*_OPS: their "+f" constraints.
#define SPARSA_WGMMA_D32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define SPARSA_WGMMA_D64 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define SPARSA_WGMMA_D32_OPS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define SPARSA_WGMMA_D64_OPS(d) \
  SPARSA_WGMMA_D32_OPS(d), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define SPARSA_WGMMA_D88 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87}"
#define SPARSA_WGMMA_D88_OPS(d) \
  SPARSA_WGMMA_D64_OPS(d), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])

// wgmma m64nNk16 with f32 accumulation for b16 inputs T and width N. ss: A and B from shared
// memory (A K-major); rs: A from registers. TRANS_B = 0: B is K-major, 1: MN-major.
// accumulate = 0 overwrites D. One macro writes the four (type, N) specialisations: PTX_TYPE is
// the instruction's type suffix, DLIST / DOPS the D operand, and the numbers the operands after D
// (N/2 of them): ss: a-desc, b-desc, accumulate, TRANS_B; rs: a[4], b-desc, accumulate, TRANS_B.
template <class T, int N>
struct Wgmma;

#define SPARSA_WGMMA_B16(T, PTX_TYPE, N, DLIST, DOPS, SS_PRED, SS_TAIL, RS_PRED, RS_TAIL)                        \
  template <>                                                                                                   \
  struct Wgmma<T, N> {                                                                                          \
    template <int TRANS_B>                                                                                      \
    static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_PRED ", 0;\n"                                         \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE "\n" DLIST            \
                   ", " SS_TAIL ";\n}\n"                                                                        \
                   : DOPS(d)                                                                                    \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_B));                                            \
    }                                                                                                           \
    template <int TRANS_B>                                                                                      \
    static __device__ __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,            \
                                              int accumulate) {                                                 \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_PRED ", 0;\n"                                         \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE "\n" DLIST            \
                   ", " RS_TAIL ";\n}\n"                                                                        \
                   : DOPS(d)                                                                                    \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TRANS_B));        \
    }                                                                                                           \
  };

SPARSA_WGMMA_B16(__nv_bfloat16, "bf16", 64, SPARSA_WGMMA_D32, SPARSA_WGMMA_D32_OPS, "%34", "%32, %33, p, 1, 1, 0, %35",
                 "%37", "{%32,%33,%34,%35}, %36, p, 1, 1, %38")
SPARSA_WGMMA_B16(__half, "f16", 64, SPARSA_WGMMA_D32, SPARSA_WGMMA_D32_OPS, "%34", "%32, %33, p, 1, 1, 0, %35", "%37",
                 "{%32,%33,%34,%35}, %36, p, 1, 1, %38")
SPARSA_WGMMA_B16(__nv_bfloat16, "bf16", 128, SPARSA_WGMMA_D64, SPARSA_WGMMA_D64_OPS, "%66",
                 "%64, %65, p, 1, 1, 0, %67", "%69", "{%64,%65,%66,%67}, %68, p, 1, 1, %70")
SPARSA_WGMMA_B16(__half, "f16", 128, SPARSA_WGMMA_D64, SPARSA_WGMMA_D64_OPS, "%66", "%64, %65, p, 1, 1, 0, %67",
                 "%69", "{%64,%65,%66,%67}, %68, p, 1, 1, %70")
// N = 176: the score tile of the dense executor's 176-key tiles (attention.cu).
SPARSA_WGMMA_B16(__nv_bfloat16, "bf16", 176, SPARSA_WGMMA_D88, SPARSA_WGMMA_D88_OPS, "%90",
                 "%88, %89, p, 1, 1, 0, %91", "%93", "{%88,%89,%90,%91}, %92, p, 1, 1, %94")
SPARSA_WGMMA_B16(__half, "f16", 176, SPARSA_WGMMA_D88, SPARSA_WGMMA_D88_OPS, "%90", "%88, %89, p, 1, 1, 0, %91", "%93",
                 "{%88,%89,%90,%91}, %92, p, 1, 1, %94")
#undef SPARSA_WGMMA_B16

// wgmma m64nNk8 with tf32 inputs (f32 bit patterns; the tensor cores read sign, exponent and the
// top 10 mantissa bits) and f32 accumulation, A and B both from shared memory. The .tf32 form has
// no transpose immediates: both operands are K-major (rows = M or N, K contiguous), the layout of
// Swizzle128 above with 32 tf32 per 128-byte row; a k8 step advances the descriptor by 32 bytes.
// Operands: d, a-desc, b-desc, scale-d (predicate: 0 overwrites D), imm-scale-a, imm-scale-b.
template <int N>
struct WgmmaTf32;

template <>
struct WgmmaTf32<128> {
  static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32\n" SPARSA_WGMMA_D64 ", %64, %65, p, 1, 1;\n}\n"
                 : SPARSA_WGMMA_D64_OPS(d)
                 : "l"(a), "l"(b), "r"(accumulate));
  }
};

}  // namespace sparsa::cuda::detail
