#include "train/training_checkpoint.h"

#include <deque>

namespace fedmesh::train {

namespace {

Status copy_into(const store::StoredTensor& stored, Tensor& destination, const std::string& what) {
  if (stored.value.dtype() != destination.dtype() || stored.value.shape() != destination.shape()) {
    return corrupt("checkpoint tensor " + what + " is " + dtype_name(stored.value.dtype()) + " " +
                   shape_to_string(stored.value.shape()) + ", the model expects " + dtype_name(destination.dtype()) +
                   " " + shape_to_string(destination.shape()));
  }
  destination.copy_from(stored.value);  // onto the CUDA device where the model lives there
  return Status::ok();
}

}  // namespace

nlohmann::json trainer_state_to_json(const TrainerState& state) {
  return {{"step", state.step},
          {"epoch", state.epoch},
          {"epoch_offset", state.epoch_offset},
          {"epoch_rng",
           {{"words", state.epoch_rng.words},
            {"spare_normal", state.epoch_rng.spare_normal},
            {"has_spare_normal", state.epoch_rng.has_spare_normal}}},
          {"optimizer_steps", state.optimizer_steps},
          {"loss_scaler",
           {{"scale", state.loss_scaler.scale},
            {"clean_run", state.loss_scaler.clean_run},
            {"skipped", state.loss_scaler.skipped}}},
          {"epoch_loss_sum", state.epoch_loss_sum},
          {"epoch_samples", state.epoch_samples},
          {"epoch_correct", state.epoch_correct},
          {"samples", state.samples},
          {"skipped_steps", state.skipped_steps},
          {"train_seconds", state.train_seconds},
          {"final_train_loss", state.final_train_loss},
          {"epochs_completed", state.epochs_completed}};
}

Result<TrainerState> trainer_state_from_json(const std::string& text) {
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) return corrupt("the checkpoint's trainer state is not a JSON object");
  TrainerState state;
  try {
    state.step = json.at("step").get<int64_t>();
    state.epoch = json.at("epoch").get<int64_t>();
    state.epoch_offset = json.at("epoch_offset").get<int64_t>();
    const nlohmann::json& rng = json.at("epoch_rng");
    state.epoch_rng.words = rng.at("words").get<std::array<uint64_t, 4>>();
    state.epoch_rng.spare_normal = rng.at("spare_normal").get<double>();
    state.epoch_rng.has_spare_normal = rng.at("has_spare_normal").get<bool>();
    state.optimizer_steps = json.at("optimizer_steps").get<int64_t>();
    const nlohmann::json& scaler = json.at("loss_scaler");
    state.loss_scaler.scale = scaler.at("scale").get<float>();
    state.loss_scaler.clean_run = scaler.at("clean_run").get<int64_t>();
    state.loss_scaler.skipped = scaler.at("skipped").get<int64_t>();
    state.epoch_loss_sum = json.at("epoch_loss_sum").get<double>();
    state.epoch_samples = json.at("epoch_samples").get<int64_t>();
    state.epoch_correct = json.at("epoch_correct").get<int64_t>();
    state.samples = json.at("samples").get<int64_t>();
    state.skipped_steps = json.at("skipped_steps").get<int64_t>();
    state.train_seconds = json.at("train_seconds").get<double>();
    state.final_train_loss = json.at("final_train_loss").get<double>();
    state.epochs_completed = json.at("epochs_completed").get<int64_t>();
  } catch (const nlohmann::json::exception& error) {
    return corrupt(std::string("the checkpoint's trainer state is malformed: ") + error.what());
  }
  return state;
}

Status commit_training_checkpoint(store::CheckpointStore& store, Sequential& model, Trainer& trainer,
                                  const nlohmann::json& metrics, std::optional<store::PrivacyEntry> privacy) {
  const TrainerState state = trainer.state();
  std::vector<Parameter*> parameters = model.parameters();
  store::RoundToCommit round;
  round.privacy = std::move(privacy);
  if (round.privacy) round.privacy->round = state.step;
  round.round = state.step;
  round.model_version = state.step;
  round.metrics_json = metrics.dump();
  round.state_json = trainer_state_to_json(state).dump();
  // The store reads host memory: tensors on the CUDA device are copied out
  // first (the deque keeps every host tensor where the round's pointers point).
  std::deque<Tensor> host;
  for (Parameter* parameter : parameters) {
    round.tensors.push_back({kModelRole, parameter->name, &host.emplace_back(parameter->value.host())});
  }
  for (const OptimizerStateTensor& tensor : trainer.optimizer().state_tensors(parameters)) {
    round.tensors.push_back({kOptimizerRole, tensor.name, &host.emplace_back(tensor.tensor->host())});
  }
  return store.commit_round(round);
}

Status load_model_weights(const store::LoadedCheckpoint& checkpoint, Sequential& model) {
  for (Parameter* parameter : model.parameters()) {
    const store::StoredTensor* stored = checkpoint.find(kModelRole, parameter->name);
    if (stored == nullptr) {
      return corrupt("checkpoint round " + std::to_string(checkpoint.round.round) + " has no weights for " +
                     parameter->name + ": it was written for a different model");
    }
    FEDMESH_RETURN_IF_ERROR(copy_into(*stored, parameter->value, std::string(kModelRole) + "/" + parameter->name));
  }
  model.refresh_compute();
  return Status::ok();
}

Status restore_training_checkpoint(const store::LoadedCheckpoint& checkpoint, Sequential& model, Trainer& trainer,
                                   int64_t targets_per_sample) {
  Result<TrainerState> state = trainer_state_from_json(checkpoint.round.state_json);
  if (!state.is_ok()) return state.status();
  std::vector<Parameter*> parameters = model.parameters();
  FEDMESH_RETURN_IF_ERROR(load_model_weights(checkpoint, model));
  for (const OptimizerStateTensor& tensor : trainer.optimizer().state_tensors(parameters)) {
    const store::StoredTensor* stored = checkpoint.find(kOptimizerRole, tensor.name);
    if (stored == nullptr) {
      return corrupt("checkpoint round " + std::to_string(checkpoint.round.round) + " has no optimizer state " +
                     tensor.name + ": it was written with a different optimizer");
    }
    FEDMESH_RETURN_IF_ERROR(copy_into(*stored, *tensor.tensor, std::string(kOptimizerRole) + "/" + tensor.name));
  }
  Status restored = trainer.restore(*state, targets_per_sample);
  if (!restored.is_ok()) return corrupt("checkpoint round " + std::to_string(checkpoint.round.round) + ": " + restored.message());
  return Status::ok();
}

}  // namespace fedmesh::train
