// Small helpers shared by the commands: a wall clock and number formatting.
#pragma once

#include <cstdint>
#include <chrono>
#include <cstdio>
#include <string>

namespace sparsa::cli {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// printf-style formatting into a std::string.
template <class... Args>
std::string format(const char* fmt, Args... args) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), fmt, args...);
  return buf;
}

}  // namespace sparsa::cli
