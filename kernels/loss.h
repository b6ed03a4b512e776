// The losses a model trains on: fused, numerically stable softmax +
// cross-entropy for classes, and squared error for real-valued targets.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/tensor.h"

namespace fedmesh {

struct CrossEntropyResult {
  double loss_sum = 0.0;  // sum over rows of -log softmax(logits)[label]
  int64_t correct = 0;    // rows whose argmax equals the label
};

// logits (rows, classes) of any dtype; labels (rows) in [0, classes).
// If dlogits is given (same shape, any dtype) it receives
//   d(loss_sum * grad_scale / normalizer)/d logits = grad_scale/normalizer * (softmax - onehot),
// so a mean loss over a batch is normalizer = rows, and loss scaling is grad_scale.
CrossEntropyResult softmax_cross_entropy(const Tensor& logits, std::span<const int32_t> labels, Tensor* dlogits,
                                         float grad_scale = 1.0f, float normalizer = 1.0f);

struct SquaredErrorResult {
  double loss_sum = 0.0;  // sum over rows of (prediction - value)^2
  double abs_sum = 0.0;   // sum over rows of |prediction - value|
};

// predictions (rows, 1) of any dtype; values (rows). If dpredictions is given
// (same shape, any dtype) it receives
//   d(loss_sum * grad_scale / normalizer)/d predictions = grad_scale/normalizer * 2 (prediction - value).
SquaredErrorResult squared_error(const Tensor& predictions, std::span<const float> values, Tensor* dpredictions,
                                 float grad_scale = 1.0f, float normalizer = 1.0f);

}  // namespace fedmesh
