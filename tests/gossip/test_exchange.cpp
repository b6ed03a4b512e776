// A node's model in gossip (gossip/exchange.h): push-sum conserves what the
// network holds (sum of w z, exactly when lossless, up to the quantization
// error with compression) and reaches consensus at the network average;
// weights travel exactly however small; a share that was
// never delivered comes back whole; pairwise averaging reaches consensus and
// weighs by staleness; sparsifiers are refused with the reason; bad merges
// change nothing.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "base/random.h"
#include "tests/gossip/gossip_models.h"
#include "gossip/exchange.h"
#include "gossip/topology.h"

namespace fedmesh::gossip {
namespace {

using testing::Model;
using testing::plan;

std::vector<protocol::TensorShape> manifest() { return testing::two_tensors(64, 80); }

Model random_model(uint64_t seed, float scale) { return testing::random_model(manifest(), seed, scale); }

std::vector<GossipState> network(MergeRule rule, const std::string& spec, int n, const Model& reference) {
  std::vector<GossipState> nodes;
  for (int i = 0; i < n; ++i) {
    Result<GossipState> s = GossipState::create(rule, plan(spec), manifest(), reference, 100 + i,
                                                kernels::cpu_compression_kernels());
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    nodes.push_back(std::move(*s));
    // Each node trained somewhere else: its own model, near the reference.
    Model mine = reference;
    const Model moved = random_model(7 + i, 0.05f);
    for (size_t t = 0; t < mine.size(); ++t) {
      for (size_t k = 0; k < mine[t].size(); ++k) mine[t][k] += moved[t][k];
    }
    EXPECT_TRUE(nodes.back().set_model(mine).is_ok());
  }
  return nodes;
}

// sum over nodes of w z, per element, in double.
std::vector<double> network_mass(const std::vector<GossipState>& nodes) {
  std::vector<double> mass;
  for (const GossipState& node : nodes) {
    size_t k = 0;
    for (size_t t = 0; t < node.model().size(); ++t) {
      for (size_t i = 0; i < node.model()[t].size(); ++i, ++k) {
        if (mass.size() <= k) mass.push_back(0.0);
        mass[k] += node.weight() * node.model()[t][i];
      }
    }
  }
  return mass;
}

// One synchronous gossip step on a topology: every node shares, then every
// share is merged.
void gossip_step(std::vector<GossipState>& nodes, Topology topology, int fanout, int64_t step) {
  Rng rng(static_cast<uint64_t>(step) + 1);
  struct Sent { size_t to; GossipShare* share; };
  std::vector<GossipShare> shares(nodes.size());
  std::vector<Sent> sent;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const std::vector<size_t> peers = choose_peers(topology, i, nodes.size(), fanout, step, rng);
    Result<GossipShare> share = nodes[i].share(static_cast<int>(peers.size()));
    ASSERT_TRUE(share.is_ok()) << share.status().message();
    shares[i] = std::move(*share);
    for (size_t p : peers) sent.push_back({p, &shares[i]});
  }
  for (const Sent& s : sent) ASSERT_TRUE(nodes[s.to].merge(s.share->decoded, s.share->weight, 1.0).is_ok());
}

double max_disagreement(const std::vector<GossipState>& nodes) {
  Model first, other;
  first = nodes[0].model();
  double worst = 0.0;
  for (size_t i = 1; i < nodes.size(); ++i) {
    other = nodes[i].model();
    double d = 0.0;
    for (size_t t = 0; t < first.size(); ++t) {
      for (size_t k = 0; k < first[t].size(); ++k) d = std::max(d, std::fabs(static_cast<double>(first[t][k]) - other[t][k]));
    }
    worst = std::max(worst, d);
  }
  return worst;
}

TEST(GossipExchange, PushSumConservesTheNetworkAndReachesTheAverage) {
  for (const std::string spec : {"identity", "int8", "fp16", "int4:stochastic"}) {
    SCOPED_TRACE(spec);
    const Model reference = random_model(1, 1.0f);
    std::vector<GossipState> nodes = network(MergeRule::kPushSum, spec, 8, reference);
    Model average = reference;
    for (auto& t : average) std::fill(t.begin(), t.end(), 0.0f);
    for (const GossipState& node : nodes) {
      Model m;
      m = node.model();
      for (size_t t = 0; t < m.size(); ++t) {
        for (size_t k = 0; k < m[t].size(); ++k) average[t][k] += m[t][k] / 8.0f;
      }
    }
    const std::vector<double> before = network_mass(nodes);
    for (int64_t step = 0; step < 40; ++step) gossip_step(nodes, Topology::kOnePeerExponential, 1, step);
    const std::vector<double> after = network_mass(nodes);
    const double conserved = spec == "identity" ? 2e-5 : spec == "int4:stochastic" ? 0.2 : 0.02;
    for (size_t k = 0; k < before.size(); ++k) ASSERT_NEAR(after[k], before[k], conserved * (1.0 + std::fabs(before[k])));
    double weights = 0.0;
    for (const GossipState& node : nodes) weights += node.weight();
    EXPECT_NEAR(weights, 8.0, 1e-9);
    // Every node holds the average, up to what is still in the residuals
    // (a quantization step of the last shares).
    // int4 on values of range ~0.2 has a step of ~0.03.
    const double tolerance = spec == "identity" ? 1e-5 : spec == "int4:stochastic" ? 5e-2 : 2e-3;
    EXPECT_LT(max_disagreement(nodes), tolerance);
    Model m;
    m = nodes[3].model();
    for (size_t t = 0; t < m.size(); ++t) {
      for (size_t k = 0; k < m[t].size(); ++k) ASSERT_NEAR(m[t][k], average[t][k], tolerance);
    }
  }
}

TEST(GossipExchange, AnUndeliveredShareComesBackWhole) {
  const Model reference = random_model(2, 1.0f);
  std::vector<GossipState> nodes = network(MergeRule::kPushSum, "identity", 1, reference);
  Model before;
  before = nodes[0].model();
  const std::vector<double> mass = network_mass(nodes);
  Result<GossipShare> share = nodes[0].share(3);
  ASSERT_TRUE(share.is_ok());
  EXPECT_NEAR(nodes[0].weight(), 0.25, 1e-7);
  nodes[0].take_back(*share, 3);
  EXPECT_NEAR(nodes[0].weight(), 1.0, 1e-12);
  const std::vector<double> back = network_mass(nodes);
  for (size_t k = 0; k < mass.size(); ++k) ASSERT_NEAR(back[k], mass[k], 1e-5 * (1.0 + std::fabs(mass[k])));
  Model after;
  after = nodes[0].model();
  for (size_t t = 0; t < after.size(); ++t) {
    for (size_t k = 0; k < after[t].size(); ++k) ASSERT_NEAR(after[t][k], before[t][k], 1e-5);
  }
}

TEST(GossipExchange, PairwiseReachesConsensusAndWeighsByStaleness) {
  const Model reference = random_model(3, 1.0f);
  std::vector<GossipState> nodes = network(MergeRule::kPairwise, "int8", 6, reference);
  const double start = max_disagreement(nodes);
  for (int64_t step = 0; step < 60; ++step) gossip_step(nodes, Topology::kRing, 1, step);
  EXPECT_LT(max_disagreement(nodes), 0.02 * start) << "pairwise gossip on a ring should agree";
  // Staleness 0 changes nothing; staleness 1 moves half-way.
  std::vector<GossipState> two = network(MergeRule::kPairwise, "identity", 2, reference);
  Model a, b;
  a = two[0].model();
  b = two[1].model();
  Result<GossipShare> share = two[1].share(1);
  ASSERT_TRUE(share.is_ok());
  ASSERT_TRUE(two[0].merge(share->decoded, share->weight, 0.0).is_ok());
  Model unchanged;
  unchanged = two[0].model();
  EXPECT_EQ(unchanged, a);
  ASSERT_TRUE(two[0].merge(share->decoded, share->weight, 1.0).is_ok());
  Model half;
  half = two[0].model();
  EXPECT_NEAR(half[0][5], 0.5f * (a[0][5] + b[0][5]), 1e-5);
  EXPECT_NEAR(two[0].distance_to(share->decoded), std::sqrt([&] {
                double d = 0.0;
                for (size_t t = 0; t < half.size(); ++t)
                  for (size_t k = 0; k < half[t].size(); ++k) d += (half[t][k] - b[t][k]) * (half[t][k] - b[t][k]);
                return d;
              }()), 1e-3);
}

TEST(GossipExchange, SparsifiersAreRefusedWithTheReason) {
  for (const std::string spec : {"topk:0.01", "dct-sign:32", "powersgd:2"}) {
    Result<GossipState> s = GossipState::create(MergeRule::kPushSum, plan(spec), manifest(), random_model(4, 1.0f), 1,
                                                kernels::cpu_compression_kernels());
    ASSERT_FALSE(s.is_ok()) << spec;
    EXPECT_NE(s.status().message().find("gossip cannot carry"), std::string::npos) << s.status().message();
  }
  EXPECT_FALSE(parse_merge_rule("average").is_ok());
  EXPECT_EQ(*parse_merge_rule("pairwise"), MergeRule::kPairwise);
}

TEST(GossipExchange, BadMergesChangeNothing) {
  const Model reference = random_model(5, 1.0f);
  std::vector<GossipState> nodes = network(MergeRule::kPushSum, "identity", 1, reference);
  Model before;
  before = nodes[0].model();
  Model values = random_model(6, 0.1f);
  EXPECT_FALSE(nodes[0].merge(values, 0.0, 1.0).is_ok()) << "zero weight";
  EXPECT_FALSE(nodes[0].merge(values, std::nan(""), 1.0).is_ok()) << "NaN weight";
  values[1][3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(nodes[0].merge(values, 0.5, 1.0).is_ok()) << "infinite value";
  values.pop_back();
  EXPECT_FALSE(nodes[0].merge(values, 0.5, 1.0).is_ok()) << "missing tensor";
  Model after;
  after = nodes[0].model();
  EXPECT_EQ(after, before);
  EXPECT_DOUBLE_EQ(nodes[0].weight(), 1.0);
}

// What travels beside a gossip update's tensors, in its signed header: a
// share's weight (however small) or a catch-up slice; anything else is
// refused by name.
TEST(GossipExchange, UpdateMetaChecksRefuseWhatIsNotOne) {
  for (const double weight : {1.0, 0.25, 1.0 / 3.0, 1e-30, 1e-200, 3.5e-300}) {
    EXPECT_TRUE(check_update_meta({GossipUpdateKind::kShare, weight, 0, 0}).is_ok()) << weight;
  }
  EXPECT_TRUE(check_update_meta({GossipUpdateKind::kCatchUpSlice, 0.0, 2, 3}).is_ok());
  EXPECT_TRUE(check_update_meta({GossipUpdateKind::kCatchUpSlice, 0.0, 15, kMaxCatchUpSlices}).is_ok());

  const auto refused = [](GossipUpdateMeta meta, const std::string& why) {
    const Status status = check_update_meta(meta);
    ASSERT_FALSE(status.is_ok()) << why;
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << why;
  };
  refused({GossipUpdateKind::kShare, 0.0, 0, 0}, "a zero weight");
  refused({GossipUpdateKind::kShare, -0.5, 0, 0}, "a negative weight");
  refused({GossipUpdateKind::kShare, std::nan(""), 0, 0}, "a NaN weight");
  refused({GossipUpdateKind::kShare, INFINITY, 0, 0}, "an infinite weight");
  refused({GossipUpdateKind::kCatchUpSlice, 0.0, 3, 3}, "slice 3 of 3");
  refused({GossipUpdateKind::kCatchUpSlice, 0.0, 0, 0}, "no slices");
  refused({GossipUpdateKind::kCatchUpSlice, 0.0, 0, kMaxCatchUpSlices + 1}, "more slices than kMaxCatchUpSlices");
  refused({static_cast<GossipUpdateKind>(7), 1.0, 0, 0}, "an unknown kind");
}

}  // namespace
}  // namespace fedmesh::gossip
