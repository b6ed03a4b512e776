// Fused, numerically stable softmax + cross-entropy.
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

}  // namespace fedmesh
