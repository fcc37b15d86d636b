// `dense`: softmax attention over every key, the baseline every other method is judged by.
#include <algorithm>

#include "methods.h"

namespace sparsa::cli {
namespace {

Result<MethodOutput> run_dense(const MethodInputs& inputs) {
  SPARSA_RETURN_IF_ERROR(check_known_params("dense", inputs.params, {}));
  Result<AttentionOutput> attention = sparsa::dense(inputs.q, inputs.k, inputs.v, inputs.options);
  if (!attention.ok()) return attention.status();
  MethodOutput output;
  output.attention = std::move(attention).value();
  // The fraction of (query, key) pairs the mask leaves visible (1 without a mask).
  const int64_t len_q = inputs.q.shape[2], len_kv = inputs.k.shape[2];
  double visible = 0;
  for (int64_t i = 0; i < len_q; ++i) {
    visible += static_cast<double>(std::max<int64_t>(0, mask_key_end(inputs.options.mask, i, len_q, len_kv) -
                                                            mask_key_begin(inputs.options.mask, i, len_q, len_kv)));
  }
  output.density = visible / (static_cast<double>(len_q) * static_cast<double>(len_kv));
  return output;
}

}  // namespace

SPARSA_REGISTER_METHOD(Method{
    .name = "dense",
    .summary = "softmax attention over every key (the reference every method is compared with)",
    .param_help = {},
    .run = run_dense,
    .in_demo = true,
    .demo_params = Params::object(),
    .takes_mask = true,
});

}  // namespace sparsa::cli
