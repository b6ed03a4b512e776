#include "train/predict.h"

#include <cmath>
#include <map>
#include <vector>

#include "base/file_io.h"
#include "train/data/arrays.h"

namespace fedmesh::train {

namespace {

// x's elements as fp32 (any numeric type; f8 and 64-bit integers rounded),
// every one finite.
Result<std::vector<float>> elements_of(const data::ArrayView& x, const std::string& what) {
  std::vector<float> out(static_cast<size_t>(x.elements()));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<float>(x.value(static_cast<int64_t>(i)));
    if (!std::isfinite(out[i])) return invalid_argument(what + " holds a non-finite value at element " + std::to_string(i));
  }
  return out;
}

}  // namespace

Result<Prediction> predict(const PredictOptions& options) {
  if (options.weights.path.empty()) return invalid_argument("--weights is required: the model's weights file");
  if (options.batch_size < 1) return invalid_argument("--batch-size must be at least 1");
  Result<std::string> bytes = read_file_bounded(options.input, kMaxPredictInputBytes);
  if (!bytes.is_ok()) return Status(bytes.status().code(), "--input: " + bytes.status().message());
  std::vector<std::vector<uint8_t>> inflated;
  const std::span<const uint8_t> view(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size());
  Result<std::map<std::string, data::ArrayView>> arrays = data::parse_array_file(view, options.input, inflated);
  if (!arrays.is_ok()) return invalid_argument("--input: " + arrays.status().message());
  const auto found = arrays->find("x");
  if (found == arrays->end()) return invalid_argument("--input: " + options.input + " holds no array named x");
  const data::ArrayView& x = found->second;
  const std::string what = "--input: " + options.input + ": x";
  if (x.shape.size() < 2) {
    return invalid_argument(what + " is " + shape_to_string(x.shape) + ": expected (samples, ...), one row per sample");
  }
  Result<std::vector<float>> values = elements_of(x, what);
  if (!values.is_ok()) return values.status();

  const std::optional<TransformerConfig> language = language_model_config(options.model);
  ModelInput input;
  if (language) {
    input.vocabulary = options.vocabulary > 0 ? options.vocabulary : language->vocabulary;
    if (x.shape.size() != 2 || x.shape[1] > language->context) {
      return invalid_argument(what + " is " + shape_to_string(x.shape) + ": " + options.model +
                              " takes token ids (samples, at most " + std::to_string(language->context) + ")");
    }
    for (size_t i = 0; i < values->size(); ++i) {
      const float id = (*values)[i];
      if (id < 0.0f || id >= static_cast<float>(input.vocabulary) || id != std::floor(id)) {
        return invalid_argument(what + " element " + std::to_string(i) + " is " + std::to_string(id) +
                                ", not a token id of a vocabulary of " + std::to_string(input.vocabulary));
      }
    }
  } else {
    input.sample_shape.assign(x.shape.begin() + 1, x.shape.end());
    input.classes = options.classes;
  }
  Result<std::unique_ptr<Sequential>> model = make_initial_model(options.model, 0, input, options.weights);
  if (!model.is_ok()) return model.status();

  const int64_t samples = x.shape[0];
  const int64_t per_sample = samples > 0 ? x.elements() / samples : 0;
  Prediction out;
  out.samples = samples;
  int64_t rows_done = 0;
  for (int64_t begin = 0; begin < samples; begin += options.batch_size) {
    const int64_t end = std::min(samples, begin + options.batch_size);
    Shape shape = x.shape;
    shape[0] = end - begin;
    const Tensor batch = Tensor::view_of(values->data() + begin * per_sample, shape, DType::kF32);
    const Tensor logits = (*model)->forward(batch, /*training=*/false);
    if (!out.logits.defined()) {
      const int64_t rows_per_sample = logits.dim(0) / (end - begin);
      out.logits = Tensor::empty({samples * rows_per_sample, logits.dim(1)});
    }
    out.logits.slice_rows(rows_done, rows_done + logits.dim(0)).copy_from(logits);
    rows_done += logits.dim(0);
  }
  if (!out.logits.defined()) return invalid_argument(what + " holds no samples");
  return out;
}

}  // namespace fedmesh::train
