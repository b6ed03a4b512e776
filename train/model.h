// A model: a named sequence of layers, its parameters by stable names, and
// its compute precision (fp32, or bf16/fp16 copies of fp32 master weights).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "train/layers/layer.h"
#include "train/layers/transformer.h"
#include "train/lora.h"

namespace fedmesh::train {

class Sequential {
 public:
  explicit Sequential(std::string name, Shape sample_shape) : name_(std::move(name)), sample_shape_(std::move(sample_shape)) {}

  void add(std::unique_ptr<Layer> layer) { layers_.push_back(std::move(layer)); }
  const std::string& name() const { return name_; }
  const Shape& sample_shape() const { return sample_shape_; }  // one input sample, without the batch
  DType compute_dtype() const { return compute_dtype_; }
  size_t layer_count() const { return layers_.size(); }
  Layer& layer(size_t i) { return *layers_[i]; }
  // Puts `layer` in place of layer i and returns the one it replaces (tensor
  // parallelism swaps a transformer block for its shard and back).
  std::unique_ptr<Layer> replace_layer(size_t i, std::unique_ptr<Layer> layer) {
    layers_[i].swap(layer);
    return layer;
  }

  // x (batch, sample_shape...) in the compute dtype -> logits (batch, classes).
  Tensor forward(const Tensor& x, bool training);
  // Backpropagates d loss / d logits through every layer, accumulating
  // grads; after_layer(i), if given, is called when layer i is done.
  void backward(const Tensor& dlogits, const std::function<void(size_t layer)>& after_layer = {});

  // The trainable parameters, in layer order: every parameter, or with LoRA
  // the adapters' B factors alone. What an optimizer steps, a data-parallel
  // step reduces, a checkpoint keeps and a federation sends.
  std::vector<Parameter*> parameters();
  // Layer i's share of parameters(): its own, or the B factors of its weights.
  std::vector<Parameter*> layer_parameters(size_t i);
  // Every tensor the model computes with: the layers' parameters (frozen
  // ones included) and the adapters' B factors.
  std::vector<Parameter*> all_parameters();
  int64_t parameter_count();  // the layers' weights (the model's size, adapters not counted)
  int64_t trainable_count();  // the elements of parameters()
  void zero_grad();

  // LoRA (train/lora.h): freezes every layer parameter and adapts the
  // weights `options` targets, A drawn from `seed`. Once, on the host,
  // before set_compute_dtype and to_device; a target list that matches no
  // weight of 2 or more dimensions is refused naming the globs.
  Status attach_lora(const LoraOptions& options, uint64_t seed);
  const LoraOptions& lora() const { return lora_; }
  std::vector<LowRankAdapter*> adapters();
  // Writes every adapted weight as W0 + scale · B · A (after B changed).
  void merge_adapters();
  // With LoRA, "blake2b:" + hex over the frozen weights (names, shapes,
  // values; W0 for adapted ones) and the A factors: what every process of a
  // federation must share besides the B factors it averages. "" without.
  std::string frozen_fingerprint();
  // Switches the compute copies to `dtype` (fp32: the masters themselves).
  void set_compute_dtype(DType dtype);
  // Re-rounds compute copies after the masters changed (after an optimizer step).
  void refresh_compute();
  // Moves every parameter (master, gradient, compute copy) to `device`; the
  // layers then keep their activations there. For Device::kCuda ask
  // cuda::available() first, and check device_problem().
  void to_device(Device device);
  Device device() const { return device_; }
  // Why the model cannot run on `device` ("" if it can): a layer with no
  // CUDA version (train/layers/spec_layers.h), named.
  std::string device_problem(Device device);
  // A human-readable table: layer, output shape, parameters.
  std::string summary();

 private:
  std::string name_;
  Shape sample_shape_;
  DType compute_dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  std::vector<std::unique_ptr<Layer>> layers_;
  LoraOptions lora_;
  std::vector<std::unique_ptr<LowRankAdapter>> adapters_;
  std::vector<std::vector<LowRankAdapter*>> layer_adapters_;  // with LoRA, by the layer owning each adapted weight
};

inline constexpr int64_t kFashionMnistSide = 28;
inline constexpr int64_t kFashionMnistClasses = 10;

// "mlp": 784-512-256-10 with ReLU; "cnn": two 3x3 conv (32, 64 channels) each
// with ReLU and 2x2 max-pool, then 3136-128-10. Parameters are initialized
// from `seed` as PyTorch initializes the same layers.
// Language models (GPT-2 style, train/layers/transformer.h), inputs (batch,
// context) token ids, logits (batch * context, vocabulary):
//   "gpt-nano"  vocabulary 256, context 64, width 64, 4 heads, 2 layers (~0.1M; tests)
//   "gpt-tiny"  vocabulary 256, context 128, width 192, 6 heads, 4 layers (~1.8M; CPU runs)
//   "gpt-small" vocabulary 256, context 256, width 384, 6 heads, 6 layers (~10.8M)
//   "gpt2"      vocabulary 50257, context 1024, width 768, 12 heads, 12 layers (124M, GPT-2 small)
// initialized as GPT-2 is. `vocabulary` > 0 replaces a language model's
// vocabulary (a trained tokenizer's size, train/data/bpe_tokenizer.h); an
// image model refuses it. 0: the model's own.
Result<std::unique_ptr<Sequential>> make_model(std::string_view name, uint64_t seed, int64_t vocabulary = 0);
// The models follow the data: "mlp" takes samples of any shape (a table's
// {features}, an image's {channels, height, width}) and "cnn" images of
// any channels and sides >= 4 (64 * (h/4) * (w/4) into fc1), each with
// `classes` outputs (regression: one, the predicted value). A shape a model
// cannot take is refused naming the model and the shape. Empty sample_shape
// / classes 0: Fashion-MNIST's (1, 28, 28) and 10.
struct ModelInput {
  int64_t vocabulary = 0;  // language models, as above
  Shape sample_shape;
  int64_t classes = 0;
  bool regression = false;  // classes must then be 1
};
Result<std::unique_ptr<Sequential>> make_model(std::string_view name, uint64_t seed, const ModelInput& input);
std::vector<std::string> model_names();
// The transformer's sizes for a language model's name (or a model spec
// file holding a GPT, train/model_spec.h); nullopt for the image models.
std::optional<TransformerConfig> language_model_config(std::string_view name);
// Whether model `name` (a built-in or a spec file) splits over n tensor
// ranks (train/parallel/tensor_parallel_model.h): a GPT whose heads and MLP
// features divide by n. kInvalidArgument naming the model and what does
// not divide.
Status check_tensor_parallel_model(std::string_view model, int n);
// A language model of any sizes (the named ones above are these).
std::unique_ptr<Sequential> make_transformer(std::string name, const TransformerConfig& config, uint64_t seed);

}  // namespace fedmesh::train
