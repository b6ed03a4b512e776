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
  Rng rng(seed);
  auto model = std::make_unique<Sequential>(spec.name, sample);
  std::map<std::string, int> counts;  // per prefix, for fc1, conv1, ln1, ...
  std::set<std::string> taken;
  for (const LayerSpec& l : spec.layers) taken.insert(l.name);
  const auto name_for = [&](const LayerSpec& l, const std::string& prefix) {
    if (!l.name.empty()) return l.name;
    std::string candidate;
    do {
      candidate = prefix + std::to_string(++counts[prefix]);
    } while (taken.count(candidate) > 0);
    return candidate;
  };
  Shape shape = sample;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& l = spec.layers[i];
    const auto refuse = [&](const std::string& takes) {
      return invalid_argument("model " + spec.name + ": layer " + std::to_string(i + 1) + " (" + l.type + ") takes " +
                              takes + "; it would get " + shape_to_string(shape));
    };
    const bool image = shape.size() == 3;
    const int64_t values = product(shape);
    BuiltLayer built{l.type, "", {}, 0, values};
    std::unique_ptr<Layer> layer;
    if (l.type == "linear") {
      const int64_t out = l.out > 0 ? l.out : classes;
      if (values * out > (int64_t{1} << 30)) {
        return refuse("at most 2^30 weights (" + std::to_string(values) + " inputs x " + std::to_string(out) +
                      " outputs is more; pool or convolve first)");
      }
      built.name = name_for(l, "fc");
      auto linear = std::make_unique<Linear>(built.name, values, out);
      linear->initialize(rng);
      layer = std::move(linear);
      built.flops = 2 * values * out;
      shape = {out};
    } else if (l.type == "conv2d") {
      if (!image) return refuse("images (channels, height, width)");
      const int64_t h = (shape[1] + 2 * l.padding - l.kernel) / l.stride + 1;
      const int64_t w = (shape[2] + 2 * l.padding - l.kernel) / l.stride + 1;
      if (shape[1] + 2 * l.padding < l.kernel || shape[2] + 2 * l.padding < l.kernel) {
        return refuse("images of at least " + std::to_string(l.kernel) + "x" + std::to_string(l.kernel) +
                      " (with padding " + std::to_string(l.padding) + ")");
      }
      if (l.kernel * l.kernel * shape[0] * l.out > (int64_t{1} << 30)) return refuse("at most 2^30 weights");
      built.name = name_for(l, "conv");
      auto conv = std::make_unique<Conv2d>(built.name, shape[0], l.out, l.kernel, l.stride, l.padding);
      conv->initialize(rng);
      layer = std::move(conv);
      built.flops = 2 * l.kernel * l.kernel * shape[0] * l.out * h * w;
      shape = {l.out, h, w};
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
      shape = {shape[0], (shape[1] - l.kernel) / l.stride + 1, (shape[2] - l.kernel) / l.stride + 1};
    } else if (l.type == "global_avgpool") {
      if (!image) return refuse("images (channels, height, width)");
      layer = std::make_unique<GlobalAvgPool2d>();
      shape = {shape[0]};
    } else if (l.type == "flatten") {
      layer = std::make_unique<Flatten>();
      shape = {values};
      built.flops = 0;
    } else if (l.type == "relu") {
      layer = std::make_unique<ReLU>();
    } else if (l.type == "gelu") {
      layer = std::make_unique<Gelu>();
    } else if (l.type == "silu") {
      layer = std::make_unique<Silu>();
    } else if (l.type == "layernorm") {
      built.name = name_for(l, "ln");
      layer = std::make_unique<LayerNorm>(built.name, shape.back());
      built.flops = 5 * values;
    } else if (l.type == "dropout") {
      // Each dropout draws from its own generator: the model's seed and its place.
      layer = std::make_unique<Dropout>(l.p, seed ^ (0x9e3779b97f4a7c15ULL * (i + 1)));
    } else {
      return invalid_argument("model " + spec.name + ": layer " + std::to_string(i + 1) + " has unknown type " + l.type);
    }
    if (product(shape) > (int64_t{1} << 28)) {
      return invalid_argument("model " + spec.name + ": layer " + std::to_string(i + 1) + " (" + l.type +
                              ") outputs " + shape_to_string(shape) + " per sample, more than 2^28 values");
    }
    built.output = shape;
    for (Parameter* p : layer->parameters()) built.parameters += p->value.numel();
    if (plan != nullptr) plan->push_back(built);
    model->add(std::move(layer));
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
