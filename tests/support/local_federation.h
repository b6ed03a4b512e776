// A federation of real processes on loopback for integration tests: keys, a
// signed roster and configs made by deploy/local_federation.sh in a fresh
// temporary directory (removed at the end), on free ports; `fedmesh
// aggregator` and `fedmesh node` processes started from them.
#pragma once

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/cluster.h"
#include "support/process.h"

namespace fedmesh::testing {

class LocalFederation {
 public:
  // `extra`: deploy/local_federation.sh flags (--rounds, --agg 'KEY = VALUE',
  // ...); `name` keeps two federations of one test apart.
  LocalFederation(int sites, const std::vector<std::string>& extra, const std::string& name = "") {
    using namespace std::chrono_literals;
    dir_ = std::filesystem::path(::testing::TempDir()) / ("fedmesh-federation-" + name + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    port_ = free_ports(2 + sites);  // the aggregator's, its metrics, then each site's metrics
    std::vector<std::string> argv = {"/bin/bash", local_federation_script(), "--fedmesh", fedmesh_binary(),
                                     "--dir", dir_.string(), "--sites", std::to_string(sites),
                                     "--port", std::to_string(port_), "--metrics-port", std::to_string(port_ + 1)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ChildProcess make(argv);
    make.read_all(60s);
    made_ = port_ > 0 && make.wait() == 0;
  }
  ~LocalFederation() { std::filesystem::remove_all(dir_); }
  LocalFederation(const LocalFederation&) = delete;
  LocalFederation& operator=(const LocalFederation&) = delete;

  bool made() const { return made_; }
  const std::filesystem::path& dir() const { return dir_; }
  std::filesystem::path aggregator_config() const { return dir_ / "agg.toml"; }
  // The aggregator's /metrics, /status and /dashboard address.
  std::string metrics() const { return "127.0.0.1:" + std::to_string(port_ + 1); }

  std::unique_ptr<ChildProcess> aggregator(const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> argv = {fedmesh_binary(), "aggregator", "--config", aggregator_config().string(), "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv);
  }
  std::unique_ptr<ChildProcess> site(int k, const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> argv = {fedmesh_binary(), "node", "--config",
                                     (dir_ / ("site-" + std::to_string(k) + ".toml")).string(), "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv);
  }

 private:
  std::filesystem::path dir_;
  int port_ = -1;
  bool made_ = false;
};

}  // namespace fedmesh::testing
