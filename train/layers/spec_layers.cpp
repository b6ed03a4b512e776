#include "train/layers/spec_layers.h"

#include <cmath>

#include "base/status.h"
#include "kernels/convert.h"

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

}  // namespace fedmesh::train
