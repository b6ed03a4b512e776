// Layer normalization over the last dimension, with saved statistics for the
// backward pass.
#pragma once

#include "kernels/tensor.h"

namespace fedmesh {

inline constexpr float kLayerNormEpsilon = 1e-5f;

// x, y (rows, n) any dtype; gamma, beta (n) fp32; mean, rstd (rows) fp32 outputs.
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y, Tensor& mean,
                       Tensor& rstd, float epsilon = kLayerNormEpsilon);
// dx (rows, n) any dtype (overwritten); dgamma, dbeta (n) fp32 (accumulated into).
void layernorm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta);

}  // namespace fedmesh
