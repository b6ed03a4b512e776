// The local trainer: epochs or steps of mini-batch training with gradient
// accumulation, gradient-norm clipping, learning-rate schedules, mixed
// precision with loss scaling, and evaluation. Deterministic for a seed and a
// thread count on the CPU.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/random.h"
#include "base/status.h"
#include "crypto/dp_noise.h"
#include "kernels/device_ops.h"
#include "kernels/optimizer.h"
#include "train/data/dataset.h"
#include "train/data/fashion_mnist.h"
#include "train/loss_scaler.h"
#include "train/model.h"

namespace fedmesh::train {

struct TrainOptions {
  int64_t epochs = 1;
  int64_t max_steps = 0;  // > 0: stop after this many optimizer steps, whatever the epochs
  int64_t batch_size = 64;
  int64_t grad_accumulation = 1;  // micro-batches of batch_size per optimizer step
  std::string optimizer = "adamw";  // "adamw" | "sgd"
  float lr = 1e-3f;
  float momentum = 0.9f;  // sgd only
  bool nesterov = false;  // sgd only
  float weight_decay = 1e-4f;
  LrSchedule schedule;
  float clip_grad_norm = 0.0f;  // 0: no clipping
  DType precision = DType::kF32;
  LossScalerOptions loss_scaling;  // used for fp16 only
  uint64_t seed = 0;
  int64_t eval_batch_size = 256;
  // In-site data parallelism: fit() gives this rank the part
  // [rank x n / ranks, (rank + 1) x n / ranks) of each step's n samples
  // (every rank draws the same batches from the same seed); with the
  // data-parallel gradient hook (train/parallel/data_parallel.h) the ranks
  // then take the step one process would take on the whole batch.
  int data_parallel_rank = 0;
  int data_parallel_ranks = 1;
  // Example-level differential privacy (DP-SGD, Abadi et al. 2016): with
  // dp_clip_norm > 0 every example's gradient is clipped to that L2 norm on
  // its own, the clipped gradients are summed, N(0, (σ C)²) noise with σ =
  // dp_noise_multiplier is added to every coordinate, and the sum is divided
  // by the step's samples. The noise is a discrete Gaussian on a grid of
  // 2^-20 x C or finer (crypto/dp_noise.h) drawn from the OS CSPRNG. With
  // dp_seeded_noise it is drawn from dp_seed and the step instead, so a
  // resumed run draws what an uninterrupted one would: for simulations and
  // tests that replay, and no privacy guarantee (whoever knows the seed can
  // subtract the noise). fp32 and bf16 only (no loss scaling), one process
  // (no data-parallel ranks).
  float dp_clip_norm = 0.0f;
  float dp_noise_multiplier = 0.0f;
  bool dp_seeded_noise = false;
  uint64_t dp_seed = 0;

  // Checks ranges and names; the message says which option is wrong.
  Status validate() const;
};

// Classification: the mean cross-entropy and the share of correct argmaxes.
// Regression: loss is the mean squared error in the units the model trains
// in (standardized targets), accuracy stays 0, and mae / rmse are in the
// data's own units; r2 = 1 - SSE / SST (unit-free; 0 when the targets do not vary).
struct EvalResult {
  double loss = 0.0;
  double accuracy = 0.0;
  int64_t count = 0;
  bool regression = false;
  double mae = 0.0, rmse = 0.0, r2 = 0.0;
};

struct StepResult {
  double loss = 0.0;        // mean loss of the step's samples
  int64_t samples = 0;
  int64_t correct = 0;
  double grad_norm = 0.0;   // before clipping, after unscaling; 0 when skipped
  bool applied = true;      // false when skipped for non-finite gradients (or a failed gradient hook)
};

struct StepProgress {
  int64_t epoch = 0, epochs = 0;
  int64_t step = 0, total_steps = 0;
  StepResult result;
  float lr = 0.0f;
  float loss_scale = 1.0f;
  double samples_per_second = 0.0;
  double eta_seconds = 0.0;
};

struct EpochReport {
  int64_t epoch = 0;
  double train_loss = 0.0, train_accuracy = 0.0;
  EvalResult test;  // count == 0 when no test set
  double seconds = 0.0;
};

struct TrainSummary {
  int64_t steps = 0, skipped_steps = 0, epochs_completed = 0;
  int64_t samples = 0;
  double train_seconds = 0.0;  // time in training steps, excluding evaluation
  double samples_per_second = 0.0;
  double final_train_loss = 0.0;
  float final_loss_scale = 1.0f;
  EvalResult test;
};

// Everything besides the model's weights and the optimizer's tensors that
// decides the rest of a run: where it is, the shuffle generator, the loss
// scaler, the optimizer's step count, and the running totals its reports are
// made of. A checkpoint holds this, the weights and the optimizer tensors.
struct TrainerState {
  int64_t step = 0;          // optimizer steps done (skipped ones included)
  int64_t epoch = 1;         // 1-based epoch in progress
  int64_t epoch_offset = 0;  // samples of this epoch's shuffled order already consumed
  Rng::State epoch_rng;      // the shuffle generator as it was before this epoch's shuffle
  int64_t optimizer_steps = 0;
  DynamicLossScaler::State loss_scaler;
  // Running totals of the epoch in progress and of the run.
  double epoch_loss_sum = 0.0;
  int64_t epoch_samples = 0, epoch_correct = 0;
  int64_t samples = 0, skipped_steps = 0;
  double train_seconds = 0.0;
  double final_train_loss = 0.0;
  int64_t epochs_completed = 0;
};

// What a step's gradients go through between the backward pass and the
// optimizer: in-site data parallelism makes them (and the step's result)
// the whole step's over all ranks. The trainer calls, in every step:
// before_last_backward (when this rank has samples) just before the
// backward pass of its last micro-batch, after_layer(i) when layer i's
// backward pass is done in it (its parameters' gradients are then final),
// and finish after the backward pass, before the gradients are checked and
// applied. Gradients are averaged over this rank's samples and times the
// loss scale; `step` holds this rank's samples, mean loss and correct.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual void before_last_backward(const StepResult& step) { (void)step; }
  virtual void after_layer(size_t layer) { (void)layer; }
  // A failure leaves the step unapplied; Trainer::last_hook_status() says why.
  virtual Status finish(std::span<Parameter* const> parameters, StepResult& step) = 0;
  // The squared L2 norm of the whole step's gradient, read after finish,
  // when this rank holds part of it only (tensor parallelism: the parts
  // summed over the ranks, so every rank clips and skips alike); nullopt:
  // the norm of `parameters`' gradients is the whole.
  virtual std::optional<double> whole_squared_norm() const { return std::nullopt; }
  // The same on the CUDA device: writes the whole step's squared norm to
  // *squared_norm (a device fp64 scalar, the step's) and returns true, or
  // returns false and the trainer sums `parameters`' squares there.
  virtual Result<bool> device_squared_norm(std::span<Parameter* const> parameters, double* squared_norm) {
    (void)parameters;
    (void)squared_norm;
    return false;
  }
};

struct TrainCallbacks {
  std::function<void(const StepProgress&)> on_step;
  std::function<void(const EpochReport&)> on_epoch;
};

// The device a run trains on, from its --device / training.device ("cpu"
// or "cuda"): cuda where this build has the backend, a GPU is there, and the
// run is not DP-SGD (its per-example gradients run on the CPU). Otherwise
// kInvalidArgument or kUnavailable saying what to do.
// Regression trains on the CPU only (its loss has no device kernel yet):
// regression = true with cuda is kInvalidArgument.
Result<Device> training_device(std::string_view device, bool dp_sgd, bool regression = false);

class Trainer {
 public:
  // Model must outlive the trainer. Call only with validated options.
  Trainer(Sequential& model, TrainOptions options);

  // Runs to the end of the options' epochs or steps. Continues the run in
  // progress after restore(), or after a callback threw out of fit(); starts a
  // new run otherwise (also on a second call after one that finished: step 0,
  // epoch 1, while the generator, the optimizer and the loss scaler go on).
  TrainSummary fit(const data::Dataset& train, const data::Dataset* test, const TrainCallbacks& callbacks);
  TrainSummary fit(const data::ImageDataset& train, const data::ImageDataset* test, const TrainCallbacks& callbacks);
  // One optimizer step over `indices`, split in micro-batches of batch_size.
  StepResult train_step(const data::Dataset& dataset, std::span<const int64_t> indices, float lr);
  StepResult train_step(const data::ImageDataset& dataset, std::span<const int64_t> indices, float lr);
  // In-site data parallelism plugs in here (train/parallel/data_parallel.h);
  // `sync` must outlive the trainer's steps. nullptr: none.
  void set_gradient_sync(GradientSync* sync) { sync_ = sync; }
  // Why the last step was not applied when the gradient sync failed.
  const Status& last_hook_status() const { return hook_status_; }
  // Mean loss and accuracy over every target of every sample.
  EvalResult evaluate(const data::Dataset& dataset);
  EvalResult evaluate(const data::ImageDataset& dataset);
  const DynamicLossScaler& loss_scaler() const { return loss_scaler_; }

  // The position after the last step: consistent inside on_step (the step just
  // taken is counted), inside on_epoch (the next epoch is in progress) and
  // after fit().
  TrainerState state() const;
  // Continues a run from a checkpoint. Order: build the model and this trainer
  // with the run's options (same seed, thread count and training set), copy
  // the weights into the model's parameters and call model.refresh_compute(),
  // copy the optimizer tensors into optimizer().state_tensors(model.parameters()),
  // then restore(state) and fit(). kInvalidArgument names a field out of range
  // or inconsistent with the others; the trainer is unchanged then.
  // targets_per_sample: the training set's (a language model's positions per
  // sample), as correct predictions are counted per target.
  Status restore(const TrainerState& state, int64_t targets_per_sample = 1);
  Optimizer& optimizer() { return *optimizer_; }
  const TrainOptions& options() const { return options_; }
  // Replaces the optimizer the options named (ZeRO-1 shards it across
  // data-parallel ranks: train/parallel/zero.h); before the first step.
  void set_optimizer(std::unique_ptr<Optimizer> optimizer) { optimizer_ = std::move(optimizer); }

 private:
  void private_gradient(const data::Dataset& dataset, std::span<const int64_t> indices, StepResult& result);
  // The sync, the finite check, loss scaling, clipping and the optimizer
  // step, on the gradients the backward pass (or DP-SGD) left.
  StepResult apply_gradients(StepResult result, float lr);
  Sequential& model_;
  TrainOptions options_;
  std::unique_ptr<Optimizer> optimizer_;
  DynamicLossScaler loss_scaler_;
  Rng shuffle_rng_;
  TrainerState position_;  // step, epoch, offset, totals; the rest is read from the parts
  bool run_in_progress_ = false;  // restored, or fit() left by an exception: the next fit() continues
  GradientSync* sync_ = nullptr;
  Status hook_status_;
  // The batch's inputs (on the model's device) and its labels in targets_
  // (regression: its values in values_).
  const Tensor& load_batch(const data::Dataset& dataset, std::span<const int64_t> indices);
  // The batch's cross-entropy against targets_ (and dlogits when given):
  // added to loss_sum and correct on the CPU; on the CUDA device to
  // device_scalars_, which read_device_loss reads (waiting) into them.
  // Regression (CPU only): the squared error against values_, its absolute
  // error added to abs_sum_.
  void add_loss(const Tensor& logits, Tensor* dlogits, float grad_scale, float normalizer, double& loss_sum,
                int64_t& correct);
  void read_device_loss(double& loss_sum, int64_t& correct);
  Tensor inputs_, device_inputs_, dlogits_;
  // The gradient sync's finish (a no-op without one); false, with the step
  // marked unapplied and the reason in hook_status_, when it failed.
  bool sync_gradients(std::span<Parameter* const> parameters, StepResult& result);
  // CUDA: the step's (or an evaluation's) scalars on the device.
  StepResult step_on_device(StepResult result, float lr, int64_t targets);
  device::StepScalars device_scalars_;
  device::DeviceLabels device_labels_;
  const int32_t* device_label_ids_ = nullptr;  // this batch's labels in device_labels_
  std::vector<std::vector<float>> dp_sum_;  // DP-SGD: the clipped per-example gradients' sum
  std::unique_ptr<crypto::NoiseSource> secure_noise_;  // DP-SGD without dp_seeded_noise: the CSPRNG
  std::vector<int32_t> targets_;
  std::vector<float> values_;
  bool regression_ = false;  // the last batch loaded is a regression batch
  double abs_sum_ = 0.0;
};

}  // namespace fedmesh::train
