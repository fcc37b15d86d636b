#include "file_layout.h"

#include <utility>

namespace sparsa::cli {

Result<FileLayout> parse_layout(const std::string& text) {
  if (text == "bhsd") return FileLayout::bhsd;
  if (text == "bshd") return FileLayout::bshd;
  return invalid_argument("--layout: expected bhsd ([batch, heads, seq, head_dim]) or bshd ([batch, seq, heads, "
                          "head_dim]), got '" + text + "'");
}

Tensor swap_layout(const Tensor& t, FileLayout layout) {
  if (layout == FileLayout::bhsd || t.ndim != 4) return t;
  Tensor v = t;
  std::swap(v.shape[1], v.shape[2]);
  std::swap(v.strides[1], v.strides[2]);
  return v;
}

}  // namespace sparsa::cli
