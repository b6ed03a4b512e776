// Layers that config-defined models (train/model_spec.h) add to those of the
// built-in models: SiLU, average pooling, global average pooling and
// dropout. They compute on the host in fp32 (an input in bf16/fp16 is widened
// and the output narrowed back to its dtype) and have no CUDA version yet:
// runs_on_cuda() is false, and a model holding one is refused on
// --device cuda before it trains (Sequential::device_problem).
#pragma once

#include <cstdint>
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

}  // namespace fedmesh::train
