// `sparsa ruler tasks|generate` (the long-context task generator) and `sparsa eval-model`
// (accuracy of a diffusion LM per task x length x attention method; docs/eval.md).
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "cmd_eval_model.h"
#include "common.h"
#include "svg.h"
#include "table.h"
#include "sparsa/dlm.h"
#include "sparsa/ruler.h"
#include "util.h"

namespace sparsa::cli {

namespace {

struct RulerOptions {
  std::string tasks = "all", lengths = "1K", tokenizer, out;
  int64_t samples = 10;
  uint64_t seed = 0;
  int threads = 1;
  bool json = false, skip_unfit = false;
};

nlohmann::json sample_json(const eval::Sample& s) {
  return {{"task", s.task},
          {"max_len", s.max_len},
          {"seed", s.seed},
          {"index", s.index},
          {"input", s.input},
          {"answer_prefix", s.answer_prefix},
          {"target", s.target},
          {"outputs", s.outputs},
          {"metric", eval::metric_name(s.metric)},
          {"gen_tokens", s.gen_tokens},
          {"input_tokens", s.input_tokens},
          {"depth", s.depth},
          {"answer_token", s.answer_token},
          {"haystack_units", s.haystack_units},
          {"next_unit_tokens", s.next_unit_tokens}};
}

Result<eval::TokenCounter> token_counter(const std::string& tokenizer_path, std::shared_ptr<dlm::Tokenizer>* keep) {
  if (tokenizer_path.empty()) return eval::TokenCounter(eval::approx_token_count);
  auto tok = dlm::Tokenizer::load(tokenizer_path);
  if (!tok.ok()) return tok.status();
  *keep = std::make_shared<dlm::Tokenizer>(std::move(tok.value()));
  dlm::Tokenizer* t = keep->get();
  return eval::TokenCounter([t](const std::string& text) { return static_cast<int64_t>(t->encode(text).size()); });
}

Outcome run_ruler_tasks(const RulerOptions& o) {
  if (o.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const eval::TaskInfo& t : eval::tasks()) {
      j.push_back({{"name", t.name},
                   {"family", t.family},
                   {"metric", eval::metric_name(t.metric)},
                   {"gen_tokens", t.gen_tokens},
                   {"has_depth", t.has_depth},
                   {"summary", t.summary}});
    }
    std::cout << json_text(j) << "\n";
    return success();
  }
  Table table({"task", "family", "metric", "gen", "summary"});
  for (const eval::TaskInfo& t : eval::tasks()) {
    table.add_row({t.name, t.family, eval::metric_name(t.metric), std::to_string(t.gen_tokens), t.summary});
  }
  std::cout << table.render();
  return success();
}

// Samples of every (task, length, index), in that order, over `threads` threads.
Result<std::vector<eval::Sample>> make_samples(const std::vector<std::string>& tasks, const std::vector<int64_t>& lengths,
                                               int64_t samples, uint64_t seed, const eval::TokenCounter& count,
                                               int threads, bool skip_unfit = false) {
  struct Job {
    std::string task;
    int64_t length, index;
  };
  std::vector<Job> jobs;
  for (const std::string& t : tasks) {
    for (int64_t len : lengths) {
      for (int64_t i = 0; i < samples; ++i) jobs.push_back({t, len, i});
    }
  }
  std::vector<eval::Sample> out(jobs.size());
  std::vector<Status> errors(jobs.size(), Status::Ok());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t j = next++; j < jobs.size(); j = next++) {
      auto s = eval::make_sample(jobs[j].task, jobs[j].length, seed, jobs[j].index, count);
      if (s.ok()) {
        out[j] = std::move(s.value());
      } else {
        errors[j] = s.status();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(threads, 1); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  std::vector<eval::Sample> kept;
  std::set<std::string> skipped;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (errors[j].ok()) {
      kept.push_back(std::move(out[j]));
    } else if (skip_unfit && errors[j].code() == StatusCode::unsupported) {
      skipped.insert(jobs[j].task + "@" + eval::length_label(jobs[j].length));
    } else {
      return errors[j];
    }
  }
  if (!skipped.empty()) {
    std::string list;
    for (const std::string& s : skipped) list += (list.empty() ? "" : ", ") + s;
    std::fprintf(stderr, "sparsa ruler: skipped (the smallest instance does not fit): %s\n", list.c_str());
  }
  return kept;
}

Outcome run_ruler_generate(const RulerOptions& o) {
  auto tasks = eval::parse_task_list("--tasks", o.tasks);
  if (!tasks.ok()) return usage_error(tasks.status());
  auto lengths = eval::parse_length_list("--lengths", o.lengths);
  if (!lengths.ok()) return usage_error(lengths.status());
  if (o.samples < 1 || o.samples > 10000000) return usage_error(invalid_argument("--samples: expected 1 to 10^7"));
  if (o.threads < 1 || o.threads > 1024) return usage_error(invalid_argument("--threads: expected 1 to 1024"));
  if (!o.out.empty()) {
    if (Status st = check_output_path("--out", o.out, {".jsonl"}); !st.ok()) return usage_error(st);
  }
  std::shared_ptr<dlm::Tokenizer> tok;
  auto count = token_counter(o.tokenizer, &tok);
  if (!count.ok()) return runtime_error(count.status());
  auto samples =
      make_samples(tasks.value(), lengths.value(), o.samples, o.seed, count.value(), o.threads, o.skip_unfit);
  if (!samples.ok()) return runtime_error(samples.status());
  std::string text;
  for (const eval::Sample& s : samples.value()) text += json_text(sample_json(s), -1) + "\n";
  if (o.out.empty()) {
    std::cout << text;
    return success();
  }
  if (Status st = write_text_file("--out", o.out, text); !st.ok()) return runtime_error(st);
  return success();
}

// ---- eval-model ---------------------------------------------------------------------------

struct SampleResult {
  int64_t index = 0;
  double depth = -1, score = 0, seconds = 0;
  int64_t answer_token = -1, input_tokens = 0;
  std::string prediction;
};

struct Cell {
  std::string task, method;
  int64_t length = 0;
  std::vector<SampleResult> samples;
  double accuracy() const {
    double s = 0;
    for (const SampleResult& r : samples) s += r.score;
    return samples.empty() ? 0 : 100.0 * s / static_cast<double>(samples.size());
  }
  int64_t nulls() const {
    int64_t n = 0;
    for (const SampleResult& r : samples) n += eval::postprocess(r.prediction).empty();
    return n;
  }
  double seconds() const {
    double s = 0;
    for (const SampleResult& r : samples) s += r.seconds;
    return s;
  }
};

// Two line plots side by side: accuracy vs length (every task averaged) and accuracy vs depth
// (the tasks whose answer sits at one place, in 10 bins of depth), one line per method.
std::string accuracy_svg(const std::vector<Cell>& cells, const std::vector<std::string>& methods,
                         const std::vector<int64_t>& lengths, const std::string& model) {
  LinePlot by_length{"accuracy vs length (" + model + ")", "context length (tokens)", "accuracy (%)", true, false, {}};
  LinePlot by_depth{"accuracy vs answer depth", "depth of the answer in the context (%)", "accuracy (%)", false, false, {}};
  for (const std::string& m : methods) {
    Series sl{m, {}, {}}, sd{m, {}, {}};
    for (int64_t len : lengths) {
      double sum = 0;
      int n = 0;
      for (const Cell& c : cells) {
        if (c.method == m && c.length == len) {
          sum += c.accuracy();
          ++n;
        }
      }
      if (n) {
        sl.x.push_back(static_cast<double>(len));
        sl.y.push_back(sum / n);
      }
    }
    double bin_sum[10] = {0};
    int bin_n[10] = {0};
    for (const Cell& c : cells) {
      if (c.method != m) continue;
      for (const SampleResult& r : c.samples) {
        if (r.depth < 0) continue;
        const int b = std::clamp(static_cast<int>(r.depth * 10), 0, 9);
        bin_sum[b] += 100.0 * r.score;
        ++bin_n[b];
      }
    }
    for (int b = 0; b < 10; ++b) {
      if (bin_n[b]) {
        sd.x.push_back(10.0 * b + 5.0);
        sd.y.push_back(bin_sum[b] / bin_n[b]);
      }
    }
    by_length.series.push_back(sl);
    if (!sd.x.empty()) by_depth.series.push_back(sd);
  }
  auto body = [](std::string svg) {
    const size_t start = svg.find("<svg");
    return start == std::string::npos ? svg : svg.substr(start);
  };
  std::string left = body(render_svg(by_length)), right = body(render_svg(by_depth));
  right.insert(4, " x=\"760\"");
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1520\" "
         "height=\"480\" viewBox=\"0 0 1520 480\">\n" +
         left + right + "</svg>\n";
}

}  // namespace

Outcome run_eval_model(const EvalModelOptions& o) {
  auto tasks = eval::parse_task_list("--tasks", o.tasks);
  if (!tasks.ok()) return usage_error(tasks.status());
  auto lengths = eval::parse_length_list(o.lengths_flag, o.lengths);
  if (!lengths.ok()) return usage_error(lengths.status());
  auto methods = eval::parse_method_list("--attention", o.attention);
  if (!methods.ok()) return usage_error(methods.status());
  if (o.samples < 1 || o.samples > 1000000) return usage_error(invalid_argument(o.samples_flag + ": expected 1 to 10^6"));
  if (o.steps < 0) return usage_error(invalid_argument("--steps: expected >= 0 (0: one token per step)"));
  if (o.gen_len < 0) return usage_error(invalid_argument("--gen-len: expected >= 0 (0: the task's budget)"));
  if (!o.svg.empty()) {
    if (Status st = check_output_path("--svg", o.svg, {".svg"}); !st.ok()) return usage_error(st);
  }
  if (!o.json_path.empty()) {
    if (Status st = check_output_path("--json", o.json_path, {".json"}); !st.ok()) return usage_error(st);
  }
  const std::string tok_path =
      o.tokenizer.empty() ? (std::filesystem::path(o.model) / "tokenizer.json").string() : o.tokenizer;
  std::shared_ptr<dlm::Tokenizer> tok;
  auto count = token_counter(tok_path, &tok);
  if (!count.ok()) return runtime_error(count.status());
  // --chat (instruct models): the question (the input before its answer prefix) as the user's
  // message in the model's chat template, the answer prefix after the assistant's turn opens, as
  // RULER prompts chat models. The lengths are calibrated on the bare input, so a prompt is longer
  // by the template's own tokens.
  std::optional<dlm::ChatTemplate> chat;
  if (o.chat) {
    auto t = dlm::ChatTemplate::load(o.model);
    if (!t.ok()) return runtime_error(Status(t.status().code(), "--chat: " + t.status().message()));
    chat.emplace(std::move(t.value()));
  }

  // The model itself first (a runtime error), then every method's spec before any work, so that a
  // bad --attention fails at once, as a usage error naming it. Between them, for a backend other
  // than cpu, the plain model on that backend: a model that loads on the cpu but not there (a
  // backend this build or machine lacks, a head_dim its kernels do not take) is a usage error
  // naming --backend. The methods' models are then loaded one at a time, each freed before the
  // next: one copy of the weights at a time, on the GPU too.
  dlm::Config config;
  dlm::Loop loop = dlm::Loop::block;
  {
    auto plain = dlm::Model::load(o.model, dlm::LoadOptions{});
    if (!plain.ok()) return runtime_error(plain.status());
    config = plain->config();
    loop = plain->default_loop();
  }
  if (o.backend != "cpu") {
    dlm::LoadOptions lo;
    lo.backend = o.backend;
    auto plain = dlm::Model::load(o.model, lo);
    if (!plain.ok()) {
      return usage_error(Status(plain.status().code(), "--backend " + o.backend + ": " + plain.status().message()));
    }
  }
  // An item is METHOD[|LAYERS=METHOD...]: its own layer overrides after --attention-layers'.
  auto load_options = [&](const std::string& item) {
    dlm::LoadOptions lo;
    lo.backend = o.backend;
    lo.num_threads = o.threads;
    lo.attention_layers = o.attention_layers;
    size_t begin = 0, bar = item.find('|');
    lo.attention = item.substr(0, bar);
    while (bar != std::string::npos) {
      begin = bar + 1;
      bar = item.find('|', begin);
      lo.attention_layers.push_back(item.substr(begin, bar == std::string::npos ? bar : bar - begin));
    }
    return lo;
  };
  if (!o.attention_layers.empty()) {  // the overrides alone first, so that their errors name their flag
    dlm::LoadOptions lo = load_options("dense");
    if (Status st = dlm::check_attention(config, lo); !st.ok()) {
      return usage_error(invalid_argument("--attention-layers: " + st.message()));
    }
  }
  for (const std::string& m : methods.value()) {
    if (Status st = dlm::check_attention(config, load_options(m)); !st.ok()) {
      return usage_error(invalid_argument("--attention " + m + ": " + st.message()));
    }
  }
  for (int64_t len : lengths.value()) {
    if (len > config.max_seq_len) {
      return usage_error(invalid_argument(o.lengths_flag + ": " + eval::length_label(len) + " exceeds the model's " +
                                          "max_position_embeddings (" + std::to_string(config.max_seq_len) + ")"));
    }
  }
  auto samples = make_samples(tasks.value(), lengths.value(), o.samples, o.seed, count.value(),
                              static_cast<int>(std::min<unsigned>(std::max(1u, std::thread::hardware_concurrency()), 16)));
  if (!samples.ok()) return runtime_error(samples.status());

  std::vector<Cell> cells;
  const auto start = std::chrono::steady_clock::now();
  const size_t total = samples->size() * methods->size();
  size_t done = 0;
  for (size_t mi = 0; mi < methods->size(); ++mi) {
    auto loaded = dlm::Model::load(o.model, load_options(methods->at(mi)));
    if (!loaded.ok()) return runtime_error(Status(loaded.status().code(), "--attention " + methods->at(mi) + ": " +
                                                                         loaded.status().message()));
    const dlm::Model& model = loaded.value();
    dlm::GenerateOptions g;
    g.loop = loop;  // the model's default loop, as read from the plain load
    g.steps = o.steps > 0 ? o.steps
                          : (g.loop == dlm::Loop::block ? std::max<int64_t>(config.block_size, 1) : 0);
    g.block_len = 32;
    g.confidence = dlm::default_confidence(g.loop);
    for (size_t si = 0; si < samples->size(); ++si) {
      const eval::Sample& s = (*samples)[si];
      if (cells.empty() || cells.back().method != methods->at(mi) || cells.back().task != s.task ||
          cells.back().length != s.max_len) {
        cells.push_back({s.task, methods->at(mi), s.max_len, {}});
      }
      g.gen_len = o.gen_len > 0 ? o.gen_len : s.gen_tokens;
      if (g.loop == dlm::Loop::remask || g.loop == dlm::Loop::prefix_cache || g.loop == dlm::Loop::dual_cache) {
        g.gen_len = (g.gen_len + g.block_len - 1) / g.block_len * g.block_len;  // remask: whole blocks
      }
      if (g.loop != dlm::Loop::block && o.steps == 0) g.steps = g.gen_len;
      std::string input = s.input;
      if (chat) {
        const bool has_prefix = input.size() >= s.answer_prefix.size() &&
                                input.compare(input.size() - s.answer_prefix.size(), s.answer_prefix.size(),
                                              s.answer_prefix) == 0;
        const std::string question = has_prefix ? input.substr(0, input.size() - s.answer_prefix.size()) : input;
        auto rendered = chat->render({{"user", question}});
        if (!rendered.ok()) return runtime_error(Status(rendered.status().code(), "--chat: " + rendered.status().message()));
        input = rendered.value() + (has_prefix ? s.answer_prefix : std::string());
      }
      const std::vector<int32_t> prompt = tok->encode(input);
      const auto t0 = std::chrono::steady_clock::now();
      auto result = model.generate({prompt}, g);
      if (!result.ok()) {
        return runtime_error(Status(result.status().code(), "--attention " + methods->at(mi) + ", " + s.task + " at " +
                                                                 eval::length_label(s.max_len) + " sample " +
                                                                 std::to_string(s.index) + ": " +
                                                                 result.status().message()));
      }
      auto text = tok->decode(result->tokens[0], true);
      SampleResult r;
      r.index = s.index;
      r.depth = s.depth;
      r.answer_token = s.answer_token;
      r.input_tokens = static_cast<int64_t>(prompt.size());
      r.prediction = text.ok() ? text.value() : std::string();
      r.score = eval::score(s, r.prediction);
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      cells.back().samples.push_back(r);
      ++done;
      if (!o.quiet) {
        const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr, "\r[sparsa eval-model] %zu/%zu  %s  %s@%s  sample %lld  acc %.1f%%  %.0f s   ", done, total,
                     methods->at(mi).c_str(), s.task.c_str(), eval::length_label(s.max_len).c_str(),
                     static_cast<long long>(s.index), cells.back().accuracy(), el);
        std::fflush(stderr);
      }
    }
  }
  if (!o.quiet) std::fprintf(stderr, "\n");

  nlohmann::json j = {{"model", o.model},
                      {"backend", o.backend},
                      {"arch", dlm::arch_name(config.arch)},
                      {"loop", dlm::loop_name(loop)},
                      {"seed", o.seed},
                      {"samples", o.samples},
                      {"tasks", tasks.value()},
                      {"lengths", lengths.value()},
                      {"methods", methods.value()},
                      {"attention_layers", o.attention_layers}};
  nlohmann::json results = nlohmann::json::array();
  for (const Cell& c : cells) {
    nlohmann::json per = nlohmann::json::array();
    for (const SampleResult& r : c.samples) {
      per.push_back({{"index", r.index},
                     {"depth", r.depth},
                     {"answer_token", r.answer_token},
                     {"input_tokens", r.input_tokens},
                     {"score", r.score},
                     {"seconds", r.seconds},
                     {"prediction", r.prediction}});
    }
    results.push_back({{"task", c.task},
                       {"length", c.length},
                       {"method", c.method},
                       {"accuracy", c.accuracy()},
                       {"nulls", c.nulls()},
                       {"seconds", c.seconds()},
                       {"per_sample", per}});
  }
  j["results"] = results;
  if (!o.svg.empty()) {
    const std::string name = std::filesystem::path(o.model).filename().string();
    if (Status st = write_text_file("--svg", o.svg, accuracy_svg(cells, methods.value(), lengths.value(), name));
        !st.ok()) {
      return runtime_error(st);
    }
  }
  if (!o.json_path.empty()) {
    if (Status st = write_text_file("--json", o.json_path, json_text(j) + "\n"); !st.ok()) return runtime_error(st);
  }
  if (o.json) {
    std::cout << json_text(j) << "\n";
    return success();
  }
  // The table: one row per task x length, one column per method (accuracy %), then the mean.
  std::vector<std::string> headers = {"task", "length"};
  for (const std::string& m : methods.value()) headers.push_back(m);
  Table table(headers);
  std::map<std::string, std::pair<double, int>> mean;
  for (const std::string& t : tasks.value()) {
    for (int64_t len : lengths.value()) {
      std::vector<std::string> row = {t, eval::length_label(len)};
      for (const std::string& m : methods.value()) {
        for (const Cell& c : cells) {
          if (c.task == t && c.length == len && c.method == m) {
            row.push_back(format("%.1f", c.accuracy()));
            mean[m].first += c.accuracy();
            mean[m].second += 1;
          }
        }
      }
      table.add_row(row);
    }
  }
  std::vector<std::string> row = {"mean", ""};
  for (const std::string& m : methods.value()) row.push_back(format("%.1f", mean[m].first / std::max(1, mean[m].second)));
  table.add_row(row);
  // Speed beside accuracy: the mean wall time of one sample's generation (prefill and decode).
  row = {"s/sample", ""};
  for (const std::string& m : methods.value()) {
    double seconds = 0;
    size_t n = 0;
    for (const Cell& c : cells) {
      if (c.method != m) continue;
      seconds += c.seconds();
      n += c.samples.size();
    }
    row.push_back(format("%.2f", seconds / static_cast<double>(std::max<size_t>(1, n))));
  }
  table.add_row(row);
  std::cout << "accuracy (%) of " << o.model << " (" << dlm::arch_name(config.arch) << ", "
            << dlm::loop_name(loop) << " loop), " << o.samples << " samples per cell, seed " << o.seed;
  for (const std::string& l : o.attention_layers) std::cout << ", layers " << l;
  std::cout << "\n" << table.render();
  return success();
}

std::vector<Subcommand> add_eval_model_commands(CLI::App& app) {
  std::vector<Subcommand> out;
  auto r = std::make_shared<RulerOptions>();
  CLI::App* ruler = app.add_subcommand("ruler", "the RULER-style long-context task generator (docs/eval.md)");
  ruler->require_subcommand(1);
  CLI::App* list = ruler->add_subcommand("tasks", "list the tasks, their scoring and generation budgets");
  list->add_flag("--json", r->json, "print JSON");
  CLI::App* gen = ruler->add_subcommand("generate", "write samples as JSON lines (one object per sample)");
  gen->add_option("--tasks", r->tasks, "tasks, families or all (comma-separated)")->capture_default_str();
  gen->add_option("--lengths", r->lengths, "max lengths in tokens, e.g. 1K,4K,8K (K = 1024)")->capture_default_str();
  gen->add_option("--samples", r->samples, "samples per task and length")->capture_default_str();
  gen->add_option("--seed", r->seed, "seed (a sample depends only on seed, task, length and index)")
      ->capture_default_str();
  gen->add_option("--tokenizer", r->tokenizer,
                  "tokenizer.json that counts the tokens (default: none, ceil(bytes/4) as the estimate)");
  gen->add_option("--threads", r->threads, "threads")->capture_default_str();
  gen->add_option("--out", r->out, "output .jsonl (default: stdout)");
  gen->add_flag("--skip-unfit", r->skip_unfit,
                "skip (with a note on stderr) the task x length pairs whose smallest instance does not fit, "
                "instead of failing");
  out.push_back({ruler, [r, list] { return list->parsed() ? run_ruler_tasks(*r) : run_ruler_generate(*r); }});

  auto e = std::make_shared<EvalModelOptions>();
  CLI::App* ev = app.add_subcommand("eval-model", "accuracy of a diffusion LM on the long-context tasks, per "
                                                  "task x length x attention method");
  ev->add_option("--model", e->model, "model directory (config.json, safetensors, tokenizer.json)")->required();
  ev->add_option("--tasks", e->tasks, "tasks, families or all (comma-separated; sparsa ruler tasks)")
      ->capture_default_str();
  ev->add_option("--lengths", e->lengths, "context lengths in tokens, e.g. 2K,4K,8K,16K")->capture_default_str();
  ev->add_option("--attention", e->attention,
                 "attention methods, e.g. dense,ba_att:density=0.5,quest:budget=128;losa:budget=128,k=4 (an item "
                 "whose part before any '|' has an '=' before any ':' continues the previous method; ';' always "
                 "separates; METHOD|0,1=dense gives that method its own layer overrides)")
      ->capture_default_str();
  ev->add_option("--attention-layers", e->attention_layers,
                 "per-layer overrides LAYERS=METHOD under every method, e.g. 0=dense (repeatable)")
      ->allow_extra_args(false);
  ev->add_option("--samples", e->samples, "samples per task and length")->capture_default_str();
  ev->add_option("--seed", e->seed, "task seed")->capture_default_str();
  ev->add_option("--steps", e->steps,
                 "block loop (sdar): denoising steps per block (default: the block size, one token per step); "
                 "remask (llada): total steps (default: gen-len)");
  ev->add_option("--gen-len", e->gen_len, "tokens to generate (default: the task's budget)");
  ev->add_option("--tokenizer", e->tokenizer, "tokenizer.json (default: the model directory's)");
  ev->add_option("--backend", e->backend,
                 "cpu, cuda or cuda:N (bf16 on the GPU: dense, ba_att, mean_pool, and quest and losa on denoising "
                 "steps; xattention runs on the cpu backend only)")
      ->capture_default_str();
  ev->add_option("--threads", e->threads, "attention threads (0 = all cores)");
  ev->add_option_function<std::string>(
        "--json", [e](const std::string& v) {
          if (v.empty() || v == "-") e->json = true;
          else e->json_path = v;
        },
        "[FILE] print JSON instead of the table (with FILE: write it there, the table printed too)")
      ->expected(0, 1);
  ev->add_option("--svg", e->svg, "SVG plot: accuracy vs length and vs answer depth, one line per method");
  ev->add_flag("--quiet", e->quiet, "no progress line");
  ev->add_flag("--chat", e->chat,
               "instruct / chat models: each question as the user's message in the model's chat template, "
               "the answer prefix after it (docs/eval.md)");
  out.push_back({ev, [e] { return run_eval_model(*e); }});
  return out;
}

}  // namespace sparsa::cli
