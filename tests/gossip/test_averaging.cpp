// Gossip topologies and merge arithmetic (gossip/topology.h, gossip/averaging.h):
// the graphs are what their names say, push-sum conserves the network's
// mass and reaches the average (exactly, in log2 n steps, on the one-peer
// exponential graph), pairwise averaging weighs by staleness, bad input is
// refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "base/random.h"
#include "gossip/averaging.h"
#include "gossip/topology.h"

namespace fedmesh::gossip {
namespace {

TEST(Topology, GraphsAreWhatTheirNamesSay) {
  Rng rng(1);
  EXPECT_EQ(choose_peers(Topology::kRing, 6, 8, 2, 0, rng), (std::vector<size_t>{7, 0}));
  EXPECT_EQ(choose_peers(Topology::kExponential, 3, 8, 1, 0, rng), (std::vector<size_t>{4, 5, 7}));
  EXPECT_EQ(choose_peers(Topology::kExponential, 0, 10, 1, 0, rng), (std::vector<size_t>{1, 2, 4, 8}));
  // One peer per step, cycling through the exponential graph's distances.
  std::vector<size_t> seen;
  for (int64_t step = 0; step < 6; ++step) {
    const std::vector<size_t> p = choose_peers(Topology::kOnePeerExponential, 1, 8, 3, step, rng);
    ASSERT_EQ(p.size(), 1u);
    seen.push_back(p[0]);
  }
  EXPECT_EQ(seen, (std::vector<size_t>{2, 3, 5, 2, 3, 5}));
  for (int trial = 0; trial < 100; ++trial) {
    const std::vector<size_t> p = choose_peers(Topology::kRandom, 4, 9, 3, trial, rng);
    ASSERT_EQ(p.size(), 3u);
    EXPECT_EQ(std::set<size_t>(p.begin(), p.end()).size(), 3u);
    EXPECT_EQ(std::count(p.begin(), p.end(), 4u), 0);
    for (const size_t i : p) EXPECT_LT(i, 9u);
  }
  EXPECT_TRUE(choose_peers(Topology::kRing, 0, 1, 2, 0, rng).empty()) << "alone: no peers";
  EXPECT_EQ(choose_peers(Topology::kRing, 0, 3, 5, 0, rng).size(), 2u) << "fanout capped at n - 1";
  EXPECT_EQ(*parse_topology("one-peer-exponential"), Topology::kOnePeerExponential);
  EXPECT_FALSE(parse_topology("star").is_ok());
}

std::vector<PushSumState> random_nodes(size_t n, size_t length, uint64_t seed, std::vector<double>& average) {
  Rng rng(seed);
  std::vector<PushSumState> nodes;
  average.assign(length, 0.0);
  for (size_t i = 0; i < n; ++i) {
    std::vector<float> model(length);
    for (size_t k = 0; k < length; ++k) {
      model[k] = static_cast<float>(rng.normal() * (1.0 + static_cast<double>(i)));
      average[k] += model[k] / static_cast<double>(n);
    }
    nodes.push_back(PushSumState::from_model(model));
  }
  return nodes;
}

// One synchronous gossip step: everyone splits, then everyone merges.
void push_sum_step(std::vector<PushSumState>& nodes, Topology topology, int fanout, int64_t step, Rng& rng) {
  std::vector<std::pair<size_t, PushSumShare>> messages;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const std::vector<size_t> peers = choose_peers(topology, i, nodes.size(), fanout, step, rng);
    const PushSumShare share = push_sum_split(nodes[i], static_cast<int>(peers.size()));
    for (const size_t p : peers) messages.emplace_back(p, share);
  }
  for (const auto& [to, share] : messages) ASSERT_TRUE(push_sum_merge(nodes[to], share).is_ok());
}

TEST(PushSum, ConservesMassAndReachesTheAverage) {
  for (const Topology topology : {Topology::kRandom, Topology::kRing, Topology::kExponential}) {
    std::vector<double> average;
    std::vector<PushSumState> nodes = random_nodes(8, 16, 7, average);
    Rng rng(3);
    // The directed ring mixes slowest: its second eigenvalue is cos(pi / 8)
    // = 0.92 for 8 nodes, so 200 steps bring the error below 1e-6.
    for (int64_t step = 0; step < 200; ++step) {
      push_sum_step(nodes, topology, 1, step, rng);
      double weight = 0.0;
      for (const PushSumState& node : nodes) weight += node.weight;
      ASSERT_NEAR(weight, 8.0, 1e-9) << topology_name(topology) << " step " << step;
    }
    for (const PushSumState& node : nodes) {
      std::vector<float> model(16);
      node.model(model);
      for (size_t k = 0; k < 16; ++k) {
        EXPECT_NEAR(model[k], average[k], 1e-4) << topology_name(topology) << " element " << k;
      }
    }
  }
}

TEST(PushSum, OnePeerExponentialIsExactAfterLog2NSteps) {
  std::vector<double> average;
  std::vector<PushSumState> nodes = random_nodes(16, 8, 11, average);
  Rng rng(5);
  for (int64_t step = 0; step < 4; ++step) push_sum_step(nodes, Topology::kOnePeerExponential, 1, step, rng);
  for (const PushSumState& node : nodes) {
    std::vector<float> model(8);
    node.model(model);
    for (size_t k = 0; k < 8; ++k) EXPECT_NEAR(model[k], average[k], 1e-5) << k;
  }
}

TEST(PushSum, BadSharesAreRefusedAndChangeNothing) {
  PushSumState state = PushSumState::from_model(std::vector<float>{1.0f, 2.0f});
  PushSumShare wrong_length{{1.0f}, 0.5};
  EXPECT_FALSE(push_sum_merge(state, wrong_length).is_ok());
  PushSumShare nan_value{{1.0f, NAN}, 0.5};
  EXPECT_FALSE(push_sum_merge(state, nan_value).is_ok());
  PushSumShare negative_weight{{1.0f, 1.0f}, -1.0};
  EXPECT_FALSE(push_sum_merge(state, negative_weight).is_ok());
  EXPECT_EQ(state.sum, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(state.weight, 1.0);
}

TEST(PairwiseAveraging, WeighsThePeerByStaleness) {
  std::vector<float> model = {0.0f, 4.0f};
  const std::vector<float> peer = {2.0f, 0.0f};
  ASSERT_TRUE(pairwise_average(model, peer, 1.0).is_ok());
  EXPECT_EQ(model, (std::vector<float>{1.0f, 2.0f})) << "fresh: the midpoint";
  ASSERT_TRUE(pairwise_average(model, peer, 0.0).is_ok());
  EXPECT_EQ(model, (std::vector<float>{1.0f, 2.0f})) << "weight 0: unchanged";
  ASSERT_TRUE(pairwise_average(model, peer, 0.5).is_ok());
  EXPECT_EQ(model, (std::vector<float>{1.25f, 1.5f})) << "s = 0.5: a quarter of the way";
  EXPECT_FALSE(pairwise_average(model, std::vector<float>{1.0f}, 1.0).is_ok());
  EXPECT_FALSE(pairwise_average(model, peer, 1.5).is_ok());
  EXPECT_FALSE(pairwise_average(model, std::vector<float>{NAN, 0.0f}, 1.0).is_ok());
  EXPECT_NEAR(model_distance(std::vector<float>{0.0f, 3.0f}, std::vector<float>{4.0f, 0.0f}), 5.0, 1e-12);
}

}  // namespace
}  // namespace fedmesh::gossip
