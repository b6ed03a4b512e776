// Status and Result<T>: the return types of everything that can fail for a
// reason outside the program (a file, a config, a peer). Programming errors
// use FEDMESH_CHECK instead, which stays on in release builds.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace fedmesh {

enum class StatusCode {
  kOk,
  kInvalidArgument,   // a config value, flag or input the caller can fix
  kNotFound,          // a file or record that is not there
  kCorrupt,           // bytes that do not parse or fail a checksum
  kIoError,           // the disk or the OS refused
  kUnavailable,       // a resource (device, peer) not present right now
  kRevoked,           // the federation took this member's key off its roster: retrying cannot help
  kInternal,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status revoked(std::string m) { return {StatusCode::kRevoked, std::move(m)}; }

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {
    if (status_.is_ok()) status_ = Status(StatusCode::kInternal, "Result built from an ok Status");
  }

  bool is_ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return checked(); }
  const T& value() const& { return const_cast<Result*>(this)->checked(); }
  T&& value() && { return std::move(checked()); }
  T* operator->() { return &checked(); }
  T& operator*() { return checked(); }

 private:
  T& checked() {
    if (!value_) {
      std::fprintf(stderr, "fedmesh: value() on a failed Result: %s\n", status_.to_string().c_str());
      std::abort();
    }
    return *value_;
  }
  std::optional<T> value_;
  Status status_;
};

[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& what);

}  // namespace fedmesh

// Always-on invariant check (never compiled out under NDEBUG).
#define FEDMESH_CHECK(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) ::fedmesh::check_failed(#cond, __FILE__, __LINE__, std::string{__VA_ARGS__}); \
  } while (0)

#define FEDMESH_RETURN_IF_ERROR(expr)      \
  do {                                     \
    ::fedmesh::Status status_ = (expr);    \
    if (!status_.is_ok()) return status_;  \
  } while (0)
