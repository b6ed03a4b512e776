// General matrix multiply on the CPU: OpenBLAS sgemm with fp32 accumulation.
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace fedmesh {

// c(m,n) = alpha * op(a)(m,k) · op(b)(k,n) + beta * c, on row-major float buffers.
void sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The same on 2-D tensors of any dtype. fp32 operands go straight to sgemm;
// bf16/fp16 operands are widened to fp32 one block of kGemmBlockK along k at a
// time (never a whole-tensor copy), and a bf16/fp16 c is accumulated in fp32
// and rounded once at the end.
inline constexpr int64_t kGemmBlockK = 256;

// m, n, k of gemm()'s operands, checked (2-D, matching): shared by the CPU
// kernel and its CUDA counterpart (device_ops.h).
struct GemmDims {
  int64_t m, n, k;
};
GemmDims gemm_dims(bool transpose_a, bool transpose_b, const Tensor& a, const Tensor& b, const Tensor& c);

void gemm(bool transpose_a, bool transpose_b, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c);

}  // namespace fedmesh
