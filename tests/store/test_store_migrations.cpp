// The schema moves forward only: a database written at any earlier schema
// version opens, is migrated, keeps its rows, and ends with exactly the schema
// of a database created new; a database from a newer fedmesh is refused.
#include <gtest/gtest.h>

#include <set>

#include "store/checkpoint_store.h"
#include "store/schema.h"
#include "store/sqlite.h"
#include "tests/store/store_test_support.h"

namespace fedmesh::store {
namespace {

using testing::fresh_directory;
using testing::patterned;
using testing::same_bytes;

// The tables each migration adds (none is ever altered: a change is a new migration).
const std::vector<std::vector<std::string>> kTablesAddedBy = {
    {"meta", "rounds", "tensors", "tensor_chunks"},
    {"peers", "replay_counters"},
    {"pending_updates", "pending_update_chunks", "applied_updates"},
    {"privacy_ledger"},
    {"round_log"},
    {"quarantined_rounds", "quarantined_tensors", "quarantined_tensor_chunks", "quarantined_updates",
     "quarantined_update_chunks"},
    {"replay_counters_by_name"},
    {},  // 8: BLAKE2bp tensor checksums, in the rows' own bytes
    {},  // 9: BLAKE2bp pending update checksums, likewise
};

std::set<std::string> schema_of(Database& database) {
  auto statement = database.prepare("SELECT type || ' ' || name || ': ' || coalesce(sql, '') FROM sqlite_master "
                                    "WHERE name NOT LIKE 'sqlite_%'");
  std::set<std::string> result;
  while (*statement->step()) result.insert(statement->column_text(0));
  return result;
}

Database open_database(const std::filesystem::path& path) {
  auto database = Database::open(path.string(), Database::Mode::kReadWriteCreate);
  EXPECT_TRUE(database.is_ok()) << database.status().to_string();
  return std::move(database).value();
}

TEST(StoreMigrations, EachVersionAddsItsTablesAndNothingElse) {
  ASSERT_EQ(kTablesAddedBy.size(), static_cast<size_t>(kSchemaVersion)) << "a new migration needs its line above";
  const auto dir = fresh_directory();
  for (int version = 1; version <= kSchemaVersion; ++version) {
    Database database = open_database(dir / ("v" + std::to_string(version) + ".db"));
    ASSERT_TRUE(migrate(database, version).is_ok());
    EXPECT_EQ(*schema_version(database), version);
    for (int v = 1; v <= kSchemaVersion; ++v) {
      for (const std::string& table : kTablesAddedBy[static_cast<size_t>(v - 1)]) {
        const int64_t present = *database.query_int("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '" + table + "'");
        EXPECT_EQ(present, v <= version ? 1 : 0) << table << " at version " << version;
      }
    }
    ASSERT_TRUE(migrate(database, version).is_ok()) << "migrating to the current version is a no-op";
    EXPECT_EQ(*schema_version(database), version);
  }
}

// A checkpoint written by a fedmesh at `version`: a full store's round, with
// the tables of later migrations removed and their version rows forgotten,
// which is exactly what that fedmesh would have left (migrations only add).
void write_database_at_version(const std::filesystem::path& path, int version, const Tensor& weights) {
  {
    auto store = CheckpointStore::open(path.string());
    ASSERT_TRUE(store.is_ok());
    RoundToCommit round;
    round.round = 3;
    round.model_version = 3;
    round.metrics_json = R"({"test_accuracy":0.8})";
    round.tensors.push_back({"model", "fc.weight", &weights});
    ASSERT_TRUE(store->commit_round(round).is_ok());
    ASSERT_TRUE(store->set_meta("train_config", R"({"lr":0.001})").is_ok());
    if (version >= 2) {
      ASSERT_TRUE(store->record_replay_counter("site-a", 12).is_ok());
    }
  }
  Database database = open_database(path);
  for (int v = version + 1; v <= kSchemaVersion; ++v) {
    for (const std::string& table : kTablesAddedBy[static_cast<size_t>(v - 1)]) {
      ASSERT_TRUE(database.execute("DROP TABLE " + table).is_ok()) << table;
    }
  }
  ASSERT_TRUE(database.execute("DELETE FROM schema_version WHERE version > " + std::to_string(version)).is_ok());
  ASSERT_EQ(*schema_version(database), version);
}

TEST(StoreMigrations, EveryEarlierVersionOpensWithItsDataAndTheNewestSchema) {
  const auto dir = fresh_directory();
  std::set<std::string> newest;
  {
    Database fresh = open_database(dir / "fresh.db");
    ASSERT_TRUE(migrate(fresh).is_ok());
    newest = schema_of(fresh);
  }
  const Tensor weights = patterned({300, 7}, DType::kF32, 21);
  for (int version = 1; version < kSchemaVersion; ++version) {
    SCOPED_TRACE("from schema version " + std::to_string(version));
    const auto path = dir / ("at-v" + std::to_string(version) + ".db");
    write_database_at_version(path, version, weights);

    auto store = CheckpointStore::open_existing(path.string());
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    {
      Database database = open_database(path);
      EXPECT_EQ(*schema_version(database), kSchemaVersion);
      EXPECT_EQ(schema_of(database), newest) << "a migrated database must look like a new one";
    }
    auto loaded = store->load_latest();
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->round.round, 3);
    EXPECT_TRUE(same_bytes(loaded->find("model", "fc.weight")->value, weights));
    EXPECT_EQ(**store->meta("train_config"), R"({"lr":0.001})");
    if (version >= 7) {
      // Written at a version that keeps them by key: they stay as they were.
      EXPECT_EQ(store->replay_counters()->at("site-a"), 12u);
      EXPECT_TRUE(store->named_replay_counters()->empty());
    } else if (version >= 2) {
      // Kept by name until the owner maps names to roster keys; then by key.
      EXPECT_TRUE(store->replay_counters()->empty());
      EXPECT_EQ((*store->named_replay_counters())["site-a"], 12u);
      const std::string key_a(64, 'a');
      ASSERT_TRUE(store->record_replay_counter(key_a, 5).is_ok());  // the key's own counter, lower: raised
      ASSERT_TRUE(store->adopt_named_replay_counters({{"site-a", key_a}, {"site-q", std::string(64, 'c')}}).is_ok());
      EXPECT_EQ(store->replay_counters()->count(std::string(64, 'c')), 0u) << "a name with no counter adopts nothing";
      EXPECT_TRUE(store->named_replay_counters()->empty());
      EXPECT_EQ(store->replay_counters()->at(key_a), 12u);
      EXPECT_EQ(store->replay_counters()->count("site-a"), 0u);
    }
    // The tables the migration added work.
    ASSERT_TRUE(store->add_pending_update({{1, 2, 3}, "site-b", 3, 10, "", 0}, std::vector<uint8_t>{9, 9}).is_ok());
    ASSERT_TRUE(store->record_replay_counter("site-b", 1).is_ok());
    RoundToCommit next;
    next.round = 4;
    next.model_version = 4;
    next.tensors.push_back({"model", "fc.weight", &weights});
    next.applied_updates.push_back({{1, 2, 3}, "site-b", 1});
    ASSERT_TRUE(store->commit_round(next).is_ok());
    EXPECT_EQ(*store->applied_round(std::vector<uint8_t>{1, 2, 3}), std::optional<int64_t>(4));
    EXPECT_TRUE(store->integrity_check().is_ok());
  }
}

TEST(StoreMigrations, NewerOrBackwardVersionsAreRefused) {
  const auto dir = fresh_directory();
  {
    Database database = open_database(dir / "newer.db");
    ASSERT_TRUE(migrate(database).is_ok());
    ASSERT_TRUE(database.execute("INSERT INTO schema_version VALUES (" + std::to_string(kSchemaVersion + 1) +
                                 ", 'the future')").is_ok());
    const Status backwards = migrate(database, 1);
    EXPECT_FALSE(backwards.is_ok());
  }
  auto store = CheckpointStore::open((dir / "newer.db").string());
  ASSERT_FALSE(store.is_ok());
  EXPECT_NE(store.status().message().find("newer fedmesh"), std::string::npos) << store.status().message();

  Database database = open_database(dir / "current.db");
  ASSERT_TRUE(migrate(database).is_ok());
  const Status backwards = migrate(database, 1);
  EXPECT_EQ(backwards.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(backwards.message().find("cannot go back"), std::string::npos) << backwards.message();
  EXPECT_FALSE(migrate(database, 0).is_ok());
  EXPECT_FALSE(migrate(database, kSchemaVersion + 1).is_ok());
}

}  // namespace
}  // namespace fedmesh::store
