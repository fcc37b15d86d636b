// `dense`: softmax attention over every key, the baseline every other method is judged by.
#include "methods.h"

namespace sparsa::cli {
namespace {

Result<MethodOutput> run_dense(const MethodInputs& inputs) {
  SPARSA_RETURN_IF_ERROR(check_known_params("dense", inputs.params, {}));
  Result<AttentionOutput> attention = sparsa::dense(inputs.q, inputs.k, inputs.v, inputs.options);
  if (!attention.ok()) return attention.status();
  MethodOutput output;
  output.attention = std::move(attention).value();
  output.density = 1.0;
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
