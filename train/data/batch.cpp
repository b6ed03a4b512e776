#include "train/data/batch.h"
#include "train/data/dataset.h"

#include <array>

namespace fedmesh::train::data {

void make_image_batch(const ImageDataset& dataset, std::span<const int64_t> indices, DType dtype, Tensor& images,
                      std::vector<int32_t>& labels) {
  const int64_t batch = static_cast<int64_t>(indices.size());
  const int64_t pixels = dataset.pixels_per_image();
  const Shape shape = {batch, dataset.channels, dataset.rows, dataset.cols};
  Tensor::reuse(images, shape, dtype);
  FEDMESH_CHECK(dataset.mean.size() == static_cast<size_t>(dataset.channels) &&
                    dataset.std.size() == static_cast<size_t>(dataset.channels),
                "one mean and std per channel");
  // One lookup table per channel and byte value: normalization costs a load per pixel.
  const int64_t plane = dataset.rows * dataset.cols;
  std::vector<std::array<float, 256>> tables(static_cast<size_t>(dataset.channels));
  for (size_t c = 0; c < tables.size(); ++c) {
    for (int v = 0; v < 256; ++v) {
      tables[c][static_cast<size_t>(v)] = (static_cast<float>(v) / 255.0f - dataset.mean[c]) / dataset.std[c];
    }
  }
  labels.resize(static_cast<size_t>(batch));
  visit_dtype(dtype, [&]<class T>() {
    T* out = images.data<T>();
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t index = indices[static_cast<size_t>(i)];
      FEDMESH_CHECK(index >= 0 && index < dataset.count, "sample index out of range");
      const uint8_t* src = dataset.pixels.data() + index * pixels;
      for (int64_t c = 0; c < dataset.channels; ++c) {
        const std::array<float, 256>& table = tables[static_cast<size_t>(c)];
        for (int64_t j = c * plane; j < (c + 1) * plane; ++j) out[i * pixels + j] = from_float<T>(table[src[j]]);
      }
      labels[static_cast<size_t>(i)] = dataset.labels[static_cast<size_t>(index)];
    }
  });
}

void ImageSet::make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                          std::vector<int32_t>& targets) const {
  make_image_batch(images_, indices, dtype, inputs, targets);
}

void ImageBatches::make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                              std::vector<int32_t>& targets) const {
  make_image_batch(images_, indices, dtype, inputs, targets);
}

}  // namespace fedmesh::train::data
