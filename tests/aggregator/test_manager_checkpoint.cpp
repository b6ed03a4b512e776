// The round manager past a quarantined round: restored from the round
// before, it puts that model out as the version after the lost one, whose
// parent is the lost version's hash (so a site holding it accepts the next
// model), in the round after the lost one; versions and round numbers never
// go back, and a lost hash is replaced by a placeholder with a warning.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "aggregator/manager_checkpoint.h"
#include "aggregator/pending_values.h"
#include "federation/model_chain.h"
#include "store/pending_payload.h"
#include "store/sqlite.h"

namespace fedmesh::aggregator {
namespace {

RoundManager make_manager() {
  Tensor w = Tensor::zeros({4});
  auto manager = RoundManager::create(RoundOptions{}, {"w"}, {w});
  EXPECT_TRUE(manager.is_ok()) << manager.status().to_string();
  return std::move(manager).value();
}

nlohmann::json chain_state(const std::vector<crypto::Hash>& chain) {
  nlohmann::json hexes = nlohmann::json::array();
  for (const crypto::Hash& h : chain) hexes.push_back(federation::hash_hex(h));
  return {{"chain", hexes}};
}

// One synchronous round with site "a" sending `delta`, committed with the chain.
void run_round(store::CheckpointStore& store, RoundManager& manager, std::vector<crypto::Hash>& chain, float delta) {
  ASSERT_TRUE(manager.start_round({"a"}, 0.0).is_ok());
  SiteUpdate u;
  u.id = "a/" + std::to_string(manager.round());
  u.site = "a";
  u.round = manager.round();
  u.base_version = manager.version();
  u.sample_count = 10;
  u.delta = {delta, delta, delta, delta};
  ASSERT_TRUE(manager.submit(std::move(u), 1.0).is_ok());
  auto record = manager.close_round(2.0);
  ASSERT_TRUE(record.is_ok()) << record.status().to_string();
  chain.push_back(record->link.hash);
  ASSERT_TRUE(commit_manager_round(store, manager, *record, nlohmann::json::object(), chain_state(chain)).is_ok());
}

struct Restored {
  RoundManager manager = make_manager();
  std::vector<crypto::Hash> chain;
  int64_t round = 0;
};

// What the aggregator does when it starts: quarantine, restore, chain.
Restored restore(store::CheckpointStore& store) {
  Restored r;
  auto latest = store.resume_latest(nullptr);
  EXPECT_TRUE(latest.is_ok()) << latest.status().to_string();
  if (!latest.is_ok()) return r;
  auto state = restore_manager(*latest, r.manager);
  EXPECT_TRUE(state.is_ok()) << state.status().to_string();
  for (const auto& hex : state->at("chain")) r.chain.push_back(federation::parse_hash_hex(hex.get<std::string>()).value());
  r.round = latest->round.round;
  return r;
}

std::filesystem::path fresh_db() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const auto dir = std::filesystem::path(::testing::TempDir()) /
                   ("fedmesh-manager-checkpoint-" + std::string(info->name()) + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir / "aggregator.db";
}

TEST(StepPastQuarantine, TheRestoredModelBecomesTheVersionAfterTheLostOneWithItAsParent) {
  const auto db = fresh_db();
  auto store = store::CheckpointStore::open(db.string());
  ASSERT_TRUE(store.is_ok());
  RoundManager manager = make_manager();
  std::vector<crypto::Hash> chain = {manager.link().hash};
  run_round(*store, manager, chain, 1.0f);
  const std::vector<float> model_of_round_1(manager.model()[0].data<float>(), manager.model()[0].data<float>() + 4);
  run_round(*store, manager, chain, 2.0f);
  if (HasFatalFailure()) return;
  const crypto::Hash lost = chain[2];
  ASSERT_TRUE(store->quarantine_round(2, "its bytes changed on disk").is_ok());

  Restored r = restore(*store);
  ASSERT_EQ(r.round, 1);
  ASSERT_EQ(r.manager.version(), 1);
  std::vector<std::string> warnings;
  auto step = step_past_quarantine(*store, r.manager, r.round, /*asynchronous=*/false, r.chain,
                                   [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  ASSERT_TRUE(step->has_value());
  const RoundRecord& record = **step;
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ(record.round, 3);
  EXPECT_EQ(record.version, 3);
  EXPECT_TRUE(record.applied.empty());
  EXPECT_EQ(record.link.parent, lost);
  EXPECT_EQ(r.manager.version(), 3);
  EXPECT_EQ(r.manager.round(), 3);
  EXPECT_EQ(r.manager.server_steps(), 1) << "no server step was taken";
  EXPECT_EQ(std::vector<float>(r.manager.model()[0].data<float>(), r.manager.model()[0].data<float>() + 4),
            model_of_round_1);
  ASSERT_EQ(r.chain.size(), 4u);
  EXPECT_EQ(r.chain[2], lost);
  EXPECT_EQ(r.chain[3], record.link.hash);
  // A site holding the lost version 2 verifies version 3 as a site does.
  EXPECT_TRUE(federation::verify_chain(lost, {{3, lost, r.chain[3]}}).is_ok());
  EXPECT_TRUE(federation::verify_model(record.link, r.manager.names(), r.manager.model()).is_ok());

  // Committed, it is what the next start resumes from, with nothing more to step past.
  ASSERT_TRUE(commit_manager_round(*store, r.manager, record, nlohmann::json::object(), chain_state(r.chain)).is_ok());
  run_round(*store, r.manager, r.chain, 3.0f);
  if (HasFatalFailure()) return;
  EXPECT_EQ(r.manager.round(), 4);
  EXPECT_EQ(r.manager.version(), 4);
  Restored again = restore(*store);
  EXPECT_EQ(again.round, 4);
  auto nothing = step_past_quarantine(*store, again.manager, again.round, false, again.chain, nullptr);
  ASSERT_TRUE(nothing.is_ok());
  EXPECT_FALSE(nothing->has_value());
}

TEST(StepPastQuarantine, ALostHashIsReplacedAndSaidSo) {
  const auto db = fresh_db();
  auto store = store::CheckpointStore::open(db.string());
  ASSERT_TRUE(store.is_ok());
  RoundManager manager = make_manager();
  std::vector<crypto::Hash> chain = {manager.link().hash};
  for (float d : {1.0f, 2.0f, 3.0f}) run_round(*store, manager, chain, d);
  if (HasFatalFailure()) return;
  {
    // Rounds 2 and 3's records damaged: their states no longer hold a chain.
    auto raw = store::Database::open(db.string(), store::Database::Mode::kReadWrite);
    ASSERT_TRUE(raw.is_ok());
    ASSERT_TRUE(raw->execute("UPDATE rounds SET state = '{\"chain\":[\"zz\"]}' WHERE round >= 2").is_ok());
  }
  Restored r = restore(*store);
  ASSERT_EQ(r.round, 1);
  EXPECT_EQ(store->quarantined_rounds().value().size(), 2u);
  std::vector<std::string> warnings;
  auto step = step_past_quarantine(*store, r.manager, r.round, false, r.chain,
                                   [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  ASSERT_TRUE(step->has_value());
  EXPECT_EQ((*step)->round, 4);
  EXPECT_EQ((*step)->version, 4);
  ASSERT_EQ(r.chain.size(), 5u);
  EXPECT_NE(r.chain[2], chain[2]);
  EXPECT_NE(r.chain[3], chain[3]);
  EXPECT_EQ((*step)->link.parent, r.chain[3]);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("no readable hash"), std::string::npos) << warnings[0];
  EXPECT_TRUE(federation::verify_model((*step)->link, r.manager.names(), r.manager.model()).is_ok());
}

// The aggregator's path for large models (issue 30): each update's payload
// written into the store from its tensors where they lie, then read back by
// the round manager through PendingValues a slice at a time. The step equals
// the one with the updates in memory, bit for bit; a payload of the format
// before versions is read too; the commit that applies the updates removes
// them from the store while their readers are still held; damage is found.
TEST(PendingValues, TheManagerStepsFromUpdatesLeftInTheStore) {
  const auto db = fresh_db();
  auto store = store::CheckpointStore::open(db.string());
  ASSERT_TRUE(store.is_ok());
  constexpr int64_t kValues = (int64_t{3} << 19) + 5;  // 1.5 slices of the manager's reads
  const auto make = [] {
    Tensor w = Tensor::zeros({kValues});
    auto manager = RoundManager::create(RoundOptions{}, {"w"}, {w});
    EXPECT_TRUE(manager.is_ok());
    return std::move(manager).value();
  };
  RoundManager in_memory = make(), from_store = make();
  ASSERT_TRUE(in_memory.start_round({"a", "b"}, 0).is_ok());
  ASSERT_TRUE(from_store.start_round({"a", "b"}, 0).is_ok());
  for (int s = 0; s < 2; ++s) {
    const std::string site = s == 0 ? "a" : "b";
    SiteUpdate u;
    u.id = site + "/1";
    u.site = site;
    u.round = 1;
    u.sample_count = 10 + s;
    u.local_loss = 0.5 + s;
    u.delta.resize(kValues);
    for (int64_t i = 0; i < kValues; ++i) u.delta[i] = static_cast<float>((i * (s + 3)) % 1001) * 1e-4f - 0.05f;
    const std::vector<uint8_t> id(u.id.begin(), u.id.end());
    const store::PendingHeader header{u.round, u.base_version, u.sample_count, u.local_loss, u.local_accuracy};
    if (s == 0) {
      // As the aggregator writes it: the header, then two tensors' values where they lie.
      const std::vector<uint8_t> head = store::encode_pending_header(header, kValues);
      const std::span<const float> values(u.delta);
      const std::vector<std::span<const uint8_t>> pieces = {head, store::pending_value_bytes(values.first(1000)),
                                                            store::pending_value_bytes(values.subspan(1000))};
      ASSERT_TRUE(store->add_pending_update_in_pieces({id, site, 0, u.sample_count, "", 0}, pieces).is_ok());
    } else {
      // The format before versions: the five fields (40 bytes), then the values.
      std::vector<uint8_t> payload = store::encode_pending_payload(header, u.delta);
      payload.erase(payload.begin(), payload.begin() + 8);
      payload.erase(payload.begin() + 40, payload.begin() + 48);
      ASSERT_TRUE(store->add_pending_update({id, site, 0, u.sample_count, "", 0}, payload).is_ok());
    }
    auto values = PendingValues::open(*store, id, kValues);
    ASSERT_TRUE(values.is_ok()) << values.status().to_string();
    EXPECT_EQ((*values)->header().sample_count, u.sample_count);
    EXPECT_EQ((*values)->header().local_loss, u.local_loss);
    ASSERT_TRUE(in_memory.submit(u, 1).is_ok());
    SiteUpdate stored = u;
    stored.delta.clear();
    stored.stored = *values;
    auto submitted = from_store.submit(std::move(stored), 1);
    ASSERT_TRUE(submitted.is_ok()) << submitted.status().to_string();
  }
  auto expected = in_memory.close_round(2);
  auto record = from_store.close_round(2);
  ASSERT_TRUE(expected.is_ok());
  ASSERT_TRUE(record.is_ok()) << record.status().to_string();
  EXPECT_EQ(record->link.hash, expected->link.hash) << "the same model, bit for bit";
  EXPECT_DOUBLE_EQ(record->mean_local_loss, 1.0);
  std::vector<crypto::Hash> chain = {in_memory.link().hash};
  ASSERT_TRUE(commit_manager_round(*store, from_store, *record, nlohmann::json::object(), chain_state(chain)).is_ok());
  EXPECT_TRUE(store->pending_updates().value().empty()) << "the commit took the applied updates out of pending";

  // Damage after the check: found at the step, which fails and stops the manager.
  const std::vector<uint8_t> id = {'a', '/', '2'};
  const std::vector<float> delta(kValues, 0.01f);
  const std::vector<uint8_t> payload = store::encode_pending_payload({2, 1, 10, 0, 0}, delta);
  ASSERT_TRUE(store->add_pending_update({id, "a", 1, 10, "", 0}, payload).is_ok());
  ASSERT_TRUE(from_store.start_round({"a"}, 3).is_ok());
  SiteUpdate u;
  u.id = "a/2";
  u.site = "a";
  u.round = 2;
  u.base_version = 1;
  u.sample_count = 10;
  u.stored = PendingValues::open(*store, id, kValues).value();
  ASSERT_TRUE(from_store.submit(std::move(u), 3).is_ok());
  {
    auto raw = store::Database::open(db.string(), store::Database::Mode::kReadWrite);
    ASSERT_TRUE(raw.is_ok());
    ASSERT_TRUE(raw->execute("UPDATE pending_update_chunks SET data = zeroblob(length(data)) "
                             "WHERE update_id = x'612f32' AND chunk = 1").is_ok());
  }
  auto failed = from_store.close_round(4);
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kCorrupt) << failed.status().to_string();
  EXPECT_FALSE(from_store.failed_step().is_ok());
}

// The aggregator checks an update it has just written from the tensors it
// wrote it from (no read back); the passes after read the store, and the
// memory is dropped when the first pass ends.
TEST(PendingValues, TheFirstPassCanReadTheValuesJustStored) {
  const auto db = fresh_db();
  auto store = store::CheckpointStore::open(db.string());
  ASSERT_TRUE(store.is_ok());
  const std::vector<float> a = {1, 2, 3}, b = {4, 5};
  const std::vector<uint8_t> head = store::encode_pending_header({1, 0, 10, 0, 0}, 5);
  const std::vector<std::span<const uint8_t>> pieces = {head, store::pending_value_bytes(a),
                                                        store::pending_value_bytes(b)};
  const std::vector<uint8_t> id = {'a', '/', '1'};
  ASSERT_TRUE(store->add_pending_update_in_pieces({id, "a", 0, 10, "", 0}, pieces).is_ok());
  auto values = PendingValues::open(*store, id, 5);
  ASSERT_TRUE(values.is_ok()) << values.status().to_string();
  {
    auto raw = store::Database::open(db.string(), store::Database::Mode::kReadWrite);
    ASSERT_TRUE(raw.is_ok());
    ASSERT_TRUE(raw->execute("UPDATE pending_update_chunks SET data = zeroblob(length(data)) WHERE update_id = x'612f31'").is_ok());
  }
  (*values)->read_first_pass_from({a, b});
  std::vector<float> read(5);
  ASSERT_TRUE((*values)->read(std::span<float>(read).first(2)).is_ok());
  ASSERT_TRUE((*values)->read(std::span<float>(read).subspan(2)).is_ok());
  EXPECT_EQ(read, (std::vector<float>{1, 2, 3, 4, 5})) << "across the pieces";
  EXPECT_TRUE((*values)->finish().is_ok());
  EXPECT_EQ((*values)->read(read).code(), StatusCode::kCorrupt) << "the second pass reads the store, header and all";
  (void)(*values)->finish();
}

// The same when the values were staged on disk as they arrived: the first
// pass reads them from that file (which ends too early is corrupt, not
// garbage), and lets the file go when it ends.
TEST(PendingValues, TheFirstPassCanReadTheValuesFromTheFileTheyWereStagedIn) {
  const auto db = fresh_db();
  auto store = store::CheckpointStore::open(db.string());
  ASSERT_TRUE(store.is_ok());
  const std::vector<float> all = {1, 2, 3, 4, 5};
  const std::vector<uint8_t> head = store::encode_pending_header({1, 0, 10, 0, 0}, 5);
  const std::vector<std::span<const uint8_t>> pieces = {head, store::pending_value_bytes(all)};
  const std::vector<uint8_t> id = {'a', '/', '2'};
  ASSERT_TRUE(store->add_pending_update_in_pieces({id, "a", 0, 10, "", 0}, pieces).is_ok());
  auto values = PendingValues::open(*store, id, 5);
  ASSERT_TRUE(values.is_ok()) << values.status().to_string();
  auto file = SpillFile::create(db.parent_path(), 5 * sizeof(float));
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  const std::vector<float> staged = {6, 7, 8, 9, 10};  // not what the store holds: this pass reads the file
  ASSERT_TRUE((*file)->write(0, store::pending_value_bytes(staged)).is_ok());
  std::weak_ptr<SpillFile> watch;
  {
    std::shared_ptr<SpillFile> shared = std::move(*file);
    watch = shared;
    (*values)->read_first_pass_from(std::shared_ptr<const SpillFile>(std::move(shared)));
  }
  std::vector<float> read(5);
  ASSERT_TRUE((*values)->read(std::span<float>(read).first(3)).is_ok());
  ASSERT_TRUE((*values)->read(std::span<float>(read).subspan(3)).is_ok());
  EXPECT_EQ(read, staged);
  float past[1];
  EXPECT_EQ((*values)->read(past).code(), StatusCode::kCorrupt);
  EXPECT_TRUE((*values)->finish().is_ok());
  EXPECT_TRUE(watch.expired()) << "the file is let go when the pass ends";
  ASSERT_TRUE((*values)->read(read).is_ok());
  EXPECT_EQ(read, all) << "the next pass reads the store";
  EXPECT_TRUE((*values)->finish().is_ok());
}

}  // namespace
}  // namespace fedmesh::aggregator
