#include "gossip/replicas.h"

#include <cmath>
#include <utility>

namespace fedmesh::gossip {

const char* default_gossip_compression(std::string_view local_optimizer, bool language_model) {
  if (local_optimizer == "adamw") return kAdamGossipCompression;
  return language_model ? kSgdLanguageModelGossipCompression : kSgdGossipCompression;
}

std::vector<std::pair<std::string, protocol::CompressionSpec>> plan_specs(const protocol::CompressionPlan& plan) {
  std::vector<std::pair<std::string, protocol::CompressionSpec>> specs = {{"the default", plan.default_spec}};
  for (const protocol::TensorOverride& o : plan.overrides) specs.emplace_back("override " + o.pattern, o.spec);
  return specs;
}

Status check_replica_compression(const protocol::CompressionPlan& plan) {
  for (const auto& [where, spec] : plan_specs(plan)) {
    if (spec.method == protocol::CompressionMethod::kPowerSgd) {
      return invalid_argument("gossip cannot carry '" + spec.to_string() + "' (" + where +
                              "): PowerSGD needs a factor shared by all senders of a round, which a server "
                              "computes; use top-k, dct-sign or a dense method");
    }
  }
  return Status::ok();
}

Result<ReplicaState> ReplicaState::create(const protocol::CompressionPlan& plan,
                                          std::vector<protocol::TensorShape> manifest,
                                          std::vector<std::vector<float>> reference, int members, double lr,
                                          uint64_t seed, kernels::CompressionKernels& kernels,
                                          size_t max_segment_bytes) {
  FEDMESH_RETURN_IF_ERROR(check_replica_compression(plan));
  if (members < 1) return invalid_argument("replicas need at least one member");
  if (!(lr > 0.0 && lr <= 1.0)) return invalid_argument("the outer learning rate must be in (0, 1]");
  if (reference.size() != manifest.size()) return invalid_argument("the reference model does not match the manifest");
  int64_t elements = 0;
  for (size_t t = 0; t < manifest.size(); ++t) {
    if (reference[t].size() != manifest[t].element_count()) {
      return invalid_argument("reference tensor " + manifest[t].name + " has the wrong size");
    }
    elements += static_cast<int64_t>(reference[t].size());
  }
  Result<protocol::UpdateCompressor> compressor = protocol::UpdateCompressor::create(plan, manifest, seed, kernels, max_segment_bytes);
  if (!compressor.is_ok()) return compressor.status();
  ReplicaState state;
  state.manifest_ = std::move(manifest);
  state.max_segment_bytes_ = max_segment_bytes;
  state.model_ = reference;
  state.reference_ = std::move(reference);
  state.weight_ = lr / static_cast<double>(members);
  state.sum_.emplace(elements);
  state.compressor_.emplace(std::move(*compressor));
  return state;
}

Result<OwnUpdate> ReplicaState::make_update(std::vector<std::vector<float>> trained) {
  if (trained.size() != model_.size()) return invalid_argument("make_update: wrong number of tensors");
  for (size_t t = 0; t < model_.size(); ++t) {
    if (trained[t].size() != model_[t].size()) {
      return invalid_argument("make_update: tensor " + manifest_[t].name + " has the wrong size");
    }
    for (const float v : trained[t]) {
      if (!std::isfinite(v)) return invalid_argument("make_update: tensor " + manifest_[t].name + " is not finite");
    }
  }
  // The pseudo-gradient, in place.
  for (size_t t = 0; t < model_.size(); ++t) {
    float* __restrict delta = trained[t].data();
    const float* __restrict held = model_[t].data();
    for (size_t i = 0; i < trained[t].size(); ++i) delta[i] -= held[i];
  }
  Result<protocol::CompressedUpdate> compressed = compressor_->compress(std::move(trained), /*want_decoded=*/true);
  if (!compressed.is_ok()) return compressed.status();
  OwnUpdate update;
  update.tensors = std::move(compressed->tensors);
  update.decoded = std::move(compressed->decoded);
  update.payload_bytes = compressed->payload_bytes;
  return update;
}

void ReplicaState::take_back() { compressor_->rollback(); }

Result<bool> ReplicaState::apply(const UpdateId& id, std::span<const std::vector<float>> decoded) {
  if (applied(id)) return false;
  if (decoded.size() != model_.size()) return invalid_argument("an update with the wrong number of tensors");
  std::vector<std::span<const float>> pieces;
  for (size_t t = 0; t < model_.size(); ++t) {
    if (decoded[t].size() != model_[t].size()) {
      return invalid_argument("an update whose tensor " + manifest_[t].name + " has the wrong size");
    }
    pieces.emplace_back(decoded[t]);
  }
  FEDMESH_RETURN_IF_ERROR(sum_->add(pieces, weight_));
  applied_.insert(id);
  refresh_model();
  return true;
}

void ReplicaState::refresh_model() {
  int64_t first = 0;
  for (size_t t = 0; t < model_.size(); ++t) {
    std::vector<float>& z = model_[t];
    sum_->sum(first, z);
    first += static_cast<int64_t>(z.size());
    const float* __restrict x0 = reference_[t].data();
    float* __restrict out = z.data();
    for (size_t i = 0; i < z.size(); ++i) out[i] = x0[i] + out[i];
  }
}

crypto::Hash ReplicaState::digest() const {
  const std::span<const int64_t> raw = sum_->raw();
  return crypto::hash_bytes({reinterpret_cast<const uint8_t*>(raw.data()), raw.size_bytes()});
}

void ReplicaState::forget_before(uint64_t round) {
  if (round <= floor_) return;
  floor_ = round;
  for (auto it = applied_.begin(); it != applied_.end();) it = it->round < floor_ ? applied_.erase(it) : std::next(it);
}

Status ReplicaState::restore(federation::ExactAccumulator::Saved sum, std::set<UpdateId> applied, uint64_t floor) {
  FEDMESH_RETURN_IF_ERROR(sum_->restore(std::move(sum)));
  applied_ = std::move(applied);
  floor_ = 0;
  forget_before(floor);
  refresh_model();
  return Status::ok();
}

}  // namespace fedmesh::gossip
