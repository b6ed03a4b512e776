// A language model trained with tensor parallelism (`--tensor-parallel N`,
// `training.tensor_parallel`): every transformer block of the model is
// replaced by this rank's shard (train/parallel/tensor_parallel.h), the
// rest (embeddings, final layer norm, tied projection) stays whole and
// replicated on every rank of the tensor group, where it gets the same
// gradients and so stays the same.
//
// The model is whole outside training: a checkpoint, an evaluation, an
// update sent to the federation and a round's new weights all see the
// whole blocks. gather() puts them back (one all-gather of every block's
// slices; the optimizer's state for them too), scatter() cuts the shards
// out of them again (no communication). The shard blocks, and so their
// Parameter objects, live as long as this object: a data-parallel sync
// built on the sharded model keeps pointing at them.
//
// Processes: N_tp x N_dp ranks, the ranks of one tensor group adjacent
// (global rank g: tensor rank g % N_tp, data-parallel rank g / N_tp); each
// tensor group trains one part of every batch, and the data-parallel
// groups (the ranks of one tensor rank) all-reduce the shards' gradients.
#pragma once

#include <memory>
#include <optional>
#include <unordered_set>
#include <vector>

#include "train/model.h"
#include "train/parallel/communicator.h"
#include "train/trainer.h"

namespace fedmesh::train {

class TensorParallelModel {
 public:
  // Shards every TransformerBlock of `model` (fp32 masters on the host) over
  // `tensor_ranks`; with an optimizer, its state for the blocks' parameters
  // is sliced the same way. kInvalidArgument when the model has no
  // transformer block or its heads or MLP features do not divide.
  static Result<std::unique_ptr<TensorParallelModel>> shard(Sequential& model, Communicator& tensor_ranks,
                                                            Optimizer* optimizer = nullptr);
  TensorParallelModel(const TensorParallelModel&) = delete;
  TensorParallelModel& operator=(const TensorParallelModel&) = delete;

  // Collective over the tensor ranks: whole blocks, assembled from every
  // rank's shards, back in the model (on every rank of the group), and the
  // optimizer's state for them whole. No-op when whole already.
  Status gather(Optimizer* optimizer = nullptr);
  // Local: the shards back in the model, cut from the whole blocks as they
  // are now (changed or not since gather), with the optimizer's state.
  // No-op when sharded already.
  void scatter(Optimizer* optimizer = nullptr);
  bool sharded() const { return sharded_; }

  Sequential& model() { return model_; }
  Communicator& communicator() { return communicator_; }
  // Whether a parameter of the sharded model is a slice (or held by one
  // rank only) rather than the same on every rank.
  bool is_split(const Parameter* p) const { return split_.count(p) > 0; }
  // The first failed all-reduce of a shard's forward or backward pass (the
  // step's results are then meaningless), or ok.
  Status reduction_status();

 private:
  struct Slot {
    size_t layer = 0;
    std::unique_ptr<Layer> held;  // the shard while the whole block is in the model, and the reverse
  };
  TensorParallelModel(Sequential& model, Communicator& communicator) : model_(model), communicator_(communicator) {}
  TransformerBlock& shard_of(Slot& slot);  // the slot's shard, wherever it is
  Sequential& model_;
  Communicator& communicator_;
  std::vector<Slot> slots_;
  std::unordered_set<const Parameter*> split_;
  bool sharded_ = false;
};

// The gradient sync of a tensor-parallel rank: `inner` (data parallelism
// over the ranks of the same tensor rank, or none) and then the step's
// whole gradient norm, the split parameters' squares summed over the
// tensor ranks (replicated ones counted once), so that every rank clips by
// the same factor and skips the same steps.
class TensorParallelSync final : public GradientSync {
 public:
  TensorParallelSync(TensorParallelModel& model, GradientSync* inner) : model_(model), inner_(inner) {}
  void before_last_backward(const StepResult& step) override;
  void after_layer(size_t layer) override;
  Status finish(std::span<Parameter* const> parameters, StepResult& step) override;
  std::optional<double> whole_squared_norm() const override { return whole_squared_norm_; }
  // On the device: the split and replicated sums read back (one wait), the
  // split one all-reduced, the whole written to the step's scalar.
  Result<bool> device_squared_norm(std::span<Parameter* const> parameters, double* squared_norm) override;

 private:
  TensorParallelModel& model_;
  GradientSync* inner_;
  std::optional<double> whole_squared_norm_;
};

}  // namespace fedmesh::train
