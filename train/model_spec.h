// A model described in a file instead of the C++: a TOML file (MODEL.toml,
// given wherever a model name goes: `--model FILE.toml`, `model =
// "FILE.toml"` in site and aggregator configs) holding either a sequence of
// layers for tables and images or a GPT block stack for text:
//
//   name = "tabular"                        # optional; the file's stem otherwise
//   layers = [
//     { type = "linear", out = 64 },
//     { type = "relu" },
//     { type = "dropout", p = 0.1 },
//     { type = "linear" },                  # the last linear's out: the data's classes
//   ]
//
//   name = "my-gpt"
//   gpt = { layers = 4, heads = 6, width = 192, context = 128 }  # vocabulary: the tokenizer's (or 256)
//
// Layer types and their keys (every key optional unless said):
//   linear          out (required but for the last layer), name
//   conv2d          out (required), kernel (3), stride (1), padding (kernel / 2), name
//   maxpool, avgpool  size (2), stride (size)
//   global_avgpool, flatten, relu, gelu, silu
//   layernorm       name (normalizes the last dimension)
//   groupnorm       groups (required, divides the channels), name
//   dropout         p (in [0, 1))
//   residual        layers (required: its body, no residual inside), name:
//                   y = body(x) + x, or + a 1x1 convolution of x (its
//                   "shortcut") where the body changes channels or size
// Layers with parameters are named fc1, fc2, ... (linear), conv1, ...
// (conv2d), ln1, ... (layernorm), gn1, ... (groupnorm) and res1, ...
// (residual; its layers res1.conv1, ..., its shortcut res1.shortcut)
// unless `name` says otherwise; the
// parameters are "<name>.weight" / ".bias" (layernorm: ".weight" / ".bias"
// too, as PyTorch names them). The built-in mlp and cnn are such specs
// (preset_model_spec), built by the same code.
//
// Shapes come from the data (ModelInput): a layer that cannot take what the
// one before gives is refused naming the layer, its number and both shapes,
// and the model's output must be the data's (classes) — never a failed
// check. The spec's canonical text (one line per layer, every value
// spelled out) has a fingerprint the aggregator announces with every round,
// so a site built from another spec is refused by name.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/layers/transformer.h"
#include "train/model.h"

namespace fedmesh::train {

struct LayerSpec {
  std::string type;
  std::string name;       // layers with parameters; "" until build (then fc1, conv1, ln1, ...)
  int64_t out = 0;        // linear (0: the data's classes, last layer only), conv2d
  int64_t kernel = 3;     // conv2d; pools: their size
  int64_t stride = 1;     // conv2d; pools: (size)
  int64_t padding = -1;   // conv2d; -1: kernel / 2
  double p = 0.0;         // dropout
  int64_t groups = 0;     // groupnorm
  std::vector<LayerSpec> body;  // residual: its layers
};

struct ModelSpec {
  std::string name;
  std::vector<LayerSpec> layers;          // a table or image model, or
  std::optional<TransformerConfig> gpt;   // a GPT (vocabulary 256 unless given; a tokenizer's replaces it)
  // One line per layer with every value, defaults filled in; not the name.
  std::string canonical() const;
  std::string fingerprint() const;  // "fnv1a64:" + 16 hex digits of canonical()
  // The spec as a file, every value written out: parse_model_spec reads it
  // back to the same spec. Checkpoints and exports carry it.
  std::string to_toml() const;
};

inline constexpr size_t kMaxSpecLayers = 256;
inline constexpr size_t kMaxSpecBytes = size_t{1} << 20;

// Parses a spec's TOML text; `what` (the file) and the layer's number and
// type name every flaw: unknown keys and types, values out of range, a
// GPT whose width the heads do not divide.
Result<ModelSpec> parse_model_spec(std::string_view text, const std::string& what, const std::string& default_name);
// A spec file (at most kMaxSpecBytes); the default name is the file's stem.
Result<ModelSpec> read_model_spec(const std::string& path);
// Whether a model name names a spec file (it ends in ".toml").
bool is_model_spec_file(std::string_view name);
// The built-in models as specs: "mlp", "cnn" and the GPTs of make_model.
std::optional<ModelSpec> preset_model_spec(std::string_view name);
// The fingerprint of a model name's spec (a built-in's, or a spec file's):
// what the aggregator announces and a site compares.
Result<std::string> model_fingerprint(std::string_view model);

// What build_model made of each layer, for `fedmesh model show`.
struct BuiltLayer {
  std::string kind, name;
  Shape output;             // one sample's, without the batch
  int64_t parameters = 0;
  int64_t flops = 0;        // forward, per sample: 2 x multiply-adds of linear, conv and attention, 1 per value else
};

// The model a spec describes for data of `input` (its sample shape and
// classes), initialized from `seed` layer by layer in order (each layer
// as PyTorch initializes it). `plan`, when given, receives every layer.
Result<std::unique_ptr<Sequential>> build_model(const ModelSpec& spec, uint64_t seed, const ModelInput& input,
                                                std::vector<BuiltLayer>* plan = nullptr);

}  // namespace fedmesh::train
