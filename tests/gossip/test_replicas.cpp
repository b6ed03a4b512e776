// Sparse gossip with identical replicas (gossip/replicas.h): peers that
// apply the same set of updates, in any order, hold bit-identical models;
// an update is applied once however often it arrives; the model is x0 plus
// the mean of what was sent; error feedback keeps what top-k did not send;
// bad updates change nothing; a checkpoint restores the exact sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "base/random.h"
#include "tests/gossip/gossip_models.h"
#include "gossip/exchange.h"
#include "gossip/replicas.h"

namespace fedmesh::gossip {
namespace {

using testing::Model;
using testing::plan;

std::vector<protocol::TensorShape> manifest() { return testing::two_tensors(32, 40); }

Model random_model(uint64_t seed, float scale) { return testing::random_model(manifest(), seed, scale); }

ReplicaState replica(const std::string& spec, int members, uint64_t seed, const Model& reference) {
  Result<ReplicaState> r =
      ReplicaState::create(plan(spec), manifest(), reference, members, 1.0, seed, kernels::cpu_compression_kernels());
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::move(*r);
}

Model plus(const Model& a, const Model& b) {
  Model out = a;
  for (size_t t = 0; t < out.size(); ++t) {
    for (size_t i = 0; i < out[t].size(); ++i) out[t][i] += b[t][i];
  }
  return out;
}

// Four peers each make a round's update; every peer applies all four.
struct Round {
  std::vector<UpdateId> ids;
  std::vector<Model> decoded;
};

Round make_round(std::vector<ReplicaState>& peers, uint64_t round, float scale) {
  Round out;
  for (size_t i = 0; i < peers.size(); ++i) {
    const Model trained = plus(peers[i].model(), random_model(1000 * round + i, scale));
    Result<OwnUpdate> update = peers[i].make_update(trained);
    EXPECT_TRUE(update.is_ok()) << update.status().message();
    out.ids.push_back({"peer-" + std::to_string(i), round});
    out.decoded.push_back(update->decoded);
  }
  return out;
}

TEST(Replicas, TheSameSetInAnyOrderGivesTheSameBits) {
  const Model x0 = random_model(1, 1.0f);
  std::vector<ReplicaState> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(replica("topk:0.05+int8", 4, 10 + i, x0));
  for (uint64_t r = 0; r < 3; ++r) {
    const Round round = make_round(peers, r, 0.1f);
    for (size_t p = 0; p < peers.size(); ++p) {
      std::vector<size_t> order = {0, 1, 2, 3};
      std::rotate(order.begin(), order.begin() + static_cast<int64_t>(p), order.end());
      if (p % 2 == 1) std::reverse(order.begin(), order.end());
      for (size_t k : order) {
        Result<bool> applied = peers[p].apply(round.ids[k], round.decoded[k]);
        ASSERT_TRUE(applied.is_ok()) << applied.status().message();
        EXPECT_TRUE(*applied);
      }
    }
    for (size_t p = 1; p < peers.size(); ++p) {
      EXPECT_EQ(peers[p].digest(), peers[0].digest());
      EXPECT_EQ(peers[p].model(), peers[0].model());  // bit for bit
    }
  }
  EXPECT_EQ(peers[0].applied_ids().size(), 12u);
}

TEST(Replicas, TheModelIsX0PlusTheMeanOfWhatWasSent) {
  const Model x0 = random_model(2, 1.0f);
  std::vector<ReplicaState> peers;
  for (int i = 0; i < 4; ++i) peers.push_back(replica("identity", 4, 20 + i, x0));
  const Round round = make_round(peers, 0, 0.2f);
  for (size_t k = 0; k < 4; ++k) ASSERT_TRUE(peers[0].apply(round.ids[k], round.decoded[k]).is_ok());
  for (size_t t = 0; t < x0.size(); ++t) {
    for (size_t i = 0; i < x0[t].size(); ++i) {
      double mean = 0.0;
      for (size_t k = 0; k < 4; ++k) mean += round.decoded[k][t][i] / 4.0;
      EXPECT_NEAR(peers[0].model()[t][i], x0[t][i] + mean, 1e-6);
    }
  }
}

TEST(Replicas, AnUpdateIsAppliedOnceHoweverOftenItArrives) {
  const Model x0 = random_model(3, 1.0f);
  std::vector<ReplicaState> peers;
  for (int i = 0; i < 2; ++i) peers.push_back(replica("topk:0.1+int8", 2, 30 + i, x0));
  const Round round = make_round(peers, 0, 0.1f);
  ASSERT_TRUE(*peers[0].apply(round.ids[1], round.decoded[1]));
  const crypto::Hash once = peers[0].digest();
  Result<bool> again = peers[0].apply(round.ids[1], round.decoded[1]);
  ASSERT_TRUE(again.is_ok());
  EXPECT_FALSE(*again);
  EXPECT_EQ(peers[0].digest(), once);
}

TEST(Replicas, ErrorFeedbackKeepsWhatTopKDidNotSend) {
  // One peer alone: after many rounds with no training, everything the first
  // round moved has been sent, a few coordinates at a time.
  const Model x0 = random_model(4, 1.0f);
  ReplicaState peer = replica("topk:0.1+fp32", 1, 40, x0);
  const Model target = plus(x0, random_model(41, 0.1f));
  Model trained = target;
  for (uint64_t r = 0; r < 40; ++r) {
    Result<OwnUpdate> update = peer.make_update(trained);
    ASSERT_TRUE(update.is_ok());
    ASSERT_TRUE(peer.apply({"me", r}, update->decoded).is_ok());
    trained = peer.model();  // no training: the next delta is zero, only the residual goes
  }
  for (size_t t = 0; t < x0.size(); ++t) {
    for (size_t i = 0; i < x0[t].size(); ++i) EXPECT_NEAR(peer.model()[t][i], target[t][i], 1e-5);
  }
}

TEST(Replicas, BadUpdatesChangeNothing) {
  const Model x0 = random_model(5, 1.0f);
  ReplicaState peer = replica("identity", 2, 50, x0);
  const crypto::Hash before = peer.digest();
  Model wrong = random_model(51, 0.1f);
  wrong[1].pop_back();
  EXPECT_FALSE(peer.apply({"a", 0}, wrong).is_ok());
  Model nan = random_model(52, 0.1f);
  nan[0][7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(peer.apply({"a", 0}, nan).is_ok());
  Model huge = random_model(53, 0.1f);
  huge[0][3] = 1e30f;
  EXPECT_FALSE(peer.apply({"a", 0}, huge).is_ok());
  EXPECT_EQ(peer.digest(), before);
  EXPECT_FALSE(peer.applied({"a", 0}));
  EXPECT_FALSE(peer.make_update(nan).is_ok());
}

TEST(Replicas, ACheckpointRestoresTheExactSum) {
  const Model x0 = random_model(6, 1.0f);
  std::vector<ReplicaState> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(replica("int8", 3, 60 + i, x0));
  const Round round = make_round(peers, 0, 0.1f);
  for (size_t k = 0; k < 3; ++k) ASSERT_TRUE(peers[0].apply(round.ids[k], round.decoded[k]).is_ok());
  ReplicaState restarted = replica("int8", 3, 60, x0);
  ASSERT_TRUE(restarted.restore(peers[0].saved_sum(), peers[0].applied_ids()).is_ok());
  EXPECT_EQ(restarted.digest(), peers[0].digest());
  EXPECT_EQ(restarted.model(), peers[0].model());
  EXPECT_FALSE(*restarted.apply(round.ids[2], round.decoded[2]));  // still applied once
  federation::ExactAccumulator::Saved short_sum = peers[0].saved_sum();
  short_sum.sum.pop_back();
  EXPECT_FALSE(restarted.restore(short_sum, {}).is_ok());
}

TEST(Replicas, PlansAndSettingsAreChecked) {
  const Model x0 = random_model(7, 1.0f);
  EXPECT_TRUE(check_gossip_compression(plan("topk:0.01+int8"), MergeRule::kReplicas).is_ok());
  EXPECT_TRUE(check_gossip_compression(plan("dct-sign:32"), MergeRule::kReplicas).is_ok());
  EXPECT_FALSE(check_gossip_compression(plan("powersgd:2"), MergeRule::kReplicas).is_ok());
  EXPECT_FALSE(check_gossip_compression(plan("topk:0.01"), MergeRule::kPushSum).is_ok());
  EXPECT_EQ(*parse_merge_rule("replicas"), MergeRule::kReplicas);
  EXPECT_FALSE(ReplicaState::create(plan("identity"), manifest(), x0, 0, 1.0, 1, kernels::cpu_compression_kernels()).is_ok());
  EXPECT_FALSE(ReplicaState::create(plan("identity"), manifest(), x0, 2, 1.5, 1, kernels::cpu_compression_kernels()).is_ok());
  EXPECT_FALSE(GossipState::create(MergeRule::kReplicas, plan("identity"), manifest(), x0, 1,
                                   kernels::cpu_compression_kernels()).is_ok());
}

}  // namespace
}  // namespace fedmesh::gossip
