// The row kernels of causal attention on the device (kernels/cuda_ops.h):
// the softmax of a (batch, seq, seq) block of scores with the causal mask
// and the row's log-sum-exp, and its backward pass. The products around them
// are cuBLASLt's (gemm_strided_batched), put together in device_ops.cpp.
//
// One block per score row (a row of GPT-2's 1024 keys is four values a
// thread); the forward pass reads a row three times (maximum, sum, write),
// the later reads from cache. The reductions have block_sum's fixed order, so
// a launch always gives the same bits.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/ops_common.cuh"

namespace fedmesh::cuda {
namespace {

// The maximum over the block of every thread's v, to every thread (block_sum's
// shape rules and scratch).
__device__ float block_max(float v, float* scratch) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float result = lane < warps ? scratch[lane] : -INFINITY;
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    result = fmaxf(result, __shfl_xor_sync(kFullMask, result, offset));
  }
  __syncthreads();
  return result;
}

// With lse_out, each row's log-sum-exp is computed and written there; else
// it is read from lse_in.
__global__ void causal_softmax_kernel(const float* scores, int64_t rows, int64_t seq, float scale, const float* lse_in,
                                      float* lse_out, int64_t lse_stride, void* probabilities, DType p_type) {
  __shared__ float scratch[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t pair = row / seq, t = row % seq, base = row * seq, slot = pair * lse_stride + t;
    float lse;
    if (lse_out != nullptr) {
      float max_value = -INFINITY;
      for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) max_value = fmaxf(max_value, scale * scores[base + j]);
      max_value = block_max(max_value, scratch);
      float sum = 0.0f;
      for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += expf(scale * scores[base + j] - max_value);
      sum = block_sum(sum, scratch);
      lse = max_value + logf(sum);
      if (threadIdx.x == 0) lse_out[slot] = lse;
    } else {
      lse = lse_in[slot];
    }
    for (int64_t j = threadIdx.x; j < seq; j += blockDim.x) {
      store(probabilities, p_type, base + j, j <= t ? expf(scale * scores[base + j] - lse) : 0.0f);
    }
  }
}

__global__ void causal_softmax_backward_kernel(void* probabilities, DType p_type, const float* dprobabilities,
                                               int64_t rows, int64_t seq, float scale) {
  __shared__ float scratch[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = row % seq, base = row * seq;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) {
      dot += load(probabilities, p_type, base + j) * dprobabilities[base + j];
    }
    dot = block_sum(dot, scratch);  // ends with a barrier: every read of the row is done
    for (int64_t j = threadIdx.x; j < seq; j += blockDim.x) {
      const float ds = j <= t ? scale * load(probabilities, p_type, base + j) * (dprobabilities[base + j] - dot) : 0.0f;
      store(probabilities, p_type, base + j, ds);
    }
  }
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, kMaxGridBlocks)); }

void check_rows(const char* op, int64_t batch, int64_t seq) {
  FEDMESH_CHECK(batch >= 0 && seq >= 0, std::string("cuda::") + op + ": negative shape (batch " +
                                            std::to_string(batch) + ", seq " + std::to_string(seq) + ")");
}

// causal_softmax (lse_out) and causal_probabilities (lse_in): one kernel.
void launch_softmax(const char* op, Stream stream, const float* scores, int64_t batch, int64_t seq, float scale,
                    const float* lse_in, float* lse_out, int64_t lse_stride, void* probabilities, DType p_type) {
  check_rows(op, batch, seq);
  if (batch == 0 || seq == 0) return;
  launch(causal_softmax_kernel, dim3(row_blocks(batch * seq)), dim3(kRowThreads), stream, scores, batch * seq, seq,
         scale, lse_in, lse_out, lse_stride, probabilities, p_type);
}

}  // namespace

void causal_softmax(Stream stream, const float* scores, int64_t batch, int64_t seq, float scale, float* log_sum_exp,
                    int64_t lse_stride, void* probabilities, DType p_type) {
  launch_softmax("causal_softmax", stream, scores, batch, seq, scale, nullptr, log_sum_exp, lse_stride, probabilities,
                 p_type);
}

void causal_probabilities(Stream stream, const float* scores, int64_t batch, int64_t seq, float scale,
                          const float* log_sum_exp, int64_t lse_stride, void* probabilities, DType p_type) {
  launch_softmax("causal_probabilities", stream, scores, batch, seq, scale, log_sum_exp, nullptr, lse_stride,
                 probabilities, p_type);
}

void causal_softmax_backward(Stream stream, void* probabilities, DType p_type, const float* dprobabilities,
                             int64_t batch, int64_t seq, float scale) {
  check_rows("causal_softmax_backward", batch, seq);
  if (batch == 0 || seq == 0) return;
  launch(causal_softmax_backward_kernel, dim3(row_blocks(batch * seq)), dim3(kRowThreads), stream, probabilities,
         p_type, dprobabilities, batch * seq, seq, scale);
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
