// --layout of tensor files: bhsd, [batch, heads, seq, head_dim] (sparsa's own), or bshd,
// [batch, seq, heads, head_dim] (FlashAttention's and FlashInfer's). A bshd file is read as a
// zero-copy strided view in sparsa's order and O is written back in the input's layout; LSE is
// always [batch, heads_q, len_q], as FlashAttention returns it.
#pragma once

#include <string>

#include "sparsa/status.h"
#include "sparsa/tensor.h"

namespace sparsa::cli {

enum class FileLayout { bhsd, bshd };

// "--layout: expected bhsd or bshd, got 'x'".
Result<FileLayout> parse_layout(const std::string& text);

// The view of `t` with its dimensions in the other order: bshd <-> bhsd swaps dimensions 1
// and 2 (shape and strides); bhsd, or a tensor that is not 4-d, is returned unchanged (the
// library then reports its shape).
Tensor swap_layout(const Tensor& t, FileLayout layout);

}  // namespace sparsa::cli
