// Runs the fedmesh binary under test (FEDMESH_BINARY) to the end and keeps
// what it printed: every line, the JSON events, the last one, the exit code.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/process.h"

namespace fedmesh::testing {

struct FedmeshOutput {
  int exit_code = -1;
  nlohmann::json last;  // the last JSON line
  std::vector<nlohmann::json> events;
  std::string text;     // everything printed on stdout
};

inline std::string fedmesh_under_test() {
  const char* path = std::getenv("FEDMESH_BINARY");
  return path ? path : "fedmesh";
}

inline FedmeshOutput run_fedmesh(std::vector<std::string> args,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(300)) {
  args.insert(args.begin(), fedmesh_under_test());
  ChildProcess child(args);
  FedmeshOutput out;
  for (const std::string& line : child.read_all(timeout)) {
    out.text += line + "\n";
    nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
    if (!e.is_object()) continue;
    out.events.push_back(e);
    out.last = e;
  }
  out.exit_code = child.wait();
  return out;
}

// A command line of the binary under test (arguments as the shell reads
// them) run to the end: what it printed, stdout and, unless left out, stderr.
struct CommandRun {
  int exit_code = -1;
  std::string output;
};

inline CommandRun run_command(const std::string& arguments, bool with_stderr = true) {
  CommandRun result;
  const std::string command = fedmesh_under_test() + " " + arguments + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

}  // namespace fedmesh::testing
