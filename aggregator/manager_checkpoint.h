// A RoundManager in the checkpoint store, between rounds: the global model
// (role "model"), the server optimizer's tensors (role "server_optimizer"),
// and the manager's state (version, round, sampling generator, applied ids,
// the model's hash-chain link) in the round's state JSON under "manager".
// The applied updates go into the store's applied table in the same
// transaction, so an update id applied in a committed round is refused
// forever. Both `fedmesh sim --db` and `fedmesh aggregator` commit this way
// and add their own fields next to "manager".
#pragma once

#include <span>

#include <nlohmann/json.hpp>

#include "aggregator/round_manager.h"
#include "base/status.h"
#include "store/checkpoint_store.h"

namespace fedmesh::aggregator {

inline constexpr const char* kServerOptimizerRole = "server_optimizer";

// Commits `record` (the step just taken) with the manager's state. `metrics`
// gets "updates", "staleness" (one tau per applied update) and "model_hash";
// `state` (a JSON object of the caller's fields) gets "manager".
Status commit_manager_round(store::CheckpointStore& store, RoundManager& manager, const RoundRecord& record,
                            nlohmann::json metrics, nlohmann::json state,
                            const std::map<std::string, uint64_t>& replay_counters = {},
                            std::span<const store::TensorToCommit> extra_tensors = {},
                            std::optional<store::PrivacyEntry> privacy = std::nullopt);

// Restores the manager (created with the same options and model shapes) from
// a loaded checkpoint, checking the model against its hash-chain link.
// Returns the round's whole state JSON for the caller's own fields; kCorrupt
// names what is missing or malformed.
Result<nlohmann::json> restore_manager(const store::LoadedCheckpoint& checkpoint, RoundManager& manager);

}  // namespace fedmesh::aggregator
