// A block-diffusion decode the engine captured (`sparsa generate --dump-attention DIR`,
// docs/dlm.md "Capturing attention") as a decode trace (sparsa/decode_trace.h,
// DecodeTrace::from_capture; `sparsa trace --capture`).
#include <charconv>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "sparsa/decode_trace.h"
#include "sparsa/io.h"

namespace sparsa {

namespace {

Status malformed(const std::string& message) { return Status{StatusCode::malformed_file, message}; }

// The forwards F of request R at layer L: DIR/rR-lL-fF.safetensors, by F.
Result<std::map<int64_t, std::string>> capture_files(const std::string& dir, int64_t request, int64_t layer) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return invalid_argument(dir + " is not a directory");
  std::string head = "r";  // rR-lL-f (built piecewise: GCC 12 warns falsely on "r" + std::string)
  head.append(std::to_string(request)).append("-l").append(std::to_string(layer)).append("-f");
  const std::string tail = ".safetensors";
  std::map<int64_t, std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
      continue;
    }
    const std::string f = name.substr(head.size(), name.size() - head.size() - tail.size());
    int64_t forward = -1;
    const auto [end, err] = std::from_chars(f.data(), f.data() + f.size(), forward);
    if (err != std::errc() || end != f.data() + f.size() || forward < 0) continue;  // e.g. rR-lL-fF-plan
    files.emplace(forward, entry.path().string());
  }
  if (ec) return Status{StatusCode::io_error, dir + ": " + ec.message()};
  if (files.empty()) {
    return invalid_argument("no " + head + "*.safetensors in " + dir + " (capture request " +
                            std::to_string(request) + " and layer " + std::to_string(layer) +
                            " with --dump-layers, --dump-forwards)");
  }
  return files;
}

Result<int64_t> metadata_int(const std::vector<std::pair<std::string, std::string>>& meta, const std::string& key,
                             const std::string& path) {
  for (const auto& [k, v] : meta) {
    if (k != key) continue;
    int64_t x = 0;
    const auto [end, err] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (err != std::errc() || end != v.data() + v.size()) {
      return malformed(path + ": __metadata__ " + key + ": expected an integer, got '" + v + "'");
    }
    return x;
  }
  return malformed(path + ": __metadata__ has no '" + key + "' (not an attention capture of `sparsa generate`)");
}

Result<HostArray> entry(std::vector<NamedArray>& arrays, const std::string& name, const std::string& path) {
  for (NamedArray& a : arrays) {
    if (a.name == name) return std::move(a.array);
  }
  return malformed(path + ": no tensor '" + name + "'");
}

struct CapturedForward {
  int64_t forward = 0, step = 0, pos0 = 0, tokens = 0;
  std::string path;
};

Result<std::vector<CapturedForward>> captured_forwards(const std::map<int64_t, std::string>& files) {
  std::vector<CapturedForward> out;
  for (const auto& [forward, path] : files) {
    auto meta = read_safetensors_metadata(path);
    if (!meta.ok()) return meta.status();
    CapturedForward f{forward, 0, 0, 0, path};
    for (auto [key, field] : {std::pair{"step", &f.step}, std::pair{"pos0", &f.pos0}, std::pair{"tokens", &f.tokens}}) {
      auto x = metadata_int(*meta, key, path);
      if (!x.ok()) return x.status();
      *field = *x;
    }
    out.push_back(f);
  }
  return out;
}

// The rows (tokens) whose keys differ between two [1, heads_kv, B, d] captures of layer 0:
// there a key depends only on its token and position, so exactly the tokens unmasked between
// the two passes.
std::vector<int64_t> changed_rows(const HostArray& a, const HostArray& b) {
  const Tensor x = a.view(), y = b.view();
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < x.shape[2]; ++i) {
    bool changed = false;
    for (int64_t h = 0; h < x.shape[1] && !changed; ++h)
      for (int64_t t = 0; t < x.shape[3] && !changed; ++t) {
        changed = a.ptr<float>()[x.offset({0, h, i, t})] != b.ptr<float>()[y.offset({0, h, i, t})];
      }
    if (changed) rows.push_back(i);
  }
  return rows;
}

// The decoded blocks of one request at one layer: every run of denoising steps 0, 1, ..., S-1
// at one pos0 followed by its commit pass (step -1, the same pos0); prefill passes before and
// a last block that was not committed are left out (`skipped` counts the forwards).
}  // namespace

Result<DecodeTrace> DecodeTrace::from_capture(const std::string& dir, int64_t request, int64_t layer,
                                              int64_t* skipped) {
  int64_t left_out = 0;
  if (skipped == nullptr) skipped = &left_out;
  if (request < 0) return invalid_argument("request: expected >= 0, got " + std::to_string(request));
  if (layer < 0) return invalid_argument("layer: expected >= 0, got " + std::to_string(layer));
  auto files = capture_files(dir, request, layer);
  if (!files.ok()) return files.status();
  auto zero_files = layer == 0 ? files : capture_files(dir, request, 0);
  if (!zero_files.ok()) {
    return invalid_argument("layer 0 of request " + std::to_string(request) + " is not in " + dir +
                            ": the tokens unmasked at each step are read from its keys (capture with --dump-layers 0," +
                            std::to_string(layer) + ")");
  }
  auto fw = captured_forwards(*files);
  if (!fw.ok()) return fw.status();
  struct Block {
    std::vector<size_t> steps;  // indices into fw
    size_t commit = 0;
  };
  std::vector<Block> blocks;
  *skipped = 0;
  for (size_t i = 0; i < fw->size();) {
    const CapturedForward& f = (*fw)[i];
    if (f.step != 0) {
      ++*skipped;
      ++i;
      continue;
    }
    Block b;
    size_t j = i;
    while (j < fw->size() && (*fw)[j].step == static_cast<int64_t>(j - i) && (*fw)[j].pos0 == f.pos0) {
      if ((*fw)[j].forward != f.forward + static_cast<int64_t>(j - i) || (*fw)[j].tokens != f.tokens) {
        return invalid_argument((*fw)[j].path + ": expected forward " +
                                std::to_string(f.forward + static_cast<int64_t>(j - i)) + " of " +
                                std::to_string(f.tokens) + " tokens, step " + std::to_string(j - i) +
                                " of the block at " + std::to_string(f.pos0) +
                                " (a capture with forwards left out by --dump-forwards or --dump-max cannot be traced)");
      }
      b.steps.push_back(j++);
    }
    if (j == fw->size()) {  // the last block was never committed (generation stopped): left out
      *skipped += static_cast<int64_t>(j - i);
      break;
    }
    const CapturedForward& c = (*fw)[j];
    if (c.step != -1 || c.pos0 != f.pos0 || c.tokens != f.tokens || c.forward != f.forward + static_cast<int64_t>(j - i)) {
      return invalid_argument(c.path + ": expected the commit pass of the block at " +
                              std::to_string(f.pos0) + " (forward " +
                              std::to_string(f.forward + static_cast<int64_t>(j - i)) + ", step -1, pos0 " +
                              std::to_string(f.pos0) + "), got forward " + std::to_string(c.forward) + ", step " +
                              std::to_string(c.step) + ", pos0 " + std::to_string(c.pos0));
    }
    b.commit = j;
    blocks.push_back(std::move(b));
    i = j + 1;
  }
  if (blocks.empty()) {
    return invalid_argument(dir + " holds no committed block of request " + std::to_string(request) +
                            " at layer " + std::to_string(layer) + " (only prefill or logits passes)");
  }
  // A prompt that ends inside a block leaves the first decoded block with fewer masked tokens,
  // so fewer steps: that block joins the prefix (its commit is in the next block's prefix_k).
  if (blocks.size() > 1 && blocks[0].steps.size() != blocks[1].steps.size()) {
    *skipped += static_cast<int64_t>(blocks[0].steps.size()) + 1;
    blocks.erase(blocks.begin());
  }
  const int64_t B = (*fw)[blocks[0].steps[0]].tokens, P = (*fw)[blocks[0].steps[0]].pos0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const CapturedForward& f = (*fw)[blocks[b].steps[0]];
    if (f.pos0 != P + static_cast<int64_t>(b) * B || f.tokens != B || blocks[b].steps.size() != blocks[0].steps.size()) {
      return invalid_argument(f.path + ": block " + std::to_string(b) + " at " + std::to_string(f.pos0) +
                              ", " + std::to_string(f.tokens) + " tokens, " + std::to_string(blocks[b].steps.size()) +
                              " steps; a trace needs consecutive blocks of " + std::to_string(B) + " tokens from " +
                              std::to_string(P) + " with " + std::to_string(blocks[0].steps.size()) +
                              " steps each (threshold decoding varies the steps)");
    }
  }

  std::vector<HostArray> keep;  // the tensors the views below point into
  keep.reserve(blocks.size() * (blocks[0].steps.size() * 3 + 2) + 2);
  const auto take = [&](std::vector<NamedArray>& arrays, const std::string& name, const std::string& path) -> Result<Tensor> {
    auto a = entry(arrays, name, path);
    if (!a.ok()) return a.status();
    keep.push_back(std::move(a).value());
    return keep.back().view();
  };
  const auto layer0_k = [&](int64_t forward) -> Result<HostArray> {
    const auto it = zero_files->find(forward);
    if (it == zero_files->end()) {
      return invalid_argument("layer 0's forward " + std::to_string(forward) + " of request " +
                              std::to_string(request) + " is not in " + dir + " (it gives the unmasking order)");
    }
    auto arrays = read_safetensors(it->second);
    if (!arrays.ok()) return arrays.status();
    auto k = entry(*arrays, "k", it->second);
    if (!k.ok()) return k.status();
    const Tensor t = k->view();
    if (t.dtype != DType::f32 || t.ndim != 4 || t.shape[0] != 1 || t.shape[2] != B) {
      return malformed(it->second + ": k: expected f32 [1, heads_kv, " + std::to_string(B) + ", head_dim], got " +
                       t.shape_string() + (t.dtype != DType::f32 ? " (not f32)" : ""));
    }
    return k;
  };
  Tensor prefix_k, prefix_v;
  std::vector<RecordedTraceBlock> recorded(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    RecordedTraceBlock& rb = recorded[b];
    std::vector<HostArray> zero_k;
    for (size_t s = 0; s <= blocks[b].steps.size(); ++s) {
      const bool commit = s == blocks[b].steps.size();
      const CapturedForward& f = (*fw)[commit ? blocks[b].commit : blocks[b].steps[s]];
      auto arrays = read_safetensors(f.path);
      if (!arrays.ok()) return arrays.status();
      if (b == 0 && s == 0 && P > 0) {
        auto pk = take(*arrays, "prefix_k", f.path);
        if (!pk.ok()) return pk.status();
        auto pv = take(*arrays, "prefix_v", f.path);
        if (!pv.ok()) return pv.status();
        if (pk->ndim != 4 || pk->shape[2] != P) {
          return malformed(f.path + ": prefix_k: expected " + std::to_string(P) + " positions (pos0), got " +
                           pk->shape_string());
        }
        prefix_k = *pk;
        prefix_v = *pv;
      }
      for (const char* name : commit ? std::vector<const char*>{"k", "v"} : std::vector<const char*>{"q", "k", "v"}) {
        auto t = take(*arrays, name, f.path);
        if (!t.ok()) return t.status();
        const std::string n = name;
        if (commit) (n == "k" ? rb.final_k : rb.final_v) = *t;
        else (n == "q" ? rb.q : n == "k" ? rb.k : rb.v).push_back(*t);
      }
      auto k0 = layer0_k(f.forward);
      if (!k0.ok()) return k0.status();
      if (!zero_k.empty() && k0->view().shape_vector() != zero_k.back().view().shape_vector()) {
        return malformed(f.path + ": layer 0's k changes shape within the block");
      }
      zero_k.push_back(std::move(k0).value());
      if (s > 0) rb.unmasked.push_back(changed_rows(zero_k[s - 1], zero_k[s]));
    }
  }
  return DecodeTrace::from_recorded(prefix_k, prefix_v, recorded);
}

}  // namespace sparsa
