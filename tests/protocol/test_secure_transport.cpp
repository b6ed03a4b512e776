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
#include <limits>
#include <span>
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

  std::unique_ptr<fedmesh::testing::ChildProcess> start_sink(std::string& endpoint,
                                                             std::vector<std::string> extra = {}) {
    auto args = common("sink", "aggregator");
    args.insert(args.end(), {"--replay-file", (dir_ / "replay.txt").string()});
    args.insert(args.end(), extra.begin(), extra.end());
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

// What a member with a valid site key can still be refused for: a Hello
// that names another site, role or federation (or a 100 KiB name), a
// sequence far beyond the clock, a sample count over the cap. Each refusal
// names its reason, and the sink keeps serving the honest update after them.
TEST_F(SecureTransport, AnInsidersOutOfBoundsMessagesAreRefusedByName) {
  std::string endpoint;
  auto sink = start_sink(endpoint);
  ASSERT_FALSE(endpoint.empty());
  auto site_a = fedmesh::crypto::read_public_identity(dir_ / "keys" / "site-a.pub");
  ASSERT_TRUE(site_a.is_ok());
  const std::string box_key_hex =
      fedmesh::crypto::to_hex(std::span<const uint8_t>(site_a->box_public.data(), site_a->box_public.size()));

  struct Case {
    const char* attack;
    const char* code;
    const char* reason;  // a phrase the refusal must contain
  };
  const Case cases[] = {
      {"hello-long-name", "malformed", "siteName is 102400 bytes"},
      {"hello-role", "wrong-role", "this endpoint takes sites"},
      {"hello-federation", "wrong-federation", "another-federation"},
      {"ahead", "sequence-ahead", "ahead of this receiver's clock"},
      {"samples", "too-many-samples", "1000001 samples"},
  };
  for (const Case& c : cases) {
    const auto [result, code] = source("site-a", endpoint, c.attack, 3);
    EXPECT_EQ(code, 0) << c.attack << ": " << result.dump();
    EXPECT_EQ(result["outcome"], "rejected") << c.attack << ": " << result.dump();
    EXPECT_EQ(result["code"], c.code) << c.attack << ": " << result.dump();
    EXPECT_NE(result.value("reason", "").find(c.reason), std::string::npos) << c.attack << ": " << result.dump();
    const json rejected = sink_event(*sink, "rejected");
    EXPECT_EQ(rejected["code"], c.code) << c.attack << ": " << rejected.dump();
    // The transport says which key sent it, not only which name.
    EXPECT_EQ(rejected["peer_key"], box_key_hex) << rejected.dump();
  }
  const auto [honest, honest_code] = source("site-a", endpoint, "honest", 3);
  EXPECT_EQ(honest_code, 0) << honest.dump();
  EXPECT_EQ(honest["outcome"], "accepted") << honest.dump();
  const json accepted = sink_event(*sink, "accepted");
  EXPECT_EQ(accepted["sequence"], 3) << accepted.dump();
  EXPECT_EQ(accepted["replay_key"],
            fedmesh::crypto::to_hex(std::span<const uint8_t>(site_a->sign_public.data(), site_a->sign_public.size())));

  sink->signal(SIGTERM);
  const json summary = sink_event(*sink, "summary");
  EXPECT_EQ(sink->wait(), 0);
  EXPECT_EQ(summary["accepted"], 1) << summary.dump();
  for (const Case& c : cases) {
    EXPECT_EQ(summary["rejected"].value(c.code, 0), 1) << c.code << " in " << summary.dump();
  }
}

// A stolen key gets sequence 2^64 - 1 accepted (the sink here runs without
// the clock bound, the case the bound exists for), and the site's own next
// update is refused as replayed. The admin re-keys the site under the same
// name; after a restart on the new roster (the same replay table) the site's
// new key is taken with an ordinary sequence, and the old key cannot connect.
TEST_F(SecureTransport, AReKeyedSiteIsServedAfterItsOldKeySentTheLargestSequence) {
  std::string endpoint;
  {
    auto sink = start_sink(endpoint, {"--no-sequence-bound"});
    ASSERT_FALSE(endpoint.empty());
    const auto [stolen, code] = source("site-a", endpoint, "honest", std::numeric_limits<uint64_t>::max());
    ASSERT_EQ(code, 0) << stolen.dump();
    EXPECT_EQ(stolen["outcome"], "accepted") << stolen.dump();
    const auto [locked, locked_code] = source("site-a", endpoint, "honest", 10);
    EXPECT_EQ(locked["outcome"], "rejected") << locked.dump();
    EXPECT_EQ(locked["code"], "replayed") << locked.dump();
    sink->signal(SIGTERM);
    EXPECT_EQ(sink->wait(), 0);
  }
  // Re-key: the old key moves aside, a new one under the same name goes on
  // the roster, which the admin signs again.
  fs::rename(dir_ / "keys" / "site-a.key", dir_ / "keys" / "old-site-a.key");
  fs::rename(dir_ / "keys" / "site-a.pub", dir_ / "keys" / "old-site-a.pub");
  auto fresh = fedmesh::crypto::generate_site_keys("site-a");
  ASSERT_TRUE(fresh.is_ok());
  ASSERT_TRUE(fedmesh::crypto::write_site_keys(*fresh, dir_ / "keys").is_ok());
  auto roster = fedmesh::crypto::read_roster(dir_ / "roster.toml");
  ASSERT_TRUE(roster.is_ok());
  for (auto& entry : roster->sites) {
    if (entry.identity.name == "site-a") entry.identity = fresh->identity;
  }
  auto admin = fedmesh::crypto::read_site_keys(dir_ / "keys" / "admin.key");
  ASSERT_TRUE(admin.is_ok());
  ASSERT_TRUE(fedmesh::crypto::sign_roster(*roster, *admin).is_ok());
  ASSERT_TRUE(fedmesh::crypto::write_roster(*roster, dir_ / "roster.toml").is_ok());

  auto sink = start_sink(endpoint);
  ASSERT_FALSE(endpoint.empty());
  const auto [rekeyed, code] = source("site-a", endpoint, "honest", 10);
  EXPECT_EQ(code, 0) << rekeyed.dump();
  EXPECT_EQ(rekeyed["outcome"], "accepted") << rekeyed.dump();
  const json accepted = sink_event(*sink, "accepted");
  EXPECT_EQ(accepted["sender"], "site-a");
  EXPECT_EQ(accepted["sequence"], 10);
  const auto [old_key, old_code] = source("old-site-a", endpoint, "honest", 11);
  EXPECT_EQ(old_code, 3) << old_key.dump();
  EXPECT_EQ(old_key["event"], "refused") << old_key.dump();
  sink->signal(SIGTERM);
  EXPECT_EQ(sink->wait(), 0);
}

}  // namespace
