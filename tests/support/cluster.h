// Helpers for integration tests that start real fedmesh processes on
// loopback: the binary and scripts under test (from the environment meson
// sets), free ports, and reading a process's JSON events until one matches.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/process.h"

namespace fedmesh::testing {

inline std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}
inline std::string fedmesh_binary() { return env_or_empty("FEDMESH_BINARY"); }
inline std::string local_federation_script() { return env_or_empty("FEDMESH_LOCAL_FEDERATION"); }

inline bool port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return ok;
}

// A base port with `count` free ports after it (-1 if none found).
inline int free_ports(int count) {
  std::mt19937 rng(static_cast<unsigned>(::getpid()) ^ static_cast<unsigned>(std::time(nullptr)));
  for (int attempt = 0; attempt < 200; ++attempt) {
    // Below Linux's ephemeral range (32768..60999 by default): a port free
    // when checked could otherwise be taken by any outgoing connection (the
    // tests' own ZeroMQ clients among them) before the process binds it.
    const int base = 20000 + static_cast<int>(rng() % (32000 - 20000));
    bool all = true;
    for (int i = 0; i < count && all; ++i) all = port_free(base + i);
    if (all) return base;
  }
  return -1;
}

// Reads JSON events from a process until `match` accepts one (returned) or
// the time is up (nullopt). Every event read is appended to `seen`.
inline std::optional<nlohmann::json> wait_for(ChildProcess& process, std::vector<nlohmann::json>& seen,
                                              const std::function<bool(const nlohmann::json&)>& match,
                                              std::chrono::seconds timeout) {
  using namespace std::chrono_literals;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    std::optional<std::string> line = process.read_line(std::max(left, 1ms));
    if (!line) return std::nullopt;
    nlohmann::json event = nlohmann::json::parse(*line, nullptr, false);
    if (event.is_discarded()) continue;
    seen.push_back(event);
    if (match(event)) return event;
  }
  return std::nullopt;
}

}  // namespace fedmesh::testing
