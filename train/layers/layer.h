// Layers with explicit forward and backward passes. A layer keeps what its
// backward pass needs from the last training-mode forward, computes in fp32,
// and stores activations in the dtype of its input (the model's compute dtype).
// Output and gradient buffers are reused across steps (Tensor::reuse): safe
// because a layer only rewrites them in its next forward, after the backward
// that read them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/parameter.h"
#include "kernels/tensor.h"

namespace fedmesh::train {

class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string kind() const = 0;
  // Shape of the output for an input of `input` shape (batch first); used to validate a model.
  virtual Shape output_shape(const Shape& input) const = 0;
  virtual Tensor forward(const Tensor& x, bool training) = 0;
  // dy has the output's shape. Accumulates into parameter grads; returns dx
  // when need_input_grad, else an undefined tensor.
  virtual Tensor backward(const Tensor& dy, bool need_input_grad) = 0;
  virtual std::vector<Parameter*> parameters() { return {}; }
  // Whether the layer has a CUDA version (every built-in model's layers do).
  virtual bool runs_on_cuda() const { return true; }
};


}  // namespace fedmesh::train
