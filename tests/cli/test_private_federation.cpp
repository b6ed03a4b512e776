// Private mode with real processes: `fedmesh aggregator` and six `fedmesh
// node` processes on loopback (keys and roster from
// deploy/local_federation.sh), privacy.mode = "private", threshold 4 of 6.
// The sites are killed with SIGKILL (a hidden test flag, --secure-exit-at,
// makes a site kill itself on reaching a phase, so the kill lands exactly
// there) and restarted from their stores after the round:
//   round 1 no kill; rounds 2-6 one site at advertise, share-keys,
//   masked-input, consistency, unmask; rounds 7-11 two sites at each phase;
//   round 12 three sites at masked-input (more than n - t: the session
//   aborts and a new session with new keys completes the round).
// For every round: the aggregate the aggregator reports (BLAKE2b of the sum
// in Z_2^32) equals the plain sum of exactly the survivors' fixed-point
// inputs (each site writes its own with another hidden flag), bit for bit;
// a site killed before sending its masked input is not in the sum and one
// killed after is. Afterwards, no 64-byte piece of any site's input appears
// in the aggregator's store or log (every update is a canary), the global
// model learned, and the sites exit when the federation ends.
// Then DP-FedAvg in private mode: the privacy ledger gets one entry per
// released round with a growing epsilon, and the target budget ends the
// federation early. And the refusals of incompatible settings.
#include <gtest/gtest.h>
#include <sodium.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "crypto/keys.h"
#include "store/checkpoint_store.h"
#include "support/cluster.h"
#include "support/fedmesh_run.h"
#include "support/process.h"

namespace fs = std::filesystem;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::free_ports;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

std::string binary() { return fedmesh::testing::fedmesh_binary(); }
std::string script() { return fedmesh::testing::local_federation_script(); }

class Federation {
 public:
  Federation(int sites, const std::vector<std::string>& extra, const std::string& name) {
    dir_ = fs::path(::testing::TempDir()) / ("fedmesh-private-" + name + std::to_string(::getpid()));
    fs::remove_all(dir_);
    port_ = free_ports(2 + sites);
    std::vector<std::string> argv = {"/bin/bash", script(), "--fedmesh", binary(), "--dir", dir_.string(),
                                     "--sites", std::to_string(sites), "--port", std::to_string(port_),
                                     "--metrics-port", std::to_string(port_ + 1)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ChildProcess make(argv);
    make.read_all(60s);
    made_ = port_ > 0 && make.wait() == 0;
  }
  ~Federation() { fs::remove_all(dir_); }
  bool made() const { return made_; }
  const fs::path& dir() const { return dir_; }
  std::unique_ptr<ChildProcess> aggregator() const {
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{binary(), "aggregator", "--config", (dir_ / "agg.toml").string(), "--json"});
  }
  std::unique_ptr<ChildProcess> site(int k, const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> argv = {binary(), "node", "--config",
                                     (dir_ / ("site-" + std::to_string(k) + ".toml")).string(), "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv);
  }

 private:
  fs::path dir_;
  int port_ = -1;
  bool made_ = false;
};

std::vector<std::string> private_settings(const std::string& phase_seconds) {
  return {"--agg", "privacy.mode = \"private\"", "--agg", "secure_aggregation.phase_seconds = " + phase_seconds,
          "--agg", "secure_aggregation.clip = 4.0", "--agg", "linger_seconds = 8", "--agg", "validation_limit = 2000",
          "--site", "privacy.mode = \"private\"", "--site", "give_up_seconds = 120", "--site", "data.train_limit = 6000"};
}

struct Kill {
  int round;
  std::string phase;
};

std::string schedule_flag(const std::deque<Kill>& kills) {
  std::string out;
  for (const Kill& k : kills) out += (out.empty() ? "" : ",") + std::to_string(k.round) + ":" + k.phase;
  return out;
}

std::vector<uint8_t> read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<uint32_t> read_words(const fs::path& file) {
  const std::vector<uint8_t> bytes = read_bytes(file);
  std::vector<uint32_t> words(bytes.size() / 4);
  std::memcpy(words.data(), bytes.data(), words.size() * 4);
  return words;
}

bool contains_bytes(const std::vector<uint8_t>& haystack, const uint8_t* needle, size_t n) {
  return haystack.size() >= n && std::search(haystack.begin(), haystack.end(), needle, needle + n) != haystack.end();
}

std::string sum_digest(const std::vector<uint32_t>& sum) {
  std::array<uint8_t, 32> digest{};
  crypto_generichash(digest.data(), digest.size(), reinterpret_cast<const uint8_t*>(sum.data()), sum.size() * 4,
                     nullptr, 0);
  return fedmesh::crypto::to_hex(digest);
}

bool before_masked_input_sent(const std::string& phase) {
  return phase == "advertise" || phase == "share-keys" || phase == "masked-input";
}

TEST(PrivateFederation, SecureSumIsExactWithSitesKilledAtEveryPhase) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  ASSERT_FALSE(script().empty()) << "FEDMESH_LOCAL_FEDERATION is not set";
  constexpr int kSites = 6, kRounds = 12;
  std::vector<std::string> extra = {"--rounds", std::to_string(kRounds), "--local-steps", "30", "--deadline", "120",
                                    "--agg", "site_timeout_seconds = 2.0"};
  for (const std::string& s : private_settings("2.5")) extra.push_back(s);
  Federation federation(kSites, extra, "kills");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  const fs::path dumps = federation.dir() / "dumps";
  fs::create_directories(dumps);

  // Per site, the kills in round order (never two rounds in a row, so a
  // restarted site is back for its next one).
  std::map<int, std::deque<Kill>> schedule = {
      {0, {{7, "advertise"}, {10, "consistency"}}},
      {1, {{2, "advertise"}, {7, "advertise"}, {11, "unmask"}}},
      {2, {{3, "share-keys"}, {8, "share-keys"}, {10, "consistency"}, {12, "masked-input"}}},
      {3, {{4, "masked-input"}, {8, "share-keys"}, {11, "unmask"}}},
      {4, {{5, "consistency"}, {9, "masked-input"}, {12, "masked-input"}}},
      {5, {{6, "unmask"}, {9, "masked-input"}, {12, "masked-input"}}},
  };
  size_t scheduled = 0;
  for (const auto& [k, kills] : schedule) scheduled += kills.size();

  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
  const auto start_site = [&](int k) {
    std::vector<std::string> flags = {"--secure-dump", dumps.string()};
    if (!schedule[k].empty()) {
      flags.push_back("--secure-exit-at");
      flags.push_back(schedule_flag(schedule[k]));
    }
    return federation.site(k, flags);
  };
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < kSites; ++k) sites.push_back(start_site(k));

  struct Killed {
    int site;
    Kill kill;
  };
  std::vector<Killed> killed;
  std::map<int, int> restart_after_round;  // site -> restart once this round is over
  int64_t last_round = 0;
  bool finished = false;
  const auto until = std::chrono::steady_clock::now() + 420s;
  while (!finished && std::chrono::steady_clock::now() < until) {
    if (std::optional<json> e = wait_for(
            *aggregator, events, [](const json& e) { return e.value("event", "") == "round" || e.value("event", "") == "finished"; },
            1s)) {
      if (e->value("event", "") == "finished") finished = true;
      else last_round = (*e)["round"].get<int64_t>();
    }
    for (int k = 0; k < kSites; ++k) {
      ChildProcess& site = *sites[static_cast<size_t>(k)];
      while (site.read_line(0ms)) {
      }
      if (restart_after_round.count(k) != 0) {
        if (last_round >= restart_after_round[k]) {
          restart_after_round.erase(k);
          sites[static_cast<size_t>(k)] = start_site(k);
        }
        continue;
      }
      const std::optional<int> code = site.poll_exit();
      if (!code) continue;
      if (finished && *code == 0) continue;
      ASSERT_EQ(*code, 128 + SIGKILL) << "site-" << k << " exited on its own before the end";
      ASSERT_FALSE(schedule[k].empty()) << "site-" << k << " was killed with no kill scheduled";
      killed.push_back({k, schedule[k].front()});
      // Back after the round, so that it cannot rejoin it; in round 12 at
      // once: the round needs it for the session that follows the abort.
      restart_after_round[k] = schedule[k].front().round == kRounds ? 0 : schedule[k].front().round;
      schedule[k].pop_front();
    }
  }
  ASSERT_TRUE(finished) << "the federation did not finish (last round " << last_round << ")";
  EXPECT_EQ(killed.size(), scheduled) << "not every scheduled kill happened";

  std::map<int64_t, json> aggregates;
  std::map<int64_t, int> sessions, aborted;
  double last_accuracy = 0.0;
  for (const json& e : events) {
    const std::string kind = e.value("event", "");
    if (kind == "secure_aggregate") aggregates[e["round"].get<int64_t>()] = e;
    if (kind == "secure_session") ++sessions[e["round"].get<int64_t>()];
    if (kind == "secure_session_aborted") ++aborted[e["round"].get<int64_t>()];
    if (kind == "round" && e.contains("test_accuracy")) last_accuracy = e["test_accuracy"].get<double>();
  }
  ASSERT_EQ(aggregates.size(), static_cast<size_t>(kRounds));
  for (const auto& [round, e] : aggregates) {
    // The sum the aggregator released is the plain sum of the survivors' inputs.
    std::vector<uint32_t> sum;
    for (const json& site : e["contributors"]) {
      const fs::path file = dumps / (site.get<std::string>() + "-round-" + std::to_string(round) + ".u32");
      const std::vector<uint32_t> words = read_words(file);
      ASSERT_EQ(words.size(), e["words"].get<size_t>()) << file;
      if (sum.empty()) sum.assign(words.size(), 0);
      for (size_t i = 0; i < words.size(); ++i) sum[i] += words[i];
    }
    EXPECT_EQ(sum_digest(sum), e["sum_blake2b"].get<std::string>()) << "round " << round << ": " << e.dump();
    if (round <= 11) {
      EXPECT_EQ(sessions[round], 1) << "round " << round << " needed another session with at most 2 kills";
      EXPECT_EQ(aborted[round], 0) << "round " << round;
    }
  }
  EXPECT_GE(aborted[12], 1) << "three kills in round 12 did not abort its first session";
  EXPECT_GE(sessions[12], 2);
  for (const Killed& k : killed) {
    if (k.kill.round == 12) continue;  // a later session of round 12 includes it again
    const json& contributors = aggregates[k.kill.round]["contributors"];
    const bool in_sum = std::find(contributors.begin(), contributors.end(), "site-" + std::to_string(k.site)) !=
                        contributors.end();
    EXPECT_EQ(in_sum, !before_masked_input_sent(k.kill.phase))
        << "site-" << k.site << " killed at " << k.kill.phase << " in round " << k.kill.round;
  }
  EXPECT_GE(last_accuracy, 0.55) << "the global model did not learn in private mode";

  // Every site's input is a canary: no piece of one may be in the aggregator's store or log.
  std::vector<uint8_t> stored = read_bytes(federation.dir() / "aggregator.db");
  if (fs::exists(federation.dir() / "aggregator.db-wal")) {
    const std::vector<uint8_t> wal = read_bytes(federation.dir() / "aggregator.db-wal");
    stored.insert(stored.end(), wal.begin(), wal.end());
  }
  std::string log;
  for (const json& e : events) log += e.dump() + "\n";
  int pieces = 0;
  for (const auto& entry : fs::directory_iterator(dumps)) {
    const std::vector<uint8_t> input = read_bytes(entry.path());
    for (size_t at = 0; at + 64 <= input.size(); at += input.size() / 8) {
      bool all_zero = true;
      for (size_t i = 0; i < 64; ++i) all_zero = all_zero && input[at + i] == 0;
      if (all_zero) continue;
      ++pieces;
      EXPECT_FALSE(contains_bytes(stored, input.data() + at, 64)) << entry.path() << " at byte " << at;
      EXPECT_EQ(log.find(fedmesh::crypto::to_hex(std::span<const uint8_t>(input.data() + at, 64))), std::string::npos);
    }
  }
  EXPECT_GT(pieces, 100);

  for (int k = 0; k < kSites; ++k) {
    const int code = sites[static_cast<size_t>(k)]->wait();
    EXPECT_EQ(code, 0) << "site-" << k;
  }
  EXPECT_EQ(aggregator->wait(), 0);
}

TEST(PrivateFederation, DpFedAvgWritesTheLedgerAndStopsAtTheBudget) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  // 4 sites, σ = 1, every site every round: epsilon after round r grows with
  // r; a target between the values of round 2 and 3 ends the federation
  // after 2 released rounds of the 6 asked.
  std::vector<std::string> extra = {"--rounds", "6", "--local-steps", "10", "--deadline", "60",
                                    "--agg", "dp.noise_multiplier = 1.0",
                                    "--agg", "dp.delta = 1e-5", "--agg", "dp.target_epsilon = 8.0"};
  for (const std::string& s : private_settings("5")) extra.push_back(s);
  Federation federation(4, extra, "dp");
  ASSERT_TRUE(federation.made());
  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s));
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < 4; ++k) sites.push_back(federation.site(k));
  std::optional<json> budget =
      wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "privacy_budget"; }, 240s);
  ASSERT_TRUE(budget.has_value()) << "the privacy budget never ended the federation";
  EXPECT_LE((*budget)["epsilon"].get<double>(), 8.0);
  EXPECT_GT((*budget)["next_epsilon"].get<double>(), 8.0);
  EXPECT_EQ((*budget)["rounds"].get<int>(), 2);  // epsilon 4.73, 7.08, then 9.01 (q = 1, sigma = 1, delta 1e-5)
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return e.value("event", "") == "finished"; }, 30s));
  for (auto& site : sites) EXPECT_EQ(site->wait(), 0);
  EXPECT_EQ(aggregator->wait(), 0);

  std::vector<double> announced;
  for (const json& e : events) {
    if (e.value("event", "") == "round" && e.contains("epsilon")) announced.push_back(e["epsilon"].get<double>());
  }
  fedmesh::Result<fedmesh::store::CheckpointStore> store =
      fedmesh::store::CheckpointStore::open((federation.dir() / "aggregator.db").string());
  ASSERT_TRUE(store.is_ok()) << store.status().message();
  fedmesh::Result<std::vector<fedmesh::store::PrivacyEntry>> ledger = store->privacy_ledger();
  ASSERT_TRUE(ledger.is_ok());
  ASSERT_EQ(ledger->size(), announced.size());
  ASSERT_GE(ledger->size(), 1u);
  EXPECT_EQ(static_cast<double>(ledger->size()), (*budget)["rounds"].get<double>());
  for (size_t i = 0; i < ledger->size(); ++i) {
    EXPECT_EQ((*ledger)[i].mechanism, "dp-fedavg");
    EXPECT_EQ((*ledger)[i].steps, static_cast<int64_t>(i + 1));
    EXPECT_DOUBLE_EQ((*ledger)[i].epsilon, announced[i]);  // recorded before it was announced
    if (i > 0) EXPECT_GT((*ledger)[i].epsilon, (*ledger)[i - 1].epsilon);
  }
  const fedmesh::testing::FedmeshOutput report =
      fedmesh::testing::run_fedmesh({"privacy", "report", (federation.dir() / "aggregator.db").string()});
  EXPECT_EQ(report.exit_code, 0) << report.text;
  EXPECT_NE(report.text.find("dp-fedavg"), std::string::npos) << report.text;
}

TEST(PrivateFederation, IncompatibleSettingsAreRefusedAtStartup) {
  ASSERT_FALSE(binary().empty()) << "FEDMESH_BINARY is not set";
  Federation federation(2, {"--agg", "privacy.mode = \"private\"", "--agg", "rule = \"median\"", "--site",
                            "privacy.mode = \"private\"", "--site", "compression.default = \"topk:0.01\""},
                        "refused");
  ASSERT_TRUE(federation.made());
  const fedmesh::testing::FedmeshOutput agg =
      fedmesh::testing::run_fedmesh({"aggregator", "--config", (federation.dir() / "agg.toml").string(), "--json"});
  EXPECT_EQ(agg.exit_code, 2) << agg.text;
  EXPECT_NE(agg.text.find("needs each site's update"), std::string::npos) << agg.text;
  const fedmesh::testing::FedmeshOutput site =
      fedmesh::testing::run_fedmesh({"node", "--config", (federation.dir() / "site-0.toml").string(), "--json"});
  EXPECT_EQ(site.exit_code, 2) << site.text;
  EXPECT_NE(site.text.find("compression.default at identity"), std::string::npos) << site.text;
}

}  // namespace
