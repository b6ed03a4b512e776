#include "train/model_spec.h"

#include <map>
#include <set>

#include "base/random.h"
#include "train/layers/layers.h"
#include "train/layers/spec_layers.h"

namespace fedmesh::train {

namespace {

int64_t product(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// What `layer` gives for one sample of `sample` (its own output_shape, with
// the batch put on and taken off); the builder checks the input first.
Shape sample_output(const Layer& layer, const Shape& sample) {
  Shape batch = sample;
  batch.insert(batch.begin(), 1);
  const Shape out = layer.output_shape(batch);
  return Shape(out.begin() + 1, out.end());
}

// Parameter-holding layers' names at one level (the model's, or a residual
// body's under its prefix): `name` as given, else fc1, conv1, ... counted
// per kind, skipping names given explicitly.
class Namer {
 public:
  Namer(std::string prefix, const std::vector<LayerSpec>& layers) : prefix_(std::move(prefix)) {
    for (const LayerSpec& l : layers) taken_.insert(l.name);
  }
  std::string next(const LayerSpec& l, const std::string& kind) {
    if (!l.name.empty()) return prefix_ + l.name;
    std::string candidate;
    do {
      candidate = kind + std::to_string(++counts_[kind]);
    } while (taken_.count(candidate) > 0);
    return prefix_ + candidate;
  }

 private:
  std::string prefix_;
  std::map<std::string, int> counts_;
  std::set<std::string> taken_;
};

// Builds one layer of a spec for the shape the layer before gives,
// initialized from the model's generator in order.
class LayerBuilder {
 public:
  LayerBuilder(std::string model, uint64_t seed, int64_t classes)
      : model_(std::move(model)), seed_(seed), rng_(seed), classes_(classes) {}

  // `where`: "layer 3" (or "layer 2 (residual), layer 1"); `shape` becomes the output's.
  Result<std::unique_ptr<Layer>> build(const LayerSpec& l, const std::string& where, Namer& names, Shape& shape,
                                       BuiltLayer& built) {
    const auto refuse = [&](const std::string& takes) {
      return invalid_argument("model " + model_ + ": " + where + " (" + l.type + ") takes " + takes +
                              "; it would get " + shape_to_string(shape));
    };
    const bool image = shape.size() == 3;
    const int64_t values = product(shape);
    built = BuiltLayer{l.type, "", {}, 0, values};
    std::unique_ptr<Layer> layer;
    if (l.type == "linear") {
      const int64_t out = l.out > 0 ? l.out : classes_;
      if (values * out > (int64_t{1} << 30)) {
        return refuse("at most 2^30 weights (" + std::to_string(values) + " inputs x " + std::to_string(out) +
                      " outputs is more; pool or convolve first)");
      }
      built.name = names.next(l, "fc");
      auto linear = std::make_unique<Linear>(built.name, values, out);
      linear->initialize(rng_);
      shape = sample_output(*linear, shape);
      layer = std::move(linear);
      built.flops = 2 * values * out;
    } else if (l.type == "conv2d") {
      if (!image) return refuse("images (channels, height, width)");
      if (shape[1] + 2 * l.padding < l.kernel || shape[2] + 2 * l.padding < l.kernel) {
        return refuse("images of at least " + std::to_string(l.kernel) + "x" + std::to_string(l.kernel) +
                      " (with padding " + std::to_string(l.padding) + ")");
      }
      if (l.kernel * l.kernel * shape[0] * l.out > (int64_t{1} << 30)) return refuse("at most 2^30 weights");
      built.name = names.next(l, "conv");
      auto conv = std::make_unique<Conv2d>(built.name, shape[0], l.out, l.kernel, l.stride, l.padding);
      conv->initialize(rng_);
      const int64_t in_channels = shape[0];
      shape = sample_output(*conv, shape);
      built.flops = 2 * l.kernel * l.kernel * in_channels * product(shape);
      layer = std::move(conv);
    } else if (l.type == "maxpool" || l.type == "avgpool") {
      if (!image || shape[1] < l.kernel || shape[2] < l.kernel) {
        return refuse("images (channels, height, width) of at least " + std::to_string(l.kernel) + "x" +
                      std::to_string(l.kernel));
      }
      if (l.type == "maxpool") {
        layer = std::make_unique<MaxPool2d>(l.kernel, l.stride);
      } else {
        layer = std::make_unique<AvgPool2d>(l.kernel, l.stride);
      }
      shape = sample_output(*layer, shape);
    } else if (l.type == "global_avgpool") {
      if (!image) return refuse("images (channels, height, width)");
      layer = std::make_unique<GlobalAvgPool2d>();
      shape = sample_output(*layer, shape);
    } else if (l.type == "flatten") {
      layer = std::make_unique<Flatten>();
      shape = sample_output(*layer, shape);
      built.flops = 0;
    } else if (l.type == "relu") {
      layer = std::make_unique<ReLU>();
    } else if (l.type == "gelu") {
      layer = std::make_unique<Gelu>();
    } else if (l.type == "silu") {
      layer = std::make_unique<Silu>();
    } else if (l.type == "layernorm") {
      built.name = names.next(l, "ln");
      layer = std::make_unique<LayerNorm>(built.name, shape.back());
      built.flops = 5 * values;
    } else if (l.type == "groupnorm") {
      if (shape[0] % l.groups != 0) {
        return refuse(std::to_string(l.groups) + " groups: channels (the first dimension) divisible by them");
      }
      built.name = names.next(l, "gn");
      layer = std::make_unique<GroupNorm>(built.name, l.groups, shape[0]);
      built.flops = 5 * values;
    } else if (l.type == "dropout") {
      // Each dropout draws from its own generator: the model's seed and its place.
      layer = std::make_unique<Dropout>(l.p, seed_ ^ (0x9e3779b97f4a7c15ULL * ++dropouts_));
    } else if (l.type == "residual") {
      Result<std::unique_ptr<Layer>> block = residual(l, where, names, shape, built);
      if (!block.is_ok()) return block.status();
      layer = std::move(*block);
    } else {
      return invalid_argument("model " + model_ + ": " + where + " has unknown type " + l.type);
    }
    if (product(shape) > (int64_t{1} << 28)) {
      return invalid_argument("model " + model_ + ": " + where + " (" + l.type + ") outputs " +
                              shape_to_string(shape) + " per sample, more than 2^28 values");
    }
    built.output = shape;
    built.parameters = 0;
    for (Parameter* p : layer->parameters()) built.parameters += p->value.numel();
    return layer;
  }

 private:
  // The body's layers in order, then the shortcut: none where the body keeps
  // the shape, a 1x1 convolution where it changes an image's channels or
  // divides its sides by a whole stride.
  Result<std::unique_ptr<Layer>> residual(const LayerSpec& l, const std::string& where, Namer& names, Shape& shape,
                                          BuiltLayer& built) {
    const Shape input = shape;
    built.name = names.next(l, "res");
    Namer inner(built.name + ".", l.body);
    std::vector<std::unique_ptr<Layer>> body;
    int64_t flops = 0;
    for (size_t i = 0; i < l.body.size(); ++i) {
      BuiltLayer part;
      Result<std::unique_ptr<Layer>> layer =
          build(l.body[i], where + " (residual), layer " + std::to_string(i + 1), inner, shape, part);
      if (!layer.is_ok()) return layer.status();
      flops += part.flops;
      body.push_back(std::move(*layer));
    }
    std::unique_ptr<Layer> shortcut;
    if (shape != input) {
      const bool images = input.size() == 3 && shape.size() == 3;
      // The stride of a 1x1 convolution that gives the body's sides: (side - 1) / stride + 1 for both.
      int64_t stride = 0;
      for (int64_t s = 1; images && stride == 0 && s <= input[1]; ++s) {
        if ((input[1] - 1) / s + 1 == shape[1] && (input[2] - 1) / s + 1 == shape[2]) stride = s;
      }
      if (stride == 0) {
        return invalid_argument("model " + model_ + ": " + where + " (residual): its body turns " +
                                shape_to_string(input) + " into " + shape_to_string(shape) +
                                "; the sum needs the same shape, or images whose sides a whole stride divides (a 1x1 "
                                "convolution then projects the input)");
      }
      auto conv = std::make_unique<Conv2d>(built.name + ".shortcut", input[0], shape[0], 1, stride, 0);
      conv->initialize(rng_);
      flops += 2 * input[0] * shape[0] * shape[1] * shape[2];
      shortcut = std::move(conv);
    }
    built.flops = flops + product(shape);
    return std::unique_ptr<Layer>(new Residual(std::move(body), std::move(shortcut)));
  }

  std::string model_;
  uint64_t seed_;
  Rng rng_;
  int64_t classes_;
  uint64_t dropouts_ = 0;
};

}  // namespace

std::optional<ModelSpec> preset_model_spec(std::string_view name) {
  ModelSpec spec;
  spec.name = std::string(name);
  const auto layer = [](std::string type, int64_t out = 0) {
    LayerSpec l;
    l.type = std::move(type);
    l.out = out;
    if (l.type == "conv2d") l.padding = 1;
    if (l.type == "maxpool") l.kernel = l.stride = 2;
    return l;
  };
  if (name == "mlp") {
    spec.layers = {layer("flatten"), layer("linear", 512), layer("relu"), layer("linear", 256), layer("relu"),
                   layer("linear")};
    return spec;
  }
  if (name == "cnn") {
    spec.layers = {layer("conv2d", 32), layer("relu"), layer("maxpool"),         layer("conv2d", 64), layer("relu"),
                   layer("maxpool"),    layer("flatten"), layer("linear", 128), layer("relu"),       layer("linear")};
    return spec;
  }
  if (std::optional<TransformerConfig> gpt = language_model_config(name)) {
    spec.gpt = *gpt;
    return spec;
  }
  return std::nullopt;
}

Result<std::string> model_fingerprint(std::string_view model) {
  if (is_model_spec_file(model)) {
    Result<ModelSpec> spec = read_model_spec(std::string(model));
    if (!spec.is_ok()) return spec.status();
    return spec->fingerprint();
  }
  std::optional<ModelSpec> preset = preset_model_spec(model);
  if (!preset) return invalid_argument("unknown model '" + std::string(model) + "'");
  return preset->fingerprint();
}

Result<std::unique_ptr<Sequential>> build_model(const ModelSpec& spec, uint64_t seed, const ModelInput& input,
                                                std::vector<BuiltLayer>* plan) {
  if (spec.gpt) {
    TransformerConfig c = *spec.gpt;
    if (input.vocabulary > 0) c.vocabulary = input.vocabulary;
    if (c.vocabulary <= 0) c.vocabulary = 256;  // bytes
    std::unique_ptr<Sequential> model = make_transformer(spec.name, c, seed);
    if (plan != nullptr) {
      // Per token: qkv (3 w^2), projection (w^2) and MLP (8 w^2) multiply-adds, attention 2 x context x w.
      const int64_t w = c.width, t = c.context;
      for (size_t i = 0; i < model->layer_count(); ++i) {
        Layer& layer = model->layer(i);
        BuiltLayer b{layer.kind(), "", {t, i + 1 == model->layer_count() ? c.vocabulary : w}, 0, 0};
        for (Parameter* p : layer.parameters()) b.parameters += p->value.numel();
        if (b.kind == "block") {
          b.flops = t * (2 * 12 * w * w + 2 * 2 * t * w);
        } else if (i + 1 == model->layer_count()) {
          b.flops = t * 2 * w * c.vocabulary;
        } else {
          b.flops = t * w;
        }
        plan->push_back(std::move(b));
      }
    }
    return model;
  }
  const Shape sample = input.sample_shape.empty() ? Shape{1, kFashionMnistSide, kFashionMnistSide} : input.sample_shape;
  const int64_t classes = input.regression ? 1 : (input.classes > 0 ? input.classes : kFashionMnistClasses);
  auto model = std::make_unique<Sequential>(spec.name, sample);
  LayerBuilder builder(spec.name, seed, classes);
  Namer names("", spec.layers);
  Shape shape = sample;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    BuiltLayer built;
    Result<std::unique_ptr<Layer>> layer =
        builder.build(spec.layers[i], "layer " + std::to_string(i + 1), names, shape, built);
    if (!layer.is_ok()) return layer.status();
    if (plan != nullptr) plan->push_back(built);
    model->add(std::move(*layer));
  }
  if (shape != Shape{classes}) {
    return invalid_argument("model " + spec.name + ": its output is " + shape_to_string(shape) + " per sample; the " +
                            (input.regression ? std::string("regression target needs (1)")
                                              : "data's " + std::to_string(classes) + " classes need (" +
                                                    std::to_string(classes) + ")") +
                            " (end with a linear layer without out)");
  }
  return model;
}

}  // namespace fedmesh::train
