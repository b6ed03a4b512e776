#include "aggregator/manager_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <limits>

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

namespace {

// The hashes of a quarantined round's state "chain", when it parses and
// agrees with `trusted` on every version `trusted` holds; empty otherwise.
std::vector<crypto::Hash> agreeing_chain(const std::string& state_json, const std::vector<crypto::Hash>& trusted) {
  const nlohmann::json state = nlohmann::json::parse(state_json, nullptr, /*allow_exceptions=*/false);
  if (!state.is_object() || !state.contains("chain") || !state["chain"].is_array()) return {};
  const nlohmann::json& hexes = state["chain"];
  if (hexes.size() <= trusted.size() || hexes.size() > trusted.size() + static_cast<size_t>(kMaxBridgedVersions)) return {};
  std::vector<crypto::Hash> chain;
  chain.reserve(hexes.size());
  for (const nlohmann::json& hex : hexes) {
    if (!hex.is_string()) return {};
    Result<crypto::Hash> hash = federation::parse_hash_hex(hex.get<std::string>());
    if (!hash.is_ok()) return {};
    chain.push_back(*hash);
  }
  if (!std::equal(trusted.begin(), trusted.end(), chain.begin())) return {};
  return chain;
}

// Stands in for a version whose hash is lost: derived from the version and
// its parent, so every restart derives the same one.
crypto::Hash placeholder_hash(int64_t version, const crypto::Hash& parent) {
  crypto::Hasher hasher;
  hasher.update_text("fedmesh-quarantined-version-v1");
  hasher.update_u64(static_cast<uint64_t>(version));
  hasher.update(parent);
  return hasher.finish();
}

}  // namespace

Result<std::optional<RoundRecord>> step_past_quarantine(store::CheckpointStore& store, RoundManager& manager,
                                                        int64_t resumed_round, bool asynchronous,
                                                        std::vector<crypto::Hash>& chain,
                                                        const std::function<void(const std::string&)>& warn) {
  if (chain.size() != static_cast<size_t>(manager.version()) + 1 || chain.back() != manager.link().hash) {
    return invalid_argument("step_past_quarantine: the chain does not end at the manager's version");
  }
  Result<std::vector<store::QuarantinedRound>> quarantined = store.quarantined_rounds();
  if (!quarantined.is_ok()) return quarantined.status();
  const int64_t restored_version = manager.version();
  int64_t newest_round = -1, newest_version = restored_version;
  std::vector<const store::QuarantinedRound*> above;  // newest round first
  for (auto it = quarantined->rbegin(); it != quarantined->rend(); ++it) {
    if (it->round <= resumed_round) continue;
    above.push_back(&*it);
    newest_round = std::max(newest_round, it->round);
    if (it->model_version >= restored_version && it->model_version - restored_version <= kMaxBridgedVersions) {
      newest_version = std::max(newest_version, it->model_version);
    } else if (warn) {
      warn("quarantined round " + std::to_string(it->round) + " records model version " +
           std::to_string(it->model_version) + ", out of reach of the restored version " +
           std::to_string(restored_version) + "; not counted");
    }
  }
  if (above.empty()) return std::optional<RoundRecord>();
  if (newest_round >= std::numeric_limits<int64_t>::max() - 1) return corrupt("a quarantined round number is out of range");

  // Versions above the restored one that the quarantined rounds reached.
  std::vector<std::vector<crypto::Hash>> recorded;  // newest round first
  for (const store::QuarantinedRound* round : above) recorded.push_back(agreeing_chain(round->state_json, chain));
  int64_t unknown = 0;
  for (int64_t version = restored_version + 1; version <= newest_version; ++version) {
    std::optional<crypto::Hash> known;
    for (const std::vector<crypto::Hash>& theirs : recorded) {
      if (theirs.size() > static_cast<size_t>(version)) {
        known = theirs[static_cast<size_t>(version)];
        break;
      }
    }
    if (!known) ++unknown;
    chain.push_back(known ? *known : placeholder_hash(version, chain.back()));
  }
  if (unknown > 0 && warn) {
    warn(std::to_string(unknown) + " model version(s) up to " + std::to_string(newest_version) +
         " have no readable hash in the quarantined rounds; a site holding one of them refuses the next model "
         "until its store is moved aside");
  }

  // The restored model as the next version, in the round after the newest
  // quarantined one (asynchronous rounds are numbered by version).
  int64_t version = newest_version > restored_version ? newest_version + 1 : restored_version;
  const int64_t round = newest_round + 1;
  if (asynchronous && version < round) {
    if (round - restored_version > kMaxBridgedVersions) return corrupt("a quarantined round number is out of reach");
    while (static_cast<int64_t>(chain.size()) < round) {
      chain.push_back(placeholder_hash(static_cast<int64_t>(chain.size()), chain.back()));
    }
    version = round;
  }
  Result<RoundManagerState> state = manager.state();
  if (!state.is_ok()) return state.status();
  state->version = version;
  state->round = round;
  federation::ChainLink link;
  link.version = version;
  if (version == restored_version) {
    link = manager.link();
  } else {
    link.parent = chain.back();
    link.hash = federation::model_version_hash(version, link.parent, manager.names(), manager.model());
    chain.push_back(link.hash);
  }
  state->link = link;
  FEDMESH_RETURN_IF_ERROR(manager.restore(*state));
  RoundRecord record;
  record.round = round;
  record.version = version;
  record.link = link;
  return std::optional<RoundRecord>(record);
}

}  // namespace fedmesh::aggregator
