// The C++ API of the DLM engine (include/sparsa/dlm.h) on tiny random models written here with
// sparsa's own safetensors writer: properties that hold whatever the weights are (the numbers
// themselves are checked against the numpy reference in test_dlm.py).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

#include "engine.h"  // the forward of a batch of chunks (Model::Impl)
#include "loop_common.h"  // the commit rules
#include "sparsa/dlm.h"
#include "sparsa/io.h"

namespace fs = std::filesystem;
using namespace sparsa;

namespace {

struct Tiny {
  int64_t dim = 32, layers = 2, heads = 4, kv_heads = 2, hidden = 48, vocab = 50, block = 4;
};

// An sdar (or llada) model directory with N(0, 1/fan_in) weights.
fs::path write_model(const std::string& arch, const Tiny& t, const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("sparsa_dlm_api_" + name + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const int64_t hd = t.dim / t.heads;
  std::ofstream(dir / "config.json")
      << (arch == "sdar"
              ? "{\"model_type\": \"sdar\", \"hidden_size\": " + std::to_string(t.dim) + ", \"num_hidden_layers\": " +
                    std::to_string(t.layers) + ", \"num_attention_heads\": " + std::to_string(t.heads) +
                    ", \"num_key_value_heads\": " + std::to_string(t.kv_heads) + ", \"intermediate_size\": " +
                    std::to_string(t.hidden) + ", \"vocab_size\": " + std::to_string(t.vocab) +
                    ", \"rms_norm_eps\": 1e-6, \"rope_theta\": 1000000, "
                    "\"max_position_embeddings\": 128, \"block_size\": " +
                    std::to_string(t.block) + ", \"mask_token_id\": " + std::to_string(t.vocab - 1) +
                    ", \"eos_token_id\": " + std::to_string(t.vocab - 2) + "}"
              : "{\"model_type\": \"llada\", \"d_model\": " + std::to_string(t.dim) +
                    ", \"n_layers\": " + std::to_string(t.layers) + ", \"n_heads\": " + std::to_string(t.heads) +
                    ", \"n_kv_heads\": " + std::to_string(t.kv_heads) + ", \"mlp_hidden_size\": " +
                    std::to_string(t.hidden) + ", \"vocab_size\": " + std::to_string(t.vocab) +
                    ", \"rope_theta\": 500000.0, "
                    "\"max_sequence_length\": 128, \"mask_token_id\": " +
                    std::to_string(t.vocab - 1) + ", \"eos_token_id\": " + std::to_string(t.vocab - 2) + "}");
  std::mt19937 rng(7);
  std::vector<HostArray> arrays;
  std::vector<std::pair<std::string, Tensor>> tensors;
  auto add = [&](const std::string& n, std::vector<int64_t> shape, float scale) {
    HostArray a(DType::f32, shape);
    std::normal_distribution<float> dist(0.f, scale);
    for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] = shape.size() == 1 ? 1.f + 0.1f * dist(rng) : dist(rng);
    arrays.push_back(std::move(a));
  };
  std::vector<std::pair<std::string, size_t>> order;
  auto lin = [&](const std::string& n, int64_t o, int64_t i, float gain = 1.f) {
    add(n, {o, i}, gain / std::sqrt(static_cast<float>(i)));
    order.push_back({n, arrays.size() - 1});
  };
  auto norm = [&](const std::string& n, int64_t d) {
    add(n, {d}, 1.f);
    order.push_back({n, arrays.size() - 1});
  };
  const int64_t qd = t.heads * hd, kvd = t.kv_heads * hd;
  if (arch == "sdar") {
    lin("model.embed_tokens.weight", t.vocab, t.dim, std::sqrt(static_cast<float>(t.dim)));
    for (int64_t l = 0; l < t.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      norm(p + "input_layernorm.weight", t.dim);
      lin(p + "self_attn.q_proj.weight", qd, t.dim, 2.f);
      lin(p + "self_attn.k_proj.weight", kvd, t.dim, 2.f);
      lin(p + "self_attn.v_proj.weight", kvd, t.dim);
      norm(p + "self_attn.q_norm.weight", hd);
      norm(p + "self_attn.k_norm.weight", hd);
      lin(p + "self_attn.o_proj.weight", t.dim, qd);
      norm(p + "post_attention_layernorm.weight", t.dim);
      lin(p + "mlp.gate_proj.weight", t.hidden, t.dim);
      lin(p + "mlp.up_proj.weight", t.hidden, t.dim);
      lin(p + "mlp.down_proj.weight", t.dim, t.hidden);
    }
    norm("model.norm.weight", t.dim);
    lin("lm_head.weight", t.vocab, t.dim, 4.f);
  } else {
    const std::string p = "model.transformer.";
    lin(p + "wte.weight", t.vocab, t.dim, std::sqrt(static_cast<float>(t.dim)));
    for (int64_t l = 0; l < t.layers; ++l) {
      const std::string b = p + "blocks." + std::to_string(l) + ".";
      norm(b + "attn_norm.weight", t.dim);
      lin(b + "q_proj.weight", qd, t.dim, 2.f);
      lin(b + "k_proj.weight", kvd, t.dim, 2.f);
      lin(b + "v_proj.weight", kvd, t.dim);
      lin(b + "attn_out.weight", t.dim, qd);
      norm(b + "ff_norm.weight", t.dim);
      lin(b + "ff_proj.weight", t.hidden, t.dim);
      lin(b + "up_proj.weight", t.hidden, t.dim);
      lin(b + "ff_out.weight", t.dim, t.hidden);
    }
    norm(p + "ln_f.weight", t.dim);
    lin(p + "ff_out.weight", t.vocab, t.dim, 4.f);
  }
  for (const auto& [n, i] : order) tensors.push_back({n, arrays[i].view()});
  const Status st = write_safetensors((dir / "model.safetensors").string(), tensors);
  EXPECT_TRUE(st.ok()) << st.message();
  return dir;
}

}  // namespace

TEST(DlmApi, SdarLogitsAreBlockCausal) {
  // Block-causal attention: the logits of the first k whole blocks do not depend on what follows.
  const Tiny t;
  const fs::path dir = write_model("sdar", t, "causal");
  auto model = dlm::Model::load(dir.string());
  ASSERT_TRUE(model.ok()) << model.status().message();
  EXPECT_EQ(model->config().arch, dlm::Arch::sdar);
  std::vector<int32_t> ids = {1, 5, 9, 2, 7, 7, 3, 11, 4, 6, 8};
  auto full = model->logits(ids);
  ASSERT_TRUE(full.ok()) << full.status().message();
  ASSERT_EQ(full->size(), ids.size() * static_cast<size_t>(t.vocab));
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 8);  // two whole blocks
  auto part = model->logits(head);
  ASSERT_TRUE(part.ok());
  for (size_t i = 0; i < part->size(); ++i) ASSERT_NEAR((*part)[i], (*full)[i], 1e-4f) << i;
  // ...while a change inside the last block changes that block's logits everywhere in it
  ids[10] = 12;
  auto changed = model->logits(ids);
  ASSERT_TRUE(changed.ok());
  EXPECT_GT(std::abs((*changed)[8 * t.vocab] - (*full)[8 * t.vocab]), 1e-6f);
  fs::remove_all(dir);
}

TEST(DlmApi, LladaIsBidirectional) {
  const Tiny t;
  const fs::path dir = write_model("llada", t, "bidir");
  auto model = dlm::Model::load(dir.string());
  ASSERT_TRUE(model.ok()) << model.status().message();
  std::vector<int32_t> ids = {1, 5, 9, 2, 7};
  auto a = model->logits(ids);
  ids[4] = 3;
  auto b = model->logits(ids);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_GT(std::abs((*a)[0] - (*b)[0]), 1e-6f);  // position 0 sees position 4
  fs::remove_all(dir);
}

TEST(DlmApi, GenerateCallsBackPerBlockAndBatchesMatchSingles) {
  const Tiny t;
  const fs::path dir = write_model("sdar", t, "gen");
  auto model = dlm::Model::load(dir.string());
  ASSERT_TRUE(model.ok());
  dlm::GenerateOptions o;
  o.loop = model->default_loop();
  o.gen_len = 9;
  o.steps = 2;
  o.stop_at_eos = false;
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3}, {4, 5, 6, 7, 8, 9}};
  std::vector<int> calls(2, 0);
  auto both = model->generate(prompts, o, [&](size_t r, std::span<const int32_t>) { calls[r]++; });
  ASSERT_TRUE(both.ok()) << both.status().message();
  ASSERT_EQ(both->tokens.size(), 2u);
  EXPECT_EQ(both->tokens[0].size(), 9u);
  EXPECT_EQ(calls[0], 3);  // prompt 3 + 9 = 12 tokens: blocks 0..2 decoded
  EXPECT_EQ(calls[1], 3);  // prompt 6 + 9 = 15 -> 4 blocks, 1 prefilled, 3 decoded
  for (size_t r = 0; r < prompts.size(); ++r) {
    auto one = model->generate({prompts[r]}, o);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ(one->tokens[0], both->tokens[r]);
  }
  fs::remove_all(dir);
}

// A PromptCache across calls, as a conversation's turns use it: the next call reuses the whole
// blocks its prompt shares with the last call's prompt and output, prefills only the rest, and
// generates what a call without the cache generates (temperature 0; f32 on the cpu: the reused
// K/V differ from a fresh prefill's by summation order only, far below the logits' gaps).
void check_prompt_cache(const dlm::Model& model, dlm::GenerateOptions o) {
  const int64_t B = model.config().block_size;
  dlm::PromptCache cache;
  const std::vector<int32_t> p1 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto r1 = model.generate({p1}, o, {}, &cache);
  ASSERT_TRUE(r1.ok()) << r1.status().message();
  EXPECT_EQ(r1->reused_tokens, 0);
  EXPECT_GE(cache.tokens(), static_cast<int64_t>(p1.size()) / B * B);
  EXPECT_EQ(cache.tokens() % B, 0);

  std::vector<int32_t> p2 = p1;  // the next turn: the last prompt, its reply, then more
  p2.insert(p2.end(), r1->tokens[0].begin(), r1->tokens[0].end());
  p2.insert(p2.end(), {11, 12, 13, 14, 15});
  auto plain = model.generate({p2}, o);
  auto cached = model.generate({p2}, o, {}, &cache);
  ASSERT_TRUE(plain.ok() && cached.ok());
  EXPECT_EQ(cached->tokens, plain->tokens);
  const int64_t shared = static_cast<int64_t>(p1.size() + r1->tokens[0].size());
  EXPECT_GE(cached->reused_tokens, std::min(shared, static_cast<int64_t>(p2.size()) - 1) / B * B - B);
  EXPECT_LE(cached->reused_tokens, static_cast<int64_t>(p2.size()) / B * B);
  EXPECT_EQ(cached->reused_tokens % B, 0);
  EXPECT_GT(cached->reused_tokens, 0);
  EXPECT_EQ(cached->forward_tokens + cached->reused_tokens, plain->forward_tokens);

  std::vector<int32_t> p3 = p2;  // a prompt that differs at token 5: only the blocks before it
  p3[5] = 20;
  auto plain3 = model.generate({p3}, o);
  auto cached3 = model.generate({p3}, o, {}, &cache);
  ASSERT_TRUE(plain3.ok() && cached3.ok());
  EXPECT_EQ(cached3->reused_tokens, 5 / B * B);
  EXPECT_EQ(cached3->tokens, plain3->tokens);

  cache.clear();
  EXPECT_EQ(cache.tokens(), 0);
  auto fresh = model.generate({p3}, o, {}, &cache);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->reused_tokens, 0);
  EXPECT_EQ(fresh->tokens, plain3->tokens);
  EXPECT_GT(cache.tokens(), 0);

  auto two = model.generate({p1, p2}, o, {}, &cache);  // one request a call
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("cache"), std::string::npos) << two.status().message();
}

TEST(DlmApi, PromptCacheReusesAConversationsBlocks) {
  Tiny t;
  t.block = 4;
  const fs::path dir = write_model("sdar", t, "prompt_cache");
  auto sdar = dlm::Model::load(dir.string());
  ASSERT_TRUE(sdar.ok()) << sdar.status().message();
  dlm::GenerateOptions o;
  o.loop = dlm::Loop::block;
  o.gen_len = 9;
  o.steps = 2;
  o.stop_at_eos = false;
  {
    SCOPED_TRACE("sdar, block loop");
    check_prompt_cache(sdar.value(), o);
  }
  // Another model's cache is not reused (the same shapes, other weights).
  auto other = dlm::Model::random(sdar->config(), {}, 3);
  ASSERT_TRUE(other.ok());
  dlm::PromptCache cache;
  ASSERT_TRUE(sdar->generate({{1, 2, 3, 4, 5, 6, 7, 8, 9}}, o, {}, &cache).ok());
  auto r = other->generate({{1, 2, 3, 4, 5, 6, 7, 8, 9}}, o, {}, &cache);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->reused_tokens, 0);

  // Fast-dLLM v2's loop (token shift; a prompt of whole blocks keeps its last block to predict from).
  auto c = dlm::parse_config(R"({"model_type": "Fast_dLLM_Qwen", "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "max_position_embeddings": 128, "vocab_size": 50, "eos_token_id": 48,
    "mask_token_id": 49, "bd_size": 4})", "cfg");
  ASSERT_TRUE(c.ok()) << c.status().message();
  auto fast = dlm::Model::random(c.value(), {}, 5);
  ASSERT_TRUE(fast.ok()) << fast.status().message();
  o.loop = dlm::Loop::fast_dllm;
  o.sub_block = 2;
  {
    SCOPED_TRACE("fast_dllm");
    check_prompt_cache(fast.value(), o);
  }
  {
    SCOPED_TRACE("fast_dllm, a prompt of whole blocks");
    dlm::PromptCache whole;
    const std::vector<int32_t> p = {1, 2, 3, 4, 5, 6, 7, 8};
    ASSERT_TRUE(fast->generate({p}, o, {}, &whole).ok());
    auto plain = fast->generate({p}, o);
    auto again = fast->generate({p}, o, {}, &whole);
    ASSERT_TRUE(plain.ok() && again.ok());
    EXPECT_EQ(again->reused_tokens, 4);  // the last block runs again: its row predicts the next token
    EXPECT_EQ(again->tokens, plain->tokens);
  }

  // Where it does not serve: the remask loop of a bidirectional model.
  const fs::path ldir = write_model("llada", t, "prompt_cache_llada");
  auto llada = dlm::Model::load(ldir.string());
  ASSERT_TRUE(llada.ok());
  dlm::GenerateOptions lo;
  lo.loop = dlm::Loop::remask;
  lo.gen_len = 8;
  lo.block_len = 4;
  lo.steps = 4;
  auto refused = llada->generate({{1, 2, 3}}, lo, {}, &cache);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cache: the remask loop"), std::string::npos) << refused.status().message();
  fs::remove_all(dir);
  fs::remove_all(ldir);
}

// A forward of several requests' chunks (one GEMM per layer over all their rows; RoPE and
// attention per chunk over its own sequence's cache) gives each chunk what a forward of it alone
// gives: the same logits (within f32 GEMM rounding: the batch's GEMMs see more rows, 1e-4 of
// logits of size ~1) and the same caches after a batched K/V write.
TEST(DlmApi, ABatchedForwardEqualsItsChunksOneByOne) {
  const Tiny t;
  const fs::path dir = write_model("sdar", t, "batch");
  auto model = dlm::Model::load(dir.string());
  ASSERT_TRUE(model.ok()) << model.status().message();
  const dlm::Model::Impl& m = model->impl();
  const int64_t B = t.block, V = t.vocab;
  dlm::State s;
  s.ops = m.ops.get();
  auto fresh = [&] {
    auto q = dlm::make_sequence(m.config, m.policy, 64);
    EXPECT_TRUE(q.ok());
    return std::move(q).value();
  };
  const std::vector<int32_t> prompt_a = {1, 5, 9, 2, 7, 7, 3, 11}, prompt_b = {4, 6, 8, 10};
  const std::vector<int32_t> block_a = {12, 13, 14, 15}, block_b = {16, 17, 18, 19};
  dlm::ForwardOptions prefill;
  prefill.block_causal = B;
  dlm::ForwardOptions write;
  write.store_kv = B;
  dlm::ForwardOptions step;
  step.logits_count = B;
  step.step = 0;
  // One by one: prefill a (two blocks) and b (one), write a block of each, then a step of each.
  dlm::Sequence a1 = fresh(), b1 = fresh();
  prefill.store_kv = 8;
  ASSERT_TRUE(m.forward(s, a1, prompt_a, prefill, nullptr).ok());
  prefill.store_kv = 4;
  ASSERT_TRUE(m.forward(s, b1, prompt_b, prefill, nullptr).ok());
  ASSERT_TRUE(m.forward(s, a1, block_a, write, nullptr).ok());
  ASSERT_TRUE(m.forward(s, b1, block_b, write, nullptr).ok());
  std::vector<float> one(static_cast<size_t>(2 * B * V));
  ASSERT_TRUE(m.forward(s, a1, block_b, step, one.data()).ok());
  ASSERT_TRUE(m.forward(s, b1, block_a, step, one.data() + B * V).ok());
  // Batched: the same prefills, then the block writes and the steps as batches of two.
  dlm::Sequence a2 = fresh(), b2 = fresh();
  prefill.store_kv = 8;
  ASSERT_TRUE(m.forward(s, a2, prompt_a, prefill, nullptr).ok());
  prefill.store_kv = 4;
  ASSERT_TRUE(m.forward(s, b2, prompt_b, prefill, nullptr).ok());
  const std::vector<dlm::Chunk> writes = {{&a2, block_a, write}, {&b2, block_b, write}};
  ASSERT_TRUE(m.forward(s, writes, nullptr).ok());
  EXPECT_EQ(a2.length(), 12);
  EXPECT_EQ(b2.length(), 8);
  std::vector<float> both(static_cast<size_t>(2 * B * V));
  const std::vector<dlm::Chunk> steps = {{&a2, block_b, step}, {&b2, block_a, step}};
  const Status st = m.forward(s, steps, both.data());
  ASSERT_TRUE(st.ok()) << st.message();
  for (size_t i = 0; i < one.size(); ++i) ASSERT_NEAR(both[i], one[i], 1e-4f) << "logit " << i;
  // A batch names each sequence once, and has a chunk.
  const std::vector<dlm::Chunk> twice = {{&a2, block_a, step}, {&a2, block_b, step}};
  const Status dup = m.forward(s, twice, both.data());
  EXPECT_FALSE(dup.ok());
  EXPECT_NE(dup.message().find("one sequence in two chunks"), std::string::npos) << dup.message();
  EXPECT_FALSE(m.forward(s, std::span<const dlm::Chunk>(), nullptr).ok());
  fs::remove_all(dir);
}

TEST(DlmApi, Errors) {
  EXPECT_FALSE(dlm::Model::load("/nonexistent/model").ok());
  auto c = dlm::parse_config(R"({"model_type": "llada", "d_model": 64})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'n_layers'"), std::string::npos) << c.status().message();
  auto tok = dlm::Tokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                                       "pre_tokenizer": {"type": "ByteLevel"}})");
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("merges"), std::string::npos);
  EXPECT_FALSE(dlm::parse_loop("beam").ok());
}

// The factor rule's options: refused by name where they do not apply.
TEST(DlmApi, FactorOptionsAreChecked) {
  const fs::path dir = write_model("llada", Tiny{}, "factor");
  auto m = dlm::Model::load(dir.string());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  auto fails_with = [&](dlm::GenerateOptions o, const std::string& want) {
    o.gen_len = 8;
    o.block_len = 4;
    o.steps = 8;
    auto r = m.value().generate({{1, 2, 3}}, o);
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  };
  dlm::GenerateOptions o;
  o.factor = -1;
  fails_with(o, "factor: expected a finite value >= 0");
  o.factor = 1;
  o.threshold = 0.5;
  fails_with(o, "factor: a step commits by the factor rule or by the threshold");
  o.threshold = 0;
  o.confidence = dlm::Confidence::entropy;
  fails_with(o, "factor: the rule's bounds");
  o.confidence = dlm::Confidence::probability;
  o.loop = dlm::Loop::dream;
  fails_with(o, "factor: Fast-dLLM's factor rule serves the remask, prefix_cache and dual_cache loops");
  o.loop = dlm::Loop::remask;
  o.gen_len = 8;
  o.block_len = 4;
  o.steps = 3;  // not a multiple of the blocks: fine, the block's masks set the pace
  auto r = m.value().generate({{1, 2, 3}}, o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  fs::remove_all(dir);
}

// Fast-dLLM's factor rule, worked by hand (factor 1: the bounds are 1 - 1/(i + 2), i.e. 0.667,
// 0.75, 0.8, ... for the 2nd, 3rd, 4th most confident): the count is the first sorted position
// below its bound, and one more when that is the last position (Fast-dLLM's count); ties by position.
TEST(DlmApi, FactorRuleCountsAsFastDllm) {
  using dlm::factor_rule;
  auto sorted = [](std::vector<int64_t> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  EXPECT_EQ(factor_rule({}, 1.0), std::vector<int64_t>{});
  EXPECT_EQ(factor_rule({0.01}, 1.0), std::vector<int64_t>{0});               // one candidate: committed
  EXPECT_EQ(sorted(factor_rule({0.3, 0.9, 0.2, 0.1, 0.05}, 1.0)), (std::vector<int64_t>{1}));  // 0.3 < 0.667
  EXPECT_EQ(sorted(factor_rule({0.7, 0.9, 0.2, 0.1, 0.05}, 1.0)), (std::vector<int64_t>{0, 1}));  // 0.2 < 0.75
  EXPECT_EQ(sorted(factor_rule({0.77, 0.9, 0.76, 0.1, 0.05}, 1.0)), (std::vector<int64_t>{0, 1, 2}));
  // Every bound met: all of them; only the last one missed: all of them too (Fast-dLLM's count).
  EXPECT_EQ(sorted(factor_rule({0.99, 0.98, 0.97}, 1.0)), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(sorted(factor_rule({0.99, 0.98, 0.5}, 1.0)), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(sorted(factor_rule({0.99, 0.5}, 1.0)), (std::vector<int64_t>{0, 1}));
  // A larger factor lowers the bounds (factor 2: 0.333, 0.5, ...); equal confidences by position.
  EXPECT_EQ(sorted(factor_rule({0.3, 0.9, 0.4, 0.4, 0.0, 0.0}, 2.0)), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(sorted(factor_rule({0.5, 0.5, 0.5, 0.0}, 1.0)), (std::vector<int64_t>{0}));
}

// SDAR's entropy_bounded rule, worked by hand (the candidates hold -entropy): entropies sorted
// ascending, the count whose running sum stays below the bound, at least one; ties by position.
// And the strategies' names.
TEST(DlmApi, EntropyBoundedCountsAsSdar) {
  using dlm::entropy_bounded;
  EXPECT_EQ(entropy_bounded({}, 0.35), std::vector<int64_t>{});
  EXPECT_EQ(entropy_bounded({-2.0}, 0.35), std::vector<int64_t>{0});                          // none below: one
  EXPECT_EQ(entropy_bounded({-0.3, -0.1, -0.2}, 0.35), (std::vector<int64_t>{1, 2}));         // 0.1, 0.3 < 0.35
  EXPECT_EQ(entropy_bounded({-0.3, -0.1, -0.2}, 0.3), (std::vector<int64_t>{1}));             // 0.3 is not below
  EXPECT_EQ(entropy_bounded({-0.3, -0.1, -0.2}, 10.0), (std::vector<int64_t>{1, 2, 0}));      // all of them
  EXPECT_EQ(entropy_bounded({-0.1, -0.5, -0.1, -0.1}, 0.25), (std::vector<int64_t>{0, 2}));   // ties by position
  for (dlm::Unmask u : {dlm::Unmask::confidence, dlm::Unmask::sequential, dlm::Unmask::entropy_bounded}) {
    EXPECT_EQ(dlm::parse_unmask(dlm::unmask_name(u)).value(), u);
  }
  const auto bad = dlm::parse_unmask("random");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unmask"), std::string::npos) << bad.status().message();
}

// Fast-dLLM v2's published config (its Qwen2.5-7B shape, bd_size, no mask id): the block, the
// generate() default mask id, Dream's biases and token shift, block-causal; a missing bd_size is
// the default 32, a bad one is named.
TEST(DlmApi, FastDllmConfig) {
  const std::string text = R"({"model_type": "Fast_dLLM_Qwen", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "vocab_size": 152064, "eos_token_id": 151645,
    "bd_size": 32, "tie_word_embeddings": false, "hidden_act": "silu", "use_sliding_window": false})";
  auto c = dlm::parse_config(text, "cfg");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->arch, dlm::Arch::fast_dllm);
  EXPECT_EQ(c->block_size, 32);
  EXPECT_EQ(dlm::block_causal_size(c.value()), 32);
  EXPECT_EQ(c->mask_token_id, 151665);
  EXPECT_TRUE(c->qkv_bias && c->shifted_logits && !c->qk_norm);
  EXPECT_EQ(c->head_dim, 128);
  ASSERT_EQ(c->eos_token_ids.size(), 1u);
  EXPECT_EQ(c->eos_token_ids[0], 151645);
  auto no_block = dlm::parse_config(std::string(text).replace(text.find("\"bd_size\": 32,"), 14, ""), "cfg");
  ASSERT_TRUE(no_block.ok()) << no_block.status().message();
  EXPECT_EQ(no_block->block_size, 32);
  auto bad = dlm::parse_config(std::string(text).replace(text.find("32,"), 3, "0,"), "cfg");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'bd_size'"), std::string::npos) << bad.status().message();
  EXPECT_EQ(dlm::parse_loop("fast_dllm").value(), dlm::Loop::fast_dllm);
}

// check_attention: the errors Model::load gives for the attention options, from the config alone
// (no weights, no device), so a command can check every method before loading any.
TEST(DlmApi, CheckAttentionGivesLoadsErrorsWithoutWeights) {
  const fs::path dir = write_model("llada", Tiny{}, "check_attention");
  auto model = dlm::Model::load(dir.string());
  ASSERT_TRUE(model.ok()) << model.status().message();
  const dlm::Config& config = model->config();
  auto options = [](std::string backend, std::string attention, std::vector<std::string> layers = {}) {
    dlm::LoadOptions o;
    o.backend = std::move(backend);
    o.attention = std::move(attention);
    o.attention_layers = std::move(layers);
    return o;
  };
  for (const auto& o : {options("cpu", "dense"), options("cpu", "ba_att:density=0.3,sort=0"),
                        options("cpu", "xattention:density=0.5"), options("cpu", "losa:budget=64,k=2"),
                        options("cpu", "quest", {"0=dense"}), options("cuda", "ba_att:density=0.1"),
                        options("cuda:1", "losa:budget=128,k=4")}) {
    EXPECT_TRUE(dlm::check_attention(config, o).ok()) << o.backend << " " << o.attention;
  }
  // Each refusal is the one a load gives (on the cpu backend, where a load runs here), word for word.
  for (const auto& o : {options("cpu", "ba_att:density=2"), options("cpu", "nonsense"),
                        options("cpu", "quest:budget=64,k=4"), options("cpu", "dense", {"7=dense"}),
                        options("cpu", "dense", {"0=ba_att:sort=maybe"})}) {
    const Status want = dlm::Model::load(dir.string(), o).status();
    const Status got = dlm::check_attention(config, o);
    ASSERT_FALSE(want.ok()) << o.attention;
    EXPECT_FALSE(got.ok()) << o.attention;
    EXPECT_EQ(got.message(), want.message()) << o.attention;
  }
  const Status x = dlm::check_attention(config, options("cuda", "xattention:density=0.5"));
  EXPECT_FALSE(x.ok());
  EXPECT_NE(x.message().find("cpu backend only"), std::string::npos) << x.message();
  const Status b = dlm::check_attention(config, options("tpu", "dense"));
  EXPECT_FALSE(b.ok());
  EXPECT_NE(b.message().find("backend"), std::string::npos) << b.message();
  fs::remove_all(dir);
}

// The canvas selectors' block when the spec names none: 128 on the cuda backend (the executor's
// tile), 64 on the cpu; the plan a cpu ba_att builds over a 300-token canvas has 64-token blocks
// by default and the spec's block when it gives one.
TEST(DlmApi, CanvasSelectorsBlockDefaultsToTheBackendsTile) {
  EXPECT_EQ(dlm::canvas_block_default(Backend::cuda), 128);
  EXPECT_EQ(dlm::canvas_block_default(Backend::cpu), 64);
  const int64_t heads = 2, n = 300, hd = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.f, 1.f);
  HostArray q(DType::f32, {1, heads, n, hd}), k(DType::f32, {1, heads, n, hd}), v(DType::f32, {1, heads, n, hd}),
      out(DType::f32, {1, heads, n, hd});
  for (HostArray* a : {&q, &k, &v})
    for (int64_t i = 0; i < a->numel(); ++i) a->ptr<float>()[i] = dist(rng);
  dlm::AttentionCall call;
  call.q = q.view();
  call.k = k.view();
  call.v = v.view();
  call.out = out.view();
  dlm::AttentionPolicy policy;
  for (const auto& [spec, block] : std::vector<std::pair<std::string, int>>{
           {"ba_att:density=0.5,min_tokens=0", 64}, {"mean_pool:min_tokens=0", 64},
           {"ba_att:density=0.5,min_tokens=0,block=32", 32}}) {
    policy.method = spec;
    auto layer = dlm::make_layer_attention(policy, 0);
    ASSERT_TRUE(layer.ok()) << spec << ": " << layer.status().message();
    ASSERT_TRUE((*layer)->forward(call).ok()) << spec;
    auto plan = (*layer)->plan_of(call);
    ASSERT_TRUE(plan.ok() && plan->has_value()) << spec;
    EXPECT_EQ((*plan)->plan.block_q, block) << spec;
    EXPECT_EQ((*plan)->plan.block_kv, block) << spec;
    EXPECT_NE((*plan)->params.find("block_q=" + std::to_string(block) + " "), std::string::npos) << (*plan)->params;
  }
}
