#include "federation/compression_checkpoint.h"

#include <cstring>

namespace fedmesh::federation {

void add_compression_tensors(protocol::UpdateCompressor& compressor, const std::string& prefix,
                             std::deque<Tensor>& views, std::vector<store::TensorToCommit>& out) {
  for (const protocol::UpdateCompressor::StateTensor& t : compressor.state_tensors()) {
    views.push_back(Tensor::view_of(t.values->data(), Shape(t.dims), DType::kF32));
    out.push_back({t.role, prefix + t.name, &views.back()});
  }
}

Status restore_compression_tensors(protocol::UpdateCompressor& compressor, const std::string& prefix,
                                   const store::LoadedCheckpoint& checkpoint) {
  for (const protocol::UpdateCompressor::StateTensor& t : compressor.state_tensors()) {
    const store::StoredTensor* stored = checkpoint.find(t.role, prefix + t.name);
    if (stored == nullptr) {
      return corrupt("the checkpoint has no " + t.role + " tensor '" + prefix + t.name +
                     "' (was it written with another compression plan?)");
    }
    if (stored->value.dtype() != DType::kF32 || static_cast<size_t>(stored->value.numel()) != t.values->size()) {
      return corrupt("the checkpoint's " + t.role + " tensor '" + prefix + t.name + "' has " +
                     std::to_string(stored->value.numel()) + " elements, " + std::to_string(t.values->size()) +
                     " fp32 expected");
    }
    std::memcpy(t.values->data(), stored->value.raw(), t.values->size() * sizeof(float));
  }
  return Status::ok();
}

}  // namespace fedmesh::federation
