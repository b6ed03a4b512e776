// A RoundManager in the checkpoint store, between rounds: the global model
// (role "model"), the server optimizer's tensors (role "server_optimizer"),
// and the manager's state (version, round, sampling generator, applied ids,
// the model's hash-chain link) in the round's state JSON under "manager".
// The applied updates go into the store's applied table in the same
// transaction, so an update id applied in a committed round is refused
// forever. Both `fedmesh sim --db` and `fedmesh aggregator` commit this way
// and add their own fields next to "manager".
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <vector>

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

// The most versions one restoration bridges: a quarantined round's recorded
// version further above the restored one is not believed.
inline constexpr int64_t kMaxBridgedVersions = int64_t{1} << 20;

// Round numbers and model versions never go back. When rounds above
// `resumed_round` (the round the manager was restored from; 0 for the
// initial model) are in quarantine, the manager moves past them: its model
// (the restored one) becomes version V+1 in round Q+1, where Q is the
// newest quarantined round and V the newest version they recorded, and its
// parent in the chain is version V's hash, read from the quarantined
// round's state (the chain there must agree with `chain` up to the restored
// version). So a site that adopted version V before it was lost accepts the
// next model, and no version number ever names two models. A version whose
// hash cannot be read is given a placeholder (told to `warn`): a site
// holding it refuses the next model and is reset from its own store.
// `chain` (the restored model's, by version) is extended to the new version.
// Returns the record to commit (no update applied), or nullopt when nothing
// above `resumed_round` is in quarantine.
Result<std::optional<RoundRecord>> step_past_quarantine(store::CheckpointStore& store, RoundManager& manager,
                                                        int64_t resumed_round, bool asynchronous,
                                                        std::vector<crypto::Hash>& chain,
                                                        const std::function<void(const std::string&)>& warn);

}  // namespace fedmesh::aggregator
