#include "gossip/exchange.h"

#include "gossip/replicas.h"

#include <cmath>
#include <utility>

namespace fedmesh::gossip {

Result<MergeRule> parse_merge_rule(std::string_view text) {
  if (text == "push-sum") return MergeRule::kPushSum;
  if (text == "pairwise") return MergeRule::kPairwise;
  if (text == "replicas") return MergeRule::kReplicas;
  return invalid_argument("unknown merge rule '" + std::string(text) + "' (replicas, push-sum or pairwise)");
}

const char* merge_rule_name(MergeRule rule) {
  switch (rule) {
    case MergeRule::kPushSum: return "push-sum";
    case MergeRule::kPairwise: return "pairwise";
    case MergeRule::kReplicas: return "replicas";
  }
  return "unknown";
}

Status check_gossip_compression(const protocol::CompressionPlan& plan, MergeRule rule) {
  if (rule == MergeRule::kReplicas) return check_replica_compression(plan);
  for (const auto& [where, spec] : plan_specs(plan)) {
    switch (spec.method) {
      case protocol::CompressionMethod::kIdentity:
      case protocol::CompressionMethod::kHalf:
      case protocol::CompressionMethod::kBlock:
        continue;
      case protocol::CompressionMethod::kTopK:
      case protocol::CompressionMethod::kDctSign:
      case protocol::CompressionMethod::kPowerSgd:
        return invalid_argument(
            "gossip cannot carry '" + spec.to_string() + "' (" + where +
            "): gossip sends a share of the model itself, and a sparse or low-rank method would leave nearly all "
            "of it in the residual; use identity, fp16, bf16, int8 or int4, or the merge rule replicas, whose "
            "messages are updates");
    }
  }
  return Status::ok();
}

Status check_update_meta(const GossipUpdateMeta& meta) {
  switch (meta.kind) {
    case GossipUpdateKind::kShare:
      if (!(std::isfinite(meta.weight) && meta.weight > 0.0)) {
        return invalid_argument("a share whose push-sum weight is not a finite positive number");
      }
      return Status::ok();
    case GossipUpdateKind::kReplicaUpdate:
      return Status::ok();  // identified by its sender and round
    case GossipUpdateKind::kCatchUpSlice:
      if (!(meta.slices >= 1 && meta.slice < meta.slices && meta.slices <= kMaxCatchUpSlices)) {
        return invalid_argument("catch-up slice " + std::to_string(meta.slice) + " of " + std::to_string(meta.slices) +
                                " is not a slice (at most " + std::to_string(kMaxCatchUpSlices) + ")");
      }
      return Status::ok();
  }
  return invalid_argument("an unknown kind of gossip update");
}

Result<GossipState> GossipState::create(MergeRule rule, const protocol::CompressionPlan& plan,
                                        std::vector<protocol::TensorShape> manifest,
                                        std::vector<std::vector<float>> reference, uint64_t seed,
                                        kernels::CompressionKernels& kernels, size_t max_segment_bytes) {
  if (rule == MergeRule::kReplicas) return invalid_argument("GossipState runs push-sum and pairwise; replicas is ReplicaState");
  FEDMESH_RETURN_IF_ERROR(check_gossip_compression(plan, rule));
  if (reference.size() != manifest.size()) return invalid_argument("the reference model does not match the manifest");
  for (size_t t = 0; t < manifest.size(); ++t) {
    if (reference[t].size() != manifest[t].element_count()) {
      return invalid_argument("reference tensor " + manifest[t].name + " has the wrong size");
    }
  }
  Result<protocol::UpdateCompressor> compressor = protocol::UpdateCompressor::create(plan, manifest, seed, kernels, max_segment_bytes);
  if (!compressor.is_ok()) return compressor.status();
  GossipState state;
  state.rule_ = rule;
  state.manifest_ = std::move(manifest);
  state.model_ = reference;
  state.reference_ = std::move(reference);
  state.compressor_.emplace(std::move(*compressor));
  return state;
}

Status GossipState::set_model(std::span<const std::vector<float>> trained) {
  if (trained.size() != model_.size()) return invalid_argument("set_model: wrong number of tensors");
  for (size_t t = 0; t < model_.size(); ++t) {
    if (trained[t].size() != model_[t].size()) return invalid_argument("set_model: tensor " + manifest_[t].name + " has the wrong size");
    for (const float v : trained[t]) {
      if (!std::isfinite(v)) return invalid_argument("set_model: tensor " + manifest_[t].name + " is not finite");
    }
  }
  for (size_t t = 0; t < model_.size(); ++t) model_[t] = trained[t];
  return Status::ok();
}

Result<GossipShare> GossipState::share(int peers) {
  if (peers < 1) return invalid_argument("a share needs at least one peer");
  std::vector<std::vector<float>> values(model_.size());
  for (size_t t = 0; t < model_.size(); ++t) {
    values[t].resize(model_[t].size());
    for (size_t i = 0; i < model_[t].size(); ++i) values[t][i] = model_[t][i] - reference_[t][i];
  }
  std::vector<std::span<const float>> spans(values.begin(), values.end());
  Result<protocol::CompressedUpdate> compressed = compressor_->compress(spans, /*want_decoded=*/true);
  if (!compressed.is_ok()) return compressed.status();
  GossipShare share;
  share.tensors = std::move(compressed->tensors);
  share.decoded = std::move(compressed->decoded);
  share.payload_bytes = compressed->payload_bytes;
  share.peers = peers;
  if (rule_ == MergeRule::kPairwise) {
    share.weight = 1.0;
    return share;
  }
  // Give each peer w / (1 + f); the model stays.
  share.weight = weight_ / (1.0 + peers);
  weight_ -= static_cast<double>(peers) * share.weight;
  return share;
}

void GossipState::take_back(const GossipShare& share, int undelivered) {
  if (rule_ != MergeRule::kPushSum || undelivered <= 0) return;
  // As if we had received the share ourselves, `undelivered` times.
  (void)merge(share.decoded, static_cast<double>(undelivered) * share.weight, 1.0);
}

Status GossipState::merge(std::span<const std::vector<float>> values, double weight, double staleness_weight) {
  if (values.size() != model_.size()) return invalid_argument("merge: wrong number of tensors");
  for (size_t t = 0; t < model_.size(); ++t) {
    if (values[t].size() != model_[t].size()) return invalid_argument("merge: tensor " + manifest_[t].name + " has the wrong size");
  }
  double theirs_share = 0.0;  // how far we move towards x0 + values
  if (rule_ == MergeRule::kPushSum) {
    if (!std::isfinite(weight) || !(weight > 0.0)) return invalid_argument("merge: push-sum weight must be finite and > 0");
    if (!std::isfinite(weight_ + weight)) return invalid_argument("merge: the push-sum weight would overflow");
    theirs_share = weight / (weight_ + weight);
  } else {
    if (!(staleness_weight >= 0.0 && staleness_weight <= 1.0)) return invalid_argument("merge: staleness weight must be in [0, 1]");
    theirs_share = 0.5 * staleness_weight;
  }
  // Check first, then write: nothing changes on a refusal.
  std::vector<std::vector<float>> next(model_.size());
  for (size_t t = 0; t < model_.size(); ++t) {
    next[t].resize(model_[t].size());
    for (size_t i = 0; i < model_[t].size(); ++i) {
      const double theirs = static_cast<double>(reference_[t][i]) + values[t][i];
      next[t][i] = static_cast<float>((1.0 - theirs_share) * model_[t][i] + theirs_share * theirs);
      if (!std::isfinite(next[t][i])) return invalid_argument("merge: the average would not be finite (tensor " + manifest_[t].name + ")");
    }
  }
  model_ = std::move(next);
  if (rule_ == MergeRule::kPushSum) weight_ += weight;
  return Status::ok();
}

double GossipState::distance_to(std::span<const std::vector<float>> values) const {
  double total = 0.0;
  for (size_t t = 0; t < model_.size() && t < values.size(); ++t) {
    for (size_t i = 0; i < model_[t].size() && i < values[t].size(); ++i) {
      const double diff = static_cast<double>(model_[t][i]) - (static_cast<double>(reference_[t][i]) + values[t][i]);
      total += diff * diff;
    }
  }
  return std::sqrt(total);
}

}  // namespace fedmesh::gossip
