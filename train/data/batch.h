// Turns dataset samples into model inputs: normalized images in the model's
// compute dtype and int32 labels.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/tensor.h"
#include "train/data/fashion_mnist.h"

namespace fedmesh::train::data {

// Mean and standard deviation of Fashion-MNIST training pixels scaled to [0, 1].
inline constexpr float kFashionMnistPixelMean = 0.2860f;
inline constexpr float kFashionMnistPixelStd = 0.3530f;

// images becomes (indices.size(), 1, rows, cols) of `dtype`, labels the matching classes.
void make_image_batch(const ImageDataset& dataset, std::span<const int64_t> indices, DType dtype, Tensor& images,
                      std::vector<int32_t>& labels);

}  // namespace fedmesh::train::data
