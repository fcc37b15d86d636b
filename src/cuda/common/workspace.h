// Internal: device memory for the cuda backend, in one place. Everything is stream-ordered:
// allocations and frees go through sparsa's own memory pool of each device on the caller's stream
// (cudaMallocFromPoolAsync / cudaFreeAsync), so growing a workspace or freeing a plan never
// synchronises the device as cudaFree does, and memory is never handed to one stream while
// another's work may still use it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "sparsa/status.h"

namespace sparsa::cuda::detail {

// `bytes` (at least 1, so that an empty array has a distinct pointer) of `device`, ordered on
// `stream`: usable by work queued on `stream` after this call. `device` need not be current.
Status stream_malloc(int device, size_t bytes, cudaStream_t stream, void** ptr);
// Frees `ptr` once the work queued on `stream` before this call is done.
void stream_free(int device, void* ptr, cudaStream_t stream);

// A grow-only buffer of one (device, stream). Growing frees the old buffer on `stream` (the
// calls queued before on that stream finish with it first) and allocates the new one there.
class StreamBuffer {
 public:
  // At least `bytes` at data(); *grew (when not null) says whether it was (re)allocated: its
  // contents are then undefined.
  Status reserve(int device, cudaStream_t stream, size_t bytes, bool* grew = nullptr);
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// The state one launcher keeps per (device, stream) — workspaces, read-back buffers, side
// streams. Calls on one stream run in order, so the device work of two calls never shares a
// state at once; a state's users hold its own mutex to keep two host threads apart. States live
// for the whole process (a handful per stream a program uses); a stream handle that the driver
// reuses after cudaStreamDestroy finds its predecessor's state, which is correct once the
// destroyed stream's work has finished.
template <class State>
class PerStream {
 public:
  State& at(int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& e : entries_) {
      if (e.device == device && e.stream == stream) return *e.state;
    }
    entries_.push_back({device, stream, std::make_unique<State>()});
    return *entries_.back().state;
  }
  // f(device, stream, state) for every state made so far.
  template <class F>
  void for_each(F&& f) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& e : entries_) f(e.device, e.stream, *e.state);
  }

 private:
  struct Entry {
    int device;
    cudaStream_t stream;
    std::unique_ptr<State> state;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

}  // namespace sparsa::cuda::detail
