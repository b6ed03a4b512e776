// Causal attention run both ways for the tests that hold the device's
// attention to the CPU's (test_cuda_ops on a GPU, test_device_training
// everywhere): the forward pass, then the backward pass from a given dout.
#pragma once

#include <cstddef>

#include "kernels/attention.h"
#include "kernels/device_ops.h"
#include "kernels/tensor.h"

namespace fedmesh::testing {

struct AttentionPass {
  Tensor out, saved, dqkv;
};

// On the device qkv and dout live on; there with the given workspace bound
// (device_ops.h: how many sequences' scores one pass holds).
inline AttentionPass attention_pass(const AttentionShape& s, const Tensor& qkv, const Tensor& dout,
                                    size_t workspace_bytes = device::kAttentionWorkspaceBytes) {
  AttentionPass r{Tensor::empty(dout.shape(), dout.dtype(), qkv.device()), Tensor(),
                  Tensor::empty(qkv.shape(), qkv.dtype(), qkv.device())};
  if (qkv.device() == Device::kCuda) {
    device::causal_attention_forward(s, qkv, r.out, r.saved, workspace_bytes);
    device::causal_attention_backward(s, qkv, r.out, r.saved, dout, r.dqkv, workspace_bytes);
  } else {
    causal_attention_forward(s, qkv, r.out, r.saved);
    causal_attention_backward(s, qkv, r.out, r.saved, dout, r.dqkv);
  }
  return r;
}

}  // namespace fedmesh::testing
