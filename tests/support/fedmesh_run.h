// Runs the fedmesh binary under test (FEDMESH_BINARY) to the end and keeps
// what it printed: every line, the JSON events, the last one, the exit code.
#pragma once

#include <chrono>
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

}  // namespace fedmesh::testing
