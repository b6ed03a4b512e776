#include "train/layers/layers.h"

#include <cmath>
#include <cstring>

#include "kernels/device_ops.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/layernorm.h"

namespace fedmesh::train {

namespace {

void uniform_fill(Tensor& t, Rng& rng, float bound) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
}

int64_t features_after_batch(const Shape& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

// ---- Linear ------------------------------------------------------------------

Linear::Linear(const std::string& name, int64_t in_features, int64_t out_features)
    : in_(in_features),
      out_(out_features),
      weight_(name + ".weight", {out_features, in_features}),
      bias_(name + ".bias", {out_features}) {}

void Linear::initialize(Rng& rng) {
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_));
  uniform_fill(weight_.value, rng, bound);
  uniform_fill(bias_.value, rng, bound);
  weight_.refresh_compute();
  bias_.refresh_compute();
}

Shape Linear::output_shape(const Shape& input) const {
  FEDMESH_CHECK(!input.empty() && features_after_batch(input) == in_,
                "linear " + weight_.name + " expects " + std::to_string(in_) + " features, got " +
                    shape_to_string(input));
  return {input[0], out_};
}

Tensor Linear::forward(const Tensor& x, bool training) {
  const int64_t batch = x.dim(0);
  const Tensor input = x.reshape({batch, in_});
  Tensor& y = Tensor::reuse(output_, output_shape(x.shape()), x.dtype(), x.device());
  const Tensor& w = weight_.compute;
  if (device::on_cuda(y)) {
    device::gemm(false, true, 1.0f, input, w, 0.0f, y, &bias_.value);  // the bias in the GEMM's epilogue
  } else if (y.dtype() == DType::kF32 && input.dtype() == DType::kF32 && w.dtype() == DType::kF32) {
    // Start from the bias and let the GEMM accumulate onto it (beta = 1).
    float* out = y.data<float>();
    const float* b = bias_.value.data<float>();
    for (int64_t r = 0; r < batch; ++r) std::memcpy(out + r * out_, b, static_cast<size_t>(out_) * sizeof(float));
    gemm(false, true, 1.0f, input, w, 1.0f, y);
  } else {
    gemm(false, true, 1.0f, input, w, 0.0f, y);
    add_bias(y, bias_.value);
  }
  if (training) {
    input_ = input;
    input_shape_ = x.shape();
  }
  return y;
}

Tensor Linear::backward(const Tensor& dy, bool need_input_grad) {
  FEDMESH_CHECK(input_.defined(), "Linear::backward before a training forward");
  const Tensor grad = dy.reshape({input_.dim(0), out_});
  gemm(true, false, 1.0f, grad, input_, 1.0f, weight_.grad);  // (out, in) += dy^T · x
  bias_grad(grad, bias_.grad, /*accumulate=*/true);
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, input_.shape(), input_.dtype(), input_.device());
  gemm(false, false, 1.0f, grad, weight_.compute, 0.0f, dx);  // (batch, in) = dy · W
  return dx.reshape(input_shape_);
}

// ---- ReLU / GELU ---------------------------------------------------------------

Tensor ReLU::forward(const Tensor& x, bool) {
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  relu_forward(x, y);
  return y;
}

Tensor ReLU::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, dy.shape(), dy.dtype(), dy.device());
  relu_backward(output_, dy, dx);
  return dx;
}

Tensor Gelu::forward(const Tensor& x, bool training) {
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  gelu_forward(x, y);
  if (training) input_ = x;
  return y;
}

Tensor Gelu::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, dy.shape(), dy.dtype(), dy.device());
  gelu_backward(input_, dy, dx);
  return dx;
}

// ---- Flatten -------------------------------------------------------------------

Shape Flatten::output_shape(const Shape& input) const {
  FEDMESH_CHECK(!input.empty(), "flatten needs a batch dimension");
  return {input[0], features_after_batch(input)};
}

Tensor Flatten::forward(const Tensor& x, bool) {
  input_shape_ = x.shape();
  return x.reshape(output_shape(x.shape()));
}

Tensor Flatten::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  return dy.reshape(input_shape_);
}

// ---- Conv2d --------------------------------------------------------------------

Conv2d::Conv2d(const std::string& name, int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride,
               int64_t padding)
    : in_channels_(in_channels),
      out_channels_(out_channels),
      kernel_(kernel),
      stride_(stride),
      padding_(padding),
      weight_(name + ".weight", {out_channels, in_channels, kernel, kernel}),
      bias_(name + ".bias", {out_channels}) {}

void Conv2d::initialize(Rng& rng) {
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_channels_ * kernel_ * kernel_));
  uniform_fill(weight_.value, rng, bound);
  uniform_fill(bias_.value, rng, bound);
  weight_.refresh_compute();
  bias_.refresh_compute();
}

Conv2dGeometry Conv2d::geometry(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 4 && input[1] == in_channels_,
                "conv2d " + weight_.name + " expects (batch, " + std::to_string(in_channels_) + ", H, W), got " +
                    shape_to_string(input));
  Conv2dGeometry g;
  g.batch = input[0];
  g.in_channels = in_channels_;
  g.height = input[2];
  g.width = input[3];
  g.out_channels = out_channels_;
  g.kernel = kernel_;
  g.stride = stride_;
  g.padding = padding_;
  FEDMESH_CHECK(g.out_height() > 0 && g.out_width() > 0, "conv2d input smaller than its kernel");
  return g;
}

Shape Conv2d::output_shape(const Shape& input) const {
  const Conv2dGeometry g = geometry(input);
  return {g.batch, g.out_channels, g.out_height(), g.out_width()};
}

Tensor Conv2d::forward(const Tensor& x, bool training) {
  const Conv2dGeometry g = geometry(x.shape());
  Tensor& y = Tensor::reuse(output_, output_shape(x.shape()), x.dtype(), x.device());
  if (device::on_cuda(x)) {
    device::conv2d_forward(g, x, weight_.compute, bias_.value, y, device_columns_);
  } else {
    thread_local std::vector<float> inference_columns;
    conv2d_forward(g, x, weight_.compute, bias_.value, y, training ? columns_ : inference_columns);
  }
  if (training) input_shape_ = x.shape();
  return y;
}

Tensor Conv2d::backward(const Tensor& dy, bool need_input_grad) {
  FEDMESH_CHECK(!input_shape_.empty(), "Conv2d::backward before a training forward");
  const Conv2dGeometry g = geometry(input_shape_);
  Tensor* dx = nullptr;
  if (need_input_grad) dx = &Tensor::reuse(input_grad_, input_shape_, dy.dtype(), dy.device());
  if (device::on_cuda(dy)) {
    device::conv2d_backward(g, device_columns_, weight_.compute, dy, weight_.grad, bias_.grad, dx);
  } else {
    conv2d_backward(g, columns_, weight_.compute, dy, weight_.grad, bias_.grad, dx);
  }
  return need_input_grad ? *dx : Tensor{};
}

// ---- MaxPool2d -----------------------------------------------------------------

Pool2dGeometry MaxPool2d::geometry(const Shape& input) const {
  FEDMESH_CHECK(input.size() == 4 && input[2] >= kernel_ && input[3] >= kernel_,
                "maxpool2d expects (batch, channels, H >= k, W >= k), got " + shape_to_string(input));
  Pool2dGeometry g;
  g.batch = input[0];
  g.channels = input[1];
  g.height = input[2];
  g.width = input[3];
  g.kernel = kernel_;
  g.stride = stride_;
  return g;
}

Shape MaxPool2d::output_shape(const Shape& input) const {
  const Pool2dGeometry g = geometry(input);
  return {g.batch, g.channels, g.out_height(), g.out_width()};
}

Tensor MaxPool2d::forward(const Tensor& x, bool training) {
  Tensor& y = Tensor::reuse(output_, output_shape(x.shape()), x.dtype(), x.device());
  if (device::on_cuda(x)) {
    device::maxpool2d_forward(geometry(x.shape()), x, y, device_argmax_);
  } else {
    maxpool2d_forward(geometry(x.shape()), x, y, argmax_);
  }
  if (training) input_shape_ = x.shape();
  return y;
}

Tensor MaxPool2d::backward(const Tensor& dy, bool need_input_grad) {
  if (!need_input_grad) return {};
  Tensor& dx = Tensor::reuse(input_grad_, input_shape_, dy.dtype(), dy.device());
  if (device::on_cuda(dy)) {
    device::maxpool2d_backward(geometry(input_shape_), device_argmax_, dy, dx);
  } else {
    maxpool2d_backward(geometry(input_shape_), argmax_, dy, dx);
  }
  return dx;
}

// ---- LayerNorm -----------------------------------------------------------------

LayerNorm::LayerNorm(const std::string& name, int64_t features)
    : features_(features), gamma_(name + ".weight", {features}), beta_(name + ".bias", {features}) {
  fill(gamma_.value, 1.0f);
  gamma_.refresh_compute();
}

Tensor LayerNorm::forward(const Tensor& x, bool training) {
  FEDMESH_CHECK(x.rank() >= 1 && x.shape().back() == features_, "layernorm: last dimension must be " +
                                                                     std::to_string(features_));
  const int64_t rows = x.numel() / features_;
  Tensor& y = Tensor::reuse(output_, x.shape(), x.dtype(), x.device());
  Tensor::reuse(mean_, {rows}, DType::kF32, x.device());
  Tensor::reuse(rstd_, {rows}, DType::kF32, x.device());
  layernorm_forward(x, gamma_.value, beta_.value, y, mean_, rstd_);
  if (training) input_ = x;
  return y;
}

Tensor LayerNorm::backward(const Tensor& dy, bool need_input_grad) {
  FEDMESH_CHECK(input_.defined(), "LayerNorm::backward before a training forward");
  Tensor& dx = Tensor::reuse(input_grad_, input_.shape(), dy.dtype(), dy.device());
  layernorm_backward(input_, dy, gamma_.value, mean_, rstd_, dx, gamma_.grad, beta_.grad);
  return need_input_grad ? dx : Tensor{};
}

}  // namespace fedmesh::train
