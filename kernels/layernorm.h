// Layer normalization over the last dimension, and group normalization over
// groups of channels, with saved statistics for the backward pass.
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

// Group norm (torch.nn.GroupNorm) of x (batch, channels, positions...): the
// channels of each sample in `groups` equal groups, each normalized over
// its channels and positions, then scaled and shifted per channel.
inline constexpr float kGroupNormEpsilon = 1e-5f;
struct GroupNormShape {
  int64_t batch = 0, channels = 0, positions = 0, groups = 1;
  int64_t group_size() const { return channels / groups * positions; }  // values per (sample, group)
};
// Per (sample, group), in fp64 over its values in memory order: the sum and
// the sum of squares; mean = sum / size (stored rounded to fp32), rstd =
// 1 / sqrt(max(0, squares / size - mean²) + epsilon) in fp32; then
// y = (x - mean) * rstd * gamma[c] + beta[c] in fp32. gamma, beta
// (channels), mean, rstd (batch * groups): fp32.
void groupnorm_forward(const GroupNormShape& s, const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                       Tensor& mean, Tensor& rstd, float epsilon = kGroupNormEpsilon);
// With x̂ = (x - mean) * rstd recomputed and d = dy * gamma[c]: per (sample,
// group) md = mean(d) and mx = mean(d x̂), in fp64 in memory order; dx =
// rstd * (d - md - x̂ mx) (fp32 result; dx overwritten when not null).
// dgamma[c] += sum of dy x̂ and dbeta[c] += sum of dy over the samples and
// positions of channel c, each summed in fp64 (sample-major) and added once.
void groupnorm_backward(const GroupNormShape& s, const Tensor& x, const Tensor& dy, const Tensor& gamma,
                        const Tensor& mean, const Tensor& rstd, Tensor* dx, Tensor& dgamma, Tensor& dbeta);

}  // namespace fedmesh
