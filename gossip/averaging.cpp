#include "gossip/averaging.h"

#include <cmath>

namespace fedmesh::gossip {

PushSumState PushSumState::from_model(std::span<const float> model) {
  PushSumState state;
  state.sum.assign(model.begin(), model.end());
  state.weight = 1.0;
  return state;
}

void PushSumState::model(std::span<float> out) const {
  const double inverse = weight > 0.0 ? 1.0 / weight : 0.0;
  for (size_t i = 0; i < sum.size() && i < out.size(); ++i) out[i] = static_cast<float>(sum[i] * inverse);
}

PushSumShare push_sum_split(PushSumState& state, int peers) {
  const double fraction = 1.0 / static_cast<double>(1 + std::max(peers, 0));
  PushSumShare share;
  share.sum.resize(state.sum.size());
  for (size_t i = 0; i < state.sum.size(); ++i) {
    state.sum[i] = static_cast<float>(state.sum[i] * fraction);
    share.sum[i] = state.sum[i];
  }
  state.weight *= fraction;
  share.weight = state.weight;
  return share;
}

Status push_sum_merge(PushSumState& state, const PushSumShare& share) {
  if (share.sum.size() != state.sum.size()) {
    return invalid_argument("a push-sum share of " + std::to_string(share.sum.size()) + " values for a model of " +
                            std::to_string(state.sum.size()));
  }
  if (!std::isfinite(share.weight) || share.weight < 0.0) return invalid_argument("a push-sum share's weight is not finite and >= 0");
  for (const float x : share.sum) {
    if (!std::isfinite(x)) return invalid_argument("a push-sum share holds a non-finite value");
  }
  for (size_t i = 0; i < state.sum.size(); ++i) state.sum[i] += share.sum[i];
  state.weight += share.weight;
  return Status::ok();
}

Status pairwise_average(std::span<float> model, std::span<const float> peer, double staleness_weight) {
  if (model.size() != peer.size()) {
    return invalid_argument("a peer model of " + std::to_string(peer.size()) + " values for a model of " +
                            std::to_string(model.size()));
  }
  if (!(staleness_weight >= 0.0 && staleness_weight <= 1.0)) {
    return invalid_argument("a staleness weight outside [0, 1]");
  }
  for (const float x : peer) {
    if (!std::isfinite(x)) return invalid_argument("the peer model holds a non-finite value");
  }
  const auto mix = static_cast<float>(staleness_weight / 2.0);
  for (size_t i = 0; i < model.size(); ++i) model[i] = (1.0f - mix) * model[i] + mix * peer[i];
  return Status::ok();
}

double model_distance(std::span<const float> a, std::span<const float> b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    sum += d * d;
  }
  return std::sqrt(sum);
}

}  // namespace fedmesh::gossip
