// The numerical kernels of update compression behind one interface, with a
// CPU backend (compression_kernels.cpp: every core through parallel_for,
// OpenBLAS for PowerSGD's products) and a CUDA backend
// (cuda/compression_kernels.cu). Both compute the same results: bit for bit
// for quantization (the same grid and the same counter-based random draws),
// casts, selection and masks; within fp32 rounding for the DCT and the matrix
// products. tests/kernels/test_compression_kernels.cpp holds the CPU to
// their definitions and, where a GPU is present, the CUDA backend to the CPU.
//
// The interface takes host spans: the CUDA backend copies in and out around
// its kernels (a device-resident update could hand it device pointers
// instead; not done).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/compression_math.h"

namespace fedmesh::kernels {

enum class HalfType : uint8_t { kFp16 = 0, kBf16 = 1 };

struct BlockQuantization {
  int bits = 8;                 // 8 or 4
  uint32_t block_size = 4096;   // elements per fp32 scale
  Rounding rounding = Rounding::kNearest;
  uint64_t seed = 0;            // stochastic rounding's draws
};

inline constexpr uint64_t kMaxTopKSamples = uint64_t{1} << 18;

struct TopKOptions {
  // Tensors of at most this many elements are selected exactly; larger ones
  // estimate a threshold from a sample first (Deep Gradient Compression).
  uint64_t exact_below = uint64_t{1} << 16;
  // Of the elements, at least 1024 and at most kMaxTopKSamples of them: a
  // quarter million samples put the threshold within about 2 % of the
  // quantile aimed at even for k = 1 % of a billion (more only cost time).
  double sample_fraction = 0.01;
  uint64_t seed = 0;              // which elements are sampled
};

struct TopKSelection {
  std::vector<uint64_t> indices;  // ascending; exactly min(k, n) of them
  // x[indices[i]], where the backend had them at hand (the CPU backend);
  // empty otherwise: read them from x.
  std::vector<float> values;
  bool sampled = false;           // the threshold came from a sample
  uint64_t candidates = 0;        // elements at or above the final threshold
  int refinements = 0;            // times the threshold was lowered
};

class CompressionKernels {
 public:
  virtual ~CompressionKernels() = default;
  virtual std::string device_name() const = 0;  // "cpu", "cuda:0 NVIDIA H100 ..."

  // out[i] = a[i] + b[i] (the error-feedback input e + delta).
  virtual void add(std::span<const float> a, std::span<const float> b, std::span<float> out) = 0;
  // out[i] = a[i] - b[i] (the new residual a - D(C(a))).
  virtual void subtract(std::span<const float> a, std::span<const float> b, std::span<float> out) = 0;

  // compression_math.h's quantize_blocks / dequantize_blocks over a whole
  // tensor (first_index 0). packed has n (bits 8) or ceil(n / 2) (bits 4)
  // bytes; scales ceil(n / block_size).
  virtual void quantize_blocks(std::span<const float> x, const BlockQuantization& q, std::span<uint8_t> packed,
                               std::span<float> scales) = 0;
  virtual void dequantize_blocks(std::span<const uint8_t> packed, const BlockQuantization& q,
                                 std::span<const float> scales, std::span<float> out) = 0;
  // Error feedback's whole step for block quantization: quantize_blocks(a),
  // then residual = a - D(q) and, when `decoded` is not empty, decoded =
  // D(q), bit for bit what quantize + dequantize + subtract give. This
  // default does exactly those three passes; the CPU backend fuses them per
  // block, so a is read once and D(q) stays in cache.
  virtual void quantize_blocks_with_residual(std::span<const float> a, const BlockQuantization& q,
                                             std::span<uint8_t> packed, std::span<float> scales,
                                             std::span<float> residual, std::span<float> decoded,
                                             std::vector<float>& scratch);
  // The same step with a delta folded in: a = residual + delta is formed in
  // the residual, quantized, and the residual becomes a - D(q); bit for bit
  // add() then quantize_blocks_with_residual(residual, ..., residual, ...),
  // which this default runs. The CPU backend adds a block and steps it while
  // it is in cache: one pass over the residual and the delta.
  virtual void add_quantize_blocks_with_residual(std::span<float> residual, std::span<const float> delta,
                                                 const BlockQuantization& q, std::span<uint8_t> packed,
                                                 std::span<float> scales, std::span<float> decoded,
                                                 std::vector<float>& scratch);

  // Round to nearest even into fp16 / bf16 bits (kernels/half.h's to_fp16 /
  // to_bf16), and back.
  virtual void cast_half(std::span<const float> x, HalfType type, std::span<uint16_t> out) = 0;
  virtual void widen_half(std::span<const uint16_t> x, HalfType type, std::span<float> out) = 0;

  // The k largest |x| (ties: the lower index), as ascending indices.
  virtual TopKSelection top_k(std::span<const float> x, uint64_t k, const TopKOptions& options) = 0;
  // e[i] += delta[i] (error feedback's a, formed in the residual), then
  // top_k(e): the same selection. The CPU backend does both in one pass
  // over memory where the sampled threshold holds.
  virtual TopKSelection add_top_k(std::span<float> e, std::span<const float> delta, uint64_t k,
                                  const TopKOptions& options) {
    add(e, delta, e);
    return top_k(e, k, options);
  }

  // dct_chunk / idct_chunk over consecutive 4096-element chunks; x.size() is
  // a multiple of kDctChunk.
  virtual void dct_chunks(std::span<const float> x, std::span<float> out, bool inverse) = 0;
  // In every chunk of `chunk` elements (the last may be shorter), the k
  // largest |x| (ties: the lower index); ascending indices into x.
  virtual std::vector<uint64_t> chunk_top_k(std::span<const float> x, uint32_t chunk, uint32_t k) = 0;

  // c(m, n) = op(a)(m, k) * op(b)(k, n), row-major, fp32 accumulation.
  virtual void matmul(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, std::span<const float> a,
                      std::span<const float> b, std::span<float> c) = 0;
  // Orthonormalizes the r columns of p (m x r, row-major) in place by
  // Gram-Schmidt, in column order; a column that vanishes (norm below 1e-12
  // after its projections are removed) becomes zero.
  virtual void orthonormalize_columns(std::span<float> p, int64_t m, int64_t r) = 0;
};

// The CPU backend (one per process).
CompressionKernels& cpu_compression_kernels();

// The CUDA backend on device 0, or why there is none: this build has no CUDA
// backend, or no device is usable. (One per process.)
Result<CompressionKernels*> cuda_compression_kernels();

// By name, as a user picks it: "cpu"; "cuda" (an error naming why when there
// is no usable GPU); "auto" (the CUDA backend when it is usable, else the CPU).
Result<CompressionKernels*> compression_kernels_named(std::string_view device);

}  // namespace fedmesh::kernels
