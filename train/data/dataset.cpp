#include "train/data/dataset.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace fedmesh::train::data {

std::string fnv1a64_text(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  char out[32];
  std::snprintf(out, sizeof out, "fnv1a64:%016llx", static_cast<unsigned long long>(hash));
  return out;
}

DatasetSubset::DatasetSubset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices)
    : base_(std::move(base)), indices_(std::move(indices)) {
  for (const int64_t i : indices_) FEDMESH_CHECK(i >= 0 && i < base_->size(), "subset index out of range");
}

std::vector<int64_t> DatasetSubset::base_indices(std::span<const int64_t> indices) const {
  std::vector<int64_t> out(indices.size());
  for (size_t i = 0; i < indices.size(); ++i) {
    FEDMESH_CHECK(indices[i] >= 0 && indices[i] < size(), "sample index out of range");
    out[i] = indices_[static_cast<size_t>(indices[i])];
  }
  return out;
}

void DatasetSubset::make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                               std::vector<int32_t>& targets) const {
  base_->make_batch(base_indices(indices), dtype, inputs, targets);
}

void DatasetSubset::batch_values(std::span<const int64_t> indices, std::vector<float>& values) const {
  base_->batch_values(base_indices(indices), values);
}

std::vector<int32_t> class_ids(const Dataset& dataset) {
  std::vector<int32_t> ids;
  if (dataset.regression() || dataset.targets_per_sample() != 1) return ids;
  constexpr int64_t kBatch = 1024;
  std::vector<int64_t> indices;
  std::vector<int32_t> targets;
  Tensor inputs;
  for (int64_t begin = 0; begin < dataset.size(); begin += kBatch) {
    indices.resize(static_cast<size_t>(std::min(kBatch, dataset.size() - begin)));
    std::iota(indices.begin(), indices.end(), begin);
    dataset.make_batch(indices, DType::kF32, inputs, targets);
    ids.insert(ids.end(), targets.begin(), targets.end());
  }
  return ids;
}

std::string DataSchema::fingerprint() const { return fnv1a64_text(canonical); }

DataSchema idx_schema(const ImageDataset& images) {
  DataSchema schema;
  schema.sample_shape = {images.channels, images.rows, images.cols};
  schema.classes = images.num_classes;
  schema.canonical = "idx v1; " + std::to_string(images.channels) + "x" + std::to_string(images.rows) + "x" +
                     std::to_string(images.cols) + "; classes " + std::to_string(images.num_classes) + "; normalize";
  for (size_t c = 0; c < images.mean.size() && c < images.std.size(); ++c) {
    char text[64];
    std::snprintf(text, sizeof text, " %.6g/%.6g", images.mean[c], images.std[c]);
    schema.canonical += text;
  }
  return schema;
}

}  // namespace fedmesh::train::data
