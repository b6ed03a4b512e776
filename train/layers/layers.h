// The layers of the built-in models.
#pragma once

#include <cstdint>
#include <vector>

#include "base/random.h"
#include "kernels/conv.h"
#include "kernels/cuda_ops.h"
#include "train/layers/layer.h"

namespace fedmesh::train {

// y (batch, out) = x (batch, in) · weight (out, in)^T + bias (out). x may have
// more dimensions after batch: they are flattened.
class Linear final : public Layer {
 public:
  Linear(const std::string& name, int64_t in_features, int64_t out_features);
  std::string kind() const override { return "linear"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }
  // U(-1/sqrt(in), 1/sqrt(in)) for weight and bias, as torch.nn.Linear.
  void initialize(Rng& rng);
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  // The output of the last forward pass, (batch, out); valid until the next.
  const Tensor& last_output() const { return output_; }

 private:
  int64_t in_, out_;
  Parameter weight_, bias_;
  Shape input_shape_;  // as given, before flattening
  Tensor input_, output_, input_grad_;
};

class ReLU final : public Layer {
 public:
  std::string kind() const override { return "relu"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Tensor output_, input_grad_;
};

class Gelu final : public Layer {
 public:
  std::string kind() const override { return "gelu"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Tensor input_, output_, input_grad_;
};

// (batch, ...) -> (batch, product of the rest).
class Flatten final : public Layer {
 public:
  std::string kind() const override { return "flatten"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Shape input_shape_;
};

// NCHW convolution, square kernel; weight (out, in, k, k), bias (out).
class Conv2d final : public Layer {
 public:
  Conv2d(const std::string& name, int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride,
         int64_t padding);
  std::string kind() const override { return "conv2d"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }
  void initialize(Rng& rng);  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as torch.nn.Conv2d

 private:
  Conv2dGeometry geometry(const Shape& input) const;
  int64_t in_channels_, out_channels_, kernel_, stride_, padding_;
  Parameter weight_, bias_;
  Shape input_shape_;
  std::vector<float> columns_;  // im2col of the last training input
  Tensor device_columns_;       // the same on the CUDA device (also written in inference)
  Tensor output_, input_grad_;
};

class MaxPool2d final : public Layer {
 public:
  MaxPool2d(int64_t kernel, int64_t stride) : kernel_(kernel), stride_(stride) {}
  std::string kind() const override { return "maxpool2d"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Pool2dGeometry geometry(const Shape& input) const;
  int64_t kernel_, stride_;
  Shape input_shape_;
  std::vector<int32_t> argmax_;
  cuda::DeviceBuffer device_argmax_;  // the same on the CUDA device
  Tensor output_, input_grad_;
};

// Normalizes over the last dimension; gamma (n) starts at 1, beta (n) at 0.
class LayerNorm final : public Layer {
 public:
  LayerNorm(const std::string& name, int64_t features);
  std::string kind() const override { return "layernorm"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override { return {&gamma_, &beta_}; }

 private:
  int64_t features_;
  Parameter gamma_, beta_;
  Tensor input_, output_, mean_, rstd_, input_grad_;
};

}  // namespace fedmesh::train
