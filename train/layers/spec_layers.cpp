#include "train/layers/spec_layers.h"

#include <algorithm>
#include <cmath>

#include "base/status.h"
#include "kernels/conv.h"
#include "kernels/elementwise.h"
#include "kernels/layernorm.h"

namespace fedmesh::train {

// ---- SiLU ----------------------------------------------------------------------

Tensor Silu::forward(const Tensor& x, bool training) {
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  silu_forward(x, y);
  if (training) input_ = x;
  return y;
}

Tensor Silu::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  FEDMESH_CHECK(input_.defined(), "Silu::backward before a training forward");
  Tensor& dx = Tensor::reuse(input_grad_, dy.shape(), dy.dtype(), dy.device());
  silu_backward(input_, dy, dx);
  return dx;
}

// ---- AvgPool2d -----------------------------------------------------------------

Shape AvgPool2d::output_shape(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 4 && input[2] >= kernel_ && input[3] >= kernel_,
                "avgpool2d expects (batch, channels, H >= k, W >= k), got " + shape_to_string(input));
  return {input[0], input[1], (input[2] - kernel_) / stride_ + 1, (input[3] - kernel_) / stride_ + 1};
}

Pool2dGeometry AvgPool2d::geometry(const Shape& input) const {
  return {input[0], input[1], input[2], input[3], kernel_, stride_};
}

Tensor AvgPool2d::forward(const Tensor& x, bool training) {
  Tensor& y = Tensor::reuse(output_, output_shape(x.shape()), x.dtype(), x.device());
  avgpool2d_forward(geometry(x.shape()), x, y);
  if (training) input_shape_ = x.shape();
  return y;
}

Tensor AvgPool2d::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, input_shape_, dy.dtype(), dy.device());
  avgpool2d_backward(geometry(input_shape_), dy, dx);
  return dx;
}

// ---- GlobalAvgPool2d -----------------------------------------------------------

Shape GlobalAvgPool2d::output_shape(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 4, "global_avgpool expects (batch, channels, H, W), got " + shape_to_string(input));
  return {input[0], input[1]};
}

Tensor GlobalAvgPool2d::forward(const Tensor& x, bool training) {
  Tensor& y = Tensor::reuse(output_, output_shape(x.shape()), x.dtype(), x.device());
  plane_mean_forward(x, y);
  if (training) input_shape_ = x.shape();
  return y;
}

Tensor GlobalAvgPool2d::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, input_shape_, dy.dtype(), dy.device());
  plane_mean_backward(dy, dx);
  return dx;
}

// ---- Dropout -------------------------------------------------------------------

Tensor Dropout::forward(const Tensor& x, bool training) {
  identity_ = !training || p_ <= 0.0;
  if (identity_) return x;
  // The mask is drawn on the host, value by value, whatever the device.
  Tensor mask = Tensor::empty(x.shape());
  float* m = mask.data<float>();
  const auto keep = static_cast<float>(1.0 / (1.0 - p_));
  for (int64_t i = 0; i < mask.numel(); ++i) m[i] = rng_.uniform() < p_ ? 0.0f : keep;
  mask_ = x.device() == Device::kCpu ? std::move(mask) : mask.to(x.device());
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  mul(x, mask_, y);
  return y;
}

Tensor Dropout::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  if (identity_) return dy;
  Tensor& dx = Tensor::reuse(input_grad_, dy.shape(), dy.dtype(), dy.device());
  mul(dy, mask_, dx);
  return dx;
}

// ---- GroupNorm -----------------------------------------------------------------

GroupNorm::GroupNorm(const std::string& name, int64_t groups, int64_t channels)
    : groups_(groups), channels_(channels), weight_(name + ".weight", {channels}), bias_(name + ".bias", {channels}) {
  fill(weight_.value, 1.0f);
  weight_.refresh_compute();
}

GroupNormShape GroupNorm::shape_of(const Tensor& x) const {
  FEDMESH_CHECK(x.rank() >= 2 && x.dim(1) == channels_, "groupnorm expects (batch, channels, ...), got " +
                                                            shape_to_string(x.shape()));
  return {x.dim(0), channels_, x.numel() / (x.dim(0) * channels_), groups_};
}

Tensor GroupNorm::forward(const Tensor& x, bool training) {
  const GroupNormShape s = shape_of(x);
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  Tensor::reuse(mean_, {s.batch * s.groups}, DType::kF32, x.device());
  Tensor::reuse(rstd_, {s.batch * s.groups}, DType::kF32, x.device());
  groupnorm_forward(s, x, weight_.value, bias_.value, y, mean_, rstd_);
  if (training) input_ = x;
  return y;
}

Tensor GroupNorm::backward(const Tensor& dy, bool need_input_grad) {
  FEDMESH_CHECK(input_.defined(), "GroupNorm::backward before a training forward");
  Tensor* dx = need_input_grad ? &Tensor::reuse(input_grad_, input_.shape(), dy.dtype(), dy.device()) : nullptr;
  groupnorm_backward(shape_of(input_), input_, dy, weight_.value, mean_, rstd_, dx, weight_.grad, bias_.grad);
  return need_input_grad ? *dx : Tensor{};
}

// ---- Residual ------------------------------------------------------------------

Shape Residual::output_shape(const Shape& input) const {
  Shape shape = input;
  for (const auto& layer : body_) shape = layer->output_shape(shape);
  return shape;
}

bool Residual::runs_on_cuda() const {
  for (const auto& layer : body_) {
    if (!layer->runs_on_cuda()) return false;
  }
  return !shortcut_ || shortcut_->runs_on_cuda();
}

std::vector<Parameter*> Residual::parameters() {
  std::vector<Parameter*> all;
  for (auto& layer : body_) {
    for (Parameter* p : layer->parameters()) all.push_back(p);
  }
  if (shortcut_) {
    for (Parameter* p : shortcut_->parameters()) all.push_back(p);
  }
  return all;
}

Tensor Residual::forward(const Tensor& x, bool training) {
  Tensor h = x;
  for (auto& layer : body_) h = layer->forward(h, training);
  const Tensor skip = shortcut_ ? shortcut_->forward(x, training) : x;
  add(h, skip, Tensor::reuse(output_, h.shape(), x.dtype(), x.device()));
  return output_;
}

Tensor Residual::backward(const Tensor& dy, bool need_input_grad) {
  Tensor g = dy;
  for (size_t i = body_.size(); i-- > 0;) g = body_[i]->backward(g, true);
  const Tensor skip = shortcut_ ? shortcut_->backward(dy, need_input_grad) : dy;
  if (!need_input_grad) return {};
  add(g, skip, Tensor::reuse(input_grad_, g.shape(), dy.dtype(), dy.device()));
  return input_grad_;
}

}  // namespace fedmesh::train
