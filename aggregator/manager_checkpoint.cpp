#include "aggregator/manager_checkpoint.h"

#include <cstring>

namespace fedmesh::aggregator {

namespace {

std::vector<std::pair<std::string, Shape>> model_shapes(const RoundManager& manager) {
  std::vector<std::pair<std::string, Shape>> shapes;
  for (size_t i = 0; i < manager.model().size(); ++i) shapes.emplace_back(manager.names()[i], manager.model()[i].shape());
  return shapes;
}

nlohmann::json rng_json(const Rng::State& state) {
  return {{"words", state.words}, {"spare", state.spare_normal}, {"has_spare", state.has_spare_normal}};
}

}  // namespace

Status commit_manager_round(store::CheckpointStore& store, RoundManager& manager, const RoundRecord& record,
                            nlohmann::json metrics, nlohmann::json state,
                            const std::map<std::string, uint64_t>& replay_counters,
                            std::span<const store::TensorToCommit> extra_tensors,
                            std::optional<store::PrivacyEntry> privacy) {
  Result<RoundManagerState> manager_state = manager.state();
  if (!manager_state.is_ok()) return manager_state.status();
  state["manager"] = {{"version", manager_state->version}, {"round", manager_state->round},
                      {"rng", rng_json(manager_state->rng)},
                      {"server_steps", manager_state->server_steps}, {"accepted", manager_state->accepted},
                      {"refused", manager_state->refused}, {"applied_ids", manager_state->applied_ids},
                      {"model_hash", federation::hash_hex(manager_state->link.hash)},
                      {"parent_hash", federation::hash_hex(manager_state->link.parent)}};
  store::RoundToCommit commit;
  commit.round = record.round;
  commit.model_version = record.version;
  nlohmann::json staleness = nlohmann::json::array();
  for (const AppliedUpdateRecord& applied : record.applied) {
    staleness.push_back(applied.staleness);
    commit.applied_updates.push_back(
        {std::vector<uint8_t>(applied.id.begin(), applied.id.end()), applied.site, applied.staleness});
  }
  metrics["updates"] = record.applied.size();
  metrics["staleness"] = staleness;
  metrics["model_hash"] = federation::hash_hex(record.link.hash);
  commit.metrics_json = metrics.dump();
  commit.state_json = state.dump();
  commit.replay_counters = replay_counters;
  for (size_t i = 0; i < manager.model().size(); ++i) {
    commit.tensors.push_back({"model", manager.names()[i], &manager.model()[i]});
  }
  for (const OptimizerStateTensor& tensor : manager.server_optimizer().state_tensors(model_shapes(manager))) {
    commit.tensors.push_back({kServerOptimizerRole, tensor.name, tensor.tensor});
  }
  commit.tensors.insert(commit.tensors.end(), extra_tensors.begin(), extra_tensors.end());
  commit.privacy = std::move(privacy);
  return store.commit_round(commit);
}

Result<nlohmann::json> restore_manager(const store::LoadedCheckpoint& checkpoint, RoundManager& manager) {
  try {
    nlohmann::json state = nlohmann::json::parse(checkpoint.round.state_json);
    const nlohmann::json& m = state.at("manager");
    RoundManagerState manager_state;
    manager_state.version = m.at("version").get<int64_t>();
    manager_state.round = m.at("round").get<int64_t>();
    manager_state.rng.words = m.at("rng").at("words").get<std::array<uint64_t, 4>>();
    manager_state.rng.spare_normal = m.at("rng").at("spare").get<double>();
    manager_state.rng.has_spare_normal = m.at("rng").at("has_spare").get<bool>();
    manager_state.server_steps = m.at("server_steps").get<int64_t>();
    manager_state.accepted = m.at("accepted").get<int64_t>();
    manager_state.refused = m.at("refused").get<int64_t>();
    manager_state.applied_ids = m.at("applied_ids").get<std::vector<std::string>>();
    manager_state.link.version = manager_state.version;
    Result<crypto::Hash> model_hash = federation::parse_hash_hex(m.at("model_hash").get<std::string>());
    Result<crypto::Hash> parent_hash = federation::parse_hash_hex(m.at("parent_hash").get<std::string>());
    if (!model_hash.is_ok()) return model_hash.status();
    if (!parent_hash.is_ok()) return parent_hash.status();
    manager_state.link.hash = *model_hash;
    manager_state.link.parent = *parent_hash;
    for (size_t i = 0; i < manager.model().size(); ++i) {
      const store::StoredTensor* stored = checkpoint.find("model", manager.names()[i]);
      Tensor& destination = manager.mutable_model()[i];
      if (stored == nullptr || stored->value.shape() != destination.shape() || stored->value.dtype() != DType::kF32) {
        return corrupt("checkpoint has no model tensor " + manager.names()[i] + " of the model's shape");
      }
      std::memcpy(destination.raw(), stored->value.raw(), destination.nbytes());
    }
    for (const OptimizerStateTensor& tensor : manager.server_optimizer().state_tensors(model_shapes(manager))) {
      const store::StoredTensor* stored = checkpoint.find(kServerOptimizerRole, tensor.name);
      if (stored == nullptr || stored->value.shape() != tensor.tensor->shape()) {
        return corrupt("checkpoint has no server optimizer state " + tensor.name);
      }
      std::memcpy(tensor.tensor->raw(), stored->value.raw(), tensor.tensor->nbytes());
    }
    FEDMESH_RETURN_IF_ERROR(manager.restore(manager_state));
    return state;
  } catch (const nlohmann::json::exception& error) {
    return corrupt(std::string("the round manager's state in the checkpoint is malformed: ") + error.what());
  }
}

}  // namespace fedmesh::aggregator
