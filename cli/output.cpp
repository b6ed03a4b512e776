#include "cli/output.h"

#include <signal.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>

namespace fedmesh::cli {

void emit_json(const nlohmann::json& event) {
  // Text a model generated, or that a peer sent, need not be valid UTF-8:
  // such bytes print as U+FFFD rather than end the command.
  std::cout << event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
}

int report_failure(const std::string& command, bool json, const Status& status, int exit_code,
                   const nlohmann::json& extra) {
  if (json) {
    nlohmann::json event = {{"event", "error"},
                            {"command", command},
                            {"code", status_code_name(status.code())},
                            {"message", status.message()}};
    for (const auto& [key, value] : extra.items()) event[key] = value;
    emit_json(event);
  }
  std::fprintf(stderr, "fedmesh %s: %s\n", command.c_str(), status.message().c_str());
  return exit_code;
}

std::string format_bytes(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  } else if (bytes >= (1 << 20)) {
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  } else if (bytes >= 1024) {
    std::snprintf(text, sizeof text, "%.1f KiB", static_cast<double>(bytes) / 1024);
  } else {
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(bytes));
  }
  return text;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  char buffer[64];
  if (seconds < 60) {
    std::snprintf(buffer, sizeof buffer, "%.1fs", seconds);
  } else if (seconds < 3600) {
    std::snprintf(buffer, sizeof buffer, "%dm %02ds", static_cast<int>(seconds) / 60, static_cast<int>(seconds) % 60);
  } else {
    std::snprintf(buffer, sizeof buffer, "%dh %02dm", static_cast<int>(seconds) / 3600,
                  (static_cast<int>(seconds) / 60) % 60);
  }
  return buffer;
}

ProgressLine::ProgressLine() : terminal_(isatty(STDERR_FILENO) != 0), last_(std::chrono::steady_clock::now()) {}

void ProgressLine::update(const std::string& text, bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!terminal_) {
    if (force) std::fprintf(stderr, "%s\n", text.c_str());
    return;
  }
  if (!force && std::chrono::duration<double>(now - last_).count() < kMinRedrawSeconds) return;
  last_ = now;
  std::fprintf(stderr, "\r\033[2K%s", text.c_str());
  std::fflush(stderr);
  dirty_ = true;
}

void ProgressLine::finish() {
  if (terminal_ && dirty_) std::fprintf(stderr, "\n");
  dirty_ = false;
}

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }
}  // namespace

const std::atomic<bool>& stop_on_signals() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  return g_stop;
}

}  // namespace fedmesh::cli
