// The task generator and the scorers (include/sparsa/ruler.h): determinism per seed, length
// calibration, the recorded depth, RULER's scoring, and the command-line list parsers.
// Calibration against a real BPE tokenizer (the `tokenizers` package) is in test_ruler_cli.py.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "sparsa/ruler.h"

namespace sparsa::eval {
namespace {

// Two counters of different shape: the bytes/4 estimate, and a word-ish count (each run of
// letters, each digit and each other non-space character is a token: close to the digit-
// splitting BPE the trained model uses, and not linear in bytes).
int64_t piece_count(const std::string& text) {
  int64_t n = 0;
  bool in_word = false;
  for (char c : text) {
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (letter) {
      n += !in_word;
      in_word = true;
    } else {
      in_word = false;
      n += c != ' ';
    }
  }
  return n;
}

Sample must(const std::string& task, int64_t len, uint64_t seed, int64_t index, const TokenCounter& count) {
  auto s = make_sample(task, len, seed, index, count);
  EXPECT_TRUE(s.ok()) << task << " " << len << ": " << s.status().message();
  return s.ok() ? s.value() : Sample{};
}

TEST(Ruler, EveryTaskIsDeterministicPerSeedAndVariesAcrossSeeds) {
  for (const TaskInfo& t : tasks()) {
    const Sample a = must(t.name, 1024, 7, 3, piece_count);
    const Sample b = must(t.name, 1024, 7, 3, piece_count);
    EXPECT_EQ(a.input, b.input) << t.name;
    EXPECT_EQ(a.outputs, b.outputs) << t.name;
    EXPECT_EQ(a.depth, b.depth) << t.name;
    const Sample c = must(t.name, 1024, 8, 3, piece_count);
    const Sample d = must(t.name, 1024, 7, 4, piece_count);
    EXPECT_NE(a.input, c.input) << t.name << ": another seed must give another sample";
    EXPECT_NE(a.input, d.input) << t.name << ": another index must give another sample";
  }
}

// Tolerance: the search is exact in haystack units, so the slack left under max_len is less
// than one unit plus the generation budget's rounding: a noise line is ~25 tokens, a QA
// document ~40, a CWE word with its number 3-4; we allow 64 tokens or 2% of the length,
// whichever is larger (a search that stopped early, or an estimate taken as the answer, misses
// this by hundreds of tokens at 4K).
TEST(Ruler, LengthsAreCalibratedToTheCounter) {
  for (const TokenCounter& count : {TokenCounter(piece_count), TokenCounter(approx_token_count)}) {
    for (const TaskInfo& t : tasks()) {
      for (int64_t len : {1024, 4096}) {
        const Sample s = must(t.name, len, 1, 0, count);
        const int64_t used = s.input_tokens + s.gen_tokens;
        EXPECT_EQ(s.input_tokens, count(s.input));
        EXPECT_LE(used, len) << t.name << " " << len;
        EXPECT_GT(s.next_unit_tokens + s.gen_tokens, len) << t.name << " " << len << ": one more unit still fits";
        const int64_t tolerance = std::max<int64_t>(64, len / 50);
        EXPECT_GE(used, len - tolerance) << t.name << " " << len << ": " << used << " of " << len;
      }
    }
  }
}

TEST(Ruler, TooShortALengthIsAnErrorNamingIt) {
  auto s = make_sample("vt", 128, 0, 0, piece_count);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::unsupported);
  EXPECT_NE(s.status().message().find("max_len 128"), std::string::npos) << s.status().message();
  EXPECT_FALSE(make_sample("nope", 1024, 0, 0, piece_count).ok());
  EXPECT_FALSE(make_sample("niah_single_1", 10, 0, 0, piece_count).ok());
  EXPECT_FALSE(make_sample("niah_single_1", 1024, 0, -1, piece_count).ok());
  EXPECT_FALSE(make_sample("niah_single_1", 1024, 0, 0, TokenCounter()).ok());
}

TEST(Ruler, AnswersAreInTheContextAtTheRecordedDepth) {
  for (const TaskInfo& t : tasks()) {
    for (int64_t i = 0; i < 10; ++i) {
      const Sample s = must(t.name, 2048, 5, i, approx_token_count);
      ASSERT_FALSE(s.outputs.empty()) << t.name;
      for (const std::string& o : s.outputs) {
        if (t.family == "fwe") continue;  // coded words are counted, not stated
        EXPECT_NE(s.input.find(o), std::string::npos) << t.name << ": reference '" << o << "' not in the input";
      }
      // The target a trained model writes scores 1.
      EXPECT_EQ(score(s, s.target), 1.0) << t.name << " target '" << s.target << "'";
      EXPECT_EQ(s.input.substr(s.input.size() - s.answer_prefix.size()), s.answer_prefix) << t.name;
      if (!t.has_depth) {
        EXPECT_EQ(s.depth, -1) << t.name;
        continue;
      }
      // Stratified: sample i lands in depth bin i (vt: half the range, the chain follows).
      const double bin_lo = (t.name == "vt" ? 0.05 : 0.1) * static_cast<double>(i);
      EXPECT_GE(s.depth, bin_lo) << t.name;
      EXPECT_LT(s.depth, bin_lo + (t.name == "vt" ? 0.05 : 0.1)) << t.name;
      // The recorded token position is where the answer's line is (to one line of ~30 tokens);
      // vt's one-shot example comes before its context, so there it is only later than depth.
      ASSERT_GE(s.answer_token, 0) << t.name;
      const double at = static_cast<double>(s.answer_token) / static_cast<double>(s.input_tokens);
      if (t.name == "vt") {
        EXPECT_GE(at, s.depth - 0.05) << t.name << " index " << i;
      } else {
        EXPECT_NEAR(at, s.depth, 0.12) << t.name << " index " << i;
      }
    }
  }
}

TEST(Ruler, NiahFormatsFollowRuler) {
  const Sample s = must("niah_single_1", 1024, 3, 0, approx_token_count);
  EXPECT_EQ(s.input.rfind("A special magic number is hidden within the following text.", 0), 0u);
  EXPECT_NE(s.input.find("One of the special magic numbers for "), std::string::npos);
  EXPECT_EQ(s.outputs.size(), 1u);
  EXPECT_EQ(s.outputs[0].size(), 7u);
  const Sample q = must("niah_multiquery", 1024, 3, 0, approx_token_count);
  EXPECT_EQ(q.outputs.size(), 4u);
  EXPECT_EQ(q.input.rfind("Some special magic numbers are hidden", 0), 0u);
  EXPECT_NE(q.answer_prefix.find(", and "), std::string::npos) << q.answer_prefix;
  const Sample v = must("niah_multivalue", 1024, 3, 0, approx_token_count);
  EXPECT_EQ(v.outputs.size(), 4u);
  const Sample u = must("niah_multikey_3", 1024, 3, 0, approx_token_count);
  ASSERT_EQ(u.outputs[0].size(), 36u);
  EXPECT_EQ(u.outputs[0][14], '4');  // version 4
  const Sample vt = must("vt", 1024, 3, 0, approx_token_count);
  EXPECT_EQ(vt.outputs.size(), 5u);
  EXPECT_NE(vt.input.find("VAR " + vt.outputs[1] + " = VAR " + vt.outputs[0]), std::string::npos);
  EXPECT_NE(vt.input.find("12345"), std::string::npos) << "the one-shot example";
  const Sample c = must("cwe", 1024, 3, 0, approx_token_count);
  EXPECT_EQ(c.outputs.size(), 10u);
  std::set<std::string> distinct(c.outputs.begin(), c.outputs.end());
  EXPECT_EQ(distinct.size(), 10u);
}

// The common words really are the most common, and the frequent coded words the ranks 2-4.
TEST(Ruler, ExtractionAnswersAreTheMostFrequent) {
  auto occurrences = [](const std::string& text, const std::string& word) {
    size_t n = 0;
    for (size_t p = text.find(word); p != std::string::npos; p = text.find(word, p + 1)) {
      const bool left = p == 0 || text[p - 1] == ' ';
      const bool right = p + word.size() == text.size() || text[p + word.size()] == ' ' || text[p + word.size()] == '\n';
      n += left && right;
    }
    return n;
  };
  const Sample c = must("cwe", 2048, 9, 1, approx_token_count);
  const std::string list = c.input.substr(c.input.rfind("Below is a numbered list"));
  for (const std::string& w : c.outputs) EXPECT_GE(occurrences(list, w), 6u) << w;
  const Sample f = must("fwe", 2048, 9, 1, approx_token_count);
  size_t last = SIZE_MAX;
  for (const std::string& w : f.outputs) {
    const size_t n = occurrences(f.input, w);
    EXPECT_LE(n, last) << w;
    EXPECT_GT(n, 1u) << w;
    last = n;
  }
}

TEST(Scoring, StringMatchAllIsTheShareOfReferencesFound) {
  EXPECT_EQ(string_match_all("The value is 1234567.", {"1234567"}), 1.0);
  EXPECT_EQ(string_match_all("1234567 and 7654321", {"1234567", "7654321", "1111111", "2222222"}), 0.5);
  EXPECT_EQ(string_match_all("nothing", {"1234567"}), 0.0);
  EXPECT_EQ(string_match_all("ABCDE abcdf", {"abcde", "ABCDF"}), 1.0);  // case-insensitive
  EXPECT_EQ(string_match_all("anything", {}), 0.0);
  EXPECT_EQ(string_match_all("", {"x"}), 0.0);
  EXPECT_EQ(string_match_all("123456", {"1234567"}), 0.0);  // a prefix is not a match
}

TEST(Scoring, StringMatchPartIsAnyReference) {
  EXPECT_EQ(string_match_part("Paris", {"paris", "lyon"}), 1.0);
  EXPECT_EQ(string_match_part("Rome", {"paris", "lyon"}), 0.0);
  EXPECT_EQ(string_match_part("in Lyon, I think", {"paris", "lyon"}), 1.0);
}

TEST(Scoring, PostprocessStripsAndMapsControlCharacters) {
  EXPECT_EQ(postprocess("  a\tb\x01" "c\n "), std::string("a\nb\nc"));
  EXPECT_EQ(postprocess("\n\n"), "");
  // A reference split by a control character no longer matches (as in RULER).
  EXPECT_EQ(string_match_all("12\x02" "34", {"1234"}), 0.0);
  EXPECT_EQ(string_match_all("  1234\x03", {"1234"}), 1.0);
}

TEST(Lists, TasksFamiliesAndAll) {
  auto all = parse_task_list("--tasks", "all");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), tasks().size());
  auto some = parse_task_list("--tasks", "vt, niah_single_1,vt,qa");
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(*some, (std::vector<std::string>{"vt", "niah_single_1", "qa_1", "qa_2"}));
  auto bad = parse_task_list("--tasks", "vt,nope");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--tasks: unknown task 'nope'"), std::string::npos);
  EXPECT_FALSE(parse_task_list("--tasks", "").ok());
  EXPECT_FALSE(parse_task_list("--tasks", "vt,,cwe").ok());
}

TEST(Lists, Lengths) {
  auto l = parse_length_list("--lengths", "2K,4k,8192");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(*l, (std::vector<int64_t>{2048, 4096, 8192}));
  for (const char* bad : {"", "K", "2M", "-1", "32", "1.5K", "99999999999", "16385K", "4K,"}) {
    auto r = parse_length_list("--lengths", bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().message().rfind("--lengths: ", 0), 0u) << r.status().message();
    }
  }
  EXPECT_EQ(length_label(2048), "2K");
  EXPECT_EQ(length_label(1000), "1000");
}

TEST(Lists, MethodsKeepTheirParameters) {
  auto m = parse_method_list("--attention", "dense,ba_att:density=0.5,block=64,quest:budget=128;losa:budget=128,k=4");
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(*m, (std::vector<std::string>{"dense", "ba_att:density=0.5,block=64", "quest:budget=128",
                                          "losa:budget=128,k=4"}));
  // METHOD|LAYERS=METHOD: the comma rule reads each item's part before '|', so the overrides may
  // follow a continued parameter, be methods with parameters, and take parameters of their own.
  m = parse_method_list("--attention",
                        "mean_pool|0=dense;ba_att:density=0.1,sort=false|0=mean_pool:density=0.5,block=32;"
                        "dense|1=quest:budget=64,k=4|0=dense;ba_att:density=0.3|0,1=mean_pool:density=0.5,block=8;"
                        "dense|0,1=quest:budget=64");
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(*m, (std::vector<std::string>{"mean_pool|0=dense",
                                          "ba_att:density=0.1,sort=false|0=mean_pool:density=0.5,block=32",
                                          "dense|1=quest:budget=64,k=4|0=dense",
                                          "ba_att:density=0.3|0,1=mean_pool:density=0.5,block=8",
                                          "dense|0,1=quest:budget=64"}));
  for (const char* bad : {"", "dense,", "density=0.5", "dense,block=64", "ba_att:", "ba_att:x", "Dense", "a b",
                          "|0=dense", "Dense|0=dense", "1=mean_pool:density=0.5"}) {
    auto r = parse_method_list("--attention", bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().message().rfind("--attention: ", 0), 0u) << r.status().message();
    }
  }
}

}  // namespace
}  // namespace sparsa::eval
