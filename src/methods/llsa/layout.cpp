// Z-order and Hilbert token layouts (sparsa/layout.h).
#include "sparsa/layout.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace sparsa {

namespace {

// Interleave the bits of (row, col): col in the even bits, row in the odd bits, so the
// code walks 2 x 2 cells as (0,0) (0,1) (1,0) (1,1) and recursively the quadrants.
uint64_t morton(uint32_t row, uint32_t col) {
  uint64_t code = 0;
  for (int bit = 0; bit < 32; ++bit) {
    code |= uint64_t{(col >> bit) & 1u} << (2 * bit);
    code |= uint64_t{(row >> bit) & 1u} << (2 * bit + 1);
  }
  return code;
}

// Position of cell (x = col, y = row) along the Hilbert curve of a side x side square
// (side a power of two): descend the quadrants from the largest, rotating/flipping the
// frame so each quadrant's sub-curve enters where the previous one left.
uint64_t hilbert(uint32_t side, uint32_t x, uint32_t y) {
  uint64_t d = 0;
  for (uint32_t s = side / 2; s > 0; s /= 2) {
    const uint32_t rx = (x & s) ? 1 : 0;
    const uint32_t ry = (y & s) ? 1 : 0;
    d += uint64_t{s} * s * ((3 * rx) ^ ry);
    if (ry == 0) {  // lower quadrants: reflect (right one) and transpose the frame;
      if (rx == 1) {  // only the bits below s matter from here on
        x = side - 1 - x;
        y = side - 1 - y;
      }
      std::swap(x, y);
    }
  }
  return d;
}

}  // namespace

const char* token_layout_name(TokenLayout layout) {
  switch (layout) {
    case TokenLayout::row_major: return "row_major";
    case TokenLayout::z_order: return "z_order";
    case TokenLayout::hilbert: return "hilbert";
  }
  return "?";
}

Result<TokenLayout> parse_token_layout(const std::string& name) {
  if (name == "row_major") return TokenLayout::row_major;
  if (name == "z_order") return TokenLayout::z_order;
  if (name == "hilbert") return TokenLayout::hilbert;
  return invalid_argument("layout: expected row_major, z_order or hilbert, got '" + name + "'");
}

Result<std::vector<int32_t>> layout_permutation(int64_t height, int64_t width, TokenLayout layout) {
  if (height < 1 || width < 1) {
    return invalid_argument("height, width: expected >= 1, got " + std::to_string(height) + " x " + std::to_string(width));
  }
  if (height * width >= (int64_t{1} << 31) || height >= (int64_t{1} << 31) || width >= (int64_t{1} << 31)) {
    return invalid_argument("height * width: expected < 2^31 tokens, got " + std::to_string(height) + " x " +
                            std::to_string(width));
  }
  const int64_t n = height * width;
  std::vector<int32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  if (layout == TokenLayout::row_major) return perm;
  uint32_t side = 1;
  while (side < height || side < width) side *= 2;
  std::vector<uint64_t> key(n);
  for (int64_t r = 0; r < height; ++r)
    for (int64_t c = 0; c < width; ++c)
      key[r * width + c] = layout == TokenLayout::z_order ? morton(static_cast<uint32_t>(r), static_cast<uint32_t>(c))
                                                          : hilbert(side, static_cast<uint32_t>(c), static_cast<uint32_t>(r));
  std::sort(perm.begin(), perm.end(), [&](int32_t a, int32_t b) { return key[a] < key[b]; });
  return perm;
}

std::vector<int32_t> inverse_permutation(const std::vector<int32_t>& perm) {
  std::vector<int32_t> inv(perm.size());
  for (size_t p = 0; p < perm.size(); ++p) inv[perm[p]] = static_cast<int32_t>(p);
  return inv;
}

bool is_permutation(const std::vector<int32_t>& perm) {
  std::vector<bool> seen(perm.size(), false);
  for (int32_t x : perm) {
    if (x < 0 || static_cast<size_t>(x) >= perm.size() || seen[x]) return false;
    seen[x] = true;
  }
  return true;
}

Status permute_tokens(const Tensor& in, const std::vector<int32_t>& perm, const Tensor& out) {
  for (auto [name, t] : {std::pair{"in", &in}, std::pair{"out", &out}}) {
    if (t->data == nullptr) return invalid_argument(std::string(name) + ": is missing (null data)");
    if (t->ndim != 4) {
      return invalid_argument(std::string(name) + ": expected 4 dimensions [batch, heads, seq, dim], got " +
                              t->shape_string());
    }
    if (!(t->device == Device{})) return invalid_argument(std::string(name) + ": expected a tensor on cpu");
    if (t->strides[3] != 1 && t->shape[3] != 1) {
      return invalid_argument(std::string(name) + ": the last dimension must be contiguous");
    }
  }
  for (int d = 0; d < 4; ++d) {
    if (in.shape[d] != out.shape[d]) {
      return invalid_argument("out: expected shape " + in.shape_string() + " (as in), got " + out.shape_string());
    }
  }
  if (in.dtype != out.dtype) return unsupported_dtype("out: dtype differs from in's");
  if (static_cast<int64_t>(perm.size()) != in.shape[2]) {
    return invalid_argument("perm: expected " + std::to_string(in.shape[2]) + " entries (seq), got " +
                            std::to_string(perm.size()));
  }
  if (!is_permutation(perm)) return invalid_argument("perm: not a permutation of 0.." + std::to_string(perm.size() - 1));
  const size_t row_bytes = dtype_size(in.dtype) * in.shape[3];
  for (int64_t b = 0; b < in.shape[0]; ++b)
    for (int64_t h = 0; h < in.shape[1]; ++h)
      for (int64_t p = 0; p < in.shape[2]; ++p) {
        const auto* src = static_cast<const char*>(in.data) + in.offset({b, h, perm[p], 0}) * dtype_size(in.dtype);
        auto* dst = static_cast<char*>(out.data) + out.offset({b, h, p, 0}) * dtype_size(out.dtype);
        std::memcpy(dst, src, row_bytes);
      }
  return {};
}

}  // namespace sparsa
