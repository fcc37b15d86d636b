// Built instead of the CUDA sources when SPARSA_CUDA is off.
#include "core/backends.h"
#include "methods/ba_att/ba_att_impl.h"

namespace sparsa::cuda {
bool compiled_in() { return false; }
int device_count() { return 0; }
std::string device_description(int) { return "CUDA not compiled in"; }
Status malloc_device(int, size_t, bool, void*, void** ptr) {
  *ptr = nullptr;
  return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build (no device memory)"};
}
void free_device(int, void*, void*) {}
Status copy_to_host(int, const void*, size_t, void*, void*) {
  return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"};
}
Status copy_to_device(int, const void*, size_t, void*, void*) {
  return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"};
}
Status attention(const detail::AttentionParams&) {
  return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"};
}
Status merge(const detail::MergeParams&, void*) {
  return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"};
}
}  // namespace sparsa::cuda

namespace sparsa::ba_att_cuda {
static Status not_compiled() { return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"}; }
Status plan(const Request&, BlockIndexBuffer*) { return not_compiled(); }
Status scores(const Request&, BaAttScores*) { return not_compiled(); }
Status token_norms(const Tensor&, HostArray*) { return not_compiled(); }
}  // namespace sparsa::ba_att_cuda

#include "methods/losa/device_impl.h"

namespace sparsa::losa_cuda {
static Status not_compiled() { return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"}; }
Status append(const Pool&, int64_t, int64_t, const Tensor&, const Tensor&, void*) { return not_compiled(); }
Status dense_rows(const StepArgs&) { return not_compiled(); }
Status sparse_step_fits(DType, int64_t, int64_t, int64_t, bool, int) { return not_compiled(); }
Status sparse_step(const StepArgs&) { return not_compiled(); }
Status reuse_rows(const StepArgs&) { return not_compiled(); }
Status adopt_rows(const StepArgs&, const void*, const float*) { return not_compiled(); }
Status block_merge(const StepArgs&, bool) { return not_compiled(); }
}  // namespace sparsa::losa_cuda

#include "methods/llsa/internal.h"

namespace sparsa::llsa_cuda {
static Status not_compiled() { return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"}; }
Status check(const Tensor&, const Tensor&, int, const LlsaOptions&) { return not_compiled(); }
Status plan(const Tensor&, const Tensor&, const LlsaOptions&, int, LlsaPlan*) { return not_compiled(); }
Status forward(const Call&, const LlsaPlan*) { return not_compiled(); }
Status backward(const Call&, const LlsaPlan*) { return not_compiled(); }
int last_forward_rung() { return 0; }
int last_forward_fine_keys() { return 0; }
}  // namespace sparsa::llsa_cuda

#include "methods/xattention/xattention_impl.h"

namespace sparsa::xattention_cuda {
static Status not_compiled() { return {StatusCode::unsupported, "backend: 'cuda' is not compiled into this build"}; }
Status scores(const Request&, HostArray*) { return not_compiled(); }
Status plan(const Request&, BlockIndexBuffer*) { return not_compiled(); }
}  // namespace sparsa::xattention_cuda
