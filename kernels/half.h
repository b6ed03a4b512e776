// bf16 and fp16 storage types with round-to-nearest-even conversion from fp32.
// Arithmetic always happens in fp32: these types only load and store.
#pragma once

#include <bit>
#include <cstdint>

namespace fedmesh {

struct bf16 {
  uint16_t bits = 0;
};

struct fp16 {
  uint16_t bits = 0;
};

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }

// The conversions below are written without branches: every case is
// computed and one selected by a bit mask (GCC does not if-convert ternaries
// around fp32 additions), so that loops over arrays vectorize. Their bits are
// those of the plain case analysis (tests/kernels/test_half.cpp checks them
// against an exact oracle; all 2^32 inputs were compared with it once).
inline uint32_t select_bits(bool condition, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = 0u - static_cast<uint32_t>(condition);
  return (if_true & mask) | (if_false & ~mask);
}

// Round to nearest even; a NaN stays a (quiet) NaN with its sign.
inline bf16 to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return bf16{static_cast<uint16_t>(select_bits((u & 0x7fffffffu) > 0x7f800000u, (u >> 16) | 0x0040u, rounded))};
}

inline float to_float(fp16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t shifted = static_cast<uint32_t>(h.bits & 0x7fffu) << 13;  // exponent and mantissa in fp32's place
  const uint32_t exponent = shifted & 0x0f800000u;
  const uint32_t normal = shifted + (uint32_t{127 - 15} << 23);             // rebias the exponent
  const uint32_t special = normal + (uint32_t{128 - 16} << 23);             // Inf / NaN: exponent all ones
  // Zero and subnormals (mantissa x 2^-24): 2^-14 (1 + m / 1024) - 2^-14, exact in fp32.
  const float subnormal = std::bit_cast<float>(normal + (1u << 23)) - std::bit_cast<float>(uint32_t{113} << 23);
  const uint32_t magnitude = select_bits(exponent == 0x0f800000u, special,
                                         select_bits(exponent == 0, std::bit_cast<uint32_t>(subnormal), normal));
  return std::bit_cast<float>(sign | magnitude);
}

// Round to nearest even; finite values of 65520 or more become Inf, a NaN
// the quiet 0x7e00 with its sign.
inline fp16 to_fp16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  const uint32_t special = select_bits(abs > 0x7f800000u, 0x7e00u, 0x7c00u);
  // Below the smallest normal 2^-14: adding 0.5 leaves the subnormal mantissa,
  // rounded to nearest even by the fp32 addition, in the low bits.
  const uint32_t subnormal = std::bit_cast<uint32_t>(std::bit_cast<float>(abs) + 0.5f) - 0x3f000000u;
  // Normal: rebias, round to nearest even on the 13 bits dropped; past the
  // largest finite fp16 the result is Inf.
  const uint32_t rounded = (abs - (uint32_t{127 - 15} << 23) + 0xfffu + ((abs >> 13) & 1u)) >> 13;
  const uint32_t normal = select_bits(rounded > 0x7c00u, 0x7c00u, rounded);
  const uint32_t magnitude = select_bits(abs >= 0x7f800000u, special, select_bits(abs < 0x38800000u, subnormal, normal));
  return fp16{static_cast<uint16_t>(sign | magnitude)};
}

template <class T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16 from_float<bf16>(float x) { return to_bf16(x); }
template <>
inline fp16 from_float<fp16>(float x) { return to_fp16(x); }

}  // namespace fedmesh
