// What the aggregator acknowledges is durable, checked on real processes
// (`fedmesh aggregator` and `fedmesh node` on loopback, keys and roster from
// deploy/local_federation.sh):
//   - an update the store cannot take (every write to the pending-update
//     table fails, as on a full disk) is refused as `not-stored`, never
//     acknowledged or applied; the site keeps it and sends it again, and once
//     the store takes writes again every round holds every site's update;
//   - an open round reopened by a restarted aggregator keeps the deadline it
//     opened with, so restarts cannot hold a round open for ever;
//   - a newest round whose tensor bytes were damaged on disk while the
//     aggregator was stopped is quarantined when it starts again: it resumes
//     from the round before, puts that model out as the version after the
//     lost one, and finishes; the sites, which held the lost version, accept it.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/checkpoint_store.h"
#include "store/sqlite.h"
#include "support/cluster.h"
#include "support/local_federation.h"
#include "support/process.h"

using fedmesh::testing::ChildProcess;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

using Federation = fedmesh::testing::LocalFederation;

bool is_event(const json& e, const char* name) { return e.value("event", "") == name; }

// Another connection to the aggregator's store, as an operator's sqlite3
// would be: a trigger on it makes every pending-update write fail the way a
// full disk does, inside the aggregator's own transaction.
fedmesh::Status run_sql(const std::string& db, const std::string& sql) {
  auto database = fedmesh::store::Database::open(db, fedmesh::store::Database::Mode::kReadWrite);
  if (!database.is_ok()) return database.status();
  return database->execute(sql);
}

TEST(Durability, AnUpdateTheStoreCannotTakeIsRefusedRetryablyAndSentAgain) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  constexpr int kSites = 2;
  constexpr int kRounds = 3;
  Federation federation(kSites, {"--rounds", std::to_string(kRounds), "--local-steps", "20", "--deadline", "600",
                                 "--site", "give_up_seconds = 120", "--site", "poll_seconds = 0.2"},
                        "not-stored");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  const std::string db = (federation.dir() / "aggregator.db").string();

  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return is_event(e, "listening"); }, 60s))
      << "the aggregator did not start";
  ASSERT_TRUE(run_sql(db, "CREATE TRIGGER disk_full BEFORE INSERT ON pending_update_chunks "
                          "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
                  .is_ok());
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < kSites; ++k) sites.push_back(federation.site(k));

  std::optional<json> refused = wait_for(
      *aggregator, events,
      [](const json& e) { return is_event(e, "rejected") && e.value("code", "") == "not-stored"; }, 120s);
  ASSERT_TRUE(refused.has_value()) << "an update the store could not take was not refused";
  EXPECT_NE(refused->value("reason", "").find("disk is full"), std::string::npos) << refused->dump();
  // Nothing was applied while the store refused every update.
  for (const json& e : events) EXPECT_FALSE(is_event(e, "round")) << e.dump();
  ASSERT_TRUE(run_sql(db, "DROP TRIGGER disk_full").is_ok());

  std::optional<json> finished =
      wait_for(*aggregator, events, [](const json& e) { return is_event(e, "finished"); }, 240s);
  ASSERT_TRUE(finished.has_value()) << "the federation did not finish once the store took writes again";
  std::map<int, int> updates_by_round;
  for (const json& e : events) {
    if (is_event(e, "round")) updates_by_round[e["round"].get<int>()] = e["updates"].get<int>();
  }
  ASSERT_EQ(updates_by_round.size(), static_cast<size_t>(kRounds));
  for (const auto& [round, updates] : updates_by_round) EXPECT_EQ(updates, kSites) << "round " << round;

  // The site was told to send again, and did: it never counted the refused
  // update as answered.
  bool site_retried = false;
  for (auto& site : sites) {
    std::vector<json> site_events;
    wait_for(*site, site_events, [](const json& e) { return is_event(e, "finished"); }, 60s);
    for (const json& e : site_events) {
      if (is_event(e, "update") && e.value("code", "") == "not-stored") site_retried = true;
    }
    EXPECT_EQ(site->wait(), 0);
  }
  EXPECT_TRUE(site_retried) << "no site saw its update refused as not stored";
  EXPECT_EQ(aggregator->wait(), 0);

  // From the store: every round's applied updates, each site once a round.
  auto store = fedmesh::store::CheckpointStore::open_existing(db);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  auto log = store->round_log();
  ASSERT_TRUE(log.is_ok());
  EXPECT_EQ(log->size(), static_cast<size_t>(kRounds));
  auto raw = fedmesh::store::Database::open(db, fedmesh::store::Database::Mode::kReadOnly);
  ASSERT_TRUE(raw.is_ok());
  auto count = raw->prepare("SELECT count(*), count(DISTINCT round || ' ' || sender) FROM applied_updates");
  ASSERT_TRUE(count.is_ok());
  ASSERT_TRUE(count->step().value());
  EXPECT_EQ(count->column_int(0), kRounds * kSites);
  EXPECT_EQ(count->column_int(1), kRounds * kSites);
}

TEST(Durability, AReopenedRoundKeepsTheDeadlineItOpenedWith) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  // One site training slowly: the round stays open while the aggregator is
  // killed and started again.
  Federation federation(1, {"--rounds", "2", "--local-steps", "1000", "--deadline", "600", "--site",
                            "training.step_delay_seconds = 0.5", "--site", "give_up_seconds = 120"},
                        "deadline");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return is_event(e, "listening"); }, 60s));
  std::unique_ptr<ChildProcess> site = federation.site(0);
  std::optional<json> opened =
      wait_for(*aggregator, events, [](const json& e) { return is_event(e, "round_open"); }, 60s);
  ASSERT_TRUE(opened.has_value()) << "no round opened";
  ASSERT_TRUE(opened->contains("deadline_unix_ms")) << opened->dump();
  EXPECT_FALSE((*opened)["reopened"].get<bool>());

  for (int restart = 0; restart < 2; ++restart) {
    aggregator->signal(SIGKILL);
    aggregator->wait();
    aggregator = federation.aggregator();
    std::optional<json> reopened =
        wait_for(*aggregator, events, [](const json& e) { return is_event(e, "round_open"); }, 60s);
    ASSERT_TRUE(reopened.has_value()) << "the restarted aggregator did not reopen the round";
    EXPECT_TRUE((*reopened)["reopened"].get<bool>()) << reopened->dump();
    EXPECT_EQ((*reopened)["round"], (*opened)["round"]);
    EXPECT_EQ((*reopened)["deadline_unix_ms"], (*opened)["deadline_unix_ms"])
        << "the deadline moved with the restart: " << reopened->dump();
    EXPECT_EQ((*reopened)["opened_unix_ms"], (*opened)["opened_unix_ms"]);
  }
  site->signal(SIGKILL);
  site->wait();
  aggregator->signal(SIGKILL);
  aggregator->wait();
}

// Flips one bit in the middle of the only occurrence of `needle` in `file`.
::testing::AssertionResult flip_inside_only_occurrence(const std::string& file, const std::string& needle) {
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const size_t at = bytes.find(needle);
  if (at == std::string::npos) return ::testing::AssertionFailure() << "the tensor's bytes are not in " << file;
  if (bytes.find(needle, at + 1) != std::string::npos) return ::testing::AssertionFailure() << "the bytes are there twice";
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekp(static_cast<std::streamoff>(at + needle.size() / 2));
  const char flipped = static_cast<char>(bytes[at + needle.size() / 2] ^ 0x10);
  stream.write(&flipped, 1);
  if (!stream.good()) return ::testing::AssertionFailure() << "cannot write " << file;
  return ::testing::AssertionSuccess();
}

TEST(Durability, ADamagedNewestRoundIsQuarantinedAndTheFederationGoesOnAboveIt) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  constexpr int kSites = 2;
  constexpr int kRounds = 4;
  // Slow local training: the aggregator is stopped while both sites hold
  // version 2 and before anyone could send round 3.
  Federation federation(kSites, {"--rounds", std::to_string(kRounds), "--local-steps", "20", "--deadline", "600",
                                 "--site", "training.step_delay_seconds = 0.2", "--site", "give_up_seconds = 120",
                                 "--site", "poll_seconds = 0.2"},
                        "quarantine");
  ASSERT_TRUE(federation.made()) << "deploy/local_federation.sh failed";
  const std::string db = (federation.dir() / "aggregator.db").string();

  std::vector<json> events;
  std::unique_ptr<ChildProcess> aggregator = federation.aggregator();
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return is_event(e, "listening"); }, 60s));
  std::vector<std::unique_ptr<ChildProcess>> sites;
  for (int k = 0; k < kSites; ++k) sites.push_back(federation.site(k));
  ASSERT_TRUE(wait_for(*aggregator, events, [](const json& e) { return is_event(e, "round") && e["version"] == 2; }, 240s))
      << "version 2 was not committed";
  std::vector<std::vector<json>> site_events(kSites);
  for (int k = 0; k < kSites; ++k) {
    ASSERT_TRUE(wait_for(*sites[static_cast<size_t>(k)], site_events[static_cast<size_t>(k)],
                         [](const json& e) { return is_event(e, "model") && e["version"] == 2; }, 60s))
        << "site " << k << " did not adopt version 2";
  }
  aggregator->signal(SIGTERM);
  aggregator->wait();

  // The newest round's largest model tensor: one bit of it flipped in the file.
  int64_t damaged_round = -1, damaged_version = -1;
  std::string needle;
  {
    auto store = fedmesh::store::CheckpointStore::open_existing(db);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    auto rounds = store->rounds();
    ASSERT_TRUE(rounds.is_ok() && !rounds->empty());
    damaged_round = rounds->back().round;
    damaged_version = rounds->back().model_version;
    ASSERT_EQ(damaged_version, 2) << "the stop came after another round";
    auto loaded = store->load_round(damaged_round);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    const fedmesh::store::StoredTensor* largest = nullptr;
    for (const auto& t : loaded->tensors) {
      if (t.info.role == "model" && (largest == nullptr || t.info.byte_size > largest->info.byte_size)) largest = &t;
    }
    ASSERT_NE(largest, nullptr);
    ASSERT_GE(largest->info.byte_size, 256);
    const auto* bytes = static_cast<const char*>(largest->value.raw());
    needle.assign(bytes + largest->info.byte_size / 2, 64);
  }
  ASSERT_TRUE(flip_inside_only_occurrence(db, needle));

  std::vector<json> restarted;
  aggregator = federation.aggregator();
  std::optional<json> finished =
      wait_for(*aggregator, restarted, [](const json& e) { return is_event(e, "finished"); }, 300s);
  std::string log;
  for (const json& e : restarted) log += e.dump() + "\n";
  ASSERT_TRUE(finished.has_value()) << "the restarted aggregator did not finish:\n" << log;
  EXPECT_EQ(aggregator->wait(), 0) << log;

  // It said what it moved aside and why, and where it goes on from.
  const auto quarantined = std::find_if(restarted.begin(), restarted.end(), [&](const json& e) {
    return is_event(e, "warning") && e.value("quarantined_round", int64_t{-1}) == damaged_round;
  });
  ASSERT_NE(quarantined, restarted.end()) << log;
  EXPECT_NE((*quarantined)["reason"].get<std::string>().find("checksum"), std::string::npos) << quarantined->dump();
  const auto stepped = std::find_if(restarted.begin(), restarted.end(),
                                    [](const json& e) { return is_event(e, "warning") && e.contains("restored_round"); });
  ASSERT_NE(stepped, restarted.end()) << log;
  EXPECT_EQ((*stepped)["restored_round"], damaged_round + 1);
  EXPECT_EQ((*stepped)["restored_version"], damaged_version + 1);
  // Every round committed after the restart is above the quarantined one, and
  // the model took kRounds server steps in all: one before the lost round,
  // kRounds - 1 after it.
  int64_t rounds_after = 0, last_version = -1;
  for (const json& e : restarted) {
    if (!is_event(e, "round")) continue;
    ++rounds_after;
    EXPECT_GT(e["round"].get<int64_t>(), damaged_round + 1) << e.dump();
    EXPECT_GT(e["version"].get<int64_t>(), damaged_version + 1) << e.dump();
    last_version = e["version"].get<int64_t>();
  }
  EXPECT_EQ(rounds_after, kRounds - 1) << log;

  // The sites, which held the lost version 2, took the models after it.
  for (int k = 0; k < kSites; ++k) {
    std::vector<json>& seen = site_events[static_cast<size_t>(k)];
    std::optional<json> done =
        wait_for(*sites[static_cast<size_t>(k)], seen, [](const json& e) { return is_event(e, "finished"); }, 120s);
    ASSERT_TRUE(done.has_value()) << "site " << k << " did not finish";
    EXPECT_EQ((*done)["version"].get<int64_t>(), last_version);
    bool adopted_above = false;
    for (const json& e : seen) {
      EXPECT_EQ(e.dump().find("refusing"), std::string::npos) << "site " << k << ": " << e.dump();
      if (is_event(e, "model") && e["version"].get<int64_t>() > damaged_version) adopted_above = true;
    }
    EXPECT_TRUE(adopted_above) << "site " << k;
    EXPECT_EQ(sites[static_cast<size_t>(k)]->wait(), 0);
  }

  // The store keeps the damaged round aside, and what the owner resumes from verifies.
  auto store = fedmesh::store::CheckpointStore::open_existing(db);
  ASSERT_TRUE(store.is_ok());
  auto kept = store->quarantined_rounds();
  ASSERT_TRUE(kept.is_ok());
  ASSERT_EQ(kept->size(), 1u);
  EXPECT_EQ(kept->front().round, damaged_round);
  auto rounds = store->rounds();
  ASSERT_TRUE(rounds.is_ok() && !rounds->empty());
  for (const auto& r : *rounds) EXPECT_TRUE(store->verify_round(r.round).is_ok()) << "round " << r.round;
}

}  // namespace
