#include "sparsa/status.h"

namespace sparsa {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok: return "ok";
    case StatusCode::invalid_argument: return "invalid_argument";
    case StatusCode::unsupported_dtype: return "unsupported_dtype";
    case StatusCode::unsupported: return "unsupported";
    case StatusCode::io_error: return "io_error";
    case StatusCode::malformed_file: return "malformed_file";
    case StatusCode::non_finite: return "non_finite";
    case StatusCode::out_of_memory: return "out_of_memory";
    case StatusCode::internal: return "internal";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status invalid_argument(std::string message) {
  return {StatusCode::invalid_argument, std::move(message)};
}
Status unsupported_dtype(std::string message) {
  return {StatusCode::unsupported_dtype, std::move(message)};
}

}  // namespace sparsa
