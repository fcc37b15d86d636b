// libFuzzer harness of the CLI's index-file reader (`sparsa run --index`, a .safetensors
// file with counts / indices / perm_q / perm_kv and block sizes in __metadata__): any
// bytes give a plan buffer of the documented shapes or a Status, never a crash,
// exception, hang or sanitizer report.
#include "fuzz_file.h"
#include "index_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsa;
  const std::string& path = fuzz::scratch_path("in", ".safetensors");
  fuzz::write_file(path, data, size);
  for (std::optional<int> block : {std::optional<int>{}, std::optional<int>{16}}) {
    Result<BlockIndexBuffer> index = cli::read_index_file(path, block, block);
    if (!index.ok()) {
      // Errors name the file, or the entry as "index.counts: ..." (the CLI adds the flag).
      if (index.status().message().rfind("index", 0) != 0) fuzz::contradiction("error: " + index.status().message());
      continue;
    }
    if (index->counts.shape().size() != 3 || index->indices.shape().size() != 4 ||
        index->counts.dtype() != DType::i32 || index->indices.dtype() != DType::i32 || index->block_q < 1 ||
        index->block_kv < 1) {
      fuzz::contradiction("read_index_file accepted a plan of the wrong shape or dtype");
    }
  }
  return 0;
}
