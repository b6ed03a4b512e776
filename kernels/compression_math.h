// The scalar arithmetic of update compression, shared by the encoders
// (protocol/codec, protocol/compressor), the CPU backend of
// CompressionKernels and, in spirit, its CUDA backend: everything a receiver
// must reproduce bit for bit (the quantization grid, the random draws of
// stochastic rounding, the DCT basis) is defined once here. Plain loops over
// plain pointers; no BLAS, no threads, so the codec and its fuzz target can
// compile it alone.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace fedmesh::kernels {

enum class Rounding : uint8_t {
  kNearest = 0,     // round half to even
  kStochastic = 1,  // floor(x / scale + u), u uniform in [0, 1): unbiased
};

inline constexpr int kInt8Max = 127;
inline constexpr int kInt4Max = 7;

// splitmix64: a bijective mixer; uniform_at(seed, i) is the draw for element i
// under seed, the same whatever order or device computes it (a counter-based
// generator: no state to carry from one element to the next).
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// In [0, 1) with 24 random bits (exact in fp32).
constexpr float uniform_at(uint64_t seed, uint64_t index) {
  return static_cast<float>(splitmix64(seed ^ splitmix64(index)) >> 40) * 0x1p-24f;
}

// The largest |x_i| of n values (0 for none); NaN if one is NaN.
float block_max_abs(const float* x, uint64_t n);

// max_abs / q_max, nudged down where q_max * scale would round to Inf (max_abs
// near FLT_MAX), so that every q * scale decodes to a finite value. 0 for an
// all-zero block: its values stay 0.
float quantization_scale(float max_abs, int q_max);

// Symmetric absmax block quantization to `bits` (8 or 4). scales[b] =
// quantization_scale(max |x| over block b); q = clamp(round(x / scale)) with
// kNearest, clamp(floor(x / scale + uniform_at(seed, first_index + i))) with
// kStochastic. packed: one int8 per element (bits 8), or two int4 per byte,
// low nibble first (bits 4; an odd count leaves the last high nibble 0).
// first_index is the position of x[0] in its tensor, so that cutting a tensor
// into segments does not change the random draws. x must be finite.
void quantize_blocks(const float* x, uint64_t n, int bits, uint32_t block_size, Rounding rounding, uint64_t seed,
                     uint64_t first_index, uint8_t* packed, float* scales);
void dequantize_blocks(const uint8_t* packed, uint64_t n, int bits, uint32_t block_size, const float* scales,
                       float* out);

// The orthonormal 2-D DCT-II of 64 x 64 chunks (row-major, 4096 elements) and
// its inverse (DCT-III): out = C x C^T and x = C^T out C with
// C[k][j] = a_k cos(pi (2j + 1) k / 128), a_0 = sqrt(1/64), a_k = sqrt(2/64).
inline constexpr uint32_t kDctSide = 64;
inline constexpr uint32_t kDctChunk = kDctSide * kDctSide;
void dct_chunk(const float* in, float* out);
// C itself (row k is basis vector k), computed in double and rounded once;
// the CUDA backend multiplies by the same matrix.
const std::array<float, kDctChunk>& dct_basis();
void idct_chunk(const float* in, float* out);

// Orders positions by |x| descending, ties by the lower position: the one
// order every top-k in fedmesh selects by.
inline bool larger_magnitude_first(float a_abs, uint64_t a_index, float b_abs, uint64_t b_index) {
  return a_abs > b_abs || (a_abs == b_abs && a_index < b_index);
}

}  // namespace fedmesh::kernels
