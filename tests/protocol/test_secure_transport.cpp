// Loopback integration test: a real sink process and real source processes
// (tests/protocol/transport_peer.cpp) over CurveZMQ. A site not on the
// roster cannot connect; a forged signature, a replayed update, NaN, a wrong
// shape, an impostor sender and a message ten times the size limit are each
// refused for the right reason, while the honest sites' updates in the same
// run are all accepted bit for bit; an interrupted transfer resumes; and the
// replay window stays closed across a restart.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>

#include "crypto/keys.h"
#include "crypto/roster.h"
#include "tests/support/process.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

std::string peer_binary() {
  const char* path = std::getenv("FEDMESH_TRANSPORT_PEER");
  return path != nullptr ? path : "tests/transport_peer";
}

class SecureTransport : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fedmesh-transport-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    auto admin = fedmesh::crypto::generate_site_keys("admin");
    ASSERT_TRUE(admin.is_ok());
    ASSERT_TRUE(fedmesh::crypto::write_site_keys(*admin, dir_ / "keys").is_ok());
    fedmesh::crypto::Roster roster;
    roster.federation = "fed-test";
    roster.admin_public = admin->identity.sign_public;
    for (const char* name : {"aggregator", "site-a", "site-b", "stranger"}) {
      auto keys = fedmesh::crypto::generate_site_keys(name);
      ASSERT_TRUE(keys.is_ok());
      ASSERT_TRUE(fedmesh::crypto::write_site_keys(*keys, dir_ / "keys").is_ok());
      if (std::string(name) == "stranger") continue;  // has keys, is not on the roster
      const auto role = std::string(name) == "aggregator" ? fedmesh::crypto::Role::kAggregator
                                                          : fedmesh::crypto::Role::kSite;
      roster.sites.push_back({keys->identity, role, ""});
    }
    ASSERT_TRUE(fedmesh::crypto::sign_roster(roster, *admin).is_ok());
    ASSERT_TRUE(fedmesh::crypto::write_roster(roster, dir_ / "roster.toml").is_ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::string> common(const std::string& role, const std::string& key) const {
    return {peer_binary(), role, "--roster", (dir_ / "roster.toml").string(), "--admin-public",
            (dir_ / "keys" / "admin.pub").string(), "--key", (dir_ / "keys" / (key + ".key")).string()};
  }

  std::unique_ptr<fedmesh::testing::ChildProcess> start_sink(std::string& endpoint) {
    auto args = common("sink", "aggregator");
    args.insert(args.end(), {"--replay-file", (dir_ / "replay.txt").string()});
    auto sink = std::make_unique<fedmesh::testing::ChildProcess>(args);
    const auto line = sink->read_line(30s);
    EXPECT_TRUE(line.has_value()) << "sink printed nothing";
    if (!line) return sink;
    const json listening = json::parse(*line);
    EXPECT_EQ(listening["event"], "listening") << *line;
    EXPECT_EQ(listening["self_test"], "passed");
    endpoint = listening.value("endpoint", "");
    return sink;
  }

  // Runs one source to completion; returns its last JSON line and exit code.
  std::pair<json, int> source(const std::string& key, const std::string& endpoint, const std::string& attack,
                              uint64_t sequence, std::vector<std::string> extra = {}) {
    auto args = common("source", key);
    args.insert(args.end(), {"--connect", endpoint, "--attack", attack, "--sequence", std::to_string(sequence)});
    args.insert(args.end(), extra.begin(), extra.end());
    fedmesh::testing::ChildProcess process(args);
    const auto lines = process.read_all(60s);
    const int code = process.wait();
    if (lines.empty()) return {json{{"event", "none"}}, code};
    return {json::parse(lines.back()), code};
  }

  // Reads the sink's lines until one with `event` (skipping others).
  json sink_event(fedmesh::testing::ChildProcess& sink, const std::string& event) {
    while (auto line = sink.read_line(30s)) {
      const json parsed = json::parse(*line);
      if (parsed["event"] == event) return parsed;
    }
    return json{{"event", "timeout waiting for " + event}};
  }

  fs::path dir_;
};

TEST_F(SecureTransport, HostileMessagesAreRefusedWhileHonestSitesAreServed) {
  std::string endpoint;
  auto sink = start_sink(endpoint);
  ASSERT_FALSE(endpoint.empty());

  // Not on the roster: the CURVE handshake is refused by the ZAP handler.
  const auto [stranger, stranger_code] = source("stranger", endpoint, "honest", 1);
  EXPECT_EQ(stranger_code, 3) << stranger.dump();
  EXPECT_EQ(stranger["event"], "refused") << stranger.dump();

  // Two honest sites: accepted, and the sink decoded exactly what was sent.
  for (const char* site : {"site-a", "site-b"}) {
    const auto [result, code] = source(site, endpoint, "honest", 1);
    ASSERT_EQ(code, 0) << result.dump();
    ASSERT_EQ(result["outcome"], "accepted") << result.dump();
    const json accepted = sink_event(*sink, "accepted");
    EXPECT_EQ(accepted["sender"], site);
    EXPECT_EQ(accepted["sum"].get<double>(), result["sum"].get<double>());
  }

  const std::map<std::string, std::pair<uint64_t, std::string>> attacks = {
      {"forged", {2, "bad-signature"}},   {"nan", {3, "non-finite"}},
      {"shape", {4, "wrong-shape"}},      {"oversize", {0, "too-large"}},  {"impostor", {5, "unauthenticated"}},
  };
  for (const auto& [attack, expected] : attacks) {
    const auto [result, code] = source("site-a", endpoint, attack, expected.first);
    EXPECT_EQ(code, 0) << attack << ": " << result.dump();
    EXPECT_EQ(result["outcome"], "rejected") << attack << ": " << result.dump();
    EXPECT_EQ(result["code"], expected.second) << attack << ": " << result.dump();
    const json rejected = sink_event(*sink, "rejected");
    EXPECT_EQ(rejected["code"], expected.second) << attack << ": " << rejected.dump();
    EXPECT_FALSE(rejected.value("reason", "").empty());
  }

  // An interrupted transfer resumes from the first chunk the sink lacks.
  {
    const std::vector<std::string> small_chunks = {"--chunk-bytes", "1024", "--rows", "16"};
    auto interrupted_args = small_chunks;
    interrupted_args.insert(interrupted_args.end(), {"--stop-after-chunks", "1"});
    const auto [first, first_code] = source("site-a", endpoint, "honest", 6, interrupted_args);
    ASSERT_EQ(first_code, 0) << first.dump();
    EXPECT_EQ(first["outcome"], "abandoned") << first.dump();
    ASSERT_GT(first["chunks"].get<int>(), 1);
    const auto [second, second_code] = source("site-a", endpoint, "honest", 6, small_chunks);
    ASSERT_EQ(second_code, 0) << second.dump();
    EXPECT_EQ(second["outcome"], "accepted") << second.dump();
    EXPECT_EQ(second["started_at_chunk"], 1) << second.dump();
    EXPECT_EQ(second["chunks_sent"].get<int>(), second["chunks"].get<int>() - 1);
    const json accepted = sink_event(*sink, "accepted");
    EXPECT_EQ(accepted["sequence"], 6);
    EXPECT_EQ(accepted["sum"].get<double>(), second["sum"].get<double>());
  }

  // A replay of an older update is refused. The newest one sent again (as a
  // sender that missed its final Ack does) gets its Ack again and is not
  // taken twice (the summary counts it once).
  {
    const auto [old, old_code] = source("site-a", endpoint, "replay", 1);
    EXPECT_EQ(old_code, 0) << old.dump();
    EXPECT_EQ(old["outcome"], "rejected") << old.dump();
    EXPECT_EQ(old["code"], "replayed") << old.dump();
    const json rejected = sink_event(*sink, "rejected");
    EXPECT_EQ(rejected["code"], "replayed") << rejected.dump();
    const auto [again, again_code] =
        source("site-a", endpoint, "replay", 6, {"--chunk-bytes", "1024", "--rows", "16"});
    EXPECT_EQ(again_code, 0) << again.dump();
    EXPECT_EQ(again["outcome"], "accepted") << again.dump();
  }

  // Still serving after all of that.
  const auto [last, last_code] = source("site-b", endpoint, "honest", 2);
  EXPECT_EQ(last["outcome"], "accepted") << last.dump();

  sink->signal(SIGTERM);
  const json summary = sink_event(*sink, "summary");
  EXPECT_EQ(sink->wait(), 0);
  EXPECT_EQ(summary["accepted"], 4) << summary.dump();
  for (const auto& [attack, expected] : attacks) {
    EXPECT_EQ(summary["rejected"].value(expected.second, 0), 1) << expected.second << " in " << summary.dump();
  }
  EXPECT_EQ(summary["rejected"].value("replayed", 0), 1) << summary.dump();
  EXPECT_GE(summary["zap_denied"].get<int>(), 1) << summary.dump();
  EXPECT_EQ(summary["discarded_in_flight"], 0) << summary.dump();
}

TEST_F(SecureTransport, ReplayWindowStaysClosedAcrossARestart) {
  std::string endpoint;
  {
    auto sink = start_sink(endpoint);
    ASSERT_FALSE(endpoint.empty());
    const auto [result, code] = source("site-a", endpoint, "honest", 7);
    ASSERT_EQ(result["outcome"], "accepted") << result.dump();
    sink->signal(SIGTERM);
    EXPECT_EQ(sink->wait(), 0);
  }
  auto sink = start_sink(endpoint);
  ASSERT_FALSE(endpoint.empty());
  const auto [replayed, code] = source("site-a", endpoint, "replay", 7);
  EXPECT_EQ(replayed["outcome"], "rejected") << replayed.dump();
  EXPECT_EQ(replayed["code"], "replayed") << replayed.dump();
  const auto [fresh, fresh_code] = source("site-a", endpoint, "honest", 8);
  EXPECT_EQ(fresh["outcome"], "accepted") << fresh.dump();
}

}  // namespace
