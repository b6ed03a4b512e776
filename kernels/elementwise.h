// Elementwise ops and reductions. Inputs and outputs may be fp32, bf16 or
// fp16; arithmetic and accumulation are fp32 (reductions accumulate in fp64
// where the result feeds a norm or a loss).
#pragma once

#include <cstdint>
#include <span>

#include "kernels/tensor.h"

namespace fedmesh {

void fill(Tensor& x, float value);
void scale(Tensor& x, float factor);                       // x *= factor
void axpy(float alpha, const Tensor& x, Tensor& y);        // y += alpha * x
void add(const Tensor& a, const Tensor& b, Tensor& out);   // out = a + b
void mul(const Tensor& a, const Tensor& b, Tensor& out);   // out = a * b (on the device: b fp32)

// y (rows, n) += bias (n), broadcast over rows.
void add_bias(Tensor& y, const Tensor& bias);
// db (n) = [accumulate ? db : 0] + sum over rows of dy (rows, n); db is fp32.
void bias_grad(const Tensor& dy, Tensor& db, bool accumulate);
// db (c) = sum over batch and positions of dy (batch, c, positions); db is fp32.
void channel_bias_grad(const Tensor& dy, Tensor& db, bool accumulate);

void relu_forward(const Tensor& x, Tensor& y);
// dx = dy where y > 0 else 0 (y is the forward output; dx may alias dy).
void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx);

// GELU, tanh approximation (as in GPT-2).
void gelu_forward(const Tensor& x, Tensor& y);
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
// SiLU, y = x * sigmoid(x) (torch.nn.SiLU), in fp32: x / (1 + e^-x) as
// x * (1 / (1 + e^-x)); dx = dy * s (1 + x (1 - s)), s = sigmoid(x) (dx may alias dy).
void silu_forward(const Tensor& x, Tensor& y);
void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);

double sum(const Tensor& x);
double squared_l2_norm(const Tensor& x);
float max_abs(const Tensor& x);
bool all_finite(const Tensor& x);
// Index of the largest value in each row of x (rows, n).
void argmax_rows(const Tensor& x, std::span<int32_t> out);

}  // namespace fedmesh
