// CheckpointStore against the guarantees its header states: round trips of
// every dtype across chunk boundaries, rounds that only move forward, refused
// commits that change nothing, corruption found by round and tensor name (and
// only corruption: a read that fails for another reason is not a corrupt
// round to skip), one snapshot per load, retention of the last rounds plus
// the best with space reused, durable pending updates applied at most once,
// peers, and replay counters that never fall (over the whole uint64 range).
// Every store test runs with and without background maintenance where the
// two paths differ.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "store/checkpoint_store.h"
#include "crypto/tree_hash.h"
#include "store/schema.h"
#include "store/sqlite.h"
#include "tests/store/store_test_support.h"

namespace fedmesh::store {
namespace {

using testing::fresh_directory;
using testing::same_bytes;

constexpr size_t kMiB = size_t{1} << 20;

using testing::random_tensor;

std::vector<uint8_t> random_bytes(size_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(size);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng() >> 56);
  return bytes;
}

bool contains(const Status& status, std::string_view text) { return status.message().find(text) != std::string::npos; }

CheckpointStore open_store(const std::filesystem::path& db, StoreOptions options = {}) {
  auto store = CheckpointStore::open(db.string(), std::move(options));
  EXPECT_TRUE(store.is_ok()) << store.status().to_string();
  if (!store.is_ok()) std::abort();  // nothing below can run without it
  return std::move(store).value();
}

StoreOptions options_with(bool background, int64_t keep_last = 3, std::string best_metric = "",
                          bool best_is_max = true) {
  StoreOptions options;
  options.background_maintenance = background;
  options.keep_last = keep_last;
  options.best_metric = std::move(best_metric);
  options.best_is_max = best_is_max;
  return options;
}

RoundToCommit simple_round(int64_t round, const Tensor* tensor, std::string metrics = "{}") {
  RoundToCommit r;
  r.round = round;
  r.model_version = round * 10;
  r.metrics_json = std::move(metrics);
  r.state_json = R"({"step":)" + std::to_string(round) + "}";
  if (tensor != nullptr) r.tensors.push_back({"model", "w", tensor});
  return r;
}

std::vector<int64_t> round_numbers(CheckpointStore& store) {
  auto rounds = store.rounds();
  EXPECT_TRUE(rounds.is_ok()) << rounds.status().to_string();
  std::vector<int64_t> result;
  if (rounds.is_ok()) {
    for (const RoundInfo& info : *rounds) result.push_back(info.round);
  }
  return result;
}

int64_t count_rows(Database& database, const std::string& table) {
  auto count = database.query_int("SELECT count(*) FROM " + table);
  EXPECT_TRUE(count.is_ok()) << count.status().to_string();
  return count.is_ok() ? *count : -1;
}

Database raw_connection(const std::filesystem::path& db) {
  auto database = Database::open(db.string(), Database::Mode::kReadWrite);
  EXPECT_TRUE(database.is_ok()) << database.status().to_string();
  if (!database.is_ok()) std::abort();
  return std::move(database).value();
}

std::string read_file(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool wal_is_gone_or_empty(const std::filesystem::path& db) {
  const std::filesystem::path wal = db.string() + "-wal";
  return !std::filesystem::exists(wal) || std::filesystem::file_size(wal) == 0;
}

class StoreByMaintenance : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Maintenance, StoreByMaintenance, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "Background" : "InCommit";
                         });

// ---------------------------------------------------------------------------
// 1. Round trips.

TEST_P(StoreByMaintenance, EveryDtypeAndChunkBoundaryComesBackByteForByteAlsoAfterReopen) {
  const auto db = fresh_directory() / "store.db";
  // (917505,) fp32 = 3.5 MiB + 4 bytes: 4 chunks, the last of 0.5 MiB + 4 bytes.
  const Tensor big = random_tensor({917505}, DType::kF32, 1);
  const Tensor exact_chunk = random_tensor({512, 512}, DType::kF32, 2);        // exactly 1 MiB: 1 chunk
  const Tensor chunk_plus_one = random_tensor({524289}, DType::kF16, 3);      // 1 MiB + 2 bytes: 2 chunks
  const Tensor brain = random_tensor({7, 3, 5}, DType::kBF16, 4);
  const Tensor half = random_tensor({13}, DType::kF16, 5);
  const Tensor float_scalar = random_tensor({}, DType::kF32, 6);             // rank 0: one element
  const Tensor empty = Tensor::empty({0, 4}, DType::kBF16);
  const Tensor empty_f32 = Tensor::empty({3, 0}, DType::kF32);
  struct Expected {
    std::string role, name;
    const Tensor* tensor;
    int64_t chunks;
  };
  const std::vector<Expected> expected = {
      {"model", "big", &big, 4},
      {"model", "exact_chunk", &exact_chunk, 1},
      {"optimizer", "chunk_plus_one", &chunk_plus_one, 2},
      {"model", "brain", &brain, 1},
      {"residual", "half", &half, 1},
      {"model", "scalar", &float_scalar, 1},
      {"model", "empty", &empty, 0},
      {"optimizer", "empty", &empty_f32, 0},  // same name, another role
  };
  ASSERT_EQ(big.nbytes(), 3 * kMiB + kMiB / 2 + 4);
  ASSERT_EQ(exact_chunk.nbytes(), kMiB);
  const std::string metrics = R"({"test_accuracy":0.8125,"loss":1.5,"note":"\u00e9t\u00e9"})";
  const std::string state = R"({"rng":[1,2,3],"data_position":12345,"nested":{"a":null}})";

  auto check_infos = [&](CheckpointStore& store, int64_t round) {
    auto infos = store.tensors(round);
    ASSERT_TRUE(infos.is_ok()) << infos.status().to_string();
    ASSERT_EQ(infos->size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const TensorInfo& info = (*infos)[i];
      SCOPED_TRACE(expected[i].role + "/" + expected[i].name);
      EXPECT_EQ(info.role, expected[i].role);
      EXPECT_EQ(info.name, expected[i].name);
      EXPECT_EQ(info.dtype, expected[i].tensor->dtype());
      EXPECT_EQ(info.shape, expected[i].tensor->shape());
      EXPECT_EQ(info.encoding, "raw");
      EXPECT_EQ(info.byte_size, static_cast<int64_t>(expected[i].tensor->nbytes()));
      EXPECT_EQ(info.chunk_count, expected[i].chunks);
    }
  };
  auto check_loaded = [&](const LoadedCheckpoint& loaded, int64_t round) {
    EXPECT_EQ(loaded.round.round, round);
    EXPECT_EQ(loaded.round.model_version, round * 10);
    EXPECT_EQ(loaded.round.metrics_json, metrics);
    EXPECT_EQ(loaded.round.state_json, state);
    EXPECT_EQ(loaded.round.tensor_count, static_cast<int64_t>(expected.size()));
    EXPECT_FALSE(loaded.round.wall_time.empty());
    ASSERT_EQ(loaded.tensors.size(), expected.size());
    for (const Expected& e : expected) {
      const StoredTensor* stored = loaded.find(e.role, e.name);
      ASSERT_NE(stored, nullptr) << e.role << "/" << e.name;
      EXPECT_TRUE(same_bytes(stored->value, *e.tensor)) << e.role << "/" << e.name;
      EXPECT_EQ(stored->value.nbytes(), e.tensor->nbytes());
    }
    EXPECT_EQ(loaded.find("model", "absent"), nullptr);
    EXPECT_EQ(loaded.find("residual", "big"), nullptr);
  };
  auto same_checkpoints = [](const LoadedCheckpoint& a, const LoadedCheckpoint& b) {
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      const Tensor& x = a.tensors[i].value;
      const Tensor& y = b.tensors[i].value;
      ASSERT_EQ(x.nbytes(), y.nbytes());
      EXPECT_EQ(x.nbytes() == 0 ? 0 : std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << a.tensors[i].info.name;
      EXPECT_EQ(a.tensors[i].info.checksum, b.tensors[i].info.checksum);
    }
  };

  const Tensor other = random_tensor({100}, DType::kF32, 99);
  {
    CheckpointStore store = open_store(db, options_with(GetParam(), 10));
    ASSERT_TRUE(store.commit_round(simple_round(1, &other)).is_ok());
    RoundToCommit r;
    r.round = 4;
    r.model_version = 40;
    r.metrics_json = metrics;
    r.state_json = state;
    for (const Expected& e : expected) r.tensors.push_back({e.role, e.name, e.tensor});
    const Status committed = store.commit_round(r);
    ASSERT_TRUE(committed.is_ok()) << committed.to_string();
    check_infos(store, 4);

    auto by_round = store.load_round(4);
    ASSERT_TRUE(by_round.is_ok()) << by_round.status().to_string();
    check_loaded(*by_round, 4);
    auto latest = store.load_latest();
    ASSERT_TRUE(latest.is_ok()) << latest.status().to_string();
    check_loaded(*latest, 4);
    same_checkpoints(*by_round, *latest);

    auto rounds = store.rounds();
    ASSERT_TRUE(rounds.is_ok());
    ASSERT_EQ(rounds->size(), 2u);
    int64_t total = 0;
    for (const Expected& e : expected) total += static_cast<int64_t>(e.tensor->nbytes());
    EXPECT_EQ((*rounds)[1].byte_size, total);
    EXPECT_EQ((*rounds)[0].byte_size, static_cast<int64_t>(other.nbytes()));
    auto info = store.round_info(4);
    ASSERT_TRUE(info.is_ok());
    EXPECT_EQ(info->tensor_count, static_cast<int64_t>(expected.size()));
    EXPECT_EQ(store.round_info(3).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(store.load_round(3).status().code(), StatusCode::kNotFound);
    EXPECT_TRUE(store.verify_round(1).is_ok());
    EXPECT_TRUE(store.verify_round(4).is_ok());
  }
  EXPECT_TRUE(wal_is_gone_or_empty(db)) << "closing the store copies the log into the database file";

  for (bool inspect : {false, true}) {
    SCOPED_TRACE(inspect ? "open_existing" : "open");
    auto reopened = inspect ? CheckpointStore::open_existing(db.string(), options_with(GetParam(), 10))
                            : CheckpointStore::open(db.string(), options_with(GetParam(), 10));
    ASSERT_TRUE(reopened.is_ok()) << reopened.status().to_string();
    check_infos(*reopened, 4);
    auto by_round = reopened->load_round(4);
    ASSERT_TRUE(by_round.is_ok()) << by_round.status().to_string();
    check_loaded(*by_round, 4);
    auto latest = reopened->load_latest();
    ASSERT_TRUE(latest.is_ok()) << latest.status().to_string();
    check_loaded(*latest, 4);
    same_checkpoints(*by_round, *latest);
    auto old = reopened->load_round(1);
    ASSERT_TRUE(old.is_ok());
    EXPECT_TRUE(same_bytes(old->find("model", "w")->value, other));
    EXPECT_TRUE(reopened->integrity_check().is_ok());
  }
}

TEST(CheckpointStoreRead, ReadTensorStreamsChunksInOrderOfAtMostOneMiB) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db);
  const Tensor t = random_tensor({(5 * kMiB + 3) / 2 + 1}, DType::kBF16, 7);  // 5 MiB + 4 bytes: 6 chunks
  ASSERT_TRUE(store.commit_round(simple_round(0, &t)).is_ok()) << "round 0 is a valid first round";
  auto infos = store.tensors(0);
  ASSERT_TRUE(infos.is_ok());
  ASSERT_EQ(infos->size(), 1u);
  EXPECT_EQ((*infos)[0].chunk_count, 6);
  std::vector<size_t> sizes;
  std::vector<uint8_t> streamed;
  const Status s = store.read_tensor((*infos)[0], [&](std::span<const uint8_t> chunk) {
    sizes.push_back(chunk.size());
    streamed.insert(streamed.end(), chunk.begin(), chunk.end());
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(sizes, (std::vector<size_t>{kMiB, kMiB, kMiB, kMiB, kMiB, 4}));
  ASSERT_EQ(streamed.size(), t.nbytes());
  EXPECT_EQ(std::memcmp(streamed.data(), t.raw(), t.nbytes()), 0);

  // A consumer's failure stops the stream and is returned as it is.
  int calls = 0;
  const Status stopped = store.read_tensor((*infos)[0], [&](std::span<const uint8_t>) {
    ++calls;
    return io_error("consumer full");
  });
  EXPECT_EQ(stopped.code(), StatusCode::kIoError);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(store.tensors(12).value().size(), 0u) << "a round that was never committed has no tensors";
}

// ---------------------------------------------------------------------------
// 2. Refused commits.

TEST_P(StoreByMaintenance, RoundsOnlyMoveForward) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam(), 10));
  const Tensor t = random_tensor({16}, DType::kF32, 8);
  ASSERT_TRUE(store.commit_round(simple_round(5, &t)).is_ok());
  for (int64_t round : {5, 4, 0}) {
    const Status s = store.commit_round(simple_round(round, &t));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << round;
    EXPECT_TRUE(contains(s, "round " + std::to_string(round))) << s.message();
    EXPECT_TRUE(contains(s, "newest committed round 5")) << s.message();
  }
  EXPECT_EQ(store.commit_round(simple_round(-1, &t)).code(), StatusCode::kInvalidArgument);
  RoundToCommit negative_version = simple_round(6, &t);
  negative_version.model_version = -1;
  EXPECT_EQ(store.commit_round(negative_version).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{5}));
  ASSERT_TRUE(store.commit_round(simple_round(7, &t)).is_ok()) << "a gap is fine: only forward";
  EXPECT_EQ(store.commit_round(simple_round(6, &t)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{5, 7}));
}

TEST_P(StoreByMaintenance, MetricsAndStateMustBeJsonObjects) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam()));
  const Tensor t = random_tensor({16}, DType::kF32, 9);
  const std::vector<std::string> bad = {"", "not json", "{", "[]", "[1,2]", "1", "\"text\"", "null", "true",
                                        "{\"a\":}", "{\"a\":1} trailing", "{'a':1}"};
  for (const std::string& json : bad) {
    RoundToCommit metrics = simple_round(1, &t, json);
    Status s = store.commit_round(metrics);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "metrics '" << json << "'";
    EXPECT_TRUE(contains(s, "metrics")) << s.message();
    RoundToCommit state = simple_round(1, &t);
    state.state_json = json;
    s = store.commit_round(state);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "state '" << json << "'";
    EXPECT_TRUE(contains(s, "state")) << s.message();
  }
  RoundToCommit huge = simple_round(1, &t, R"({"x":")" + std::string(kMaxJsonBytes, 'a') + R"("})");
  EXPECT_EQ(store.commit_round(huge).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(round_numbers(store).empty());
  ASSERT_TRUE(store.commit_round(simple_round(1, &t, R"( { "ok" : [ 1 , { } ] } )")).is_ok());
  EXPECT_EQ(store.load_latest().value().round.metrics_json, R"( { "ok" : [ 1 , { } ] } )")
      << "the JSON is stored as given";
}

TEST_P(StoreByMaintenance, DuplicateTensorsAndInvalidTensorsAreRefused) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam()));
  const Tensor a = random_tensor({2 * kMiB / 4 + 3}, DType::kF32, 10);  // several chunks written before the duplicate
  const Tensor b = random_tensor({8}, DType::kF32, 11);
  RoundToCommit twice = simple_round(1, nullptr);
  twice.tensors = {{"model", "w", &a}, {"model", "v", &b}, {"model", "w", &b}};
  Status s = store.commit_round(twice);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "model/w")) << s.message();
  EXPECT_TRUE(contains(s, "twice")) << s.message();

  Tensor undefined;
  const Tensor rank9 = Tensor::empty({1, 1, 1, 1, 1, 1, 1, 1, 1});
  for (const RoundToCommit& r : {
           [&] { RoundToCommit x = simple_round(1, nullptr); x.tensors = {{"model", "u", &undefined}}; return x; }(),
           [&] { RoundToCommit x = simple_round(1, nullptr); x.tensors = {{"model", "n", nullptr}}; return x; }(),
           [&] { RoundToCommit x = simple_round(1, nullptr); x.tensors = {{"model", "r", &rank9}}; return x; }(),
           [&] { RoundToCommit x = simple_round(1, nullptr); x.tensors = {{"", "w", &b}}; return x; }(),
           [&] { RoundToCommit x = simple_round(1, nullptr); x.tensors = {{"model", "", &b}}; return x; }(),
           [&] {
             RoundToCommit x = simple_round(1, nullptr);
             x.tensors = {{"model", std::string(kMaxNameBytes + 1, 'n'), &b}};
             return x;
           }(),
       }) {
    EXPECT_EQ(store.commit_round(r).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(round_numbers(store).empty());
  {
    Database raw = raw_connection(db);
    EXPECT_EQ(count_rows(raw, "tensors"), 0);
    EXPECT_EQ(count_rows(raw, "tensor_chunks"), 0) << "the chunks written before the refusal were rolled back";
  }
  RoundToCommit ok = simple_round(1, nullptr);
  ok.tensors = {{"model", "w", &a}, {"optimizer", "w", &b}, {"model", "v", &b}};
  ASSERT_TRUE(store.commit_round(ok).is_ok());
  auto loaded = store.load_latest();
  ASSERT_TRUE(loaded.is_ok());
  EXPECT_TRUE(same_bytes(loaded->find("model", "w")->value, a));
  EXPECT_TRUE(same_bytes(loaded->find("optimizer", "w")->value, b));
}

// A commit refused at its very end (a bad peer, after tensors, applied
// updates and counters were written) leaves every table as it was.
TEST_P(StoreByMaintenance, ARefusedCommitLeavesTheStoreUnchanged) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam(), 2));
  const Tensor t = random_tensor({3 * kMiB / 4}, DType::kF32, 12);
  const std::vector<uint8_t> id1 = {1, 1, 1}, id2 = {2, 2, 2};
  ASSERT_TRUE(store.add_pending_update({id1, "site-a", 0, 10, "", 0}, random_bytes(100, 1)).is_ok());
  ASSERT_TRUE(store.add_pending_update({id2, "site-b", 0, 10, "", 0}, random_bytes(100, 2)).is_ok());
  RoundToCommit first = simple_round(1, &t);
  first.peers = std::vector<PeerRecord>{{"site-a", "tcp://a:1", "alive", 1, 1}};
  first.replay_counters = {{"site-a", 5}};
  first.applied_updates = {{id1, "site-a", 0}};
  ASSERT_TRUE(store.commit_round(first).is_ok());
  ASSERT_TRUE(store.set_meta("config", "{\"lr\":0.1}").is_ok());
  ASSERT_TRUE(store.settle().is_ok());

  auto snapshot = [&] {
    Database raw = raw_connection(db);
    std::vector<int64_t> counts;
    for (const char* table : {"rounds", "tensors", "tensor_chunks", "peers", "replay_counters", "pending_updates",
                              "pending_update_chunks", "applied_updates", "meta"}) {
      counts.push_back(count_rows(raw, table));
    }
    return counts;
  };
  const std::vector<int64_t> before = snapshot();

  RoundToCommit bad = simple_round(2, &t);
  bad.applied_updates = {{id2, "site-b", 1}};
  bad.replay_counters = {{"site-a", 9}, {"site-b", 3}};
  bad.peers = std::vector<PeerRecord>{{"site-a", "tcp://a:1", "alive", 2, 2}, {"site-b", "tcp://b:1", "sleepy", 1, 2}};
  Status s = store.commit_round(bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "sleepy")) << s.message();

  RoundToCommit listed_twice = simple_round(2, &t);
  listed_twice.applied_updates = {{id2, "site-b", 1}, {id2, "site-b", 1}};
  s = store.commit_round(listed_twice);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "twice")) << s.message();

  RoundToCommit peer_twice = simple_round(2, &t);
  peer_twice.peers = std::vector<PeerRecord>{{"site-c", "x", "alive", 1, 2}, {"site-c", "y", "dead", 1, 2}};
  EXPECT_EQ(store.commit_round(peer_twice).code(), StatusCode::kInvalidArgument);

  RoundToCommit empty_id = simple_round(2, &t);
  empty_id.applied_updates = {{{}, "site-b", 1}};
  EXPECT_EQ(store.commit_round(empty_id).code(), StatusCode::kInvalidArgument);

  RoundToCommit empty_sender = simple_round(2, &t);
  empty_sender.replay_counters = {{"", 4}};
  EXPECT_EQ(store.commit_round(empty_sender).code(), StatusCode::kInvalidArgument);

  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_EQ(snapshot(), before);
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{1}));
  EXPECT_EQ(store.pending_updates().value().size(), 1u);
  EXPECT_FALSE(store.applied_round(id2).value().has_value());
  EXPECT_EQ(store.replay_counters().value(), (std::map<std::string, uint64_t>{{"site-a", 5}}));
  ASSERT_EQ(store.peers().value().size(), 1u);
  EXPECT_EQ(store.peers().value()[0].incarnation, 1);

  // The next valid commit goes through as if nothing had happened.
  RoundToCommit good = simple_round(2, &t);
  good.applied_updates = {{id2, "site-b", 1}};
  ASSERT_TRUE(store.commit_round(good).is_ok());
  EXPECT_EQ(store.applied_round(id2).value(), std::optional<int64_t>(2));
  EXPECT_TRUE(store.pending_updates().value().empty());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(store.verify_round(2).is_ok());
}

TEST(CheckpointStoreOptions, BadOptionsAreRefusedBeforeAnythingIsWritten) {
  const auto dir = fresh_directory();
  for (const StoreOptions& options : {options_with(true, 0), options_with(false, -3),
                                      options_with(true, 3, "acc'); DROP TABLE rounds; --"),
                                      options_with(true, 3, "test.accuracy"), options_with(true, 3, "a b")}) {
    auto store = CheckpointStore::open((dir / "store.db").string(), options);
    EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument) << options.best_metric;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "store.db"));
  EXPECT_TRUE(CheckpointStore::open((dir / "store.db").string(), options_with(true, 1, "Top_1_acc")).is_ok());
}

TEST(CheckpointStoreMeta, MetaIsSetReplacedAndDurable) {
  const auto db = fresh_directory() / "store.db";
  {
    CheckpointStore store = open_store(db);
    EXPECT_FALSE(store.meta("config").value().has_value());
    ASSERT_TRUE(store.set_meta("config", "first").is_ok());
    ASSERT_TRUE(store.set_meta("config", "second").is_ok());
    ASSERT_TRUE(store.set_meta("empty", "").is_ok());
    EXPECT_EQ(store.set_meta("", "x").code(), StatusCode::kInvalidArgument);
  }
  CheckpointStore store = open_store(db);
  EXPECT_EQ(store.meta("config").value(), std::optional<std::string>("second"));
  EXPECT_EQ(store.meta("empty").value(), std::optional<std::string>(""));
}

// ---------------------------------------------------------------------------
// 3. Corruption.

// Flips one bit in the middle of the only occurrence of `needle` in `file`.
void flip_inside_only_occurrence(const std::filesystem::path& file, std::span<const uint8_t> needle) {
  std::string bytes = read_file(file);
  const std::string pattern(reinterpret_cast<const char*>(needle.data()), needle.size());
  const size_t at = bytes.find(pattern);
  ASSERT_NE(at, std::string::npos) << "the tensor's bytes are not in " << file;
  ASSERT_EQ(bytes.find(pattern, at + 1), std::string::npos) << "the tensor's bytes are in the file twice";
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekp(static_cast<std::streamoff>(at + needle.size() / 2));
  const char flipped = static_cast<char>(bytes[at + needle.size() / 2] ^ 0x04);
  stream.write(&flipped, 1);
  ASSERT_TRUE(stream.good());
}

TEST_P(StoreByMaintenance, AFlippedByteOnDiskIsFoundByRoundAndTensorAndTheOlderRoundIsLoaded) {
  const auto dir = fresh_directory();
  const auto db = dir / "store.db";
  const Tensor old_weights = random_tensor({1000}, DType::kF32, 20);
  const Tensor new_weights = random_tensor({kMiB / 2 + 100}, DType::kF16, 21);  // 2 chunks
  const Tensor bias = random_tensor({10}, DType::kF32, 22);
  {
    CheckpointStore store = open_store(db, options_with(GetParam(), 5));
    RoundToCommit r1 = simple_round(1, &old_weights);
    r1.tensors.push_back({"model", "fc.bias", &bias});
    ASSERT_TRUE(store.commit_round(r1).is_ok());
    RoundToCommit r2 = simple_round(2, nullptr);
    r2.tensors = {{"model", "fc.bias", &bias}, {"model", "fc.weight", &new_weights}};
    ASSERT_TRUE(store.commit_round(r2).is_ok());
  }
  ASSERT_TRUE(wal_is_gone_or_empty(db)) << "the last connection's close leaves everything in the database file";
  // 64 bytes from the second chunk of the new weights.
  const auto* bytes = static_cast<const uint8_t*>(new_weights.raw());
  flip_inside_only_occurrence(db, std::span<const uint8_t>(bytes + kMiB + 40, 64));
  if (HasFatalFailure()) return;

  CheckpointStore store = open_store(db, options_with(GetParam(), 5));
  EXPECT_TRUE(store.integrity_check().is_ok()) << "SQLite does not checksum blob bytes; the store does";
  const Status s = store.verify_round(2);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(s, "round 2")) << s.message();
  EXPECT_TRUE(contains(s, "model/fc.weight")) << s.message();
  EXPECT_TRUE(contains(s, "checksum")) << s.message();
  EXPECT_TRUE(store.verify_round(1).is_ok());
  EXPECT_EQ(store.load_round(2).status().code(), StatusCode::kCorrupt);

  // The intact tensor of the corrupt round still streams; the corrupt one does not.
  auto infos = store.tensors(2);
  ASSERT_TRUE(infos.is_ok());
  ASSERT_EQ(infos->size(), 2u);
  auto ignore = [](std::span<const uint8_t>) { return Status::ok(); };
  EXPECT_TRUE(store.read_tensor((*infos)[0], ignore).is_ok());
  EXPECT_EQ(store.read_tensor((*infos)[1], ignore).code(), StatusCode::kCorrupt);

  std::vector<Status> skipped;
  auto loaded = store.load_latest(&skipped);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->round.round, 1);
  EXPECT_TRUE(same_bytes(loaded->find("model", "w")->value, old_weights));
  EXPECT_TRUE(same_bytes(loaded->find("model", "fc.bias")->value, bias));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(skipped[0], "round 2")) << skipped[0].message();
  EXPECT_TRUE(contains(skipped[0], "model/fc.weight")) << skipped[0].message();

  // A new round after the corrupt one is the latest again.
  ASSERT_TRUE(store.commit_round(simple_round(3, &bias)).is_ok());
  skipped.clear();
  auto latest = store.load_latest(&skipped);
  ASSERT_TRUE(latest.is_ok());
  EXPECT_EQ(latest->round.round, 3);
  EXPECT_TRUE(skipped.empty());
}

TEST(CheckpointStoreCorruption, EditedRowsBreakTheRoundChecksum) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(true, 10));
  const Tensor t = random_tensor({64}, DType::kF32, 30);
  for (int64_t r = 1; r <= 5; ++r) {
    ASSERT_TRUE(store.commit_round(simple_round(r, &t, R"({"test_accuracy":0.25})")).is_ok());
  }
  struct Edit {
    int64_t round;
    std::string sql, expect;
  };
  const std::vector<Edit> edits = {
      {5, R"(UPDATE rounds SET metrics = '{"test_accuracy":0.99}' WHERE round = 5)", "round checksum"},
      {4, R"(UPDATE rounds SET state = '{"step":400}' WHERE round = 4)", "round checksum"},
      {3, "UPDATE rounds SET model_version = 7 WHERE round = 3", "round checksum"},
      {2, "UPDATE tensors SET name = 'v' WHERE round = 2", "round checksum"},
      {1, "UPDATE tensors SET dtype = 'bf16', shape = '[128]' WHERE round = 1", "round checksum"},
  };
  {
    Database raw = raw_connection(db);
    for (const Edit& edit : edits) ASSERT_TRUE(raw.execute(edit.sql).is_ok()) << edit.sql;
  }
  for (const Edit& edit : edits) {
    const Status s = store.verify_round(edit.round);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << edit.sql;
    EXPECT_TRUE(contains(s, "round " + std::to_string(edit.round))) << s.message();
    EXPECT_TRUE(contains(s, edit.expect)) << s.message();
  }
  std::vector<Status> skipped;
  auto latest = store.load_latest(&skipped);
  EXPECT_EQ(latest.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(latest.status(), "every one of the 5")) << latest.status().message();
  EXPECT_EQ(skipped.size(), 5u);
}

// Tensors are checksummed with BLAKE2bp-256 (33 bytes stored: the kind
// byte 1, then the hash), and a round written before that (BLAKE2b-256
// checksums of 32 bytes, a round checksum without the kind) still loads
// and verifies; a checksum of another kind or length is reported as damage.
TEST(CheckpointStoreChecksums, TensorsAreBlake2bpAndBlake2bRoundsStillVerify) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(false, 10));
  const Tensor t = random_tensor({3000}, DType::kF32, 31);
  ASSERT_TRUE(store.commit_round(simple_round(1, &t)).is_ok());
  ASSERT_TRUE(store.commit_round(simple_round(2, &t)).is_ok());
  ASSERT_TRUE(store.commit_round(simple_round(3, &t)).is_ok());
  const std::span<const uint8_t> bytes(static_cast<const uint8_t*>(t.raw()), t.nbytes());
  auto infos = store.tensors(1);
  ASSERT_TRUE(infos.is_ok());
  ASSERT_EQ(infos->size(), 1u);
  EXPECT_EQ((*infos)[0].checksum_kind, fedmesh::crypto::ChunkHash::kBlake2bp);
  EXPECT_EQ((*infos)[0].checksum, fedmesh::crypto::tree_hash(bytes));
  Database raw = raw_connection(db);
  EXPECT_EQ(*raw.query_int("SELECT length(checksum) FROM tensors WHERE round = 1"), 33);

  // Round 1 as a fedmesh before BLAKE2bp wrote it: the tensor's BLAKE2b, the
  // round checksum over the records without a kind.
  const fedmesh::crypto::Hash old_checksum = fedmesh::crypto::hash_bytes(bytes);
  const TensorInfo& info = (*infos)[0];
  RoundInfo round = store.rounds().value()[0];
  fedmesh::crypto::Hasher hasher;
  hasher.update_text("fedmesh-round-v1");
  hasher.update_u64(static_cast<uint64_t>(round.round));
  hasher.update_u64(static_cast<uint64_t>(round.model_version));
  hasher.update_text(round.metrics_json);
  hasher.update_text(round.state_json);
  hasher.update_u64(1);
  hasher.update_text(info.role);
  hasher.update_text(info.name);
  hasher.update_text("fp32");
  hasher.update_text("[3000]");
  hasher.update_text(info.encoding);
  hasher.update_u64(static_cast<uint64_t>(info.byte_size));
  hasher.update(old_checksum);
  const fedmesh::crypto::Hash old_round = hasher.finish();
  {
    auto set = raw.prepare("UPDATE tensors SET checksum = ?1 WHERE round = 1");
    ASSERT_TRUE(set.is_ok());
    ASSERT_TRUE(set->bind_blob(1, old_checksum).run().is_ok());
    auto set_round = raw.prepare("UPDATE rounds SET checksum = ?1 WHERE round = 1");
    ASSERT_TRUE(set_round.is_ok());
    ASSERT_TRUE(set_round->bind_blob(1, old_round).run().is_ok());
  }
  EXPECT_TRUE(store.verify_round(1).is_ok()) << store.verify_round(1).to_string();
  auto old = store.load_round(1);
  ASSERT_TRUE(old.is_ok()) << old.status().to_string();
  EXPECT_EQ(old->tensors[0].info.checksum_kind, fedmesh::crypto::ChunkHash::kBlake2b);
  EXPECT_EQ(std::memcmp(old->tensors[0].value.raw(), t.raw(), t.nbytes()), 0);

  // A BLAKE2bp checksum relabeled BLAKE2b (its kind byte dropped), and an
  // unknown kind byte: damage, named.
  ASSERT_TRUE(raw.execute("UPDATE tensors SET checksum = substr(checksum, 2) WHERE round = 2").is_ok());
  ASSERT_TRUE(raw.execute("UPDATE tensors SET checksum = X'02' || substr(checksum, 2) WHERE round = 3").is_ok());
  const Status relabeled = store.verify_round(2);
  EXPECT_EQ(relabeled.code(), StatusCode::kCorrupt);
  const Status unknown = store.verify_round(3);
  EXPECT_EQ(unknown.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(unknown, "neither a BLAKE2b-256")) << unknown.message();
}

// Pending updates are checksummed with BLAKE2bp (33 bytes: the kind byte
// 1 first); one a fedmesh before schema version 9 wrote (its 32-byte
// BLAKE2b) still reads, verifies and is recognized when sent again, and a
// checksum of the wrong kind or size is damage.
TEST(CheckpointStoreChecksums, PendingUpdatesAreBlake2bpAndBlake2bOnesStillVerify) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(false, 10));
  std::vector<uint8_t> payload(3 * 1024 * 1024 + 17);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + i / 1000);
  for (const uint8_t id : {1, 2, 3}) {
    ASSERT_TRUE(store.add_pending_update({{id}, "site-a", 3, 10, "", 0}, payload).is_ok());
  }
  Database raw = raw_connection(db);
  EXPECT_EQ(*raw.query_int("SELECT count(*) FROM pending_updates WHERE length(checksum) = 33"), 3);
  {
    auto checksum = raw.prepare("SELECT checksum FROM pending_updates WHERE update_id = X'01'");
    ASSERT_TRUE(checksum.is_ok());
    ASSERT_TRUE(*checksum->step());
    const std::span<const uint8_t> blob = checksum->column_blob(0);
    ASSERT_EQ(blob.size(), 33u);
    EXPECT_EQ(blob[0], 1);
    const fedmesh::crypto::Hash expected = fedmesh::crypto::tree_hash(payload);
    EXPECT_EQ(std::memcmp(blob.data() + 1, expected.data(), expected.size()), 0);
  }
  // Update 1 as an older fedmesh wrote it.
  {
    auto set = raw.prepare("UPDATE pending_updates SET checksum = ?1 WHERE update_id = X'01'");
    ASSERT_TRUE(set.is_ok());
    ASSERT_TRUE(set->bind_blob(1, fedmesh::crypto::hash_bytes(payload)).run().is_ok());
  }
  EXPECT_TRUE(store.verify_pending_updates().is_ok());
  auto read = store.read_pending_update(std::vector<uint8_t>{1});
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  EXPECT_EQ(*read, payload);
  // Sent again with the same bytes: taken (hashed with the kind it was stored
  // with); with other bytes: refused.
  EXPECT_TRUE(store.add_pending_update({{1}, "site-a", 3, 10, "", 0}, payload).is_ok());
  std::vector<uint8_t> other = payload;
  other[12345] ^= 1;
  const Status different = store.add_pending_update({{1}, "site-a", 3, 10, "", 0}, other);
  EXPECT_TRUE(contains(different, "already pending with different bytes")) << different.to_string();
  const Status different_new = store.add_pending_update({{2}, "site-a", 3, 10, "", 0}, other);
  EXPECT_TRUE(contains(different_new, "already pending with different bytes")) << different_new.to_string();
  // Relabeled (the kind byte dropped) and an unknown kind: damage.
  ASSERT_TRUE(raw.execute("UPDATE pending_updates SET checksum = substr(checksum, 2) WHERE update_id = X'02'").is_ok());
  ASSERT_TRUE(
      raw.execute("UPDATE pending_updates SET checksum = X'02' || substr(checksum, 2) WHERE update_id = X'03'").is_ok());
  EXPECT_EQ(store.read_pending_update(std::vector<uint8_t>{2}).status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(store.read_pending_update(std::vector<uint8_t>{3}).status().code(), StatusCode::kCorrupt);
  std::vector<CheckpointStore::DamagedPending> damaged;
  EXPECT_EQ(store.verify_pending_updates(&damaged).code(), StatusCode::kCorrupt);
  EXPECT_EQ(damaged.size(), 2u);
}

TEST(CheckpointStoreCorruption, MissingOrExtraRowsAreCorruptNotACrash) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(false, 10));
  const Tensor t = random_tensor({3 * kMiB / 4}, DType::kF32, 31);  // 3 chunks
  for (int64_t r = 1; r <= 6; ++r) ASSERT_TRUE(store.commit_round(simple_round(r, &t)).is_ok());
  auto id_of = [&](int64_t round) { return store.tensors(round).value().at(0).id; };
  const std::string id2 = std::to_string(id_of(2)), id3 = std::to_string(id_of(3)), id5 = std::to_string(id_of(5));
  {
    Database raw = raw_connection(db);
    ASSERT_TRUE(raw.execute("PRAGMA foreign_keys = OFF").is_ok());
    ASSERT_TRUE(raw.execute("DELETE FROM tensor_chunks WHERE tensor_id = " + id2 + " AND chunk = 1").is_ok());
    ASSERT_TRUE(raw.execute("DELETE FROM tensor_chunks WHERE tensor_id = " + id3 + " AND chunk = 2").is_ok());
    ASSERT_TRUE(raw.execute("DELETE FROM tensors WHERE round = 4").is_ok());
    ASSERT_TRUE(raw.execute("UPDATE tensor_chunks SET data = CAST(data || x'00' AS BLOB) WHERE tensor_id = " + id5 +
                            " AND chunk = 2").is_ok());
    ASSERT_TRUE(raw.execute("UPDATE tensors SET chunk_count = 9 WHERE round = 6").is_ok());
  }
  const std::vector<std::pair<int64_t, std::string>> expected = {
      {2, "chunk 1 is missing"}, {3, "recorded"}, {4, "0 tensors found, 1 recorded"}, {5, "more bytes"},
      {6, "9 chunks"}};
  for (const auto& [round, what] : expected) {
    const Status s = store.verify_round(round);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << round;
    EXPECT_TRUE(contains(s, "round " + std::to_string(round))) << s.message();
    EXPECT_TRUE(contains(s, what)) << s.message();
  }
  std::vector<Status> skipped;
  auto latest = store.load_latest(&skipped);
  ASSERT_TRUE(latest.is_ok()) << latest.status().to_string();
  EXPECT_EQ(latest->round.round, 1);
  EXPECT_EQ(skipped.size(), 5u);
}

TEST(CheckpointStoreCorruption, AFileThatIsNotSqliteIsRefusedWithAClearError) {
  const auto dir = fresh_directory();
  const auto garbage = dir / "random.db";
  {
    const std::vector<uint8_t> bytes = random_bytes(256 * 1024, 40);
    std::ofstream out(garbage, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  const std::string before = read_file(garbage);
  for (bool inspect : {false, true}) {
    auto store = inspect ? CheckpointStore::open_existing(garbage.string()) : CheckpointStore::open(garbage.string());
    ASSERT_FALSE(store.is_ok());
    EXPECT_EQ(store.status().code(), StatusCode::kCorrupt) << store.status().to_string();
    EXPECT_TRUE(contains(store.status(), garbage.string())) << store.status().message();
    EXPECT_TRUE(contains(store.status(), "not a database")) << store.status().message();
  }
  EXPECT_EQ(read_file(garbage), before) << "a refused file is not written";
  EXPECT_TRUE(wal_is_gone_or_empty(garbage));
  // The owner lock of the refused open was released: a real store at a new path works and so does a retry.
  EXPECT_EQ(CheckpointStore::open(garbage.string()).status().code(), StatusCode::kCorrupt);

  // A short file of text, and an empty file (which SQLite treats as a new database).
  const auto text = dir / "text.db";
  { std::ofstream(text) << "hello, this is not a database\n"; }
  EXPECT_FALSE(CheckpointStore::open(text.string()).is_ok());
  const auto empty = dir / "empty.db";
  { std::ofstream touch(empty); }
  auto fresh = CheckpointStore::open(empty.string());
  ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
  EXPECT_EQ(fresh->load_latest().status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(fresh->integrity_check().is_ok());

  EXPECT_EQ(CheckpointStore::open_existing((dir / "absent.db").string()).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(dir / "absent.db"));
  EXPECT_FALSE(CheckpointStore::open((dir / "no" / "such" / "dir.db").string()).is_ok());
}

TEST(CheckpointStoreCorruption, IntegrityCheckIsOkOnAHealthyStoreAndReportsADamagedOne) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({kMiB}, DType::kF32, 41);  // 4 chunks
  {
    CheckpointStore store = open_store(db, options_with(true, 2));
    for (int64_t r = 1; r <= 4; ++r) ASSERT_TRUE(store.commit_round(simple_round(r, &t)).is_ok());
    ASSERT_TRUE(store.settle().is_ok());
    EXPECT_TRUE(store.integrity_check().is_ok());
  }
  // Damage the b-tree page header of the rounds table (not blob bytes): SQLite itself sees that.
  int64_t page_size = 0, root = 0;
  {
    Database raw = raw_connection(db);
    page_size = *raw.query_int("PRAGMA page_size");
    root = *raw.query_int("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = 'rounds'");
  }
  ASSERT_EQ(page_size, 65536) << "a new store uses 64 KiB pages";
  ASSERT_GT(root, 1);
  {
    std::fstream stream(db, std::ios::in | std::ios::out | std::ios::binary);
    stream.seekp(static_cast<std::streamoff>((root - 1) * page_size));  // the page type byte
    const char bad = 0x11;
    stream.write(&bad, 1);
    ASSERT_TRUE(stream.good());
  }
  // Its owner refuses to write on it, naming SQLite's findings and the way out.
  const auto owned = CheckpointStore::open(db.string());
  ASSERT_FALSE(owned.is_ok()) << "a store that fails SQLite's check was opened for writing";
  EXPECT_EQ(owned.status().code(), StatusCode::kCorrupt) << owned.status().to_string();
  EXPECT_TRUE(contains(owned.status(), "integrity check of the store failed")) << owned.status().to_string();
  EXPECT_TRUE(contains(owned.status(), "checkpoint verify")) << owned.status().to_string();
  // An operator still opens it to see what is intact.
  auto store = CheckpointStore::open_existing(db.string());
  ASSERT_TRUE(store.is_ok()) << "the schema and its version are intact: " << store.status().to_string();
  const Status s = store->integrity_check();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  const auto latest = store->load_latest();
  EXPECT_EQ(latest.status().code(), StatusCode::kCorrupt) << latest.status().to_string();
}

// Hooks into every SQLite connection this process opens (the store's own
// are private): a callback when a statement starts.
class StatementHook {
 public:
  using Callback = std::function<void(sqlite3* db, const std::string& sql)>;
  explicit StatementHook(Callback callback) {
    callback_() = std::move(callback);
    EXPECT_EQ(sqlite3_auto_extension(reinterpret_cast<void (*)()>(&StatementHook::install)), SQLITE_OK);
  }
  ~StatementHook() {
    sqlite3_cancel_auto_extension(reinterpret_cast<void (*)()>(&StatementHook::install));
    callback_() = nullptr;
  }

 private:
  static Callback& callback_() {
    static Callback callback;
    return callback;
  }
  static int install(sqlite3* db, const char**, const sqlite3_api_routines*) {
    sqlite3_trace_v2(db, SQLITE_TRACE_STMT, &StatementHook::trace, nullptr);
    return SQLITE_OK;
  }
  static int trace(unsigned, void*, void* statement, void*) {
    if (callback_()) {
      auto* stmt = static_cast<sqlite3_stmt*>(statement);
      callback_()(sqlite3_db_handle(stmt), sqlite3_sql(stmt));
    }
    return 0;
  }
};

// A read that fails for a reason other than corruption (here an interrupt;
// in life an I/O error, a full disk on a temp file, no memory) is returned as
// what it is: load_latest must not skip the newest round as corrupt and
// silently hand back an older one.
TEST(CheckpointStoreCorruption, AFailedReadIsNotReportedAsACorruptRound) {
  const auto db = fresh_directory() / "store.db";
  const Tensor old_weights = random_tensor({100}, DType::kF32, 50);
  const Tensor new_weights = random_tensor({100}, DType::kF32, 51);
  {
    CheckpointStore store = open_store(db, options_with(false, 5));
    ASSERT_TRUE(store.commit_round(simple_round(1, &old_weights)).is_ok());
    ASSERT_TRUE(store.commit_round(simple_round(2, &new_weights)).is_ok());
  }
  bool armed = false;
  int interrupted = 0;
  StatementHook hook([&](sqlite3* connection, const std::string& sql) {
    if (armed && sql.rfind("SELECT chunk, data FROM tensor_chunks", 0) == 0) {
      armed = false;
      ++interrupted;
      sqlite3_interrupt(connection);
    }
  });
  CheckpointStore hooked = open_store(db, options_with(false, 5));  // opened after the hook: its connection is hooked
  armed = true;
  std::vector<Status> skipped;
  auto loaded = hooked.load_latest(&skipped);
  EXPECT_EQ(interrupted, 1);
  EXPECT_FALSE(loaded.is_ok() && loaded->round.round == 1)
      << "an interrupted read of round 2 made load_latest fall back to round 1; skipped: "
      << (skipped.empty() ? std::string("none") : skipped[0].to_string());
  EXPECT_TRUE(skipped.empty()) << skipped[0].to_string();
  if (!loaded.is_ok()) {
    EXPECT_NE(loaded.status().code(), StatusCode::kCorrupt) << loaded.status().to_string();
  }

  armed = true;
  const Status verify = hooked.verify_round(2);
  EXPECT_EQ(interrupted, 2);
  EXPECT_NE(verify.code(), StatusCode::kCorrupt) << verify.to_string();
  EXPECT_FALSE(verify.is_ok());
  // Without the fault, all is well.
  EXPECT_TRUE(hooked.verify_round(2).is_ok());
  EXPECT_EQ(hooked.load_latest().value().round.round, 2);
}

// A round is read in one snapshot: retention (on the store's maintenance
// connection, or by the owner while an operator inspects the store) deleting
// it half-way through a load must not make it look corrupt. The deletion is
// made when the load starts each of its statements in turn.
class SnapshotTest : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(DeletedBefore, SnapshotTest,
                         ::testing::Values("SELECT id, role, name", "SELECT checksum FROM rounds",
                                           "SELECT chunk, data FROM tensor_chunks"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           return std::string(param.index == 0 ? "TensorRecords"
                                              : param.index == 1 ? "RoundChecksum"
                                                                 : "Chunks");
                         });

TEST_P(SnapshotTest, ARoundDeletedWhileItIsLoadedIsNotReportedCorrupt) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t1 = random_tensor({3 * kMiB / 8}, DType::kF32, 52);  // 2 chunks
  const Tensor t2 = random_tensor({100}, DType::kF32, 53);
  {
    CheckpointStore store = open_store(db, options_with(false, 5));
    ASSERT_TRUE(store.commit_round(simple_round(1, &t1)).is_ok());
    ASSERT_TRUE(store.commit_round(simple_round(2, &t2)).is_ok());
  }
  const std::string trigger = GetParam();
  bool armed = false;
  int deletions = 0;
  int64_t doomed = 1;
  std::optional<Database> writer;
  StatementHook hook([&](sqlite3*, const std::string& sql) {
    if (armed && sql.rfind(trigger, 0) == 0) {
      armed = false;
      // As retention does (its tensors and chunks go by cascade).
      const Status s = writer->execute("DELETE FROM rounds WHERE round = " + std::to_string(doomed));
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      ++deletions;
    }
  });
  auto inspector = CheckpointStore::open_existing(db.string(), options_with(false, 5));
  ASSERT_TRUE(inspector.is_ok()) << inspector.status().to_string();
  writer.emplace(raw_connection(db));
  ASSERT_TRUE(writer->execute("PRAGMA foreign_keys = ON").is_ok());
  armed = true;
  auto loaded = inspector->load_round(1);
  EXPECT_EQ(deletions, 1);
  if (loaded.is_ok()) {
    EXPECT_TRUE(same_bytes(loaded->find("model", "w")->value, t1)) << "the snapshot before the deletion";
  } else {
    EXPECT_NE(loaded.status().code(), StatusCode::kCorrupt) << loaded.status().to_string();
  }
  // Afterwards round 1 is simply gone.
  EXPECT_EQ(inspector->load_round(1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(round_numbers(*inspector), (std::vector<int64_t>{2}));

  // load_latest: the newest round deleted (keep_last = 1 on the owner's side) while it is loaded.
  doomed = 2;
  deletions = 0;
  armed = true;
  std::vector<Status> skipped;
  auto latest = inspector->load_latest(&skipped);
  EXPECT_EQ(deletions, 1);
  EXPECT_TRUE(skipped.empty()) << skipped[0].to_string();
  if (latest.is_ok()) {
    EXPECT_EQ(latest->round.round, 2);
    EXPECT_TRUE(same_bytes(latest->find("model", "w")->value, t2));
  } else {
    EXPECT_NE(latest.status().code(), StatusCode::kCorrupt) << latest.status().to_string();
  }
  writer.reset();
}

// A commit whose write fails for a reason outside the caller's arguments (an
// interrupt here; a full disk in life) says so, and is not blamed on the
// caller as an update or peer "listed twice".
TEST(CheckpointStoreCorruption, AFailedWriteIsNotBlamedOnTheArguments) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({100}, DType::kF32, 54);
  std::string trigger;
  int interrupted = 0;
  StatementHook hook([&](sqlite3* connection, const std::string& sql) {
    if (!trigger.empty() && sql.rfind(trigger, 0) == 0) {
      trigger.clear();
      ++interrupted;
      sqlite3_interrupt(connection);
    }
  });
  CheckpointStore store = open_store(db, options_with(false, 5));
  ASSERT_TRUE(store.commit_round(simple_round(1, &t)).is_ok());
  for (const char* statement : {"INSERT INTO applied_updates", "INSERT INTO peers", "INSERT INTO tensors"}) {
    SCOPED_TRACE(statement);
    RoundToCommit r = simple_round(2, &t);
    r.applied_updates = {{{1, 2, 3}, "site-a", 0}};
    r.peers = std::vector<PeerRecord>{{"site-a", "tcp://a:1", "alive", 1, 2}};
    trigger = statement;
    const Status s = store.commit_round(r);
    EXPECT_EQ(interrupted, 1);
    interrupted = 0;
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_FALSE(contains(s, "twice")) << s.to_string();
    EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{1}));
    EXPECT_FALSE(store.applied_round(std::vector<uint8_t>{1, 2, 3}).value().has_value());
    EXPECT_TRUE(store.peers().value().empty());
  }
  RoundToCommit r = simple_round(2, &t);
  r.applied_updates = {{{1, 2, 3}, "site-a", 0}};
  ASSERT_TRUE(store.commit_round(r).is_ok()) << "nothing of the failed commits stayed behind";
}

// ---------------------------------------------------------------------------
// 4. Retention.

std::string accuracy_json(double accuracy) { return R"({"test_accuracy":)" + std::to_string(accuracy) + "}"; }

TEST_P(StoreByMaintenance, RetentionKeepsTheLastThreeAndTheHighest) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam(), 3, "test_accuracy", true));
  const Tensor t = random_tensor({300}, DType::kF32, 60);
  const double accuracy[] = {0.1, 0.5, 0.2, 0.95, 0.3, 0.4, 0.6, 0.7, 0.65, 0.5};
  for (int r = 1; r <= 10; ++r) {
    ASSERT_TRUE(store.commit_round(simple_round(r, &t, accuracy_json(accuracy[r - 1]))).is_ok());
  }
  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{4, 8, 9, 10}));
  Database raw = raw_connection(db);
  EXPECT_EQ(count_rows(raw, "tensors"), 4) << "deleted rounds take their tensors";
  EXPECT_EQ(count_rows(raw, "tensor_chunks"), 4);
  for (int64_t r : {4, 8, 9, 10}) EXPECT_TRUE(store.verify_round(r).is_ok()) << r;
}

TEST_P(StoreByMaintenance, RetentionKeepsTheLastThreeAndTheLowestWhenLowerIsBetter) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam(), 3, "val_loss", false));
  const Tensor t = random_tensor({300}, DType::kF32, 61);
  const double loss[] = {2.0, 1.5, 0.25, 0.9, 1.1, 0.8, 0.7, 0.6, 0.5, 0.4};
  for (int r = 1; r <= 10; ++r) {
    ASSERT_TRUE(store.commit_round(simple_round(r, &t, R"({"val_loss":)" + std::to_string(loss[r - 1]) + "}")).is_ok());
  }
  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{3, 8, 9, 10}));
}

TEST_P(StoreByMaintenance, RetentionEdgeCases) {
  const auto dir = fresh_directory();
  const Tensor t = random_tensor({30}, DType::kF32, 62);
  {  // The best among the last three: only three survive.
    CheckpointStore store = open_store(dir / "a.db", options_with(GetParam(), 3, "test_accuracy"));
    for (int r = 1; r <= 6; ++r) ASSERT_TRUE(store.commit_round(simple_round(r, &t, accuracy_json(r * 0.1))).is_ok());
    ASSERT_TRUE(store.settle().is_ok());
    EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{4, 5, 6}));
  }
  {  // A tie keeps the newest best; rounds without the metric, or with a non-number, are never best.
    CheckpointStore store = open_store(dir / "b.db", options_with(GetParam(), 2, "test_accuracy"));
    const std::vector<std::string> metrics = {accuracy_json(0.9), accuracy_json(0.9), R"({"test_accuracy":"1.5"})",
                                              R"({"other":5})", accuracy_json(0.5), R"({"test_accuracy":null})",
                                              "{}"};
    for (size_t i = 0; i < metrics.size(); ++i) {
      ASSERT_TRUE(store.commit_round(simple_round(static_cast<int64_t>(i + 1), &t, metrics[i])).is_ok());
    }
    ASSERT_TRUE(store.settle().is_ok());
    EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{2, 6, 7}));
  }
  {  // No best metric, keep_last = 1: only the newest.
    CheckpointStore store = open_store(dir / "c.db", options_with(GetParam(), 1));
    for (int r = 1; r <= 5; ++r) ASSERT_TRUE(store.commit_round(simple_round(r, &t, accuracy_json(1.0 / r))).is_ok());
    ASSERT_TRUE(store.settle().is_ok());
    EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{5}));
    EXPECT_EQ(store.load_latest().value().round.round, 5);
  }
  {  // Integer metrics order as numbers, negative ones too.
    CheckpointStore store = open_store(dir / "d.db", options_with(GetParam(), 1, "score"));
    const int score[] = {-5, 10, 9, -20, 3};
    for (int r = 1; r <= 5; ++r) {
      ASSERT_TRUE(store.commit_round(simple_round(r, &t, R"({"score":)" + std::to_string(score[r - 1]) + "}")).is_ok());
    }
    ASSERT_TRUE(store.settle().is_ok());
    EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{2, 5}));
  }
}

TEST_P(StoreByMaintenance, SpaceOfDeletedRoundsIsReused) {
  const auto db = fresh_directory() / "store.db";
  CheckpointStore store = open_store(db, options_with(GetParam(), 3, "test_accuracy"));
  const Tensor t = random_tensor({kMiB / 2 + 1000}, DType::kF32, 63);  // ~2 MiB, 3 chunks
  int64_t round = 0;
  for (; round < 5; ++round) {
    ASSERT_TRUE(store.commit_round(simple_round(round, &t, accuracy_json(round == 1 ? 0.99 : 0.1))).is_ok());
  }
  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_TRUE(wal_is_gone_or_empty(db)) << "settle() truncates the log";
  const int64_t five_rounds = store.disk_bytes();
  ASSERT_GT(five_rounds, static_cast<int64_t>(4 * t.nbytes()));
  int64_t largest = 0;
  for (; round < 55; ++round) {
    ASSERT_TRUE(store.commit_round(simple_round(round, &t, accuracy_json(0.1 + round * 0.001))).is_ok());
    largest = std::max(largest, store.disk_bytes());
  }
  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{1, 52, 53, 54}));
  const int64_t settled = store.disk_bytes();
  // Four rounds are kept and a fifth is written before retention deletes one:
  // the file holds about five rounds' pages, as after the first five.
  EXPECT_LE(settled, five_rounds + five_rounds / 2) << "freed pages are reused";
  // Between copies, the log holds about one commit with background
  // maintenance; in-commit, SQLite copies it once it passes 1000 pages.
  constexpr int64_t kAutocheckpointPages = 1000, kPageBytes = 65536, kWalFrameHeaderBytes = 24;
  const int64_t log_bound = GetParam() ? 0 : kAutocheckpointPages * (kPageBytes + kWalFrameHeaderBytes);
  EXPECT_LE(largest, 2 * five_rounds + log_bound) << "file plus log while committing";
  EXPECT_TRUE(store.integrity_check().is_ok());
  EXPECT_TRUE(same_bytes(store.load_round(1).value().find("model", "w")->value, t));
}

// ---------------------------------------------------------------------------
// 5. Updates.

TEST(CheckpointStoreUpdates, ClearingPendingUpdatesRemovesTheirChunksAndKeepsAppliedIds) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> id_a = {0x0a}, id_b = {0x0b};
  {
    CheckpointStore store = open_store(db);
    ASSERT_TRUE(store.add_pending_update({id_a, "site-a", 0, 10, "", 0}, random_bytes(kMiB + 7, 80)).is_ok());
    ASSERT_TRUE(store.add_pending_update({id_b, "site-b", 0, 10, "", 0}, random_bytes(100, 81)).is_ok());
    RoundToCommit round;
    round.round = 1;
    round.applied_updates.push_back({id_a, "site-a", 0});
    ASSERT_TRUE(store.commit_round(round).is_ok());
    ASSERT_EQ(store.pending_updates().value().size(), 1u) << "the applied one left pending in the commit";
    ASSERT_TRUE(store.clear_pending_updates().is_ok());
    EXPECT_TRUE(store.pending_updates().value().empty());
    EXPECT_FALSE(store.read_pending_update(id_b).is_ok());
    EXPECT_EQ(store.applied_round(id_a).value(), std::optional<int64_t>(1)) << "applied ids are not pending rows";
    EXPECT_FALSE(store.add_pending_update({id_a, "site-a", 0, 10, "", 0}, random_bytes(10, 82)).is_ok())
        << "an applied id stays refused after the clear";
  }
  Database raw = raw_connection(db);
  EXPECT_EQ(count_rows(raw, "pending_update_chunks"), 0) << "chunks go with their update";
}

TEST(CheckpointStoreUpdates, APendingUpdateIsDurableAndReadBackWhole) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> big = random_bytes(2 * kMiB + 12345, 70);  // 3 chunks
  const std::vector<uint8_t> exact = random_bytes(kMiB, 71);
  const std::vector<uint8_t> id_big = {0xde, 0xad, 0xbe, 0xef}, id_exact = {0x01}, id_empty = {0x00, 0x00};
  {
    CheckpointStore store = open_store(db);
    ASSERT_TRUE(store.add_pending_update({id_big, "site-a", 3, 128, "ignored", 0}, big).is_ok());
    ASSERT_TRUE(store.add_pending_update({id_exact, "site-b", 4, 64, "", 0}, exact).is_ok());
    ASSERT_TRUE(store.add_pending_update({id_empty, "site-c", 5, 0, "", 0}, {}).is_ok());
    // The store is dropped without settle(): the commit itself made it durable.
  }
  {
    Database raw = raw_connection(db);
    EXPECT_EQ(count_rows(raw, "pending_update_chunks"), 3 + 1 + 0);
  }
  CheckpointStore store = open_store(db);
  auto pending = store.pending_updates();
  ASSERT_TRUE(pending.is_ok());
  ASSERT_EQ(pending->size(), 3u);
  EXPECT_EQ((*pending)[0].update_id, id_big) << "by arrival";
  EXPECT_EQ((*pending)[0].sender, "site-a");
  EXPECT_EQ((*pending)[0].base_version, 3);
  EXPECT_EQ((*pending)[0].sample_count, 128);
  EXPECT_EQ((*pending)[0].byte_size, static_cast<int64_t>(big.size()));
  EXPECT_NE((*pending)[0].received_at, "ignored") << "filled by the store";
  EXPECT_FALSE((*pending)[0].received_at.empty());
  EXPECT_EQ((*pending)[1].update_id, id_exact);
  EXPECT_EQ((*pending)[2].update_id, id_empty);
  EXPECT_EQ((*pending)[2].byte_size, 0);
  EXPECT_EQ(store.read_pending_update(id_big).value(), big);
  EXPECT_EQ(store.read_pending_update(id_exact).value(), exact);
  EXPECT_TRUE(store.read_pending_update(id_empty).value().empty());
  EXPECT_EQ(store.read_pending_update(std::vector<uint8_t>{9, 9}).status().code(), StatusCode::kNotFound);

  EXPECT_EQ(store.add_pending_update({{}, "site-a", 0, 0, "", 0}, big).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.add_pending_update({{7}, "", 0, 0, "", 0}, big).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.add_pending_update({std::vector<uint8_t>(kMaxNameBytes + 1, 1), "s", 0, 0, "", 0}, big).code(),
            StatusCode::kInvalidArgument);
}

// The replay counter protects an update the store holds: a failure at any
// write of add_pending_update leaves neither the update nor its counter, and
// a success leaves both, also across a reopen.
TEST(CheckpointStoreUpdates, AnUpdateAndItsReplayCounterAreStoredTogetherOrNotAtAll) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> payload = random_bytes(kMiB + 9, 73);
  const std::vector<uint8_t> id = {'s', '/', '7'};
  std::string trigger;
  int interrupted = 0;
  StatementHook hook([&](sqlite3* connection, const std::string& sql) {
    if (!trigger.empty() && sql.rfind(trigger, 0) == 0) {
      trigger.clear();
      ++interrupted;
      sqlite3_interrupt(connection);
    }
  });
  {
    CheckpointStore store = open_store(db);
    PendingUpdate update{id, "site-a", 1, 10, "", 0};
    update.replay_sequence = 7;
    for (const char* statement :
         {"INSERT INTO replay_counters", "INSERT INTO pending_updates", "INSERT INTO pending_update_chunks"}) {
      SCOPED_TRACE(statement);
      trigger = statement;
      EXPECT_FALSE(store.add_pending_update(update, payload).is_ok());
      EXPECT_EQ(interrupted, 1);
      interrupted = 0;
      EXPECT_TRUE(store.replay_counters().value().empty()) << "a counter without its update";
      EXPECT_TRUE(store.pending_updates().value().empty());
    }
    ASSERT_TRUE(store.add_pending_update(update, payload).is_ok());
    EXPECT_EQ(store.replay_counters().value().at("site-a"), 7u);
    // A retransmission of the same update keeps the counter; a counter is
    // never lowered by an older update.
    ASSERT_TRUE(store.add_pending_update(update, payload).is_ok());
    PendingUpdate older{{'s', '/', '5'}, "site-a", 1, 10, "", 0};
    older.replay_sequence = 5;
    ASSERT_TRUE(store.add_pending_update(older, random_bytes(10, 74)).is_ok());
    EXPECT_EQ(store.replay_counters().value().at("site-a"), 7u);
  }
  CheckpointStore reopened = open_store(db);
  EXPECT_EQ(reopened.replay_counters().value().at("site-a"), 7u);
  EXPECT_EQ(reopened.read_pending_update(id).value(), payload);
}

// The counter an update raises is its sender key's when one is given: a
// huge sequence under one key leaves another key of the same site at 0.
TEST(CheckpointStoreUpdates, APendingUpdateRaisesItsSenderKeysCounter) {
  const auto dir = fresh_directory();
  CheckpointStore store = open_store(dir / "keys.db");
  const std::string old_key(64, 'a'), new_key(64, 'b');
  PendingUpdate stolen{{'o', '/', '1'}, "site-a", 1, 10, "", 0};
  stolen.replay_sequence = UINT64_MAX;
  stolen.replay_key = old_key;
  ASSERT_TRUE(store.add_pending_update(stolen, random_bytes(10, 75)).is_ok());
  PendingUpdate honest{{'n', '/', '1'}, "site-a", 1, 10, "", 0};
  honest.replay_sequence = 12;
  honest.replay_key = new_key;
  ASSERT_TRUE(store.add_pending_update(honest, random_bytes(10, 76)).is_ok());
  const auto counters = store.replay_counters().value();
  EXPECT_EQ(counters.at(old_key), UINT64_MAX);
  EXPECT_EQ(counters.at(new_key), 12u);
  EXPECT_EQ(counters.count("site-a"), 0u) << "kept by key, not by name";
}

// A pending update whose bytes changed on disk is found by
// verify_pending_updates, named with its sender; the intact one is not.
TEST(CheckpointStoreUpdates, ADamagedPendingUpdateIsFoundByVerification) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> good = {'a', '/', '1'}, bad = {'b', '/', '1'};
  CheckpointStore store = open_store(db);
  ASSERT_TRUE(store.add_pending_update({good, "site-a", 0, 10, "", 0}, random_bytes(100, 75)).is_ok());
  ASSERT_TRUE(store.add_pending_update({bad, "site-b", 0, 10, "", 0}, random_bytes(100, 76)).is_ok());
  EXPECT_TRUE(store.verify_pending_updates().is_ok());
  {
    Database raw = raw_connection(db);
    ASSERT_TRUE(raw.execute("UPDATE pending_update_chunks SET data = zeroblob(100) WHERE update_id = x'622f31'").is_ok());
  }
  std::vector<CheckpointStore::DamagedPending> damaged;
  const Status s = store.verify_pending_updates(&damaged);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.to_string();
  ASSERT_EQ(damaged.size(), 1u);
  EXPECT_EQ(damaged[0].update_id, bad);
  EXPECT_EQ(damaged[0].sender, "site-b");
  EXPECT_NE(damaged[0].reason.find("checksum"), std::string::npos) << damaged[0].reason;
}

// An upload staged on disk (a SpillFile) is stored from there, a header in
// front, hashed as it is written: the same bytes and checksum as the
// payload given whole (so verification passes); the same update sent again
// is taken (its counter raised), one with other bytes refused; and a
// SpillFile keeps to its bounds and leaves nothing in its directory.
TEST(CheckpointStoreUpdates, AnUploadStagedOnDiskIsStoredFromThereWithTheWholePayloadsChecksum) {
  const auto dir = fresh_directory();
  const std::vector<uint8_t> payload = random_bytes(2 * kMiB + 4099, 91);
  const std::span<const uint8_t> all(payload);
  auto file = fedmesh::SpillFile::create(dir, payload.size() - 56);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  // Written out of order, as chunks may arrive.
  ASSERT_TRUE((*file)->write(kMiB, all.subspan(56 + kMiB)).is_ok());
  ASSERT_TRUE((*file)->write(0, all.subspan(56, kMiB)).is_ok());
  EXPECT_EQ((*file)->write((*file)->size() - 1, all.first(2)).code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> past(2);
  EXPECT_EQ((*file)->read((*file)->size() - 1, past).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 0) << "the file has no name";

  CheckpointStore store = open_store(dir / "store.db");
  const std::vector<uint8_t> whole_id = {'w', '/', '2'}, spilled_id = {'s', '/', '2'};
  ASSERT_TRUE(store.add_pending_update({whole_id, "site-a", 0, 10, "", 0}, payload).is_ok());
  fedmesh::store::SpillSource source(all.first(56), **file);
  EXPECT_EQ(source.size(), payload.size());
  ASSERT_TRUE(store.add_pending_update_from({spilled_id, "site-b", 0, 10, "", 0, 7, "site-b-key"}, source).is_ok());
  EXPECT_EQ(store.read_pending_update(spilled_id).value(), payload);
  EXPECT_TRUE(store.verify_pending_updates().is_ok());
  EXPECT_EQ(store.replay_counters().value().at("site-b-key"), 7u);
  // Sent again (a lost acknowledgement): taken, its counter raised.
  ASSERT_TRUE(store.add_pending_update_from({spilled_id, "site-b", 0, 10, "", 0, 8, "site-b-key"}, source).is_ok());
  EXPECT_EQ(store.replay_counters().value().at("site-b-key"), 8u);
  const uint8_t flipped[] = {static_cast<uint8_t>(payload[56 + 5] ^ 0xff)};
  ASSERT_TRUE((*file)->write(5, flipped).is_ok());
  const Status other = store.add_pending_update_from({spilled_id, "site-b", 0, 10, "", 0, 9, "site-b-key"}, source);
  EXPECT_EQ(other.code(), StatusCode::kInvalidArgument) << other.to_string();
  EXPECT_NE(other.message().find("different bytes"), std::string::npos) << other.to_string();
  EXPECT_EQ(store.replay_counters().value().at("site-b-key"), 8u) << "nothing of a refused update is kept";
  EXPECT_EQ(fedmesh::SpillFile::create(dir / "missing", 10).status().code(), StatusCode::kIoError);
}

// The aggregator writes an update's payload from its tensors where they lie
// (pieces that cross the 1 MiB rows anywhere) and reads it back as a stream
// in slices: the same rows, bytes and checksum as the payload given whole,
// any number of passes, and damage found at the end of a pass.
TEST(CheckpointStoreUpdates, APendingUpdateWrittenInPiecesIsReadBackAsAStream) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> payload = random_bytes(3 * kMiB + 777, 90);
  const std::vector<uint8_t> whole_id = {'w', '/', '1'}, pieces_id = {'p', '/', '1'};
  CheckpointStore store = open_store(db);
  ASSERT_TRUE(store.add_pending_update({whole_id, "site-a", 0, 10, "", 0}, payload).is_ok());
  const std::span<const uint8_t> all(payload);
  const std::vector<std::span<const uint8_t>> pieces = {all.first(56), all.subspan(56, 0),
                                                        all.subspan(56, kMiB - 100), all.subspan(56 + kMiB - 100)};
  ASSERT_TRUE(store.add_pending_update_in_pieces({pieces_id, "site-b", 0, 10, "", 0}, pieces).is_ok());
  EXPECT_EQ(store.read_pending_update(pieces_id).value(), payload);
  {
    Database raw = raw_connection(db);
    EXPECT_EQ(count_rows(raw, "pending_update_chunks"), 2 * 4);
  }
  auto stream = store.open_pending_stream(pieces_id);
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  EXPECT_EQ(stream->size(), static_cast<int64_t>(payload.size()));
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<uint8_t> read(payload.size());
    size_t at = 0;
    for (size_t step = 1; at < read.size(); step = step * 3 + 1) {  // slices of every size, across rows
      const size_t n = std::min(step, read.size() - at);
      ASSERT_TRUE(stream->read(std::span<uint8_t>(read).subspan(at, n)).is_ok());
      at += n;
    }
    EXPECT_EQ(read, payload) << "pass " << pass;
    EXPECT_TRUE(stream->finish().is_ok());
  }
  uint8_t past_end[1];
  std::vector<uint8_t> everything(payload.size());
  ASSERT_TRUE(stream->read(everything).is_ok());
  EXPECT_EQ(stream->read(past_end).code(), StatusCode::kCorrupt) << "nothing past the recorded size";
  (void)stream->finish();
  std::vector<uint8_t> front(10);
  ASSERT_TRUE(stream->read(front).is_ok());
  EXPECT_TRUE(stream->finish().is_ok()) << "finish reads what is left and checks it";
  EXPECT_EQ(store.open_pending_stream(std::vector<uint8_t>{'x'}).status().code(), StatusCode::kNotFound);
  {
    Database raw = raw_connection(db);
    ASSERT_TRUE(raw.execute("UPDATE pending_update_chunks SET data = zeroblob(length(data)) "
                            "WHERE update_id = x'702f31' AND chunk = 2").is_ok());
  }
  std::vector<uint8_t> read(payload.size());
  ASSERT_TRUE(stream->read(read).is_ok()) << "the rows are all there";
  const Status damaged = stream->finish();
  EXPECT_EQ(damaged.code(), StatusCode::kCorrupt) << damaged.to_string();
  EXPECT_NE(damaged.message().find("checksum"), std::string::npos) << damaged.to_string();
  {
    Database raw = raw_connection(db);
    ASSERT_TRUE(raw.execute("DELETE FROM pending_update_chunks WHERE update_id = x'702f31' AND chunk = 1").is_ok());
  }
  const Status missing = stream->read(read);
  EXPECT_EQ(missing.code(), StatusCode::kCorrupt) << missing.to_string();
  (void)stream->finish();
}

TEST(CheckpointStoreUpdates, RetransmissionIsAcceptedOnceAndDifferentBytesAreRefused) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> payload = random_bytes(kMiB + 7, 72);
  std::vector<uint8_t> other = payload;
  other.back() ^= 1;
  const std::vector<uint8_t> id = {5, 6, 7};
  CheckpointStore store = open_store(db);
  ASSERT_TRUE(store.add_pending_update({id, "site-a", 1, 10, "", 0}, payload).is_ok());
  ASSERT_TRUE(store.add_pending_update({id, "site-a", 1, 10, "", 0}, payload).is_ok()) << "a retransmission";
  {
    CheckpointStore closed = std::move(store);
  }
  store = open_store(db);
  ASSERT_TRUE(store.add_pending_update({id, "site-a", 1, 10, "", 0}, payload).is_ok())
      << "a retransmission after restart";
  const Status s = store.add_pending_update({id, "site-a", 1, 10, "", 0}, other);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "different bytes")) << s.message();
  EXPECT_EQ(store.add_pending_update({id, "site-a", 1, 10, "", 0}, std::span<const uint8_t>(payload).first(10)).code(),
            StatusCode::kInvalidArgument);
  auto pending = store.pending_updates();
  ASSERT_TRUE(pending.is_ok());
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ(store.read_pending_update(id).value(), payload) << "the first bytes stay";
  Database raw = raw_connection(db);
  EXPECT_EQ(count_rows(raw, "pending_update_chunks"), 2);
}

TEST_P(StoreByMaintenance, AnAppliedUpdateIsNeverAppliedAgainAcrossRestarts) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 73);
  const std::vector<uint8_t> a = {0xaa, 1}, b = {0xbb, 2}, c = {0xcc, 3};
  {
    CheckpointStore store = open_store(db, options_with(GetParam(), 1));
    ASSERT_TRUE(store.add_pending_update({a, "site-a", 0, 10, "", 0}, random_bytes(3 * kMiB, 1)).is_ok());
    ASSERT_TRUE(store.add_pending_update({b, "site-b", 0, 10, "", 0}, random_bytes(10, 2)).is_ok());
    ASSERT_TRUE(store.add_pending_update({c, "site-c", 0, 10, "", 0}, random_bytes(10, 3)).is_ok());
    RoundToCommit r = simple_round(7, &t);
    r.applied_updates = {{a, "site-a", 0}, {b, "site-b", 2}};
    ASSERT_TRUE(store.commit_round(r).is_ok());
    auto pending = store.pending_updates();
    ASSERT_TRUE(pending.is_ok());
    ASSERT_EQ(pending->size(), 1u);
    EXPECT_EQ((*pending)[0].update_id, c);
    EXPECT_EQ(store.read_pending_update(a).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(store.applied_round(a).value(), std::optional<int64_t>(7));
    EXPECT_EQ(store.applied_round(b).value(), std::optional<int64_t>(7));
    EXPECT_FALSE(store.applied_round(c).value().has_value());
    Database raw = raw_connection(db);
    EXPECT_EQ(count_rows(raw, "pending_update_chunks"), 1) << "the applied payloads' chunks went with them";
  }
  CheckpointStore store = open_store(db, options_with(GetParam(), 1));
  EXPECT_EQ(store.applied_round(a).value(), std::optional<int64_t>(7));
  RoundToCommit again = simple_round(8, &t);
  again.applied_updates = {{c, "site-c", 0}, {a, "site-a", 1}};
  Status s = store.commit_round(again);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "already applied in round 7")) << s.message();
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{7}));
  EXPECT_FALSE(store.applied_round(c).value().has_value()) << "the refused round applied nothing";
  EXPECT_EQ(store.pending_updates().value().size(), 1u);

  s = store.add_pending_update({a, "site-a", 0, 10, "", 0}, random_bytes(3 * kMiB, 1));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "already applied in round 7")) << s.message();

  // Retention deleting round 7 does not forget what it applied.
  ASSERT_TRUE(store.commit_round(simple_round(8, &t)).is_ok());
  ASSERT_TRUE(store.commit_round(simple_round(9, &t)).is_ok());
  ASSERT_TRUE(store.settle().is_ok());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{9}));
  EXPECT_EQ(store.applied_round(b).value(), std::optional<int64_t>(7));
  RoundToCommit later = simple_round(10, &t);
  later.applied_updates = {{b, "site-b", 0}};
  s = store.commit_round(later);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "already applied in round 7")) << s.message();
  // An update that was never pending may be applied (e.g. aggregated from memory).
  later.applied_updates = {{c, "site-c", 0}, {{0xdd}, "site-d", 0}};
  ASSERT_TRUE(store.commit_round(later).is_ok());
  EXPECT_EQ(store.applied_round(std::vector<uint8_t>{0xdd}).value(), std::optional<int64_t>(10));
  EXPECT_TRUE(store.pending_updates().value().empty());
}

// ---------------------------------------------------------------------------
// 6. Peers and replay counters.

TEST_P(StoreByMaintenance, ThePeerViewIsReplacedByEachCommitThatCarriesOne) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 80);
  {
    CheckpointStore store = open_store(db, options_with(GetParam()));
    RoundToCommit r1 = simple_round(1, &t);
    r1.peers = std::vector<PeerRecord>{{"site-b", "tcp://b:1", "alive", 1, 1},
                                       {"site-a", "tcp://a:1", "suspect", 2, 1}};
    ASSERT_TRUE(store.commit_round(r1).is_ok());
    ASSERT_TRUE(store.commit_round(simple_round(2, &t)).is_ok()) << "no view: the stored one stays";
    auto peers = store.peers();
    ASSERT_TRUE(peers.is_ok());
    ASSERT_EQ(peers->size(), 2u);
    EXPECT_EQ((*peers)[0].site, "site-a");
    EXPECT_EQ((*peers)[0].status, "suspect");
    EXPECT_EQ((*peers)[0].incarnation, 2);

    RoundToCommit r3 = simple_round(3, &t);
    r3.peers = std::vector<PeerRecord>{{"site-c", "", "left", 5, 3}, {"site-a", "tcp://a:2", "dead", 3, 3}};
    ASSERT_TRUE(store.commit_round(r3).is_ok());
    RoundToCommit bad = simple_round(4, &t);
    bad.peers = std::vector<PeerRecord>{{"site-d", "tcp://d:1", "Alive", 1, 4}};
    Status s = store.commit_round(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(s, "Alive")) << s.message();
    bad.peers = std::vector<PeerRecord>{{"", "tcp://d:1", "alive", 1, 4}};
    EXPECT_EQ(store.commit_round(bad).code(), StatusCode::kInvalidArgument);
  }
  CheckpointStore store = open_store(db, options_with(GetParam()));
  auto peers = store.peers();
  ASSERT_TRUE(peers.is_ok());
  ASSERT_EQ(peers->size(), 2u);
  EXPECT_EQ((*peers)[0].site, "site-a");
  EXPECT_EQ((*peers)[0].address, "tcp://a:2");
  EXPECT_EQ((*peers)[0].status, "dead");
  EXPECT_EQ((*peers)[0].incarnation, 3);
  EXPECT_EQ((*peers)[0].updated_round, 3);
  EXPECT_EQ((*peers)[1].site, "site-c");
  EXPECT_EQ((*peers)[1].address, "");
  EXPECT_EQ((*peers)[1].status, "left");
  RoundToCommit empty_view = simple_round(5, &t);
  empty_view.peers = std::vector<PeerRecord>{};
  ASSERT_TRUE(store.commit_round(empty_view).is_ok());
  EXPECT_TRUE(store.peers().value().empty()) << "an empty view replaces too";
}

TEST_P(StoreByMaintenance, ReplayCountersOnlyRise) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 81);
  {
    CheckpointStore store = open_store(db, options_with(GetParam()));
    EXPECT_TRUE(store.replay_counters().value().empty());
    ASSERT_TRUE(store.record_replay_counter("site-a", 5).is_ok());
    ASSERT_TRUE(store.record_replay_counter("site-a", 6).is_ok());
    Status s = store.record_replay_counter("site-a", 6);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(s, "only rise")) << s.message();
    EXPECT_EQ(store.record_replay_counter("site-a", 2).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(store.record_replay_counter("", 2).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(store.record_replay_counter("site-b", 0).is_ok()) << "a first counter of 0";
    EXPECT_EQ(store.record_replay_counter("site-b", 0).code(), StatusCode::kInvalidArgument);

    RoundToCommit r = simple_round(1, &t);
    r.replay_counters = {{"site-a", 3}, {"site-b", 10}, {"site-c", 1}};
    ASSERT_TRUE(store.commit_round(r).is_ok());
    EXPECT_EQ(store.replay_counters().value(),
              (std::map<std::string, uint64_t>{{"site-a", 6}, {"site-b", 10}, {"site-c", 1}}))
        << "a commit raises, never lowers";
  }
  CheckpointStore store = open_store(db, options_with(GetParam()));
  EXPECT_EQ(store.replay_counters().value(),
            (std::map<std::string, uint64_t>{{"site-a", 6}, {"site-b", 10}, {"site-c", 1}}));
  EXPECT_EQ(store.record_replay_counter("site-b", 10).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(store.record_replay_counter("site-b", 11).is_ok());
}

// The privacy ledger: an entry is committed with its round (a refused
// round leaves no entry), epsilon never decreases, bad entries are refused
// by name, and retention deleting old rounds keeps every entry.
TEST_P(StoreByMaintenance, ThePrivacyLedgerIsCommittedWithItsRoundAndNeverShrinks) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 83);
  const auto entry = [](int64_t round, double epsilon) {
    PrivacyEntry e;
    e.round = round;
    e.mechanism = "dp-sgd";
    e.sampling_rate = 0.01;
    e.noise_multiplier = 1.1;
    e.steps = 100;
    e.epsilon = epsilon;
    e.delta = 1e-5;
    e.rdp_json = "[0.1, 0.2]";
    return e;
  };
  {
    CheckpointStore store = open_store(db, options_with(GetParam(), 1));
    EXPECT_TRUE(store.privacy_ledger().value().empty());
    for (int64_t round = 1; round <= 4; ++round) {
      RoundToCommit r = simple_round(round, &t);
      r.privacy = entry(round, 0.5 * static_cast<double>(round));
      ASSERT_TRUE(store.commit_round(r).is_ok());
    }
    RoundToCommit shrinking = simple_round(5, &t);
    shrinking.privacy = entry(5, 1.0);
    const Status s = store.commit_round(shrinking);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(s, "never shrinks")) << s.message();
    EXPECT_EQ(store.rounds().value().back().round, 4) << "the refused entry took its round with it";
    for (auto [field, bad] : std::initializer_list<std::pair<const char*, PrivacyEntry>>{
             {"round", entry(9, 3.0)}, {"mechanism", [&] { auto e = entry(5, 3.0); e.mechanism = "laplace"; return e; }()},
             {"delta", [&] { auto e = entry(5, 3.0); e.delta = 0.0; return e; }()},
             {"rdp", [&] { auto e = entry(5, 3.0); e.rdp_json = "{}"; return e; }()}}) {
      RoundToCommit r = simple_round(5, &t);
      r.privacy = bad;
      EXPECT_EQ(store.commit_round(r).code(), StatusCode::kInvalidArgument) << field;
    }
  }
  CheckpointStore store = open_store(db, options_with(GetParam(), 1));
  const std::vector<PrivacyEntry> ledger = store.privacy_ledger().value();
  ASSERT_EQ(ledger.size(), 4u) << "retention keeps one round, the ledger keeps every entry";
  EXPECT_EQ(ledger[3].round, 4);
  EXPECT_EQ(ledger[3].epsilon, 2.0);
  EXPECT_EQ(ledger[3].mechanism, "dp-sgd");
  EXPECT_EQ(ledger[3].rdp_json, "[0.1, 0.2]");
  EXPECT_FALSE(ledger[3].wall_time.empty());
}

TEST_P(StoreByMaintenance, TheRoundLogKeepsEveryCommittedRoundsMetricsAfterRetention) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 84);
  {
    CheckpointStore store = open_store(db, options_with(GetParam(), 1));
    EXPECT_TRUE(store.round_log().value().empty());
    for (int64_t round = 1; round <= 6; ++round) {
      const std::string metrics = R"({"test_accuracy":0.)" + std::to_string(round) + "}";
      ASSERT_TRUE(store.commit_round(simple_round(round, &t, metrics)).is_ok());
    }
    // A refused commit (its round is not above the last) writes no log entry.
    EXPECT_FALSE(store.commit_round(simple_round(6, &t, R"({"test_accuracy":0.99})")).is_ok());
    ASSERT_TRUE(store.settle().is_ok());
  }
  CheckpointStore store = open_store(db, options_with(GetParam(), 1));
  EXPECT_EQ(round_numbers(store), std::vector<int64_t>{6}) << "retention keeps one round";
  const std::vector<RoundLogEntry> log = store.round_log().value();
  ASSERT_EQ(log.size(), 6u) << "the log keeps every committed round";
  for (size_t i = 0; i < log.size(); ++i) {
    EXPECT_EQ(log[i].round, static_cast<int64_t>(i) + 1);
    EXPECT_EQ(log[i].model_version, log[i].round * 10);
    EXPECT_EQ(log[i].metrics_json, R"({"test_accuracy":0.)" + std::to_string(i + 1) + "}");
    EXPECT_FALSE(log[i].wall_time.empty());
  }
  const std::vector<RoundLogEntry> newest = store.round_log(2).value();
  ASSERT_EQ(newest.size(), 2u);
  EXPECT_EQ(newest[0].round, 5) << "the newest rounds, oldest first";
  EXPECT_EQ(newest[1].round, 6);
  EXPECT_EQ(store.round_log(-1).status().code(), StatusCode::kInvalidArgument);
}

// Sequences are uint64: a counter at or above 2^63 is not "negative".
TEST_P(StoreByMaintenance, ReplayCountersRiseAndNeverFallOverTheWholeUint64Range) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 82);
  CheckpointStore store = open_store(db, options_with(GetParam(), 10));
  constexpr uint64_t kHigh = (uint64_t{1} << 63) + 5;
  constexpr uint64_t kMax = ~uint64_t{0};
  ASSERT_TRUE(store.record_replay_counter("high", kHigh).is_ok());
  EXPECT_EQ(store.record_replay_counter("high", 10).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(store.record_replay_counter("low", 10).is_ok());

  RoundToCommit r1 = simple_round(1, &t);
  r1.replay_counters = {{"high", 10}, {"low", kHigh}, {"fresh", kMax - 1}};
  ASSERT_TRUE(store.commit_round(r1).is_ok());
  EXPECT_EQ(store.replay_counters().value(),
            (std::map<std::string, uint64_t>{{"fresh", kMax - 1}, {"high", kHigh}, {"low", kHigh}}));

  RoundToCommit r2 = simple_round(2, &t);
  r2.replay_counters = {{"high", kHigh + 1}, {"low", 3}, {"fresh", kMax}};
  ASSERT_TRUE(store.commit_round(r2).is_ok());
  EXPECT_EQ(store.replay_counters().value(),
            (std::map<std::string, uint64_t>{{"fresh", kMax}, {"high", kHigh + 1}, {"low", kHigh}}));
  EXPECT_EQ(store.record_replay_counter("fresh", kMax).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.record_replay_counter("high", kHigh).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(store.record_replay_counter("high", kMax).is_ok());
  EXPECT_EQ(store.replay_counters().value().at("high"), kMax);
}

// ---------------------------------------------------------------------------
// Ownership.

TEST(CheckpointStoreOwner, ASecondOwnerIsRefusedNamingThePidWhileInspectionWorks) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({10}, DType::kF32, 90);
  CheckpointStore owner = open_store(db);
  ASSERT_TRUE(owner.commit_round(simple_round(1, &t)).is_ok());
  auto second = CheckpointStore::open(db.string());
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(second.status(), "pid " + std::to_string(::getpid()))) << second.status().message();
  auto inspector = CheckpointStore::open_existing(db.string());
  ASSERT_TRUE(inspector.is_ok()) << inspector.status().to_string();
  EXPECT_EQ(inspector->load_latest().value().round.round, 1);
  ASSERT_TRUE(owner.commit_round(simple_round(2, &t)).is_ok());
  EXPECT_EQ(inspector->load_latest().value().round.round, 2) << "the inspector sees new commits";
  {
    CheckpointStore moved = std::move(owner);
    EXPECT_FALSE(CheckpointStore::open(db.string()).is_ok()) << "the lock moves with the store";
  }
  EXPECT_TRUE(CheckpointStore::open(db.string()).is_ok()) << "released when the owner closes";
}

// ---------------------------------------------------------------------------
// The SQLite wrapper.

TEST(SqliteWrapper, OpenModesErrorsAndBinding) {
  const auto dir = fresh_directory();
  const std::string path = (dir / "plain.db").string();
  EXPECT_EQ(Database::open(path, Database::Mode::kReadWrite).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Database::open(path, Database::Mode::kReadOnly).status().code(), StatusCode::kNotFound);
  auto database = Database::open(path, Database::Mode::kReadWriteCreate);
  ASSERT_TRUE(database.is_ok());
  ASSERT_TRUE(database->execute("CREATE TABLE t(a TEXT NOT NULL, b BLOB NOT NULL, c INTEGER, d REAL)").is_ok());

  // Empty text and blobs bind as empty values, never as NULL, however the view was made.
  auto insert = database->prepare("INSERT INTO t(a, b, c, d) VALUES (?1, ?2, ?3, ?4)");
  ASSERT_TRUE(insert.is_ok());
  insert->bind(1, std::string_view()).bind_blob(2, std::span<const uint8_t>()).bind(3, int64_t{-7}).bind(4, 2.5);
  Status s = insert->run();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  // Bound bytes are not copied: they must outlive the step.
  const std::vector<uint8_t> one_two = {1, 2}, one = {1}, three = {3};
  insert->bind(1, std::string_view("x")).bind_blob(2, one_two).bind_null(3).bind(4, 0.0);
  ASSERT_TRUE(insert->run().is_ok());
  EXPECT_EQ(*database->query_int("SELECT count(*) FROM t WHERE a = '' AND b = x''"), 1);
  EXPECT_EQ(*database->query_int("SELECT count(*) FROM t WHERE c IS NULL"), 1);

  // A constraint failure is the caller's argument, named with the file.
  insert->bind_null(1).bind_blob(2, one);
  s = insert->run();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, path)) << s.message();
  EXPECT_TRUE(contains(s, "NOT NULL")) << s.message();
  // A bad parameter index is reported by the step, not lost.
  insert->bind(9, int64_t{1});
  EXPECT_EQ(insert->run().code(), StatusCode::kInvalidArgument);
  insert->bind(1, std::string_view("y")).bind_blob(2, three).bind(3, int64_t{1}).bind(4, 1.0);
  EXPECT_TRUE(insert->run().is_ok()) << "the failed bind was cleared by the reset";

  const Status syntax = database->prepare("SELEKT 1").status();
  EXPECT_FALSE(syntax.is_ok());
  EXPECT_TRUE(contains(syntax, "SELEKT")) << syntax.message();
  EXPECT_EQ(database->query_int("SELECT c FROM t WHERE 0").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(*database->query_text("SELECT 'héllo'"), "héllo");

  auto select = database->prepare("SELECT a, b, c, d FROM t ORDER BY rowid");
  ASSERT_TRUE(select.is_ok());
  ASSERT_TRUE(*select->step());
  EXPECT_EQ(select->column_text(0), "");
  EXPECT_TRUE(select->column_blob(1).empty());
  EXPECT_FALSE(select->is_null(1));
  EXPECT_EQ(select->column_int(2), -7);
  EXPECT_EQ(select->column_double(3), 2.5);
  ASSERT_TRUE(*select->step());
  EXPECT_TRUE(select->is_null(2));
  const auto blob = select->column_blob(1);
  EXPECT_EQ(std::vector<uint8_t>(blob.begin(), blob.end()), (std::vector<uint8_t>{1, 2}));
  ASSERT_TRUE(*select->step());
  EXPECT_FALSE(*select->step());

  // Read-only connections refuse writes.
  auto reader = Database::open(path, Database::Mode::kReadOnly);
  ASSERT_TRUE(reader.is_ok());
  EXPECT_FALSE(reader->execute("DELETE FROM t").is_ok());
  EXPECT_EQ(*reader->query_int("SELECT count(*) FROM t"), 3);
}

TEST(SqliteWrapper, TransactionsRollBackUnlessCommittedAndBlobsAreWrittenInPlace) {
  const auto dir = fresh_directory();
  auto opened = Database::open((dir / "tx.db").string(), Database::Mode::kReadWriteCreate);
  ASSERT_TRUE(opened.is_ok());
  Database database = std::move(opened).value();
  ASSERT_TRUE(database.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, data BLOB NOT NULL)").is_ok());
  {
    auto transaction = Transaction::begin(database);
    ASSERT_TRUE(transaction.is_ok());
    ASSERT_TRUE(database.execute("INSERT INTO t(data) VALUES (x'01')").is_ok());
  }
  EXPECT_EQ(*database.query_int("SELECT count(*) FROM t"), 0) << "rolled back on destruction";
  {
    auto transaction = Transaction::begin(database);
    ASSERT_TRUE(transaction.is_ok());
    EXPECT_FALSE(Transaction::begin(database).is_ok()) << "no nested transactions";
    auto insert = database.prepare("INSERT INTO t(data) VALUES (?1)");
    ASSERT_TRUE(insert.is_ok());
    insert->bind_zeroblob(1, 5);
    ASSERT_TRUE(insert->run().is_ok());
    const std::vector<uint8_t> bytes = {9, 8, 7, 6, 5};
    ASSERT_TRUE(database.write_blob("t", "data", database.last_insert_rowid(), bytes).is_ok());
    EXPECT_EQ(database.changes(), 1);
    EXPECT_FALSE(database.write_blob("t", "data", 999, bytes).is_ok());
    ASSERT_TRUE(transaction->commit().is_ok());
  }
  EXPECT_EQ(*database.query_text("SELECT hex(data) FROM t"), "0908070605");
  Database moved = std::move(database);
  EXPECT_EQ(database.handle(), nullptr);
  EXPECT_EQ(*moved.query_int("SELECT count(*) FROM t"), 1);
}


// ---------------------------------------------------------------------------
// Quarantine.

// Notices an owner was given while resuming.
struct Notices {
  std::vector<QuarantineNotice> seen;
  std::function<void(const QuarantineNotice&)> callback() {
    return [this](const QuarantineNotice& n) { seen.push_back(n); };
  }
};

// Rounds 1 and 2 (two tensors each) committed and closed, then one bit of
// round 2's fc.weight flipped in the database file.
void write_rounds_and_damage_the_newest(const std::filesystem::path& db, const Tensor& old_weights,
                                        const Tensor& new_weights, const Tensor& bias) {
  {
    CheckpointStore store = open_store(db, options_with(true, 5));
    RoundToCommit r1 = simple_round(1, &old_weights);
    r1.tensors.push_back({"model", "fc.bias", &bias});
    ASSERT_TRUE(store.commit_round(r1).is_ok());
    RoundToCommit r2 = simple_round(2, nullptr);
    r2.tensors = {{"model", "fc.bias", &bias}, {"model", "fc.weight", &new_weights}};
    ASSERT_TRUE(store.commit_round(r2).is_ok());
  }
  ASSERT_TRUE(wal_is_gone_or_empty(db));
  const auto* bytes = static_cast<const uint8_t*>(new_weights.raw());
  flip_inside_only_occurrence(db, std::span<const uint8_t>(bytes + 4000, 64));
}

TEST(CheckpointStoreQuarantine, ADamagedNewestRoundIsMovedAsideWithItsEvidenceAndTheOwnerResumesFromTheRoundBefore) {
  const auto db = fresh_directory() / "store.db";
  const Tensor old_weights = random_tensor({1000}, DType::kF32, 120);
  const Tensor new_weights = random_tensor({kMiB / 2 + 100}, DType::kF16, 121);  // 2 chunks
  const Tensor bias = random_tensor({10}, DType::kF32, 122);
  write_rounds_and_damage_the_newest(db, old_weights, new_weights, bias);
  if (HasFatalFailure()) return;

  CheckpointStore store = open_store(db, options_with(true, 5));
  Notices notices;
  auto resumed = store.resume_latest(notices.callback());
  ASSERT_TRUE(resumed.is_ok()) << resumed.status().to_string();
  EXPECT_EQ(resumed->round.round, 1);
  EXPECT_TRUE(same_bytes(resumed->find("model", "w")->value, old_weights));
  ASSERT_EQ(notices.seen.size(), 1u);
  EXPECT_EQ(notices.seen[0].round, std::optional<int64_t>(2));
  EXPECT_NE(notices.seen[0].reason.find("model/fc.weight"), std::string::npos) << notices.seen[0].reason;
  EXPECT_NE(notices.seen[0].message.find("round 2"), std::string::npos) << notices.seen[0].message;

  // Out of the rounds, into quarantine, with what failed and the bytes as they were.
  EXPECT_EQ(round_numbers(store), std::vector<int64_t>{1});
  auto quarantined = store.quarantined_rounds();
  ASSERT_TRUE(quarantined.is_ok()) << quarantined.status().to_string();
  ASSERT_EQ(quarantined->size(), 1u);
  const QuarantinedRound& q = quarantined->front();
  EXPECT_EQ(q.round, 2);
  EXPECT_EQ(q.model_version, 20);
  EXPECT_EQ(q.tensor_count, 2);
  EXPECT_EQ(q.byte_size, static_cast<int64_t>(new_weights.nbytes() + bias.nbytes()));
  EXPECT_NE(q.reason.find("checksum"), std::string::npos) << q.reason;
  EXPECT_FALSE(q.quarantined_at.empty());
  EXPECT_EQ(q.state_json, R"({"step":2})");
  {
    Database raw = raw_connection(db);
    EXPECT_EQ(count_rows(raw, "tensors WHERE round = 2"), 0);
    EXPECT_EQ(count_rows(raw, "quarantined_tensor_chunks"), 3) << "bias 1 chunk, fc.weight 2";
    // The damaged chunk is kept as found: all but the flipped bit match.
    auto chunk = raw.prepare(
        "SELECT c.data FROM quarantined_tensor_chunks c JOIN quarantined_tensors t ON t.id = c.tensor_id "
        "WHERE t.name = 'fc.weight' AND c.chunk = 0");
    ASSERT_TRUE(chunk.is_ok() && chunk->step().value());
    const std::span<const uint8_t> kept = chunk->column_blob(0);
    ASSERT_EQ(kept.size(), kMiB);
    const auto* original = static_cast<const uint8_t*>(new_weights.raw());
    size_t differing = 0;
    for (size_t i = 0; i < kept.size(); ++i) differing += kept[i] != original[i] ? 1 : 0;
    EXPECT_EQ(differing, 1u);
  }
  EXPECT_TRUE(store.integrity_check().is_ok());

  // Resuming again finds nothing more to move; new rounds commit and are the newest.
  notices.seen.clear();
  EXPECT_EQ(store.resume_latest(notices.callback()).value().round.round, 1);
  EXPECT_TRUE(notices.seen.empty());
  ASSERT_TRUE(store.commit_round(simple_round(3, &bias)).is_ok());
  EXPECT_EQ(store.load_latest().value().round.round, 3);

  // A release is refused while it still fails, and changes nothing.
  const Status refused = store.release_quarantined_round(2);
  EXPECT_EQ(refused.code(), StatusCode::kCorrupt) << refused.to_string();
  EXPECT_NE(refused.message().find("still fails"), std::string::npos) << refused.message();
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(store.quarantined_rounds().value().size(), 1u);
  // Forced, it comes back byte for byte: the same check fails the same way.
  ASSERT_TRUE(store.release_quarantined_round(2, /*force=*/true).is_ok());
  EXPECT_EQ(round_numbers(store), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(store.quarantined_rounds().value().empty());
  const Status again = store.verify_round(2);
  EXPECT_EQ(again.code(), StatusCode::kCorrupt);
  EXPECT_EQ(again.message(), q.reason);
  // Moved aside once more and dropped: its evidence is gone.
  ASSERT_TRUE(store.quarantine_round(2, again.message()).is_ok());
  ASSERT_TRUE(store.drop_quarantined_round(2).is_ok());
  EXPECT_TRUE(store.quarantined_rounds().value().empty());
  EXPECT_EQ(store.drop_quarantined_round(2).code(), StatusCode::kNotFound);
  EXPECT_EQ(store.release_quarantined_round(2).code(), StatusCode::kNotFound);
  Database raw = raw_connection(db);
  EXPECT_EQ(count_rows(raw, "quarantined_tensors"), 0);
  EXPECT_EQ(count_rows(raw, "quarantined_tensor_chunks"), 0);
}

TEST(CheckpointStoreQuarantine, WhenEveryRoundIsDamagedAllAreMovedAsideAndNothingIsLeftToResume) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t = random_tensor({256}, DType::kF32, 130);
  CheckpointStore store = open_store(db);
  for (int64_t r = 1; r <= 3; ++r) ASSERT_TRUE(store.commit_round(simple_round(r, &t)).is_ok());
  {
    Database raw = raw_connection(db);
    ASSERT_TRUE(raw.execute("UPDATE rounds SET metrics = '{\"x\":1}'").is_ok());
  }
  Notices notices;
  auto resumed = store.resume_latest(notices.callback());
  EXPECT_EQ(resumed.status().code(), StatusCode::kNotFound) << resumed.status().to_string();
  ASSERT_EQ(notices.seen.size(), 3u);
  EXPECT_EQ(notices.seen[0].round, std::optional<int64_t>(3));
  EXPECT_EQ(notices.seen[2].round, std::optional<int64_t>(1));
  EXPECT_TRUE(round_numbers(store).empty());
  EXPECT_EQ(store.quarantined_rounds().value().size(), 3u);
  EXPECT_NE(store.quarantined_rounds().value()[0].reason.find("round checksum"), std::string::npos);
}

TEST(CheckpointStoreQuarantine, AnInspectorNeverMovesAnything) {
  const auto db = fresh_directory() / "store.db";
  const Tensor old_weights = random_tensor({1000}, DType::kF32, 140);
  const Tensor new_weights = random_tensor({kMiB / 2 + 100}, DType::kF16, 141);
  const Tensor bias = random_tensor({10}, DType::kF32, 142);
  write_rounds_and_damage_the_newest(db, old_weights, new_weights, bias);
  if (HasFatalFailure()) return;
  auto inspector = CheckpointStore::open_existing(db.string());
  ASSERT_TRUE(inspector.is_ok());
  Notices notices;
  EXPECT_EQ(inspector->resume_latest(notices.callback()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(inspector->quarantine_damaged_pending_updates(notices.callback()).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(notices.seen.empty());
  EXPECT_EQ(round_numbers(*inspector), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(inspector->quarantined_rounds().value().empty());
}

TEST(CheckpointStoreQuarantine, ADamagedPendingUpdateIsMovedAsideAndCanBeDroppedButNotReleased) {
  const auto db = fresh_directory() / "store.db";
  const std::vector<uint8_t> good = {'a', '/', '1'}, bad = {'b', '/', '1'};
  const std::vector<uint8_t> bad_bytes = random_bytes(kMiB + 100, 151);  // 2 chunks
  CheckpointStore store = open_store(db);
  ASSERT_TRUE(store.add_pending_update({good, "site-a", 4, 10, "", 0}, random_bytes(100, 150)).is_ok());
  ASSERT_TRUE(store.add_pending_update({bad, "site-b", 4, 12, "", 0}, bad_bytes).is_ok());
  {
    Database raw = raw_connection(db);
    ASSERT_TRUE(raw.execute("UPDATE pending_update_chunks SET data = zeroblob(100) WHERE update_id = x'622f31' AND chunk = 1").is_ok());
  }
  Notices notices;
  ASSERT_TRUE(store.quarantine_damaged_pending_updates(notices.callback()).is_ok());
  ASSERT_EQ(notices.seen.size(), 1u);
  EXPECT_EQ(notices.seen[0].update_id, bad);
  EXPECT_EQ(notices.seen[0].sender, "site-b");
  EXPECT_NE(notices.seen[0].message.find("b/1"), std::string::npos) << notices.seen[0].message;
  auto pending = store.pending_updates();
  ASSERT_EQ(pending->size(), 1u);
  EXPECT_EQ(pending->front().update_id, good);
  EXPECT_TRUE(store.verify_pending_updates().is_ok()) << "what is left pending is intact";

  auto quarantined = store.quarantined_updates();
  ASSERT_TRUE(quarantined.is_ok());
  ASSERT_EQ(quarantined->size(), 1u);
  EXPECT_EQ(quarantined->front().update_id, bad);
  EXPECT_EQ(quarantined->front().sender, "site-b");
  EXPECT_EQ(quarantined->front().base_version, 4);
  EXPECT_EQ(quarantined->front().sample_count, 12);
  EXPECT_EQ(quarantined->front().byte_size, static_cast<int64_t>(bad_bytes.size()));
  EXPECT_NE(quarantined->front().reason.find("checksum"), std::string::npos) << quarantined->front().reason;
  {
    Database raw = raw_connection(db);
    EXPECT_EQ(count_rows(raw, "quarantined_update_chunks"), 2) << "its bytes are kept, the damaged chunk too";
    EXPECT_EQ(count_rows(raw, "pending_update_chunks"), 1);
  }

  const Status refused = store.release_quarantined_update(bad);
  EXPECT_EQ(refused.code(), StatusCode::kCorrupt) << refused.to_string();
  EXPECT_EQ(store.pending_updates()->size(), 1u);
  EXPECT_EQ(store.quarantined_updates()->size(), 1u);
  ASSERT_TRUE(store.drop_quarantined_update(bad).is_ok());
  EXPECT_TRUE(store.quarantined_updates()->empty());
  EXPECT_EQ(store.drop_quarantined_update(bad).code(), StatusCode::kNotFound);
  Database raw = raw_connection(db);
  EXPECT_EQ(count_rows(raw, "quarantined_update_chunks"), 0);
}

TEST(CheckpointStoreQuarantine, AnIntactItemReleasedComesBackAsItWas) {
  const auto db = fresh_directory() / "store.db";
  const Tensor t1 = random_tensor({kMiB / 4 + 3}, DType::kF32, 160);  // 2 chunks
  const Tensor t2 = random_tensor({33}, DType::kBF16, 161);
  const std::vector<uint8_t> id = {'c', '/', '7'};
  const std::vector<uint8_t> payload = random_bytes(kMiB + 9, 162);
  CheckpointStore store = open_store(db);
  RoundToCommit r1 = simple_round(1, &t1);
  r1.tensors.push_back({"optimizer", "m", &t2});
  ASSERT_TRUE(store.commit_round(r1).is_ok());
  ASSERT_TRUE(store.commit_round(simple_round(2, &t2)).is_ok());
  ASSERT_TRUE(store.add_pending_update({id, "site-c", 1, 5, "", 0}, payload).is_ok());

  ASSERT_TRUE(store.quarantine_round(1, "checked by hand").is_ok());
  ASSERT_TRUE(store.quarantine_pending_update(id, "checked by hand").is_ok());
  EXPECT_EQ(store.quarantine_round(1, "again").code(), StatusCode::kNotFound);
  EXPECT_EQ(store.quarantine_pending_update(id, "again").code(), StatusCode::kNotFound);
  EXPECT_EQ(round_numbers(store), std::vector<int64_t>{2});
  EXPECT_TRUE(store.pending_updates()->empty());
  EXPECT_EQ(store.quarantined_rounds().value().front().reason, "checked by hand");

  ASSERT_TRUE(store.release_quarantined_round(1).is_ok());
  ASSERT_TRUE(store.release_quarantined_update(id).is_ok());
  EXPECT_TRUE(store.quarantined_rounds()->empty());
  EXPECT_TRUE(store.quarantined_updates()->empty());
  auto loaded = store.load_round(1);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_TRUE(same_bytes(loaded->find("model", "w")->value, t1));
  EXPECT_TRUE(same_bytes(loaded->find("optimizer", "m")->value, t2));
  EXPECT_EQ(loaded->round.model_version, 10);
  EXPECT_EQ(store.read_pending_update(id).value(), payload);
  EXPECT_EQ(store.pending_updates()->front().sender, "site-c");

  // A round number committed again while its old round is in quarantine: the
  // old one can only be dropped; the round log describes the new one.
  ASSERT_TRUE(store.quarantine_round(2, "checked by hand").is_ok());
  RoundToCommit redo = simple_round(2, &t1, R"({"redo":1})");
  ASSERT_TRUE(store.commit_round(redo).is_ok());
  EXPECT_EQ(store.release_quarantined_round(2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store.round_log().value().back().metrics_json, R"({"redo":1})");
  EXPECT_TRUE(store.integrity_check().is_ok());
}

}  // namespace
}  // namespace fedmesh::store
