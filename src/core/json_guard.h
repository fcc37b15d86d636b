// Internal: reading JSON that comes from a file (a .safetensors header) without trusting it.
//
// nlohmann's parser, its copies and dump() recurse once per nesting level, so 200,000
// nested '[' overflow the stack. The text is scanned first (iteratively) and refused when
// it nests deeper than a limit; below it every recursive operation is bounded.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace sparsa::detail {

// Deep enough for any real header (a safetensors header nests 3 levels), shallow
// enough that recursion over the parsed value stays a few kilobytes of stack.
inline constexpr int kMaxJsonDepth = 32;

// The deepest nesting of '[' / '{' outside strings, scanning at most until it exceeds
// max_depth; *at is the byte offset where the limit was crossed (or text.size()).
// Strings are tracked as JSON defines them (backslash escapes), so brackets inside a
// string do not count. On invalid JSON the count is still an upper bound of what a
// parser would nest before it stops.
int json_nesting_depth(std::string_view text, int max_depth, size_t* at);

// Bytes of a parser's message made printable ASCII: bytes outside 0x20..0x7e become \xNN
// (nlohmann quotes the raw bytes it last read, which may be invalid UTF-8).
std::string printable(const std::string& s);

// s shortened for a message: at most max_chars characters, "..." appended when cut.
std::string clip(const std::string& s, size_t max_chars = 80);

}  // namespace sparsa::detail
