#include "train/initial_weights.h"

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "base/file_io.h"
#include "train/data/arrays.h"

namespace fedmesh::train {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + ")";
}

// The array's elements as fp32 (f4 as stored, f8 rounded), or why not.
Result<std::vector<float>> as_floats(const data::ArrayView& array, const std::string& what) {
  const int64_t n = array.elements();
  std::vector<float> out(static_cast<size_t>(n));
  if (array.dtype == "f4") {
    std::memcpy(out.data(), array.bytes.data(), out.size() * sizeof(float));
  } else if (array.dtype == "f8") {
    for (int64_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, array.bytes.data() + i * sizeof(double), sizeof v);
      out[static_cast<size_t>(i)] = static_cast<float>(v);
    }
  } else {
    return invalid_argument(what + " is " + array.dtype + ": weights must be f4 or f8 (float32 or float64)");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[static_cast<size_t>(i)])) {
      return invalid_argument(what + " holds a non-finite value at element " + std::to_string(i));
    }
  }
  return out;
}

}  // namespace

Status load_initial_weights(Sequential& model, const std::string& path) {
  Result<std::string> bytes = read_file_bounded(path, kMaxInitialWeightsBytes);
  if (!bytes.is_ok()) return Status(bytes.status().code(), "--init-from: " + bytes.status().message());
  std::vector<std::vector<uint8_t>> inflated;
  const std::span<const uint8_t> view(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size());
  Result<std::map<std::string, data::ArrayView>> arrays = data::parse_array_file(view, path, inflated);
  if (!arrays.is_ok()) return invalid_argument("--init-from: " + arrays.status().message());

  // Everything is checked before anything is copied.
  const std::vector<Parameter*> parameters = model.parameters();
  std::vector<std::vector<float>> values;
  std::set<std::string> used;
  for (Parameter* p : parameters) {
    const auto found = arrays->find(p->name);
    if (found == arrays->end()) {
      return invalid_argument("--init-from: " + path + " has no array \"" + p->name + "\" (the model " + model.name() +
                              " has " + std::to_string(parameters.size()) + " parameters; `fedmesh checkpoint export` " +
                              "writes them under these names)");
    }
    const std::vector<int64_t> want(p->value.shape().begin(), p->value.shape().end());
    const std::string what = "--init-from: " + path + ": \"" + p->name + "\"";
    if (found->second.shape != want) {
      return invalid_argument(what + " is " + shape_text(found->second.shape) + ", the model's is " + shape_text(want));
    }
    Result<std::vector<float>> floats = as_floats(found->second, what);
    if (!floats.is_ok()) return floats.status();
    values.push_back(std::move(*floats));
    used.insert(p->name);
  }
  for (const auto& [name, array] : *arrays) {
    if (!used.contains(name)) {
      return invalid_argument("--init-from: " + path + " holds \"" + name + "\", which is no parameter of " +
                              model.name() + " (a file of another model?)");
    }
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    Parameter& p = *parameters[i];
    const Tensor host = Tensor::view_of(values[i].data(), p.value.shape(), DType::kF32);
    p.value.copy_from(host);
    p.refresh_compute();
  }
  return Status::ok();
}

}  // namespace fedmesh::train
