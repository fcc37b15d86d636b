// sparsa/ruler.h — a RULER-style long-context task generator and its scorers (docs/eval.md).
//
// Every family of RULER (Hsieh et al., 2024) that needs no download: needle-in-a-haystack
// (single, multi-key, multi-value, multi-query) over noise and needle haystacks, variable
// tracking, common- and frequent-word extraction (an embedded word list), and a synthetic
// multi-document QA in place of SQuAD/HotpotQA. A sample is a pure function of (task, max_len,
// seed, index) and of the token counter: the haystack grows until the input plus the task's
// generation budget just fits max_len tokens of the evaluated model's own tokenizer.
// Scoring is RULER's: case-insensitive substring match, string_match_all (share of the
// references found) or string_match_part (any reference found), after RULER's clean-up.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sparsa/status.h"

namespace sparsa::eval {

enum class Metric : uint8_t { all, part };  // string_match_all, string_match_part
const char* metric_name(Metric metric);

struct TaskInfo {
  std::string name;     // "niah_single_1", ...
  std::string family;   // niah, vt, cwe, fwe, qa
  Metric metric = Metric::all;
  int64_t gen_tokens = 0;  // RULER's tokens_to_generate: the budget kept free in max_len
  bool has_depth = false;  // the answer sits at one place in the context (plotted against depth)
  std::string summary;
};
// The tasks, in the order `all` runs them.
const std::vector<TaskInfo>& tasks();
const TaskInfo* find_task(const std::string& name);

// Tokens of a text as the evaluated model counts them (encode(text).size()).
using TokenCounter = std::function<int64_t(const std::string&)>;
// Without a tokenizer: ceil(bytes / 4), the usual rule of thumb for English BPE (used to
// make the text a tokenizer is trained on; lengths are then approximate).
int64_t approx_token_count(const std::string& text);

struct Sample {
  std::string task;
  int64_t max_len = 0;   // input_tokens + gen_tokens <= max_len
  uint64_t seed = 0;     // the run's seed; the sample's own stream is derived from (seed, task, max_len, index)
  int64_t index = 0;
  std::string input;     // what the model sees: task template + context + question + answer prefix
  std::string answer_prefix;  // the end of `input` (RULER keeps it in its own field)
  std::string target;    // a correct continuation (training text): " 1234567." etc.
  std::vector<std::string> outputs;  // the references the scorer looks for
  Metric metric = Metric::all;
  int64_t gen_tokens = 0;
  int64_t input_tokens = 0;  // counted with the generator's counter
  // Where the answer is: its share of the context (0 = first line, 1 = last) and the token
  // position of its first character in `input`; -1 for the tasks without one place (cwe, fwe).
  double depth = -1;
  int64_t answer_token = -1;
  int64_t haystack_units = 0;  // lines / needles / words / documents the search settled on
  // Tokens of the same sample with one more haystack unit: more than max_len - gen_tokens, the
  // proof that the haystack is the largest that fits (the calibration's exactness).
  int64_t next_unit_tokens = 0;
};

// One sample. Fails with invalid_argument (naming the argument) on an unknown task or a bad
// max_len / index / counter, and with `unsupported` (naming task and max_len) when not even
// the smallest instance fits max_len (vt's one-shot example alone takes 500 tokens).
Result<Sample> make_sample(const std::string& task, int64_t max_len, uint64_t seed, int64_t index,
                           const TokenCounter& count);

// RULER's post-processing of a prediction: strip() and control characters 0x00-0x1f -> '\n'.
std::string postprocess(const std::string& prediction);
// In [0, 1] (RULER reports x100). Case-insensitive substring match on the post-processed text.
double string_match_all(const std::string& prediction, const std::vector<std::string>& refs);
double string_match_part(const std::string& prediction, const std::vector<std::string>& refs);
double score(const Sample& sample, const std::string& prediction);

// The command-line lists, each error naming `flag`:
//   tasks:   comma-separated task names, families (niah, vt, cwe, fwe, qa) or "all"; duplicates dropped.
//   lengths: "1K,2k,4096" (K = 1024), each in [64, 2^24].
//   methods: engine attention specs "dense,ba_att:density=0.5,block=64,quest:budget=128"; a
//            comma item holding '=' but no ':' continues the previous method's parameters, and
//            ';' always separates methods.
Result<std::vector<std::string>> parse_task_list(const std::string& flag, const std::string& text);
Result<std::vector<int64_t>> parse_length_list(const std::string& flag, const std::string& text);
Result<std::vector<std::string>> parse_method_list(const std::string& flag, const std::string& text);
// "2K" for 2048, else the number.
std::string length_label(int64_t length);

}  // namespace sparsa::eval
