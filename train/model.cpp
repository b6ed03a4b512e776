#include "train/model.h"

#include <algorithm>
#include <sstream>

#include "base/random.h"
#include "crypto/hash.h"
#include "crypto/keys.h"
#include "kernels/elementwise.h"
#include "train/layers/layers.h"
#include "train/model_spec.h"

namespace fedmesh::train {

Tensor Sequential::forward(const Tensor& x, bool training) {
  Tensor activation = x;
  for (auto& layer : layers_) activation = layer->forward(activation, training);
  return activation;
}

void Sequential::backward(const Tensor& dlogits, const std::function<void(size_t layer)>& after_layer) {
  // Layers before the first one with parameters (a leading Flatten, say) need
  // no gradient, so neither does the input of that first trainable layer.
  // With LoRA, layers below the first adapted one likewise. A layer's
  // adapters fold its weights' gradients into B before after_layer(i) (a
  // data-parallel step then reduces the B factors, not the weights).
  size_t first_trainable = 0;
  while (first_trainable < layers_.size() && layer_parameters(first_trainable).empty()) ++first_trainable;
  Tensor grad = dlogits;
  for (size_t i = layers_.size(); i-- > first_trainable;) {
    grad = layers_[i]->backward(grad, /*need_input_grad=*/i > first_trainable);
    if (!layer_adapters_.empty()) {
      for (LowRankAdapter* adapter : layer_adapters_[i]) adapter->fold_gradient();
    }
    if (after_layer) after_layer(i);
  }
}

std::vector<Parameter*> Sequential::layer_parameters(size_t i) {
  if (!lora_.enabled()) return layers_[i]->parameters();
  std::vector<Parameter*> factors;
  for (LowRankAdapter* adapter : layer_adapters_[i]) factors.push_back(&adapter->factor_b());
  return factors;
}

std::vector<Parameter*> Sequential::parameters() {
  std::vector<Parameter*> trainable;
  for (size_t i = 0; i < layers_.size(); ++i)
    for (Parameter* p : layer_parameters(i)) trainable.push_back(p);
  return trainable;
}

std::vector<Parameter*> Sequential::all_parameters() {
  std::vector<Parameter*> all;
  for (auto& layer : layers_)
    for (Parameter* p : layer->parameters()) all.push_back(p);
  for (auto& adapter : adapters_) all.push_back(&adapter->factor_b());
  return all;
}

int64_t Sequential::parameter_count() {
  int64_t n = 0;
  for (auto& layer : layers_)
    for (Parameter* p : layer->parameters()) n += p->value.numel();
  return n;
}

int64_t Sequential::trainable_count() {
  int64_t n = 0;
  for (Parameter* p : parameters()) n += p->value.numel();
  return n;
}

void Sequential::zero_grad() {
  // Frozen weights too: their layers still accumulate dL/dW, which the adapters read.
  for (Parameter* p : all_parameters()) fill(p->grad, 0.0f);
}

void Sequential::to_device(Device device) {
  for (Parameter* p : all_parameters()) p->to_device(device);
  for (auto& adapter : adapters_) adapter->to_device(device);
  device_ = device;
}

Status Sequential::attach_lora(const LoraOptions& options, uint64_t seed) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  if (!options.enabled()) return Status::ok();
  FEDMESH_CHECK(!lora_.enabled(), "attach_lora twice");
  FEDMESH_CHECK(device_ == Device::kCpu && compute_dtype_ == DType::kF32,
                "attach_lora before set_compute_dtype and to_device");
  std::vector<std::vector<LowRankAdapter*>> by_layer(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (Parameter* p : layers_[i]->parameters()) {
      if (p->value.rank() < 2 || !lora_targets(options.targets, p->name)) continue;
      adapters_.push_back(std::make_unique<LowRankAdapter>(*p, options.rank, options.scale(), seed));
      by_layer[i].push_back(adapters_.back().get());
    }
  }
  if (adapters_.empty()) {
    std::string weights;
    for (auto& layer : layers_)
      for (Parameter* p : layer->parameters())
        if (p->value.rank() >= 2) weights += (weights.empty() ? "" : ", ") + p->name;
    return invalid_argument("the LoRA targets (--lora-targets, training.lora.targets: " + options.describe() +
                            ") match no weight of model " + name_ +
                            "; its weights are: " + weights);
  }
  lora_ = options;
  layer_adapters_ = std::move(by_layer);
  return Status::ok();
}

std::vector<LowRankAdapter*> Sequential::adapters() {
  std::vector<LowRankAdapter*> out;
  for (auto& adapter : adapters_) out.push_back(adapter.get());
  return out;
}

void Sequential::merge_adapters() {
  for (auto& adapter : adapters_) adapter->merge();
}

std::string Sequential::frozen_fingerprint() {
  if (!lora_.enabled()) return "";
  crypto::Hasher hasher;
  hasher.update_text(lora_.to_json().dump());
  const auto add = [&](const std::string& name, const Tensor& values) {
    const Tensor host = values.host();
    hasher.update_text(name);
    hasher.update_u64(static_cast<uint64_t>(host.rank()));
    for (const int64_t d : host.shape()) hasher.update_u64(static_cast<uint64_t>(d));
    hasher.update({static_cast<const uint8_t*>(host.raw()), host.nbytes()});
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (Parameter* p : layers_[i]->parameters()) {
      const auto adapted = std::find_if(layer_adapters_[i].begin(), layer_adapters_[i].end(),
                                        [&](LowRankAdapter* a) { return &a->target() == p; });
      if (adapted == layer_adapters_[i].end()) {
        add(p->name, p->value);
      } else {
        add(p->name, (*adapted)->base());
        add(p->name + ".lora_a", (*adapted)->factor_a());
      }
    }
  }
  return "blake2b:" + crypto::to_hex(hasher.finish());
}

std::string Sequential::device_problem(Device device) {
  if (device != Device::kCuda) return "";
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i]->runs_on_cuda()) {
      return "model " + name_ + ": layer " + std::to_string(i + 1) + " (" + layers_[i]->kind() +
             ") has no CUDA version yet; train it with --device cpu";
    }
  }
  return "";
}

void Sequential::set_compute_dtype(DType dtype) {
  compute_dtype_ = dtype;
  for (Parameter* p : all_parameters()) p->set_compute_dtype(dtype);
}

void Sequential::refresh_compute() {
  for (Parameter* p : parameters()) p->refresh_compute();
  merge_adapters();
}

std::string Sequential::summary() {
  std::ostringstream out;
  Shape shape = sample_shape_;
  shape.insert(shape.begin(), 1);
  out << name_ << " (input " << shape_to_string(sample_shape_) << ")\n";
  for (auto& layer : layers_) {
    shape = layer->output_shape(shape);
    int64_t count = 0;
    std::string names;
    for (Parameter* p : layer->parameters()) {
      count += p->value.numel();
      names += (names.empty() ? "" : ", ") + p->name;
    }
    Shape without_batch(shape.begin() + 1, shape.end());
    out << "  " << layer->kind() << " -> " << shape_to_string(without_batch);
    if (count) out << "  " << count << " parameters (" << names << ")";
    out << "\n";
  }
  out << "  total parameters: " << parameter_count() << "\n";
  if (lora_.enabled()) {
    out << "  LoRA (" << lora_.describe() << "): " << adapters_.size() << " adapted weights, " << trainable_count()
        << " trainable parameters (B factors)\n";
  }
  return out.str();
}

std::vector<std::string> model_names() { return {"mlp", "cnn", "gpt-nano", "gpt-tiny", "gpt-small", "gpt2"}; }

std::optional<TransformerConfig> language_model_config(std::string_view name) {
  const auto config = [](int64_t vocabulary, int64_t context, int64_t width, int64_t heads, int64_t layers) {
    TransformerConfig c;
    c.vocabulary = vocabulary;
    c.context = context;
    c.width = width;
    c.heads = heads;
    c.layers = layers;
    return c;
  };
  if (is_model_spec_file(name)) {  // a GPT described in a file; an unreadable one is refused when the model is built
    Result<ModelSpec> spec = read_model_spec(std::string(name));
    if (!spec.is_ok() || !spec->gpt) return std::nullopt;
    TransformerConfig c = *spec->gpt;
    if (c.vocabulary <= 0) c.vocabulary = 256;
    return c;
  }
  if (name == "gpt-nano") return config(256, 64, 64, 4, 2);
  if (name == "gpt-tiny") return config(256, 128, 192, 6, 4);
  if (name == "gpt-small") return config(256, 256, 384, 6, 6);
  if (name == "gpt2") return config(50257, 1024, 768, 12, 12);
  return std::nullopt;
}

std::unique_ptr<Sequential> make_transformer(std::string name, const TransformerConfig& c, uint64_t seed) {
  Rng rng(seed);
  auto model = std::make_unique<Sequential>(std::move(name), Shape{c.context});
  auto embedding = std::make_unique<TokenEmbedding>(c.vocabulary, c.context, c.width);
  embedding->initialize(rng);
  TokenEmbedding& tied = *embedding;
  model->add(std::move(embedding));
  for (int64_t i = 0; i < c.layers; ++i) {
    auto block = std::make_unique<TransformerBlock>(std::string("h").append(std::to_string(i)), c.width, c.heads);
    block->initialize(rng, c.layers);
    model->add(std::move(block));
  }
  model->add(std::make_unique<LayerNorm>("ln_f", c.width));
  model->add(std::make_unique<TiedProjection>(tied, c.vocabulary, c.width));
  return model;
}

Result<std::unique_ptr<Sequential>> make_model(std::string_view name, uint64_t seed, int64_t vocabulary) {
  ModelInput input;
  input.vocabulary = vocabulary;
  return make_model(name, seed, input);
}

Result<std::unique_ptr<Sequential>> make_model(std::string_view name, uint64_t seed, const ModelInput& input) {
  const int64_t vocabulary = input.vocabulary;
  if (vocabulary < 0) return invalid_argument("a vocabulary of " + std::to_string(vocabulary) + " tokens");
  // A model described in a file (train/model_spec.h), or a preset: both are specs.
  std::optional<ModelSpec> spec;
  if (is_model_spec_file(name)) {
    Result<ModelSpec> read = read_model_spec(std::string(name));
    if (!read.is_ok()) return read.status();
    if (read->gpt) return build_model(*read, seed, input);
    spec = std::move(*read);
  }
  if (std::optional<TransformerConfig> config = language_model_config(name)) {
    if (vocabulary > 0) config->vocabulary = vocabulary;
    return make_transformer(std::string(name), *config, seed);
  }
  if (vocabulary > 0) {
    return invalid_argument("model '" + std::string(name) + "' is not a language model: it takes no vocabulary (tokenizer)");
  }
  if (!spec) spec = preset_model_spec(name);
  if (!spec) {
    return invalid_argument("unknown model '" + std::string(name) + "' (available: mlp, cnn, gpt-nano, gpt-tiny, gpt-small, gpt2, or a model spec file NAME.toml)");
  }
  const Shape sample = input.sample_shape.empty() ? Shape{1, kFashionMnistSide, kFashionMnistSide} : input.sample_shape;
  const int64_t classes = input.classes > 0 ? input.classes : kFashionMnistClasses;
  const std::string shown = shape_to_string(sample);
  int64_t features = 1;
  for (int64_t d : sample) {
    if (d < 1) return invalid_argument("model " + std::string(name) + ": a sample of shape " + shown + " has an empty side");
    features *= d;
  }
  if (features > (int64_t{1} << 24)) {
    return invalid_argument("model " + std::string(name) + ": a sample of shape " + shown + " has " +
                            std::to_string(features) + " values, more than 2^24");
  }
  if (name == "cnn" && (sample.size() != 3 || sample[1] < 4 || sample[2] < 4)) {
    return invalid_argument("model cnn takes images of (channels, height, width) with sides of at least 4; this data "
                            "set's samples are " + shown + (sample.size() == 1 ? " (a table: use mlp)" : ""));
  }
  if (input.regression && classes != 1) {
    return invalid_argument("model " + std::string(name) + ": a regression model has one output, not " +
                            std::to_string(classes));
  }
  if (!input.regression && classes < 2) return invalid_argument("model " + std::string(name) + ": " + std::to_string(classes) + " class(es); a classifier needs 2 or more");
  return build_model(*spec, seed, input);
}

Status check_tensor_parallel_model(std::string_view model, int n) {
  const std::optional<TransformerConfig> gpt = language_model_config(model);
  if (!gpt) {
    return invalid_argument("tensor parallelism splits the transformer blocks of a GPT; model " + std::string(model) +
                            " has none (use data-parallel ranks instead)");
  }
  if (n < 1 || gpt->heads % n != 0 || (4 * gpt->width) % n != 0) {
    return invalid_argument("tensor parallelism over " + std::to_string(n) + " ranks: model " + std::string(model) +
                            " has " + std::to_string(gpt->heads) + " heads and " + std::to_string(4 * gpt->width) +
                            " MLP features per block, which must both divide by " + std::to_string(n));
  }
  return Status::ok();
}

}  // namespace fedmesh::train
