// What the trainer trains on: samples it can index and turn into a batch of
// model inputs and target classes (or, for regression, real values). A classifier's sample has one target (an
// image and its label); a language model's has one per position (a window
// of tokens and the tokens that follow each).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tensor.h"
#include "train/data/fashion_mnist.h"

namespace fedmesh::train::data {

// What a model must know of a data set, and what every node of a
// federation must share: the shape of one sample ({channels, height, width}
// for images, {features} for a table), the number of classes (targets are
// class ids in [0, classes)), and `canonical`: one line of text naming
// everything that decides how a raw record becomes a sample (format, class
// names, feature list and encoding, image size and channels, how values are
// normalized). Two nodes whose canonical texts differ do not train the same
// task; fingerprint() is what they compare.
// "fnv1a64:" + 16 hex digits: the FNV-1a hash of `text`, as fingerprints
// of schemas and statistics are written.
std::string fnv1a64_text(std::string_view text);

// A regression data set's schema has regression = true and classes = 1:
// one real-valued output per sample.
struct DataSchema {
  Shape sample_shape;
  int64_t classes = 0;
  bool regression = false;
  std::string canonical;
  std::string fingerprint() const;  // "fnv1a64:" + 16 hex digits of canonical
};

// The schema of IDX images (Fashion-MNIST, or a directory of IDX files):
// their shape, class count and normalization.
DataSchema idx_schema(const ImageDataset& images);

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;  // samples
  // inputs: the model's input for these samples (the model's compute dtype
  // `dtype` for pixels; token ids are always fp32, exact below 2^24);
  // targets: targets_per_sample() classes per sample, in sample order.
  virtual void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                          std::vector<int32_t>& targets) const = 0;
  virtual int64_t targets_per_sample() const { return 1; }
  // Regression (data.task = "regression"): one real target per sample, in
  // the units the model trains in (standardized as the inputs are: the
  // data's own units are value x target_scale() + the mean). make_batch
  // then leaves `targets` empty and batch_values gives the batch's values.
  virtual bool regression() const { return false; }
  virtual void batch_values(std::span<const int64_t> indices, std::vector<float>& values) const {
    (void)indices;
    values.clear();
  }
  virtual double target_scale() const { return 1.0; }
};

// Another Dataset, not owned, seen as a Dataset (it must outlive the view).
class DatasetView final : public Dataset {
 public:
  explicit DatasetView(const Dataset& base) : base_(base) {}
  int64_t size() const override { return base_.size(); }
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override {
    base_.make_batch(indices, dtype, inputs, targets);
  }
  int64_t targets_per_sample() const override { return base_.targets_per_sample(); }
  bool regression() const override { return base_.regression(); }
  void batch_values(std::span<const int64_t> indices, std::vector<float>& values) const override {
    base_.batch_values(indices, values);
  }
  double target_scale() const override { return base_.target_scale(); }

 private:
  const Dataset& base_;
};

// Some samples of a shared Dataset, in the order given (a virtual site's
// shard of own data in `fedmesh sim`). Indices must be in [0, base size).
class DatasetSubset final : public Dataset {
 public:
  DatasetSubset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices);
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override;
  int64_t targets_per_sample() const override { return base_->targets_per_sample(); }
  bool regression() const override { return base_->regression(); }
  void batch_values(std::span<const int64_t> indices, std::vector<float>& values) const override;
  double target_scale() const override { return base_->target_scale(); }

 private:
  std::vector<int64_t> base_indices(std::span<const int64_t> indices) const;
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
};

// A classifier's class id of every sample, in order (read in batches of
// inputs that are then dropped). Regression and language data have none: empty.
std::vector<int32_t> class_ids(const Dataset& dataset);

// An ImageDataset it owns, seen as a Dataset.
class ImageSet final : public Dataset {
 public:
  explicit ImageSet(ImageDataset images) : images_(std::move(images)) {}
  int64_t size() const override { return images_.count; }
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override;
  const ImageDataset& images() const { return images_; }

 private:
  ImageDataset images_;
};

// An ImageDataset seen as a Dataset (normalized images, one label each).
class ImageBatches final : public Dataset {
 public:
  explicit ImageBatches(const ImageDataset& images) : images_(images) {}
  int64_t size() const override { return images_.count; }
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override;

 private:
  const ImageDataset& images_;
};

}  // namespace fedmesh::train::data

namespace fedmesh::train::data {

// A loaded data set: what to train and evaluate on, its schema, and one
// line for the start of a run ("569 rows of breast_cancer.csv, 30 features, 2 classes").
struct LoadedData {
  std::unique_ptr<Dataset> train, test;
  DataSchema schema;
  std::string description;
};

}  // namespace fedmesh::train::data
