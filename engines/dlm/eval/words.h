// The embedded word lists of the task generator (words.cpp): everyday English adjectives,
// nouns and verbs, written for sparsa (RULER uses the wonderwords lists; results are therefore
// not bit-identical to RULER's, only alike in kind). Lowercase ASCII, distinct, sorted.
#pragma once

#include <span>
#include <string_view>

namespace sparsa::eval {

std::span<const std::string_view> adjectives();
std::span<const std::string_view> nouns();
std::span<const std::string_view> verbs();

}  // namespace sparsa::eval
