// Turns dataset samples into model inputs: normalized images in the model's
// compute dtype and int32 labels.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/tensor.h"
#include "train/data/fashion_mnist.h"

namespace fedmesh::train::data {

// images becomes (indices.size(), channels, rows, cols) of `dtype`, each
// channel normalized by the dataset's mean and std; labels the matching classes.
void make_image_batch(const ImageDataset& dataset, std::span<const int64_t> indices, DType dtype, Tensor& images,
                      std::vector<int32_t>& labels);

}  // namespace fedmesh::train::data
