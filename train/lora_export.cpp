#include "train/lora_export.h"

#include <filesystem>

#include "train/training_checkpoint.h"

namespace fedmesh::train {

Status record_lora_base(store::CheckpointStore& store, std::string_view name, uint64_t seed, const ModelInput& input,
                        const InitialWeights& init, Sequential& model) {
  if (!model.lora().enabled()) return Status::ok();
  std::string init_path = init.path;
  if (!init_path.empty()) {
    std::error_code error;
    const std::filesystem::path absolute = std::filesystem::absolute(init_path, error);
    if (!error) init_path = absolute.string();
  }
  const nlohmann::json record = {
      {"model", name},
      {"seed", seed},
      {"input",
       {{"vocabulary", input.vocabulary}, {"sample_shape", input.sample_shape}, {"classes", input.classes},
        {"regression", input.regression}}},
      {"init", init_path},
      {"init_format", init.format},
      {"init_partial", init.partial},
      {"lora", model.lora().to_json()},
      {"frozen", model.frozen_fingerprint()}};
  return store.set_meta(kLoraBaseKey, record.dump());
}

Result<std::unique_ptr<Sequential>> merged_lora_model(store::CheckpointStore& store, int64_t round,
                                                      const std::string& init_path, const std::string& init_format) {
  Result<std::optional<std::string>> text = store.meta(kLoraBaseKey);
  if (!text.is_ok()) return text.status();
  if (!text->has_value()) {
    return invalid_argument(store.path() + " holds no LoRA run (no adapters to merge): export it without --merge-lora");
  }
  const nlohmann::json record = nlohmann::json::parse(**text, nullptr, false);
  const auto field = [&](const char* key, nlohmann::json::value_t type) {
    return record.is_object() && record.contains(key) && record[key].type() == type;
  };
  using Type = nlohmann::json::value_t;
  if (!field("model", Type::string) || !field("seed", Type::number_unsigned) || !field("input", Type::object) ||
      !field("init", Type::string) || !field("init_format", Type::string) || !field("init_partial", Type::boolean) ||
      !field("lora", Type::object) || !field("frozen", Type::string)) {
    return corrupt(store.path() + ": the " + std::string(kLoraBaseKey) + " record is malformed: " + **text);
  }
  const nlohmann::json& in = record["input"];
  ModelInput input;
  try {
    input.vocabulary = in.at("vocabulary").get<int64_t>();
    input.sample_shape = in.at("sample_shape").get<Shape>();
    input.classes = in.at("classes").get<int64_t>();
    input.regression = in.at("regression").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    return corrupt(store.path() + ": the " + std::string(kLoraBaseKey) + " record's input is malformed: " + e.what());
  }
  Result<LoraOptions> lora = lora_from_json(record["lora"], store.path());
  if (!lora.is_ok()) return lora.status();
  InitialWeights init;
  init.path = init_path.empty() ? record["init"].get<std::string>() : init_path;
  init.format = init_path.empty() || init_format.empty() ? record["init_format"].get<std::string>() : init_format;
  init.partial = record["init_partial"].get<bool>();
  init.lora = *lora;
  const std::string recorded = record["frozen"].get<std::string>();
  Result<std::unique_ptr<Sequential>> model =
      make_initial_model(record["model"].get<std::string>(), record["seed"].get<uint64_t>(), input, init);
  if (!model.is_ok()) {
    return Status(model.status().code(), "the frozen weights under the adapters: " + model.status().message() +
                                             (init_path.empty() ? " (give the base file with --init if it moved)" : ""));
  }
  if (const std::string rebuilt = (*model)->frozen_fingerprint(); rebuilt != recorded) {
    return invalid_argument("the frozen weights rebuilt from " + (init.path.empty() ? std::string("the seed") : init.path) +
                            " (" + rebuilt + ") are not the ones the adapters were trained on (" + recorded +
                            "): give the run's own base file with --init");
  }
  Result<store::LoadedCheckpoint> loaded = store.load_round(round);
  if (!loaded.is_ok()) return loaded.status();
  FEDMESH_RETURN_IF_ERROR(load_model_weights(*loaded, **model));  // the B factors; merged by refresh_compute
  return model;
}

}  // namespace fedmesh::train
