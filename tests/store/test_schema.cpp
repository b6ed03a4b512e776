// store::migrate against schema.h: from every earlier version a database
// with rows of that version reaches kSchemaVersion through
// CheckpointStore::open with its rows intact and the new tables working; a
// newer database and a backward target are refused; a migration that fails,
// or a process that dies inside one, leaves the previous version; a second
// migrate (also by another connection that got there first) is a no-op.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "store/checkpoint_store.h"
#include "store/schema.h"
#include "store/sqlite.h"
#include "tests/store/store_test_support.h"

namespace fedmesh::store {
namespace {

using testing::fresh_directory;
using testing::same_bytes;

// The tables each migration adds.
const std::vector<std::vector<std::string>> kTablesOf = {
    {"meta", "rounds", "tensors", "tensor_chunks"},
    {"peers", "replay_counters"},
    {"pending_updates", "pending_update_chunks", "applied_updates"},
    {"privacy_ledger"},
    {"round_log"},
    {"quarantined_rounds", "quarantined_tensors", "quarantined_tensor_chunks", "quarantined_updates",
     "quarantined_update_chunks"},
    {"replay_counters_by_name"},
    {},  // 8: BLAKE2bp tensor checksums (no table)
    {},  // 9: BLAKE2bp pending update checksums (no table)
};

bool contains(const Status& status, std::string_view text) { return status.message().find(text) != std::string::npos; }

Database open_database(const std::filesystem::path& path, Database::Mode mode = Database::Mode::kReadWriteCreate) {
  auto database = Database::open(path.string(), mode);
  EXPECT_TRUE(database.is_ok()) << database.status().to_string();
  if (!database.is_ok()) std::abort();
  return std::move(database).value();
}

bool has_table(Database& database, const std::string& name) {
  return *database.query_int("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '" + name + "'") == 1;
}

std::set<std::string> schema_of(Database& database) {
  auto statement = database.prepare(
      "SELECT type || ' ' || name || ': ' || coalesce(sql, '') FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'");
  std::set<std::string> result;
  while (*statement->step()) result.insert(statement->column_text(0));
  return result;
}

int64_t version_rows(Database& database) { return *database.query_int("SELECT count(*) FROM schema_version"); }

using testing::random_tensor;

TEST(Schema, AnEmptyDatabaseIsVersionZeroAndEachVersionAddsItsTables) {
  ASSERT_EQ(kTablesOf.size(), static_cast<size_t>(kSchemaVersion)) << "a new migration needs its line in kTablesOf";
  const auto dir = fresh_directory();
  for (int version = 1; version <= kSchemaVersion; ++version) {
    Database database = open_database(dir / ("v" + std::to_string(version) + ".db"));
    EXPECT_EQ(*schema_version(database), 0);
    ASSERT_TRUE(migrate(database, version).is_ok());
    EXPECT_EQ(*schema_version(database), version);
    EXPECT_EQ(version_rows(database), version) << "one row per migration applied";
    for (int v = 1; v <= kSchemaVersion; ++v) {
      for (const std::string& table : kTablesOf[static_cast<size_t>(v - 1)]) {
        EXPECT_EQ(has_table(database, table), v <= version) << table << " at version " << version;
      }
    }
    // Migrating again, to the same version or by default to the newest, applies nothing twice.
    ASSERT_TRUE(migrate(database, version).is_ok());
    EXPECT_EQ(version_rows(database), version);
    ASSERT_TRUE(migrate(database).is_ok());
    ASSERT_TRUE(migrate(database).is_ok());
    EXPECT_EQ(*schema_version(database), kSchemaVersion);
    EXPECT_EQ(version_rows(database), kSchemaVersion);
  }
}

TEST(Schema, TargetsOutsideTheKnownVersionsAndBackwardTargetsAreRefused) {
  const auto dir = fresh_directory();
  Database database = open_database(dir / "db");
  for (int target : {0, -1, kSchemaVersion + 1}) {
    const Status s = migrate(database, target);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << target;
    EXPECT_TRUE(contains(s, "does not exist")) << s.message();
  }
  EXPECT_EQ(*schema_version(database), 0) << "a refused target changes nothing";
  ASSERT_TRUE(migrate(database, kSchemaVersion).is_ok());
  for (int target = 1; target < kSchemaVersion; ++target) {
    const Status s = migrate(database, target);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << target;
    EXPECT_TRUE(contains(s, "cannot go back")) << s.message();
  }
  EXPECT_EQ(*schema_version(database), kSchemaVersion);
}

TEST(Schema, ADatabaseFromANewerFedmeshIsRefused) {
  const auto dir = fresh_directory();
  const auto path = dir / "newer.db";
  {
    Database database = open_database(path);
    ASSERT_TRUE(migrate(database).is_ok());
    ASSERT_TRUE(database
                    .execute("INSERT INTO schema_version(version, applied_at) VALUES (" +
                             std::to_string(kSchemaVersion + 1) + ", '2031-01-01T00:00:00Z')")
                    .is_ok());
    ASSERT_TRUE(database.execute("CREATE TABLE from_the_future(x)").is_ok());
    EXPECT_EQ(*schema_version(database), kSchemaVersion + 1);
    for (int target = 1; target <= kSchemaVersion; ++target) {
      const Status s = migrate(database, target);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(contains(s, "newer fedmesh")) << s.message();
      EXPECT_TRUE(contains(s, path.string())) << s.message();
    }
  }
  for (bool inspect : {false, true}) {
    auto store = inspect ? CheckpointStore::open_existing(path.string()) : CheckpointStore::open(path.string());
    ASSERT_FALSE(store.is_ok());
    EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(store.status(), "newer fedmesh")) << store.status().message();
  }
  Database database = open_database(path);
  EXPECT_EQ(*schema_version(database), kSchemaVersion + 1) << "a refused database is left as it was";
  EXPECT_EQ(version_rows(database), kSchemaVersion + 1);
}

// A checkpoint store at the newest version holding one round of every kind of
// row, whose rows are copied into databases at earlier versions.
struct Source {
  std::filesystem::path path;
  Tensor big = random_tensor({300000}, DType::kF32, 1);  // 1.14 MiB: 2 chunks
  Tensor small = random_tensor({3, 5}, DType::kBF16, 2);
  Tensor scalar = random_tensor({}, DType::kF16, 3);
};

void write_source(Source& source) {
  auto store = CheckpointStore::open(source.path.string());
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  RoundToCommit r;
  r.round = 12;
  r.model_version = 34;
  r.metrics_json = R"({"test_accuracy":0.75})";
  r.state_json = R"({"rng":"abc","position":99})";
  r.tensors = {{"model", "big", &source.big},
               {"optimizer", "small", &source.small},
               {"model", "scalar", &source.scalar}};
  r.peers = std::vector<PeerRecord>{{"site-a", "tcp://a:1", "alive", 3, 12}};
  r.replay_counters = {{"site-a", 41}};
  ASSERT_TRUE(store->commit_round(r).is_ok());
  ASSERT_TRUE(store->set_meta("config", R"({"lr":0.01})").is_ok());
}

TEST(Schema, EveryEarlierVersionOpensWithItsRowsIntactAndTheNewTablesWork) {
  const auto dir = fresh_directory();
  Source source;
  source.path = dir / "source.db";
  write_source(source);
  if (HasFatalFailure()) return;
  std::set<std::string> newest_schema;
  {
    Database fresh = open_database(dir / "fresh.db");
    ASSERT_TRUE(migrate(fresh).is_ok());
    newest_schema = schema_of(fresh);
  }

  for (int version = 1; version < kSchemaVersion; ++version) {
    SCOPED_TRACE("from version " + std::to_string(version));
    const auto path = dir / ("v" + std::to_string(version) + ".db");
    {
      Database old = open_database(path);
      ASSERT_TRUE(migrate(old, version).is_ok());
      ASSERT_TRUE(old.execute("ATTACH DATABASE '" + source.path.string() + "' AS source").is_ok());
      for (int v = 1; v <= version; ++v) {
        for (const std::string& table : kTablesOf[static_cast<size_t>(v - 1)]) {
          ASSERT_TRUE(old.execute("INSERT INTO main." + table + " SELECT * FROM source." + table).is_ok()) << table;
        }
      }
      ASSERT_TRUE(old.execute("DETACH DATABASE source").is_ok());
      EXPECT_EQ(*schema_version(old), version);
    }

    {
      auto store = CheckpointStore::open(path.string());
      ASSERT_TRUE(store.is_ok()) << store.status().to_string();
      // The old rows: the round verifies (its checksums were computed by the full store) and loads.
      ASSERT_TRUE(store->verify_round(12).is_ok());
      auto loaded = store->load_latest();
      ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
      EXPECT_EQ(loaded->round.round, 12);
      EXPECT_EQ(loaded->round.model_version, 34);
      EXPECT_EQ(loaded->round.metrics_json, R"({"test_accuracy":0.75})");
      EXPECT_EQ(loaded->round.state_json, R"({"rng":"abc","position":99})");
      ASSERT_EQ(loaded->tensors.size(), 3u);
      EXPECT_TRUE(same_bytes(loaded->find("model", "big")->value, source.big));
      EXPECT_EQ(loaded->find("model", "big")->info.chunk_count, 2);
      EXPECT_TRUE(same_bytes(loaded->find("optimizer", "small")->value, source.small));
      EXPECT_TRUE(same_bytes(loaded->find("model", "scalar")->value, source.scalar));
      EXPECT_EQ(store->meta("config").value(), std::optional<std::string>(R"({"lr":0.01})"));
      // The round log is filled from the rounds the old store had.
      const std::vector<RoundLogEntry> log = store->round_log().value();
      ASSERT_EQ(log.size(), 1u);
      EXPECT_EQ(log[0].round, 12);
      EXPECT_EQ(log[0].model_version, 34);
      EXPECT_EQ(log[0].metrics_json, R"({"test_accuracy":0.75})");
      if (version >= 2) {
        ASSERT_EQ(store->peers().value().size(), 1u);
        EXPECT_EQ(store->peers().value()[0].incarnation, 3);
        if (version < 7) {
          // Counters kept by name wait for the owner to map them to keys.
          EXPECT_TRUE(store->replay_counters().value().empty());
          EXPECT_EQ(store->named_replay_counters().value(), (std::map<std::string, uint64_t>{{"site-a", 41}}));
        } else {
          // Already kept by key: they stay where they are.
          EXPECT_EQ(store->replay_counters().value().size(), 1u);
          EXPECT_TRUE(store->named_replay_counters().value().empty());
        }
      } else {
        EXPECT_TRUE(store->peers().value().empty());
        EXPECT_TRUE(store->replay_counters().value().empty());
      }

      // The new tables work.
      const std::vector<uint8_t> id = {4, 2}, payload(1500000, 0x5a);
      ASSERT_TRUE(store->add_pending_update({id, "site-b", 34, 10, "", 0}, payload).is_ok());
      EXPECT_EQ(store->read_pending_update(id).value(), payload);
      ASSERT_TRUE(store->record_replay_counter("site-b", 7).is_ok());
      RoundToCommit next;
      next.round = 13;
      next.model_version = 35;
      next.tensors = {{"model", "big", &source.big}};
      next.applied_updates = {{id, "site-b", 1}};
      next.peers = std::vector<PeerRecord>{{"site-b", "tcp://b:1", "alive", 1, 13}};
      next.replay_counters = {{"site-a", 42}};
      ASSERT_TRUE(store->commit_round(next).is_ok());
      EXPECT_EQ(store->applied_round(id).value(), std::optional<int64_t>(13));
      EXPECT_TRUE(store->pending_updates().value().empty());
      EXPECT_EQ(store->peers().value().at(0).site, "site-b");
      EXPECT_EQ(store->replay_counters().value().at("site-a"), 42u);
      EXPECT_EQ(store->load_latest().value().round.round, 13);
      EXPECT_EQ(store->round_log().value().size(), 2u) << "the new round is logged too";
      EXPECT_TRUE(store->verify_round(12).is_ok());
      EXPECT_TRUE(store->integrity_check().is_ok());
    }
    Database migrated = open_database(path);
    EXPECT_EQ(*schema_version(migrated), kSchemaVersion);
    EXPECT_EQ(version_rows(migrated), kSchemaVersion);
    EXPECT_EQ(schema_of(migrated), newest_schema) << "the same schema as a database created new";
  }
}

TEST(Schema, AFailedMigrationLeavesThePreviousVersionWhole) {
  const auto path = fresh_directory() / "db";
  Database database = open_database(path);
  ASSERT_TRUE(migrate(database, 1).is_ok());
  // A table in the way of migration 2's second CREATE TABLE.
  ASSERT_TRUE(database.execute("CREATE TABLE replay_counters(x)").is_ok());
  const Status s = migrate(database);
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s, "replay_counters")) << s.message();
  EXPECT_EQ(*schema_version(database), 1);
  EXPECT_EQ(version_rows(database), 1);
  EXPECT_FALSE(has_table(database, "peers")) << "migration 2's first table went with the rest of it";
  ASSERT_TRUE(database.execute("DROP TABLE replay_counters").is_ok());
  ASSERT_TRUE(migrate(database).is_ok());
  EXPECT_EQ(*schema_version(database), kSchemaVersion);
}

// A process killed inside a migration (between two statements of migration
// 3, or at the moment it would commit) leaves the database at the previous
// version, from which the next open migrates.
class SchemaCrash : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

INSTANTIATE_TEST_SUITE_P(JournalAndPoint, SchemaCrash,
                         ::testing::Combine(::testing::Values("delete", "wal"), ::testing::Bool()),
                         [](const auto& param) {
                           return std::get<0>(param.param) + (std::get<1>(param.param) ? "AtCommit" : "MidMigration");
                         });

TEST_P(SchemaCrash, AProcessKilledInsideAMigrationLeavesThePreviousVersion) {
  const auto [journal_mode, at_commit] = GetParam();
  const auto path = fresh_directory() / "db";
  {
    Database database = open_database(path);
    ASSERT_EQ(*database.query_text("PRAGMA journal_mode = " + journal_mode), journal_mode);
    ASSERT_TRUE(migrate(database, 1).is_ok());
  }
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto database = Database::open(path.string(), Database::Mode::kReadWrite);
    if (!database.is_ok()) ::_exit(10);
    if (at_commit) {
      // migrate starts from version 1 here: the first COMMIT is migration 2's, the second migration 3's.
      static int commits = 0;
      sqlite3_commit_hook(
          database->handle(),
          [](void*) -> int {
            if (++commits == 2) ::_exit(0);
            return 0;
          },
          nullptr);
    } else {
      sqlite3_trace_v2(
          database->handle(), SQLITE_TRACE_STMT,
          [](unsigned, void*, void* statement, void*) -> int {
            if (std::strstr(sqlite3_sql(static_cast<sqlite3_stmt*>(statement)), "CREATE TABLE pending_update_chunks")) {
              ::_exit(0);
            }
            return 0;
          },
          nullptr);
    }
    (void)migrate(*database);
    ::_exit(11);  // not reached: the hook ends the process first
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the child did not die inside migration 3";
  {
    Database database = open_database(path, Database::Mode::kReadWrite);
    EXPECT_EQ(*schema_version(database), 2) << "migration 2 committed, migration 3 never did";
    EXPECT_TRUE(has_table(database, "peers"));
    EXPECT_FALSE(has_table(database, "pending_updates")) << "nothing of the interrupted migration remains";
    EXPECT_FALSE(has_table(database, "applied_updates"));
  }
  auto store = CheckpointStore::open(path.string());
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  ASSERT_TRUE(store->add_pending_update({{1}, "site", 0, 0, "", 0}, std::vector<uint8_t>{1, 2, 3}).is_ok());
  EXPECT_TRUE(store->integrity_check().is_ok());
  Database database = open_database(path, Database::Mode::kReadWrite);
  EXPECT_EQ(*schema_version(database), kSchemaVersion);
  EXPECT_EQ(version_rows(database), kSchemaVersion);
}

// Two connections migrate the same new database (an owner starting while an
// operator's `fedmesh checkpoint list` opens it): the one that gets the write
// lock second finds the work done instead of failing on "table already exists".
TEST(Schema, AMigrationThatAnotherConnectionFinishedFirstIsANoOp) {
  const auto path = fresh_directory() / "db";
  Database first = open_database(path);
  Database second = open_database(path);
  struct Gate {
    std::mutex mutex;
    std::condition_variable changed;
    bool blocked = false, go = false;
  } gate;
  // The second connection's busy handler: it tells the test that it waits for
  // the lock, and waits itself until the first connection has migrated.
  sqlite3_busy_handler(
      second.handle(),
      [](void* context, int attempts) -> int {
        auto* g = static_cast<Gate*>(context);
        std::unique_lock lock(g->mutex);
        g->blocked = true;
        g->changed.notify_all();
        g->changed.wait_for(lock, std::chrono::seconds(30), [&] { return g->go; });
        return attempts < 1000 ? 1 : 0;
      },
      &gate);

  ASSERT_TRUE(first.execute("BEGIN IMMEDIATE").is_ok());  // holds the write lock
  Status second_result;
  std::thread migrating([&] { second_result = migrate(second); });
  bool blocked = false;
  {
    std::unique_lock lock(gate.mutex);
    blocked = gate.changed.wait_for(lock, std::chrono::seconds(30), [&] { return gate.blocked; });
  }
  EXPECT_TRUE(blocked) << "the second connection never waited for the write lock";
  ASSERT_TRUE(first.execute("ROLLBACK").is_ok());
  const Status first_result = migrate(first);  // while the second waits, having read version 0
  {
    std::lock_guard lock(gate.mutex);
    gate.go = true;
  }
  gate.changed.notify_all();
  migrating.join();
  EXPECT_TRUE(first_result.is_ok()) << first_result.to_string();
  EXPECT_TRUE(second_result.is_ok()) << second_result.to_string();
  EXPECT_EQ(*schema_version(first), kSchemaVersion);
  EXPECT_EQ(version_rows(first), kSchemaVersion) << "every migration applied once";
}

}  // namespace
}  // namespace fedmesh::store
