// Shared by the libFuzzer harnesses: the readers take a path, so each input is written
// to one scratch file per process (in $TMPDIR, removed at exit), and a result that
// contradicts itself stops the run with a message.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "sparsa/io.h"

namespace sparsa::fuzz {

// A scratch path "<tmp>/sparsa-fuzz-<pid>-<tag><suffix>" that lives until the process exits.
inline const std::string& scratch_path(const char* tag, const char* suffix) {
  struct Scratch {
    std::string path;
    ~Scratch() { std::remove(path.c_str()); }
  };
  static thread_local Scratch s;  // one per (tag, suffix) call site and thread
  if (s.path.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    s.path = std::string(tmp && *tmp ? tmp : "/tmp") + "/sparsa-fuzz-" + std::to_string(getpid()) + "-" + tag + suffix;
  }
  return s.path;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::fprintf(stderr, "fuzz: cannot write the scratch file %s\n", path.c_str());
    std::abort();
  }
}

[[noreturn]] inline void contradiction(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::abort();
}

// An error must carry a message that starts with the file it is about.
inline void check_error(const Status& s, const std::string& path) {
  if (s.ok()) return;
  if (s.message().find(path) == std::string::npos) {
    contradiction("error without the path: " + s.message());
  }
}

inline bool same(const HostArray& a, const HostArray& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

}  // namespace sparsa::fuzz
