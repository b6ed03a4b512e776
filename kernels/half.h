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

inline bf16 to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN, keep sign
  }
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

inline float to_float(fp16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  const uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // subnormal: value = mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline fp16 to_fp16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN
    return fp16{static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  }
  if (abs >= 0x477ff000u) return fp16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to Inf (>= 65520)
  if (abs < 0x38800000u) {  // below the smallest normal 2^-14: subnormal or zero
    // value / 2^-24 rounded to nearest even gives the subnormal mantissa
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // exact: power of two
    // round half to even using the float's own rounding: add and subtract 2^23
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;
    return fp16{static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded))};
  }
  const uint32_t mantissa_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xfffu + mantissa_odd;
  return fp16{static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
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
