// A child process for integration tests: started with fork/exec, its stdout
// read line by line with a timeout, stopped with a signal. Real processes,
// real sockets; nothing mocked.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace fedmesh::testing {

class ChildProcess {
 public:
  explicit ChildProcess(const std::vector<std::string>& argv) {
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out[1]);
    stdout_ = out[0];
  }
  ~ChildProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      wait();
    }
    if (stdout_ >= 0) close(stdout_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // The next line of stdout, or nullopt at end of output or timeout.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (const auto end = buffer_.find('\n'); end != std::string::npos) {
        std::string line = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd fd{stdout_, POLLIN, 0};
      if (poll(&fd, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = read(stdout_, chunk, sizeof chunk);
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  // All remaining output until the process closes stdout (or timeout).
  std::vector<std::string> read_all(std::chrono::milliseconds timeout) {
    std::vector<std::string> lines;
    while (auto line = read_line(timeout)) lines.push_back(*line);
    return lines;
  }

  void signal(int number) { kill(pid_, number); }

  // The exit code if the process has ended (reaped), without waiting.
  std::optional<int> poll_exit() {
    if (exited_) return exit_code_;
    int status = 0;
    rusage usage{};
    if (wait4(pid_, &status, WNOHANG, &usage) != pid_) return std::nullopt;
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    peak_rss_kb_ = usage.ru_maxrss;
    return exit_code_;
  }

  // Exit code (128 + signal if killed).
  int wait() {
    if (exited_) return exit_code_;
    int status = 0;
    rusage usage{};
    wait4(pid_, &status, 0, &usage);
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    peak_rss_kb_ = usage.ru_maxrss;
    return exit_code_;
  }
  // The process's peak resident set in KiB once wait() or poll_exit() reaped
  // it (0 before).
  long peak_rss_kb() const { return peak_rss_kb_; }

 private:
  pid_t pid_ = -1;
  int stdout_ = -1;
  std::string buffer_;
  bool exited_ = false;
  int exit_code_ = -1;
  long peak_rss_kb_ = 0;
};

}  // namespace fedmesh::testing
