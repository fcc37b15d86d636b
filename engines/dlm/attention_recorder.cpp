// The attention recorder of the cpu backend (engine.h): every layer's attention behind a thin
// wrapper that times it and, where LoadOptions::dump_attention selects the call, writes the
// call's inputs (and the block plan its method built) as safetensors files that `sparsa eval`,
// `sparsa plan` and `sparsa run` read (docs/dlm.md, "Capturing attention").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "engine.h"
#include "sparsa/io.h"

namespace sparsa::dlm {

class RecordedAttention final : public LayerAttention {
 public:
  RecordedAttention(std::unique_ptr<LayerAttention> inner, AttentionRecorder* recorder, int layer, int request,
                    std::string method)
      : inner_(std::move(inner)), recorder_(recorder), layer_(layer), request_(request), method_(std::move(method)) {}

  Status forward(const AttentionCall& call) override {
    const auto start = std::chrono::steady_clock::now();
    Status st = inner_->forward(call);
    recorder_->seconds_.fetch_add(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    const int64_t forward = forwards_++;
    if (!st.ok() || !recorder_->selected(layer_, forward)) return st;
    return recorder_->capture(call, *inner_, request_, forward, method_);
  }
  Result<std::optional<CallPlan>> plan_of(const AttentionCall& call) override { return inner_->plan_of(call); }
  bool takes_suffix() const override { return inner_->takes_suffix(); }
  void on_commit() override { inner_->on_commit(); }
  void on_reset() override { inner_->on_reset(); }

 private:
  std::unique_ptr<LayerAttention> inner_;
  AttentionRecorder* recorder_;
  int layer_, request_;
  std::string method_;
  int64_t forwards_ = 0;
};

Result<std::shared_ptr<AttentionRecorder>> AttentionRecorder::create(const AttentionDumpOptions& dump,
                                                                    int n_layers) {
  auto r = std::make_shared<AttentionRecorder>();
  r->dump_ = dump;
  if (dump.dir.empty()) return r;
  for (int l : dump.layers) {
    if (l < 0 || l >= n_layers) {
      return invalid_argument("dump_attention.layers: layer " + std::to_string(l) + " is not in [0, " +
                              std::to_string(n_layers) + ")");
    }
  }
  for (int64_t f : dump.forwards) {
    if (f < 0) return invalid_argument("dump_attention.forwards: expected forward passes >= 0, got " + std::to_string(f));
  }
  if (dump.max_files < 1) {
    return invalid_argument("dump_attention.max_files: expected >= 1, got " + std::to_string(dump.max_files));
  }
  // A new or empty directory: a capture never replaces files of an earlier one.
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir(dump.dir);
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) {
      return Status(StatusCode::io_error, "dump_attention: " + dump.dir + " exists and is not a directory");
    }
    if (fs::directory_iterator(dir, ec) != fs::directory_iterator()) {
      return Status(StatusCode::io_error, "dump_attention: " + dump.dir +
                                              " is not empty (a capture would replace its files); give a new or "
                                              "empty directory");
    }
    if (ec) return Status(StatusCode::io_error, "dump_attention: " + dump.dir + ": " + ec.message());
  } else if (!fs::create_directories(dir, ec)) {
    return Status(StatusCode::io_error, "dump_attention: cannot create " + dump.dir + ": " + ec.message());
  }
  return r;
}

std::unique_ptr<LayerAttention> AttentionRecorder::wrap(std::unique_ptr<LayerAttention> inner, int layer, int request,
                                                        std::string method) {
  return std::make_unique<RecordedAttention>(std::move(inner), this, layer, request, std::move(method));
}

bool AttentionRecorder::selected(int layer, int64_t forward) const {
  if (dump_.dir.empty()) return false;
  const bool layer_ok = dump_.layers.empty() || std::find(dump_.layers.begin(), dump_.layers.end(), layer) != dump_.layers.end();
  const bool forward_ok =
      dump_.forwards.empty() || std::find(dump_.forwards.begin(), dump_.forwards.end(), forward) != dump_.forwards.end();
  return layer_ok && forward_ok;
}

Status AttentionRecorder::capture(const AttentionCall& call, LayerAttention& inner, int request, int64_t forward,
                                  const std::string& method) {
  if (written_.fetch_add(1) >= dump_.max_files) {  // this capture's slot, or none left
    --written_;
    ++skipped_;
    return Status::Ok();
  }
  Status st = write_capture(call, inner, request, forward, method);
  if (!st.ok()) --written_;  // the slot is given back: nothing was written for it
  return st;
}

Status AttentionRecorder::write_capture(const AttentionCall& call, LayerAttention& inner, int request,
                                        int64_t forward, const std::string& method) {
  char stem_text[80];  // rR-lL-fF
  std::snprintf(stem_text, sizeof stem_text, "r%d-l%d-f%lld", request, call.layer, static_cast<long long>(forward));
  const std::string stem = stem_text;
  const std::filesystem::path dir(dump_.dir);
  // Contiguous copies of the call's strided views (the engine's cpu activations are f32).
  std::vector<HostArray> held;
  std::vector<std::pair<std::string, Tensor>> entries;
  auto add = [&](const char* name, const Tensor& t) {
    held.push_back(HostArray::copy_of(t));
    entries.emplace_back(name, held.back().view());
  };
  held.reserve(5);
  add("q", call.q);
  add("k", call.k);
  add("v", call.v);
  if (call.pos0 > 0) {
    add("prefix_k", call.prefix_k);
    add("prefix_v", call.prefix_v);
  }
  std::vector<std::pair<std::string, std::string>> meta = {
      {"request", std::to_string(request)},         {"layer", std::to_string(call.layer)},
      {"forward", std::to_string(forward)},         {"step", std::to_string(call.step)},
      {"pos0", std::to_string(call.pos0)},          {"tokens", std::to_string(call.q.shape[2])},
      {"block_causal", std::to_string(call.block_causal)}, {"method", method}};
  auto plan = inner.plan_of(call);
  if (!plan.ok()) return plan.status();
  if (plan->has_value()) {
    const std::string plan_file = stem + "-plan.safetensors";
    SPARSA_RETURN_IF_ERROR(write_block_index((dir / plan_file).string(), (*plan)->plan));
    meta.emplace_back("plan", plan_file);
    meta.emplace_back("plan_method", (*plan)->method);
    meta.emplace_back("plan_params", (*plan)->params);
  }
  return write_safetensors((dir / (stem + ".safetensors")).string(), entries, meta);
}

}  // namespace sparsa::dlm
