// Widening and narrowing copies between fp32 and the storage dtypes.
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace fedmesh {

// dst[i] = float(src[i]) for n elements of dtype `src_dtype`.
void widen_to_f32(const void* src, DType src_dtype, float* dst, int64_t n);
// dst[i] = dtype(src[i]) rounded to nearest even.
void narrow_from_f32(const float* src, void* dst, DType dst_dtype, int64_t n);
// Copies src into dst (same element count), converting the dtype.
void convert(const Tensor& src, Tensor& dst);
// A new tensor of `dtype` holding src's values, on src's device.
Tensor to_dtype(const Tensor& src, DType dtype);

}  // namespace fedmesh
