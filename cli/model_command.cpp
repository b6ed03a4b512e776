#include "cli/model_command.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/data_flags.h"
#include "cli/output.h"
#include "store/tensor_export.h"
#include "train/model_spec.h"
#include "train/predict.h"
#include "train/training_data.h"

namespace fedmesh::cli {

namespace {

struct ModelFlags {
  std::string model;
  train::data::DataSource data;
  std::string tokenizer;
  bool json = false;
  CLI::Option* data_given = nullptr;  // --data was given: build for that data
};

int fail(const ModelFlags& flags, const Status& status) {
  return report_failure("model", flags.json, status, status.code() == StatusCode::kIoError ? 1 : 2);
}

// "1.23 M" style counts for people.
std::string count_text(double n) {
  char out[32];
  if (n >= 1e9) std::snprintf(out, sizeof out, "%.2f G", n / 1e9);
  else if (n >= 1e6) std::snprintf(out, sizeof out, "%.2f M", n / 1e6);
  else if (n >= 1e3) std::snprintf(out, sizeof out, "%.1f k", n / 1e3);
  else std::snprintf(out, sizeof out, "%.0f", n);
  return out;
}

int run_show(const ModelFlags& flags) {
  // The spec: a file, or a built-in model written as one.
  std::optional<train::ModelSpec> spec;
  if (train::is_model_spec_file(flags.model)) {
    Result<train::ModelSpec> read = train::read_model_spec(flags.model);
    if (!read.is_ok()) return fail(flags, read.status());
    spec = std::move(*read);
  } else {
    spec = train::preset_model_spec(flags.model);
    if (!spec) return fail(flags, invalid_argument("unknown model '" + flags.model + "' (a built-in name or FILE.toml)"));
  }
  // What the model is built for: the data's shape and classes (Fashion-MNIST's
  // without --data), or the tokenizer's vocabulary.
  train::ModelInput input;
  std::string data_text = spec->gpt ? "bytes (vocabulary 256)" : "Fashion-MNIST (1, 28, 28), 10 classes";
  if (flags.data_given->count() > 0 || !flags.tokenizer.empty()) {
    train::TrainingDataSpec what{flags.model, flags.data, flags.tokenizer, 0, 0};
    Result<train::TrainingData> data = train::load_training_data(what);
    if (!data.is_ok()) return fail(flags, data.status());
    input = {data->vocabulary, data->schema.sample_shape, data->schema.classes, data->schema.regression};
    data_text = data->description;
  }
  std::vector<train::BuiltLayer> plan;
  Result<std::unique_ptr<train::Sequential>> model = train::build_model(*spec, 0, input, &plan);
  if (!model.is_ok()) return fail(flags, model.status());
  const int64_t parameters = (*model)->parameter_count();
  int64_t flops = 0;
  for (const train::BuiltLayer& b : plan) flops += b.flops;
  const std::string device_note = [&] {
    for (size_t i = 0; i < (*model)->layer_count(); ++i) {
      if (!(*model)->layer(i).runs_on_cuda()) return "cpu only (" + (*model)->layer(i).kind() + " has no CUDA version yet)";
    }
    return std::string("cpu and cuda");
  }();
  if (flags.json) {
    nlohmann::json layers = nlohmann::json::array();
    for (const train::BuiltLayer& b : plan) {
      layers.push_back({{"kind", b.kind}, {"name", b.name}, {"output", b.output}, {"parameters", b.parameters},
                        {"flops", b.flops}});
    }
    emit_json({{"event", "summary"}, {"command", "model show"}, {"model", spec->name},
               {"fingerprint", spec->fingerprint()}, {"input", (*model)->sample_shape()}, {"layers", layers},
               {"parameters", parameters}, {"flops_per_sample", flops}, {"devices", device_note}});
    return 0;
  }
  std::printf("model %s (%s), built for %s\n", spec->name.c_str(), spec->fingerprint().c_str(), data_text.c_str());
  std::printf("input %s per sample\n", shape_to_string((*model)->sample_shape()).c_str());
  std::printf("%-3s %-16s %-10s %-18s %12s %12s\n", "#", "layer", "name", "output", "parameters", "FLOPs");
  for (size_t i = 0; i < plan.size(); ++i) {
    const train::BuiltLayer& b = plan[i];
    std::printf("%-3zu %-16s %-10s %-18s %12lld %12s\n", i + 1, b.kind.c_str(), b.name.c_str(),
                shape_to_string(b.output).c_str(), static_cast<long long>(b.parameters), count_text(static_cast<double>(b.flops)).c_str());
  }
  std::printf("total: %lld parameters (%s), %s FLOPs per sample forward; runs on %s\n",
              static_cast<long long>(parameters), format_bytes(parameters * 4).c_str(),
              count_text(static_cast<double>(flops)).c_str(), device_note.c_str());
  return 0;
}

struct PredictFlags {
  train::PredictOptions options;
  std::string out;
  bool json = false;
};

int run_predict(const PredictFlags& flags) {
  const auto failed = [&](const Status& s) {
    return report_failure("model predict", flags.json, s, s.code() == StatusCode::kIoError ? 1 : 2);
  };
  Result<train::Prediction> prediction = train::predict(flags.options);
  if (!prediction.is_ok()) return failed(prediction.status());
  const Tensor& logits = prediction->logits;
  std::vector<store::SafetensorsEntry> entries = {
      {"logits", DType::kF32, logits.shape(), false, [&](const std::function<Status(std::span<const uint8_t>)>& consume) {
         return consume({static_cast<const uint8_t*>(logits.raw()), logits.nbytes()});
       }}};
  Result<store::ExportSummary> written =
      store::write_safetensors(flags.out, entries, {{"model", flags.options.model}, {"weights", flags.options.weights.path}});
  if (!written.is_ok()) return failed(written.status());
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "model predict"}, {"samples", prediction->samples},
               {"logits", logits.shape()}, {"out", flags.out}});
  } else {
    std::printf("%lld samples: logits %s written to %s\n", static_cast<long long>(prediction->samples),
                shape_to_string(logits.shape()).c_str(), flags.out.c_str());
  }
  return 0;
}

}  // namespace

CLI::Validator model_name_check() {
  return CLI::Validator(
      [](std::string& name) -> std::string {
        const std::vector<std::string> names = train::model_names();
        if (std::find(names.begin(), names.end(), name) != names.end() || train::is_model_spec_file(name)) return "";
        std::string list;
        for (const std::string& n : names) list += n + ", ";
        return "model '" + name + "' is none of " + list + "or a model spec file NAME.toml";
      },
      "MODEL|FILE.toml");
}

void add_model_command(CLI::App& app, int& exit_code) {
  CLI::App* cmd = app.add_subcommand(
      "model", "Models: what a built-in model or a model spec file (FILE.toml: layers for tables and images, or a GPT) "
               "builds for your data");
  cmd->require_subcommand(1);
  auto flags = std::make_shared<ModelFlags>();
  CLI::App* show = cmd->add_subcommand(
      "show", "Print a model's layers with their output shapes, parameter counts and forward FLOPs per sample, the "
              "total, and the spec's fingerprint (what the aggregator and every site must share). A spec that does "
              "not fit the data is refused naming the layer and both shapes");
  show->add_option("model", flags->model, "A built-in model (mlp, cnn, gpt-nano, ...) or a spec file FILE.toml "
                                          "(docs/models.md)")
      ->required()
      ->check(model_name_check());
  flags->data_given = show->add_option("--data", flags->data.source,
                   "The data the model is built for (as `fedmesh train --data`): csv:FILE, images:DIR, arrays:FILE, "
                   "... Without it: Fashion-MNIST's shape and classes");
  add_own_data_flags(show, flags->data);
  show->add_option("--tokenizer", flags->tokenizer, "A GPT's tokenizer (its vocabulary sizes the model)");
  show->add_flag("--json", flags->json, "Print one JSON summary line");
  show->callback([flags, &exit_code] { exit_code = run_show(*flags); });

  auto predict_flags = std::make_shared<PredictFlags>();
  train::PredictOptions& o = predict_flags->options;
  CLI::App* predict = cmd->add_subcommand(
      "predict", "Run a model with given weights on given inputs (evaluation mode) and write its logits: the array "
                 "\"logits\" of a safetensors file, (samples, classes), or (samples x context, vocabulary) for a GPT");
  predict->add_option("model", o.model, "A built-in model or a spec file FILE.toml")->required()->check(model_name_check());
  predict->add_option("--weights", o.weights.path,
                      "The weights: a safetensors/.npz/.npy file with every parameter by name (what `checkpoint "
                      "export` writes), as train --init")
      ->required();
  predict->add_option("--weights-format", o.weights.format, "fedmesh, or hf-gpt2 (Hugging Face's GPT-2 layout)")
      ->check(CLI::IsMember({"fedmesh", "hf-gpt2"}))
      ->capture_default_str();
  predict->add_option("--input", o.input,
                      "A .npz, .npy or safetensors file whose array x holds the samples (N, ...) or, for a GPT, "
                      "token ids (N, at most the context)")
      ->required();
  predict->add_option("--classes", o.classes, "Image and table models: outputs per sample")->capture_default_str();
  predict->add_option("--vocabulary", o.vocabulary, "GPTs: the vocabulary (0: the model's own)")->capture_default_str();
  predict->add_option("--batch-size", o.batch_size, "Samples per forward pass")->capture_default_str();
  predict->add_option("--out", predict_flags->out, "The logits file (safetensors)")->required();
  predict->add_flag("--json", predict_flags->json, "Print one JSON summary line");
  predict->callback([predict_flags, &exit_code] { exit_code = run_predict(*predict_flags); });
}

}  // namespace fedmesh::cli
