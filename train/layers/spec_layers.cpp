#include "train/layers/spec_layers.h"

#include <algorithm>
#include <cmath>

#include "base/status.h"
#include "kernels/convert.h"
#include "kernels/elementwise.h"

namespace fedmesh::train {

namespace {

// The values of a host tensor as fp32.
std::vector<float> host_floats(const Tensor& t) {
  FEDMESH_CHECK(t.device() == Device::kCpu, "these layers compute on the host");
  std::vector<float> out(static_cast<size_t>(t.numel()));
  widen_to_f32(t.raw(), t.dtype(), out.data(), t.numel());
  return out;
}

// `values` into `slot`, reused with `shape` in `dtype` (rounded to it).
Tensor& store(Tensor& slot, const Shape& shape, DType dtype, const std::vector<float>& values) {
  Tensor& t = Tensor::reuse(slot, shape, dtype, Device::kCpu);
  narrow_from_f32(values.data(), t.raw(), dtype, t.numel());
  return t;
}

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

}  // namespace

// ---- SiLU ----------------------------------------------------------------------

Tensor Silu::forward(const Tensor& x, bool training) {
  std::vector<float> in = host_floats(x), out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = in[i] * sigmoid(in[i]);
  if (training) input_ = std::move(in);
  return store(output_, x.shape(), x.dtype(), out);
}

Tensor Silu::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  const std::vector<float> grad = host_floats(dy);
  std::vector<float> out(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) {
    const float s = sigmoid(input_[i]);
    out[i] = grad[i] * s * (1.0f + input_[i] * (1.0f - s));  // d/dx x s(x) = s (1 + x (1 - s))
  }
  return store(input_grad_, dy.shape(), dy.dtype(), out);
}

// ---- AvgPool2d -----------------------------------------------------------------

Shape AvgPool2d::output_shape(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 4 && input[2] >= kernel_ && input[3] >= kernel_,
                "avgpool2d expects (batch, channels, H >= k, W >= k), got " + shape_to_string(input));
  return {input[0], input[1], (input[2] - kernel_) / stride_ + 1, (input[3] - kernel_) / stride_ + 1};
}

Tensor AvgPool2d::forward(const Tensor& x, bool training) {
  const Shape out_shape = output_shape(x.shape());
  const int64_t planes = x.dim(0) * x.dim(1), h = x.dim(2), w = x.dim(3), oh = out_shape[2], ow = out_shape[3];
  const std::vector<float> in = host_floats(x);
  std::vector<float> out(static_cast<size_t>(planes * oh * ow));
  const float scale = 1.0f / static_cast<float>(kernel_ * kernel_);
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        float sum = 0.0f;
        for (int64_t a = 0; a < kernel_; ++a) {
          for (int64_t b = 0; b < kernel_; ++b) sum += in[static_cast<size_t>((p * h + i * stride_ + a) * w + j * stride_ + b)];
        }
        out[static_cast<size_t>((p * oh + i) * ow + j)] = sum * scale;
      }
    }
  }
  if (training) input_shape_ = x.shape();
  return store(output_, out_shape, x.dtype(), out);
}

Tensor AvgPool2d::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  const Shape& s = input_shape_;
  const int64_t planes = s[0] * s[1], h = s[2], w = s[3], oh = dy.dim(2), ow = dy.dim(3);
  const std::vector<float> grad = host_floats(dy);
  std::vector<float> out(static_cast<size_t>(planes * h * w), 0.0f);
  const float scale = 1.0f / static_cast<float>(kernel_ * kernel_);
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        const float g = grad[static_cast<size_t>((p * oh + i) * ow + j)] * scale;
        for (int64_t a = 0; a < kernel_; ++a) {
          for (int64_t b = 0; b < kernel_; ++b) out[static_cast<size_t>((p * h + i * stride_ + a) * w + j * stride_ + b)] += g;
        }
      }
    }
  }
  return store(input_grad_, s, dy.dtype(), out);
}

// ---- GlobalAvgPool2d -----------------------------------------------------------

Shape GlobalAvgPool2d::output_shape(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 4, "global_avgpool expects (batch, channels, H, W), got " + shape_to_string(input));
  return {input[0], input[1]};
}

Tensor GlobalAvgPool2d::forward(const Tensor& x, bool training) {
  const int64_t planes = x.dim(0) * x.dim(1), area = x.dim(2) * x.dim(3);
  const std::vector<float> in = host_floats(x);
  std::vector<float> out(static_cast<size_t>(planes));
  for (int64_t p = 0; p < planes; ++p) {
    double sum = 0.0;
    for (int64_t k = 0; k < area; ++k) sum += in[static_cast<size_t>(p * area + k)];
    out[static_cast<size_t>(p)] = static_cast<float>(sum / static_cast<double>(area));
  }
  if (training) input_shape_ = x.shape();
  return store(output_, output_shape(x.shape()), x.dtype(), out);
}

Tensor GlobalAvgPool2d::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  const Shape& s = input_shape_;
  const int64_t planes = s[0] * s[1], area = s[2] * s[3];
  const std::vector<float> grad = host_floats(dy);
  std::vector<float> out(static_cast<size_t>(planes * area));
  for (int64_t p = 0; p < planes; ++p) {
    const float g = grad[static_cast<size_t>(p)] / static_cast<float>(area);
    for (int64_t k = 0; k < area; ++k) out[static_cast<size_t>(p * area + k)] = g;
  }
  return store(input_grad_, s, dy.dtype(), out);
}

// ---- Dropout -------------------------------------------------------------------

Tensor Dropout::forward(const Tensor& x, bool training) {
  identity_ = !training || p_ <= 0.0;
  if (identity_) return x;
  std::vector<float> values = host_floats(x);
  mask_.resize(values.size());
  const auto keep = static_cast<float>(1.0 / (1.0 - p_));
  for (size_t i = 0; i < values.size(); ++i) {
    mask_[i] = rng_.uniform() < p_ ? 0.0f : keep;
    values[i] *= mask_[i];
  }
  return store(output_, x.shape(), x.dtype(), values);
}

Tensor Dropout::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  if (identity_) return dy;
  std::vector<float> grad = host_floats(dy);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] *= mask_[i];
  return store(input_grad_, dy.shape(), dy.dtype(), grad);
}

// ---- GroupNorm -----------------------------------------------------------------

GroupNorm::GroupNorm(const std::string& name, int64_t groups, int64_t channels)
    : groups_(groups), channels_(channels), weight_(name + ".weight", {channels}), bias_(name + ".bias", {channels}) {
  fill(weight_.value, 1.0f);
  weight_.refresh_compute();
}

Tensor GroupNorm::forward(const Tensor& x, bool training) {
  FEDMESH_CHECK(x.rank() >= 2 && x.dim(1) == channels_, "groupnorm expects (batch, channels, ...)");
  const int64_t batch = x.dim(0), per_channel = x.numel() / (batch * channels_);
  const int64_t group_size = channels_ / groups_ * per_channel;
  const std::vector<float> in = host_floats(x);
  std::vector<float> out(in.size()), normalized(in.size()), rstd(static_cast<size_t>(batch * groups_));
  const float* w = weight_.value.data<float>();
  const float* b = bias_.value.data<float>();
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t g = 0; g < groups_; ++g) {
      const size_t start = static_cast<size_t>((n * groups_ + g) * group_size);
      double sum = 0.0, squares = 0.0;
      for (int64_t k = 0; k < group_size; ++k) {
        const double v = in[start + static_cast<size_t>(k)];
        sum += v;
        squares += v * v;
      }
      const double mean = sum / static_cast<double>(group_size);
      const double variance = std::max(0.0, squares / static_cast<double>(group_size) - mean * mean);
      const auto r = static_cast<float>(1.0 / std::sqrt(variance + 1e-5));  // PyTorch's eps
      rstd[static_cast<size_t>(n * groups_ + g)] = r;
      for (int64_t k = 0; k < group_size; ++k) {
        const size_t i = start + static_cast<size_t>(k);
        const int64_t c = g * (channels_ / groups_) + k / per_channel;
        normalized[i] = (in[i] - static_cast<float>(mean)) * r;
        out[i] = normalized[i] * w[c] + b[c];
      }
    }
  }
  if (training) {
    normalized_ = std::move(normalized);
    rstd_ = std::move(rstd);
    input_shape_ = x.shape();
  }
  return store(output_, x.shape(), x.dtype(), out);
}

Tensor GroupNorm::backward(const Tensor& dy, bool need_input_grad) {
  const int64_t batch = input_shape_[0], per_channel = dy.numel() / (batch * channels_);
  const int64_t group_size = channels_ / groups_ * per_channel;
  const std::vector<float> grad = host_floats(dy);
  const float* w = weight_.value.data<float>();
  float* dw = weight_.grad.data<float>();
  float* db = bias_.grad.data<float>();
  std::vector<float> out(grad.size());
  for (int64_t n = 0; n < batch; ++n) {
    for (int64_t g = 0; g < groups_; ++g) {
      const size_t start = static_cast<size_t>((n * groups_ + g) * group_size);
      // dx = rstd (dx̂ - mean(dx̂) - x̂ mean(dx̂ x̂)), dx̂ = dy w.
      double mean_d = 0.0, mean_dx = 0.0;
      for (int64_t k = 0; k < group_size; ++k) {
        const size_t i = start + static_cast<size_t>(k);
        const int64_t c = g * (channels_ / groups_) + k / per_channel;
        dw[c] += grad[i] * normalized_[i];
        db[c] += grad[i];
        const double d = static_cast<double>(grad[i]) * w[c];
        mean_d += d;
        mean_dx += d * normalized_[i];
      }
      mean_d /= static_cast<double>(group_size);
      mean_dx /= static_cast<double>(group_size);
      const float r = rstd_[static_cast<size_t>(n * groups_ + g)];
      for (int64_t k = 0; k < group_size; ++k) {
        const size_t i = start + static_cast<size_t>(k);
        const int64_t c = g * (channels_ / groups_) + k / per_channel;
        out[i] = r * static_cast<float>(static_cast<double>(grad[i]) * w[c] - mean_d - normalized_[i] * mean_dx);
      }
    }
  }
  if (!need_input_grad) return {};
  return store(input_grad_, input_shape_, dy.dtype(), out);
}

// ---- Residual ------------------------------------------------------------------

Shape Residual::output_shape(const Shape& input) const {
  Shape shape = input;
  for (const auto& layer : body_) shape = layer->output_shape(shape);
  return shape;
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
