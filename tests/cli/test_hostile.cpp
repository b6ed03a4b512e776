// Strangers against a real `fedmesh aggregator` with one site, on loopback
// (deploy/local_federation.sh):
//   - 1100 plain TCP connections to its ZeroMQ port that never begin a
//     handshake, with the aggregator started under the common soft limit of
//     1024 open files: it raises the limit to the hard one, so /healthz
//     answers all along, its site keeps closing rounds, and every stranger's
//     connection is dropped once the handshake interval is over;
//   - the same flood with the hard limit at 1024 too (nothing to raise): the
//     aggregator runs short of descriptors for a while but neither stops nor
//     loses its store; once the strangers are dropped it answers /healthz
//     and its site closes rounds again;
//   - slowloris on its HTTP endpoint: two connections dripping a header byte
//     every second, reconnecting when closed, while /healthz, /status and
//     /metrics are asked again and again: every answer within 1 s.
// Where this machine's own hard limit is too low to open 1100 connections,
// the flood is as large as it allows (and says so).

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/http_endpoint.h"
#include "support/cluster.h"
#include "support/local_federation.h"
#include "support/process.h"

namespace {

using fedmesh::testing::ChildProcess;
using fedmesh::testing::LocalFederation;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kStrangers = 1100;
constexpr int kCommonSoftLimit = 1024;

struct FileLimit {
  int64_t soft = -1;
  int64_t hard = -1;
};

// A process's "Max open files" from /proc (unlimited as INT64_MAX).
FileLimit file_limit_of(pid_t pid) {
  std::ifstream limits("/proc/" + std::to_string(pid) + "/limits");
  std::string line;
  while (std::getline(limits, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    std::istringstream fields(line.substr(std::string("Max open files").size()));
    std::string soft, hard;
    fields >> soft >> hard;
    const auto value = [](const std::string& text) { return text == "unlimited" ? INT64_MAX : std::stoll(text); };
    return {value(soft), value(hard)};
  }
  return {};
}

// This test process's soft limit raised to its hard one (it opens the flood).
int64_t raise_own_limit() {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);
  getrlimit(RLIMIT_NOFILE, &limit);
  return limit.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(limit.rlim_cur);
}

// `fedmesh aggregator` started by bash after `ulimit ARGS` (e.g. "-S -n 1024").
std::unique_ptr<ChildProcess> aggregator_under(const LocalFederation& federation, const std::string& ulimit) {
  return std::make_unique<ChildProcess>(std::vector<std::string>{
      "/bin/bash", "-c", "ulimit " + ulimit + " && exec \"$0\" \"$@\"", fedmesh::testing::fedmesh_binary(),
      "aggregator", "--config", federation.aggregator_config().string(), "--json"});
}

int port_of(const std::string& endpoint) { return std::stoi(endpoint.substr(endpoint.rfind(':') + 1)); }

// `count` TCP connections to 127.0.0.1:port that send nothing; those
// established within a few seconds are kept (the rest are closed).
class Strangers {
 public:
  Strangers(int port, int count) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::vector<int> pending;
    for (int i = 0; i < count; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0 || errno == EINPROGRESS) {
        pending.push_back(fd);
      } else {
        ::close(fd);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!pending.empty() && std::chrono::steady_clock::now() < deadline) {
      std::vector<pollfd> polled;
      for (const int fd : pending) polled.push_back({fd, POLLOUT, 0});
      ::poll(polled.data(), polled.size(), 200);
      std::vector<int> still;
      for (const pollfd& p : polled) {
        if (p.revents == 0) {
          still.push_back(p.fd);
          continue;
        }
        int error = 0;
        socklen_t size = sizeof error;
        ::getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &error, &size);
        if (error == 0) {
          fds_.push_back(p.fd);
        } else {
          ::close(p.fd);
        }
      }
      pending = std::move(still);
    }
    for (const int fd : pending) ::close(fd);
  }
  ~Strangers() {
    for (const int fd : fds_) ::close(fd);
  }
  Strangers(const Strangers&) = delete;
  Strangers& operator=(const Strangers&) = delete;

  int established() const { return static_cast<int>(fds_.size()); }
 private:
  std::vector<int> fds_;
};

// How many descriptors a process holds.
int open_descriptors(pid_t pid) {
  std::error_code error;
  int count = 0;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++count;
  }
  return count;
}

bool healthz_answers(const std::string& address, int timeout_seconds) {
  fedmesh::Result<fedmesh::HttpReply> reply = fedmesh::http_fetch(address, "/healthz", "", timeout_seconds);
  return reply.is_ok() && reply->status == 200 && reply->body == "ok\n";
}

bool is_round(const json& e) { return e.value("event", "") == "round"; }

// Reads whatever the aggregator printed in the next `period` (so that its
// output never fills the pipe), keeping the highest version a round reached.
void drain(ChildProcess& aggregator, std::vector<json>& events, int64_t& version, std::chrono::milliseconds period) {
  const auto until = std::chrono::steady_clock::now() + period;
  while (std::chrono::steady_clock::now() < until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    std::optional<std::string> line = aggregator.read_line(std::max(left, 1ms));
    if (!line) return;
    json event = json::parse(*line, nullptr, false);
    if (event.is_discarded()) continue;
    if (is_round(event)) version = std::max(version, event.value("version", int64_t{0}));
    events.push_back(std::move(event));
  }
}

std::string last_events(const std::vector<json>& events) {
  std::string text;
  for (size_t i = events.size() > 8 ? events.size() - 8 : 0; i < events.size(); ++i) text += events[i].dump() + "\n";
  return text;
}

struct FloodOutcome {
  bool healthz_all_along = true;  // every probe during the flood answered
  bool stayed_up = true;
};

// One site's federation, the aggregator under `ulimit`, flooded with
// strangers once its first round is in; checks what holds either way and
// returns what depends on the limit.
void flood_and_check(const std::string& ulimit, const std::string& name, FileLimit& aggregator_limit,
                     FloodOutcome& outcome, int& flood) {
  const int64_t own_limit = raise_own_limit();
  flood = static_cast<int>(std::min<int64_t>(kStrangers, own_limit - 128));
  if (flood < kStrangers) {
    std::printf("this process may open %lld files: the flood is %d connections, not %d\n",
                static_cast<long long>(own_limit), flood, kStrangers);
  }
  LocalFederation federation(1, {"--rounds", "1000", "--local-steps", "5", "--deadline", "30"}, name);
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  std::unique_ptr<ChildProcess> aggregator = aggregator_under(federation, ulimit);
  std::vector<json> events;
  std::optional<json> listening =
      wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s);
  ASSERT_TRUE(listening.has_value()) << "the aggregator did not start:\n" << last_events(events);
  aggregator_limit = file_limit_of(aggregator->pid());
  std::unique_ptr<ChildProcess> site = federation.site(0);
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return is_round(e) && e["version"] >= 1; }, 120s))
      << "no round closed before the flood:\n" << last_events(events);
  int64_t version = 0;
  for (const json& e : events) {
    if (is_round(e)) version = std::max(version, e.value("version", int64_t{0}));
  }
  const int64_t version_before = version;

  const int baseline = open_descriptors(aggregator->pid());
  Strangers strangers(port_of((*listening)["endpoint"].get<std::string>()), flood);
  std::printf("%d of %d stranger connections established\n", strangers.established(), flood);
  EXPECT_GE(strangers.established(), std::min(flood, kCommonSoftLimit - 64));
  // Ten seconds of flood: the handshake interval passes twice.
  int peak = baseline;
  const auto flood_ends = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < flood_ends) {
    peak = std::max(peak, open_descriptors(aggregator->pid()));
    if (!healthz_answers(federation.metrics(), 2)) outcome.healthz_all_along = false;
    drain(*aggregator, events, version, 500ms);
    if (aggregator->poll_exit().has_value()) {
      outcome.stayed_up = false;
      break;
    }
  }
  ASSERT_TRUE(outcome.stayed_up) << "the aggregator exited under the flood:\n" << last_events(events);
  std::printf("descriptors: %d before the flood, %d at its peak\n", baseline, peak);
  EXPECT_GT(peak, baseline + 100) << "the flood never reached the aggregator";
  // Every stranger is dropped (no handshake within the interval): the
  // aggregator's descriptors fall back while the connections stay open here.
  int now_open = peak;
  for (const auto give_up = std::chrono::steady_clock::now() + 40s; std::chrono::steady_clock::now() < give_up;) {
    now_open = open_descriptors(aggregator->pid());
    if (now_open <= baseline + 16) break;
    drain(*aggregator, events, version, 500ms);
  }
  EXPECT_LE(now_open, baseline + 16) << "stranger connections were kept past the handshake interval";
  // ... the endpoint answers, and the site closes rounds.
  bool answered = false;
  for (const auto give_up = std::chrono::steady_clock::now() + 30s;
       !answered && std::chrono::steady_clock::now() < give_up;) {
    answered = healthz_answers(federation.metrics(), 2);
    if (!answered) drain(*aggregator, events, version, 500ms);
  }
  EXPECT_TRUE(answered) << "/healthz does not answer after the flood";
  for (const auto give_up = std::chrono::steady_clock::now() + 90s;
       version < version_before + 2 && std::chrono::steady_clock::now() < give_up;) {
    drain(*aggregator, events, version, 500ms);
    ASSERT_FALSE(aggregator->poll_exit().has_value()) << "the aggregator exited:\n" << last_events(events);
  }
  EXPECT_GE(version, version_before + 2) << "the site closed no rounds during or after the flood:\n"
                                         << last_events(events);
  for (const json& e : events) {
    if (e.value("event", "") == "error") ADD_FAILURE() << "the aggregator reported an error: " << e.dump();
  }
}

TEST(Hostile, StrangersPastTheSoftFileLimitLeaveTheAggregatorServing) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  FileLimit limit;
  FloodOutcome outcome;
  int flood = 0;
  flood_and_check("-S -n " + std::to_string(kCommonSoftLimit), "soft", limit, outcome, flood);
  if (HasFatalFailure()) return;
  // Started under soft 1024, it took what the hard limit allows.
  EXPECT_EQ(limit.soft, limit.hard) << "the aggregator kept the soft limit it was started with";
  if (limit.soft >= flood + 256) {
    EXPECT_TRUE(outcome.healthz_all_along) << "/healthz failed to answer during the flood";
  } else {
    std::printf("the hard limit (%lld) leaves no room for the flood: /healthz during it is not checked\n",
                static_cast<long long>(limit.hard));
  }
}

TEST(Hostile, StrangersExhaustingEveryFileLeaveTheStoreAndTheAggregatorUp) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  FileLimit limit;
  FloodOutcome outcome;
  int flood = 0;
  flood_and_check("-n " + std::to_string(kCommonSoftLimit), "hard", limit, outcome, flood);
  if (HasFatalFailure()) return;
  EXPECT_EQ(limit.soft, kCommonSoftLimit);
  EXPECT_EQ(limit.hard, kCommonSoftLimit);
}

// A client that opens a connection, sends the start of a request head and
// then one byte a second, opening another when the endpoint closes it.
void drip_slowly(const std::string& address, const std::atomic<bool>& stop, std::atomic<int>& connections) {
  const int port = port_of(address);
  while (!stop) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      if (fd >= 0) ::close(fd);
      std::this_thread::sleep_for(100ms);
      continue;
    }
    ++connections;
    const std::string start = "GET /status HTTP/1.1\r\nHost: x\r\n";
    bool open = ::send(fd, start.data(), start.size(), MSG_NOSIGNAL) > 0;
    while (open && !stop) {
      for (int i = 0; i < 10 && !stop; ++i) std::this_thread::sleep_for(100ms);
      open = ::send(fd, "X", 1, MSG_NOSIGNAL) == 1;
      pollfd p{fd, POLLIN, 0};
      if (open && ::poll(&p, 1, 0) > 0) open = false;  // closed (or answered): start again
    }
    ::close(fd);
  }
}

TEST(Hostile, SlowlorisDoesNotSilenceTheHttpEndpoint) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  LocalFederation federation(1, {"--rounds", "1000"}, "slowloris");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  std::vector<json> events;
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s))
      << "the aggregator did not start:\n" << last_events(events);
  ASSERT_TRUE(healthz_answers(federation.metrics(), 5));

  std::atomic<bool> stop{false};
  std::atomic<int> connections{0};
  std::thread first(drip_slowly, federation.metrics(), std::cref(stop), std::ref(connections));
  std::thread second(drip_slowly, federation.metrics(), std::cref(stop), std::ref(connections));
  std::this_thread::sleep_for(500ms);  // both dripping before the first probe
  int probes = 0, answered = 0;
  int64_t version = 0;
  const auto until = std::chrono::steady_clock::now() + 8s;
  while (std::chrono::steady_clock::now() < until) {
    // One second to answer, each page in turn.
    const char* path = probes % 3 == 0 ? "/healthz" : probes % 3 == 1 ? "/status" : "/metrics";
    fedmesh::Result<fedmesh::HttpReply> reply = fedmesh::http_fetch(federation.metrics(), path, "", 1);
    ++probes;
    if (reply.is_ok() && reply->status == 200) {
      ++answered;
    } else {
      ADD_FAILURE() << path << " did not answer within 1 s under slowloris: "
                    << (reply.is_ok() ? std::to_string(reply->status) : reply.status().to_string());
    }
    drain(*aggregator, events, version, 250ms);
  }
  stop = true;
  first.join();
  second.join();
  EXPECT_EQ(answered, probes);
  EXPECT_GE(probes, 16);
  // Each dripping connection was closed at the head deadline and reopened.
  EXPECT_GE(connections.load(), 4) << "the dripping connections were never closed";
  EXPECT_FALSE(aggregator->poll_exit().has_value());
}

}  // namespace
