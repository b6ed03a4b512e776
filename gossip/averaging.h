// Merging models in gossip, as arithmetic on flat fp32 vectors.
//
// Push-sum (Kempe et al. 2003; SGP, Assran et al. 2019): each node holds a
// weighted sum x and a weight w; its model is x / w. A gossip step splits
// (x, w) into 1 + f equal shares, keeps one and sends one to each of its f
// peers; a receiver adds what it gets. The network's total of x and of w is
// conserved, so every node's x / w converges to the network average on any
// strongly connected topology. Staleness only cuts off here: a message more
// than max_staleness of the receiver's versions old is dropped (scaling the
// mass instead would bias the average).
//
// Pairwise averaging: x_i <- (1 - s(tau) / 2) x_i + s(tau) / 2 x_j with the
// staleness weights of the aggregator (federation/staleness.h); tau is
// measured in the receiver's version counter.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace fedmesh::gossip {

struct PushSumState {
  std::vector<float> sum;  // x: the weighted sum of models
  double weight = 1.0;     // w
  // Starts from a model with weight 1.
  static PushSumState from_model(std::span<const float> model);
  // The model this node holds: x / w.
  void model(std::span<float> out) const;
};

struct PushSumShare {
  std::vector<float> sum;
  double weight = 0.0;
};

// Keeps 1 / (1 + peers) of `state` and returns the share each peer gets.
PushSumShare push_sum_split(PushSumState& state, int peers);
// Adds a received share; kInvalidArgument for a length mismatch or a
// non-finite share (nothing is added then).
Status push_sum_merge(PushSumState& state, const PushSumShare& share);

// x <- (1 - s / 2) x + (s / 2) peer, with s = s(tau) in [0, 1].
Status pairwise_average(std::span<float> model, std::span<const float> peer, double staleness_weight);

// The L2 distance between two models (the consensus metric a node reports).
double model_distance(std::span<const float> a, std::span<const float> b);

}  // namespace fedmesh::gossip
