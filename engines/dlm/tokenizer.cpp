// Hugging Face tokenizer.json, byte-level BPE (the scheme of GPT-2, Qwen2/3, Llama-3, LLaDA).
//
// encode(text):
//   1. split the text on the added tokens (leftmost, longest match); each is its own id;
//   2. pre-tokenize every other segment with the configured split — GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      or Qwen2's (Llama-3's with \p{N}{1,3})
//        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//      (written out by hand below, no regex engine); ByteLevel's add_prefix_space prepends a
//      space to a segment that does not start with one;
//   3. map each piece's bytes to GPT-2's printable byte alphabet and apply the merges, lowest
//      rank first (ignore_merges: a piece that is a whole vocabulary entry is taken as it is).
// decode(ids): concatenate the tokens, map the byte alphabet back to bytes (invalid UTF-8 becomes
// U+FFFD, as the tokenizers package's lossy decoding does).
//
// Unicode classes: \s is Unicode whitespace; \p{L} and \p{N} are exact for ASCII and Latin-1
// and cover the main letter/digit blocks beyond (Latin Extended, Greek, Cyrillic, Armenian,
// Hebrew, Arabic, Devanagari, Thai, Hangul, kana, CJK); other code points count as symbols.
// The NFC normalizer (Qwen) is accepted and not applied: exact for text already in NFC.
#include <algorithm>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "sparsa/dlm.h"
#include "sparsa/io.h"
#include "utf8.h"

namespace sparsa::dlm {

namespace {

using Json = nlohmann::json;

// ---- UTF-8 ---------------------------------------------------------------------------------

// Each ill-formed sequence (its maximal subpart) becomes one U+FFFD, as the tokenizers package's
// decode and Python's errors="replace" give.
std::string utf8_lossy(const std::string& bytes) {
  std::string out;
  for (size_t i = 0; i < bytes.size();) {
    size_t len = 0;
    const uint32_t cp = decode_utf8(bytes, i, &len);
    if (cp >= kInvalidUtf8) {
      out += "\xEF\xBF\xBD";
    } else {
      out.append(bytes, i, len);
    }
    i += len;
  }
  return out;
}

// ---- character classes -----------------------------------------------------------------------
bool is_space(uint32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0D) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
bool is_number(uint32_t c) {
  return (c >= '0' && c <= '9') || c == 0xB2 || c == 0xB3 || c == 0xB9 || (c >= 0xBC && c <= 0xBE) ||
         (c >= 0x660 && c <= 0x669) || (c >= 0x6F0 && c <= 0x6F9) || (c >= 0x966 && c <= 0x96F) ||
         (c >= 0x2070 && c <= 0x2079 && c != 0x2071 && c != 0x2072 && c != 0x2073) || (c >= 0x2080 && c <= 0x2089) ||
         (c >= 0x2150 && c <= 0x2189) || (c >= 0x2460 && c <= 0x249B) || (c >= 0xFF10 && c <= 0xFF19) || c == 0x3007 ||
         (c >= 0x3021 && c <= 0x3029);
}
bool is_letter(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (c < 0x100) return c == 0xAA || c == 0xB5 || c == 0xBA || (c >= 0xC0 && c != 0xD7 && c != 0xF7);
  return (c >= 0x100 && c <= 0x2AF) || (c >= 0x370 && c <= 0x3FF && c != 0x37E && c != 0x387 && c != 0x375) ||
         (c >= 0x400 && c <= 0x481) || (c >= 0x48A && c <= 0x52F) || (c >= 0x531 && c <= 0x556) ||
         (c >= 0x561 && c <= 0x587) || (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A) ||
         (c >= 0x904 && c <= 0x939) || (c >= 0xE01 && c <= 0xE30) || (c >= 0x1E00 && c <= 0x1FFF) ||
         (c >= 0x3041 && c <= 0x3096) || (c >= 0x30A1 && c <= 0x30FA) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xF900 && c <= 0xFAFF) ||
         (c >= 0xFF21 && c <= 0xFF3A) || (c >= 0xFF41 && c <= 0xFF5A);
}

// ---- pre-tokenizer split -----------------------------------------------------------------------
enum class Split { gpt2, qwen };

struct Cps {
  std::vector<uint32_t> cp;
  std::vector<size_t> at;  // byte offset of each code point, plus the end
};
Cps code_points(const std::string& s) {
  Cps c;
  for (size_t i = 0; i < s.size();) {
    size_t len = 0;
    c.cp.push_back(decode_utf8(s, i, &len));
    c.at.push_back(i);
    i += len;
  }
  c.at.push_back(s.size());
  return c;
}

// Length (in code points) of a contraction at i: 's 't 're 've 'm 'll 'd.
size_t contraction(const std::vector<uint32_t>& cp, size_t i, bool ignore_case) {
  if (cp[i] != '\'' || i + 1 >= cp.size()) return 0;
  auto lower = [&](size_t j) -> uint32_t {
    if (j >= cp.size()) return 0;
    const uint32_t c = cp[j];
    return ignore_case && c >= 'A' && c <= 'Z' ? c + 32 : c;
  };
  const uint32_t a = lower(i + 1), b = lower(i + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  return 0;
}

// \s+(?!\S) then \s+ at i (cp[i] is whitespace).
size_t whitespace_run(const std::vector<uint32_t>& cp, size_t i) {
  size_t j = i;
  while (j < cp.size() && is_space(cp[j])) ++j;
  if (j == cp.size() || j - i == 1) return j - i;
  return j - i - 1;  // leave the last space to the next piece
}

size_t match_gpt2(const std::vector<uint32_t>& cp, size_t i) {
  const size_t n = cp.size();
  if (size_t c = contraction(cp, i, false)) return c;
  // " ?\p{L}+ | ?\p{N}+ | ?[^\s\p{L}\p{N}]+": an optional space, then a run of one class
  const size_t j0 = cp[i] == ' ' && i + 1 < n && !is_space(cp[i + 1]) ? i + 1 : i;
  const uint32_t c = cp[j0];
  if (!is_space(c)) {
    const int cls = is_letter(c) ? 0 : is_number(c) ? 1 : 2;
    auto same = [&](uint32_t x) { return !is_space(x) && (is_letter(x) ? 0 : is_number(x) ? 1 : 2) == cls; };
    size_t j = j0;
    while (j < n && same(cp[j])) ++j;
    return j - i;
  }
  return whitespace_run(cp, i);
}

size_t match_qwen(const std::vector<uint32_t>& cp, size_t i, int max_digits) {
  const size_t n = cp.size();
  if (size_t c = contraction(cp, i, true)) return c;
  const uint32_t c = cp[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+
  const bool lead = c != '\r' && c != '\n' && !is_letter(c) && !is_number(c);
  if (lead && i + 1 < n && is_letter(cp[i + 1])) {
    size_t j = i + 1;
    while (j < n && is_letter(cp[j])) ++j;
    return j - i;
  }
  if (is_letter(c)) {
    size_t j = i;
    while (j < n && is_letter(cp[j])) ++j;
    return j - i;
  }
  if (is_number(c)) {  // \p{N}{1,max_digits}
    size_t j = i;
    while (j < n && is_number(cp[j]) && static_cast<int>(j - i) < max_digits) ++j;
    return j - i;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  const size_t s = c == ' ' ? 1 : 0;
  auto symbol = [&](uint32_t x) { return !is_space(x) && !is_letter(x) && !is_number(x); };
  if (i + s < n && symbol(cp[i + s])) {
    size_t j = i + s;
    while (j < n && symbol(cp[j])) ++j;
    while (j < n && (cp[j] == '\r' || cp[j] == '\n')) ++j;
    return j - i;
  }
  // \s*[\r\n]+ : up to the last newline of the whitespace run
  size_t j = i, last_newline = 0;
  bool newline = false;
  while (j < n && is_space(cp[j])) {
    if (cp[j] == '\r' || cp[j] == '\n') {
      newline = true;
      last_newline = j;
    }
    ++j;
  }
  if (newline) return last_newline + 1 - i;
  if (is_space(c)) return whitespace_run(cp, i);
  return 1;  // unreachable: every code point is a letter, number, symbol or space
}

// GPT-2's byte -> printable code point table.
std::vector<uint32_t> byte_alphabet() {
  std::vector<uint32_t> map(256);
  uint32_t extra = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? b : extra++;
  }
  return map;
}

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

}  // namespace

struct Tokenizer::Impl {
  std::unordered_map<std::string, int32_t> vocab;
  std::map<std::pair<std::string, std::string>, int32_t> ranks;
  std::vector<std::string> id_to_token;
  std::vector<char> id_is_added, id_is_special;
  std::vector<std::pair<std::string, int32_t>> added;  // content, id (longest first)
  Split split = Split::gpt2;
  int max_digits = 1;
  bool add_prefix_space = false;
  bool ignore_merges = false;
  std::vector<uint32_t> byte_to_cp;
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;

  void bpe(const std::string& piece, std::vector<int32_t>& out) const {
    std::string mapped;
    for (unsigned char b : piece) append_utf8(mapped, byte_to_cp[b]);
    if (ignore_merges) {
      auto it = vocab.find(mapped);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::vector<std::string> sym;
    for (size_t i = 0; i < mapped.size();) {
      size_t len = 0;
      decode_utf8(mapped, i, &len);
      sym.push_back(mapped.substr(i, len));
      i += len;
    }
    while (sym.size() > 1) {
      int32_t best = INT32_MAX;
      std::pair<std::string, std::string> best_pair;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        auto it = ranks.find({sym[i], sym[i + 1]});
        if (it != ranks.end() && it->second < best) {
          best = it->second;
          best_pair = it->first;
        }
      }
      if (best == INT32_MAX) break;
      std::vector<std::string> next;
      for (size_t i = 0; i < sym.size();) {
        if (i + 1 < sym.size() && sym[i] == best_pair.first && sym[i + 1] == best_pair.second) {
          next.push_back(sym[i] + sym[i + 1]);
          i += 2;
        } else {
          next.push_back(sym[i]);
          i += 1;
        }
      }
      sym.swap(next);
    }
    for (const std::string& s : sym) {
      auto it = vocab.find(s);
      if (it != vocab.end()) out.push_back(it->second);  // a byte outside the vocabulary is dropped
    }
  }

  void encode_segment(std::string text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    if (add_prefix_space && text[0] != ' ') text.insert(text.begin(), ' ');
    const Cps c = code_points(text);
    for (size_t i = 0; i < c.cp.size();) {
      size_t len = split == Split::gpt2 ? match_gpt2(c.cp, i) : match_qwen(c.cp, i, max_digits);
      len = std::max<size_t>(len, 1);
      bpe(text.substr(c.at[i], c.at[i + len] - c.at[i]), out);
      i += len;
    }
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  auto text = read_text_file(path);
  if (!text.ok()) return text.status();
  return parse(text.value(), path);
}

Result<Tokenizer> Tokenizer::parse(const std::string& json_text, const std::string& where) {
  try {
    return parse_json(json_text, where);
  } catch (const nlohmann::json::exception& e) {  // a value of an unexpected type deep inside
    return invalid_argument(where + ": malformed: " + e.what());
  }
}

Result<Tokenizer> Tokenizer::parse_json(const std::string& json_text, const std::string& where) {
  auto bad = [&](const std::string& field, const std::string& problem) {
    return invalid_argument(where + ": '" + field + "' " + problem);
  };
  auto unsupported = [&](const std::string& field, const std::string& problem) {
    return Status(StatusCode::unsupported, where + ": '" + field + "' " + problem);
  };
  Json j;
  try {
    j = Json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) return invalid_argument(where + ": expected a JSON object");
  auto impl = std::make_unique<Impl>();
  impl->byte_to_cp = byte_alphabet();
  for (uint32_t b = 0; b < 256; ++b) impl->cp_to_byte[impl->byte_to_cp[b]] = static_cast<uint8_t>(b);

  if (!j.contains("model") || !j["model"].is_object()) return bad("model", "is missing (expected an object)");
  const Json& m = j["model"];
  if (!m.contains("type") || m["type"] != "BPE") {
    return unsupported("model.type", "= " + (m.contains("type") ? m["type"].dump() : std::string("(missing)")) +
                                         ": only byte-level BPE is supported");
  }
  if (m.contains("byte_fallback") && m["byte_fallback"] == true)
    return unsupported("model.byte_fallback", "= true is not supported");
  if (m.contains("dropout") && !m["dropout"].is_null()) return unsupported("model.dropout", "is not supported");
  for (const char* f : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(f) && !m[f].is_null() && m[f] != "")
      return unsupported(std::string("model.") + f, "is not supported");
  }
  if (m.contains("ignore_merges")) {
    if (!m["ignore_merges"].is_boolean()) return bad("model.ignore_merges", "must be true or false");
    impl->ignore_merges = m["ignore_merges"].get<bool>();
  }
  if (!m.contains("vocab") || !m["vocab"].is_object() || m["vocab"].empty()) {
    return bad("model.vocab", "is missing or empty (expected an object token -> id)");
  }
  int64_t max_id = -1;
  for (const auto& [tok, id] : m["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > (1 << 24)) {
      return bad("model.vocab", "entry '" + tok + "' must map to an id in [0, 2^24], got " + id.dump());
    }
    impl->vocab[tok] = static_cast<int32_t>(id.get<int64_t>());
    max_id = std::max<int64_t>(max_id, id.get<int64_t>());
  }
  if (!m.contains("merges") || !m["merges"].is_array() || m["merges"].empty()) {
    return bad("model.merges", "is missing or empty: a byte-level BPE tokenizer needs its merges");
  }
  int32_t rank = 0;
  for (const Json& mg : m["merges"]) {
    std::pair<std::string, std::string> p;
    if (mg.is_string()) {
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= s.size()) {
        return bad("model.merges", "entry " + std::to_string(rank) + " must be \"a b\", got " + mg.dump());
      }
      p = {s.substr(0, sp), s.substr(sp + 1)};
    } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
      p = {mg[0].get<std::string>(), mg[1].get<std::string>()};
    } else {
      return bad("model.merges",
                 "entry " + std::to_string(rank) + " must be \"a b\" or [\"a\", \"b\"], got " + mg.dump());
    }
    impl->ranks.emplace(p, rank++);
  }

  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array()) return bad("added_tokens", "must be a list");
    for (const Json& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
          !a["content"].is_string() || a["content"].get<std::string>().empty() || a["id"].get<int64_t>() < 0 ||
          a["id"].get<int64_t>() > (1 << 24)) {
        return bad("added_tokens", "entries need an integer 'id' and a non-empty string 'content', got " + a.dump());
      }
      impl->added.push_back({a["content"].get<std::string>(), static_cast<int32_t>(a["id"].get<int64_t>())});
      max_id = std::max<int64_t>(max_id, a["id"].get<int64_t>());
    }
  }
  std::stable_sort(impl->added.begin(), impl->added.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });

  // normalizer
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const Json& nz = j["normalizer"];
    if (!nz.is_object() || !nz.contains("type") || nz["type"] != "NFC") {
      return unsupported("normalizer", "= " + nz.dump().substr(0, 80) + " is not supported (expected null or NFC)");
    }
  }
  // pre-tokenizer
  auto byte_level = [&](const Json& p, bool* use_regex) -> Status {
    if (p.contains("add_prefix_space")) impl->add_prefix_space = p["add_prefix_space"] == true;
    *use_regex = !p.contains("use_regex") || p["use_regex"] == true;
    return Status::Ok();
  };
  if (!j.contains("pre_tokenizer") || !j["pre_tokenizer"].is_object()) {
    return bad("pre_tokenizer", "is missing: expected ByteLevel or Sequence[Split, ByteLevel]");
  }
  const Json& pt = j["pre_tokenizer"];
  const std::string pt_type = pt.value("type", "");
  if (pt_type == "ByteLevel") {
    bool use_regex = true;
    SPARSA_RETURN_IF_ERROR(byte_level(pt, &use_regex));
    if (!use_regex) return unsupported("pre_tokenizer.use_regex", "= false without a Split is not supported");
    impl->split = Split::gpt2;
  } else if (pt_type == "Sequence" && pt.contains("pretokenizers") && pt["pretokenizers"].is_array()) {
    bool have_split = false, have_byte_level = false;
    for (const Json& p : pt["pretokenizers"]) {
      const std::string t = p.is_object() ? p.value("type", "") : "";
      if (t == "Split") {
        std::string pattern;
        if (p.contains("pattern") && p["pattern"].is_object()) {
          const Json& pat = p["pattern"];
          if (pat.contains("Regex") && pat["Regex"].is_string()) pattern = pat["Regex"].get<std::string>();
        }
        if (pattern == kQwenPattern) {
          impl->split = Split::qwen;
          impl->max_digits = 1;
        } else if (pattern == kLlama3Pattern) {
          impl->split = Split::qwen;
          impl->max_digits = 3;
        } else if (pattern == kGpt2Pattern) {
          impl->split = Split::gpt2;
        } else {
          return unsupported("pre_tokenizer.Split.pattern", "is not one of the GPT-2, Qwen2 or Llama-3 patterns");
        }
        if (p.value("behavior", "Isolated") != "Isolated" || p.value("invert", false)) {
          return unsupported("pre_tokenizer.Split.behavior", "must be Isolated, not inverted");
        }
        have_split = true;
      } else if (t == "ByteLevel") {
        bool use_regex = true;
        SPARSA_RETURN_IF_ERROR(byte_level(p, &use_regex));
        if (use_regex) {
          if (have_split)
            return unsupported("pre_tokenizer.ByteLevel.use_regex", "= true after a Split is not supported");
          impl->split = Split::gpt2;
          have_split = true;
        }
        have_byte_level = true;
      } else {
        return unsupported("pre_tokenizer", "step '" + t + "' is not supported (expected Split and ByteLevel)");
      }
    }
    if (!have_split || !have_byte_level) return unsupported("pre_tokenizer", "needs a Split and a ByteLevel step");
  } else {
    return unsupported("pre_tokenizer.type", "= '" + pt_type + "' is not supported (expected ByteLevel or Sequence)");
  }

  impl->id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
  impl->id_is_added.assign(static_cast<size_t>(max_id + 1), 0);
  impl->id_is_special.assign(static_cast<size_t>(max_id + 1), 0);
  for (const auto& [tok, id] : impl->vocab) impl->id_to_token[id] = tok;
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const Json& a : j["added_tokens"]) {
      const int64_t id = a["id"].get<int64_t>();
      impl->id_to_token[id] = a["content"].get<std::string>();
      impl->id_is_added[id] = 1;
      impl->id_is_special[id] = a.value("special", false) ? 1 : 0;
    }
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int32_t> out;
  const Impl& t = *impl_;
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (const auto& a : t.added) {  // longest first
      if (text.compare(i, a.first.size(), a.first) == 0) {
        hit = &a;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    t.encode_segment(text.substr(start, i - start), out);
    out.push_back(hit->second);
    i += hit->first.size();
    start = i;
  }
  t.encode_segment(text.substr(start), out);
  return out;
}

Result<std::string> Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& t = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(t.id_to_token.size())) {
      return invalid_argument("decode: token id " + std::to_string(id) + " outside the vocabulary [0, " +
                              std::to_string(t.id_to_token.size()) + ")");
    }
    if (t.id_is_added[id]) {
      if (!(skip_special && t.id_is_special[id])) bytes += t.id_to_token[id];
      continue;
    }
    const std::string& tok = t.id_to_token[id];
    for (size_t i = 0; i < tok.size();) {
      size_t len = 0;
      const uint32_t cp = decode_utf8(tok, i, &len);
      auto it = t.cp_to_byte.find(cp);
      if (it != t.cp_to_byte.end()) {
        bytes += static_cast<char>(it->second);
      } else {
        bytes.append(tok, i, len);
      }
      i += len;
    }
  }
  return utf8_lossy(bytes);
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

}  // namespace sparsa::dlm
