// CheckpointStore: what a commit stores comes back byte for byte, after a
// reopen too; bad commits are refused and change nothing; corruption on disk
// is found by name and the newest intact round is used instead; retention
// keeps the last rounds plus the best and reuses space; applied updates are
// never applied twice; peers and replay counters.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "store/checkpoint_store.h"
#include "store/sqlite.h"
#include "tests/store/store_test_support.h"

namespace fedmesh::store {
namespace {

using testing::fresh_directory;
using testing::patterned;
using testing::same_bytes;

CheckpointStore open_store(const std::filesystem::path& db, StoreOptions options = {}) {
  auto store = CheckpointStore::open(db.string(), std::move(options));
  EXPECT_TRUE(store.is_ok()) << store.status().to_string();
  return std::move(store).value();
}

RoundToCommit round_with(int64_t round, const std::vector<std::pair<std::string, const Tensor*>>& tensors,
                         std::string metrics = "{}") {
  RoundToCommit r;
  r.round = round;
  r.model_version = round;
  r.metrics_json = std::move(metrics);
  r.state_json = R"({"step":)" + std::to_string(round) + "}";
  for (const auto& [name, tensor] : tensors) r.tensors.push_back({"model", name, tensor});
  return r;
}

TEST(StoreCommits, WhatIsCommittedComesBackByteForByteAfterReopen) {
  const auto db = fresh_directory() / "store.db";
  const Tensor big = patterned({3 * 1024 * 1024 / 4 + 17}, DType::kF32, 1);  // spans 4 chunks
  const Tensor half = patterned({33, 7}, DType::kF16, 2);
  const Tensor brain = patterned({5, 3, 2}, DType::kBF16, 3);
  const Tensor empty = Tensor::empty({0, 4});
  {
    CheckpointStore store = open_store(db);
    RoundToCommit r = round_with(7, {{"big", &big}, {"half", &half}, {"brain", &brain}, {"empty", &empty}},
                                 R"({"test_accuracy":0.5})");
    r.tensors.push_back({"optimizer", "big.exp_avg", &half});
    ASSERT_TRUE(store.commit_round(r).is_ok());
    auto infos = store.tensors(7);
    ASSERT_TRUE(infos.is_ok());
    ASSERT_EQ(infos->size(), 5u);
    EXPECT_EQ((*infos)[0].chunk_count, 4);
    EXPECT_EQ((*infos)[3].chunk_count, 0);
    EXPECT_EQ((*infos)[3].byte_size, 0);
  }
  CheckpointStore store = open_store(db);
  auto loaded = store.load_latest();
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->round.round, 7);
  EXPECT_EQ(loaded->round.metrics_json, R"({"test_accuracy":0.5})");
  EXPECT_EQ(loaded->round.state_json, R"({"step":7})");
  EXPECT_TRUE(same_bytes(loaded->find("model", "big")->value, big));
  EXPECT_TRUE(same_bytes(loaded->find("model", "half")->value, half));
  EXPECT_TRUE(same_bytes(loaded->find("model", "brain")->value, brain));
  EXPECT_TRUE(same_bytes(loaded->find("optimizer", "big.exp_avg")->value, half));
  EXPECT_EQ(loaded->find("model", "empty")->value.shape(), (Shape{0, 4}));
  EXPECT_EQ(loaded->find("model", "missing"), nullptr);
  EXPECT_TRUE(store.integrity_check().is_ok());
  auto rounds = store.rounds();
  ASSERT_TRUE(rounds.is_ok());
  ASSERT_EQ(rounds->size(), 1u);
  EXPECT_EQ((*rounds)[0].byte_size, static_cast<int64_t>(big.nbytes() + 2 * half.nbytes() + brain.nbytes()));
}

TEST(StoreCommits, RefusedCommitsChangeNothing) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db);
  const Tensor t = patterned({10}, DType::kF32, 4);
  ASSERT_TRUE(store.commit_round(round_with(5, {{"w", &t}})).is_ok());

  Status s = store.commit_round(round_with(5, {{"w", &t}}));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("only move forward"), std::string::npos) << s.message();
  EXPECT_FALSE(store.commit_round(round_with(3, {{"w", &t}})).is_ok());
  s = store.commit_round(round_with(6, {{"w", &t}}, "not json"));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("metrics"), std::string::npos) << s.message();
  EXPECT_FALSE(store.commit_round(round_with(6, {{"w", &t}}, "[1,2]")).is_ok());
  s = store.commit_round(round_with(6, {{"w", &t}, {"w", &t}}));
  EXPECT_NE(s.message().find("appears twice"), std::string::npos) << s.message();
  EXPECT_FALSE(store.commit_round(round_with(6, {{"", &t}})).is_ok());
  Tensor undefined;
  EXPECT_FALSE(store.commit_round(round_with(6, {{"x", &undefined}})).is_ok());

  auto rounds = store.rounds();
  ASSERT_TRUE(rounds.is_ok());
  ASSERT_EQ(rounds->size(), 1u);
  EXPECT_EQ((*rounds)[0].round, 5);
  ASSERT_TRUE(store.commit_round(round_with(6, {{"w", &t}})).is_ok());
  EXPECT_TRUE(store.verify_round(6).is_ok());
}

// Finds `needle` in the file and flips one bit in the middle of it.
bool flip_byte_inside(const std::filesystem::path& file, const Tensor& needle) {
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>());
  const std::string pattern(static_cast<const char*>(needle.raw()), 256);
  const size_t at = bytes.find(pattern);
  if (at == std::string::npos) return false;
  stream.clear();
  stream.seekp(static_cast<std::streamoff>(at + 100));
  const char flipped = static_cast<char>(bytes[at + 100] ^ 0x10);
  stream.write(&flipped, 1);
  return stream.good();
}

TEST(StoreCommits, AFlippedByteInAChunkIsFoundByNameAndTheOlderRoundIsUsed) {
  const auto dir = fresh_directory();
  const auto db = dir / "store.db";
  const Tensor old_weights = patterned({4096}, DType::kF32, 10);
  const Tensor new_weights = patterned({4096}, DType::kF32, 77);
  {
    CheckpointStore store = open_store(db);
    ASSERT_TRUE(store.commit_round(round_with(1, {{"fc1.weight", &old_weights}})).is_ok());
    ASSERT_TRUE(store.commit_round(round_with(2, {{"fc1.weight", &new_weights}})).is_ok());
    ASSERT_TRUE(store.settle().is_ok());
  }
  ASSERT_FALSE(std::filesystem::exists(dir / "store.db-wal") && std::filesystem::file_size(dir / "store.db-wal") > 0)
      << "closing the store leaves everything in the database file";
  ASSERT_TRUE(flip_byte_inside(db, new_weights));

  CheckpointStore store = open_store(db);
  EXPECT_TRUE(store.integrity_check().is_ok()) << "SQLite cannot see a flipped byte in blob data; the checksums can";
  const Status s = store.verify_round(2);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("round 2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("model/fc1.weight"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("checksum"), std::string::npos) << s.message();
  EXPECT_TRUE(store.verify_round(1).is_ok());

  std::vector<Status> skipped;
  auto loaded = store.load_latest(&skipped);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->round.round, 1);
  EXPECT_TRUE(same_bytes(loaded->find("model", "fc1.weight")->value, old_weights));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].message().find("round 2"), std::string::npos);
}

TEST(StoreCommits, EditedMetricsBreakTheRoundChecksum) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db);
  const Tensor t = patterned({64}, DType::kF32, 5);
  ASSERT_TRUE(store.commit_round(round_with(1, {{"w", &t}}, R"({"test_accuracy":0.25})")).is_ok());
  {
    auto other = Database::open(db.string(), Database::Mode::kReadWrite);
    ASSERT_TRUE(other.is_ok());
    ASSERT_TRUE(other->execute(R"(UPDATE rounds SET metrics = '{"test_accuracy":0.99}')").is_ok());
  }
  const Status s = store.verify_round(1);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("round checksum"), std::string::npos) << s.message();
  std::vector<Status> skipped;
  EXPECT_EQ(store.load_latest(&skipped).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(skipped.size(), 1u);
}

TEST(StoreCommits, AFileThatIsNotADatabaseIsRefusedClearly) {
  const auto dir = fresh_directory();
  const auto db = dir / "garbage.db";
  {
    std::ofstream out(db, std::ios::binary);
    for (int i = 0; i < 20000; ++i) out.put(static_cast<char>(i * 7919 % 251));
  }
  auto store = CheckpointStore::open(db.string());
  ASSERT_FALSE(store.is_ok());
  EXPECT_NE(store.status().message().find("garbage.db"), std::string::npos) << store.status().message();
  EXPECT_EQ(CheckpointStore::open_existing((dir / "absent.db").string()).status().code(), StatusCode::kNotFound);
}

TEST(StoreCommits, RetentionKeepsTheLastRoundsAndTheBest) {
  const auto db = fresh_directory() / "store.db";
  StoreOptions options;
  options.keep_last = 3;
  options.best_metric = "test_accuracy";
  CheckpointStore store = open_store(db, options);
  const Tensor t = patterned({256}, DType::kF32, 6);
  const double accuracy[] = {0.1, 0.5, 0.9, 0.3, 0.2, 0.4, 0.35, 0.6, 0.55, 0.5};
  for (int r = 1; r <= 10; ++r) {
    ASSERT_TRUE(store.commit_round(round_with(r, {{"w", &t}}, R"({"test_accuracy":)" + std::to_string(accuracy[r - 1]) + "}")).is_ok());
  }
  ASSERT_TRUE(store.settle().is_ok());  // retention runs after the commits, on the store's own thread
  auto rounds = store.rounds();
  ASSERT_TRUE(rounds.is_ok());
  std::vector<int64_t> kept;
  for (const auto& r : *rounds) kept.push_back(r.round);
  EXPECT_EQ(kept, (std::vector<int64_t>{3, 8, 9, 10}));
  // Tensors of deleted rounds went with them.
  for (int64_t r : {1, 2, 4, 7}) {
    auto tensors = store.tensors(r);
    ASSERT_TRUE(tensors.is_ok());
    EXPECT_TRUE(tensors->empty()) << r;
  }
  for (int64_t r : kept) EXPECT_TRUE(store.verify_round(r).is_ok()) << r;
}

TEST(StoreCommits, RetentionOfTheLowestAndWithoutABestMetric) {
  const auto dir = fresh_directory();
  StoreOptions lowest;
  lowest.keep_last = 2;
  lowest.best_metric = "val_loss";
  lowest.best_is_max = false;
  CheckpointStore store = open_store(dir / "lowest.db", lowest);
  const Tensor t = patterned({16}, DType::kF32, 7);
  const double loss[] = {3.0, 1.0, 2.0, 2.5, 2.2};
  for (int r = 1; r <= 5; ++r) {
    ASSERT_TRUE(store.commit_round(round_with(r, {{"w", &t}}, R"({"val_loss":)" + std::to_string(loss[r - 1]) + "}")).is_ok());
  }
  ASSERT_TRUE(store.settle().is_ok());
  auto rounds = store.rounds();
  ASSERT_EQ(rounds->size(), 3u);
  EXPECT_EQ((*rounds)[0].round, 2);

  StoreOptions last_only;
  last_only.keep_last = 1;
  last_only.background_maintenance = false;  // retention inside each commit
  CheckpointStore plain = open_store(dir / "plain.db", last_only);
  for (int r = 1; r <= 4; ++r) {
    ASSERT_TRUE(plain.commit_round(round_with(r, {{"w", &t}})).is_ok());
    ASSERT_EQ(plain.rounds()->size(), 1u);
  }
  ASSERT_EQ(plain.rounds()->size(), 1u);
  EXPECT_EQ(plain.rounds()->front().round, 4);

  StoreOptions bad;
  bad.keep_last = 0;
  EXPECT_FALSE(CheckpointStore::open((dir / "bad.db").string(), bad).is_ok());
  bad.keep_last = 1;
  bad.best_metric = "x'; DROP TABLE rounds; --";
  EXPECT_FALSE(CheckpointStore::open((dir / "bad.db").string(), bad).is_ok());
}

TEST(StoreCommits, SpaceOfDeletedRoundsIsReused) {
  const auto db = fresh_directory() / "store.db";
  StoreOptions options;
  options.keep_last = 2;
  CheckpointStore store = open_store(db, options);
  const Tensor t = patterned({512 * 1024}, DType::kF32, 8);  // 2 MiB per round
  for (int r = 1; r <= 5; ++r) ASSERT_TRUE(store.commit_round(round_with(r, {{"w", &t}})).is_ok());
  ASSERT_TRUE(store.settle().is_ok());
  const int64_t after_five = store.disk_bytes();
  for (int r = 6; r <= 55; ++r) ASSERT_TRUE(store.commit_round(round_with(r, {{"w", &t}})).is_ok());
  ASSERT_TRUE(store.settle().is_ok());
  const int64_t after_fifty_five = store.disk_bytes();
  EXPECT_LE(after_fifty_five, after_five + static_cast<int64_t>(t.nbytes()))
      << "the store grew from " << after_five << " to " << after_fifty_five << " bytes keeping 2 rounds";
  EXPECT_TRUE(store.integrity_check().is_ok());
}

TEST(StoreCommits, UpdatesArePendingDurablyAndAppliedOnlyOnce) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> id_a = {0xaa, 1, 2, 3}, id_b = {0xbb, 4, 5, 6};
  std::vector<uint8_t> payload(2 * 1024 * 1024 + 123);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 13);
  const Tensor t = patterned({8}, DType::kF32, 9);
  {
    CheckpointStore store = open_store(db);
    PendingUpdate a{id_a, "hospital-a", 4, 600, "", 0};
    ASSERT_TRUE(store.add_pending_update(a, payload).is_ok());
    ASSERT_TRUE(store.add_pending_update(a, payload).is_ok()) << "a retransmission is accepted once";
    std::vector<uint8_t> other = payload;
    other[5] ^= 1;
    const Status s = store.add_pending_update(a, other);
    EXPECT_NE(s.message().find("different bytes"), std::string::npos) << s.message();
    ASSERT_TRUE(store.add_pending_update({id_b, "hospital-b", 5, 300, "", 0}, std::vector<uint8_t>{1, 2, 3}).is_ok());
  }
  {
    CheckpointStore store = open_store(db);  // after a restart, nothing received is lost
    auto pending = store.pending_updates();
    ASSERT_TRUE(pending.is_ok());
    ASSERT_EQ(pending->size(), 2u);
    EXPECT_EQ((*pending)[0].sender, "hospital-a");
    EXPECT_EQ((*pending)[0].base_version, 4);
    EXPECT_EQ((*pending)[0].byte_size, static_cast<int64_t>(payload.size()));
    auto bytes = store.read_pending_update(id_a);
    ASSERT_TRUE(bytes.is_ok());
    EXPECT_EQ(*bytes, payload);

    RoundToCommit r = round_with(1, {{"w", &t}});
    r.applied_updates.push_back({id_a, "hospital-a", 2});
    ASSERT_TRUE(store.commit_round(r).is_ok());
    auto applied = store.applied_round(id_a);
    ASSERT_TRUE(applied.is_ok());
    EXPECT_EQ(*applied, std::optional<int64_t>(1));
    EXPECT_EQ(store.pending_updates()->size(), 1u);
    EXPECT_EQ(store.read_pending_update(id_a).status().code(), StatusCode::kNotFound);
  }
  CheckpointStore store = open_store(db);
  RoundToCommit again = round_with(2, {{"w", &t}});
  again.applied_updates.push_back({id_a, "hospital-a", 0});
  const Status s = store.commit_round(again);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("already applied in round 1"), std::string::npos) << s.message();
  EXPECT_EQ(store.rounds()->size(), 1u) << "the refused round must not be committed";
  const Status resent = store.add_pending_update({id_a, "hospital-a", 4, 600, "", 0}, payload);
  EXPECT_NE(resent.message().find("already applied in round 1"), std::string::npos) << resent.message();
  RoundToCommit twice = round_with(2, {{"w", &t}});
  twice.applied_updates = {{id_b, "hospital-b", 0}, {id_b, "hospital-b", 0}};
  EXPECT_FALSE(store.commit_round(twice).is_ok());
  EXPECT_EQ(store.pending_updates()->size(), 1u) << "a refused round leaves pending updates pending";
}

TEST(StoreCommits, PeersAreReplacedAndReplayCountersOnlyRise) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db);
  const Tensor t = patterned({8}, DType::kF32, 11);
  RoundToCommit r1 = round_with(1, {{"w", &t}});
  r1.peers = std::vector<PeerRecord>{{"site-a", "tcp://10.0.0.1:7000", "alive", 1, 1},
                                     {"site-b", "tcp://10.0.0.2:7000", "suspect", 3, 1}};
  r1.replay_counters = {{"site-a", 10}, {"site-b", 4}};
  ASSERT_TRUE(store.commit_round(r1).is_ok());
  RoundToCommit r2 = round_with(2, {{"w", &t}});
  r2.peers = std::vector<PeerRecord>{{"site-b", "tcp://10.0.0.2:7000", "dead", 4, 2}};
  r2.replay_counters = {{"site-a", 7}, {"site-c", 1}};
  ASSERT_TRUE(store.commit_round(r2).is_ok());
  auto peers = store.peers();
  ASSERT_TRUE(peers.is_ok());
  ASSERT_EQ(peers->size(), 1u);
  EXPECT_EQ((*peers)[0].status, "dead");
  EXPECT_EQ((*peers)[0].incarnation, 4);
  auto counters = store.replay_counters();
  ASSERT_TRUE(counters.is_ok());
  EXPECT_EQ((*counters)["site-a"], 10u) << "a counter is never lowered";
  EXPECT_EQ((*counters)["site-b"], 4u);
  EXPECT_EQ((*counters)["site-c"], 1u);

  EXPECT_TRUE(store.record_replay_counter("site-a", 11).is_ok());
  EXPECT_FALSE(store.record_replay_counter("site-a", 11).is_ok());
  EXPECT_FALSE(store.record_replay_counter("site-a", 3).is_ok());
  EXPECT_EQ((*store.replay_counters())["site-a"], 11u);

  RoundToCommit bad = round_with(3, {{"w", &t}});
  bad.peers = std::vector<PeerRecord>{{"site-x", "tcp://x:1", "zombie", 0, 3}};
  const Status s = store.commit_round(bad);
  EXPECT_NE(s.message().find("zombie"), std::string::npos) << s.message();
  EXPECT_EQ(store.peers()->size(), 1u);
}

}  // namespace
}  // namespace fedmesh::store

namespace fedmesh::store {
namespace {

TEST(StoreOwner, OneProcessOwnsAStoreOthersMayInspectIt) {
  const auto db = testing::fresh_directory() / "store.db";
  const Tensor t = testing::patterned({8}, DType::kF32, 12);
  {
    auto owner = CheckpointStore::open(db.string());
    ASSERT_TRUE(owner.is_ok()) << owner.status().to_string();
    RoundToCommit round;
    round.round = 1;
    round.tensors.push_back({"model", "w", &t});
    ASSERT_TRUE(owner->commit_round(round).is_ok());

    auto second = CheckpointStore::open(db.string());
    ASSERT_FALSE(second.is_ok());
    EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(second.status().message().find("pid " + std::to_string(::getpid())), std::string::npos)
        << second.status().message();
    auto inspector = CheckpointStore::open_existing(db.string());
    ASSERT_TRUE(inspector.is_ok()) << inspector.status().to_string();
    EXPECT_EQ(inspector->rounds()->size(), 1u);
    EXPECT_TRUE(inspector->verify_round(1).is_ok());
  }
  auto next_owner = CheckpointStore::open(db.string());
  ASSERT_TRUE(next_owner.is_ok()) << "the lock goes with the store that held it: " << next_owner.status().to_string();
  EXPECT_TRUE(next_owner->verify_round(1).is_ok());
}

}  // namespace
}  // namespace fedmesh::store
