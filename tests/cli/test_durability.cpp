// What the aggregator acknowledges is durable, checked on real processes
// (`fedmesh aggregator` and `fedmesh node` on loopback, keys and roster from
// deploy/local_federation.sh):
//   - an update the store cannot take (every write to the pending-update
//     table fails, as on a full disk) is refused as `not-stored`, never
//     acknowledged or applied; the site keeps it and sends it again, and once
//     the store takes writes again every round holds every site's update;
//   - an open round reopened by a restarted aggregator keeps the deadline it
//     opened with, so restarts cannot hold a round open for ever.
#include <gtest/gtest.h>

#include <chrono>
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

}  // namespace
