#include "node/parallel/data_parallel.h"

#include <memory>
#include <vector>

namespace fedmesh::node {

Trainer::GradientHook data_parallel_hook(Communicator& communicator) {
  auto buffer = std::make_shared<std::vector<float>>();
  return [&communicator, buffer](std::span<Parameter* const> parameters, int64_t samples) -> Status {
    size_t total = 1;  // the last slot carries the sample count
    for (const Parameter* p : parameters) {
      if (p->grad.dtype() != DType::kF32) return invalid_argument("data parallel: gradient " + p->name + " is not fp32");
      total += static_cast<size_t>(p->grad.numel());
    }
    buffer->resize(total);
    size_t at = 0;
    const float weight = static_cast<float>(samples);
    for (const Parameter* p : parameters) {
      const float* g = p->grad.data<float>();
      for (int64_t i = 0; i < p->grad.numel(); ++i) (*buffer)[at++] = g[i] * weight;
    }
    (*buffer)[at] = weight;
    FEDMESH_RETURN_IF_ERROR(communicator.all_reduce_sum(*buffer));
    const float all_samples = buffer->back();
    if (!(all_samples > 0.0f)) return invalid_argument("data parallel: no rank had samples in this step");
    const float inverse = 1.0f / all_samples;
    at = 0;
    for (Parameter* p : parameters) {
      float* g = p->grad.data<float>();
      for (int64_t i = 0; i < p->grad.numel(); ++i) g[i] = (*buffer)[at++] * inverse;
    }
    return Status::ok();
  };
}

}  // namespace fedmesh::node
