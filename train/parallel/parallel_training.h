// One process's part in training a model over a group of ranks: data
// parallelism over the whole group, or tensor parallelism (the model's
// transformer blocks sharded over tensor groups, tensor_parallel_model.h)
// with data parallelism across the groups. `fedmesh train --ranks M
// --tensor-parallel N` and a node's ranks (node/site_ranks.h) build the
// same thing here.
#pragma once

#include <memory>
#include <optional>

#include "train/parallel/data_parallel.h"
#include "train/parallel/rank_group.h"
#include "train/parallel/tensor_parallel_model.h"

namespace fedmesh::train {

class ParallelTraining {
 public:
  // Every process of the group calls it, after the group connected, with
  // the same model (whole, built alike; broadcast first where it may
  // differ) and `flags` of its own rank (rank 0: flags.rendezvous = its
  // group's directory()). Without tensor parallelism, data parallelism
  // runs over `world`; with it, the tensor and data-parallel groups are
  // connected and the model's blocks are sharded (the optimizer's state
  // too, when given): the model then holds shards until gather().
  static Result<std::unique_ptr<ParallelTraining>> start(Communicator& world, const RankFlags& flags, Sequential& model,
                                                         Optimizer* optimizer, const DataParallelOptions& options);

  // The trainer's gradient sync, and the data-parallel part of it (null
  // when there is a single data-parallel rank).
  GradientSync& hook() { return tensor_sync_ ? static_cast<GradientSync&>(*tensor_sync_) : *data_parallel_; }
  DataParallel* data_parallel() { return data_parallel_ ? &*data_parallel_ : nullptr; }
  // Null without tensor parallelism.
  TensorParallelModel* tensor() { return tensor_.get(); }
  // Whole blocks in the model (collective over the tensor group), or
  // shards (local); no-ops without tensor parallelism.
  Status gather(Optimizer* optimizer = nullptr) { return tensor_ ? tensor_->gather(optimizer) : Status::ok(); }
  void scatter(Optimizer* optimizer = nullptr) {
    if (tensor_) tensor_->scatter(optimizer);
  }

 private:
  ParallelTraining() = default;
  ParallelGroups groups_;
  std::unique_ptr<TensorParallelModel> tensor_;
  std::optional<DataParallel> data_parallel_;
  std::optional<TensorParallelSync> tensor_sync_;
};

}  // namespace fedmesh::train
