// Built instead of the CUDA sources when SPARSA_CUDA is off.
#include "core/backends.h"

namespace sparsa::cuda {
bool compiled_in() { return false; }
int device_count() { return 0; }
std::string device_description(int) { return "CUDA not compiled in"; }
Status attention(const detail::AttentionParams&) {
  return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"};
}
}  // namespace sparsa::cuda
