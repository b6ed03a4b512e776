#include "kernels/elementwise.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/device_ops.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {
namespace {

constexpr int64_t kElementwiseGrain = 1 << 14;

void check_same_numel(const Tensor& a, const Tensor& b, const char* op) {
  FEDMESH_CHECK(a.numel() == b.numel(), std::string(op) + ": " + shape_to_string(a.shape()) + " vs " +
                                            shape_to_string(b.shape()));
}

// out[i] = f(a[i]) for every dtype pair.
template <class F>
void map_unary(const Tensor& a, Tensor& out, F f) {
  visit_dtype(a.dtype(), [&]<class In>() {
    visit_dtype(out.dtype(), [&]<class Out>() {
      const In* in = static_cast<const In*>(a.raw());
      Out* o = static_cast<Out*>(out.raw());
      parallel_for(a.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) o[i] = from_float<Out>(f(to_float(in[i])));
      });
    });
  });
}

// out[i] = f(a[i], b[i]).
template <class F>
void map_binary(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  visit_dtype(a.dtype(), [&]<class A>() {
    visit_dtype(b.dtype(), [&]<class B>() {
      visit_dtype(out.dtype(), [&]<class Out>() {
        const A* pa = static_cast<const A*>(a.raw());
        const B* pb = static_cast<const B*>(b.raw());
        Out* o = static_cast<Out*>(out.raw());
        parallel_for(a.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) o[i] = from_float<Out>(f(to_float(pa[i]), to_float(pb[i])));
        });
      });
    });
  });
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// tanh for GELU, written so that the compiler vectorizes the loops that call
// it (libm's tanhf is a scalar call, and it was a third of a transformer
// step): tanh(u) = 1 - 2 / (e^(2u) + 1), with e^v = 2^n 2^f for v log2(e) =
// n + f, |f| <= 1/2, 2^f by its Taylor polynomial to degree 7 (truncation
// (ln 2 / 2)^8 / 8! < 6e-9) and 2^n put in the exponent bits. The absolute
// error stays within about 2e-7 for every u: GELU multiplies it by |x| / 2,
// well inside the few-ulp budget of its tests (and of the CUDA kernel's
// tanhf, which it is compared with).
inline float tanh_for_gelu(float u) {
  float v = 2.0f * u;
  v = v > 88.0f ? 88.0f : v;
  v = v < -88.0f ? -88.0f : v;
  const float t = v * 1.4426950408889634f;
  // Round to the nearest integer without a branch: adding 1.5 * 2^23 leaves
  // no fraction bits (|t| < 128).
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = (t - n) * 0.6931471805599453f;  // in [-ln2 / 2, ln2 / 2]
  const float p =
      1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6.0f + f * (1.0f / 24.0f + f * (1.0f / 120.0f +
                                                                                  f * (1.0f / 720.0f + f * (1.0f / 5040.0f)))))));
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return 1.0f - 2.0f / (p * scale + 1.0f);
}

}  // namespace

void fill(Tensor& x, float value) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(x)) return device::fill(x, value);
  visit_dtype(x.dtype(), [&]<class T>() {
    const T v = from_float<T>(value);
    T* p = x.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = v;
  });
}

void scale(Tensor& x, float factor) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(x)) return device::scale(x, factor);
  map_unary(x, x, [factor](float v) { return v * factor; });
}

void axpy(float alpha, const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::axpy(alpha, x, y);
  check_same_numel(x, y, "axpy");
  map_binary(x, y, y, [alpha](float xv, float yv) { return yv + alpha * xv; });
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(out)) return device::add(a, b, out);
  check_same_numel(a, b, "add");
  check_same_numel(a, out, "add");
  map_binary(a, b, out, [](float x, float y) { return x + y; });
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(out)) return device::mul(a, b, out);
  check_same_numel(a, b, "mul");
  check_same_numel(a, out, "mul");
  map_binary(a, b, out, [](float x, float y) { return x * y; });
}

void add_bias(Tensor& y, const Tensor& bias) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::add_bias(y, bias);
  const int64_t n = bias.numel();
  FEDMESH_CHECK(n > 0 && y.numel() % n == 0, "add_bias: bias does not divide the output");
  const int64_t rows = y.numel() / n;
  const float* b = bias.data<float>();
  visit_dtype(y.dtype(), [&]<class T>() {
    T* p = y.data<T>();
    parallel_for(rows, std::max<int64_t>(1, kElementwiseGrain / n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T* row = p + r * n;
        for (int64_t j = 0; j < n; ++j) row[j] = from_float<T>(to_float(row[j]) + b[j]);
      }
    });
  });
}

void bias_grad(const Tensor& dy, Tensor& db, bool accumulate) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(db)) return device::bias_grad(dy, db, accumulate);
  const int64_t n = db.numel();
  FEDMESH_CHECK(n > 0 && dy.numel() % n == 0, "bias_grad: shapes do not match");
  const int64_t rows = dy.numel() / n;
  float* out = db.data<float>();
  if (!accumulate) std::memset(out, 0, static_cast<size_t>(n) * sizeof(float));
  visit_dtype(dy.dtype(), [&]<class T>() {
    const T* p = dy.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = p + r * n;
      for (int64_t j = 0; j < n; ++j) out[j] += to_float(row[j]);
    }
  });
}

void channel_bias_grad(const Tensor& dy, Tensor& db, bool accumulate) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(db)) return device::channel_bias_grad(dy, db, accumulate);
  FEDMESH_CHECK(dy.rank() >= 2 && dy.dim(1) == db.numel(), "channel_bias_grad: shapes do not match");
  const int64_t batch = dy.dim(0), channels = dy.dim(1);
  const int64_t positions = dy.numel() / (batch * channels);
  float* out = db.data<float>();
  visit_dtype(dy.dtype(), [&]<class T>() {
    const T* p = dy.data<T>();
    parallel_for(channels, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        float total = 0.0f;
        for (int64_t b = 0; b < batch; ++b) {
          const T* plane = p + (b * channels + c) * positions;
          for (int64_t i = 0; i < positions; ++i) total += to_float(plane[i]);
        }
        out[c] = accumulate ? out[c] + total : total;
      }
    });
  });
}

void relu_forward(const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::relu_forward(x, y);
  check_same_numel(x, y, "relu");
  map_unary(x, y, [](float v) { return v > 0.0f ? v : 0.0f; });
}

void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dx)) return device::relu_backward(y, dy, dx);
  check_same_numel(y, dy, "relu_backward");
  check_same_numel(y, dx, "relu_backward");
  map_binary(y, dy, dx, [](float out, float grad) { return out > 0.0f ? grad : 0.0f; });
}

inline float gelu_value(float v) {
  const float inner = kSqrt2OverPi * (v + kGeluCubic * v * v * v);
  return 0.5f * v * (1.0f + tanh_for_gelu(inner));
}

inline float gelu_slope(float v) {
  const float inner = kSqrt2OverPi * (v + kGeluCubic * v * v * v);
  const float t = tanh_for_gelu(inner);
  const float d_inner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v);
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * d_inner;
}

void gelu_forward(const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::gelu_forward(x, y);
  check_same_numel(x, y, "gelu");
  if (x.dtype() == DType::kF32 && y.dtype() == DType::kF32) {
    // fp32: a plain loop the compiler vectorizes (the generic path converts
    // per element and does not).
    const float* in = x.data<float>();
    float* out = y.data<float>();
    parallel_for(x.numel(), kElementwiseGrain, [in, out](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = gelu_value(in[i]);
    });
    return;
  }
  map_unary(x, y, [](float v) { return gelu_value(v); });
}

void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dx)) return device::gelu_backward(x, dy, dx);
  check_same_numel(x, dy, "gelu_backward");
  check_same_numel(x, dx, "gelu_backward");
  if (x.dtype() == DType::kF32 && dy.dtype() == DType::kF32 && dx.dtype() == DType::kF32) {
    const float* in = x.data<float>();
    const float* grad = dy.data<float>();
    float* out = dx.data<float>();  // may alias grad: element i reads grad[i] before writing out[i]
    parallel_for(x.numel(), kElementwiseGrain, [in, grad, out](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = grad[i] * gelu_slope(in[i]);
    });
    return;
  }
  map_binary(x, dy, dx, [](float v, float grad) { return grad * gelu_slope(v); });
}

namespace {

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

}  // namespace

void silu_forward(const Tensor& x, Tensor& y) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(y)) return device::silu_forward(x, y);
  check_same_numel(x, y, "silu");
  map_unary(x, y, [](float v) { return v * sigmoid(v); });
}

void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(dx)) return device::silu_backward(x, dy, dx);
  check_same_numel(x, dy, "silu_backward");
  check_same_numel(x, dx, "silu_backward");
  map_binary(x, dy, dx, [](float v, float grad) {
    const float s = sigmoid(v);
    return grad * s * (1.0f + v * (1.0f - s));
  });
}

namespace {
template <class F>
double reduce(const Tensor& x, F f) {
  device::require_host("reduce", {&x});
  return visit_dtype(x.dtype(), [&]<class T>() {
    const T* p = static_cast<const T*>(x.raw());
    std::vector<double> partial(static_cast<size_t>(cpu_threads()) + 1, 0.0);
    // Fixed chunking (independent of scheduling) keeps the result deterministic.
    const int64_t chunks = static_cast<int64_t>(partial.size());
    parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = x.numel() * c / chunks, end = x.numel() * (c + 1) / chunks;
        double total = 0.0;
        for (int64_t i = begin; i < end; ++i) total += f(to_float(p[i]));
        partial[static_cast<size_t>(c)] = total;
      }
    });
    double total = 0.0;
    for (double v : partial) total += v;
    return total;
  });
}
}  // namespace

double sum(const Tensor& x) {
  return reduce(x, [](float v) { return static_cast<double>(v); });
}

double squared_l2_norm(const Tensor& x) {
  const ProfileScope profile(StepTime::kKernels);
  if (device::on_cuda(x)) return device::squared_l2_norm(x);
  if (x.dtype() != DType::kF32) return reduce(x, [](float v) { return static_cast<double>(v) * v; });
  // fp32 fast path: 8 double lanes per block of kNormBlock values (explicit
  // lanes vectorize without reassociation flags), blocks summed in order.
  // Fixed chunking, so the result depends only on the data.
  constexpr int64_t kNormBlock = 1024;
  constexpr int kLanes = 8;
  const float* p = x.data<float>();
  const int64_t n = x.numel();
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  parallel_for(blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kNormBlock, end = std::min(n, begin + kNormBlock);
      double lanes[kLanes] = {};
      int64_t i = begin;
      for (; i + kLanes <= end; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(p[i + l]) * p[i + l];
      double total = 0.0;
      for (; i < end; ++i) total += static_cast<double>(p[i]) * p[i];
      for (double lane : lanes) total += lane;
      partial[static_cast<size_t>(b)] = total;
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

float max_abs(const Tensor& x) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("max_abs", {&x});
  return visit_dtype(x.dtype(), [&]<class T>() {
    const T* p = static_cast<const T*>(x.raw());
    float best = 0.0f;
    for (int64_t i = 0; i < x.numel(); ++i) best = std::max(best, std::fabs(to_float(p[i])));
    return best;
  });
}

bool all_finite(const Tensor& x) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("all_finite", {&x});
  return visit_dtype(x.dtype(), [&]<class T>() {
    const T* p = static_cast<const T*>(x.raw());
    bool finite = true;
    for (int64_t i = 0; i < x.numel(); ++i) finite &= std::isfinite(to_float(p[i]));
    return finite;
  });
}

void argmax_rows(const Tensor& x, std::span<int32_t> out) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("argmax_rows", {&x});
  FEDMESH_CHECK(x.rank() == 2 && static_cast<int64_t>(out.size()) == x.dim(0), "argmax_rows: shapes");
  const int64_t n = x.dim(1);
  visit_dtype(x.dtype(), [&]<class T>() {
    const T* p = x.data<T>();
    for (int64_t r = 0; r < x.dim(0); ++r) {
      int32_t best = 0;
      for (int64_t j = 1; j < n; ++j)
        if (to_float(p[r * n + j]) > to_float(p[r * n + best])) best = static_cast<int32_t>(j);
      out[static_cast<size_t>(r)] = best;
    }
  });
}

}  // namespace fedmesh
