// A networked peer's replica bookkeeping (node/replica_sync.h): the exact
// sum's checkpoint pieces round-trip every 64-bit value; a checkpoint in a
// real store restores the same sum (digest), the ids applied, the floor and
// the own updates kept, whose re-encoding decodes to the very values sent;
// the window forgets old rounds; what a member lacks is listed by round.
#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <limits>

#include "node/replica_sync.h"
#include "protocol/codec.h"
#include "store/checkpoint_store.h"
#include "tests/gossip/gossip_models.h"

namespace fedmesh::node {
namespace {

using gossip::testing::Model;

std::vector<protocol::TensorShape> manifest() { return gossip::testing::two_tensors(24, 30); }

ReplicaSync sync(const std::string& self, const Model& x0) {
  Result<gossip::ReplicaState> state = gossip::ReplicaState::create(
      gossip::testing::plan("topk:0.05+int8"), manifest(), x0, 3, 1.0, 7, kernels::cpu_compression_kernels());
  EXPECT_TRUE(state.is_ok()) << state.status().message();
  return ReplicaSync(std::move(*state), self);
}

Model plus(const Model& a, const Model& b) {
  Model out = a;
  for (size_t t = 0; t < out.size(); ++t) {
    for (size_t i = 0; i < out[t].size(); ++i) out[t][i] += b[t][i];
  }
  return out;
}

TEST(ReplicaSync, FixedPointPiecesRoundTripEveryValue) {
  for (const int64_t v : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{123456789012345}, int64_t{-98765432109876},
                          std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    float pieces[3];
    split_fixed_point(v, pieces);
    EXPECT_EQ(join_fixed_point(pieces), v);
  }
}

TEST(ReplicaSync, ACheckpointRestoresTheSumTheIdsAndTheOwnUpdates) {
  const Model x0 = gossip::testing::random_model(manifest(), 1, 1.0f);
  ReplicaSync a = sync("a", x0);
  for (uint64_t r = 0; r < 20; ++r) {
    ASSERT_TRUE(a.make(r, plus(a.state().model(), gossip::testing::random_model(manifest(), 100 + r, 0.1f))).is_ok());
    const Model theirs = gossip::testing::random_model(manifest(), 200 + r, 0.01f);
    ASSERT_TRUE(*a.take("b", r, theirs));
    EXPECT_FALSE(*a.take("b", r, theirs)) << "a second copy is not applied";
    a.advance(r + 1);
  }
  // The window: 16 rounds kept, older ones forgotten and no longer taken.
  EXPECT_EQ(a.state().floor(), 4u);
  EXPECT_EQ(a.own(3), nullptr);
  ASSERT_NE(a.own(4), nullptr);
  EXPECT_FALSE(*a.take("c", 2, gossip::testing::random_model(manifest(), 9, 0.01f)));
  EXPECT_EQ(a.missing("b", 20), std::vector<uint64_t>{});
  EXPECT_EQ(a.missing("c", 6), (std::vector<uint64_t>{4, 5}));

  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / ("replica-sync-" + std::to_string(::getpid()) + ".db");
  std::filesystem::remove(path);
  {
    Result<store::CheckpointStore> db = store::CheckpointStore::open(path.string());
    ASSERT_TRUE(db.is_ok()) << db.status().message();
    store::RoundToCommit round;
    round.round = 1;
    std::deque<Tensor> views;
    nlohmann::json state;
    a.save(views, round.tensors, state);
    round.state_json = state.dump();
    ASSERT_TRUE(db->commit_round(round).is_ok());
  }
  Result<store::CheckpointStore> db = store::CheckpointStore::open(path.string());
  ASSERT_TRUE(db.is_ok());
  Result<store::LoadedCheckpoint> loaded = db->resume_latest({});
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  ReplicaSync b = sync("a", x0);
  ASSERT_TRUE(b.restore(*loaded, nlohmann::json::parse(loaded->round.state_json)).is_ok());
  EXPECT_EQ(b.state().digest(), a.state().digest());
  EXPECT_EQ(b.state().model(), a.state().model());
  EXPECT_EQ(b.state().floor(), a.state().floor());
  EXPECT_EQ(b.state().applied_ids(), a.state().applied_ids());
  EXPECT_EQ(b.own_rounds(), a.own_rounds());
  // A restored own update, sent again, decodes to the values first sent.
  for (const uint64_t r : {uint64_t{4}, uint64_t{19}}) {
    const std::vector<protocol::EncodedTensor>* sent = a.own(r);
    const std::vector<protocol::EncodedTensor>* again = b.own(r);
    ASSERT_TRUE(sent && again);
    for (size_t t = 0; t < manifest().size(); ++t) {
      std::vector<float> first(manifest()[t].element_count()), second(manifest()[t].element_count());
      for (const protocol::EncodedSegment& segment : (*sent)[t].segments) {
        ASSERT_TRUE(protocol::decode_segment(segment.view(), manifest(), first).is_ok());
      }
      for (const protocol::EncodedSegment& segment : (*again)[t].segments) {
        ASSERT_TRUE(protocol::decode_segment(segment.view(), manifest(), second).is_ok());
      }
      EXPECT_EQ(first, second) << "round " << r << " tensor " << t;
    }
  }
  // A state from another merge rule is refused, not guessed at.
  ReplicaSync c = sync("a", x0);
  EXPECT_FALSE(c.restore(*loaded, nlohmann::json::object()).is_ok());
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace fedmesh::node
