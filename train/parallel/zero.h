// ZeRO stage 1 (Rajbhandari et al., 2020): the optimizer state is sharded
// across the data-parallel ranks. The gradients are all-reduced as usual
// (DataParallel), so every rank still checks them, clips them and unscales
// them on the whole; then each rank steps only its contiguous 1/N of the
// flattened parameters, with optimizer state for that part alone, and an
// all-gather hands every rank the others' updated parts. The arithmetic per
// element is the optimizer's own, so the weights are bit-identical to
// those of unsharded data parallelism (tests/train/test_data_parallel.cpp),
// with 1/N of AdamW's two moments (or SGD's momentum) per rank.
#pragma once

#include <memory>
#include <vector>

#include "kernels/optimizer.h"
#include "train/parallel/communicator.h"
#include "train/trainer.h"

namespace fedmesh::train {

class ShardedOptimizer final : public Optimizer {
 public:
  // `options` names the optimizer (sgd or adamw) and its settings;
  // `communicator` must outlive this.
  ShardedOptimizer(const TrainOptions& options, Communicator& communicator);
  void step(std::vector<Parameter*>& parameters, float lr) override;
  std::string name() const override;
  // This rank's shard of the state ("zero1.exp_avg", ...), one flat tensor
  // each: a checkpoint of it is one rank's, not the run's.
  std::vector<OptimizerStateTensor> state_tensors(const std::vector<Parameter*>& parameters) override;
  // The first failed all-gather (the ranks' weights then differ: the run
  // must stop); ok otherwise.
  const Status& status() const { return status_; }
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_; }

 private:
  void shape_for(const std::vector<Parameter*>& parameters);
  TrainOptions options_;
  Communicator& communicator_;
  int64_t total_ = -1, block_ = 0, begin_ = 0, end_ = 0;
  std::vector<Tensor> state_;  // 1 (sgd with momentum), 2 (adamw) or 0 tensors of end_ - begin_
  std::vector<float> gathered_;
  Status status_;
};

}  // namespace fedmesh::train
