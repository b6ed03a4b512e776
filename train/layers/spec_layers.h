// Layers that config-defined models (train/model_spec.h) add to those of the
// built-in models: SiLU, average pooling, global average pooling, dropout,
// group norm and residual blocks. They compute with the kernels'
// Tensor-level ops (elementwise.h, conv.h, layernorm.h), in fp32 whatever
// the activations' dtype, on the CPU or the CUDA device alike; a residual
// block runs on the device when its layers do.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/conv.h"
#include "kernels/layernorm.h"
#include "train/layers/layer.h"

namespace fedmesh::train {

// y = x * sigmoid(x), as torch.nn.SiLU.
class Silu final : public Layer {
 public:
  std::string kind() const override { return "silu"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Tensor input_, output_, input_grad_;  // input_: of the last training forward
};

// NCHW mean over k x k windows every `stride` (no padding, the last partial
// window dropped), as torch.nn.AvgPool2d(k, stride).
class AvgPool2d final : public Layer {
 public:
  AvgPool2d(int64_t kernel, int64_t stride) : kernel_(kernel), stride_(stride) {}
  std::string kind() const override { return "avgpool2d"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Pool2dGeometry geometry(const Shape& input) const;
  int64_t kernel_, stride_;
  Shape input_shape_;
  Tensor output_, input_grad_;
};

// (batch, channels, H, W) -> (batch, channels): each channel's mean, as
// torch.nn.AdaptiveAvgPool2d(1) followed by flatten.
class GlobalAvgPool2d final : public Layer {
 public:
  std::string kind() const override { return "global_avgpool"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  Shape input_shape_;
  Tensor output_, input_grad_;
};

// Training: each value is zeroed with probability p and the others scaled
// by 1 / (1 - p) (inverted dropout, as torch.nn.Dropout); inference: the
// identity. The masks come from a generator seeded by the model's seed, so a
// run is reproducible; on the CUDA device the host draws the same mask and
// copies it over (one host-to-device copy per training forward), so a run
// drops the same values on either device.
class Dropout final : public Layer {
 public:
  Dropout(double p, uint64_t seed) : p_(p), rng_(seed) {}
  std::string kind() const override { return "dropout"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;

 private:
  double p_;
  Rng rng_;
  Tensor mask_;           // fp32, 0 or 1 / (1 - p) per value of the last training forward, on the input's device
  bool identity_ = true;  // the last forward was inference (or p = 0)
  Tensor output_, input_grad_;
};

// Group normalization (Wu and He 2018, as torch.nn.GroupNorm): the
// channels of each sample in `groups` groups, each group normalized over its
// channels and positions, then scaled and shifted per channel (weight
// starts at 1, bias at 0). Input (batch, channels, ...).
class GroupNorm final : public Layer {
 public:
  GroupNorm(const std::string& name, int64_t groups, int64_t channels);
  std::string kind() const override { return "groupnorm"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }

 private:
  GroupNormShape shape_of(const Tensor& x) const;
  int64_t groups_, channels_;
  Parameter weight_, bias_;
  Tensor input_, mean_, rstd_;  // of the last training forward; mean and 1/σ per (sample, group)
  Tensor output_, input_grad_;
};

// y = body(x) + x, or + shortcut(x) (a 1x1 convolution) where the body
// changes the channels or the size: a ResNet basic block without its final
// activation. The body's layers run in order; the gradient flows through
// both paths and is added.
class Residual final : public Layer {
 public:
  Residual(std::vector<std::unique_ptr<Layer>> body, std::unique_ptr<Layer> shortcut)
      : body_(std::move(body)), shortcut_(std::move(shortcut)) {}
  std::string kind() const override { return "residual"; }
  Shape output_shape(const Shape& input) const override;
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  std::vector<Parameter*> parameters() override;
  bool runs_on_cuda() const override;  // when every layer of it does

 private:
  std::vector<std::unique_ptr<Layer>> body_;
  std::unique_ptr<Layer> shortcut_;  // null: the identity
  Tensor output_, input_grad_;
};

}  // namespace fedmesh::train
