#include "kernels/parameter.h"

#include "kernels/convert.h"

namespace fedmesh {

Parameter::Parameter(std::string parameter_name, Shape shape)
    : name(std::move(parameter_name)), value(Tensor::zeros(shape)), grad(Tensor::zeros(shape)), compute(value) {}

void Parameter::set_compute_dtype(DType dtype) {
  compute = dtype == DType::kF32 ? value : Tensor::empty(value.shape(), dtype, value.device());
  refresh_compute();
}

void Parameter::to_device(Device device) {
  if (value.device() == device) return;
  const bool shared = compute.raw() == value.raw();
  value = value.to(device);
  grad = grad.to(device);
  compute = shared ? value : compute.to(device);
}

void Parameter::refresh_compute() {
  if (compute.raw() != value.raw()) convert(value, compute);
}

}  // namespace fedmesh
