// LoRA runs in the store: what rebuilds the frozen model under a run's B
// factors, and the merged model of a round (`fedmesh checkpoint export
// --merge-lora`). A LoRA round holds the B factors alone (train/lora.h);
// the frozen weights come from the run's init file and its seed, so the
// store records how to rebuild them (the "lora_base" meta key, written when
// a LoRA run of `fedmesh train` or an aggregator starts on the store) and the
// fingerprint that proves a rebuild is the same.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "store/checkpoint_store.h"
#include "train/initial_weights.h"
#include "train/model.h"

namespace fedmesh::train {

inline constexpr const char* kLoraBaseKey = "lora_base";

// Records how `model` (built by make_initial_model from these arguments,
// adapters attached) is rebuilt: model name, seed, input, init file and
// format, LoRA options and the frozen fingerprint. Nothing without LoRA.
Status record_lora_base(store::CheckpointStore& store, std::string_view name, uint64_t seed, const ModelInput& input,
                        const InitialWeights& init, Sequential& model);

// The model of `round` with every adapter merged (W0 + scale · B · A in the
// adapted weights' values; the B factors then mean nothing more): rebuilt
// from the store's record, with `init_path` (and `init_format`) instead of
// the recorded file when given (it moved). Refused, naming what: a store
// without a LoRA run, an init file that is missing or holds other weights
// (the rebuilt frozen fingerprint differs from the recorded one), a round
// without the B factors.
Result<std::unique_ptr<Sequential>> merged_lora_model(store::CheckpointStore& store, int64_t round,
                                                      const std::string& init_path = "",
                                                      const std::string& init_format = "");

}  // namespace fedmesh::train
