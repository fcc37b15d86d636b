// sparsa/layout.h — token orders for images: Z-order (Morton) and Hilbert
// permutations of an H x W grid, any sides, and their inverses.
//
// LLSA pools B consecutive tokens; in row-major order those are a strip of one row, in
// Z-order or Hilbert order they are a square patch: when H and W are multiples of 2^j,
// every aligned group of 4^j consecutive tokens is a 2^j x 2^j square (B = 16: 4 x 4
// patches, and 16 x 16 patches one level up). For other sides the order is the
// restriction of the curve on the enclosing 2^k x 2^k square to the cells inside the
// grid (cells sorted by their curve index): still a bijection, still local, squares
// wherever the grid allows them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa {

enum class TokenLayout : uint8_t { row_major, z_order, hilbert };

const char* token_layout_name(TokenLayout layout);
Result<TokenLayout> parse_token_layout(const std::string& name);

// perm[p] = row-major index (row * width + col) of the token at position p of the
// layout order. height, width >= 1 and height * width < 2^31.
Result<std::vector<int32_t>> layout_permutation(int64_t height, int64_t width, TokenLayout layout);

// inv[perm[p]] = p. perm must be a permutation of 0..n-1 (not checked here; see
// is_permutation).
std::vector<int32_t> inverse_permutation(const std::vector<int32_t>& perm);
bool is_permutation(const std::vector<int32_t>& perm);

// out[b, h, p, :] = in[b, h, perm[p], :] for [batch, heads, seq, dim] tensors of the same
// shape and dtype (seq == perm.size()). Apply perm before attention and its inverse
// after. out must not alias in.
Status permute_tokens(const Tensor& in, const std::vector<int32_t>& perm, const Tensor& out);

}  // namespace sparsa
