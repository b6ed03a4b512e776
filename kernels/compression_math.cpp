#include "kernels/compression_math.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>

namespace fedmesh::kernels {
namespace {

// Rounds |x| <= 2^22 to the nearest integer, ties to even, with two additions
// (vectorizable, unlike a call to roundf on baseline x86-64).
inline float round_small(float x) {
  constexpr float kMagic = 0x1.8p23f;
  return (x + kMagic) - kMagic;
}

inline int quantize_one(float x, float scale, int q_max, Rounding rounding, uint64_t seed, uint64_t index) {
  const float r = x / scale;
  const float q = rounding == Rounding::kNearest ? round_small(r) : std::floor(r + uniform_at(seed, index));
  return static_cast<int>(std::clamp(q, -static_cast<float>(q_max), static_cast<float>(q_max)));
}

// C^T, so that both products below read their matrix row by row.
const std::array<float, kDctChunk>& dct_basis_transposed() {
  static const std::array<float, kDctChunk> transposed = [] {
    std::array<float, kDctChunk> t{};
    const std::array<float, kDctChunk>& c = dct_basis();
    for (uint32_t k = 0; k < kDctSide; ++k) {
      for (uint32_t j = 0; j < kDctSide; ++j) t[j * kDctSide + k] = c[k * kDctSide + j];
    }
    return t;
  }();
  return transposed;
}

// out = L · in · R for 64 x 64 row-major matrices, where L and R are C or C^T.
// Both products run with the innermost loop over a row (it vectorizes); each
// output still sums its terms in the order j = 0..63.
void transform(const float* in, float* out, bool inverse) {
  const float* c = dct_basis().data();
  // R[j][k]: C^T forward (= C[k][j]), C inverse.
  const float* r = inverse ? dct_basis().data() : dct_basis_transposed().data();
  constexpr uint32_t n = kDctSide;
  std::array<float, kDctChunk> tmp{};
  // tmp = in · R
  for (uint32_t i = 0; i < n; ++i) {
    float* row = tmp.data() + i * n;
    for (uint32_t j = 0; j < n; ++j) {
      const float a = in[i * n + j];
      const float* r_row = r + j * n;
      for (uint32_t k = 0; k < n; ++k) row[k] += a * r_row[k];
    }
  }
  // out = L · tmp  (L = C forward, C^T inverse)
  for (uint32_t k = 0; k < n; ++k) {
    for (uint32_t j = 0; j < n; ++j) out[k * n + j] = 0.0f;
    for (uint32_t i = 0; i < n; ++i) {
      const float l = inverse ? c[i * n + k] : c[k * n + i];
      for (uint32_t j = 0; j < n; ++j) out[k * n + j] += l * tmp[i * n + j];
    }
  }
}

}  // namespace

float block_max_abs(const float* x, uint64_t n) {
  // On the magnitudes' bit patterns: for non-negative floats the integer order
  // is the numeric order, and an integer maximum vectorizes (a float one is
  // not reassociated by the compiler: it ran as one dependent chain). A NaN
  // is the largest pattern, so it comes out as the result.
  uint32_t m = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(x[i]) & 0x7fffffffu;
    m = bits > m ? bits : m;
  }
  return std::bit_cast<float>(m);
}

const std::array<float, kDctChunk>& dct_basis() {
  static const std::array<float, kDctChunk> basis = [] {
    std::array<float, kDctChunk> c{};
    const double pi = std::acos(-1.0);
    for (uint32_t k = 0; k < kDctSide; ++k) {
      const double a = k == 0 ? std::sqrt(1.0 / kDctSide) : std::sqrt(2.0 / kDctSide);
      for (uint32_t j = 0; j < kDctSide; ++j) {
        c[k * kDctSide + j] = static_cast<float>(a * std::cos(pi * (2.0 * j + 1.0) * k / (2.0 * kDctSide)));
      }
    }
    return c;
  }();
  return basis;
}

float quantization_scale(float max_abs, int q_max) {
  float scale = max_abs / static_cast<float>(q_max);
  while (scale > 0.0f && !std::isfinite(static_cast<float>(q_max) * scale)) scale = std::nextafter(scale, 0.0f);
  return scale;
}

void quantize_blocks(const float* x, uint64_t n, int bits, uint32_t block_size, Rounding rounding, uint64_t seed,
                     uint64_t first_index, uint8_t* packed, float* scales) {
  const bool int4 = bits == 4;
  const int q_max = int4 ? kInt4Max : kInt8Max;
  const uint64_t blocks = (n + block_size - 1) / block_size;
  // An even block size starts every block on a whole int4 byte: each block
  // writes its own bytes. An odd one shares bytes between blocks: zero them
  // all first and OR the nibbles in.
  const bool whole_bytes = int4 && block_size % 2 == 0;
  if (int4 && !whole_bytes) std::fill(packed, packed + (n + 1) / 2, uint8_t{0});
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t first = b * block_size;
    const uint64_t count = std::min<uint64_t>(block_size, n - first);
    const float scale = quantization_scale(block_max_abs(x + first, count), q_max);
    scales[b] = scale;
    if (whole_bytes) std::fill(packed + first / 2, packed + (first + count + 1) / 2, uint8_t{0});
    if (!(scale > 0.0f)) {
      if (!int4) std::fill(packed + first, packed + first + count, uint8_t{0});
      continue;
    }
    if (whole_bytes && rounding == Rounding::kNearest) {
      // Two elements a byte, low nibble first: the same q as quantize_one,
      // branch-free so that it vectorizes.
      const float limit = static_cast<float>(q_max);
      const uint64_t pairs = count / 2;
      const float* xs = x + first;
      uint8_t* bytes = packed + first / 2;
      for (uint64_t p = 0; p < pairs; ++p) {
        const auto low = static_cast<int>(std::clamp(round_small(xs[2 * p] / scale), -limit, limit));
        const auto high = static_cast<int>(std::clamp(round_small(xs[2 * p + 1] / scale), -limit, limit));
        bytes[p] = static_cast<uint8_t>((low & 0xf) | ((high & 0xf) << 4));
      }
      if (count % 2 != 0) {
        const auto last = static_cast<int>(std::clamp(round_small(xs[count - 1] / scale), -limit, limit));
        bytes[pairs] = static_cast<uint8_t>(last & 0xf);
      }
    } else if (int4) {
      for (uint64_t i = first; i < first + count; ++i) {
        const int q = quantize_one(x[i], scale, q_max, rounding, seed, first_index + i);
        packed[i / 2] |= static_cast<uint8_t>((q & 0xf) << (4 * (i & 1)));
      }
    } else if (rounding == Rounding::kNearest) {
      const float limit = static_cast<float>(q_max);
      for (uint64_t i = first; i < first + count; ++i) {  // the hot loop: branch-free so it vectorizes
        const float q = std::clamp(round_small(x[i] / scale), -limit, limit);
        packed[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
    } else {
      for (uint64_t i = first; i < first + count; ++i) {
        packed[i] = static_cast<uint8_t>(static_cast<int8_t>(quantize_one(x[i], scale, q_max, rounding, seed,
                                                                          first_index + i)));
      }
    }
  }
}

void dequantize_blocks(const uint8_t* packed, uint64_t n, int bits, uint32_t block_size, const float* scales,
                       float* out) {
  const uint64_t blocks = (n + block_size - 1) / block_size;
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t first = b * block_size;
    const uint64_t count = std::min<uint64_t>(block_size, n - first);
    const float scale = scales[b];
    if (bits == 4 && first % 2 == 0) {
      // A byte at a time, low nibble first (vectorizes).
      const uint8_t* bytes = packed + first / 2;
      float* o = out + first;
      for (uint64_t p = 0; p < count / 2; ++p) {
        o[2 * p] = static_cast<float>(((bytes[p] & 0xf) ^ 8) - 8) * scale;
        o[2 * p + 1] = static_cast<float>(((bytes[p] >> 4) ^ 8) - 8) * scale;
      }
      if (count % 2 != 0) o[count - 1] = static_cast<float>(((bytes[count / 2] & 0xf) ^ 8) - 8) * scale;
    } else if (bits == 4) {
      for (uint64_t i = first; i < first + count; ++i) {
        const int nibble = (packed[i / 2] >> (4 * (i & 1))) & 0xf;
        out[i] = static_cast<float>((nibble ^ 8) - 8) * scale;
      }
    } else {
      for (uint64_t i = first; i < first + count; ++i) out[i] = static_cast<float>(static_cast<int8_t>(packed[i])) * scale;
    }
  }
}

void dct_chunk(const float* in, float* out) { transform(in, out, /*inverse=*/false); }
void idct_chunk(const float* in, float* out) { transform(in, out, /*inverse=*/true); }

}  // namespace fedmesh::kernels
