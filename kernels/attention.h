// Causal multi-head self-attention: the core between the QKV projection and
// the output projection of a GPT-style block, with an explicit backward pass.
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace fedmesh {

struct AttentionShape {
  int64_t batch, seq, heads, head_dim;
};

// qkv: (batch, seq, 3 * heads * head_dim) any dtype, laid out [q | k | v] along
// the last axis with each head's slice contiguous (head h of q at columns
// h*head_dim .. (h+1)*head_dim, of k at heads*head_dim + h*head_dim, ...), as
// GPT-2 lays out the output of c_attn. (batch * seq, 3 * heads * head_dim) is
// accepted too: only the element count and the last axis are checked.
// out: (batch, seq, heads * head_dim) any dtype, heads side by side like q.
// saved: made (batch, heads, seq) fp32 by Tensor::reuse and filled with each
// query row's log-sum-exp L[t] = log Σ_{j<=t} exp(scores[t][j]), the softmax's
// normalizer: the backward pass recomputes P[t][j] = exp(scores[t][j] − L[t])
// from it and q, k, so what a training step keeps is O(seq) per head, not the
// O(seq²) probabilities (as flash attention does; the (seq, seq) rows live in
// one scratch buffer per worker thread, reused for every head).
//
//   scores = q·kᵀ / sqrt(head_dim), position t attending to positions <= t,
//   P = softmax over the key axis (row max subtracted), out = P·v.
//
// All arithmetic and accumulation in fp32 whatever the dtypes: inputs are
// widened on load and outputs rounded once on store. Results are the same
// bits for the same inputs and thread count.
void causal_attention_forward(const AttentionShape& s, const Tensor& qkv, Tensor& out, Tensor& saved);

// dqkv (shape of qkv, any dtype, overwritten) from dout (shape of out, any
// dtype), given the qkv, the out and the saved log-sum-exps of the forward
// pass (P recomputed from them):
//   dV = Pᵀ·dout, dP = dout·vᵀ, dS = P ∘ (dP − delta),
//   dQ = dS·k / sqrt(head_dim), dK = dSᵀ·q / sqrt(head_dim),
// with delta = rowsum(dP ∘ P) = rowsum(dout ∘ out) (the same quantity, as
// out = P·v). This CPU kernel, the reference, checks out's shape but takes
// delta from dP and P in fp32 and so does not read out; the fused device
// kernels (device_ops.h) read it and take delta = rowsum(dout ∘ out) from the
// rounded out, which saves them a pass over the keys.
void causal_attention_backward(const AttentionShape& s, const Tensor& qkv, const Tensor& out, const Tensor& saved,
                               const Tensor& dout, Tensor& dqkv);

}  // namespace fedmesh
