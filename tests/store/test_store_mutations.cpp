// A checkpoint database is a file from outside the process. Hundreds of
// seeded mutations of a real store (flipped bytes, overwritten runs, a cut
// tail) are opened and read through every reading call: none crashes, and
// whatever the store still returns as intact is byte for byte what was
// committed. Corruption is either reported or harmless, never silent.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <random>

#include "store/checkpoint_store.h"
#include "tests/store/store_test_support.h"

namespace fedmesh::store {
namespace {

using testing::fresh_directory;
using testing::patterned;
using testing::same_bytes;

std::string read_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::filesystem::path& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(StoreMutations, CorruptionIsReportedOrHarmlessNeverSilent) {
  const auto dir = fresh_directory();
  const auto pristine = dir / "pristine.db";
  std::vector<Tensor> weights;  // weights[r] was committed as round r + 1
  for (int r = 0; r < 3; ++r) weights.push_back(patterned({70'000}, DType::kF32, static_cast<uint8_t>(40 + r)));
  const Tensor bias = patterned({10}, DType::kF32, 99);
  {
    StoreOptions options;
    options.keep_last = 3;
    auto store = CheckpointStore::open(pristine.string(), options);
    ASSERT_TRUE(store.is_ok());
    for (int r = 0; r < 3; ++r) {
      RoundToCommit round;
      round.round = r + 1;
      round.model_version = r + 1;
      round.metrics_json = R"({"test_accuracy":0.)" + std::to_string(r + 1) + "}";
      round.state_json = R"({"epoch":)" + std::to_string(r + 1) + "}";
      round.tensors = {{"model", "fc.weight", &weights[static_cast<size_t>(r)]}, {"model", "fc.bias", &bias}};
      ASSERT_TRUE(store->commit_round(round).is_ok());
    }
    ASSERT_TRUE(store->add_pending_update({{7, 7}, "site-a", 1, 5, "", 0}, std::vector<uint8_t>(5000, 3)).is_ok());
  }
  const std::string original = read_bytes(pristine);
  ASSERT_GT(original.size(), 100'000u);
  ASSERT_FALSE(std::filesystem::exists(dir / "pristine.db-wal") && std::filesystem::file_size(dir / "pristine.db-wal") > 0);

  std::mt19937_64 random(4);
  constexpr int kMutations = 300;
  int opened = 0, refused_at_open = 0, loads_ok = 0, corruption_reported = 0;
  const auto db = dir / "mutant.db";
  for (int m = 0; m < kMutations; ++m) {
    std::string bytes = original;
    const int kind = m % 4;
    const size_t at = random() % bytes.size();
    if (kind == 0) {
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << (random() % 8)));
    } else if (kind == 1) {
      for (size_t i = at; i < std::min(bytes.size(), at + 1 + random() % 64); ++i) bytes[i] = static_cast<char>(random());
    } else if (kind == 2) {
      // Aim at the first pages, where SQLite keeps its header and the schema.
      const size_t early = random() % std::min<size_t>(bytes.size(), 200'000);
      bytes[early] = static_cast<char>(random());
    } else {
      bytes.resize(at);
    }
    std::filesystem::remove(db.string() + "-wal");
    std::filesystem::remove(db.string() + "-shm");
    write_bytes(db, bytes);

    auto store = CheckpointStore::open_existing(db.string());
    if (!store.is_ok()) {
      ++refused_at_open;
      EXPECT_FALSE(store.status().message().empty());
      continue;
    }
    ++opened;
    (void)store->integrity_check();
    (void)store->pending_updates();
    (void)store->read_pending_update(std::vector<uint8_t>{7, 7});
    (void)store->peers();
    (void)store->replay_counters();
    if (auto rounds = store->rounds(); rounds.is_ok()) {
      for (const RoundInfo& round : *rounds) {
        const Status verified = store->verify_round(round.round);
        if (!verified.is_ok() && verified.code() == StatusCode::kCorrupt) ++corruption_reported;
      }
    }
    std::vector<Status> skipped;
    auto loaded = store->load_latest(&skipped);
    if (!loaded.is_ok()) continue;
    ++loads_ok;
    // What the store vouches for must be what was committed as that round.
    const int64_t round = loaded->round.round;
    ASSERT_TRUE(round >= 1 && round <= 3) << "mutation " << m << " invented round " << round;
    const StoredTensor* weight = loaded->find("model", "fc.weight");
    const StoredTensor* loaded_bias = loaded->find("model", "fc.bias");
    ASSERT_NE(weight, nullptr) << "mutation " << m;
    ASSERT_NE(loaded_bias, nullptr) << "mutation " << m;
    EXPECT_TRUE(same_bytes(weight->value, weights[static_cast<size_t>(round - 1)])) << "mutation " << m << " at " << at;
    EXPECT_TRUE(same_bytes(loaded_bias->value, bias)) << "mutation " << m;
    EXPECT_EQ(loaded->round.state_json, R"({"epoch":)" + std::to_string(round) + "}") << "mutation " << m;
  }
  std::printf("%d mutations: %d refused at open, %d opened, %d loaded an intact round, %d corrupt rounds reported\n",
              kMutations, refused_at_open, opened, loads_ok, corruption_reported);
  EXPECT_GT(corruption_reported + refused_at_open, kMutations / 10) << "the mutations should be noticed";
  EXPECT_GT(loads_ok, 0) << "some mutations hit nothing that matters";
}

}  // namespace
}  // namespace fedmesh::store
