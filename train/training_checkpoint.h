// A local training run's checkpoint in the store: the model's fp32 master
// weights (role "model"), the optimizer's state tensors (role "optimizer"),
// and the TrainerState as the round's state JSON, committed together in one
// transaction per checkpoint. Restoring all three into a fresh model and
// trainer built with the same options continues the run exactly where the
// checkpoint left it, so an interrupted and resumed run ends with the same
// weights, bit for bit, as one that never stopped (same thread count).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "train/model.h"
#include "train/trainer.h"
#include "store/checkpoint_store.h"

namespace fedmesh::train {

inline constexpr const char* kModelRole = "model";
inline constexpr const char* kOptimizerRole = "optimizer";

nlohmann::json trainer_state_to_json(const TrainerState& state);
// kCorrupt naming the field when a stored state is malformed.
Result<TrainerState> trainer_state_from_json(const std::string& text);

// Commits the model, the optimizer state and the trainer's state as round
// `step` (model version `step`), with the privacy ledger's entry for it when
// the run is differentially private. Only after it returns ok is the step
// durable.
Status commit_training_checkpoint(store::CheckpointStore& store, Sequential& model, Trainer& trainer,
                                  const nlohmann::json& metrics,
                                  std::optional<store::PrivacyEntry> privacy = std::nullopt);

// Copies a checkpoint's weights (role "model") into the model's masters and
// compute copies; kCorrupt names a tensor that is missing or of the wrong
// shape. Reads checkpoints of `fedmesh train`, the aggregator and the nodes.
Status load_model_weights(const store::LoadedCheckpoint& checkpoint, Sequential& model);

// Loads a checkpoint into a freshly built model and trainer (same model name,
// seed and options): weights, compute copies, optimizer tensors and steps,
// and the trainer's position. kCorrupt names a tensor that is missing or of
// the wrong shape. targets_per_sample: the training set's (Trainer::restore).
Status restore_training_checkpoint(const store::LoadedCheckpoint& checkpoint, Sequential& model, Trainer& trainer,
                                   int64_t targets_per_sample = 1);

}  // namespace fedmesh::train
