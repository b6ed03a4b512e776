// The elementwise ops, reductions, optimizers, loss-scaling checks and
// federation updates of kernels/cuda_ops.h. Each elementwise kernel is a
// grid-stride loop doing, per element, the CPU kernel's fp32 operations in its
// order (ops_common.cuh), so its results are the CPU's bit for bit except
// where a transcendental function (tanhf, expf) or a summation order differs.
#include "kernels/cuda/cuda_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda_ops.h"

namespace fedmesh::cuda {
namespace {

// squared_l2_norm's first pass: at most this many blocks write partial sums,
// a second one-block pass adds them in order.
constexpr int kNormBlocks = 1024;

void check_count(int64_t n, const char* op) {
  FEDMESH_CHECK(n >= 0, std::string("cuda::") + op + ": negative element count " + std::to_string(n));
}

// A grid-stride kernel over n elements, n checked first.
template <class... Parameters, class... Arguments>
void launch_elementwise(const char* op, int64_t n, void (*kernel)(Parameters...), Stream stream,
                        Arguments&&... arguments) {
  check_count(n, op);
  launch(kernel, grid_for(n), kThreads, stream, std::forward<Arguments>(arguments)...);
}

// ---- elementwise ---------------------------------------------------------------

__global__ void fill_kernel(void* x, DType type, int64_t n, float value) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) store(x, type, i, value);
}

// The memory-bound elementwise ops run in 16-byte vectors
// (launch_vectorized, ops_common.cuh): out = f(in) or out = f(a, b), where
// run<W>(i) does elements i .. i + W. `out` may alias an input: each element
// is read before it is written.
template <class F>
struct UnaryMap {
  const void* in;
  DType in_type;
  void* out;
  DType out_type;
  F f;
  template <int W>
  __device__ void run(int64_t i) const {
    float v[W];
    load_n<W>(in, in_type, i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = f(v[k]);
    store_n<W>(out, out_type, i, v);
  }
};

template <class F>
struct BinaryMap {
  const void* a;
  DType a_type;
  const void* b;
  DType b_type;
  void* out;
  DType out_type;
  F f;
  template <int W>
  __device__ void run(int64_t i) const {
    float u[W], v[W];
    load_n<W>(a, a_type, i, u);
    load_n<W>(b, b_type, i, v);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = f(u[k], v[k]);
    store_n<W>(out, out_type, i, v);
  }
};

struct Identity {
  __device__ float operator()(float v) const { return v; }
};
struct Scaled {
  float factor;
  __device__ float operator()(float v) const { return __fmul_rn(v, factor); }
};
struct PlusScaled {  // (x, y) -> y + alpha * x
  float alpha;
  __device__ float operator()(float x, float y) const { return __fadd_rn(y, __fmul_rn(alpha, x)); }
};
struct Gelu {
  __device__ float operator()(float v) const { return device_gelu(v); }
};
struct GeluGrad {  // (x, dy) -> dy * gelu'(x)
  __device__ float operator()(float x, float dy) const { return device_gelu_grad(x, dy); }
};

// elementwise.cpp's sigmoid, 1 / (1 + exp(-v)): only expf may differ from
// glibc's (CUDA: 2 ulp), the other operations are the CPU's in its order.
__device__ __forceinline__ float device_sigmoid(float v) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v))); }

struct Silu {  // v * sigmoid(v)
  __device__ float operator()(float v) const { return __fmul_rn(v, device_sigmoid(v)); }
};
struct SiluGrad {  // (x, dy) -> dy * s * (1 + x * (1 - s)), s = sigmoid(x)
  __device__ float operator()(float x, float dy) const {
    const float s = device_sigmoid(x);
    return __fmul_rn(__fmul_rn(dy, s), __fadd_rn(1.0f, __fmul_rn(x, __fsub_rn(1.0f, s))));
  }
};
struct Product {
  __device__ float operator()(float a, float b) const { return __fmul_rn(a, b); }
};

__global__ void add_bias_kernel(void* y, DType type, int64_t rows, int64_t n, const float* bias) {
  const int64_t count = rows * n;
  for (int64_t i = grid_start(); i < count; i += grid_stride()) {
    store(y, type, i, __fadd_rn(load(y, type, i), bias[i % n]));
  }
}

__global__ void relu_forward_kernel(const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float v = load(x, x_type, i);
    store(y, y_type, i, v > 0.0f ? v : 0.0f);
  }
}

__global__ void relu_backward_kernel(const void* y, DType y_type, const void* dy, DType dy_type, void* dx,
                                     DType dx_type, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    store(dx, dx_type, i, load(y, y_type, i) > 0.0f ? load(dy, dy_type, i) : 0.0f);
  }
}

// ---- reductions ----------------------------------------------------------------

struct LoadTerm {  // column_sums' term for bias_grad: dy itself
  const void* dy;
  DType type;
  int64_t n;
  __device__ float2 operator()(int64_t row, int64_t column) const {
    return make_float2(load(dy, type, row * n + column), 0.0f);
  }
};

// One block per channel: its batch * positions values, summed in fp32.
__global__ void channel_sums_kernel(const void* dy, DType type, int64_t batch, int64_t channels, int64_t positions,
                                    float* db, bool accumulate) {
  __shared__ float scratch[kWarp];
  const int64_t per_channel = batch * positions;
  for (int64_t c = blockIdx.x; c < channels; c += gridDim.x) {
    float total = 0.0f;
    for (int64_t t = threadIdx.x; t < per_channel; t += blockDim.x) {
      const int64_t b = t / positions, position = t % positions;
      total = __fadd_rn(total, load(dy, type, (b * channels + c) * positions + position));
    }
    total = block_sum(total, scratch);
    if (threadIdx.x == 0) db[c] = accumulate ? __fadd_rn(db[c], total) : total;
  }
}

// Partial sums of x^2 in fp64, one per block (a fixed grid for a given n).
__global__ void squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double scratch[kWarp];
  double total = 0.0;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const double v = x[i];
    total = __dadd_rn(total, __dmul_rn(v, v));  // v * v is exact in fp64
  }
  total = block_sum(total, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void add_partials_kernel(const double* partial, int count, double* out) {
  __shared__ double scratch[kWarp];
  double total = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) total = __dadd_rn(total, partial[i]);
  total = block_sum(total, scratch);
  if (threadIdx.x == 0) *out = __dadd_rn(*out, total);
}

// ---- optimizers ----------------------------------------------------------------

__device__ __forceinline__ bool step_skipped(const int* found_inf) { return found_inf != nullptr && *found_inf != 0; }

__device__ __forceinline__ float scaled_grad(const float* grads, int64_t i, const float* grad_scale_inverse) {
  return grad_scale_inverse != nullptr ? __fmul_rn(grads[i], *grad_scale_inverse) : grads[i];
}

struct SgdParameters {
  float lr, momentum, weight_decay;
  bool nesterov;
};

__global__ void sgd_kernel(float* weights, const float* grads, float* momentum_buffer, void* compute_copy,
                           DType compute_type, int64_t n, SgdParameters p, const float* grad_scale_inverse,
                           const int* found_inf) {
  if (step_skipped(found_inf)) return;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float g = scaled_grad(grads, i, grad_scale_inverse);
    float w = weights[i];
    const float d = __fadd_rn(g, __fmul_rn(p.weight_decay, w));  // g + weight_decay * w
    if (p.momentum == 0.0f) {
      w = __fsub_rn(w, __fmul_rn(p.lr, d));
    } else {
      const float buffer = __fadd_rn(__fmul_rn(p.momentum, momentum_buffer[i]), d);
      momentum_buffer[i] = buffer;
      w = __fsub_rn(w, __fmul_rn(p.lr, p.nesterov ? __fadd_rn(d, __fmul_rn(p.momentum, buffer)) : buffer));
    }
    weights[i] = w;
    if (compute_copy != nullptr) store(compute_copy, compute_type, i, w);
  }
}

// optimizer.cpp's per-step constants, computed on the host as it does.
struct AdamWParameters {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, epsilon;
  float step_size, inv_sqrt_correction2, decay;
};

__global__ void adamw_kernel(float* weights, const float* grads, float* first_moment, float* second_moment,
                             void* compute_copy, DType compute_type, int64_t n, AdamWParameters p,
                             const float* grad_scale_inverse, const int* found_inf) {
  if (step_skipped(found_inf)) return;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float g = scaled_grad(grads, i, grad_scale_inverse);
    // m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
    const float m = __fadd_rn(__fmul_rn(p.beta1, first_moment[i]), __fmul_rn(p.one_minus_beta1, g));
    const float v = __fadd_rn(__fmul_rn(p.beta2, second_moment[i]), __fmul_rn(__fmul_rn(p.one_minus_beta2, g), g));
    first_moment[i] = m;
    second_moment[i] = v;
    // w = w * decay - step_size * m / (sqrt(v) * inv_sqrt_correction2 + epsilon)
    const float denominator = __fadd_rn(__fmul_rn(__fsqrt_rn(v), p.inv_sqrt_correction2), p.epsilon);
    const float w = __fsub_rn(__fmul_rn(weights[i], p.decay), __fdiv_rn(__fmul_rn(p.step_size, m), denominator));
    weights[i] = w;
    if (compute_copy != nullptr) store(compute_copy, compute_type, i, w);
  }
}

// ---- loss scaling --------------------------------------------------------------

__global__ void unscale_and_check_kernel(float* grads, int64_t n, float inverse_scale, int* found_inf) {
  bool finite = true;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float g = __fmul_rn(grads[i], inverse_scale);
    grads[i] = g;
    finite &= isfinite(g);
  }
  if (!finite) *found_inf = 1;  // every writer writes 1: no race on the value
}

// train/trainer.cpp's factor, in fp64 like it.
__global__ void gradient_scale_factor_kernel(const double* squared_norm, float loss_scale, float clip_grad_norm,
                                             float* factor, int* found_inf) {
  const double squared = *squared_norm;
  double f = __ddiv_rn(1.0, loss_scale);
  if (!isfinite(squared)) {
    if (found_inf != nullptr) *found_inf = 1;
  } else {
    const double norm = __ddiv_rn(__dsqrt_rn(squared), loss_scale);
    if (clip_grad_norm > 0.0f && norm > clip_grad_norm) f = __dmul_rn(f, __ddiv_rn(clip_grad_norm, norm));
  }
  *factor = static_cast<float>(f);
}

// ---- federation updates --------------------------------------------------------

__global__ void delta_kernel(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) out[i] = __fsub_rn(a[i], b[i]);
}

__global__ void weighted_accumulate_kernel(double* accumulator, const float* x, double weight, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    accumulator[i] = __dadd_rn(accumulator[i], __dmul_rn(weight, static_cast<double>(x[i])));
  }
}

}  // namespace

// ---- elementwise -----------------------------------------------------------------

void fill(Stream stream, void* x, DType x_type, int64_t n, float value) {
  launch_elementwise("fill", n, fill_kernel, stream, x, x_type, n, value);
}

void scale(Stream stream, void* x, DType x_type, int64_t n, float factor) {
  check_count(n, "scale");
  launch_vectorized(stream, UnaryMap<Scaled>{x, x_type, x, x_type, {factor}}, n, {x});
}

void axpy(Stream stream, float alpha, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  check_count(n, "axpy");
  launch_vectorized(stream, BinaryMap<PlusScaled>{x, x_type, y, y_type, y, y_type, {alpha}}, n, {x, y});
}

void cast(Stream stream, const void* src, DType src_type, void* dst, DType dst_type, int64_t n) {
  check_count(n, "cast");
  if (src_type == dst_type) {  // a copy, as convert() does (NaN payloads untouched)
    if (src != dst) copy_on_device(src, dst, static_cast<size_t>(n) * dtype_size(src_type), stream);
    return;
  }
  launch_vectorized(stream, UnaryMap<Identity>{src, src_type, dst, dst_type, {}}, n, {src, dst});
}

void add_bias(Stream stream, void* y, DType y_type, int64_t rows, int64_t n, const float* bias) {
  FEDMESH_CHECK(rows >= 0 && n > 0, "cuda::add_bias: shape (" + std::to_string(rows) + ", " + std::to_string(n) + ")");
  launch(add_bias_kernel, grid_for(rows * n), kThreads, stream, y, y_type, rows, n, bias);
}

void bias_grad(Stream stream, const void* dy, DType dy_type, int64_t rows, int64_t n, float* db, bool accumulate) {
  FEDMESH_CHECK(rows >= 0 && n > 0, "cuda::bias_grad: shape (" + std::to_string(rows) + ", " + std::to_string(n) + ")");
  column_sums(stream, LoadTerm{dy, dy_type, n}, rows, n, db, nullptr, accumulate);
}

void channel_bias_grad(Stream stream, const void* dy, DType dy_type, int64_t batch, int64_t channels, int64_t positions,
                       float* db, bool accumulate) {
  FEDMESH_CHECK(batch >= 0 && channels >= 0 && positions >= 0, "cuda::channel_bias_grad: negative shape");
  if (channels == 0) return;
  launch(channel_sums_kernel, grid_for(channels, 1), kRowThreads, stream, dy, dy_type, batch, channels, positions, db,
         accumulate);
}

void relu_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  launch_elementwise("relu_forward", n, relu_forward_kernel, stream, x, x_type, y, y_type, n);
}

void relu_backward(Stream stream, const void* y, DType y_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n) {
  launch_elementwise("relu_backward", n, relu_backward_kernel, stream, y, y_type, dy, dy_type, dx, dx_type, n);
}

void gelu_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  check_count(n, "gelu_forward");
  launch_vectorized(stream, UnaryMap<Gelu>{x, x_type, y, y_type, {}}, n, {x, y});
}

void gelu_backward(Stream stream, const void* x, DType x_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n) {
  check_count(n, "gelu_backward");
  launch_vectorized(stream, BinaryMap<GeluGrad>{x, x_type, dy, dy_type, dx, dx_type, {}}, n, {x, dy, dx});
}

void silu_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t n) {
  check_count(n, "silu_forward");
  launch_vectorized(stream, UnaryMap<Silu>{x, x_type, y, y_type, {}}, n, {x, y});
}

void silu_backward(Stream stream, const void* x, DType x_type, const void* dy, DType dy_type, void* dx, DType dx_type,
                   int64_t n) {
  check_count(n, "silu_backward");
  launch_vectorized(stream, BinaryMap<SiluGrad>{x, x_type, dy, dy_type, dx, dx_type, {}}, n, {x, dy, dx});
}

void multiply(Stream stream, const void* a, DType a_type, const float* b, void* out, DType out_type, int64_t n) {
  check_count(n, "multiply");
  launch_vectorized(stream, BinaryMap<Product>{a, a_type, b, DType::kF32, out, out_type, {}}, n, {a, b, out});
}

void squared_l2_norm(Stream stream, const float* x, int64_t n, double* out) {
  check_count(n, "squared_l2_norm");
  const unsigned blocks = std::min<unsigned>(grid_for(n), kNormBlocks);
  DeviceBuffer partial(blocks * sizeof(double), stream);
  launch(squares_partial_kernel, blocks, kThreads, stream, x, n, partial.as<double>());
  launch(add_partials_kernel, 1, kNormBlocks, stream, partial.as<const double>(), static_cast<int>(blocks), out);
}

// ---- optimizers ------------------------------------------------------------------

void sgd_step(Stream stream, float* weights, const float* grads, float* momentum, void* compute_copy,
              DType compute_type, int64_t n, float lr, const SgdOptions& options, const float* grad_scale_inverse,
              const int* found_inf) {
  FEDMESH_CHECK(options.momentum == 0.0f || momentum != nullptr, "cuda::sgd_step: momentum without a buffer");
  if (compute_copy == weights) compute_copy = nullptr;  // fp32 compute reads the master itself
  const SgdParameters parameters{lr, options.momentum, options.weight_decay, options.nesterov};
  launch_elementwise("sgd_step", n, sgd_kernel, stream, weights, grads, momentum, compute_copy, compute_type, n,
                     parameters, grad_scale_inverse, found_inf);
}

void adamw_step(Stream stream, float* weights, const float* grads, float* first_moment, float* second_moment,
                void* compute_copy, DType compute_type, int64_t n, int64_t step, float lr, const AdamWOptions& options,
                const float* grad_scale_inverse, const int* found_inf) {
  FEDMESH_CHECK(step >= 1, "cuda::adamw_step: steps count from 1, got " + std::to_string(step));
  if (compute_copy == weights) compute_copy = nullptr;
  // optimizer.cpp's expressions, evaluated on the host like there.
  const float correction1 = 1.0f - std::pow(options.beta1, static_cast<float>(step));
  const float correction2 = 1.0f - std::pow(options.beta2, static_cast<float>(step));
  const AdamWParameters parameters{.beta1 = options.beta1,
                                   .beta2 = options.beta2,
                                   .one_minus_beta1 = 1.0f - options.beta1,
                                   .one_minus_beta2 = 1.0f - options.beta2,
                                   .epsilon = options.epsilon,
                                   .step_size = lr / correction1,
                                   .inv_sqrt_correction2 = 1.0f / std::sqrt(correction2),
                                   .decay = 1.0f - lr * options.weight_decay};
  launch_elementwise("adamw_step", n, adamw_kernel, stream, weights, grads, first_moment, second_moment, compute_copy,
                     compute_type, n, parameters, grad_scale_inverse, found_inf);
}

// ---- loss scaling --------------------------------------------------------------

void unscale_and_check(Stream stream, float* grads, int64_t n, float inverse_scale, int* found_inf) {
  launch_elementwise("unscale_and_check", n, unscale_and_check_kernel, stream, grads, n, inverse_scale, found_inf);
}

void gradient_scale_factor(Stream stream, const double* squared_norm, float loss_scale, float clip_grad_norm,
                           float* factor, int* found_inf) {
  FEDMESH_CHECK(loss_scale > 0.0f, "cuda::gradient_scale_factor: loss scale " + std::to_string(loss_scale));
  launch(gradient_scale_factor_kernel, 1, 1, stream, squared_norm, loss_scale, clip_grad_norm, factor, found_inf);
}

// ---- federation updates ----------------------------------------------------------

void delta(Stream stream, const float* a, const float* b, float* out, int64_t n) {
  launch_elementwise("delta", n, delta_kernel, stream, a, b, out, n);
}

void weighted_accumulate(Stream stream, double* accumulator, const float* x, double weight, int64_t n) {
  launch_elementwise("weighted_accumulate", n, weighted_accumulate_kernel, stream, accumulator, x, weight, n);
}

}  // namespace fedmesh::cuda
