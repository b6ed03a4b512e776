// A trainable parameter: fp32 master value and gradient, plus the copy the
// layers compute with (the master itself in fp32, a bf16/fp16 copy in mixed
// precision, refreshed after every optimizer step).
#pragma once

#include <string>

#include "kernels/tensor.h"

namespace fedmesh {

struct Parameter {
  std::string name;  // stable, e.g. "conv1.weight": identifies the tensor on the wire
  Tensor value;      // fp32 master weights
  Tensor grad;       // fp32, same shape
  Tensor compute;    // what forward/backward read: value itself, or a low-precision copy

  Parameter(std::string parameter_name, Shape shape);
  // Makes `compute` a copy in `dtype` (or `value` itself for fp32) and fills it.
  void set_compute_dtype(DType dtype);
  // Re-rounds the compute copy from the master after the master changed.
  void refresh_compute();
  // Moves master, gradient and compute copy to `device` (their values kept).
  void to_device(Device device);
};

}  // namespace fedmesh
