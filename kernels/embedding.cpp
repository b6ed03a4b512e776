#include "kernels/embedding.h"

#include "kernels/device_ops.h"
#include "kernels/step_profile.h"

namespace fedmesh {

void embedding_forward(const Tensor& table, std::span<const int32_t> ids, Tensor& out) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("embedding_forward", {&table, &out});
  FEDMESH_CHECK(table.rank() == 2, "embedding table must be 2-D");
  const int64_t vocabulary = table.dim(0), dim = table.dim(1);
  FEDMESH_CHECK(out.numel() == static_cast<int64_t>(ids.size()) * dim, "embedding_forward: output shape");
  visit_dtype(table.dtype(), [&]<class In>() {
    visit_dtype(out.dtype(), [&]<class Out>() {
      const In* src = table.data<In>();
      Out* dst = out.data<Out>();
      for (size_t i = 0; i < ids.size(); ++i) {
        FEDMESH_CHECK(ids[i] >= 0 && ids[i] < vocabulary, "embedding id " + std::to_string(ids[i]) +
                                                              " outside a vocabulary of " +
                                                              std::to_string(vocabulary));
        const In* row = src + ids[i] * dim;
        for (int64_t j = 0; j < dim; ++j) dst[static_cast<int64_t>(i) * dim + j] = from_float<Out>(to_float(row[j]));
      }
    });
  });
}

void embedding_backward(std::span<const int32_t> ids, const Tensor& dout, Tensor& dtable) {
  const ProfileScope profile(StepTime::kKernels);
  device::require_host("embedding_backward", {&dout, &dtable});
  const int64_t vocabulary = dtable.dim(0), dim = dtable.dim(1);
  FEDMESH_CHECK(dout.numel() == static_cast<int64_t>(ids.size()) * dim, "embedding_backward: shapes");
  float* table = dtable.data<float>();
  visit_dtype(dout.dtype(), [&]<class T>() {
    const T* grad = dout.data<T>();
    for (size_t i = 0; i < ids.size(); ++i) {
      FEDMESH_CHECK(ids[i] >= 0 && ids[i] < vocabulary, "embedding id out of range");
      float* row = table + ids[i] * dim;
      for (int64_t j = 0; j < dim; ++j) row[j] += to_float(grad[static_cast<int64_t>(i) * dim + j]);
    }
  });
}

}  // namespace fedmesh
