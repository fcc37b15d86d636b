// The RULER-style task generator (docs/eval.md). Each task builds its text from a haystack
// size n (noise lines, distractor needles, words, documents) with every random choice drawn
// before n is known, so that text(n) is one fixed family and the calibration below only
// searches n: the largest n with tokens(input(n)) + gen_tokens <= max_len.
//
// Templates, answer prefixes and generation budgets are RULER's (scripts/data/synthetic/
// constants.py of NVIDIA/RULER, as documented in the RULER paper); the random values are
// RULER's kinds (7-digit numbers, adjective-noun words, version-4 UUIDs, 5-letter variable
// names, 6-letter coded words) drawn from sparsa's own generator and word lists.
#include <algorithm>
#include <cmath>
#include <set>
#include <string_view>

#include "sparsa/ruler.h"
#include "words.h"

namespace sparsa::eval {

namespace {

// ---- randomness: SplitMix64 (Steele et al. 2014), the same on every platform --------------
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_++ * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull); }
  // Uniform in [0, n) (n > 0), by rejection: no modulo bias.
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    for (;;) {
      const uint64_t x = next();
      if (x < limit) return x % n;
    }
  }
  int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo + 1))); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }
  Rng fork(uint64_t stream) { return Rng(mix64(next() ^ mix64(stream))); }

 private:
  uint64_t state_;
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The stream of one sample: a function of (seed, task, max_len, index) only.
Rng sample_rng(uint64_t seed, const std::string& task, int64_t max_len, int64_t index) {
  uint64_t h = mix64(seed);
  h = mix64(h ^ fnv1a(task));
  h = mix64(h ^ static_cast<uint64_t>(max_len));
  h = mix64(h ^ static_cast<uint64_t>(index));
  return Rng(h);
}

// Depth of the answer, stratified over 10 bins by the sample index so that a few samples
// already cover the whole context: bin (index mod 10), uniform inside it.
double stratified_depth(Rng& rng, int64_t index) { return (static_cast<double>(index % 10) + rng.uniform()) / 10.0; }

// ---- random values ---------------------------------------------------------------------
std::string random_number(Rng& rng) { return std::to_string(rng.range(1000000, 9999999)); }

std::string random_word_key(Rng& rng) {
  const auto a = adjectives();
  const auto n = nouns();
  return std::string(a[rng.below(a.size())]) + "-" + std::string(n[rng.below(n.size())]);
}

std::string random_uuid(Rng& rng) {
  static const char* hex = "0123456789abcdef";
  uint64_t hi = rng.next(), lo = rng.next();
  hi = (hi & ~0xF000ull) | 0x4000ull;                         // version 4
  lo = (lo & ~(0xC000ull << 48)) | (0x8000ull << 48);         // variant 10xx
  std::string s;
  for (int i = 15; i >= 0; --i) s += hex[(hi >> (4 * i)) & 0xF];
  for (int i = 15; i >= 0; --i) s += hex[(lo >> (4 * i)) & 0xF];
  return s.substr(0, 8) + "-" + s.substr(8, 4) + "-" + s.substr(12, 4) + "-" + s.substr(16, 4) + "-" + s.substr(20);
}

std::string random_letters(Rng& rng, int n, char base) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>(base + rng.below(26));
  return s;
}

// A pronounceable made-up word of 2-3 consonant-vowel syllables (names, cities, and the word
// pool's overflow).
std::string pseudo_word(Rng& rng) {
  static const char* consonants = "bdfghklmnprstvz";
  static const char* vowels = "aeiou";
  std::string s;
  const int syllables = static_cast<int>(rng.range(2, 3));
  for (int i = 0; i < syllables; ++i) {
    s += consonants[rng.below(15)];
    s += vowels[rng.below(5)];
  }
  if (rng.below(2)) s += consonants[rng.below(15)];
  return s;
}
std::string capitalized(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

// `n` distinct values from `draw`, none in `taken` (which receives them).
template <class Draw>
std::vector<std::string> distinct(Rng& rng, size_t n, std::set<std::string>& taken, Draw draw) {
  std::vector<std::string> out;
  for (size_t tries = 0; out.size() < n; ++tries) {
    std::string v = draw(rng);
    if (tries > 1000 * (n + 10)) v += std::to_string(tries);  // a tiny pool: make it distinct anyway
    if (taken.insert(v).second) out.push_back(std::move(v));
  }
  return out;
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + items[i];
  return s;
}
// "a", "a and b", "a, b, and c" (RULER's query join).
std::string join_and(const std::vector<std::string>& items) {
  if (items.size() == 1) return items[0];
  if (items.size() == 2) return items[0] + " and " + items[1];
  std::string s;
  for (size_t i = 0; i + 1 < items.size(); ++i) s += items[i] + ", ";
  return s + "and " + items.back();
}

const char* kNoiseLine = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

// ---- one task's text as a function of its haystack size ----------------------------------
// text(n) returns the input and, when the answer sits at one place, its byte offset in it.
struct Built {
  std::string input;
  size_t answer_offset = std::string::npos;
};

struct Draft {
  std::string answer_prefix, target;
  std::vector<std::string> outputs;
  double depth = -1;
  int64_t min_units = 0;  // the smallest haystack that makes sense
  std::function<Built(int64_t)> text;
};

// Lines of a haystack with extra lines inserted before haystack line floor(frac * (n + 1))
// (clamped), in the order given; returns the joined text and the offset of insert `mark`.
struct Insert {
  double frac;
  std::string line;
};
std::string with_inserts(int64_t n, const std::function<std::string(int64_t)>& haystack_line,
                         const std::vector<Insert>& inserts, size_t mark, size_t* mark_offset) {
  std::vector<std::pair<int64_t, size_t>> at;  // (line, insert), stable by insert order
  for (size_t i = 0; i < inserts.size(); ++i) {
    at.emplace_back(std::clamp<int64_t>(static_cast<int64_t>(inserts[i].frac * static_cast<double>(n + 1)), 0, n), i);
  }
  std::stable_sort(at.begin(), at.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string s;
  size_t next = 0;
  bool first = true;
  auto add = [&](const std::string& line) {
    if (!first) s += "\n";
    first = false;
    s += line;
  };
  for (int64_t line = 0; line <= n; ++line) {
    for (; next < at.size() && at[next].first == line; ++next) {
      if (at[next].second == mark && mark_offset) *mark_offset = s.size() + (first ? 0 : 1);
      add(inserts[at[next].second].line);
    }
    if (line < n) add(haystack_line(line));
  }
  return s;
}

// ---- NIAH ---------------------------------------------------------------------------------
struct NiahConfig {
  bool needle_haystack = false;  // false: noise lines
  bool uuid_keys = false, uuid_values = false;
  int keys = 1, values = 1, queries = 1;
};

Draft niah(const NiahConfig& cfg, Rng& rng, int64_t index) {
  std::set<std::string> taken;
  auto key_of = [&](Rng& r) { return cfg.uuid_keys ? random_uuid(r) : random_word_key(r); };
  auto value_of = [&](Rng& r) { return cfg.uuid_values ? random_uuid(r) : random_number(r); };
  const std::vector<std::string> keys = distinct(rng, cfg.keys, taken, key_of);
  std::vector<std::vector<std::string>> values;
  std::set<std::string> taken_values;
  for (int k = 0; k < cfg.keys; ++k) values.push_back(distinct(rng, cfg.values, taken_values, value_of));
  std::vector<int> order(cfg.keys);
  for (int k = 0; k < cfg.keys; ++k) order[k] = k;
  rng.shuffle(order);
  std::vector<int> queried(order.begin(), order.begin() + cfg.queries);
  const std::string type_v = cfg.uuid_values ? "uuids" : "numbers";
  auto needle = [&](const std::string& key, const std::string& value) {
    return "One of the special magic " + type_v + " for " + key + " is: " + value + ".";
  };
  // The needles in a shuffled order; the first value of the first queried key carries the
  // stratified depth, the others are uniform.
  std::vector<Insert> inserts;
  size_t mark = 0;
  for (int k = 0; k < cfg.keys; ++k) {
    for (int v = 0; v < cfg.values; ++v) {
      if (k == queried[0] && v == 0) mark = inserts.size();
      inserts.push_back({0, needle(keys[k], values[k][v])});
    }
  }
  for (Insert& in : inserts) in.frac = rng.uniform();
  Draft d;
  d.depth = stratified_depth(rng, index);
  inserts[mark].frac = d.depth;
  {
    std::vector<size_t> perm(inserts.size());
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = i;
    rng.shuffle(perm);
    std::vector<Insert> shuffled;
    size_t new_mark = 0;
    for (size_t i = 0; i < perm.size(); ++i) {
      if (perm[i] == mark) new_mark = i;
      shuffled.push_back(inserts[perm[i]]);
    }
    inserts = shuffled;
    mark = new_mark;
  }
  // Distractor needles of the needle haystack: line i from its own stream, so that the first
  // n lines do not depend on n.
  const uint64_t distractor_seed = rng.next();
  auto haystack_line = [cfg, type_v, distractor_seed, taken](int64_t i) -> std::string {
    if (!cfg.needle_haystack) return kNoiseLine;
    Rng r(mix64(distractor_seed ^ mix64(static_cast<uint64_t>(i))));
    std::string key;
    do {
      key = cfg.uuid_keys ? random_uuid(r) : random_word_key(r);
    } while (taken.count(key));
    const std::string value = cfg.uuid_values ? random_uuid(r) : random_number(r);
    return "One of the special magic " + type_v + " for " + key + " is: " + value + ".";
  };

  std::vector<std::string> query_keys;
  for (int q : queried) {
    query_keys.push_back(keys[q]);
    for (const std::string& v : values[q]) d.outputs.push_back(v);
  }
  const std::string query = join_and(query_keys);
  const bool single = cfg.queries * cfg.values == 1;
  const std::string t = single ? type_v.substr(0, type_v.size() - 1) : type_v;
  const std::string head =
      single ? "A special magic " + t + " is hidden within the following text. Make sure to memorize it. I will quiz you "
                                        "about the " + t + " afterwards.\n"
             : "Some special magic " + t + " are hidden within the following text. Make sure to memorize it. I will quiz "
                                           "you about the " + t + " afterwards.\n";
  const std::string question = single ? "\nWhat is the special magic " + t + " for " + query + " mentioned in the provided text?"
                                      : "\nWhat are all the special magic " + t + " for " + query +
                                            " mentioned in the provided text?";
  d.answer_prefix = " The special magic " + t + " for " + query + " mentioned in the provided text " +
                    (single ? "is" : "are");
  d.target = " " + join_and(d.outputs) + ".";
  d.min_units = 0;
  d.text = [=](int64_t n) {
    size_t offset = std::string::npos;
    const std::string context = with_inserts(n, haystack_line, inserts, mark, &offset);
    return Built{head + context + question + d.answer_prefix, offset == std::string::npos ? offset : head.size() + offset};
  };
  return d;
}

// ---- variable tracking --------------------------------------------------------------------
struct VtChain {
  std::vector<std::string> names;
  std::string value;
};

VtChain vt_chain(Rng& rng, std::set<std::string>& taken, const std::string& value) {
  VtChain c;
  c.names = distinct(rng, 5, taken, [](Rng& r) { return random_letters(r, 5, 'A'); });  // 4 hops
  c.value = value;
  return c;
}
std::vector<std::string> vt_lines(const VtChain& c) {
  std::vector<std::string> lines = {"VAR " + c.names[0] + " = " + c.value};
  for (size_t i = 1; i < c.names.size(); ++i) lines.push_back("VAR " + c.names[i] + " = VAR " + c.names[i - 1]);
  return lines;
}
const char* kVtHead = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n";
std::string vt_question(const std::string& value) {
  return "\nQuestion: Find all variables that are assigned the value " + value + " in the text above.";
}
std::string vt_prefix(const std::string& value) {
  return " Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned the "
         "value " + value + ", they are: ";
}

// The chain's lines at sorted random line positions (the first at `depth`), in order.
std::vector<Insert> vt_inserts(Rng& rng, const VtChain& c, double first) {
  std::vector<double> fr = {first};
  for (size_t i = 1; i < c.names.size(); ++i) fr.push_back(first + (1 - first) * rng.uniform());
  std::sort(fr.begin(), fr.end());
  std::vector<Insert> ins;
  const std::vector<std::string> lines = vt_lines(c);
  for (size_t i = 0; i < lines.size(); ++i) ins.push_back({fr[i], lines[i]});
  return ins;
}

Result<int64_t> fit_units(const std::function<Built(int64_t)>& text, int64_t lo, int64_t budget,
                          const TokenCounter& count, const std::string& what);

Draft vt(Rng& rng, int64_t index, const TokenCounter& count, Status* error) {
  std::set<std::string> taken;
  const VtChain chain = vt_chain(rng, taken, std::to_string(rng.range(10000, 99999)));
  Draft d;
  d.depth = stratified_depth(rng, index) * 0.5;  // the chain needs room after its first line
  const std::vector<Insert> inserts = vt_inserts(rng, chain, d.depth);
  // The one-shot example (RULER): a full instance at 500 tokens with the value 12345.
  const VtChain ex_chain = vt_chain(rng, taken, "12345");
  const std::vector<Insert> ex_inserts = vt_inserts(rng, ex_chain, rng.uniform() * 0.5);
  auto noise = [](int64_t) { return std::string(kNoiseLine); };
  auto example_text = [=](int64_t n) {
    return Built{kVtHead + with_inserts(n, noise, ex_inserts, 0, nullptr) + vt_question("12345") + vt_prefix("12345")};
  };
  std::string example;
  auto ex_n = fit_units(example_text, 0, 500 - 30, count, "vt's one-shot example");
  if (!ex_n.ok()) {
    *error = ex_n.status();
    return d;
  }
  example = example_text(ex_n.value()).input + join(ex_chain.names, " ") + "\n\n";
  d.outputs = chain.names;
  d.answer_prefix = vt_prefix(chain.value);
  d.target = join(chain.names, " ");
  d.text = [=](int64_t n) {
    size_t offset = std::string::npos;
    const std::string context = with_inserts(n, noise, inserts, 0, &offset);
    const std::string lead = example + kVtHead;
    return Built{lead + context + vt_question(chain.value) + d.answer_prefix, lead.size() + offset};
  };
  return d;
}

// ---- common words extraction ----------------------------------------------------------
std::vector<std::string> word_pool(Rng& rng, size_t need) {
  std::set<std::string> seen;
  std::vector<std::string> pool;
  for (auto list : {adjectives(), nouns(), verbs()}) {
    for (std::string_view w : list) {
      if (seen.insert(std::string(w)).second) pool.emplace_back(w);
    }
  }
  std::sort(pool.begin(), pool.end());
  rng.shuffle(pool);
  // Beyond the embedded lists (long contexts): made-up words, as RULER falls back to a larger list.
  Rng extra = rng.fork(17);
  while (pool.size() < need) {
    std::string w = pseudo_word(extra);
    if (seen.insert(w).second) pool.push_back(w);
  }
  return pool;
}

std::string numbered(const std::vector<std::string>& words) {
  std::string s;
  for (size_t i = 0; i < words.size(); ++i) s += (i ? " " : "") + std::to_string(i + 1) + ". " + words[i];
  return s;
}

const char* kCweHead =
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n";
const char* kCweQuestion = "\nQuestion: What are the 10 most common words in the above list?";
const char* kCwePrefix = " Answer: The top 10 words that appear most often in the list are:";

// The words (first 10 common) repeated and shuffled, numbered.
std::string cwe_list(const std::vector<std::string>& words, int freq_common, int freq_rare, uint64_t seed) {
  std::vector<std::string> all;
  for (size_t i = 0; i < words.size(); ++i) {
    for (int r = 0; r < (i < 10 ? freq_common : freq_rare); ++r) all.push_back(words[i]);
  }
  Rng rng(seed);
  rng.shuffle(all);
  return numbered(all);
}

Draft cwe(Rng& rng, int64_t max_len) {
  const bool small = max_len < 4096;
  const int freq_common = small ? 6 : 30, freq_rare = small ? 1 : 3;
  const size_t ex_words = small ? 20 : 40;
  const int ex_common = small ? 3 : 10, ex_rare = small ? 1 : 3;
  // Enough words for any context up to 2^24 tokens (each occurrence is at least 2 tokens).
  const size_t need = static_cast<size_t>(std::max<int64_t>(max_len / (2 * freq_rare) + 64, 1100));
  const std::vector<std::string> pool = word_pool(rng, need);
  Rng ex_rng = rng.fork(29);
  std::vector<std::string> ex_pool = pool;
  ex_rng.shuffle(ex_pool);
  const std::vector<std::string> ex(ex_pool.begin(), ex_pool.begin() + ex_words);
  const std::string example = std::string(kCweHead) + cwe_list(ex, ex_common, ex_rare, ex_rng.next()) + kCweQuestion +
                              kCwePrefix + " " + numbered(std::vector<std::string>(ex.begin(), ex.begin() + 10)) +
                              "\n\n";
  const uint64_t list_seed = rng.next();
  Draft d;
  d.outputs.assign(pool.begin(), pool.begin() + 10);
  d.answer_prefix = kCwePrefix;
  d.target = " " + numbered(d.outputs) + ".";
  d.min_units = 10;
  d.text = [=](int64_t n) {
    const std::vector<std::string> words(pool.begin(), pool.begin() + std::min<int64_t>(n, pool.size()));
    return Built{example + kCweHead + cwe_list(words, freq_common, freq_rare, list_seed) + kCweQuestion + kCwePrefix};
  };
  return d;
}

// ---- frequent words extraction ---------------------------------------------------------
Draft fwe(Rng& rng, int64_t max_len) {
  const int64_t vocab_size = std::max<int64_t>((max_len - 50) / 50, 5);
  std::set<std::string> taken;
  std::vector<std::string> vocab =
      distinct(rng, static_cast<size_t>(vocab_size), taken, [](Rng& r) { return random_letters(r, 6, 'a'); });
  std::sort(vocab.begin(), vocab.end());
  rng.shuffle(vocab);
  vocab[0] = "...";
  const uint64_t list_seed = rng.next();
  Draft d;
  d.outputs.assign(vocab.begin() + 1, vocab.begin() + 4);  // ranks 2-4: rank 1 is the dots
  d.answer_prefix = " Answer: According to the coded text above, the three most frequently appeared words are:";
  d.target = " " + join(d.outputs, " ") + ".";
  // n scales the Zipf counts count_k = floor(n k^-2 / zeta(2)); the top four ranks must stay
  // apart (n >= 64 gives counts 38, 9, 4, 2).
  d.min_units = 64;
  d.text = [=](int64_t n) {
    const double zeta2 = M_PI * M_PI / 6.0;
    std::vector<std::string> words;
    for (int64_t k = 1; k <= vocab_size; ++k) {
      const int64_t c = static_cast<int64_t>(static_cast<double>(n) * std::pow(static_cast<double>(k), -2.0) / zeta2);
      for (int64_t r = 0; r < c; ++r) words.push_back(vocab[k - 1]);
    }
    Rng r(list_seed);
    r.shuffle(words);
    return Built{"Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words. " +
                 join(words, " ") +
                 "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                 "frequently appeared words in the above coded text?" +
                 d.answer_prefix};
  };
  return d;
}

// ---- synthetic multi-document QA ------------------------------------------------------
const char* kProfessions[] = {"baker",   "carpenter", "chemist", "dentist",  "editor",    "farmer",
                              "florist", "gardener",  "geologist", "jeweler", "lawyer",   "librarian",
                              "mechanic", "musician", "painter", "pharmacist", "plumber", "potter",
                              "sailor",  "sculptor",  "surgeon", "tailor",   "translator", "weaver"};

struct Person {
  std::string name, city, profession, year;
};
std::string person_doc(const Person& p) {
  return p.name + " is a " + p.profession + " who lives in the city of " + p.city + ". " + p.name + " was born in " +
         p.year + " and has worked as a " + p.profession + " for many years.";
}

Draft qa(Rng& rng, int64_t index, bool two_hop) {
  std::set<std::string> names, cities;
  auto person = [&](Rng& r) {
    Person p;
    p.name = distinct(r, 1, names, [](Rng& q) { return capitalized(pseudo_word(q)) + " " + capitalized(pseudo_word(q)); })[0];
    p.city = distinct(r, 1, cities, [](Rng& q) { return capitalized(pseudo_word(q)); })[0];
    p.profession = kProfessions[r.below(std::size(kProfessions))];
    p.year = std::to_string(r.range(1900, 2010));
    return p;
  };
  const Person gold = person(rng);
  const Person boss = person(rng);  // two_hop: the bridge document names gold through boss
  Draft d;
  d.depth = stratified_depth(rng, index);
  const double bridge_depth = rng.uniform();
  std::string question;
  if (two_hop) {
    question = "In which city does the person who assists " + boss.name + " live?";
    d.outputs = {gold.city};
  } else {
    switch (rng.below(3)) {
      case 0: question = "In which city does " + gold.name + " live?"; d.outputs = {gold.city}; break;
      case 1: question = "What is the profession of " + gold.name + "?"; d.outputs = {gold.profession}; break;
      default: question = "In which year was " + gold.name + " born?"; d.outputs = {gold.year}; break;
    }
  }
  std::vector<Insert> gold_docs = {{d.depth, person_doc(gold)}};
  if (two_hop) {
    gold_docs.push_back({bridge_depth, boss.name + " is a " + boss.profession + " who lives in the city of " + boss.city +
                                           ". " + gold.name + " is the assistant of " + boss.name + "."});
  }
  // Distractors from their own streams (document i does not depend on n); their names and
  // cities avoid the gold ones.
  const uint64_t distractor_seed = rng.next();
  const std::set<std::string> gold_names = names, gold_cities = cities;
  auto distractor = [=](int64_t i) {
    Rng r(mix64(distractor_seed ^ mix64(static_cast<uint64_t>(i))));
    std::set<std::string> n = gold_names, c = gold_cities;
    Person p;
    p.name = distinct(r, 1, n, [](Rng& q) { return capitalized(pseudo_word(q)) + " " + capitalized(pseudo_word(q)); })[0];
    p.city = distinct(r, 1, c, [](Rng& q) { return capitalized(pseudo_word(q)); })[0];
    p.profession = kProfessions[r.below(std::size(kProfessions))];
    p.year = std::to_string(r.range(1900, 2010));
    return person_doc(p);
  };
  const std::string instruction =
      "Answer the question based on the given documents. Only give me the answer and do not output any other words.";
  d.answer_prefix = " Answer:";
  d.target = " " + d.outputs[0];
  d.min_units = 0;
  d.text = [=](int64_t n) {
    // Documents: the distractors with the gold ones inserted, numbered "Document i:".
    std::vector<std::pair<int64_t, size_t>> at;
    for (size_t g = 0; g < gold_docs.size(); ++g) {
      at.emplace_back(std::clamp<int64_t>(static_cast<int64_t>(gold_docs[g].frac * static_cast<double>(n + 1)), 0, n), g);
    }
    std::stable_sort(at.begin(), at.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::string context;
    size_t next = 0, answer = std::string::npos;
    int64_t number = 1;
    auto add = [&](const std::string& doc) {
      if (number > 1) context += "\n\n";
      context += "Document " + std::to_string(number++) + ":\n" + doc;
    };
    for (int64_t i = 0; i <= n; ++i) {
      while (next < at.size() && at[next].first == i) {
        if (at[next].second == 0) answer = context.size() + (number > 1 ? 2 : 0);
        add(gold_docs[at[next].second].line);
        ++next;
      }
      if (i < n) add(distractor(i));
    }
    const std::string head = instruction + "\n\nThe following are given documents.\n\n";
    return Built{head + context + "\n\n" + instruction + "\n\nQuestion: " + question + d.answer_prefix,
                 head.size() + answer};
  };
  return d;
}

// ---- calibration -----------------------------------------------------------------------
// The largest n >= lo with count(text(n)) <= budget, found from a linear estimate then a
// bracketing binary search (token counts grow monotonically with n for these haystacks, up to
// BPE merges at the seams, which the search tolerates: it keeps only n it has seen fit).
Result<int64_t> fit_units(const std::function<Built(int64_t)>& text, int64_t lo, int64_t budget,
                          const TokenCounter& count, const std::string& what) {
  auto tokens = [&](int64_t n) { return count(text(n).input); };
  const int64_t t_lo = tokens(lo);
  if (t_lo > budget) {
    return Status(StatusCode::unsupported, what + ": even the smallest instance takes " + std::to_string(t_lo) +
                                               " tokens, more than the " + std::to_string(std::max<int64_t>(budget, 0)) +
                                               " the length leaves for the input after the answer's budget");
  }
  constexpr int64_t kMaxUnits = int64_t{1} << 24;
  const int64_t probe = lo + std::max<int64_t>(8, lo);
  const int64_t t_probe = tokens(probe);
  if (t_probe > budget) {  // the answer lies in [lo, probe)
    int64_t good = lo, bad = probe;
    while (bad - good > 1) {
      const int64_t mid = good + (bad - good) / 2;
      (tokens(mid) <= budget ? good : bad) = mid;
    }
    return good;
  }
  const double per_unit = std::max(1e-3, static_cast<double>(t_probe - t_lo) / static_cast<double>(probe - lo));
  int64_t guess = probe + static_cast<int64_t>(static_cast<double>(budget - t_probe) / per_unit);
  guess = std::clamp<int64_t>(guess, probe, kMaxUnits);
  int64_t good = probe, bad = -1;
  // Bracket around the estimate with steps that double.
  int64_t step = std::max<int64_t>(2, guess / 64);
  if (tokens(guess) <= budget) {
    good = guess;
    for (int64_t n = guess + step; bad < 0; n = std::min(kMaxUnits, n + step), step *= 2) {
      if (tokens(n) <= budget) {
        good = n;
        if (n == kMaxUnits) return n;
      } else {
        bad = n;
      }
    }
  } else {
    bad = guess;
    for (int64_t n = guess - step;; n -= step, step *= 2) {
      if (n <= probe) break;
      if (tokens(n) <= budget) {
        good = n;
        break;
      }
      bad = n;
    }
  }
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    (tokens(mid) <= budget ? good : bad) = mid;
  }
  return good;
}

std::vector<TaskInfo> make_tasks() {
  using M = Metric;
  return {
      {"niah_single_1", "niah", M::all, 128, true, "one word key, a 7-digit value, noise haystack"},
      {"niah_single_uuid", "niah", M::all, 128, true, "one word key, a UUID value, noise haystack"},
      {"niah_multikey_1", "niah", M::all, 128, true, "4 word keys (3 distractor needles), noise haystack"},
      {"niah_multikey_2", "niah", M::all, 128, true, "one word key among distractor needles (needle haystack)"},
      {"niah_multikey_3", "niah", M::all, 128, true, "one UUID key, UUID values, needle haystack"},
      {"niah_multivalue", "niah", M::all, 128, true, "one word key with 4 values, noise haystack"},
      {"niah_multiquery", "niah", M::all, 128, true, "4 word keys, all 4 queried, noise haystack"},
      {"vt", "vt", M::all, 30, true, "variable tracking: one chain of 4 hops in noise, one-shot example"},
      {"cwe", "cwe", M::all, 120, false, "the 10 most common words of a numbered list, one-shot example"},
      {"fwe", "fwe", M::all, 50, false, "the 3 most frequent coded words of a Zipf(2) text"},
      {"qa_1", "qa", M::part, 32, true, "one fact about a fictional person among distractor documents"},
      {"qa_2", "qa", M::part, 32, true, "two hops: a bridge document, then the person's document"},
  };
}

}  // namespace

const char* metric_name(Metric metric) { return metric == Metric::all ? "string_match_all" : "string_match_part"; }

const std::vector<TaskInfo>& tasks() {
  static const std::vector<TaskInfo> list = make_tasks();
  return list;
}

const TaskInfo* find_task(const std::string& name) {
  for (const TaskInfo& t : tasks()) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int64_t approx_token_count(const std::string& text) { return static_cast<int64_t>((text.size() + 3) / 4); }

Result<Sample> make_sample(const std::string& task, int64_t max_len, uint64_t seed, int64_t index,
                           const TokenCounter& count) {
  const TaskInfo* info = find_task(task);
  if (!info) return invalid_argument("task: unknown task '" + task + "' (`sparsa ruler tasks` lists them)");
  if (max_len < 64 || max_len > (int64_t{1} << 24)) {
    return invalid_argument("max_len: expected a length in [64, 2^24], got " + std::to_string(max_len));
  }
  if (index < 0) return invalid_argument("index: expected >= 0, got " + std::to_string(index));
  if (!count) return invalid_argument("count: a token counter is required");
  Rng rng = sample_rng(seed, task, max_len, index);
  Draft d;
  Status error = Status::Ok();
  if (info->family == "niah") {
    NiahConfig c;
    if (task == "niah_single_uuid") c.uuid_values = true;
    if (task == "niah_multikey_1") c.keys = 4;
    if (task == "niah_multikey_2") c.needle_haystack = true;
    if (task == "niah_multikey_3") c.needle_haystack = c.uuid_keys = c.uuid_values = true;
    if (task == "niah_multivalue") c.values = 4;
    if (task == "niah_multiquery") c.keys = c.queries = 4;
    d = niah(c, rng, index);
  } else if (task == "vt") {
    d = vt(rng, index, count, &error);
  } else if (task == "cwe") {
    d = cwe(rng, max_len);
  } else if (task == "fwe") {
    d = fwe(rng, max_len);
  } else {
    d = qa(rng, index, task == "qa_2");
  }
  SPARSA_RETURN_IF_ERROR(error);
  const int64_t budget = max_len - info->gen_tokens;
  auto n = fit_units(d.text, d.min_units, budget, count,
                     "task " + task + " at max_len " + std::to_string(max_len));
  if (!n.ok()) return n.status();
  const Built built = d.text(n.value());
  Sample s;
  s.task = task;
  s.max_len = max_len;
  s.seed = seed;
  s.index = index;
  s.input = built.input;
  s.answer_prefix = d.answer_prefix;
  s.target = d.target;
  s.outputs = d.outputs;
  s.metric = info->metric;
  s.gen_tokens = info->gen_tokens;
  s.input_tokens = count(built.input);
  s.haystack_units = n.value();
  s.next_unit_tokens = count(d.text(n.value() + 1).input);
  if (info->has_depth && built.answer_offset != std::string::npos) {
    s.depth = d.depth;
    s.answer_token = count(built.input.substr(0, built.answer_offset));
  }
  return s;
}

// ---- scoring ---------------------------------------------------------------------------
std::string postprocess(const std::string& prediction) {
  std::string s = prediction;
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
  size_t b = 0, e = s.size();
  while (b < e && space(s[b])) ++b;
  while (e > b && space(s[e - 1])) --e;
  s = s.substr(b, e - b);
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20) c = '\n';
  }
  return s;
}

namespace {
std::string lower(std::string s) {
  for (char& c : s) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}
}  // namespace

double string_match_all(const std::string& prediction, const std::vector<std::string>& refs) {
  if (refs.empty()) return 0;
  const std::string p = lower(postprocess(prediction));
  size_t found = 0;
  for (const std::string& r : refs) found += p.find(lower(r)) != std::string::npos;
  return static_cast<double>(found) / static_cast<double>(refs.size());
}

double string_match_part(const std::string& prediction, const std::vector<std::string>& refs) {
  const std::string p = lower(postprocess(prediction));
  for (const std::string& r : refs) {
    if (p.find(lower(r)) != std::string::npos) return 1;
  }
  return 0;
}

double score(const Sample& sample, const std::string& prediction) {
  return sample.metric == Metric::all ? string_match_all(prediction, sample.outputs)
                                      : string_match_part(prediction, sample.outputs);
}

// ---- the command-line lists --------------------------------------------------------------
namespace {
std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t j = std::min(text.find(sep, i), text.size());
    out.push_back(text.substr(i, j - i));
    i = j + 1;
  }
  return out;
}
std::string trimmed(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return s.substr(b, e - b);
}
// A text quoted for a message: at most 40 bytes, control bytes as '?'.
std::string quoted(const std::string& s) {
  std::string out = s.size() > 40 ? s.substr(0, 40) + "..." : s;
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) c = '?';
  }
  return "'" + out + "'";
}
}  // namespace

Result<std::vector<std::string>> parse_task_list(const std::string& flag, const std::string& text) {
  std::vector<std::string> out;
  auto add = [&](const std::string& name) {
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  };
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trimmed(raw);
    if (item.empty()) return invalid_argument(flag + ": empty task name in " + quoted(text));
    bool matched = false;
    for (const TaskInfo& t : tasks()) {
      if (item == "all" || item == t.family || item == t.name) {
        add(t.name);
        matched = true;
      }
    }
    if (!matched) {
      std::string names;
      for (const TaskInfo& t : tasks()) names += (names.empty() ? "" : ", ") + t.name;
      return invalid_argument(flag + ": unknown task " + quoted(item) + " (expected all, a family niah, vt, cwe, fwe, "
                              "qa, or one of " + names + ")");
    }
  }
  return out;
}

Result<std::vector<int64_t>> parse_length_list(const std::string& flag, const std::string& text) {
  std::vector<int64_t> out;
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trimmed(raw);
    int64_t scale = 1;
    std::string digits = item;
    if (!digits.empty() && (digits.back() == 'K' || digits.back() == 'k')) {
      scale = 1024;
      digits.pop_back();
    }
    bool ok = !digits.empty() && digits.size() <= 9;
    for (char c : digits) ok = ok && c >= '0' && c <= '9';
    const int64_t v = ok ? std::stoll(digits) * scale : 0;
    if (!ok || v < 64 || v > (int64_t{1} << 24)) {
      return invalid_argument(flag + ": expected lengths such as 1K,2K,4096 (each in [64, 16777216]), got " +
                              quoted(item));
    }
    out.push_back(v);
  }
  return out;
}

Result<std::vector<std::string>> parse_method_list(const std::string& flag, const std::string& text) {
  std::vector<std::string> out;
  for (const std::string& group : split(text, ';')) {
    for (const std::string& raw : split(group, ',')) {
      const std::string item = trimmed(raw);
      if (item.empty()) return invalid_argument(flag + ": empty method in " + quoted(text));
      // METHOD[:key=value][|LAYERS=METHOD...]. The comma rule reads the part before any '|': it
      // continues the method before it when it is a key=value or the rest of a layer list
      // ("1=dense", "1=mean_pool:density=0.5": an '=' before any ':', which no method name has);
      // otherwise it starts a method. The layer overrides themselves are checked when the model
      // loads (check_attention), each error naming them.
      const std::string head = item.substr(0, item.find('|'));
      const size_t head_eq = head.find('='), head_colon = head.find(':');
      const bool continues =
          head_eq != std::string::npos && (head_colon == std::string::npos || head_eq < head_colon);
      if (continues) {  // after a "method:key=value" or inside a method's layer overrides ('|')
        if (out.empty() || out.back().find_first_of(":|") == std::string::npos) {
          return invalid_argument(flag + ": parameter " + quoted(item) + " follows no 'method:' (write e.g. "
                                  "ba_att:density=0.5,block=64)");
        }
        out.back() += "," + item;
        continue;
      }
      const size_t colon = head.find(':');
      const std::string name = head.substr(0, colon);
      bool ok = !name.empty();
      for (char c : name) ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_');
      if (!ok) return invalid_argument(flag + ": expected a method name such as dense or ba_att, got " + quoted(item));
      if (colon != std::string::npos) {
        const std::string first = head.substr(colon + 1);
        const size_t eq = first.find('=');
        if (eq == std::string::npos || eq == 0 || eq + 1 == first.size()) {
          return invalid_argument(flag + ": expected key=value after '" + name + ":', got " + quoted(item));
        }
      }
      out.push_back(item);
    }
  }
  return out;
}

std::string length_label(int64_t length) {
  if (length % 1024 == 0) return std::to_string(length / 1024) + "K";
  return std::to_string(length);
}

}  // namespace sparsa::eval
