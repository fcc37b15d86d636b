// sparsa/status.h — the error type of every public entry point.
//
// A Status is either ok or carries a code and a one-line message that names the
// argument, what was expected and what was given, e.g.
//   "q: expected 4 dimensions [batch, heads, seq, head_dim], got 3".
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>

namespace sparsa {

enum class StatusCode {
  ok = 0,
  invalid_argument,   // shapes, strides, budgets, block sizes, index ranges
  unsupported_dtype,  // a dtype the operation or backend does not take
  unsupported,        // a feature the chosen backend lacks (e.g. cuda not compiled in)
  io_error,           // a file could not be read or written
  malformed_file,     // a tensor file that lies about itself
  non_finite,         // NaN/Inf found with check_finite
  out_of_memory,
  internal,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::ok; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid_argument: q: expected ..."
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

Status invalid_argument(std::string message);
Status unsupported_dtype(std::string message);

// Result<T>: a value or a non-ok Status (std::expected arrives with C++23).
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Status status) : v_(std::move(status)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace sparsa

// Early return on a non-ok Status (internal convenience, also usable by callers).
#define SPARSA_RETURN_IF_ERROR(expr)            \
  do {                                          \
    ::sparsa::Status sparsa_status_ = (expr);   \
    if (!sparsa_status_.ok()) return sparsa_status_; \
  } while (0)
