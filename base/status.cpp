#include "base/status.h"

namespace fedmesh {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kIoError: return "I/O error";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kRevoked: return "revoked";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

void check_failed(const char* expr, const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "fedmesh: check failed: %s at %s:%d%s%s\n", expr, file, line,
               what.empty() ? "" : ": ", what.c_str());
  std::abort();
}

}  // namespace fedmesh
