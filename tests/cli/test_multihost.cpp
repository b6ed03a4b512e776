// A federation across hosts: the aggregator and four sites each in its own
// Linux network namespace with its own address, joined by veth pairs to a
// bridge in a fifth namespace (a switch), started from the kits that
// `fedmesh provision` makes (their start.sh, their configs; only the data
// limits and the round settings are made small for the test machine). No
// process shares a loopback with another: every byte crosses a veth link.
// One run checks, in order:
//   - the five hosts run a federation (4 updates a round over CurveZMQ);
//   - one site's link is taken down mid-round: the rounds close at their
//     deadline without it and the federation goes on with three sites;
//   - the link comes back: the site rejoins by itself (a later round has
//     four updates again, and one of them is its);
//   - the run finishes with the global model at the target accuracy and
//     every site ending with it;
//   - nothing was lost (../shared/DESIGN.md): no update accepted twice,
//     every accepted update applied in exactly one committed round, one model
//     per version and consecutive versions, and every store (the aggregator's
//     and each site's) passes `fedmesh checkpoint verify` (integrity check,
//     hash chain, the newest checkpoint loads).
// It needs root (network namespaces) and iproute2; it skips, saying so,
// where either is missing or namespaces cannot be made.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/checkpoint_store.h"
#include "support/cluster.h"
#include "support/fedmesh_run.h"
#include "support/process.h"
#include "support/text_files.h"

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::run_fedmesh;
using fedmesh::testing::set_toml_option;
using fedmesh::testing::spit;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

constexpr int kSites = 4;
constexpr int kRounds = 60;  // rounds take a fraction of a second: enough to outlast a TCP retransmission backoff
constexpr double kTargetAccuracy = 0.75;
constexpr const char* kSubnet = "10.213.0.";  // private to the test's namespaces

// Runs a command to its end; its exit code (-1 when it could not start).
int run(const std::vector<std::string>& argv, std::string* output = nullptr) {
  std::vector<std::string> full = {"/usr/bin/env"};
  full.insert(full.end(), argv.begin(), argv.end());
  ChildProcess child(full);
  if (!child.started()) return -1;
  std::string text;
  for (const std::string& line : child.read_all(30s)) text += line + "\n";
  if (output) *output = text;
  return child.wait();
}

// Five hosts: "agg" and "s0".."s3", each a namespace with eth0 at its own
// address, cabled to the bridge of the "hub" namespace.
class Hosts {
 public:
  Hosts() : prefix_("fm" + std::to_string(::getpid()) + "-") {}
  ~Hosts() {
    for (const std::string& ns : made_) run({"ip", "netns", "delete", ns});
  }

  // Makes the hub and the hosts; the reason when it cannot.
  std::optional<std::string> make(const std::vector<std::string>& hosts) {
    std::string out;
    if (run({"ip", "netns", "add", ns("hub")}, &out) != 0) return "cannot make a network namespace: " + out;
    made_.push_back(ns("hub"));
    // Some sandboxes make namespaces but cannot enter them (ip netns exec
    // remounts /sys): that is a machine without hosts to test on, not a failure.
    if (run({"ip", "netns", "exec", ns("hub"), "/bin/true"}, &out) != 0) return "cannot run a process in a network namespace: " + out;
    if (!ip({"-n", ns("hub"), "link", "add", "br0", "type", "bridge"}, out) ||
        !ip({"-n", ns("hub"), "link", "set", "br0", "up"}, out)) {
      return "cannot make the bridge: " + out;
    }
    for (size_t i = 0; i < hosts.size(); ++i) {
      const std::string host = ns(hosts[i]), port = "p" + std::to_string(i);
      if (run({"ip", "netns", "add", host}, &out) != 0) return "cannot make namespace " + host + ": " + out;
      made_.push_back(host);
      addresses_[hosts[i]] = kSubnet + std::to_string(i + 1);
      if (!ip({"-n", ns("hub"), "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host}, out) ||
          !ip({"-n", ns("hub"), "link", "set", port, "master", "br0"}, out) ||
          !ip({"-n", ns("hub"), "link", "set", port, "up"}, out) ||
          !ip({"-n", host, "addr", "add", addresses_[hosts[i]] + "/24", "dev", "eth0"}, out) ||
          !ip({"-n", host, "link", "set", "eth0", "up"}, out) || !ip({"-n", host, "link", "set", "lo", "up"}, out)) {
        return "cannot cable host " + hosts[i] + ": " + out;
      }
    }
    return std::nullopt;
  }

  std::string ns(const std::string& host) const { return prefix_ + host; }
  std::string address(const std::string& host) const { return addresses_.at(host); }
  bool link(const std::string& host, bool up) {
    std::string out;
    const bool ok = ip({"-n", ns(host), "link", "set", "eth0", up ? "up" : "down"}, out);
    EXPECT_TRUE(ok) << out;
    return ok;
  }

 private:
  static bool ip(std::vector<std::string> args, std::string& out) {
    args.insert(args.begin(), "ip");
    return run(args, &out) == 0;
  }
  std::string prefix_;
  std::vector<std::string> made_;
  std::map<std::string, std::string> addresses_;
};

class MultiHost : public ::testing::Test {
 protected:
  void SetUp() override {
    if (fedmesh::testing::fedmesh_binary().empty()) GTEST_SKIP() << "FEDMESH_BINARY is set by meson test";
    if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root; run as root to test across hosts";
    if (run({"ip", "-V"}) != 0) GTEST_SKIP() << "iproute2's `ip` is not installed (deploy/setup.sh installs it)";
    std::vector<std::string> names = {"agg"};
    for (int k = 0; k < kSites; ++k) names.push_back("s" + std::to_string(k));
    if (std::optional<std::string> why = hosts_.make(names)) GTEST_SKIP() << "no network namespaces here: " << *why;
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-multihost-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (HasFailure()) {
      std::printf("the aggregator's events:\n");
      for (const json& e : events_) {
        const std::string kind = e.value("event", "");
        if (kind == "round" || kind == "update" || kind == "rejected" || kind == "finished" || kind == "warning") {
          std::printf("  %s\n", e.dump().substr(0, 300).c_str());
        }
      }
    }
    processes_.clear();  // SIGKILLs what still runs, before the namespaces go
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // A kit's start.sh inside its host's namespace.
  std::unique_ptr<ChildProcess> start(const std::string& host, const std::string& kit) {
    return std::make_unique<ChildProcess>(std::vector<std::string>{
        "/usr/bin/env", "ip", "netns", "exec", hosts_.ns(host), "/bin/sh", (dir_ / "kits" / kit / "start.sh").string(),
        "--json"});
  }

  Hosts hosts_;
  fs::path dir_;
  std::vector<std::unique_ptr<ChildProcess>> processes_;
  std::vector<json> events_;  // the aggregator's, printed when the test fails
};

std::string site_name(int k) { return "site-" + std::to_string(k); }

TEST_F(MultiHost, FederationAcrossNamespacesSurvivesALinkDownAndLosesNothing) {
  // Provision: the sites dial the aggregator's host address.
  std::string sites;
  for (int k = 0; k < kSites; ++k) sites += (k ? ", \"" : "\"") + site_name(k) + "\"";
  spit(dir_ / "federation.toml", "name = \"hospitals\"\naggregator = \"tcp://" + hosts_.address("agg") +
                                     ":7400\"\nrounds = " + std::to_string(kRounds) +
                                     "\nlocal_steps = 20\nsites = [" + sites + "]\n");
  const fedmesh::testing::FedmeshOutput made =
      run_fedmesh({"provision", "--federation", (dir_ / "federation.toml").string(), "--out", (dir_ / "kits").string(),
                   "--json"});
  ASSERT_EQ(made.exit_code, 0) << made.text;
  // Small for the test machine; three sites may close a round at its
  // deadline, so the federation goes on while one is cut off.
  const fs::path agg = dir_ / "kits" / "aggregator" / "agg.toml";
  set_toml_option(agg, "min_sites", "3");
  set_toml_option(agg, "min_updates", "3");
  set_toml_option(agg, "deadline_seconds", "6");
  set_toml_option(agg, "validation_limit", "1000");
  set_toml_option(agg, "linger_seconds", "10");
  for (int k = 0; k < kSites; ++k) set_toml_option(dir_ / "kits" / site_name(k) / "site.toml", "data.train_limit", "2000");
  ::setenv("FEDMESH", fedmesh::testing::fedmesh_binary().c_str(), 1);

  std::vector<json>& events = events_;
  processes_.push_back(start("agg", "aggregator"));
  ChildProcess& aggregator = *processes_.back();
  const std::optional<json> listening =
      wait_for(aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s);
  ASSERT_TRUE(listening) << "the aggregator did not start in its namespace";
  for (int k = 0; k < kSites; ++k) processes_.push_back(start("s" + std::to_string(k), site_name(k)));
  const auto round_with = [](size_t updates) {
    return [updates](const json& e) { return e.value("event", "") == "round" && e.value("updates", size_t{0}) == updates; };
  };
  ASSERT_TRUE(wait_for(aggregator, events, round_with(kSites), 120s)) << "the four hosts never finished a round together";

  // site-2's link goes down in the middle of a round.
  ASSERT_TRUE(wait_for(aggregator, events, [](const json& e) { return e.value("event", "") == "round_open"; }, 60s));
  ASSERT_TRUE(hosts_.link("s2", false));
  const size_t cut = events.size();
  std::optional<json> without = wait_for(aggregator, events, round_with(kSites - 1), 60s);
  ASSERT_TRUE(without) << "the rounds did not go on without the cut-off site";
  EXPECT_TRUE((*without)["closed_by_deadline"].get<bool>()) << without->dump();
  ASSERT_TRUE(wait_for(aggregator, events, round_with(kSites - 1), 60s)) << "a second round without site-2";
  for (size_t i = cut; i < events.size(); ++i) {
    if (events[i].value("event", "") == "update" && events[i].value("accepted", false)) {
      EXPECT_NE(events[i].value("site", ""), site_name(2)) << "an update crossed a link that is down";
    }
  }

  // The link comes back: site-2 rejoins by itself.
  ASSERT_TRUE(hosts_.link("s2", true));
  const size_t back = events.size();
  const auto link_up = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_for(aggregator, events, round_with(kSites), 120s)) << "site-2 did not rejoin after its link came back";
  std::printf("multi-host: site-2 counted again %.1f s after its link came back\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - link_up).count());
  bool site2_counted = false;
  for (size_t i = back; i < events.size(); ++i) {
    site2_counted |= events[i].value("event", "") == "update" && events[i].value("accepted", false) &&
                     events[i].value("site", "") == site_name(2);
  }
  EXPECT_TRUE(site2_counted) << "a round had four updates again, but none of them was site-2's";

  // The run finishes at the target accuracy and every site ends with it.
  const std::optional<json> finished =
      wait_for(aggregator, events, [](const json& e) { return e.value("event", "") == "finished"; }, 300s);
  ASSERT_TRUE(finished) << "the federation did not finish";
  EXPECT_EQ((*finished)["version"], kRounds);
  double accuracy = 0.0;
  for (const json& e : events) {
    if (e.value("event", "") == "round" && e.contains("test_accuracy")) accuracy = e["test_accuracy"].get<double>();
  }
  EXPECT_GE(accuracy, kTargetAccuracy) << "the global model's test accuracy after " << kRounds << " rounds";
  std::printf("multi-host: final test accuracy %.4f after %d rounds\n", accuracy, kRounds);
  for (int k = 0; k < kSites; ++k) {
    EXPECT_EQ(processes_[static_cast<size_t>(k) + 1]->wait(), 0) << site_name(k) << " did not end cleanly";
  }
  EXPECT_EQ(aggregator.wait(), 0);

  // Nothing lost. Every accepted update is accepted once, and applied in
  // exactly one committed round (the store's update ids are unique).
  auto store = fedmesh::store::CheckpointStore::open_existing((dir_ / "kits" / "aggregator" / "aggregator.db").string());
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  std::set<std::string> accepted;
  std::map<int64_t, std::string> model_of_version;
  for (const json& e : events) {
    if (e.value("event", "") == "update" && e.value("accepted", false)) {
      const std::string id = e["id"].get<std::string>();
      EXPECT_TRUE(accepted.insert(id).second) << "update " << id << " was accepted twice";
      const std::vector<uint8_t> bytes(id.begin(), id.end());
      auto applied = store->applied_round(bytes);
      ASSERT_TRUE(applied.is_ok()) << applied.status().to_string();
      EXPECT_TRUE(applied->has_value()) << "accepted update " << id << " is in no committed round";
    }
    if (e.value("event", "") == "round") {
      const int64_t version = e["version"].get<int64_t>();
      const auto [at, fresh] = model_of_version.emplace(version, e["model_hash"].get<std::string>());
      EXPECT_TRUE(fresh && at->second == e["model_hash"]) << "two models for version " << version;
    }
  }
  EXPECT_FALSE(accepted.empty());
  ASSERT_EQ(model_of_version.size(), static_cast<size_t>(kRounds)) << "versions were skipped or repeated";
  EXPECT_EQ(model_of_version.begin()->first, 1);
  EXPECT_EQ(model_of_version.rbegin()->first, kRounds);
  // Every store opens, passes its integrity check, and its chain verifies.
  std::vector<fs::path> stores = {dir_ / "kits" / "aggregator" / "aggregator.db"};
  for (int k = 0; k < kSites; ++k) stores.push_back(dir_ / "kits" / site_name(k) / (site_name(k) + ".db"));
  for (const fs::path& db : stores) {
    const fedmesh::testing::FedmeshOutput verified = run_fedmesh({"checkpoint", "verify", db.string()});
    EXPECT_EQ(verified.exit_code, 0) << db << ": " << verified.text;
  }
}

}  // namespace
