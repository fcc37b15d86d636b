// The DLM engine's denoising steps on the device, at 8B shapes with random bf16 weights made on
// the device (Model::random: the engine's speed does not depend on the weights):
//   llada_canvas   LLaDA-8B full-canvas step over `canvas` tokens (the remask loop), logits of one
//                  block of 32 rows (what the loop reads);
//   llada_prefix   LLaDA-8B prefix-cached step: a block of 32 against `ctx` cached tokens
//                  (Fast-dLLM's cached steps);
//   sdar_block     SDAR-8B (Qwen3-8B shape: 36 layers, 32/8 heads) block step: 16 tokens against
//                  `ctx` cached tokens, logits of the 16 rows.
// The cache is filled with random K/V (the engine does not care where they came from). Each row
// reports the median step time (CUDA events on the engine's stream around Model::Impl::forward
// and the greedy sampler, which ends in the read-back of the picks), then a breakdown measured the same way by replaying
// only the step's GEMMs (same shapes, same order) and only its attention calls (the layers'
// LayerAttention over the same views): rest = step - GEMMs - attention (norms, RoPE, SwiGLU,
// embedding, the greedy sampler and its read-back of the picks, launch gaps), of which the
// elementwise kernels alone and the sampler alone are timed too. Weight streaming: the bytes of every weight matrix the step
// reads over (step - attention), against the card's HBM bandwidth by its datasheet (4.8 TB/s on an
// H200, 3.35 on an H100 SXM; other cards from their memory clock and bus width). TFLOP/s: 2 x matrix parameters x tokens plus
// the attention FLOPs, over the step time.
// generate: whole generate() calls through each loop (remask and prefix_cache on LLaDA-8B, block on
// SDAR-8B; prompts of 1-4K tokens, greedy): tokens/s and steps/s, wall clock.
// gemm: each GEMM shape of the two models at 16 and 32 rows, cuBLAS beside every rung of sparsa's
// weight-streaming kernel (skinny_gemm.cu) and cuBLASLt's algorithms (gemm "tuned": the
// heuristic's pick, the timed choice, the fastest listed): microseconds and weight TB/s. The weights
// rotate through copies that together exceed the 60 MB L2, so every call streams from HBM.
// --gemm cublas|streaming|tuned: the engine's GEMM choice for the step rows (LoadOptions::gemm).
// --attention SPEC: every layer's attention method (LoadOptions::attention, e.g. losa:budget=256,k=4);
// the step rows time step 1 of a block, so a LoSA layer's untimed warm-up call is its dense first step.
// --batch N: the sdar_block rows step N requests together, each with its own cache of ctx tokens
// (one batched forward; rows "sdar_block xN", tokens = 16 N).
//   bench_dlm [--rows llada_canvas,llada_prefix,sdar_block,generate,gemm] [--canvas 4096]
//             [--ctx 32768,65536,131072] [--iters 10] [--gemm cublas] [--attention dense] [--batch 1]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/lt_gemm.h"
#include "cuda/skinny_gemm.h"
#include "engine.h"
#include "model_common.h"
#include "sparsa/dlm.h"

using namespace sparsa;
using namespace sparsa::dlm;

namespace {

// The card's HBM bandwidth by its datasheet, bytes/s.
double hbm_peak() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return 4.8e12;
  const std::string name = prop.name;
  if (name.find("H200") != std::string::npos) return 4.8e12;
  if (name.find("H100") != std::string::npos && name.find("PCIe") == std::string::npos) return 3.35e12;
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0);
  return 2.0 * clock_khz * 1e3 * bus_bits / 8;
}

#define CHECK(x)                                                                        \
  do {                                                                                  \
    const Status s_ = (x);                                                              \
    if (!s_.ok()) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.to_string().c_str()); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

Config llada_8b() {
  Config c;
  c.arch = Arch::llada;
  c.dim = 4096;
  c.n_layers = 32;
  c.n_heads = c.n_kv_heads = 32;
  c.head_dim = 128;
  c.hidden_dim = 12288;
  c.vocab_size = 126464;
  c.rope.theta = 500000;
  c.max_seq_len = 1 << 18;
  c.mask_token_id = 126336;
  return c;
}

Config sdar_8b() {
  Config c;
  c.arch = Arch::sdar;
  c.dim = 4096;
  c.n_layers = 36;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.hidden_dim = 12288;
  c.vocab_size = 151936;
  c.rope.theta = 1e6;
  c.max_seq_len = 1 << 18;
  c.block_size = 16;
  c.qk_norm = true;
  c.norm_eps = 1e-6;
  c.mask_token_id = 151669;
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds of fn() on `stream`, median of iters runs after one warm-up.
template <class Fn>
double time_ms(cudaStream_t stream, int iters, Fn&& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

// Random K/V of `tokens` positions appended to every layer's cache (one upload, reused).
void fill_cache(const Config& c, Sequence& seq, int64_t tokens, void* stream) {
  if (tokens == 0) return;
  const int64_t chunk = std::min<int64_t>(tokens, 16384);
  std::vector<uint16_t> host(static_cast<size_t>(2 * c.n_kv_heads * chunk * c.head_dim));
  uint64_t x = 88172645463325252ull;
  for (auto& h : host) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    h = float_to_bf16(static_cast<float>(static_cast<double>(x >> 40) / 16777216.0 * 2 - 1));
  }
  auto kv = DeviceArray::allocate(DType::bf16, {2, 1, c.n_kv_heads, chunk, c.head_dim}, {DeviceType::cuda, 0}, false,
                                  stream);
  CHECK(kv.status());
  cudaMemcpy(kv->data(), host.data(), host.size() * 2, cudaMemcpyHostToDevice);
  Tensor k = Tensor::contiguous(kv->data(), DType::bf16, {1, c.n_kv_heads, chunk, c.head_dim}, {DeviceType::cuda, 0});
  Tensor v = k;
  v.data = static_cast<uint16_t*>(kv->data()) + c.n_kv_heads * chunk * c.head_dim;
  for (auto& cache : *seq.device_cache) {
    for (int64_t done = 0; done < tokens; done += chunk) {
      Tensor kk = k, vv = v;
      kk.shape[2] = vv.shape[2] = std::min(chunk, tokens - done);
      CHECK(cache.append(seq.device_seq, kk, vv, stream));
    }
  }
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
}

struct Row {
  std::string name;
  int64_t tokens = 0, ctx = 0;
  double step = 0, gemm = 0, attention = 0, elementwise = 0, sample = 0;
  double flops = 0, weight_bytes = 0;
  bool skipped = false;  // its caches did not fit the card
};

// One step of `batch` requests decoded together (one batched forward: the GEMMs over all their
// rows, attention per request over its own cache of ctx tokens); n tokens and logit_rows logits a
// request.
Row bench_step(const Model& model, const std::string& name, int64_t n, int64_t ctx, int64_t logit_rows, int iters,
               int64_t batch = 1) {
  const Model::Impl& m = model.impl();
  const Config& c = m.config;
  Ops& ops = *m.ops;
  auto stream = static_cast<cudaStream_t>(ops.stream());
  // The batch's sequences made together: one device cache per layer, and QUEST's and LoSA's
  // batched state, as the block loop makes them.
  const std::vector<int64_t> max_tokens(static_cast<size_t>(batch), ctx + n);
  auto made = make_sequences(c, m.policy, max_tokens);
  Row r;
  r.name = batch > 1 ? name + " x" + std::to_string(batch) : name;
  r.tokens = n * batch;
  r.ctx = ctx;
  if (made.status().code() == StatusCode::out_of_memory) {  // the caches do not fit this card: a row without times
    std::printf("%s at %lld cached tokens: skipped, its caches do not fit this card (%s)\n", r.name.c_str(),
                static_cast<long long>(ctx), made.status().message().c_str());
    r.skipped = true;
    return r;
  }
  CHECK(made.status());
  std::vector<Sequence> seqs = std::move(made.value());
  for (Sequence& seq : seqs) fill_cache(c, seq, ctx, stream);
  State s;
  s.ops = &ops;
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
  const int64_t N = n * batch, L = logit_rows * batch;  // the batch's rows and logit rows
  std::vector<int32_t> all_tokens;
  for (int64_t b = 0; b < batch; ++b) all_tokens.insert(all_tokens.end(), tokens.begin(), tokens.end());
  std::vector<float> logits(static_cast<size_t>(L * c.vocab_size));
  ForwardOptions fo;
  fo.block_causal = c.arch == Arch::sdar ? c.block_size : 0;
  fo.logits_begin = 0;
  fo.logits_count = logit_rows;
  fo.step = 1;
  ForwardOptions ao = fo;  // the attention-only calls: no logits
  ao.logits_count = 0;
  std::vector<Chunk> chunks, attention_chunks;
  std::vector<ChunkRows> rows;
  for (int64_t b = 0; b < batch; ++b) {
    chunks.push_back({&seqs[b], tokens, fo});
    attention_chunks.push_back({&seqs[b], tokens, ao});
    rows.push_back({b * n, n, ctx, b * logit_rows});
  }
  // A step as the loops run it at temperature 0: the forward, then the greedy sampler on the
  // device (only the picks come back).
  std::vector<Pick> picks(static_cast<size_t>(L));
  const std::vector<int32_t> banned;
  r.step = time_ms(stream, iters, [&] {
    CHECK(m.forward(s, chunks, nullptr));
    if (!ops.greedy(s.logits, L, c.vocab_size, banned, picks.data())) {
      ops.to_host(logits.data(), s.logits, L * c.vocab_size);
    }
  });
  // The GEMMs alone, in the step's order and shapes.
  const Weights& w = m.weights;
  r.gemm = time_ms(stream, iters, [&] {
    for (const LayerWeights& Lw : w.layers) {
      ops.matmul(s.qkv, s.xb, N, Lw.wqkv);
      ops.matmul_add(s.x, s.att, N, Lw.wo);
      ops.matmul(s.gu, s.xb, N, Lw.w_gate_up);
      ops.matmul_add(s.x, s.h, N, Lw.w_down);
    }
    ops.matmul_f32(s.logits, s.xb, L, w.lm_head);
  });
  // The attention alone: every layer's calls over the same views (the qkv scratch holds the last
  // step's last layer, real numbers of the right scale).
  r.attention = time_ms(stream, iters, [&] {
    for (int l = 0; l < c.n_layers; ++l) CHECK(attend(c, s, attention_chunks, rows, l));
  });
  // The elementwise kernels alone (norms, head norms, RoPE, SwiGLU, the embedding), and the sampler
  // with its read-back alone: the two known parts of the rest (what remains is launch gaps and host work).
  r.elementwise = time_ms(stream, iters, [&] {
    ops.embed(s.x, w.embed, all_tokens);
    for (const LayerWeights& Lw : w.layers) {
      ops.rms_norm(s.xb, s.x, Lw.attn_norm, N, c.dim, c.norm_eps);
      if (c.qk_norm) {
        ops.head_norm(s.qkv, N, c.n_heads, c.head_dim, qkv_width(c), Lw.q_norm, c.norm_eps);
        ops.head_norm(static_cast<char*>(s.qkv) + c.n_heads * c.head_dim * 2, N, c.n_kv_heads, c.head_dim,
                      qkv_width(c), Lw.k_norm, c.norm_eps);
      }
      rope_chunks(c, s, rows, c.n_heads + c.n_kv_heads);
      ops.rms_norm(s.xb, s.x, Lw.ffn_norm, N, c.dim, c.norm_eps);
      ops.swiglu(s.h, s.gu, N, c.hidden_dim);
    }
    ops.rms_norm(s.xb, s.x, w.final_norm, L, c.dim, c.norm_eps);
  });
  r.sample = time_ms(stream, iters, [&] {
    if (!ops.greedy(s.logits, L, c.vocab_size, banned, picks.data())) {
      ops.to_host(logits.data(), s.logits, L * c.vocab_size);
    }
  });
  CHECK(ops.check());
  double matrix_params = 0;
  for (const LayerWeights& Lw : w.layers) {
    for (const Weight* x : {&Lw.wqkv, &Lw.wo, &Lw.w_gate_up, &Lw.w_down}) matrix_params += double(x->rows) * x->cols;
  }
  const double head = double(w.lm_head.rows) * w.lm_head.cols;
  r.weight_bytes = 2 * (matrix_params + head);
  const double pairs = double(n) * (ctx + n) * batch;  // each chunk's own keys counted whole (bidirectional chunk)
  r.flops = 2 * matrix_params * N + 2 * head * L + 4.0 * pairs * c.head_dim * c.n_heads * c.n_layers;
  return r;
}

// A whole generate() through one loop (greedy, no EOS stop): tokens generated per second and
// forward passes per second, wall clock (the loop's host work and the prompt's prefill included).
struct GenRow {
  std::string loop;
  int64_t prompt = 0, gen = 0, steps = 0;
  double seconds = 0;
};

GenRow bench_generate(const Model& model, Loop loop, int64_t prompt_len, int64_t gen_len, int64_t block_len,
                      int64_t steps) {
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
  for (int64_t i = 0; i < prompt_len; ++i) prompt[i] = static_cast<int32_t>((i * 104729) % 1000 + 1);
  GenerateOptions o;
  o.loop = loop;
  o.gen_len = gen_len;
  o.block_len = block_len;
  o.steps = steps;
  o.stop_at_eos = false;
  auto warm = model.generate({prompt}, o);  // first call: allocations, cuBLAS's plans
  CHECK(warm.status());
  auto r = model.generate({prompt}, o);
  CHECK(r.status());
  return {loop_name(loop), prompt_len, gen_len, r->steps, r->seconds};
}

// One GEMM shape at n rows: cuBLAS (the engine's call: TN, bf16 in, f32 compute) and each rung of
// the skinny kernel, over weight copies that together exceed L2. Output bf16 for the act GEMMs,
// f32 accumulate for the residual ones, f32 for the head, as the engine runs them.
struct GemmShape {
  const char* name;
  int64_t rows, cols;
  int out;  // 0 bf16, 1 f32 accumulate, 2 f32
};

void bench_gemm_table(int iters) {
  const GemmShape shapes[] = {
      {"sdar qkv", 6144, 4096, 0},      {"sdar o", 4096, 4096, 1},         {"sdar gate_up", 24576, 4096, 0},
      {"sdar down", 4096, 12288, 1},    {"sdar head", 151936, 4096, 2},    {"llada qkv", 12288, 4096, 0},
      {"llada head", 126464, 4096, 2},
  };
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cublasHandle_t handle;
  cublasCreate(&handle);
  cublasSetStream(handle, stream);
  void* ws = nullptr;
  cudaMalloc(&ws, size_t{64} << 20);
  cublasSetWorkspace(handle, ws, size_t{64} << 20);

  LtGemm lt;
  lt.init(ws, size_t{64} << 20);
  const int rungs = skinny_gemm_variants();
  std::printf("\nGEMMs alone (bf16 weights streamed from HBM; us per call, weight TB/s)\n");
  std::printf("%-12s %4s | %16s", "shape", "n", "cublas");
  for (int v = 0; v < rungs; ++v) std::printf(" | %16s", ("rung " + std::to_string(v)).c_str());
  std::printf(" | %16s | best vs cublas\n", "engine's, overlap");
  for (const GemmShape& sh : shapes) {
    const size_t wbytes = static_cast<size_t>(sh.rows * sh.cols * 2);
    const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / wbytes + 1));
    std::vector<void*> ws_copies(static_cast<size_t>(copies));
    for (auto& p : ws_copies) {
      if (cudaMalloc(&p, wbytes) != cudaSuccess) {
        std::fprintf(stderr, "bench gemm: cudaMalloc of %zu bytes failed\n", wbytes);
        std::exit(1);
      }
      cudaMemsetAsync(p, 0, wbytes, stream);  // zeros stream like any bytes; the values do not matter here
    }
    for (int64_t n : {16, 32}) {
      void *x = nullptr, *y = nullptr;
      cudaMalloc(&x, static_cast<size_t>(n * sh.cols * 2));
      cudaMalloc(&y, static_cast<size_t>(n * sh.rows * 4));
      cudaMemsetAsync(x, 0, static_cast<size_t>(n * sh.cols * 2), stream);
      cudaMemsetAsync(y, 0, static_cast<size_t>(n * sh.rows * 4), stream);
      const int reps = std::max(copies, 8);
      auto time_calls = [&](auto&& call) {
        return time_ms(stream, iters, [&] {
                 for (int r = 0; r < reps; ++r) call(ws_copies[static_cast<size_t>(r % copies)]);
               }) * 1e3 / reps;
      };
      const float one = 1.0f, beta = sh.out == 1 ? 1.0f : 0.0f;
      const double t_cublas = time_calls([&](void* w) {
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(sh.rows), static_cast<int>(n),
                     static_cast<int>(sh.cols), &one, w, CUDA_R_16BF, static_cast<int>(sh.cols), x, CUDA_R_16BF,
                     static_cast<int>(sh.cols), &beta, y, sh.out == 0 ? CUDA_R_16BF : CUDA_R_32F,
                     static_cast<int>(sh.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      });
      std::printf("%-12s %4lld | %8.1f %5.2f TB", sh.name, static_cast<long long>(n), t_cublas,
                  wbytes / (t_cublas * 1e-6) / 1e12);
      // The product as the weight-streaming kernel takes it (w: the first copy; the timed calls
      // set each copy).
      SkinnyGemm product;
      product.y = y;
      product.y_f32 = sh.out != 0;
      product.accumulate = sh.out == 1;
      product.x = x;
      product.w = ws_copies[0];
      product.n = n;
      product.rows = sh.rows;
      product.cols = sh.cols;
      double best = 1e30;
      for (int c = 0; c <= rungs; ++c) {  // c == rungs: the engine's rung as a programmatic dependent launch
        const int v = c < rungs ? c : 0;
        SkinnyGemm g = product;
        // Ordinary launches, as inside a step (where the kernel before a GEMM is not a GEMM);
        // the last column overlaps each call with the previous one's tail.
        g.overlap_previous = c == rungs;
        const double t = time_calls([&](void* w) {
          g.w = w;
          if (c < rungs) skinny_gemm_variant(g, v, stream);
          else skinny_gemm(g, stream);
        });
        if (c < rungs) best = std::min(best, t);
        std::printf(" | %8.1f %5.2f TB", t, wbytes / (t * 1e-6) / 1e12);
      }
      std::printf(" | %.2fx\n", t_cublas / best);
      // gemm "tuned": cuBLASLt's heuristic's own pick, the engine's timed choice (among cuBLASLt's
      // algorithms and, up to 16 rows, the weight-streaming kernel), and the fastest of cuBLASLt's
      // listed algorithms in this loop's timing.
      const LtShape shape = LtGemm::shape(n, sh.rows, sh.cols, sh.out == 0 ? CUDA_R_16BF : CUDA_R_32F, sh.out == 1, y,
                                          x, ws_copies[0]);
      std::vector<LtCandidate> list;
      if (lt.candidates(shape, 16, &list) == CUBLAS_STATUS_SUCCESS) {
        std::vector<double> t_lt;
        for (const LtCandidate& cand : list) {
          t_lt.push_back(time_calls([&](void* w) { lt.run(shape, cand, y, x, w, stream); }));
        }
        // The engine offers the weight-streaming kernel (its rung, a dependent launch) up to 16 rows.
        SkinnyGemm g = product;
        g.overlap_previous = true;
        const SkinnyGemm* skinny = n <= 16 && skinny_gemm_supported(g) ? &g : nullptr;
        const double t_tuned = time_calls([&](void* w) { lt.tuned(shape, y, x, w, stream, skinny); });
        const size_t b = static_cast<size_t>(std::min_element(t_lt.begin(), t_lt.end()) - t_lt.begin());
        const LtCandidate* chosen = lt.chosen(shape, skinny != nullptr);
        std::printf("%-12s %4lld |   cuBLASLt's heuristic's pick %.1f us (%s); tuned %.1f us %.2f TB (%s), %.2fx cublas; "
                    "fastest cuBLASLt algorithm of %zu here %.1f us (%s)\n",
                    sh.name, static_cast<long long>(n), t_lt[0], list[0].describe().c_str(), t_tuned,
                    wbytes / (t_tuned * 1e-6) / 1e12, chosen != nullptr ? chosen->describe().c_str() : "-",
                    t_cublas / t_tuned, list.size(), t_lt[b], list[b].describe().c_str());
      } else {
        std::printf("%-12s %4lld |   cuBLASLt: no algorithm listed\n", sh.name, static_cast<long long>(n));
      }
      cudaFree(x);
      cudaFree(y);
    }
    for (void* p : ws_copies) cudaFree(p);
  }
  for (int v = 0; v < rungs; ++v) std::printf("rung %d: %s\n", v, skinny_gemm_variant_name(v));
  std::printf("every rung an ordinary launch; the last column the engine's rung (skinny_gemm) as a programmatic "
              "dependent launch (its first weights load while the GEMM before it finishes)\n");
  if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess) {
    std::fprintf(stderr, "bench gemm: a CUDA error\n");
    std::exit(1);
  }
  cudaFree(ws);
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string rows = "llada_canvas,llada_prefix,sdar_block,generate";
  int64_t canvas = 4096;
  std::vector<int64_t> ctxs = {32768, 65536, 131072};
  int iters = 10;
  std::string gemm = "cublas", attention = "dense";
  int64_t batch = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rows") rows = argv[i + 1];
    else if (a == "--canvas") canvas = std::strtoll(argv[i + 1], nullptr, 10);
    else if (a == "--ctx") ctxs = parse_list(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--gemm") gemm = argv[i + 1];
    else if (a == "--attention") attention = argv[i + 1];
    else if (a == "--batch") batch = std::max<int64_t>(std::strtoll(argv[i + 1], nullptr, 10), 1);
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  LoadOptions lo;
  lo.backend = "cuda";
  lo.gemm = gemm;
  lo.attention = attention;
  if (rows.find("gemm") != std::string::npos) bench_gemm_table(iters);
  std::vector<Row> out;
  std::vector<GenRow> gens;
  const bool want_generate = rows.find("generate") != std::string::npos;
  const bool want_llada = rows.find("llada") != std::string::npos, want_sdar = rows.find("sdar") != std::string::npos;
  if (want_llada) {
    auto model = Model::random(llada_8b(), lo, 1);
    CHECK(model.status());
    if (rows.find("llada_canvas") != std::string::npos) {
      out.push_back(bench_step(model.value(), "llada_canvas", canvas, 0, 32, std::max(iters / 2, 3)));
    }
    if (rows.find("llada_prefix") != std::string::npos) {
      for (int64_t ctx : ctxs) {
        if (ctx > 65536) continue;  // LLaDA-8B's K/V at 128K is 68 GB: the row stops at 64K
        out.push_back(bench_step(model.value(), "llada_prefix", 32, ctx, 32, iters));
      }
    }
    if (want_generate) {
      gens.push_back(bench_generate(model.value(), Loop::remask, 960, 64, 32, 64));
      gens.push_back(bench_generate(model.value(), Loop::prefix_cache, 4032, 64, 32, 64));
    }
  }
  if (want_sdar) {
    auto model = Model::random(sdar_8b(), lo, 2);
    CHECK(model.status());
    const Config& c = model->config();
    for (int64_t ctx : ctxs) {
      // The batch's K/V caches must fit beside the weights (batch 8 at 128K would need 151 GB).
      const double kv_bytes = double(batch) * (ctx + 16) * c.n_layers * c.n_kv_heads * c.head_dim * 2 * 2;
      if (kv_bytes > 100e9) {
        std::printf("sdar_block x%lld at %lld cached tokens: skipped, its K/V caches would take %.0f GB\n",
                    static_cast<long long>(batch), static_cast<long long>(ctx), kv_bytes / 1e9);
        continue;
      }
      out.push_back(bench_step(model.value(), "sdar_block", 16, ctx, 16, iters, batch));
    }
    if (want_generate) gens.push_back(bench_generate(model.value(), Loop::block, 1024, 256, 16, 16));
  }
  if (out.empty() && gens.empty()) return 0;
  std::printf("DLM engine steps on the device (bf16, random 8B-shaped weights, GEMMs %s, attention %s; medians of "
              "CUDA-event timings)\n", gemm.c_str(), attention.c_str());
  const double hbm = hbm_peak();
  std::printf("(of HBM: against %.2f TB/s)\n", hbm / 1e12);
  std::printf("%-13s %6s %7s | %9s %9s %9s %9s (%7s %7s) | %8s %12s %9s\n", "row", "tokens", "ctx", "step ms",
              "gemm ms", "attn ms", "rest ms", "elemw", "sample", "TFLOP/s", "weights TB/s", "of HBM");
  for (const Row& r : out) {
    if (r.skipped) continue;
    const double non_attn = r.step - r.attention;
    const double tbs = r.weight_bytes / (non_attn * 1e-3) / 1e12;
    std::printf("%-13s %6lld %7lld | %9.2f %9.2f %9.2f %9.2f (%7.2f %7.2f) | %8.1f %12.2f %8.0f%%\n",
                r.name.c_str(), static_cast<long long>(r.tokens), static_cast<long long>(r.ctx), r.step, r.gemm,
                r.attention, r.step - r.gemm - r.attention, r.elementwise, r.sample,
                r.flops / (r.step * 1e-3) / 1e12, tbs, 100 * tbs * 1e12 / hbm);
  }
  if (!gens.empty()) {
    std::printf("\ngenerate() end to end (greedy, wall clock, prefill included)\n");
    std::printf("%-13s %7s %5s %7s | %9s %10s %10s\n", "loop", "prompt", "gen", "steps", "seconds", "tokens/s",
                "steps/s");
    for (const GenRow& g : gens) {
      std::printf("%-13s %7lld %5lld %7lld | %9.3f %10.1f %10.1f\n", g.loop.c_str(), static_cast<long long>(g.prompt),
                  static_cast<long long>(g.gen), static_cast<long long>(g.steps), g.seconds, g.gen / g.seconds,
                  g.steps / g.seconds);
    }
  }
  return 0;
}
