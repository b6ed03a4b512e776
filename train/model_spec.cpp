#include "train/model_spec.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include <toml++/toml.h>

#include "base/file_io.h"
#include "base/toml_input.h"
#include "train/data/dataset.h"

namespace fedmesh::train {

namespace {

constexpr int64_t kMaxWidth = int64_t{1} << 20;  // linear out, conv channels
constexpr int64_t kMaxKernel = 31;

// The keys each layer type takes (besides `type`).
const std::map<std::string, std::vector<std::string>, std::less<>>& layer_keys() {
  static const std::map<std::string, std::vector<std::string>, std::less<>> keys = {
      {"linear", {"out", "name"}},
      {"conv2d", {"out", "kernel", "stride", "padding", "name"}},
      {"maxpool", {"size", "stride"}},
      {"avgpool", {"size", "stride"}},
      {"global_avgpool", {}},
      {"flatten", {}},
      {"relu", {}},
      {"gelu", {}},
      {"silu", {}},
      {"layernorm", {"name"}},
      {"groupnorm", {"groups", "name"}},
      {"dropout", {"p"}},
      {"residual", {"layers", "name"}},
  };
  return keys;
}

std::string joined(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : ", ") + w;
  return out.empty() ? "no keys" : out;
}

std::string type_list() {
  std::vector<std::string> types;
  for (const auto& [type, keys] : layer_keys()) types.push_back(type);
  return joined(types);
}

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// Reads an integer key of `table` into `out` within [low, high]; "" or the flaw.
std::string read_int(const toml::table& table, std::string_view key, int64_t low, int64_t high, int64_t& out) {
  const toml::node* node = table.get(key);
  if (node == nullptr) return "";
  const std::optional<int64_t> value = node->is_integer() ? node->value<int64_t>() : std::nullopt;
  if (!value) return std::string(key) + " must be an integer";
  if (*value < low || *value > high) {
    return std::string(key) + " = " + std::to_string(*value) + " is outside [" + std::to_string(low) + ", " +
           std::to_string(high) + "]";
  }
  out = *value;
  return "";
}

Result<std::vector<LayerSpec>> parse_layers(const toml::node* node, const std::string& what, bool in_residual);

Result<LayerSpec> parse_layer(const toml::table& table, size_t number, const std::string& what, bool in_residual) {
  const auto flaw = [&](const std::string& type, const std::string& why) {
    return invalid_argument(what + ": layer " + std::to_string(number) + (type.empty() ? "" : " (" + type + ")") +
                            ": " + why);
  };
  const toml::node* type_node = table.get("type");
  const std::optional<std::string> type = type_node ? type_node->value<std::string>() : std::nullopt;
  if (!type) return flaw("", "needs type = one of " + type_list());
  const auto known = layer_keys().find(*type);
  if (known == layer_keys().end()) return flaw("", "unknown type '" + type->substr(0, 64) + "' (one of " + type_list() + ")");
  for (const auto& [key, value] : table) {
    if (key.str() == "type") continue;
    if (std::find(known->second.begin(), known->second.end(), key.str()) == known->second.end()) {
      return flaw(*type, "unknown key '" + std::string(key.str()).substr(0, 64) + "' (" + *type + " takes " +
                             joined(known->second) + ")");
    }
  }
  LayerSpec layer;
  layer.type = *type;
  std::string problem;
  if (*type == "linear" || *type == "conv2d") {
    if (problem = read_int(table, "out", 1, kMaxWidth, layer.out); !problem.empty()) return flaw(*type, problem);
    if (*type == "conv2d" && layer.out == 0) return flaw(*type, "needs out (its output channels)");
  }
  if (*type == "conv2d") {
    if (problem = read_int(table, "kernel", 1, kMaxKernel, layer.kernel); !problem.empty()) return flaw(*type, problem);
    if (problem = read_int(table, "stride", 1, kMaxKernel, layer.stride); !problem.empty()) return flaw(*type, problem);
    layer.padding = layer.kernel / 2;
    if (problem = read_int(table, "padding", 0, layer.kernel - 1, layer.padding); !problem.empty()) {
      return flaw(*type, problem);
    }
  }
  if (*type == "maxpool" || *type == "avgpool") {
    layer.kernel = 2;
    if (problem = read_int(table, "size", 1, kMaxKernel, layer.kernel); !problem.empty()) return flaw(*type, problem);
    layer.stride = layer.kernel;
    if (problem = read_int(table, "stride", 1, kMaxKernel, layer.stride); !problem.empty()) return flaw(*type, problem);
  }
  if (*type == "groupnorm") {
    if (problem = read_int(table, "groups", 1, kMaxWidth, layer.groups); !problem.empty()) return flaw(*type, problem);
    if (layer.groups == 0) return flaw(*type, "needs groups (how many groups the channels form)");
  }
  if (*type == "residual") {
    if (in_residual) return flaw(*type, "a residual block inside a residual block is not taken");
    Result<std::vector<LayerSpec>> body =
        parse_layers(table.get("layers"), what + ": layer " + std::to_string(number) + " (residual)", true);
    if (!body.is_ok()) return body.status();
    layer.body = std::move(*body);
  }
  if (*type == "dropout") {
    if (const toml::node* p = table.get("p")) {
      const std::optional<double> value = p->value<double>();
      if (!value || !(*value >= 0.0 && *value < 1.0)) return flaw(*type, "p must be a number in [0, 1)");
      layer.p = *value;
    }
  }
  if (const toml::node* name = table.get("name")) {
    const std::optional<std::string> text = name->value<std::string>();
    if (!text || !valid_name(*text)) return flaw(*type, "name must be 1-64 of a-z A-Z 0-9 _ -");
    layer.name = *text;
  }
  return layer;
}

Result<TransformerConfig> parse_gpt(const toml::table& table, const std::string& what) {
  const auto flaw = [&](const std::string& why) { return invalid_argument(what + ": gpt: " + why); };
  static const std::vector<std::string> keys = {"layers", "heads", "width", "context", "vocabulary"};
  for (const auto& [key, value] : table) {
    if (std::find(keys.begin(), keys.end(), key.str()) == keys.end()) {
      return flaw("unknown key '" + std::string(key.str()).substr(0, 64) + "' (gpt takes " + joined(keys) + ")");
    }
  }
  TransformerConfig c;
  c.vocabulary = 256;  // bytes; a tokenizer's vocabulary replaces it
  std::string problem;
  if (problem = read_int(table, "layers", 1, 128, c.layers); !problem.empty()) return flaw(problem);
  if (problem = read_int(table, "heads", 1, 256, c.heads); !problem.empty()) return flaw(problem);
  if (problem = read_int(table, "width", 1, 16384, c.width); !problem.empty()) return flaw(problem);
  if (problem = read_int(table, "context", 1, 65536, c.context); !problem.empty()) return flaw(problem);
  if (problem = read_int(table, "vocabulary", 2, 1 << 22, c.vocabulary); !problem.empty()) return flaw(problem);
  for (const char* required : {"layers", "heads", "width", "context"}) {
    if (!table.contains(required)) return flaw(std::string("needs ") + required);
  }
  if (c.width % c.heads != 0) {
    return flaw("width " + std::to_string(c.width) + " is not a multiple of heads " + std::to_string(c.heads));
  }
  return c;
}

// A list of layers (the model's, or a residual block's body): 1 to
// kMaxSpecLayers tables, names unique across the model's top level and the
// body, only the last linear without out.
Result<std::vector<LayerSpec>> parse_layers(const toml::node* node, const std::string& what, bool in_residual) {
  const toml::array* array = node != nullptr ? node->as_array() : nullptr;
  if (array == nullptr || array->empty() || array->size() > kMaxSpecLayers) {
    return invalid_argument(what + ": layers must be a list of 1 to " + std::to_string(kMaxSpecLayers) + " tables");
  }
  std::vector<LayerSpec> out;
  std::set<std::string> names;
  for (size_t i = 0; i < array->size(); ++i) {
    const toml::table* table = (*array)[i].as_table();
    if (table == nullptr) return invalid_argument(what + ": layer " + std::to_string(i + 1) + " is not a table");
    Result<LayerSpec> layer = parse_layer(*table, i + 1, what, in_residual);
    if (!layer.is_ok()) return layer.status();
    if (!layer->name.empty() && !names.insert(layer->name).second) {
      return invalid_argument(what + ": layer " + std::to_string(i + 1) + ": the name '" + layer->name +
                              "' is used twice");
    }
    if (layer->type == "linear" && layer->out == 0 && (in_residual || i + 1 != array->size())) {
      return invalid_argument(what + ": layer " + std::to_string(i + 1) +
                              " (linear): needs out (only the model's last layer's defaults to the data's classes)");
    }
    out.push_back(std::move(*layer));
  }
  return out;
}

}  // namespace

namespace {

// One line per layer, every value spelled out; a residual's body indented under it.
void append_canonical(std::string& out, const std::vector<LayerSpec>& layers, const std::string& indent) {
  char p[32];
  for (const LayerSpec& l : layers) {
    out += indent + l.type;
    if (l.type == "linear" || l.type == "conv2d") out += " out=" + std::to_string(l.out);
    if (l.type == "conv2d") {
      out += " kernel=" + std::to_string(l.kernel) + " stride=" + std::to_string(l.stride) +
             " padding=" + std::to_string(l.padding);
    }
    if (l.type == "maxpool" || l.type == "avgpool") {
      out += " size=" + std::to_string(l.kernel) + " stride=" + std::to_string(l.stride);
    }
    if (l.type == "groupnorm") out += " groups=" + std::to_string(l.groups);
    if (l.type == "dropout") {
      std::snprintf(p, sizeof p, "%.17g", l.p);
      out += std::string(" p=") + p;
    }
    if (!l.name.empty()) out += " name=" + l.name;
    out += "\n";
    if (l.type == "residual") append_canonical(out, l.body, indent + "  ");
  }
}

}  // namespace

std::string ModelSpec::canonical() const {
  std::string out;  // the architecture only: two specs that build the same model share it, whatever their names
  if (gpt) {
    out += "gpt layers=" + std::to_string(gpt->layers) + " heads=" + std::to_string(gpt->heads) +
           " width=" + std::to_string(gpt->width) + " context=" + std::to_string(gpt->context) +
           " vocabulary=" + std::to_string(gpt->vocabulary) + "\n";
    return out;
  }
  append_canonical(out, layers, "");
  return out;
}

std::string ModelSpec::fingerprint() const { return data::fnv1a64_text(canonical()); }

namespace {

void append_toml(std::string& out, const std::vector<LayerSpec>& layers, const std::string& indent) {
  char p[32];
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& l = layers[i];
    out += indent + "{ type = \"" + l.type + "\"";
    if (l.type == "linear" && l.out > 0) out += ", out = " + std::to_string(l.out);
    if (l.type == "conv2d") {
      out += ", out = " + std::to_string(l.out) + ", kernel = " + std::to_string(l.kernel) +
             ", stride = " + std::to_string(l.stride) + ", padding = " + std::to_string(l.padding);
    }
    if (l.type == "maxpool" || l.type == "avgpool") {
      out += ", size = " + std::to_string(l.kernel) + ", stride = " + std::to_string(l.stride);
    }
    if (l.type == "groupnorm") out += ", groups = " + std::to_string(l.groups);
    if (l.type == "dropout") {
      std::snprintf(p, sizeof p, "%.17g", l.p);
      std::string value = p;
      if (value.find_first_of(".en") == std::string::npos) value += ".0";  // a TOML float, not an integer
      out += ", p = " + value;
    }
    if (!l.name.empty()) out += ", name = \"" + l.name + "\"";
    if (l.type == "residual") {
      out += ", layers = [\n";
      append_toml(out, l.body, indent + "    ");
      out += indent + "  ]";
    }
    out += " },\n";
  }
}

}  // namespace

std::string ModelSpec::to_toml() const {
  std::string out = "name = \"" + name + "\"\n";
  if (gpt) {
    out += "gpt = { layers = " + std::to_string(gpt->layers) + ", heads = " + std::to_string(gpt->heads) +
           ", width = " + std::to_string(gpt->width) + ", context = " + std::to_string(gpt->context) +
           ", vocabulary = " + std::to_string(gpt->vocabulary) + " }\n";
    return out;
  }
  out += "layers = [\n";
  append_toml(out, layers, "  ");
  return out + "]\n";
}

Result<ModelSpec> parse_model_spec(std::string_view text, const std::string& what, const std::string& default_name) {
  if (text.size() > kMaxSpecBytes) return invalid_argument(what + ": a model spec of more than 1 MiB");
  Result<toml::table> parsed = parse_toml(text, what);
  if (!parsed.is_ok()) return invalid_argument(parsed.status().message());  // a user's file: exit 2
  const toml::table& root = *parsed;
  for (const auto& [key, value] : root) {
    if (key.str() != "name" && key.str() != "layers" && key.str() != "gpt") {
      return invalid_argument(what + ": unknown key '" + std::string(key.str()).substr(0, 64) +
                              "' (a model spec holds name, and layers or gpt)");
    }
  }
  ModelSpec spec;
  spec.name = default_name;
  if (const toml::node* name = root.get("name")) {
    const std::optional<std::string> value = name->value<std::string>();
    if (!value || !valid_name(*value)) return invalid_argument(what + ": name must be 1-64 of a-z A-Z 0-9 _ -");
    spec.name = *value;
  }
  const toml::node* layers = root.get("layers");
  const toml::node* gpt = root.get("gpt");
  if ((layers == nullptr) == (gpt == nullptr)) {
    return invalid_argument(what + ": a model spec holds either layers = [...] (tables and images) or gpt = {...} "
                                   "(text), " + (layers ? "not both" : "and has neither"));
  }
  if (gpt != nullptr) {
    const toml::table* table = gpt->as_table();
    if (table == nullptr) return invalid_argument(what + ": gpt must be a table { layers, heads, width, context }");
    Result<TransformerConfig> config = parse_gpt(*table, what);
    if (!config.is_ok()) return config.status();
    spec.gpt = *config;
    return spec;
  }
  Result<std::vector<LayerSpec>> parsed_layers = parse_layers(layers, what, false);
  if (!parsed_layers.is_ok()) return parsed_layers.status();
  spec.layers = std::move(*parsed_layers);
  return spec;
}

bool is_model_spec_file(std::string_view name) {
  return name.size() > 5 && name.substr(name.size() - 5) == ".toml";
}

Result<ModelSpec> read_model_spec(const std::string& path) {
  Result<std::string> text = read_file_bounded(path, kMaxSpecBytes);
  if (!text.is_ok()) return Status(text.status().code(), "model spec " + text.status().message());
  std::string stem = std::filesystem::path(path).stem().string();
  if (!valid_name(stem)) stem = "model";
  return parse_model_spec(*text, path, stem);
}

}  // namespace fedmesh::train
