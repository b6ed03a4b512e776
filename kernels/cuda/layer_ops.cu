// Layer and group norm, softmax cross-entropy, convolution, pooling and
// embedding of kernels/cuda_ops.h. Row-wise ops run one thread block per row
// with fixed-order block reductions (fp64 where the CPU kernel sums in fp64);
// gathers and scatters run one thread per output element.
#include "kernels/cuda/cuda_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/cuda/ops_common.cuh"
#include "kernels/cuda_ops.h"

namespace fedmesh::cuda {
namespace {

constexpr int64_t kNoIndex = INT64_MAX;

// ---- layer norm ----------------------------------------------------------------

// The layer-norm arithmetic every kernel below shares, as the CPU's
// kernels/layernorm.cpp does it (explicit rounding: no FMA contraction).
__device__ __forceinline__ float normalized(float v, float mu, float rs) { return __fmul_rn(__fsub_rn(v, mu), rs); }
__device__ __forceinline__ float scaled_shifted(float xhat, float gamma, float beta) {
  return __fadd_rn(__fmul_rn(xhat, gamma), beta);
}
// rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)
__device__ __forceinline__ float input_gradient(float dxhat, float xhat, float rs, float mean_dxhat,
                                                float mean_dxhat_xhat) {
  return __fmul_rn(rs, __fsub_rn(__fsub_rn(dxhat, mean_dxhat), __fmul_rn(xhat, mean_dxhat_xhat)));
}

// One block per row. W = kVector where n is a multiple of it and the
// buffers start 16-byte aligned (every row then is too): each thread moves
// 16-byte vectors; else W = 1. The sums are fp64, in a fixed order for a
// given W and block shape.
template <int W>
__global__ void layernorm_forward_kernel(const void* x, DType x_type, const float* gamma, const float* beta, void* y,
                                         DType y_type, float* mean, float* rstd, int64_t rows, int64_t n,
                                         float epsilon) {
  __shared__ double scratch[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * n;
    double total = 0.0;
    for (int64_t j = threadIdx.x * W; j < n; j += int64_t{blockDim.x} * W) {
      float v[W];
      load_n<W>(x, x_type, base + j, v);
#pragma unroll
      for (int k = 0; k < W; ++k) total += v[k];
    }
    const double m = block_sum(total, scratch) / static_cast<double>(n);
    double variance = 0.0;
    for (int64_t j = threadIdx.x * W; j < n; j += int64_t{blockDim.x} * W) {
      float v[W];
      load_n<W>(x, x_type, base + j, v);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const double d = v[k] - m;
        variance += d * d;
      }
    }
    variance = block_sum(variance, scratch) / static_cast<double>(n);
    const float inv = static_cast<float>(1.0 / sqrt(variance + epsilon));
    const float mu = static_cast<float>(m);
    if (threadIdx.x == 0) {
      mean[row] = mu;
      rstd[row] = inv;
    }
    for (int64_t j = threadIdx.x * W; j < n; j += int64_t{blockDim.x} * W) {
      float v[W];
      load_n<W>(x, x_type, base + j, v);
#pragma unroll
      for (int k = 0; k < W; ++k) v[k] = scaled_shifted(normalized(v[k], mu, inv), gamma[j + k], beta[j + k]);
      store_n<W>(y, y_type, base + j, v);
    }
  }
}

template <int W>
__global__ void layernorm_backward_dx_kernel(const void* x, DType x_type, const void* dy, DType dy_type,
                                             const float* gamma, const float* mean, const float* rstd, void* dx,
                                             DType dx_type, int64_t rows, int64_t n) {
  __shared__ double scratch[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * n;
    const float mu = mean[row], rs = rstd[row];
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
    for (int64_t j = threadIdx.x * W; j < n; j += int64_t{blockDim.x} * W) {
      float v[W], g[W];
      load_n<W>(x, x_type, base + j, v);
      load_n<W>(dy, dy_type, base + j, g);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float xhat = normalized(v[k], mu, rs);
        const float dxhat = __fmul_rn(g[k], gamma[j + k]);
        sum_dxhat += dxhat;
        sum_dxhat_xhat += static_cast<double>(dxhat) * xhat;
      }
    }
    const float mean_dxhat = static_cast<float>(block_sum(sum_dxhat, scratch) / static_cast<double>(n));
    const float mean_dxhat_xhat = static_cast<float>(block_sum(sum_dxhat_xhat, scratch) / static_cast<double>(n));
    for (int64_t j = threadIdx.x * W; j < n; j += int64_t{blockDim.x} * W) {
      float v[W], g[W];
      load_n<W>(x, x_type, base + j, v);
      load_n<W>(dy, dy_type, base + j, g);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        g[k] = input_gradient(__fmul_rn(g[k], gamma[j + k]), normalized(v[k], mu, rs), rs, mean_dxhat,
                              mean_dxhat_xhat);
      }
      store_n<W>(dx, dx_type, base + j, g);
    }
  }
}

// The rows of a transformer (n = width, at most kWarpRowVectors * 256 and a
// multiple of kVector, 16-byte aligned buffers): one warp per row, the row
// held in registers (V vectors of kVector per lane, V = ceil(n / 256)), so x
// (and dy) are read from memory once, and the sums are warp shuffles in fp64
// (a fixed butterfly: the same bits on every run) with no block barrier.
// The block kernels above take every other shape.
inline constexpr int kWarpRowVectors = 4;
inline constexpr int kWarpRowThreads = 256;  // 8 rows per block

__device__ __forceinline__ bool lane_vector(int p, int64_t n, int64_t& j) {
  j = (int64_t{p} * kWarp + threadIdx.x % kWarp) * kVector;
  return j < n;
}

template <int V>
__global__ void __launch_bounds__(kWarpRowThreads)
    layernorm_forward_warp_kernel(const void* x, DType x_type, const float* gamma, const float* beta, void* y,
                                  DType y_type, float* mean, float* rstd, int64_t rows, int64_t n, float epsilon) {
  constexpr int kRowsPerBlock = kWarpRowThreads / kWarp;
  for (int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / kWarp; row < rows;
       row += int64_t{gridDim.x} * kRowsPerBlock) {
    const int64_t base = row * n;
    float v[V][kVector];
    double total = 0.0;
#pragma unroll
    for (int p = 0; p < V; ++p) {
      int64_t j;
      if (!lane_vector(p, n, j)) continue;
      load_n<kVector>(x, x_type, base + j, v[p]);
#pragma unroll
      for (int k = 0; k < kVector; ++k) total += v[p][k];
    }
    const double m = warp_sum(total) / static_cast<double>(n);
    double variance = 0.0;
#pragma unroll
    for (int p = 0; p < V; ++p) {
      int64_t j;
      if (!lane_vector(p, n, j)) continue;
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        const double d = v[p][k] - m;
        variance += d * d;
      }
    }
    variance = warp_sum(variance) / static_cast<double>(n);
    const float inv = static_cast<float>(1.0 / sqrt(variance + epsilon));
    const float mu = static_cast<float>(m);
    if (threadIdx.x % kWarp == 0) {
      mean[row] = mu;
      rstd[row] = inv;
    }
#pragma unroll
    for (int p = 0; p < V; ++p) {
      int64_t j;
      if (!lane_vector(p, n, j)) continue;
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        v[p][k] = scaled_shifted(normalized(v[p][k], mu, inv), gamma[j + k], beta[j + k]);
      }
      store_n<kVector>(y, y_type, base + j, v[p]);
    }
  }
}

template <int V>
__global__ void __launch_bounds__(kWarpRowThreads)
    layernorm_backward_dx_warp_kernel(const void* x, DType x_type, const void* dy, DType dy_type, const float* gamma,
                                      const float* mean, const float* rstd, void* dx, DType dx_type, int64_t rows,
                                      int64_t n) {
  constexpr int kRowsPerBlock = kWarpRowThreads / kWarp;
  for (int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / kWarp; row < rows;
       row += int64_t{gridDim.x} * kRowsPerBlock) {
    const int64_t base = row * n;
    const float mu = mean[row], rs = rstd[row];
    float xhat[V][kVector], dxhat[V][kVector];
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
#pragma unroll
    for (int p = 0; p < V; ++p) {
      int64_t j;
      if (!lane_vector(p, n, j)) continue;
      load_n<kVector>(x, x_type, base + j, xhat[p]);
      load_n<kVector>(dy, dy_type, base + j, dxhat[p]);
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        xhat[p][k] = normalized(xhat[p][k], mu, rs);
        dxhat[p][k] = __fmul_rn(dxhat[p][k], gamma[j + k]);
        sum_dxhat += dxhat[p][k];
        sum_dxhat_xhat += static_cast<double>(dxhat[p][k]) * xhat[p][k];
      }
    }
    const float mean_dxhat = static_cast<float>(warp_sum(sum_dxhat) / static_cast<double>(n));
    const float mean_dxhat_xhat = static_cast<float>(warp_sum(sum_dxhat_xhat) / static_cast<double>(n));
#pragma unroll
    for (int p = 0; p < V; ++p) {
      int64_t j;
      if (!lane_vector(p, n, j)) continue;
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        dxhat[p][k] = input_gradient(dxhat[p][k], xhat[p][k], rs, mean_dxhat, mean_dxhat_xhat);
      }
      store_n<kVector>(dx, dx_type, base + j, dxhat[p]);
    }
  }
}

// Whether the warp-per-row kernels take rows of n elements, and their V.
int warp_row_vectors(int64_t n, std::initializer_list<const void*> buffers) {
  if (n % kVector != 0 || n > int64_t{kWarpRowVectors} * kWarp * kVector || !vectorizable(buffers)) return 0;
  return static_cast<int>((n + kWarp * kVector - 1) / (kWarp * kVector));
}

// The warp kernels by V - 1.
constexpr decltype(&layernorm_forward_warp_kernel<1>) kForwardWarp[kWarpRowVectors] = {
    layernorm_forward_warp_kernel<1>, layernorm_forward_warp_kernel<2>, layernorm_forward_warp_kernel<3>,
    layernorm_forward_warp_kernel<4>};
constexpr decltype(&layernorm_backward_dx_warp_kernel<1>) kBackwardWarp[kWarpRowVectors] = {
    layernorm_backward_dx_warp_kernel<1>, layernorm_backward_dx_warp_kernel<2>, layernorm_backward_dx_warp_kernel<3>,
    layernorm_backward_dx_warp_kernel<4>};

unsigned warp_row_grid(int64_t rows) { return grid_for(rows, kWarpRowThreads / kWarp); }

// column_sums' terms for dgamma (dy * xhat) and dbeta (dy).
struct LayerNormParameterTerm {
  const void* x;
  DType x_type;
  const void* dy;
  DType dy_type;
  const float* mean;
  const float* rstd;
  int64_t n;
  __device__ float2 operator()(int64_t row, int64_t column) const {
    const int64_t i = row * n + column;
    const float gy = load(dy, dy_type, i);
    const float xhat = normalized(load(x, x_type, i), mean[row], rstd[row]);
    return make_float2(__fmul_rn(gy, xhat), gy);
  }
};

// ---- group norm ------------------------------------------------------------------

// GroupNormShape with its derived sizes, for the device (group_size() is host code).
struct GroupNormDims {
  int64_t batch, channels, positions, groups;
  int64_t per_group;  // channels per group
  int64_t size;       // values per (sample, group): per_group * positions, contiguous in memory
};

GroupNormDims groupnorm_dims(const GroupNormShape& s, const char* op) {
  FEDMESH_CHECK(s.batch > 0 && s.channels > 0 && s.positions > 0 && s.groups > 0 && s.channels % s.groups == 0,
                std::string("cuda::") + op + ": shape batch " + std::to_string(s.batch) + " channels " +
                    std::to_string(s.channels) + " positions " + std::to_string(s.positions) + " groups " +
                    std::to_string(s.groups));
  return {s.batch, s.channels, s.positions, s.groups, s.channels / s.groups, s.group_size()};
}

// W = kVector where positions is a multiple of it (then a vector never
// straddles two channels, and every group starts on a whole vector) and the
// buffers are 16-byte aligned; else 1.
bool groupnorm_vectors(const GroupNormDims& s, std::initializer_list<const void*> buffers) {
  return s.positions % kVector == 0 && vectorizable(buffers);
}

// One block per (sample, group) q, whose values are x[q * size, (q + 1) *
// size). The sum and the sum of squares are fp64 like layernorm.cpp's, but
// added in the block's order, not memory order: they may differ from the
// CPU's in their last bits (the fp32 mean and rstd then by a rounding step at
// most). Each thread reads an element before writing the same one, after
// the block's reduction, so y may alias x.
template <int W>
__global__ void groupnorm_forward_kernel(GroupNormDims s, const void* x, DType x_type, const float* gamma,
                                         const float* beta, void* y, DType y_type, float* mean, float* rstd,
                                         float epsilon) {
  __shared__ double scratch[kWarp];
  for (int64_t q = blockIdx.x; q < s.batch * s.groups; q += gridDim.x) {
    const int64_t base = q * s.size, first_channel = (q % s.groups) * s.per_group;
    double total = 0.0, squares = 0.0;
    for (int64_t k = threadIdx.x * W; k < s.size; k += int64_t{blockDim.x} * W) {
      float v[W];
      load_n<W>(x, x_type, base + k, v);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const double d = v[e];
        total += d;
        squares += d * d;  // exact in fp64 (24-bit significands)
      }
    }
    total = block_sum(total, scratch);
    squares = block_sum(squares, scratch);
    const double size = static_cast<double>(s.size);
    const double m = total / size;
    // max(0, squares / size - m²) + epsilon, rounded as the CPU does (no FMA).
    const double spread = __dsub_rn(squares / size, __dmul_rn(m, m));
    const double variance = 0.0 < spread ? spread : 0.0;  // std::max(0.0, spread), NaN included
    const float inv = static_cast<float>(1.0 / sqrt(__dadd_rn(variance, static_cast<double>(epsilon))));
    const float mu = static_cast<float>(m);
    if (threadIdx.x == 0) {
      mean[q] = mu;
      rstd[q] = inv;
    }
    for (int64_t k = threadIdx.x * W; k < s.size; k += int64_t{blockDim.x} * W) {
      const int64_t c = first_channel + k / s.positions;  // the vector's channel
      float v[W];
      load_n<W>(x, x_type, base + k, v);
#pragma unroll
      for (int e = 0; e < W; ++e) v[e] = scaled_shifted(normalized(v[e], mu, inv), gamma[c], beta[c]);
      store_n<W>(y, y_type, base + k, v);
    }
  }
}

// dgamma and dbeta need, per channel, a sum over every sample and position:
// the channel's batch * positions values (index t = sample * positions +
// position) are cut into `gridDim.y` chunks of chunk_length, a block sums one
// chunk of one channel in fp64, and groupnorm_parameter_finish_kernel adds
// the chunks in order, so the order is fixed by the shape (deterministic, no
// atomics) but is not the CPU's sample-major one. A network's group norms
// have tens to hundreds of channels over many thousand values each: one
// block per channel alone would leave most of a GPU idle.
inline constexpr int64_t kGroupNormChunkTargetBlocks = 1024;
inline constexpr int64_t kGroupNormMinChunk = 2048;  // values, 8 per thread of a block

int64_t groupnorm_parameter_chunks(const GroupNormDims& s) {
  const int64_t by_values = std::max<int64_t>(1, s.batch * s.positions / kGroupNormMinChunk);
  const int64_t by_blocks = std::max<int64_t>(1, kGroupNormChunkTargetBlocks / s.channels);
  return std::min(by_values, by_blocks);
}

// Without `partial` (one chunk) the sums go straight into dgamma and dbeta,
// each added once as fp32 like the CPU's; else to partial[chunk][c] (dgamma's)
// and partial[chunks + chunk][c] (dbeta's).
__global__ void groupnorm_parameter_kernel(GroupNormDims s, const void* x, DType x_type, const void* dy, DType dy_type,
                                           const float* mean, const float* rstd, int64_t chunk_length, float* dgamma,
                                           float* dbeta, double* partial) {
  __shared__ double scratch[kWarp];
  const int64_t per_channel = s.batch * s.positions;
  const int64_t begin = blockIdx.y * chunk_length;
  const int64_t end = per_channel < begin + chunk_length ? per_channel : begin + chunk_length;
  for (int64_t c = blockIdx.x; c < s.channels; c += gridDim.x) {
    const int64_t group = c / s.per_group;
    double scale_sum = 0.0, shift_sum = 0.0;
    for (int64_t t = begin + threadIdx.x; t < end; t += blockDim.x) {
      const int64_t sample = t / s.positions, position = t % s.positions;
      const int64_t q = sample * s.groups + group, i = (sample * s.channels + c) * s.positions + position;
      const float d = load(dy, dy_type, i);
      scale_sum += static_cast<double>(d) * normalized(load(x, x_type, i), mean[q], rstd[q]);  // exact product
      shift_sum += d;
    }
    scale_sum = block_sum(scale_sum, scratch);
    shift_sum = block_sum(shift_sum, scratch);
    if (threadIdx.x != 0) continue;
    if (partial != nullptr) {
      partial[blockIdx.y * s.channels + c] = scale_sum;
      partial[(gridDim.y + blockIdx.y) * s.channels + c] = shift_sum;
    } else {
      dgamma[c] = __fadd_rn(dgamma[c], static_cast<float>(scale_sum));
      dbeta[c] = __fadd_rn(dbeta[c], static_cast<float>(shift_sum));
    }
  }
}

__global__ void groupnorm_parameter_finish_kernel(const double* partial, int64_t chunks, int64_t channels,
                                                  float* dgamma, float* dbeta) {
  for (int64_t c = grid_start(); c < channels; c += grid_stride()) {
    double scale_sum = 0.0, shift_sum = 0.0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      scale_sum += partial[chunk * channels + c];
      shift_sum += partial[(chunks + chunk) * channels + c];
    }
    dgamma[c] = __fadd_rn(dgamma[c], static_cast<float>(scale_sum));
    dbeta[c] = __fadd_rn(dbeta[c], static_cast<float>(shift_sum));
  }
}

// One block per (sample, group): mean(d) and mean(d x̂) in fp64 (block order,
// not memory order), then dx = rstd * float(d - mean(d) - x̂ mean(d x̂)), d =
// dy * gamma[c] in fp64 (exact), every step rounded as layernorm.cpp rounds
// it (no FMA). Each thread reads an element before writing the same one,
// after the block's reduction, so dx may alias dy (the parameter sums, which
// also read dy, are enqueued before this kernel).
template <int W>
__global__ void groupnorm_backward_dx_kernel(GroupNormDims s, const void* x, DType x_type, const void* dy,
                                             DType dy_type, const float* gamma, const float* mean, const float* rstd,
                                             void* dx, DType dx_type) {
  __shared__ double scratch[kWarp];
  for (int64_t q = blockIdx.x; q < s.batch * s.groups; q += gridDim.x) {
    const int64_t base = q * s.size, first_channel = (q % s.groups) * s.per_group;
    const float mu = mean[q], rs = rstd[q];
    double sum_d = 0.0, sum_d_xhat = 0.0;
    for (int64_t k = threadIdx.x * W; k < s.size; k += int64_t{blockDim.x} * W) {
      const float g = gamma[first_channel + k / s.positions];
      float v[W], grad[W];
      load_n<W>(x, x_type, base + k, v);
      load_n<W>(dy, dy_type, base + k, grad);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const double d = static_cast<double>(grad[e]) * g;
        sum_d = __dadd_rn(sum_d, d);
        sum_d_xhat = __dadd_rn(sum_d_xhat, __dmul_rn(d, normalized(v[e], mu, rs)));
      }
    }
    const double size = static_cast<double>(s.size);
    const double mean_d = block_sum(sum_d, scratch) / size;
    const double mean_d_xhat = block_sum(sum_d_xhat, scratch) / size;
    for (int64_t k = threadIdx.x * W; k < s.size; k += int64_t{blockDim.x} * W) {
      const float g = gamma[first_channel + k / s.positions];
      float v[W], grad[W];
      load_n<W>(x, x_type, base + k, v);
      load_n<W>(dy, dy_type, base + k, grad);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const double d = static_cast<double>(grad[e]) * g;
        const double inner = __dsub_rn(__dsub_rn(d, mean_d), __dmul_rn(normalized(v[e], mu, rs), mean_d_xhat));
        grad[e] = __fmul_rn(rs, static_cast<float>(inner));
      }
      store_n<W>(dx, dx_type, base + k, grad);
    }
  }
}

// ---- softmax cross-entropy -----------------------------------------------------

// The larger value, the lower index on ties: with each thread's strict
// `v > best` scan in index order, the block finds the first maximum.
__device__ __forceinline__ void take_better(float& value, int64_t& index, float other_value, int64_t other_index) {
  if (other_value > value || (other_value == value && other_index < index)) {
    value = other_value;
    index = other_index;
  }
}

// (value, index) of the block's maximum, to every thread.
__device__ void block_argmax(float& value, int64_t& index, float* values, int64_t* indices) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    take_better(value, index, __shfl_xor_sync(kFullMask, value, offset), __shfl_xor_sync(kFullMask, index, offset));
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  if (lane == 0) {
    values[warp] = value;
    indices[warp] = index;
  }
  __syncthreads();
  value = -INFINITY;
  index = kNoIndex;
  for (int w = 0; w < warps; ++w) take_better(value, index, values[w], indices[w]);
  __syncthreads();
}

// One block per row, two passes over it. The first keeps, per thread, the
// running maximum (and its first index) and the sum of exp(v - maximum),
// rescaled when the maximum grows (the online softmax), so a row is read
// once for both; the block then rescales every thread's sum to the row's
// maximum and adds them in fp64. The second writes the gradients. exp is
// fp32 (expf, 2 ulp): the fp64 exp the CPU kernel uses made this the third
// most expensive kernel of a GPT-2 step (50 257 classes). The bounds this
// costs are stated with the test (tests/kernels/test_cuda_ops.cpp).
__global__ void cross_entropy_kernel(const void* logits, DType logits_type, const int32_t* labels, int64_t rows,
                                     int64_t classes, void* dlogits, DType dlogits_type, float grad_factor,
                                     double* loss_sum, unsigned long long* correct) {
  __shared__ double sums[kWarp];
  __shared__ float values[kWarp];
  __shared__ int64_t indices[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * classes;
    float max_value = -INFINITY, sum = 0.0f;
    int64_t argmax = kNoIndex;
    for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) {
      const float v = load(logits, logits_type, base + j);
      if (v > max_value) {
        // The old terms scaled to the new maximum (0 while it was -Inf).
        sum = max_value == -INFINITY ? 0.0f : __fmul_rn(sum, expf(__fsub_rn(max_value, v)));
        sum = __fadd_rn(sum, 1.0f);
        max_value = v;
        argmax = j;
      } else if (max_value != -INFINITY) {
        sum = __fadd_rn(sum, expf(__fsub_rn(v, max_value)));
      }
    }
    const float thread_max = max_value;
    block_argmax(max_value, argmax, values, indices);
    if (argmax == kNoIndex) argmax = 0;  // nothing above -Inf: the CPU keeps index 0
    const double scaled =
        thread_max == -INFINITY ? 0.0 : static_cast<double>(sum) * exp(static_cast<double>(thread_max - max_value));
    const double log_denominator = log(block_sum(scaled, sums));
    const float shift = static_cast<float>(static_cast<double>(max_value) + log_denominator);  // v - shift = log p
    const int32_t label = labels[row];
    const bool valid = label >= 0 && label < classes;
    if (threadIdx.x == 0) {
      if (loss_sum != nullptr) {
        const double loss =
            valid ? log_denominator - static_cast<double>(__fsub_rn(load(logits, logits_type, base + label), max_value))
                  : static_cast<double>(NAN);
        atomicAdd(loss_sum, loss);
      }
      if (correct != nullptr && valid && argmax == label) atomicAdd(correct, 1ull);
    }
    if (dlogits == nullptr) continue;
    for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) {
      const float p = expf(__fsub_rn(load(logits, logits_type, base + j), shift));
      const float g = __fmul_rn(j == label ? __fsub_rn(p, 1.0f) : p, grad_factor);
      store(dlogits, dlogits_type, base + j, valid ? g : NAN);
    }
  }
}

// ---- convolution -----------------------------------------------------------------

struct ConvShape {  // Conv2dGeometry with its derived sizes, for the device
  int64_t batch, channels, height, width, out_channels, kernel, stride, padding;
  int64_t out_height, out_width, plane, columns;
};

ConvShape conv_shape(const Conv2dGeometry& g) {
  FEDMESH_CHECK(g.batch >= 0 && g.in_channels > 0 && g.height > 0 && g.width > 0 && g.out_channels > 0 &&
                    g.kernel > 0 && g.stride > 0 && g.padding >= 0 && g.out_height() > 0 && g.out_width() > 0,
                "cuda conv2d: bad geometry");
  return {g.batch,
          g.in_channels,
          g.height,
          g.width,
          g.out_channels,
          g.kernel,
          g.stride,
          g.padding,
          g.out_height(),
          g.out_width(),
          g.out_height() * g.out_width(),
          g.columns()};
}

// col[r, column] for r = (channel, ki, kj), column = (image, i, j).
__global__ void im2col_kernel(ConvShape s, const void* x, DType x_type, float* col) {
  const int64_t count = s.channels * s.kernel * s.kernel * s.columns;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t r = index / s.columns, column = index % s.columns;
    const int64_t c = r / (s.kernel * s.kernel), ki = (r / s.kernel) % s.kernel, kj = r % s.kernel;
    const int64_t image = column / s.plane, i = (column % s.plane) / s.out_width, j = column % s.out_width;
    const int64_t hi = i * s.stride - s.padding + ki, wi = j * s.stride - s.padding + kj;
    const bool inside = hi >= 0 && hi < s.height && wi >= 0 && wi < s.width;
    col[index] = inside ? load(x, x_type, ((image * s.channels + c) * s.height + hi) * s.width + wi) : 0.0f;
  }
}

// One thread per input pixel gathers the column entries that read it, in
// (ki, kj) order: the order conv.cpp's col2im adds them in, from 0.
__global__ void col2im_kernel(ConvShape s, const float* dcol, void* dx, DType dx_type) {
  const int64_t count = s.batch * s.channels * s.height * s.width;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t wi = index % s.width, hi = (index / s.width) % s.height;
    const int64_t c = (index / (s.width * s.height)) % s.channels, image = index / (s.width * s.height * s.channels);
    float total = 0.0f;
    for (int64_t ki = 0; ki < s.kernel; ++ki) {
      const int64_t ti = hi + s.padding - ki;  // = i * stride
      if (ti < 0 || ti % s.stride != 0 || ti / s.stride >= s.out_height) continue;
      const int64_t i = ti / s.stride;
      for (int64_t kj = 0; kj < s.kernel; ++kj) {
        const int64_t tj = wi + s.padding - kj;
        if (tj < 0 || tj % s.stride != 0 || tj / s.stride >= s.out_width) continue;
        const int64_t r = (c * s.kernel + ki) * s.kernel + kj;
        total = __fadd_rn(total, dcol[r * s.columns + image * s.plane + i * s.out_width + tj / s.stride]);
      }
    }
    store(dx, dx_type, index, total);
  }
}

// y[image, oc, p] = product[oc, image * plane + p] + bias[oc].
__global__ void product_to_output_kernel(ConvShape s, const float* product, const float* bias, void* y, DType y_type) {
  const int64_t count = s.batch * s.out_channels * s.plane;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t p = index % s.plane, oc = (index / s.plane) % s.out_channels,
                  image = index / (s.plane * s.out_channels);
    store(y, y_type, index, __fadd_rn(product[oc * s.columns + image * s.plane + p], bias[oc]));
  }
}

// dy_t[oc, image * plane + p] = dy[image, oc, p], fp32.
__global__ void output_to_product_kernel(ConvShape s, const void* dy, DType dy_type, float* dy_t) {
  const int64_t count = s.batch * s.out_channels * s.plane;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t p = index % s.plane, oc = (index / s.plane) % s.out_channels,
                  image = index / (s.plane * s.out_channels);
    dy_t[oc * s.columns + image * s.plane + p] = load(dy, dy_type, index);
  }
}

// The weight as fp32: itself, or a widened copy held in `scratch`.
const float* weight_as_f32(Stream stream, const void* weight, DType weight_type, int64_t count, DeviceBuffer& scratch) {
  if (weight_type == DType::kF32) return static_cast<const float*>(weight);
  scratch = DeviceBuffer(static_cast<size_t>(count) * sizeof(float), stream);
  cast(stream, weight, weight_type, scratch.data(), DType::kF32, count);
  return scratch.as<const float>();
}

// ---- pooling ---------------------------------------------------------------------

struct PoolShape {
  int64_t planes, height, width, kernel, stride, out_height, out_width;
};

PoolShape pool_shape(const Pool2dGeometry& g, const char* op) {
  FEDMESH_CHECK(
      g.batch >= 0 && g.channels >= 0 && g.kernel > 0 && g.stride > 0 && g.height >= g.kernel && g.width >= g.kernel,
      std::string("cuda::") + op + ": bad geometry");
  return {g.batch * g.channels, g.height, g.width, g.kernel, g.stride, g.out_height(), g.out_width()};
}

__global__ void maxpool_forward_kernel(PoolShape s, const void* x, DType x_type, void* y, DType y_type,
                                       int32_t* argmax) {
  const int64_t out_plane = s.out_height * s.out_width, count = s.planes * out_plane;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t plane = index / out_plane, i = (index % out_plane) / s.out_width, j = index % s.out_width;
    const int64_t base = plane * s.height * s.width;
    float best = -INFINITY;
    int64_t best_index = (i * s.stride) * s.width + j * s.stride;
    for (int64_t ki = 0; ki < s.kernel; ++ki) {
      for (int64_t kj = 0; kj < s.kernel; ++kj) {
        const int64_t at = (i * s.stride + ki) * s.width + j * s.stride + kj;
        const float v = load(x, x_type, base + at);
        if (v > best) {
          best = v;
          best_index = at;
        }
      }
    }
    store(y, y_type, index, best);
    argmax[index] = static_cast<int32_t>(best_index);
  }
}

// One thread per input pixel adds, in output order, the gradients of the
// outputs whose window covers it and chose it: conv.cpp's order.
__global__ void maxpool_backward_kernel(PoolShape s, const int32_t* argmax, const void* dy, DType dy_type, void* dx,
                                        DType dx_type) {
  const int64_t in_plane = s.height * s.width, out_plane = s.out_height * s.out_width, count = s.planes * in_plane;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t plane = index / in_plane, at = index % in_plane, h = at / s.width, w = at % s.width;
    // Outputs i with i * stride <= h <= i * stride + kernel - 1.
    const int64_t i0 = h - s.kernel + 1 <= 0 ? 0 : (h - s.kernel + s.stride) / s.stride;
    const int64_t i1 = min(s.out_height - 1, h / s.stride);
    const int64_t j0 = w - s.kernel + 1 <= 0 ? 0 : (w - s.kernel + s.stride) / s.stride;
    const int64_t j1 = min(s.out_width - 1, w / s.stride);
    float total = 0.0f;
    for (int64_t i = i0; i <= i1; ++i) {
      for (int64_t j = j0; j <= j1; ++j) {
        const int64_t out = plane * out_plane + i * s.out_width + j;
        if (argmax[out] == at) total = __fadd_rn(total, load(dy, dy_type, out));
      }
    }
    store(dx, dx_type, index, total);
  }
}

// conv.cpp's average pooling, bit for bit: each window's fp32 sum in
// row-major order, times scale = 1 / kernel² (computed on the host as there).
__global__ void avgpool_forward_kernel(PoolShape s, float scale, const void* x, DType x_type, void* y, DType y_type) {
  const int64_t out_plane = s.out_height * s.out_width, count = s.planes * out_plane;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t plane = index / out_plane, i = (index % out_plane) / s.out_width, j = index % s.out_width;
    const int64_t corner = plane * s.height * s.width + (i * s.stride) * s.width + j * s.stride;
    float total = 0.0f;
    for (int64_t a = 0; a < s.kernel; ++a) {
      for (int64_t b = 0; b < s.kernel; ++b) total = __fadd_rn(total, load(x, x_type, corner + a * s.width + b));
    }
    store(y, y_type, index, __fmul_rn(total, scale));
  }
}

// One thread per input pixel adds dy * scale of the windows holding it, in
// row-major window order: conv.cpp's gather, so the sums match bit for bit
// (a scatter from the outputs would add overlapping windows in no fixed
// order). A pixel that no window holds (stride > kernel) gets 0.
__global__ void avgpool_backward_kernel(PoolShape s, float scale, const void* dy, DType dy_type, void* dx,
                                        DType dx_type) {
  const int64_t in_plane = s.height * s.width, out_plane = s.out_height * s.out_width, count = s.planes * in_plane;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    const int64_t plane = index / in_plane, r = (index % in_plane) / s.width, c = index % s.width;
    // Windows i with i * stride <= r < i * stride + kernel (and j alike for c).
    const int64_t i0 = r < s.kernel ? 0 : (r - s.kernel) / s.stride + 1, i1 = min(s.out_height - 1, r / s.stride);
    const int64_t j0 = c < s.kernel ? 0 : (c - s.kernel) / s.stride + 1, j1 = min(s.out_width - 1, c / s.stride);
    float total = 0.0f;
    for (int64_t i = i0; i <= i1; ++i) {
      for (int64_t j = j0; j <= j1; ++j) {
        total = __fadd_rn(total, __fmul_rn(load(dy, dy_type, plane * out_plane + i * s.out_width + j), scale));
      }
    }
    store(dx, dx_type, index, total);
  }
}

// One warp per plane: global pooling reduces a CNN's last feature maps, many
// planes of a few dozen values, where a block per plane would idle most of
// its threads. The fp64 sum is a fixed warp butterfly (the same bits on every
// run), in another order than the CPU's memory order.
inline constexpr int kPlaneMeanThreads = 256;  // 8 planes per block

__global__ void __launch_bounds__(kPlaneMeanThreads)
    plane_mean_forward_kernel(const void* x, DType x_type, void* y, DType y_type, int64_t planes, int64_t area) {
  constexpr int kPlanesPerBlock = kPlaneMeanThreads / kWarp;
  const int lane = threadIdx.x % kWarp;
  for (int64_t plane = blockIdx.x * int64_t{kPlanesPerBlock} + threadIdx.x / kWarp; plane < planes;
       plane += int64_t{gridDim.x} * kPlanesPerBlock) {
    double total = 0.0;
    for (int64_t k = lane; k < area; k += kWarp) total += load(x, x_type, plane * area + k);
    total = warp_sum(total);
    if (lane == 0) store(y, y_type, plane, static_cast<float>(total / static_cast<double>(area)));
  }
}

// dx[plane, k] = dy[plane] / area in fp32, area_f = float(area) as the CPU rounds it.
__global__ void plane_mean_backward_kernel(const void* dy, DType dy_type, void* dx, DType dx_type, int64_t planes,
                                           int64_t area, float area_f) {
  const int64_t count = planes * area;
  for (int64_t index = grid_start(); index < count; index += grid_stride()) {
    store(dx, dx_type, index, __fdiv_rn(load(dy, dy_type, index / area), area_f));
  }
}

// ---- embedding -------------------------------------------------------------------

__global__ void embedding_forward_kernel(const void* table, DType table_type, int64_t vocabulary, int64_t dim,
                                         const int32_t* ids, int64_t count, void* out, DType out_type) {
  const int64_t total = count * dim;
  for (int64_t index = grid_start(); index < total; index += grid_stride()) {
    const int64_t id = ids[index / dim], j = index % dim;
    const bool valid = id >= 0 && id < vocabulary;
    store(out, out_type, index, valid ? load(table, table_type, id * dim + j) : NAN);
  }
}

__global__ void embedding_backward_kernel(const int32_t* ids, int64_t count, const void* dout, DType dout_type,
                                          float* dtable, int64_t vocabulary, int64_t dim) {
  const int64_t total = count * dim;
  for (int64_t index = grid_start(); index < total; index += grid_stride()) {
    const int64_t id = ids[index / dim];
    if (id >= 0 && id < vocabulary) atomicAdd(dtable + id * dim + index % dim, load(dout, dout_type, index));
  }
}

}  // namespace

// ---- layer norm --------------------------------------------------------------------

void layernorm_forward(Stream stream, const void* x, DType x_type, const float* gamma, const float* beta, void* y,
                       DType y_type, float* mean, float* rstd, int64_t rows, int64_t n, float epsilon) {
  FEDMESH_CHECK(rows >= 0 && n > 0,
                "cuda::layernorm_forward: shape (" + std::to_string(rows) + ", " + std::to_string(n) + ")");
  if (rows == 0) return;
  if (const int v = warp_row_vectors(n, {x, y}); v > 0) {
    launch(kForwardWarp[v - 1], warp_row_grid(rows), kWarpRowThreads, stream, x, x_type, gamma, beta, y,
           y_type, mean, rstd, rows, n, epsilon);
    return;
  }
  const auto kernel = n % kVector == 0 && vectorizable({x, y}) ? layernorm_forward_kernel<kVector>
                                                                : layernorm_forward_kernel<1>;
  launch(kernel, grid_for(rows, 1), kRowThreads, stream, x, x_type, gamma, beta, y, y_type, mean, rstd, rows, n,
         epsilon);
}

void layernorm_backward(Stream stream, const void* x, DType x_type, const void* dy, DType dy_type, const float* gamma,
                        const float* mean, const float* rstd, void* dx, DType dx_type, float* dgamma, float* dbeta,
                        int64_t rows, int64_t n) {
  FEDMESH_CHECK(rows >= 0 && n > 0,
                "cuda::layernorm_backward: shape (" + std::to_string(rows) + ", " + std::to_string(n) + ")");
  if (rows == 0) return;
  if (const int v = warp_row_vectors(n, {x, dy, dx}); v > 0) {
    launch(kBackwardWarp[v - 1], warp_row_grid(rows), kWarpRowThreads, stream, x, x_type, dy, dy_type, gamma,
           mean, rstd, dx, dx_type, rows, n);
  } else {
    const auto kernel = n % kVector == 0 && vectorizable({x, dy, dx}) ? layernorm_backward_dx_kernel<kVector>
                                                                       : layernorm_backward_dx_kernel<1>;
    launch(kernel, grid_for(rows, 1), kRowThreads, stream, x, x_type, dy, dy_type, gamma, mean, rstd, dx, dx_type,
           rows, n);
  }
  column_sums(stream, LayerNormParameterTerm{x, x_type, dy, dy_type, mean, rstd, n}, rows, n, dgamma, dbeta,
              /*accumulate=*/true);
}

// ---- group norm -----------------------------------------------------------------------

void groupnorm_forward(Stream stream, const GroupNormShape& shape, const void* x, DType x_type, const float* gamma,
                       const float* beta, void* y, DType y_type, float* mean, float* rstd, float epsilon) {
  const GroupNormDims s = groupnorm_dims(shape, "groupnorm_forward");
  const auto kernel = groupnorm_vectors(s, {x, y}) ? groupnorm_forward_kernel<kVector> : groupnorm_forward_kernel<1>;
  launch(kernel, grid_for(s.batch * s.groups, 1), kRowThreads, stream, s, x, x_type, gamma, beta, y, y_type, mean, rstd,
         epsilon);
}

void groupnorm_backward(Stream stream, const GroupNormShape& shape, const void* x, DType x_type, const void* dy,
                        DType dy_type, const float* gamma, const float* mean, const float* rstd, void* dx,
                        DType dx_type, float* dgamma, float* dbeta) {
  const GroupNormDims s = groupnorm_dims(shape, "groupnorm_backward");
  // dgamma and dbeta first: they read dy, which dx may overwrite.
  const int64_t chunks = groupnorm_parameter_chunks(s), per_channel = s.batch * s.positions;
  const int64_t chunk_length = (per_channel + chunks - 1) / chunks;
  const dim3 grid(grid_for(s.channels, 1), static_cast<unsigned>(chunks));
  if (chunks == 1) {
    launch(groupnorm_parameter_kernel, grid, kRowThreads, stream, s, x, x_type, dy, dy_type, mean, rstd, chunk_length,
           dgamma, dbeta, static_cast<double*>(nullptr));
  } else {
    DeviceBuffer partial(static_cast<size_t>(2 * chunks * s.channels) * sizeof(double), stream);
    launch(groupnorm_parameter_kernel, grid, kRowThreads, stream, s, x, x_type, dy, dy_type, mean, rstd, chunk_length,
           dgamma, dbeta, partial.as<double>());
    launch(groupnorm_parameter_finish_kernel, grid_for(s.channels), kThreads, stream, partial.as<const double>(),
           chunks, s.channels, dgamma, dbeta);
  }
  if (dx == nullptr) return;
  const auto kernel =
      groupnorm_vectors(s, {x, dy, dx}) ? groupnorm_backward_dx_kernel<kVector> : groupnorm_backward_dx_kernel<1>;
  launch(kernel, grid_for(s.batch * s.groups, 1), kRowThreads, stream, s, x, x_type, dy, dy_type, gamma, mean, rstd, dx,
         dx_type);
}

// ---- softmax cross-entropy -----------------------------------------------------------

void softmax_cross_entropy(Stream stream, const void* logits, DType logits_type, const int32_t* labels, int64_t rows,
                           int64_t classes, void* dlogits, DType dlogits_type, float grad_scale, float normalizer,
                           double* loss_sum, int64_t* correct) {
  FEDMESH_CHECK(rows >= 0 && classes > 0,
                "cuda::softmax_cross_entropy: shape (" + std::to_string(rows) + ", " + std::to_string(classes) + ")");
  if (rows == 0) return;
  const float grad_factor = grad_scale / normalizer;  // as loss.cpp computes it
  static_assert(sizeof(int64_t) == sizeof(unsigned long long));
  launch(cross_entropy_kernel, grid_for(rows, 1), kRowThreads, stream, logits, logits_type, labels, rows, classes,
         dlogits, dlogits_type, grad_factor, loss_sum, reinterpret_cast<unsigned long long*>(correct));
}

// ---- convolution and pooling -----------------------------------------------------------

void im2col(Stream stream, const Conv2dGeometry& g, const void* x, DType x_type, float* col) {
  const ConvShape s = conv_shape(g);
  launch(im2col_kernel, grid_for(g.patch_size() * s.columns), kThreads, stream, s, x, x_type, col);
}

void col2im(Stream stream, const Conv2dGeometry& g, const float* dcol, void* dx, DType dx_type) {
  const ConvShape s = conv_shape(g);
  launch(col2im_kernel, grid_for(s.batch * s.channels * s.height * s.width), kThreads, stream, s, dcol, dx, dx_type);
}

void conv2d_forward(Stream stream, const Conv2dGeometry& g, const void* x, DType x_type, const void* weight,
                    DType weight_type, const float* bias, void* y, DType y_type, float* col) {
  const ConvShape s = conv_shape(g);
  const int64_t patch = g.patch_size();
  if (s.columns == 0) return;
  im2col(stream, g, x, x_type, col);
  DeviceBuffer weight_scratch;
  const float* w = weight_as_f32(stream, weight, weight_type, s.out_channels * patch, weight_scratch);
  // product (out_channels, columns) = weight (out_channels, patch) · col (patch, columns)
  DeviceBuffer product(static_cast<size_t>(s.out_channels * s.columns) * sizeof(float), stream);
  gemm(stream, false, false, s.out_channels, s.columns, patch, 1.0f, w, DType::kF32, patch, col, DType::kF32, s.columns,
       0.0f, product.data(), DType::kF32, s.columns);
  launch(product_to_output_kernel, grid_for(s.out_channels * s.columns), kThreads, stream, s, product.as<const float>(),
         bias, y, y_type);
}

void conv2d_backward(Stream stream, const Conv2dGeometry& g, const float* col, const void* weight, DType weight_type,
                     const void* dy, DType dy_type, float* dweight, float* dbias, void* dx, DType dx_type) {
  const ConvShape s = conv_shape(g);
  const int64_t patch = g.patch_size();
  if (s.columns == 0) return;
  // dy (batch, out_channels, plane) -> dy_t (out_channels, columns), fp32.
  DeviceBuffer dy_t(static_cast<size_t>(s.out_channels * s.columns) * sizeof(float), stream);
  launch(output_to_product_kernel, grid_for(s.out_channels * s.columns), kThreads, stream, s, dy, dy_type,
         dy_t.as<float>());
  channel_bias_grad(stream, dy, dy_type, s.batch, s.out_channels, s.plane, dbias, /*accumulate=*/true);
  // dweight (out_channels, patch) += dy_t · col^T
  gemm(stream, false, true, s.out_channels, patch, s.columns, 1.0f, dy_t.data(), DType::kF32, s.columns, col,
       DType::kF32, s.columns, 1.0f, dweight, DType::kF32, patch);
  if (dx == nullptr) return;
  DeviceBuffer weight_scratch;
  const float* w = weight_as_f32(stream, weight, weight_type, s.out_channels * patch, weight_scratch);
  // dcol (patch, columns) = weight^T · dy_t
  DeviceBuffer dcol(static_cast<size_t>(patch * s.columns) * sizeof(float), stream);
  gemm(stream, true, false, patch, s.columns, s.out_channels, 1.0f, w, DType::kF32, patch, dy_t.data(), DType::kF32,
       s.columns, 0.0f, dcol.data(), DType::kF32, s.columns);
  col2im(stream, g, dcol.as<const float>(), dx, dx_type);
}

void maxpool2d_forward(Stream stream, const Pool2dGeometry& g, const void* x, DType x_type, void* y, DType y_type,
                       int32_t* argmax) {
  const PoolShape s = pool_shape(g, "maxpool2d_forward");
  launch(maxpool_forward_kernel, grid_for(s.planes * s.out_height * s.out_width), kThreads, stream, s, x, x_type, y,
         y_type, argmax);
}

void maxpool2d_backward(Stream stream, const Pool2dGeometry& g, const int32_t* argmax, const void* dy, DType dy_type,
                        void* dx, DType dx_type) {
  const PoolShape s = pool_shape(g, "maxpool2d_backward");
  launch(maxpool_backward_kernel, grid_for(s.planes * s.height * s.width), kThreads, stream, s, argmax, dy, dy_type, dx,
         dx_type);
}

// conv.cpp's 1 / kernel², rounded as it rounds it.
float average_scale(const PoolShape& s) { return 1.0f / static_cast<float>(s.kernel * s.kernel); }

void avgpool2d_forward(Stream stream, const Pool2dGeometry& g, const void* x, DType x_type, void* y, DType y_type) {
  const PoolShape s = pool_shape(g, "avgpool2d_forward");
  launch(avgpool_forward_kernel, grid_for(s.planes * s.out_height * s.out_width), kThreads, stream, s, average_scale(s),
         x, x_type, y, y_type);
}

void avgpool2d_backward(Stream stream, const Pool2dGeometry& g, const void* dy, DType dy_type, void* dx,
                        DType dx_type) {
  const PoolShape s = pool_shape(g, "avgpool2d_backward");
  launch(avgpool_backward_kernel, grid_for(s.planes * s.height * s.width), kThreads, stream, s, average_scale(s), dy,
         dy_type, dx, dx_type);
}

void plane_mean_forward(Stream stream, const void* x, DType x_type, void* y, DType y_type, int64_t planes,
                        int64_t area) {
  FEDMESH_CHECK(planes >= 0 && area >= 0,
                "cuda::plane_mean_forward: shape (" + std::to_string(planes) + ", " + std::to_string(area) + ")");
  if (planes == 0) return;
  launch(plane_mean_forward_kernel, grid_for(planes, kPlaneMeanThreads / kWarp), kPlaneMeanThreads, stream, x, x_type,
         y, y_type, planes, area);
}

void plane_mean_backward(Stream stream, const void* dy, DType dy_type, void* dx, DType dx_type, int64_t planes,
                         int64_t area) {
  FEDMESH_CHECK(planes >= 0 && area >= 0,
                "cuda::plane_mean_backward: shape (" + std::to_string(planes) + ", " + std::to_string(area) + ")");
  launch(plane_mean_backward_kernel, grid_for(planes * area), kThreads, stream, dy, dy_type, dx, dx_type, planes, area,
         static_cast<float>(area));
}

// ---- embedding -------------------------------------------------------------------------

void embedding_forward(Stream stream, const void* table, DType table_type, int64_t vocabulary, int64_t dim,
                       const int32_t* ids, int64_t count, void* out, DType out_type) {
  FEDMESH_CHECK(vocabulary >= 0 && dim > 0 && count >= 0, "cuda::embedding_forward: bad shape");
  launch(embedding_forward_kernel, grid_for(count * dim), kThreads, stream, table, table_type, vocabulary, dim, ids,
         count, out, out_type);
}

void embedding_backward(Stream stream, const int32_t* ids, int64_t count, const void* dout, DType dout_type,
                        float* dtable, int64_t vocabulary, int64_t dim) {
  FEDMESH_CHECK(vocabulary >= 0 && dim > 0 && count >= 0, "cuda::embedding_backward: bad shape");
  launch(embedding_backward_kernel, grid_for(count * dim), kThreads, stream, ids, count, dout, dout_type, dtable,
         vocabulary, dim);
}

}  // namespace fedmesh::cuda
