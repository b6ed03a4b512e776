// In-site data parallelism: each rank trains on its part of the step's
// batch and, before the optimizer step, the gradients become what one
// process would compute on the whole batch: sum over ranks of
// (rank's samples x rank's mean gradient), divided by all the samples.
// Every rank then applies the same gradient to the same weights, so the
// ranks stay equal (tests/train/test_data_parallel.cpp checks 2 and 3
// processes against one on the combined batch).
//
// Gradients travel in buckets of about bucket_bytes, filled in the order
// the backward pass finishes layers (last layer first). With overlap, a
// bucket is all-reduced on a communication thread as soon as the backward
// pass has finished its layers, while the backward pass goes on with the
// layers below; the step waits for the last bucket only. The step's sample
// count, loss and correct count ride in the last bucket. Every rank sends
// the same buckets in the same order, so the collectives match.
//
// The buckets live where the model lives: for a model on the CUDA device
// they are device memory, packed and unpacked by the device's kernels, and
// the communicator must read device memory (NCCL); before a bucket goes to
// the collective, which runs on its own stream, the host waits for the
// kernels that packed it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "train/model.h"
#include "train/parallel/communicator.h"
#include "train/trainer.h"

namespace fedmesh::train {

struct DataParallelOptions {
  size_t bucket_bytes = size_t{256} << 10;  // 256 KiB; SIZE_MAX: one bucket
  bool overlap = true;                    // all-reduce buckets during the backward pass
  bool zero_one = false;                  // shard the optimizer state (zero.h); fit_data_parallel installs it
};

class DataParallel final : public GradientSync {
 public:
  // `communicator` and `model` must outlive this; the communicator is used
  // by this object's thread during steps and must not be used by anyone
  // else until finish() returns.
  DataParallel(Communicator& communicator, Sequential& model, DataParallelOptions options = {});
  ~DataParallel() override;

  void before_last_backward(const StepResult& step) override;
  void after_layer(size_t layer) override;
  Status finish(std::span<Parameter* const> parameters, StepResult& step) override;

  size_t bucket_count() const { return buckets_.size(); }
  const DataParallelOptions& options() const { return options_; }
  Communicator& communicator() { return communicator_; }
  Sequential& model() { return model_; }

 private:
  struct Bucket {
    std::vector<Parameter*> parameters;  // in the order they are packed
    size_t lowest_layer = 0;             // the bucket is complete once this layer's backward is done
    Tensor values;                       // fp32, on the model's device; the last bucket also the counts
    bool queued = false;
  };
  void queue(size_t bucket);
  void communicate();

  Communicator& communicator_;
  Sequential& model_;
  DataParallelOptions options_;
  std::vector<Bucket> buckets_;  // in backward order; the last one carries the step's counts
  float weight_ = 0.0f;          // this rank's samples in the step
  double loss_sum_ = 0.0;
  int64_t correct_ = 0;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<size_t> pending_;
  size_t in_flight_ = 0;
  Status error_;
  bool stopping_ = false;
  std::thread thread_;
};

// trainer.fit() with `sync` (the trainer must train sync.model() with
// data_parallel_rank/ranks set; with sync.options().zero_one its optimizer
// is replaced by a ShardedOptimizer before the first step), stopped at the
// first step whose sync failed (a rank died or left: every later step would
// wait for it and fail too), whose status is then returned; at the end,
// check_replicas_equal. Exceptions from the callbacks pass through.
Result<TrainSummary> fit_data_parallel(Trainer& trainer, DataParallel& sync, const data::Dataset& train,
                                       const data::Dataset* test, const TrainCallbacks& callbacks);

// The same with `hook` as the trainer's gradient sync: a hook that wraps
// `data_parallel` (tensor parallelism, tensor_parallel_model.h), or
// data_parallel itself; data_parallel may be null (no data-parallel ranks).
Result<TrainSummary> fit_synced(Trainer& trainer, GradientSync& hook, DataParallel* data_parallel,
                                const data::Dataset& train, const data::Dataset* test, const TrainCallbacks& callbacks);

// Makes every rank's parameters (masters and compute copies) rank 0's.
Status broadcast_parameters(Communicator& communicator, Sequential& model);
// Makes every rank's parameters and optimizer state tensors rank 0's (a
// run resumed from rank 0's checkpoint; the trainer's position travels
// separately, as trainer_state_to_json).
Status broadcast_training_state(Communicator& communicator, Sequential& model, Trainer& trainer);
// kInternal when the ranks' parameters differ (a checksum of each rank's,
// gathered): data parallelism keeps them bit-identical, so any difference
// is a bug or a rank that trained something else.
Status check_replicas_equal(Communicator& communicator, Sequential& model);

}  // namespace fedmesh::train
