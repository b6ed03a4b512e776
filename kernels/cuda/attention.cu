// Causal multi-head self-attention on the device (kernels/cuda_ops.h):
// kernels/attention.h's semantics with its memory bound, O(seq) saved per
// head. One warp per query row: the forward pass walks the row's keys once
// with an online softmax (running max and sum, flash attention's recurrence)
// and keeps only the output and the row's log-sum-exp; the backward pass
// recomputes each probability from the scores and that log-sum-exp, writes
// the row's dq itself and adds its share of dk and dv into fp32 accumulators
// by atomicAdd (so their last bits may depend on the order rows finish).
//
// A lane holds head_dim / 32 of the row's coordinates (head_dim <= 128), and
// a score is a warp sum. Simple rather than fast: no tiling through shared
// memory, every key read from global memory by every row that sees it.
#include <cmath>
#include <string>

#include "kernels/cuda/ops_common.cuh"

namespace fedmesh::cuda {
namespace {

inline constexpr int kRowsPerBlock = 4;         // warps per block, one query row each
inline constexpr int kMaxDimsPerLane = 4;       // head_dim <= 128
inline constexpr int64_t kMaxHeadDim = kWarp * kMaxDimsPerLane;

struct RowAt {
  int64_t width, stride;  // heads * head_dim, and 3 * width: qkv's row length
  int64_t q, k0, v0;      // qkv offsets of this row's q, and of key 0's k and v (same head)
  int64_t out;            // out / dout offset of this row's head slice
};

__device__ __forceinline__ RowAt row_at(const AttentionShape& s, int64_t b, int64_t h, int64_t t) {
  RowAt at;
  at.width = s.heads * s.head_dim;
  at.stride = 3 * at.width;
  at.q = (b * s.seq + t) * at.stride + h * s.head_dim;
  at.k0 = b * s.seq * at.stride + at.width + h * s.head_dim;
  at.v0 = at.k0 + at.width;
  at.out = (b * s.seq + t) * at.width + h * s.head_dim;
  return at;
}

// This lane's coordinates c = lane + 32 i of a head slice starting at `offset`.
__device__ __forceinline__ void load_lane(const void* p, DType type, int64_t offset, int64_t head_dim, int lane,
                                          float (&values)[kMaxDimsPerLane]) {
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int64_t c = lane + kWarp * i;
    values[i] = c < head_dim ? load(p, type, offset + c) : 0.0f;
  }
}

// The warp's dot product of the lane-held `x` with the head slice at `offset`.
__device__ __forceinline__ float warp_dot(const float (&x)[kMaxDimsPerLane], const void* p, DType type, int64_t offset,
                                          int64_t head_dim, int lane) {
  float partial = 0.0f;
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int64_t c = lane + kWarp * i;
    if (c < head_dim) partial += x[i] * load(p, type, offset + c);
  }
  return warp_sum(partial);
}

__global__ void attention_forward_kernel(AttentionShape s, const void* qkv, DType qkv_type, void* out, DType out_type,
                                         float* log_sum_exp, float scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / kWarp;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (t >= s.seq) return;  // uniform over the warp
  const RowAt at = row_at(s, b, h, t);
  float q[kMaxDimsPerLane], accumulator[kMaxDimsPerLane] = {};
  load_lane(qkv, qkv_type, at.q, s.head_dim, lane, q);
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t j = 0; j <= t; ++j) {
    const float score = warp_dot(q, qkv, qkv_type, at.k0 + j * at.stride, s.head_dim, lane) * scale;
    const float next_max = fmaxf(running_max, score);
    const float correction = expf(running_max - next_max);  // 0 for the first key
    const float p = expf(score - next_max);
    running_sum = running_sum * correction + p;
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      const int64_t c = lane + kWarp * i;
      if (c < s.head_dim) accumulator[i] = accumulator[i] * correction + p * load(qkv, qkv_type, at.v0 + j * at.stride + c);
    }
    running_max = next_max;
  }
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int64_t c = lane + kWarp * i;
    if (c < s.head_dim) store(out, out_type, at.out + c, accumulator[i] / running_sum);
  }
  if (lane == 0) log_sum_exp[(b * s.heads + h) * s.seq + t] = running_max + logf(running_sum);
}

// dq of the row into dqkv; dk and dv (fp32, (batch * seq, width) laid out as
// out) accumulated by atomicAdd.
__global__ void attention_backward_kernel(AttentionShape s, const void* qkv, DType qkv_type, const float* log_sum_exp,
                                          const void* dout, DType dout_type, void* dqkv, DType dqkv_type,
                                          float* dk_sum, float* dv_sum, float scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / kWarp;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (t >= s.seq) return;
  const RowAt at = row_at(s, b, h, t);
  float q[kMaxDimsPerLane], g[kMaxDimsPerLane], dq[kMaxDimsPerLane] = {};
  load_lane(qkv, qkv_type, at.q, s.head_dim, lane, q);
  load_lane(dout, dout_type, at.out, s.head_dim, lane, g);
  const float lse = log_sum_exp[(b * s.heads + h) * s.seq + t];
  // D = Σ_j P_tj dP_tj, with dP_tj = dout_t · v_j.
  float d = 0.0f;
  for (int64_t j = 0; j <= t; ++j) {
    const float p = expf(warp_dot(q, qkv, qkv_type, at.k0 + j * at.stride, s.head_dim, lane) * scale - lse);
    d += p * warp_dot(g, qkv, qkv_type, at.v0 + j * at.stride, s.head_dim, lane);
  }
  for (int64_t j = 0; j <= t; ++j) {
    const int64_t key = at.k0 + j * at.stride, value = at.v0 + j * at.stride;
    const float p = expf(warp_dot(q, qkv, qkv_type, key, s.head_dim, lane) * scale - lse);
    const float dp = warp_dot(g, qkv, qkv_type, value, s.head_dim, lane);
    const float ds = p * (dp - d);
    const int64_t target = (b * s.seq + j) * at.width + h * s.head_dim;
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      const int64_t c = lane + kWarp * i;
      if (c >= s.head_dim) continue;
      dq[i] += ds * load(qkv, qkv_type, key + c);
      atomicAdd(dk_sum + target + c, ds * q[i] * scale);
      atomicAdd(dv_sum + target + c, p * g[i]);
    }
  }
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int64_t c = lane + kWarp * i;
    if (c < s.head_dim) store(dqkv, dqkv_type, at.q + c, dq[i] * scale);
  }
}

// dqkv's k and v columns from the fp32 sums ((batch * seq, width) each).
__global__ void store_key_value_grads_kernel(const float* dk_sum, const float* dv_sum, int64_t rows, int64_t width,
                                             void* dqkv, DType dqkv_type) {
  for (int64_t i = grid_start(); i < rows * width; i += grid_stride()) {
    const int64_t row = i / width, column = i % width;
    store(dqkv, dqkv_type, row * 3 * width + width + column, dk_sum[i]);
    store(dqkv, dqkv_type, row * 3 * width + 2 * width + column, dv_sum[i]);
  }
}

void check_shape(const char* op, const AttentionShape& s) {
  FEDMESH_CHECK(s.batch >= 0 && s.seq >= 0 && s.heads > 0 && s.head_dim > 0 && s.head_dim <= kMaxHeadDim &&
                    s.batch <= 65535 && s.heads <= 65535,
                std::string("cuda::") + op + ": attention shape (batch " + std::to_string(s.batch) + ", seq " +
                    std::to_string(s.seq) + ", heads " + std::to_string(s.heads) + ", head_dim " +
                    std::to_string(s.head_dim) + ") outside what the kernel takes (head_dim <= " +
                    std::to_string(kMaxHeadDim) + ", batch and heads <= 65535)");
}

dim3 row_grid(const AttentionShape& s) {
  return dim3(static_cast<unsigned>((s.seq + kRowsPerBlock - 1) / kRowsPerBlock), static_cast<unsigned>(s.heads),
              static_cast<unsigned>(s.batch));
}

}  // namespace

void causal_attention_forward(Stream stream, const AttentionShape& s, const void* qkv, DType qkv_type, void* out,
                              DType out_type, float* log_sum_exp) {
  check_shape("causal_attention_forward", s);
  if (s.batch == 0 || s.seq == 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  launch(attention_forward_kernel, row_grid(s), dim3(kRowsPerBlock * kWarp), stream, s, qkv, qkv_type, out, out_type,
         log_sum_exp, scale);
}

void causal_attention_backward(Stream stream, const AttentionShape& s, const void* qkv, DType qkv_type,
                               const float* log_sum_exp, const void* dout, DType dout_type, void* dqkv,
                               DType dqkv_type) {
  check_shape("causal_attention_backward", s);
  if (s.batch == 0 || s.seq == 0) return;
  const int64_t rows = s.batch * s.seq, width = s.heads * s.head_dim;
  const size_t bytes = static_cast<size_t>(rows * width) * sizeof(float);
  DeviceBuffer sums(2 * bytes, stream);
  set_zero(sums.data(), 2 * bytes, stream);
  float* dk_sum = sums.as<float>();
  float* dv_sum = dk_sum + rows * width;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  launch(attention_backward_kernel, row_grid(s), dim3(kRowsPerBlock * kWarp), stream, s, qkv, qkv_type, log_sum_exp,
         dout, dout_type, dqkv, dqkv_type, dk_sum, dv_sum, scale);
  launch(store_key_value_grads_kernel, dim3(grid_for(rows * width)), dim3(kThreads), stream, dk_sum, dv_sum, rows,
         width, dqkv, dqkv_type);
}

// ---- token ids ------------------------------------------------------------------

namespace {

__global__ void token_ids_kernel(const float* x, int64_t n, int64_t vocabulary, int32_t* ids) {
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const float v = x[i];
    ids[i] = (v >= 0.0f && v < static_cast<float>(vocabulary) && v == floorf(v)) ? static_cast<int32_t>(v) : -1;
  }
}

}  // namespace

void token_ids(Stream stream, const float* x, int64_t n, int64_t vocabulary, int32_t* ids) {
  if (n == 0) return;
  launch(token_ids_kernel, dim3(grid_for(n)), dim3(kThreads), stream, x, n, vocabulary, ids);
}

}  // namespace fedmesh::cuda
