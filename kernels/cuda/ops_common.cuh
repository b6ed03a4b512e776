// What the .cu files of kernels/cuda_ops.h share: launch shapes, loads and
// stores of a runtime dtype, and warp/block reductions.
//
// Loads and stores switch on the dtype inside the kernel (uniform across the
// grid, so no divergence) instead of instantiating every kernel for every
// dtype pair: one compiled kernel per op keeps the CUDA build short.
//
// Every fp32 operation whose rounding the CPU reference fixes is written as an
// explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fsub_rn,
// __fdiv_rn, __fsqrt_rn): nvcc would otherwise contract a * b + c into an FMA
// that the CPU (x86-64 baseline, ISO C++, no contraction) does not do.
#pragma once

#include "kernels/cuda/cuda_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "kernels/cuda/half_device.cuh"
#include "kernels/cuda_ops.h"
#include "kernels/tensor.h"

namespace fedmesh::cuda {

inline constexpr int kThreads = 256;                // elementwise kernels
inline constexpr int kRowThreads = 256;             // one block per row
inline constexpr int64_t kMaxGridBlocks = 1 << 16;  // grid-stride loops beyond this
inline constexpr int kWarp = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

inline cudaStream_t to_cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

inline unsigned grid_for(int64_t items, int threads = kThreads) {
  return static_cast<unsigned>(std::clamp<int64_t>((items + threads - 1) / threads, 1, kMaxGridBlocks));
}

// kernel<<<grid, block, 0, stream>>>(args...), checked.
template <class... Parameters, class... Arguments>
void launch(void (*kernel)(Parameters...), dim3 grid, dim3 block, Stream stream, Arguments&&... arguments) {
  kernel<<<grid, block, 0, to_cuda(stream)>>>(std::forward<Arguments>(arguments)...);
  FEDMESH_CUDA_CHECK_LAUNCH();
}

// The first index and the stride of a grid-stride loop.
__device__ __forceinline__ int64_t grid_start() { return blockIdx.x * int64_t{blockDim.x} + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t{gridDim.x} * blockDim.x; }

__device__ __forceinline__ float load(const void* p, DType type, int64_t i) {
  switch (type) {
    case DType::kBF16: return device_bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return device_fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF32: break;
  }
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store(void* p, DType type, int64_t i, float v) {
  if (type == DType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = device_half_bits(v, type == DType::kBF16);
  }
}

// ---- 16-byte vectors -------------------------------------------------------------
//
// Memory-bound kernels move kVector consecutive elements per thread: one
// 16-byte access for bf16 and fp16, two for fp32, where every buffer starts
// 16-byte aligned (vectorizable, on the host) and the index is a multiple of
// kVector. The arithmetic per element is unchanged, so the results are the
// scalar loop's bit for bit.
inline constexpr int kVector = 8;

inline bool vectorizable(std::initializer_list<const void*> buffers) {
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// v[0..W) = elements i .. i + W of p (W = kVector: i a multiple of it; W = 1: any i).
template <int W>
__device__ __forceinline__ void load_n(const void* p, DType type, int64_t i, float (&v)[W]) {
  if constexpr (W == kVector) {
    if (type == DType::kF32) {
      const float4 a = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i)[0];
      const float4 b = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint16_t lo = static_cast<uint16_t>(words[k] & 0xffffu), hi = static_cast<uint16_t>(words[k] >> 16);
        v[2 * k] = type == DType::kBF16 ? device_bf16_to_float(lo) : device_fp16_to_float(lo);
        v[2 * k + 1] = type == DType::kBF16 ? device_bf16_to_float(hi) : device_fp16_to_float(hi);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = load(p, type, i + k);
  }
}

template <int W>
__device__ __forceinline__ void store_n(void* p, DType type, int64_t i, const float (&v)[W]) {
  if constexpr (W == kVector) {
    if (type == DType::kF32) {
      float4* out = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
      out[0] = make_float4(v[0], v[1], v[2], v[3]);
      out[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      const bool bf16 = type == DType::kBF16;
      uint32_t words[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        words[k] = uint32_t{device_half_bits(v[2 * k], bf16)} | (uint32_t{device_half_bits(v[2 * k + 1], bf16)} << 16);
      }
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) store(p, type, i + k, v[k]);
  }
}

// An elementwise op over n elements: op.template run<kVector>(i) for every
// whole vector when `vectors`, then op.template run<1>(i) for the rest, in
// a grid-stride loop.
template <class Op>
__global__ void elementwise_kernel(Op op, int64_t n, bool vectors) {
  const int64_t whole = vectors ? n / kVector : 0;
  for (int64_t v = grid_start(); v < whole; v += grid_stride()) op.template run<kVector>(v * kVector);
  for (int64_t i = whole * kVector + grid_start(); i < n; i += grid_stride()) op.template run<1>(i);
}

template <class Op>
void launch_vectorized(Stream stream, Op op, int64_t n, std::initializer_list<const void*> buffers) {
  const bool vectors = vectorizable(buffers);
  launch(elementwise_kernel<Op>, grid_for(vectors ? (n + kVector - 1) / kVector : n), kThreads, stream, op, n,
         vectors);
}

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// The sum over the block of every thread's v, returned to every thread; the
// order is fixed by the block shape, so a launch always gives the same bits.
// blockDim.x a multiple of 32, at most 1024. `scratch` holds 32 T in shared
// memory; the call ends with a barrier, so it may be reused right after.
template <class T>
__device__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = lane < warps ? scratch[lane] : T{0};
  total = warp_sum(total);
  __syncthreads();
  return total;
}

// Column sums of a (rows, columns) matrix of fp32 terms, in a fixed order:
// first[j] = [accumulate ? first[j] : 0] + sum over rows of term(row, j).x,
// and the same into second[j] from .y when second is given.
//
// A block of (kColumnTile, kRowGroups) threads sums 32 columns over one chunk
// of rows: each thread every kRowGroups-th row of its column, then the groups
// are added in order. A layer's bias or layer-norm gradient is a few hundred
// columns over many thousand rows (GPT-2: 768 x 16 384), so one chunk per
// column tile would leave most of a GPU idle (24 blocks); the rows are cut
// into chunks, each block writes its partial sums to a scratch buffer, and a
// second kernel adds the chunks in order. The chunk count depends only on the
// shape, so a launch always gives the same bits.
inline constexpr int kColumnTile = 32;
inline constexpr int kRowGroups = 16;
inline constexpr int64_t kColumnSumTargetBlocks = 1024;  // enough to fill an H100 several times over
inline constexpr int64_t kColumnSumMinChunkRows = 128;

// How many chunks of rows column_sums cuts (rows, columns) into.
inline int64_t column_sum_chunks(int64_t rows, int64_t columns) {
  const int64_t column_blocks = (columns + kColumnTile - 1) / kColumnTile;
  const int64_t by_rows = std::max<int64_t>(1, rows / kColumnSumMinChunkRows);
  const int64_t by_blocks = std::max<int64_t>(1, kColumnSumTargetBlocks / std::max<int64_t>(1, column_blocks));
  return std::min(by_rows, by_blocks);
}

// Rows [chunk * chunk_rows, min(rows, (chunk + 1) * chunk_rows)) of the
// columns of this block, chunk = blockIdx.y. With `partial` (chunks > 1) the
// sums go to partial[chunk][j] (and partial[chunks + chunk][j] for second);
// else straight to first and second.
template <class Term>
__global__ void column_sums_kernel(Term term, int64_t rows, int64_t columns, int64_t chunk_rows, float* first,
                                   float* second, bool accumulate, float* partial) {
  __shared__ float partial_first[kRowGroups][kColumnTile + 1];
  __shared__ float partial_second[kRowGroups][kColumnTile + 1];
  const int64_t j = blockIdx.x * int64_t{kColumnTile} + threadIdx.x;
  const int64_t begin = blockIdx.y * chunk_rows, end = rows < begin + chunk_rows ? rows : begin + chunk_rows;
  float sum_first = 0.0f, sum_second = 0.0f;
  if (j < columns) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowGroups) {
      const float2 t = term(r, j);
      sum_first = __fadd_rn(sum_first, t.x);
      sum_second = __fadd_rn(sum_second, t.y);
    }
  }
  partial_first[threadIdx.y][threadIdx.x] = sum_first;
  partial_second[threadIdx.y][threadIdx.x] = sum_second;
  __syncthreads();
  if (threadIdx.y != 0 || j >= columns) return;
  float total_first = 0.0f, total_second = 0.0f;
  for (int group = 0; group < kRowGroups; ++group) {
    total_first = __fadd_rn(total_first, partial_first[group][threadIdx.x]);
    total_second = __fadd_rn(total_second, partial_second[group][threadIdx.x]);
  }
  if (partial != nullptr) {
    partial[blockIdx.y * columns + j] = total_first;
    partial[(gridDim.y + blockIdx.y) * columns + j] = total_second;
    return;
  }
  first[j] = accumulate ? __fadd_rn(first[j], total_first) : total_first;
  if (second != nullptr) second[j] = accumulate ? __fadd_rn(second[j], total_second) : total_second;
}

// first[j] (and second[j]) from the chunks' partial sums, chunk by chunk in order.
static __global__ void column_sums_finish_kernel(const float* partial, int64_t chunks, int64_t columns, float* first,
                                          float* second, bool accumulate) {
  for (int64_t j = grid_start(); j < columns; j += grid_stride()) {
    float total_first = 0.0f, total_second = 0.0f;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      total_first = __fadd_rn(total_first, partial[chunk * columns + j]);
      total_second = __fadd_rn(total_second, partial[(chunks + chunk) * columns + j]);
    }
    first[j] = accumulate ? __fadd_rn(first[j], total_first) : total_first;
    if (second != nullptr) second[j] = accumulate ? __fadd_rn(second[j], total_second) : total_second;
  }
}

template <class Term>
void column_sums(Stream stream, Term term, int64_t rows, int64_t columns, float* first, float* second,
                 bool accumulate) {
  if (columns == 0) return;
  const int64_t chunks = column_sum_chunks(rows, columns);
  const int64_t chunk_rows = chunks == 1 ? std::max<int64_t>(rows, 1) : (rows + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>((columns + kColumnTile - 1) / kColumnTile), static_cast<unsigned>(chunks));
  if (chunks == 1) {
    launch(column_sums_kernel<Term>, grid, dim3(kColumnTile, kRowGroups), stream, term, rows, columns, chunk_rows,
           first, second, accumulate, static_cast<float*>(nullptr));
    return;
  }
  DeviceBuffer partial(static_cast<size_t>(2 * chunks * columns) * sizeof(float), stream);
  launch(column_sums_kernel<Term>, grid, dim3(kColumnTile, kRowGroups), stream, term, rows, columns, chunk_rows,
         first, second, accumulate, partial.as<float>());
  launch(column_sums_finish_kernel, grid_for(columns), kThreads, stream, partial.as<const float>(), chunks, columns,
         first, second, accumulate);
}

// gelu (tanh approximation) and its derivative with elementwise.cpp's
// operations in its order; only tanhf may differ from glibc's (CUDA: 2 ulp).
inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float gelu_inner(float v) {
  // kSqrt2OverPi * (v + kGeluCubic * v * v * v)
  return __fmul_rn(kSqrt2OverPi, __fadd_rn(v, __fmul_rn(__fmul_rn(__fmul_rn(kGeluCubic, v), v), v)));
}

__device__ __forceinline__ float device_gelu(float v) {
  // 0.5f * v * (1.0f + tanh(inner))
  return __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.0f, tanhf(gelu_inner(v))));
}

__device__ __forceinline__ float device_gelu_grad(float v, float grad) {
  const float t = tanhf(gelu_inner(v));
  // kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v)
  const float d_inner = __fmul_rn(kSqrt2OverPi, __fadd_rn(1.0f, __fmul_rn(__fmul_rn(3.0f * kGeluCubic, v), v)));
  // grad * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * d_inner)
  const float left = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
  const float right = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, v), __fsub_rn(1.0f, __fmul_rn(t, t))), d_inner);
  return __fmul_rn(grad, __fadd_rn(left, right));
}

}  // namespace fedmesh::cuda
