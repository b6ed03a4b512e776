// fp16 / bf16 <-> fp32 on the device, bit for bit as kernels/half.h computes
// them on the host (shared by the compression kernels and the training ops).
//
// Finite values and infinities: the hardware's round-to-nearest-even
// conversions, which are what half.h computes (overflow to Inf included).
// NaN: half.h's quiet NaN with the sign kept (fp16 drops the payload, bf16
// keeps its top bits), written out because cvt gives a canonical NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fedmesh::cuda {

__device__ __forceinline__ uint16_t device_half_bits(float v, bool bf16) {
  const uint32_t u = __float_as_uint(v);
  if (isnan(v)) {
    return bf16 ? static_cast<uint16_t>((u >> 16) | 0x0040u) : static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u);
  }
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

__device__ __forceinline__ float device_bf16_to_float(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// half.h's to_float(fp16) bit for bit (NaN payloads kept, unlike cvt).
__device__ __forceinline__ float device_fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return __uint_as_float(sign);
    const float magnitude = __fmul_rn(static_cast<float>(mantissa), 5.9604644775390625e-8f);  // exact: * 2^-24
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace fedmesh::cuda
