// The CUDA backend of CompressionKernels (kernels/compression_kernels.h) on
// device 0. Every method copies its host spans to cached device buffers, runs
// its kernels on one stream and copies the result back; a mutex serializes
// callers, so the buffers and the stream are never shared by two calls.
//
// Parity with the CPU backend (compression_math.cpp, compression_kernels.cpp):
// - Quantization, casts, top-k and chunk top-k are bit-identical. Every fp32
//   operation whose rounding matters is written as an explicit
//   round-to-nearest intrinsic (__fdiv_rn, __fmul_rn, __fadd_rn, __fsub_rn):
//   the result then holds whatever -prec-div / -fmad / -use_fast_math say,
//   and no multiply-add is contracted into an FMA that the CPU (x86-64
//   baseline, ISO C++ so no contraction) does not do.
// - The DCT and matmul go through cuBLAS in CUBLAS_DEFAULT_MATH (fp32 compute,
//   never TF32), so they agree within fp32 rounding; Gram-Schmidt accumulates
//   in double like the CPU and differs only in the order of that sum.
// First: its pragma must precede base/status.h.
#include "kernels/cuda/cuda_check.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <array>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/compression_kernels.h"
#include "kernels/compression_math.h"
#include "kernels/cuda/half_device.cuh"

namespace fedmesh::kernels {
namespace {

constexpr int kThreads = 256;                  // elementwise kernels
constexpr uint64_t kMaxGridBlocks = 1u << 16;  // grid-stride loops beyond this
constexpr uint32_t kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Quantization blocks of at least this many elements get a whole thread
// block for their absmax; smaller ones a warp each.
constexpr uint32_t kWideBlockElements = 1024;

// chunk_top_k sorts a chunk in shared memory up to this size (32 KiB of
// 64-bit keys); larger chunks take the two-radix-sort path.
constexpr uint32_t kSharedChunkMax = 4096;
constexpr uint32_t kChunkThreadsMax = 512;

// Gram-Schmidt runs in one thread block (r <= 64 columns in PowerSGD).
constexpr int kGramThreads = 1024;

// top_k's sampling aims at kSampleAim * k candidates and multiplies its aim
// by kRefineFactor after an unlucky sample: the CPU backend's constants, so
// both backends report the same candidates and refinements.
constexpr double kSampleAim = 1.25;
constexpr double kRefineFactor = 4.0;
constexpr uint64_t kMinSamples = 1024;

unsigned grid_for(uint64_t items, unsigned threads) {
  return static_cast<unsigned>(std::clamp<uint64_t>((items + threads - 1) / threads, 1, kMaxGridBlocks));
}

// ---- device copies of compression_math.h's scalar definitions ---------------
// (its constexpr functions are host-only without --expt-relaxed-constexpr;
// the arithmetic here is identical, and the parity tests hold it so.)

__device__ __forceinline__ uint64_t device_splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// uniform_at: 24 random bits, exact in fp32.
__device__ __forceinline__ float device_uniform_at(uint64_t seed, uint64_t index) {
  return __fmul_rn(__ull2float_rn(device_splitmix64(seed ^ device_splitmix64(index)) >> 40), 0x1p-24f);
}

__device__ float device_quantization_scale(float max_abs, int q_max) {
  const float limit = static_cast<float>(q_max);
  float scale = __fdiv_rn(max_abs, limit);
  while (scale > 0.0f && !isfinite(__fmul_rn(limit, scale))) scale = nextafterf(scale, 0.0f);
  return scale;
}

// compression_math.cpp's quantize_one. Nearest rounding is its round_small:
// (r + 1.5 * 2^23) - 1.5 * 2^23, round half to even for |r| <= 2^22 (always
// here: |x| <= max_abs makes |r| at most about 2 * q_max), written the same
// way so that the two agree by construction.
__device__ __forceinline__ int device_quantize_one(float x, float scale, float q_max, Rounding rounding,
                                                   uint64_t seed, uint64_t index) {
  if (!(scale > 0.0f)) return 0;  // an all-zero block
  constexpr float kMagic = 0x1.8p23f;
  const float r = __fdiv_rn(x, scale);
  const float q = rounding == Rounding::kNearest ? __fsub_rn(__fadd_rn(r, kMagic), kMagic)
                                                 : floorf(__fadd_rn(r, device_uniform_at(seed, index)));
  return static_cast<int>(fminf(fmaxf(q, -q_max), q_max));  // std::clamp for non-NaN q
}

__device__ __forceinline__ float warp_max(float v) {
  for (unsigned offset = kWarp / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// ---- elementwise -------------------------------------------------------------

__global__ void add_kernel(const float* a, const float* b, float* out, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = __fadd_rn(a[i], b[i]);
  }
}

__global__ void subtract_kernel(const float* a, const float* b, float* out, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = __fsub_rn(a[i], b[i]);
  }
}

// ---- block quantization ------------------------------------------------------
// Two kernels: the scales (one warp, or one thread block, per quantization
// block), then the values, one thread per output byte. Splitting them lets an
// int4 byte take its two nibbles from two blocks (odd block sizes) without
// two writers.

__global__ void block_scales_warp_kernel(const float* x, uint64_t n, uint32_t block_size, uint64_t blocks, int q_max,
                                         float* scales) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint64_t warps = uint64_t{gridDim.x} * blockDim.x / kWarp;
  // A warp-stride loop (the grid is capped): the bound is the same for the
  // 32 lanes of a warp, so the shuffles see them all.
  for (uint64_t block = (blockIdx.x * uint64_t{blockDim.x} + threadIdx.x) / kWarp; block < blocks; block += warps) {
    const uint64_t first = block * block_size;
    const uint64_t last = min(n, first + block_size);
    float max_abs = 0.0f;
    for (uint64_t i = first + lane; i < last; i += kWarp) max_abs = fmaxf(max_abs, fabsf(x[i]));
    max_abs = warp_max(max_abs);
    if (lane == 0) scales[block] = device_quantization_scale(max_abs, q_max);
  }
}

__global__ void block_scales_wide_kernel(const float* x, uint64_t n, uint32_t block_size, uint64_t blocks, int q_max,
                                         float* scales) {
  __shared__ float warp_maxima[kThreads / kWarp];
  for (uint64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
    const uint64_t first = block * block_size;
    const uint64_t last = min(n, first + block_size);
    float max_abs = 0.0f;
    for (uint64_t i = first + threadIdx.x; i < last; i += blockDim.x) max_abs = fmaxf(max_abs, fabsf(x[i]));
    max_abs = warp_max(max_abs);
    if (threadIdx.x % kWarp == 0) warp_maxima[threadIdx.x / kWarp] = max_abs;
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = 0.0f;
      for (uint32_t w = 0; w < blockDim.x / kWarp; ++w) m = fmaxf(m, warp_maxima[w]);
      scales[block] = device_quantization_scale(m, q_max);
    }
    __syncthreads();  // warp_maxima is reused by the next block
  }
}

__global__ void quantize_int8_kernel(const float* x, uint64_t n, uint32_t block_size, const float* scales,
                                     Rounding rounding, uint64_t seed, uint8_t* packed) {
  const float q_max = static_cast<float>(kInt8Max);
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    const int q = device_quantize_one(x[i], scales[i / block_size], q_max, rounding, seed, i);
    packed[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
  }
}

// Byte t holds elements 2t (low nibble) and 2t + 1 (high nibble; 0 past n).
__global__ void quantize_int4_kernel(const float* x, uint64_t n, uint32_t block_size, const float* scales,
                                     Rounding rounding, uint64_t seed, uint8_t* packed) {
  const float q_max = static_cast<float>(kInt4Max);
  const uint64_t bytes = (n + 1) / 2;
  for (uint64_t t = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; t < bytes; t += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t i = 2 * t;
    const int low = device_quantize_one(x[i], scales[i / block_size], q_max, rounding, seed, i);
    const int high =
        i + 1 < n ? device_quantize_one(x[i + 1], scales[(i + 1) / block_size], q_max, rounding, seed, i + 1) : 0;
    packed[t] = static_cast<uint8_t>((low & 0xf) | ((high & 0xf) << 4));
  }
}

__global__ void dequantize_int8_kernel(const uint8_t* packed, uint64_t n, uint32_t block_size, const float* scales,
                                       float* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = __fmul_rn(static_cast<float>(static_cast<int8_t>(packed[i])), scales[i / block_size]);
  }
}

__global__ void dequantize_int4_kernel(const uint8_t* packed, uint64_t n, uint32_t block_size, const float* scales,
                                       float* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    const int nibble = (packed[i / 2] >> (4 * (i & 1))) & 0xf;
    out[i] = __fmul_rn(static_cast<float>((nibble ^ 8) - 8), scales[i / block_size]);
  }
}

// ---- fp16 / bf16 -------------------------------------------------------------
// half_device.cuh's conversions: bit for bit kernels/half.h.

__global__ void cast_half_kernel(const float* x, uint64_t n, bool bf16, uint16_t* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = cuda::device_half_bits(x[i], bf16);
  }
}

__global__ void widen_half_kernel(const uint16_t* x, uint64_t n, bool bf16, float* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = bf16 ? cuda::device_bf16_to_float(x[i]) : cuda::device_fp16_to_float(x[i]);
  }
}

// ---- top-k -------------------------------------------------------------------

// The CPU's sample: position s is uniform_at(seed, s) * float(n), truncated.
__global__ void sample_magnitudes_kernel(const float* x, uint64_t n, float n_float, uint64_t seed, uint64_t samples,
                                         float* sample) {
  for (uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; s < samples;
       s += uint64_t{gridDim.x} * blockDim.x) {
    const auto position = static_cast<uint64_t>(__fmul_rn(device_uniform_at(seed, s), n_float));
    sample[s] = fabsf(x[min(n - 1, position)]);
  }
}

__global__ void count_at_least_kernel(const float* x, uint64_t n, float threshold, unsigned long long* count) {
  unsigned long long found = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    found += fabsf(x[i]) >= threshold;
  }
  for (unsigned offset = kWarp / 2; offset > 0; offset >>= 1) found += __shfl_xor_sync(kFullMask, found, offset);
  if (threadIdx.x % kWarp == 0 && found > 0) atomicAdd(count, found);
}

struct AtLeast {
  const float* x;
  float threshold;
  __device__ bool operator()(uint64_t i) const { return fabsf(x[i]) >= threshold; }
};

// For non-negative floats the bit pattern orders like the value.
__global__ void gather_magnitude_bits_kernel(const float* x, const uint64_t* indices, uint64_t count, uint32_t* keys) {
  for (uint64_t j = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; j < count; j += uint64_t{gridDim.x} * blockDim.x) {
    keys[j] = __float_as_uint(fabsf(x[indices[j]]));
  }
}

// ---- chunk top-k -------------------------------------------------------------

// (~|x| bits, position): ascending order is larger_magnitude_first.
__device__ __forceinline__ uint64_t selection_key(float v, uint32_t position) {
  return (static_cast<uint64_t>(~__float_as_uint(fabsf(v))) << 32) | position;
}

// Sorts keys[0, size) ascending; size is a power of two; the whole block calls it.
__device__ void bitonic_sort(uint64_t* keys, uint32_t size) {
  for (uint32_t width = 2; width <= size; width <<= 1) {
    for (uint32_t stride = width >> 1; stride > 0; stride >>= 1) {
      for (uint32_t i = threadIdx.x; i < size; i += blockDim.x) {
        const uint32_t j = i ^ stride;
        if (j > i) {
          const bool ascending = (i & width) == 0;
          const uint64_t a = keys[i], b = keys[j];
          if ((a > b) == ascending) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ uint32_t next_power_of_two(uint32_t v) { return v <= 1 ? 1 : 1u << (32 - __clz(v - 1)); }

// One thread block per chunk (grid-stride over chunks): sort (|x| desc,
// position asc), keep the first `keep`, sort those positions ascending.
// Chunk c's indices start at c * min(k, chunk) in out.
__global__ void chunk_top_k_shared_kernel(const float* x, uint64_t n, uint32_t chunk, uint64_t chunks, uint32_t k,
                                          uint32_t padded, uint64_t* out) {
  __shared__ uint64_t keys[kSharedChunkMax];
  const uint64_t keep_full = min(k, chunk);
  for (uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const uint64_t first = c * chunk;
    const auto count = static_cast<uint32_t>(min(uint64_t{chunk}, n - first));
    const uint32_t keep = min(k, count);
    for (uint32_t i = threadIdx.x; i < padded; i += blockDim.x) {
      keys[i] = i < count ? selection_key(x[first + i], i) : ~uint64_t{0};
    }
    __syncthreads();
    bitonic_sort(keys, padded);
    const uint32_t kept_padded = next_power_of_two(keep);
    for (uint32_t i = threadIdx.x; i < kept_padded; i += blockDim.x) {
      keys[i] = i < keep ? (keys[i] & 0xffffffffull) : ~uint64_t{0};
    }
    __syncthreads();
    bitonic_sort(keys, kept_padded);
    for (uint32_t i = threadIdx.x; i < keep; i += blockDim.x) out[c * keep_full + i] = first + keys[i];
    __syncthreads();  // keys is reused by the next chunk
  }
}

// Large chunks: key every element by (~|x|, position in chunk), radix-sort,
// then stable-sort by chunk, flag each chunk's first k, compact in order.
__global__ void chunk_keys_kernel(const float* x, uint64_t n, uint32_t chunk, uint64_t* keys, uint32_t* chunk_ids) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t c = i / chunk;
    keys[i] = selection_key(x[i], static_cast<uint32_t>(i - c * chunk));
    chunk_ids[i] = static_cast<uint32_t>(c);
  }
}

__global__ void flag_chunk_best_kernel(const uint32_t* chunk_ids, const uint64_t* keys, uint64_t n, uint32_t chunk,
                                       uint32_t k, uint8_t* flags) {
  for (uint64_t p = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; p < n; p += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t first = uint64_t{chunk_ids[p]} * chunk;  // every chunk is whole in the sorted order
    if (p - first < k) flags[first + (keys[p] & 0xffffffffull)] = 1;
  }
}

// ---- Gram-Schmidt ------------------------------------------------------------

__global__ void transpose_kernel(const float* in, int64_t rows, int64_t cols, float* out) {
  const uint64_t total = static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
  for (uint64_t e = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; e < total; e += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t row = e / static_cast<uint64_t>(cols), col = e % static_cast<uint64_t>(cols);
    out[col * static_cast<uint64_t>(rows) + row] = in[e];
  }
}

// Every thread gets the same sum (each adds the warp partials in one order).
__device__ double block_sum(double v) {
  __shared__ double partial[kGramThreads / kWarp];
  for (unsigned offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  __syncthreads();  // the previous sum has been read
  if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = v;
  __syncthreads();
  double total = 0.0;
  for (uint32_t w = 0; w < blockDim.x / kWarp; ++w) total += partial[w];
  return total;
}

// Modified Gram-Schmidt on the r columns of q, stored column by column (r, m),
// as the CPU does it: dots and norms in double, updates in fp32 without FMA.
// Each thread owns the same rows in every loop, so the updates need no sync.
__global__ void gram_schmidt_kernel(float* q, int64_t m, int64_t r) {
  for (int64_t j = 0; j < r; ++j) {
    float* pj = q + j * m;
    for (int64_t i = 0; i < j; ++i) {
      const float* pi = q + i * m;
      double dot = 0.0;
      for (int64_t row = threadIdx.x; row < m; row += blockDim.x) {
        dot += static_cast<double>(pi[row]) * static_cast<double>(pj[row]);
      }
      const float d = __double2float_rn(block_sum(dot));
      for (int64_t row = threadIdx.x; row < m; row += blockDim.x) pj[row] = __fsub_rn(pj[row], __fmul_rn(d, pi[row]));
    }
    double squares = 0.0;
    for (int64_t row = threadIdx.x; row < m; row += blockDim.x) {
      squares += static_cast<double>(pj[row]) * static_cast<double>(pj[row]);
    }
    const double norm = sqrt(block_sum(squares));
    const float inverse = norm < 1e-12 ? 0.0f : __double2float_rn(1.0 / norm);
    for (int64_t row = threadIdx.x; row < m; row += blockDim.x) pj[row] = __fmul_rn(pj[row], inverse);
  }
}

// ---- the backend -------------------------------------------------------------

// Bits that hold every index below n (at least one, so that a radix sort runs).
int index_bits(uint64_t n) { return std::max(1, static_cast<int>(std::bit_width(n > 0 ? n - 1 : 0))); }

class CudaCompressionKernels final : public CompressionKernels {
 public:
  // Creates the stream and the cuBLAS handle on device 0; an error Status
  // when the device cannot be used.
  static Result<CompressionKernels*> create() {
    auto* backend = new CudaCompressionKernels();  // lives for the process (see cuda_compression_kernels)
    const Status status = backend->init();
    if (!status.is_ok()) {
      delete backend;
      return status;
    }
    return static_cast<CompressionKernels*>(backend);
  }

  ~CudaCompressionKernels() override {
    // Only reached when init() failed: the live instance is never destroyed,
    // since the CUDA runtime may be torn down before static destructors run.
    for (Buffer& buffer : buffers_) cudaFree(buffer.data);
    if (basis_ != nullptr) cudaFree(basis_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string device_name() const override { return name_; }

  void add(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    elementwise(a, b, out, /*subtract=*/false);
  }

  void subtract(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    elementwise(a, b, out, /*subtract=*/true);
  }

  void quantize_blocks(std::span<const float> x, const BlockQuantization& q, std::span<uint8_t> packed,
                       std::span<float> scales) override {
    FEDMESH_CHECK(q.bits == 8 || q.bits == 4, "quantize_blocks: bits must be 8 or 4, got " + std::to_string(q.bits));
    FEDMESH_CHECK(q.block_size > 0, "quantize_blocks: block_size 0");
    const uint64_t n = x.size();
    const uint64_t bytes = q.bits == 8 ? n : (n + 1) / 2;
    const uint64_t blocks = (n + q.block_size - 1) / q.block_size;
    FEDMESH_CHECK(packed.size() == bytes && scales.size() == blocks, "quantize_blocks: packed has " +
                      std::to_string(packed.size()) + " bytes (want " + std::to_string(bytes) + "), scales " +
                      std::to_string(scales.size()) + " (want " + std::to_string(blocks) + ")");
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_x = upload(kInputA, x);
    auto* d_packed = buffer<uint8_t>(kOutput, bytes);
    auto* d_scales = buffer<float>(kScales, blocks);
    const int q_max = q.bits == 8 ? kInt8Max : kInt4Max;
    if (q.block_size >= kWideBlockElements) {
      block_scales_wide_kernel<<<grid_for(blocks, 1), kThreads, 0, stream_>>>(d_x, n, q.block_size, blocks, q_max,
                                                                              d_scales);
    } else {
      block_scales_warp_kernel<<<grid_for(blocks * kWarp, kThreads), kThreads, 0, stream_>>>(d_x, n, q.block_size,
                                                                                               blocks, q_max, d_scales);
    }
    FEDMESH_CUDA_CHECK_LAUNCH();
    if (q.bits == 8) {
      quantize_int8_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_x, n, q.block_size, d_scales, q.rounding,
                                                                            q.seed, d_packed);
    } else {
      quantize_int4_kernel<<<grid_for(bytes, kThreads), kThreads, 0, stream_>>>(d_x, n, q.block_size, d_scales,
                                                                                q.rounding, q.seed, d_packed);
    }
    FEDMESH_CUDA_CHECK_LAUNCH();
    download(packed, d_packed);
    download(scales, d_scales);
    finish();
  }

  void dequantize_blocks(std::span<const uint8_t> packed, const BlockQuantization& q, std::span<const float> scales,
                         std::span<float> out) override {
    FEDMESH_CHECK(q.bits == 8 || q.bits == 4, "dequantize_blocks: bits must be 8 or 4, got " + std::to_string(q.bits));
    FEDMESH_CHECK(q.block_size > 0, "dequantize_blocks: block_size 0");
    const uint64_t n = out.size();
    const uint64_t bytes = q.bits == 8 ? n : (n + 1) / 2;
    const uint64_t blocks = (n + q.block_size - 1) / q.block_size;
    FEDMESH_CHECK(packed.size() >= bytes && scales.size() >= blocks, "dequantize_blocks: packed has " +
                      std::to_string(packed.size()) + " bytes (want " + std::to_string(bytes) + "), scales " +
                      std::to_string(scales.size()) + " (want " + std::to_string(blocks) + ")");
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const uint8_t* d_packed = upload(kInputA, packed.first(bytes));
    const float* d_scales = upload(kScales, scales.first(blocks));
    auto* d_out = buffer<float>(kOutput, n);
    if (q.bits == 8) {
      dequantize_int8_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_packed, n, q.block_size, d_scales,
                                                                              d_out);
    } else {
      dequantize_int4_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_packed, n, q.block_size, d_scales,
                                                                              d_out);
    }
    FEDMESH_CUDA_CHECK_LAUNCH();
    download(out, d_out);
    finish();
  }

  void cast_half(std::span<const float> x, HalfType type, std::span<uint16_t> out) override {
    FEDMESH_CHECK(out.size() == x.size(), "cast_half: sizes differ");
    const uint64_t n = x.size();
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_x = upload(kInputA, x);
    auto* d_out = buffer<uint16_t>(kOutput, n);
    cast_half_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_x, n, type == HalfType::kBf16, d_out);
    FEDMESH_CUDA_CHECK_LAUNCH();
    download(out, d_out);
    finish();
  }

  void widen_half(std::span<const uint16_t> x, HalfType type, std::span<float> out) override {
    FEDMESH_CHECK(out.size() == x.size(), "widen_half: sizes differ");
    const uint64_t n = x.size();
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const uint16_t* d_x = upload(kInputA, x);
    auto* d_out = buffer<float>(kOutput, n);
    widen_half_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_x, n, type == HalfType::kBf16, d_out);
    FEDMESH_CUDA_CHECK_LAUNCH();
    download(out, d_out);
    finish();
  }

  // The CPU's algorithm step for step (same sample, same ranks, same
  // thresholds), so that sampled, candidates and refinements agree too.
  TopKSelection top_k(std::span<const float> x, uint64_t k, const TopKOptions& options) override {
    TopKSelection selection;
    const uint64_t n = x.size();
    k = std::min(k, n);
    if (k == 0) return selection;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_x = upload(kInputA, x);
    if (n <= options.exact_below || k * 4 > n) {
      selection.candidates = count_at_least(d_x, n, 0.0f);
      selection.indices = best_at_least(d_x, n, 0.0f, selection.candidates, k);
      return selection;
    }
    // Deep Gradient Compression: the threshold that keeps k of n is about
    // the k/n quantile of a sample's magnitudes; aim a little low, and lower
    // the threshold again after an unlucky sample.
    selection.sampled = true;
    const uint64_t samples = std::min<uint64_t>(
        n, std::max<uint64_t>(kMinSamples, static_cast<uint64_t>(options.sample_fraction * static_cast<double>(n))));
    auto* d_sample = buffer<float>(kSample, samples);
    auto* d_sorted = buffer<float>(kSampleSorted, samples);
    sample_magnitudes_kernel<<<grid_for(samples, kThreads), kThreads, 0, stream_>>>(
        d_x, n, static_cast<float>(n), options.seed, samples, d_sample);
    FEDMESH_CUDA_CHECK_LAUNCH();
    size_t temp_bytes = 0;
    FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(nullptr, temp_bytes, d_sample, d_sorted, samples, 0,
                                                                32, stream_));
    void* d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
    FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(d_temp, temp_bytes, d_sample, d_sorted, samples, 0,
                                                                32, stream_));
    double wanted = kSampleAim * static_cast<double>(k);
    for (;;) {
      const uint64_t rank = std::min<uint64_t>(
          samples - 1, static_cast<uint64_t>(wanted / static_cast<double>(n) * static_cast<double>(samples)));
      float threshold = 0.0f;
      if (rank + 1 < samples) {
        FEDMESH_CUDA_CHECK(
            cudaMemcpyAsync(&threshold, d_sorted + rank, sizeof(float), cudaMemcpyDeviceToHost, stream_));
        finish();
      }
      selection.candidates = count_at_least(d_x, n, threshold);
      // threshold 0 admits every element but a NaN (x is meant to be finite:
      // stop there rather than loop).
      if (selection.candidates >= k || threshold == 0.0f) {
        selection.indices = best_at_least(d_x, n, threshold, selection.candidates, k);
        return selection;
      }
      ++selection.refinements;
      wanted *= kRefineFactor;
    }
  }

  void dct_chunks(std::span<const float> x, std::span<float> out, bool inverse) override {
    FEDMESH_CHECK(x.size() % kDctChunk == 0 && out.size() == x.size(),
                  "dct_chunks: " + std::to_string(x.size()) + " elements in, " + std::to_string(out.size()) +
                      " out; want equal multiples of " + std::to_string(kDctChunk));
    const uint64_t chunks = x.size() / kDctChunk;
    if (chunks == 0) return;
    FEDMESH_CHECK(chunks <= static_cast<uint64_t>(INT_MAX), "dct_chunks: too many chunks for cuBLAS");
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_x = upload(kInputA, x);
    auto* d_tmp = buffer<float>(kInputB, x.size());
    auto* d_out = buffer<float>(kOutput, x.size());
    // cuBLAS is column-major: a row-major 64 x 64 matrix M reads as M^T, so
    // the basis reads as Cc = C^T. Forward, Y = C X C^T reads as
    // Y^T = Cc^T X^T Cc: tmp = X^T Cc, then Cc^T tmp. Inverse, X = C^T Y C
    // reads as X^T = Cc Y^T Cc^T: tmp = Y^T Cc^T, then Cc tmp.
    constexpr int side = static_cast<int>(kDctSide);
    constexpr long long stride = kDctChunk;
    const float one = 1.0f, zero = 0.0f;
    const int batch = static_cast<int>(chunks);
    FEDMESH_CUBLAS_CHECK(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_N, inverse ? CUBLAS_OP_T : CUBLAS_OP_N, side,
                                                   side, side, &one, d_x, side, stride, basis_, side, 0, &zero, d_tmp,
                                                   side, stride, batch));
    FEDMESH_CUBLAS_CHECK(cublasSgemmStridedBatched(cublas_, inverse ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, side,
                                                   side, side, &one, basis_, side, 0, d_tmp, side, stride, &zero,
                                                   d_out, side, stride, batch));
    download(out, d_out);
    finish();
  }

  std::vector<uint64_t> chunk_top_k(std::span<const float> x, uint32_t chunk, uint32_t k) override {
    FEDMESH_CHECK(chunk > 0, "chunk_top_k: chunk 0");
    const uint64_t n = x.size();
    if (n == 0 || k == 0) return {};
    const uint64_t chunks = (n + chunk - 1) / chunk;
    const uint64_t keep_full = std::min(k, chunk);
    const uint64_t total = (chunks - 1) * keep_full + std::min<uint64_t>(k, n - (chunks - 1) * chunk);
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_x = upload(kInputA, x);
    auto* d_out = buffer<uint64_t>(kIndicesOut, total);
    if (chunk <= kSharedChunkMax) {
      const uint32_t padded = std::bit_ceil(chunk);
      const unsigned threads = std::clamp<uint32_t>(padded / 2, kWarp, kChunkThreadsMax);
      chunk_top_k_shared_kernel<<<static_cast<unsigned>(std::min<uint64_t>(chunks, kMaxGridBlocks)), threads, 0,
                                  stream_>>>(d_x, n, chunk, chunks, k, padded, d_out);
      FEDMESH_CUDA_CHECK_LAUNCH();
    } else {
      FEDMESH_CHECK(chunks <= UINT32_MAX, "chunk_top_k: more than 2^32 chunks");
      auto* d_keys = buffer<uint64_t>(kKeys, n);
      auto* d_keys_sorted = buffer<uint64_t>(kKeysSorted, n);
      auto* d_ids = buffer<uint32_t>(kIds, n);
      auto* d_ids_sorted = buffer<uint32_t>(kIdsSorted, n);
      chunk_keys_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_x, n, chunk, d_keys, d_ids);
      FEDMESH_CUDA_CHECK_LAUNCH();
      // By (|x| desc, position asc) over the whole tensor, then stably by
      // chunk: each chunk's elements end up in selection order.
      size_t temp_bytes = 0;
      FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, d_keys, d_keys_sorted, d_ids,
                                                         d_ids_sorted, n, 0, 64, stream_));
      void* d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
      FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(d_temp, temp_bytes, d_keys, d_keys_sorted, d_ids,
                                                         d_ids_sorted, n, 0, 64, stream_));
      const int chunk_bits = index_bits(chunks);
      FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, d_ids_sorted, d_ids, d_keys_sorted,
                                                         d_keys, n, 0, chunk_bits, stream_));
      d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
      FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(d_temp, temp_bytes, d_ids_sorted, d_ids, d_keys_sorted,
                                                         d_keys, n, 0, chunk_bits, stream_));
      auto* d_flags = buffer<uint8_t>(kFlags, n);
      FEDMESH_CUDA_CHECK(cudaMemsetAsync(d_flags, 0, n, stream_));
      flag_chunk_best_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_ids, d_keys, n, chunk, k, d_flags);
      FEDMESH_CUDA_CHECK_LAUNCH();
      const uint64_t selected = select_flagged(d_flags, n, d_out);
      FEDMESH_CHECK(selected == total, "chunk_top_k: selected " + std::to_string(selected) + " of " +
                                           std::to_string(total));
    }
    std::vector<uint64_t> indices(total);
    download(std::span<uint64_t>(indices), d_out);
    finish();
    return indices;
  }

  void matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, std::span<const float> a,
              std::span<const float> b, std::span<float> c) override {
    FEDMESH_CHECK(m >= 0 && n >= 0 && k >= 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
                  "matmul: dimensions out of cuBLAS's range");
    const auto a_size = static_cast<size_t>(m * k), b_size = static_cast<size_t>(k * n),
               c_size = static_cast<size_t>(m * n);
    FEDMESH_CHECK(a.size() >= a_size && b.size() >= b_size && c.size() >= c_size, "matmul: spans too small");
    if (c_size == 0) return;
    if (k == 0) {
      std::fill(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(c_size), 0.0f);
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_a = upload(kInputA, a.first(a_size));
    const float* d_b = upload(kInputB, b.first(b_size));
    auto* d_c = buffer<float>(kOutput, c_size);
    // Row-major c = op(a) op(b) is column-major c^T = op(b)^T op(a)^T: the
    // column-major views of a and b are already their transposes.
    const float one = 1.0f, zero = 0.0f;
    FEDMESH_CUBLAS_CHECK(cublasSgemm(cublas_, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                     static_cast<int>(k), &one, d_b, static_cast<int>(transpose_b ? k : n), d_a,
                                     static_cast<int>(transpose_a ? m : k), &zero, d_c, static_cast<int>(n)));
    download(c.first(c_size), d_c);
    finish();
  }

  void orthonormalize_columns(std::span<float> p, int64_t m, int64_t r) override {
    FEDMESH_CHECK(m >= 0 && r >= 0 && p.size() >= static_cast<size_t>(m * r), "orthonormalize_columns: bad shape");
    const auto size = static_cast<size_t>(m * r);
    if (size == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_p = upload(kInputA, std::span<const float>(p.first(size)));
    auto* d_columns = buffer<float>(kInputB, size);
    auto* d_out = buffer<float>(kOutput, size);
    transpose_kernel<<<grid_for(size, kThreads), kThreads, 0, stream_>>>(d_p, m, r, d_columns);  // (r, m)
    FEDMESH_CUDA_CHECK_LAUNCH();
    gram_schmidt_kernel<<<1, kGramThreads, 0, stream_>>>(d_columns, m, r);
    FEDMESH_CUDA_CHECK_LAUNCH();
    transpose_kernel<<<grid_for(size, kThreads), kThreads, 0, stream_>>>(d_columns, r, m, d_out);  // (m, r)
    FEDMESH_CUDA_CHECK_LAUNCH();
    download(p.first(size), d_out);
    finish();
  }

 private:
  // The cached device buffers, one per role, grown as needed and kept.
  enum BufferRole {
    kInputA,
    kInputB,
    kOutput,
    kScales,
    kSample,
    kSampleSorted,
    kCount,
    kCandidates,
    kCandidatesSorted,
    kMagnitudes,
    kMagnitudesSorted,
    kIndicesOut,
    kKeys,
    kKeysSorted,
    kIds,
    kIdsSorted,
    kFlags,
    kCubTemp,
    kRoleCount
  };
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
  };

  CudaCompressionKernels() = default;

  Status init() {
    cudaDeviceProp properties{};
    cudaError_t error = cudaSetDevice(device_);
    if (error == cudaSuccess) error = cudaGetDeviceProperties(&properties, device_);
    if (error == cudaSuccess) error = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (error == cudaSuccess) error = cudaMalloc(&basis_, kDctChunk * sizeof(float));
    if (error == cudaSuccess) {
      // The CPU's own basis (compression_math.h), so both backends multiply by the same C.
      error = cudaMemcpy(basis_, dct_basis().data(), kDctChunk * sizeof(float), cudaMemcpyHostToDevice);
    }
    if (error != cudaSuccess) {
      cudaGetLastError();
      return unavailable(std::string("CUDA device 0 cannot be used: ") + cudaGetErrorName(error) + " (" +
                         cudaGetErrorString(error) + ")");
    }
    cublasStatus_t status = cublasCreate(&cublas_);
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasSetStream(cublas_, stream_);
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasSetPointerMode(cublas_, CUBLAS_POINTER_MODE_HOST);
    // fp32 compute throughout: DEFAULT never picks TF32 for an sgemm.
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH);
    if (status != CUBLAS_STATUS_SUCCESS) {
      return unavailable(std::string("cuBLAS on CUDA device 0: ") + cublasGetStatusName(status) + " (" +
                         cublasGetStatusString(status) + ")");
    }
    name_ = "cuda:" + std::to_string(device_) + " " + properties.name;
    return Status::ok();
  }

  // Another library may have made another device current on this thread.
  void use_device() { FEDMESH_CUDA_CHECK(cudaSetDevice(device_)); }

  template <class T>
  T* buffer(BufferRole role, uint64_t count) {
    Buffer& buffer = buffers_[role];
    const size_t bytes = std::max<size_t>(count * sizeof(T), 1);
    if (buffer.bytes < bytes) {
      const size_t grown = std::max(bytes, buffer.bytes + buffer.bytes / 2);  // amortize a slowly growing size
      FEDMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no queued work still reads the old one
      FEDMESH_CUDA_CHECK(cudaFree(buffer.data));
      buffer = {};
      FEDMESH_CUDA_CHECK(cudaMalloc(&buffer.data, grown));
      buffer.bytes = grown;
    }
    return static_cast<T*>(buffer.data);
  }

  template <class T>
  const T* upload(BufferRole role, std::span<const T> host) {
    T* device = buffer<T>(role, host.size());
    FEDMESH_CUDA_CHECK(cudaMemcpyAsync(device, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream_));
    return device;
  }
  template <class T>
  const T* upload(BufferRole role, std::span<T> host) {
    return upload(role, std::span<const T>(host));
  }

  template <class T>
  void download(std::span<T> host, const T* device) {
    FEDMESH_CUDA_CHECK(cudaMemcpyAsync(host.data(), device, host.size_bytes(), cudaMemcpyDeviceToHost, stream_));
  }

  void finish() { FEDMESH_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  void elementwise(std::span<const float> a, std::span<const float> b, std::span<float> out, bool subtract) {
    FEDMESH_CHECK(a.size() == out.size() && b.size() == out.size(), "add/subtract: sizes differ");
    const uint64_t n = out.size();
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    use_device();
    const float* d_a = upload(kInputA, a);
    const float* d_b = upload(kInputB, b);
    auto* d_out = buffer<float>(kOutput, n);
    if (subtract) {
      subtract_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_a, d_b, d_out, n);
    } else {
      add_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_a, d_b, d_out, n);
    }
    FEDMESH_CUDA_CHECK_LAUNCH();
    download(out, d_out);
    finish();
  }

  // How many |x| >= threshold.
  uint64_t count_at_least(const float* d_x, uint64_t n, float threshold) {
    auto* d_count = buffer<unsigned long long>(kCount, 1);
    FEDMESH_CUDA_CHECK(cudaMemsetAsync(d_count, 0, sizeof(unsigned long long), stream_));
    count_at_least_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_>>>(d_x, n, threshold, d_count);
    FEDMESH_CUDA_CHECK_LAUNCH();
    unsigned long long count = 0;
    FEDMESH_CUDA_CHECK(cudaMemcpyAsync(&count, d_count, sizeof(count), cudaMemcpyDeviceToHost, stream_));
    finish();
    return count;
  }

  // Of the `count` elements with |x| >= threshold, the first min(k, count) in
  // selection order (|x| desc, index asc), as ascending indices.
  std::vector<uint64_t> best_at_least(const float* d_x, uint64_t n, float threshold, uint64_t count, uint64_t k) {
    k = std::min(k, count);
    if (k == 0) return {};
    auto* d_candidates = buffer<uint64_t>(kCandidates, count);
    auto* d_num = buffer<unsigned long long>(kCount, 1);
    // Compaction keeps index order, and the radix sort is stable: ties in
    // |x| stay in index order.
    const thrust::counting_iterator<uint64_t> positions(0);
    size_t temp_bytes = 0;
    FEDMESH_CUDA_CHECK(cub::DeviceSelect::If(nullptr, temp_bytes, positions, d_candidates, d_num,
                                             static_cast<int64_t>(n), AtLeast{d_x, threshold}, stream_));
    void* d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
    FEDMESH_CUDA_CHECK(cub::DeviceSelect::If(d_temp, temp_bytes, positions, d_candidates, d_num,
                                             static_cast<int64_t>(n), AtLeast{d_x, threshold}, stream_));
    auto* d_magnitudes = buffer<uint32_t>(kMagnitudes, count);
    gather_magnitude_bits_kernel<<<grid_for(count, kThreads), kThreads, 0, stream_>>>(d_x, d_candidates, count,
                                                                                       d_magnitudes);
    FEDMESH_CUDA_CHECK_LAUNCH();
    auto* d_magnitudes_sorted = buffer<uint32_t>(kMagnitudesSorted, count);
    auto* d_candidates_sorted = buffer<uint64_t>(kCandidatesSorted, count);
    FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, temp_bytes, d_magnitudes,
                                                                 d_magnitudes_sorted, d_candidates,
                                                                 d_candidates_sorted, count, 0, 32, stream_));
    d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
    FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(d_temp, temp_bytes, d_magnitudes,
                                                                 d_magnitudes_sorted, d_candidates,
                                                                 d_candidates_sorted, count, 0, 32, stream_));
    // The best k, by index: d_candidates is free again.
    const int bits = index_bits(n);
    FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, temp_bytes, d_candidates_sorted, d_candidates, k, 0,
                                                      bits, stream_));
    d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
    FEDMESH_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(d_temp, temp_bytes, d_candidates_sorted, d_candidates, k, 0,
                                                      bits, stream_));
    unsigned long long selected = 0;
    FEDMESH_CUDA_CHECK(cudaMemcpyAsync(&selected, d_num, sizeof(selected), cudaMemcpyDeviceToHost, stream_));
    std::vector<uint64_t> indices(k);
    download(std::span<uint64_t>(indices), d_candidates);
    finish();
    FEDMESH_CHECK(selected == count, "top_k: counted " + std::to_string(count) + " candidates, compacted " +
                                         std::to_string(selected));
    return indices;
  }

  // The positions whose flag is set, ascending, into d_out; returns how many.
  uint64_t select_flagged(const uint8_t* d_flags, uint64_t n, uint64_t* d_out) {
    auto* d_num = buffer<unsigned long long>(kCount, 1);
    const thrust::counting_iterator<uint64_t> positions(0);
    size_t temp_bytes = 0;
    FEDMESH_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, temp_bytes, positions, d_flags, d_out, d_num,
                                                  static_cast<int64_t>(n), stream_));
    void* d_temp = buffer<uint8_t>(kCubTemp, temp_bytes);
    FEDMESH_CUDA_CHECK(cub::DeviceSelect::Flagged(d_temp, temp_bytes, positions, d_flags, d_out, d_num,
                                                  static_cast<int64_t>(n), stream_));
    unsigned long long selected = 0;
    FEDMESH_CUDA_CHECK(cudaMemcpyAsync(&selected, d_num, sizeof(selected), cudaMemcpyDeviceToHost, stream_));
    finish();
    return selected;
  }

  const int device_ = 0;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  float* basis_ = nullptr;  // (64, 64) row-major DCT basis
  std::mutex mutex_;        // one call at a time owns the stream and the buffers
  std::array<Buffer, kRoleCount> buffers_{};
};

Result<CompressionKernels*> make_cuda_compression_kernels() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later callers
    return unavailable(std::string("no usable CUDA device: ") + cudaGetErrorName(error) + " (" +
                       cudaGetErrorString(error) + ")");
  }
  if (count == 0) return unavailable("the CUDA runtime found no device");
  return CudaCompressionKernels::create();
}

}  // namespace

Result<CompressionKernels*> cuda_compression_kernels() {
  // One per process, never destroyed (static destructors may run after the
  // CUDA runtime has shut down); a failure is remembered too.
  static const Result<CompressionKernels*> instance = make_cuda_compression_kernels();
  return instance;
}

}  // namespace fedmesh::kernels
