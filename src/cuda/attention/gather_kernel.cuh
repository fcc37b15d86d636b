// Internal: the fused gather of a block-sparse plan's key permutation. Reading K and V through
// perm_kv inside the flash kernel costs a dependent index load before every tile's copies and
// scatters each tile over the whole sequence; on BA-Att plans at 128K tokens that was 13% (10% of
// blocks kept) to 29% (50%) of the executor's time (bench/cuda/ba_att_profile.py). Copying K and V
// once into permuted order costs one read and one write of each, after which the kernel walks
// contiguous tiles. Q keeps its in-kernel gather: each query tile is read once per CTA.
#pragma once

#include <cstdint>

namespace sparsa::cuda::detail {

// dst_k[b, h, i] = k[b, h, perm[b, h, i]] and the same for v; dst is contiguous [batch, heads,
// len, D]; a permutation entry outside [0, len) gives a row of zeros (as the in-kernel gather
// reads it). One thread per 16-byte chunk; sources 16-byte aligned (base and strides).
template <int D>
__global__ void gather_kv_kernel(const uint16_t* k, const uint16_t* v, int64_t k_stride0, int64_t k_stride1,
                                 int64_t k_stride2, int64_t v_stride0, int64_t v_stride1, int64_t v_stride2,
                                 const int32_t* perm, int64_t perm_stride0, int64_t perm_stride1,
                                 int64_t perm_stride2, int heads, int len, int64_t rows, uint16_t* dst_k,
                                 uint16_t* dst_v) {
  constexpr int kChunks = D / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * kChunks) return;
  const int64_t row = i / kChunks;
  const int chunk = static_cast<int>(i % kChunks);
  const int64_t pos = row % len, bh = row / len;
  const int64_t b = bh / heads, h = bh % heads;
  const int32_t token = perm[b * perm_stride0 + h * perm_stride1 + pos * perm_stride2];
  uint4 kw = make_uint4(0, 0, 0, 0), vw = make_uint4(0, 0, 0, 0);
  if (token >= 0 && token < len) {
    kw = __ldg(reinterpret_cast<const uint4*>(k + b * k_stride0 + h * k_stride1 + token * k_stride2) + chunk);
    vw = __ldg(reinterpret_cast<const uint4*>(v + b * v_stride0 + h * v_stride1 + token * v_stride2) + chunk);
  }
  reinterpret_cast<uint4*>(dst_k + row * D)[chunk] = kw;
  reinterpret_cast<uint4*>(dst_v + row * D)[chunk] = vw;
}

}  // namespace sparsa::cuda::detail
