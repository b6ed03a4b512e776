#include "train/parallel/parallel_training.h"

#include <utility>

namespace fedmesh::train {

Result<std::unique_ptr<ParallelTraining>> ParallelTraining::start(Communicator& world, const RankFlags& flags,
                                                                  Sequential& model, Optimizer* optimizer,
                                                                  const DataParallelOptions& options) {
  std::unique_ptr<ParallelTraining> out(new ParallelTraining());
  if (flags.tensor_parallel == 1) {
    out->data_parallel_.emplace(world, model, options);
    return out;
  }
  Result<ParallelGroups> groups = connect_parallel_groups(flags, model.device());
  if (!groups.is_ok()) return groups.status();
  out->groups_ = std::move(*groups);
  Result<std::unique_ptr<TensorParallelModel>> tensor = TensorParallelModel::shard(model, *out->groups_.tensor, optimizer);
  if (!tensor.is_ok()) return tensor.status();
  out->tensor_ = std::move(*tensor);
  // The data-parallel sync keeps the shards' parameters: built while they are in the model.
  if (out->groups_.data) out->data_parallel_.emplace(*out->groups_.data, model, options);
  out->tensor_sync_.emplace(*out->tensor_, out->data_parallel());
  return out;
}

}  // namespace fedmesh::train
