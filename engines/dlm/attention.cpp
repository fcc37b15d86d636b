// The per-layer attention of the engine. `dense` is exact softmax attention through sparsa's
// own executors: the chunk's own keys (dense, or block_sparse over the block-causal plan),
// the cached prefix (dense), and the two merged by their log-sum-exp (DESIGN.md §1) — the same
// split LoSA uses, so a sparse method replaces the prefix half without touching the model.
#include "engine.h"

namespace sparsa::dlm {

namespace {

class DenseAttention final : public LayerAttention {
 public:
  explicit DenseAttention(const AttentionPolicy& policy) {
    options_.backend = policy.backend;
    options_.num_threads = policy.num_threads;
  }

  Status forward(const AttentionCall& call) override {
    const int64_t heads_q = call.q.shape[1], n = call.q.shape[2], hd = call.q.shape[3];
    if (own_lse_.empty() || own_lse_.shape()[2] < n || own_lse_.shape()[1] != heads_q) {
      own_lse_ = HostArray(DType::f32, {1, heads_q, n});
      pre_out_ = HostArray(DType::f32, {1, heads_q, n, hd});
      pre_lse_ = HostArray(DType::f32, {1, heads_q, n});
    }
    const Tensor own_lse = Tensor::contiguous(own_lse_.ptr<float>(), DType::f32, {1, heads_q, n});
    if (call.block_causal > 0) {
      SPARSA_RETURN_IF_ERROR(block_causal_plan(n, call.block_causal, heads_q, call.pos0));
      SPARSA_RETURN_IF_ERROR(block_sparse(call.q, call.k, call.v, plan_.view(), call.out, own_lse, options_));
    } else {
      SPARSA_RETURN_IF_ERROR(dense(call.q, call.k, call.v, call.out, own_lse, options_));
    }
    if (call.prefix == nullptr || call.prefix->length() == 0) return Status::Ok();
    const Tensor pre_out = Tensor::contiguous(pre_out_.ptr<float>(), DType::f32, {1, heads_q, n, hd});
    const Tensor pre_lse = Tensor::contiguous(pre_lse_.ptr<float>(), DType::f32, {1, heads_q, n});
    SPARSA_RETURN_IF_ERROR(dense(call.q, call.prefix->keys(), call.prefix->values(), pre_out, pre_lse, options_));
    return merge(call.out, own_lse, pre_out, pre_lse, call.out, own_lse,
                 options_.backend == Backend::cuda ? Backend::cuda : Backend::cpu);
  }

 private:
  // Query block qb of the chunk sees key blocks 0..qb (causal across blocks, all of a block).
  Status block_causal_plan(int64_t n, int64_t b, int64_t heads_q, int64_t pos0) {
    if (pos0 % b != 0) {
      return Status(StatusCode::internal, "attention: a block-causal chunk must start at a block boundary");
    }
    if (plan_n_ == n && plan_b_ == b && plan_heads_ == heads_q) return Status::Ok();
    const int64_t nb = (n + b - 1) / b;
    std::vector<int32_t> counts(static_cast<size_t>(heads_q * nb));
    std::vector<int32_t> blocks(static_cast<size_t>(heads_q * nb * nb));
    for (int64_t h = 0; h < heads_q; ++h) {
      for (int64_t qb = 0; qb < nb; ++qb) {
        const int64_t r = h * nb + qb;
        counts[r] = static_cast<int32_t>(qb + 1);
        for (int64_t j = 0; j <= qb; ++j) blocks[r * nb + j] = static_cast<int32_t>(j);
      }
    }
    plan_ = BlockIndexBuffer::from_rows(1, heads_q, n, n, static_cast<int>(b), static_cast<int>(b), counts,
                                        blocks.data(), nb);
    plan_n_ = n;
    plan_b_ = b;
    plan_heads_ = heads_q;
    return Status::Ok();
  }

  AttentionOptions options_;
  HostArray own_lse_, pre_out_, pre_lse_;
  BlockIndexBuffer plan_;
  int64_t plan_n_ = -1, plan_b_ = -1, plan_heads_ = -1;
};

}  // namespace

Result<std::unique_ptr<LayerAttention>> make_layer_attention(const AttentionPolicy& policy, int layer) {
  const std::string& method =
      layer < static_cast<int>(policy.layer_methods.size()) ? policy.layer_methods[layer] : policy.method;
  if (method == "dense") return std::unique_ptr<LayerAttention>(new DenseAttention(policy));
  return invalid_argument("attention method '" + method + "' (layer " + std::to_string(layer) +
                          ") is not available in the engine yet (expected dense)");
}

}  // namespace sparsa::dlm
