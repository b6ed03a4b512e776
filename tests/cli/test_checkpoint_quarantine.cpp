// `fedmesh checkpoint quarantine` and what `checkpoint verify` says of the
// quarantine, run as an operator would on a store whose owner moved a
// damaged round and a damaged pending update aside: listing (text and
// --json) changes nothing, a release of an item that still fails is refused
// and changes nothing, --force releases it, drop deletes it, and bad flags are
// refused by name without touching the store.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/fedmesh_run.h"

#include "store/checkpoint_store.h"
#include "store/sqlite.h"

namespace {

using fedmesh::store::CheckpointStore;
using fedmesh::store::Database;
using nlohmann::json;

using fedmesh::testing::CommandRun;

CommandRun run(const std::string& arguments, bool with_stderr = true) {
  return fedmesh::testing::run_command(arguments, with_stderr);
}

std::vector<json> json_lines(const std::string& text) {
  std::vector<json> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) lines.push_back(json::parse(line));  // every stdout line is JSON
  }
  return lines;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

int64_t count(const std::string& db, const std::string& table) {
  auto database = Database::open(db, Database::Mode::kReadOnly);
  if (!database.is_ok()) return -1;
  auto n = database->query_int("SELECT count(*) FROM " + table);
  return n.is_ok() ? *n : -1;
}

class CheckpointQuarantineCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("fedmesh-quarantine-cli-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    db_ = (dir_ / "store.db").string();
    // Rounds 1..3 and two pending updates; round 3's record and update
    // site-b/9's bytes are damaged, and the owner moves both aside.
    const fedmesh::Tensor weights = fedmesh::Tensor::zeros({64}, fedmesh::DType::kF32);
    auto store = CheckpointStore::open(db_);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    for (int64_t r = 1; r <= 3; ++r) {
      fedmesh::store::RoundToCommit round;
      round.round = r;
      round.model_version = r;
      round.tensors.push_back({"model", "w", &weights});
      ASSERT_TRUE(store->commit_round(round).is_ok());
    }
    const std::vector<uint8_t> good = {'s', 'i', 't', 'e', '-', 'a', '/', '7'};
    const std::vector<uint8_t> bad = {'s', 'i', 't', 'e', '-', 'b', '/', '9'};
    ASSERT_TRUE(store->add_pending_update({good, "site-a", 3, 10, "", 0}, std::vector<uint8_t>(40, 1)).is_ok());
    ASSERT_TRUE(store->add_pending_update({bad, "site-b", 3, 10, "", 0}, std::vector<uint8_t>(40, 2)).is_ok());
    {
      auto raw = Database::open(db_, Database::Mode::kReadWrite);
      ASSERT_TRUE(raw.is_ok());
      ASSERT_TRUE(raw->execute("UPDATE rounds SET metrics = '{\"edited\":1}' WHERE round = 3").is_ok());
      ASSERT_TRUE(raw->execute("UPDATE pending_update_chunks SET data = zeroblob(40) WHERE update_id = "
                               "CAST('site-b/9' AS BLOB)")
                      .is_ok());
    }
    auto resumed = store->resume_latest(nullptr);
    ASSERT_TRUE(resumed.is_ok()) << resumed.status().to_string();
    ASSERT_EQ(resumed->round.round, 2);
    ASSERT_TRUE(store->quarantine_damaged_pending_updates(nullptr).is_ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
  std::string db_;
};

TEST_F(CheckpointQuarantineCommand, HelpExplainsTheCommandAndItsActions) {
  const CommandRun help = run("checkpoint quarantine --help");
  EXPECT_EQ(help.exit_code, 0);
  for (const char* part : {"damaged rounds and pending updates", "--release-round", "--drop-round",
                           "--release-update", "--drop-update", "--force", "--json", "Nothing changes unless"}) {
    EXPECT_TRUE(has(help.output, part)) << part << "\n" << help.output;
  }
  EXPECT_TRUE(has(run("checkpoint --help").output, "quarantine"));
}

TEST_F(CheckpointQuarantineCommand, ListingAndVerifyingNameTheItemsAndChangeNothing) {
  const CommandRun listed = run("checkpoint quarantine " + db_);
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_TRUE(has(listed.output, "quarantined round 3 (model version 3")) << listed.output;
  EXPECT_TRUE(has(listed.output, "round checksum mismatch")) << listed.output;
  EXPECT_TRUE(has(listed.output, "quarantined pending update site-b/9 from site-b")) << listed.output;
  EXPECT_TRUE(has(listed.output, "1 rounds and 1 pending updates in quarantine")) << listed.output;

  const CommandRun as_json = run("checkpoint quarantine " + db_ + " --json", /*with_stderr=*/false);
  ASSERT_EQ(as_json.exit_code, 0);
  const std::vector<json> lines = json_lines(as_json.output);
  ASSERT_EQ(lines.size(), 3u) << as_json.output;
  EXPECT_EQ(lines[0]["event"], "quarantined");
  EXPECT_EQ(lines[0]["kind"], "round");
  EXPECT_EQ(lines[0]["round"], 3);
  EXPECT_EQ(lines[0]["bytes"], 64 * 4);
  EXPECT_FALSE(lines[0]["quarantined_at"].get<std::string>().empty());
  EXPECT_EQ(lines[1]["kind"], "pending_update");
  EXPECT_EQ(lines[1]["update"], "site-b/9");
  EXPECT_EQ(lines[1]["sender"], "site-b");
  EXPECT_TRUE(has(lines[1]["reason"].get<std::string>(), "checksum")) << lines[1].dump();
  EXPECT_EQ(lines[2], json({{"event", "summary"}, {"command", "checkpoint quarantine"}, {"rounds", 1},
                            {"pending_updates", 1}}));

  // verify: what is left is intact (exit 0), and the quarantine is reported.
  const CommandRun verified = run("checkpoint verify " + db_ + " --json", /*with_stderr=*/false);
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  const std::vector<json> events = json_lines(verified.output);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["quarantined_rounds"], 1);
  EXPECT_EQ(events.back()["quarantined_pending_updates"], 1);
  int quarantined_events = 0;
  for (const json& e : events) quarantined_events += e["event"] == "quarantined" ? 1 : 0;
  EXPECT_EQ(quarantined_events, 2);
  EXPECT_TRUE(has(run("checkpoint verify " + db_).output, "in quarantine: 1 rounds, 1 pending updates"));

  EXPECT_EQ(count(db_, "rounds"), 2);
  EXPECT_EQ(count(db_, "pending_updates"), 1);
  EXPECT_EQ(count(db_, "quarantined_rounds"), 1);
  EXPECT_EQ(count(db_, "quarantined_updates"), 1);
}

TEST_F(CheckpointQuarantineCommand, ReleaseIsRefusedWhileDamagedUnlessForcedAndDropDeletes) {
  const CommandRun refused = run("checkpoint quarantine " + db_ + " --release-round 3");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_TRUE(has(refused.output, "still fails its checks")) << refused.output;
  EXPECT_EQ(count(db_, "rounds"), 2);
  EXPECT_EQ(count(db_, "quarantined_rounds"), 1);

  const CommandRun forced = run("checkpoint quarantine " + db_ + " --release-round 3 --force --json", false);
  EXPECT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_EQ(json_lines(forced.output).back()["action"], "released");
  EXPECT_EQ(count(db_, "rounds"), 3);
  EXPECT_EQ(count(db_, "quarantined_rounds"), 0);
  // Back as it was: verify names it again.
  const CommandRun verified = run("checkpoint verify " + db_);
  EXPECT_EQ(verified.exit_code, 1);
  EXPECT_TRUE(has(verified.output, "round 3: round 3: round checksum mismatch")) << verified.output;

  const CommandRun update_refused = run("checkpoint quarantine " + db_ + " --release-update site-b/9");
  EXPECT_EQ(update_refused.exit_code, 1) << update_refused.output;
  EXPECT_EQ(count(db_, "pending_updates"), 1);
  const CommandRun dropped = run("checkpoint quarantine " + db_ + " --drop-update site-b/9");
  EXPECT_EQ(dropped.exit_code, 0) << dropped.output;
  EXPECT_TRUE(has(dropped.output, "dropped pending update site-b/9")) << dropped.output;
  EXPECT_EQ(count(db_, "quarantined_updates"), 0);
  EXPECT_EQ(count(db_, "quarantined_update_chunks"), 0);
  EXPECT_EQ(count(db_, "pending_updates"), 1);
}

TEST_F(CheckpointQuarantineCommand, BadRequestsAreRefusedByNameAndChangeNothing) {
  struct Case {
    std::string arguments, expect;
  };
  const std::vector<Case> cases = {
      {"--release-round 7", "no quarantined round 7"},
      {"--drop-round 2", "no quarantined round 2"},
      {"--drop-update site-a/7", "no quarantined pending update site-a/7"},
      {"--release-round 3 --drop-update site-b/9", "at most one of"},
      {"--force", "--force goes with"},
      {"--drop-round 3 --force", "--force goes with"},
  };
  for (const Case& c : cases) {
    const CommandRun result = run("checkpoint quarantine " + db_ + " " + c.arguments);
    EXPECT_EQ(result.exit_code, 2) << c.arguments << "\n" << result.output;
    EXPECT_TRUE(has(result.output, c.expect)) << c.arguments << "\n" << result.output;
  }
  const CommandRun missing = run("checkpoint quarantine " + (dir_ / "absent.db").string());
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_FALSE(std::filesystem::exists(dir_ / "absent.db"));
  EXPECT_EQ(count(db_, "rounds"), 2);
  EXPECT_EQ(count(db_, "quarantined_rounds"), 1);
  EXPECT_EQ(count(db_, "quarantined_updates"), 1);
}

}  // namespace
