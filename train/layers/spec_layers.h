// Layers that config-defined models (train/model_spec.h) add to those of the
// built-in models: SiLU, average pooling, global average pooling, dropout,
// group norm and residual blocks. They compute on the host in fp32 (an input in bf16/fp16 is widened
// and the output narrowed back to its dtype) and have no CUDA version yet:
// runs_on_cuda() is false, and a model holding one is refused on
// --device cuda before it trains (Sequential::device_problem).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/random.h"
#include "train/layers/layer.h"

namespace fedmesh::train {

// y = x * sigmoid(x), as torch.nn.SiLU.
class Silu final : public Layer {
 public:
  std::string kind() const override { return "silu"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  bool runs_on_cuda() const override { return false; }

 private:
  std::vector<float> input_;  // of the last training forward
  Tensor output_, input_grad_;
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
  bool runs_on_cuda() const override { return false; }

 private:
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
  bool runs_on_cuda() const override { return false; }

 private:
  Shape input_shape_;
  Tensor output_, input_grad_;
};

// Training: each value is zeroed with probability p and the others scaled
// by 1 / (1 - p) (inverted dropout, as torch.nn.Dropout); inference: the
// identity. The masks come from a generator seeded by the model's seed, so a
// run is reproducible.
class Dropout final : public Layer {
 public:
  Dropout(double p, uint64_t seed) : p_(p), rng_(seed) {}
  std::string kind() const override { return "dropout"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, bool training) override;
  Tensor backward(const Tensor& dy, bool need_input_grad) override;
  bool runs_on_cuda() const override { return false; }

 private:
  double p_;
  Rng rng_;
  std::vector<float> mask_;  // 0 or 1 / (1 - p) per value of the last training forward
  bool identity_ = true;     // the last forward was inference (or p = 0)
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
  bool runs_on_cuda() const override { return false; }

 private:
  int64_t groups_, channels_;
  Parameter weight_, bias_;
  Shape input_shape_;
  std::vector<float> normalized_, rstd_;  // of the last training forward: x̂ per value, 1/σ per (sample, group)
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
  bool runs_on_cuda() const override { return false; }

 private:
  std::vector<std::unique_ptr<Layer>> body_;
  std::unique_ptr<Layer> shortcut_;  // null: the identity
  Tensor output_, input_grad_;
};

}  // namespace fedmesh::train
