// Arrays of fp32 to and from fp16 / bf16, with the bits of kernels/half.h's
// element-wise conversions (round to nearest even, NaNs as half.h makes
// them). On x86-64 CPUs with F16C and AVX2 (checked once, at run time) they
// convert 8 values an instruction; elsewhere they run half.h's branch-free
// loops. Halves are 2-byte little-endian values at any alignment (a
// segment's bytes, a tensor's storage). Plain loops, no threads: callers
// split the work.
#pragma once

#include <cstddef>

namespace fedmesh {

void fp32_to_fp16(const float* in, void* out, size_t n);
void fp32_to_bf16(const float* in, void* out, size_t n);
void fp16_to_fp32(const void* in, float* out, size_t n);
void bf16_to_fp32(const void* in, float* out, size_t n);

// The same for either half type: bf16 when `brain`, else fp16.
inline void fp32_to_half(const float* in, void* out, size_t n, bool brain) {
  if (brain) {
    fp32_to_bf16(in, out, n);
  } else {
    fp32_to_fp16(in, out, n);
  }
}
inline void half_to_fp32(const void* in, float* out, size_t n, bool brain) {
  if (brain) {
    bf16_to_fp32(in, out, n);
  } else {
    fp16_to_fp32(in, out, n);
  }
}

// Whether the F16C/AVX2 loops run on this CPU (for reports).
bool half_arrays_use_f16c();

}  // namespace fedmesh
