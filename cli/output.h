// Output for people and for machines: JSON lines on stdout with --json, a
// live progress line on a terminal otherwise.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace fedmesh::cli {

// Prints one JSON object as one line and flushes.
void emit_json(const nlohmann::json& event);

// A command that failed says so once: "fedmesh COMMAND: message" on stderr
// and, with --json, {"event":"error","command","code","message"} (plus the
// fields of `extra`) on stdout. Returns exit_code, the command's to return.
int report_failure(const std::string& command, bool json, const Status& status, int exit_code,
                   const nlohmann::json& extra = nlohmann::json::object());

// "512 B", "1.5 KiB", "3.21 MiB", "1.02 GiB"
std::string format_bytes(int64_t bytes);

// "1m 05s", "12.3s"
std::string format_duration(double seconds);

// A status line rewritten in place on a terminal (at most every
// kMinRedrawSeconds), or printed once per call when stderr is not a terminal
// and `always` is set.
class ProgressLine {
 public:
  ProgressLine();
  void update(const std::string& text, bool force = false);
  void finish();  // ends the line so later output starts on a new one

 private:
  static constexpr double kMinRedrawSeconds = 0.2;
  bool terminal_;
  bool dirty_ = false;
  std::chrono::steady_clock::time_point last_;
};

// SIGINT and SIGTERM set this flag (a long-running role then stops cleanly:
// the store settles, the socket closes); installed once per process.
const std::atomic<bool>& stop_on_signals();

}  // namespace fedmesh::cli
