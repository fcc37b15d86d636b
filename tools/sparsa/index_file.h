// BlockIndex files for `sparsa run --index` (docs/cli.md, "Index files").
//
// A .safetensors file with entries
//   counts   I32 [batch, heads_q, num_q_blocks]
//   indices  I32 [batch, heads_q, num_q_blocks, capacity]
//   perm_q   I32 [batch, heads_q, len_q]    (optional)
//   perm_kv  I32 [batch, heads_kv, len_kv]  (optional)
// and the block sizes in the header's __metadata__ ({"block_q": "64", "block_kv": "64"},
// strings as safetensors requires) unless the caller passes them. Any other entry is
// refused, so a misspelt "perm_kv" cannot be silently ignored.
#pragma once

#include <optional>
#include <string>

#include "sparsa/index.h"
#include "sparsa/status.h"

namespace sparsa::cli {

// block_q / block_kv: from the command line (they override __metadata__). The result is
// checked for shapes and dtypes only; validate_block_index does the range checks against
// the attention shapes.
Result<BlockIndexBuffer> read_index_file(const std::string& path, std::optional<int> block_q,
                                         std::optional<int> block_kv);

// The writer is the library's write_block_index (sparsa/io.h).

}  // namespace sparsa::cli
