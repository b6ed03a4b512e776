#include "train/initial_weights.h"

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "base/file_io.h"
#include "train/data/arrays.h"
#include "train/hf_gpt2.h"

namespace fedmesh::train {

namespace {

// An array of the file standing for one parameter: where it came from, and
// whether it is stored transposed (a 2-D Conv1D weight of Hugging Face's).
struct Source {
  std::string file_name;
  data::ArrayView array;
  bool transposed = false;
};

// The array's elements as fp32 in the parameter's layout (f4 as stored, f8
// rounded; a transposed one turned back), or why not.
Result<std::vector<float>> as_floats(const Source& source, const std::string& what) {
  const data::ArrayView& array = source.array;
  const int64_t n = array.elements();
  std::vector<float> stored(static_cast<size_t>(n));
  if (array.dtype == "f4") {
    std::memcpy(stored.data(), array.bytes.data(), stored.size() * sizeof(float));
  } else if (array.dtype == "f8") {
    for (int64_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, array.bytes.data() + i * sizeof(double), sizeof v);
      stored[static_cast<size_t>(i)] = static_cast<float>(v);
    }
  } else {
    return invalid_argument(what + " is " + array.dtype + ": weights must be f4 or f8 (float32 or float64)");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(stored[static_cast<size_t>(i)])) {
      return invalid_argument(what + " holds a non-finite value at element " + std::to_string(i));
    }
  }
  if (!source.transposed) return stored;
  const int64_t rows = array.shape[0], cols = array.shape[1];  // stored (rows, cols), wanted (cols, rows)
  std::vector<float> out(stored.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = stored[static_cast<size_t>(r * cols + c)];
  }
  return out;
}

}  // namespace

Result<InitFormat> parse_init_format(std::string_view text) {
  if (text == "fedmesh") return InitFormat::kFedmesh;
  if (text == "hf-gpt2") return InitFormat::kHfGpt2;
  return invalid_argument("--init-format must be fedmesh or hf-gpt2, not '" + std::string(text) + "'");
}

Status load_initial_weights(Sequential& model, const std::string& path, InitFormat format, bool partial,
                            InitReport* report) {
  FEDMESH_CHECK(!model.lora().enabled(), "load_initial_weights before attach_lora");
  InitReport local;
  InitReport& said = report != nullptr ? *report : local;
  said = InitReport{};
  Result<std::string> bytes = read_file_bounded(path, kMaxInitialWeightsBytes);
  if (!bytes.is_ok()) return Status(bytes.status().code(), "--init: " + bytes.status().message());
  std::vector<std::vector<uint8_t>> inflated;
  const std::span<const uint8_t> view(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size());
  Result<std::map<std::string, data::ArrayView>> arrays = data::parse_array_file(view, path, inflated);
  if (!arrays.is_ok()) return invalid_argument("--init: " + arrays.status().message());

  // The file's arrays under the model's names.
  std::map<std::string, Source> sources;
  for (const auto& [name, array] : *arrays) {
    const HfGpt2Name hf = format == InitFormat::kHfGpt2 ? from_hf_gpt2(name) : HfGpt2Name{name, false};
    const std::string& mapped = hf.name;
    const bool transposed = hf.transposed;
    if (mapped.empty()) continue;
    if (transposed && array.shape.size() != 2) {
      return invalid_argument("--init: " + path + ": \"" + name + "\" is " + shape_to_string(array.shape) +
                              ": a Conv1D weight is 2-D (in, out)");
    }
    if (!sources.emplace(mapped, Source{name, array, transposed}).second) {
      return invalid_argument("--init: " + path + " holds \"" + mapped + "\" twice (as \"" + name + "\" too)");
    }
  }

  // Everything is checked before anything is copied.
  const std::vector<Parameter*> parameters = model.parameters();
  std::vector<std::vector<float>> values(parameters.size());
  std::vector<bool> taken(parameters.size(), false);
  std::set<std::string> used;
  for (size_t i = 0; i < parameters.size(); ++i) {
    Parameter* p = parameters[i];
    const auto found = sources.find(p->name);
    if (found == sources.end() && partial) {
      said.seeded.push_back(p->name);
      continue;
    }
    if (found == sources.end()) {
      const bool looks_hf = format == InitFormat::kFedmesh && (sources.contains("transformer.wte.weight") ||
                                                                sources.contains("h.0.ln_1.weight"));
      return invalid_argument("--init: " + path + " has no array \"" + p->name + "\"" +
                              (format == InitFormat::kHfGpt2 ? " (in Hugging Face's GPT-2 names)" : "") +
                              (looks_hf ? " (its names are Hugging Face's GPT-2: give --init-format hf-gpt2)" : "") +
                              " (the model " + model.name() + " has " + std::to_string(parameters.size()) +
                              " parameters; `fedmesh checkpoint export` writes them under these names)");
    }
    const Source& source = found->second;
    std::vector<int64_t> have = source.array.shape;
    if (source.transposed) std::swap(have[0], have[1]);
    const std::vector<int64_t> want(p->value.shape().begin(), p->value.shape().end());
    const std::string what = "--init: " + path + ": \"" + source.file_name + "\"";
    if (have != want && partial) {
      said.seeded.push_back(p->name);
      said.ignored.push_back(source.file_name);
      used.insert(p->name);
      continue;
    }
    if (have != want) {
      return invalid_argument(what + " is " + shape_to_string(source.array.shape) + (source.transposed ? " (transposed)" : "") +
                              ", the model's " + p->name + " is " + shape_to_string(want));
    }
    Result<std::vector<float>> floats = as_floats(source, what);
    if (!floats.is_ok()) return floats.status();
    values[i] = std::move(*floats);
    taken[i] = true;
    used.insert(p->name);
  }
  for (const auto& [name, source] : sources) {
    if (!used.contains(name) && partial) {
      said.ignored.push_back(source.file_name);
      continue;
    }
    if (!used.contains(name)) {
      return invalid_argument("--init: " + path + " holds \"" + source.file_name + "\", which is no parameter of " +
                              model.name() + " (a file of another model?)");
    }
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (!taken[i]) continue;
    ++said.loaded;
    Parameter& p = *parameters[i];
    const Tensor host = Tensor::view_of(values[i].data(), p.value.shape(), DType::kF32);
    p.value.copy_from(host);
    p.refresh_compute();
  }
  return Status::ok();
}

Result<std::unique_ptr<Sequential>> make_initial_model(std::string_view name, uint64_t seed, const ModelInput& input,
                                                       const InitialWeights& init, InitReport* report) {
  Result<std::unique_ptr<Sequential>> model = make_model(name, seed, input);
  if (!model.is_ok()) return model;
  if (!init.path.empty()) {
    Result<InitFormat> format = parse_init_format(init.format);
    if (!format.is_ok()) return format.status();
    InitReport local;
    InitReport& said = report != nullptr ? *report : local;
    FEDMESH_RETURN_IF_ERROR(load_initial_weights(**model, init.path, *format, init.partial, &said));
    if (init.partial && said.loaded == 0) {
      return invalid_argument("--init-partial: " + init.path + " fits no parameter of " + std::string(name) +
                              " (a file of another model?)");
    }
  }
  FEDMESH_RETURN_IF_ERROR((*model)->attach_lora(init.lora, seed));
  return model;
}

}  // namespace fedmesh::train
