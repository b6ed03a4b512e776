#include "train/parallel/data_parallel.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "kernels/convert.h"
#include "kernels/cuda_ops.h"
#include "kernels/elementwise.h"
#include "train/parallel/zero.h"

namespace fedmesh::train {

namespace {

constexpr int64_t kCounts = 3;  // the last bucket's tail: samples, loss sum, correct

std::span<float> values_of(const Tensor& t) {
  return {const_cast<float*>(t.data<float>()), static_cast<size_t>(t.numel())};
}

}  // namespace

DataParallel::DataParallel(Communicator& communicator, Sequential& model, DataParallelOptions options)
    : communicator_(communicator), model_(model), options_(options) {
  // Buckets in the order the backward pass completes layers: last first.
  size_t bytes = 0;
  for (size_t i = model_.layer_count(); i-- > 0;) {
    const std::vector<Parameter*> parameters = model_.layer_parameters(i);
    if (parameters.empty()) continue;
    if (buckets_.empty() || bytes >= options_.bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& bucket = buckets_.back();
    for (Parameter* p : parameters) {
      bucket.parameters.push_back(p);
      bytes += static_cast<size_t>(p->grad.numel()) * sizeof(float);
    }
    bucket.lowest_layer = i;
  }
  FEDMESH_CHECK(model_.device() == Device::kCpu || communicator_.device_memory(),
                std::string("data parallel: the model is on the CUDA device and the ") + communicator_.backend() +
                    " communicator reads host memory (use NCCL)");
  for (Bucket& bucket : buckets_) {
    int64_t total = &bucket == &buckets_.back() ? kCounts : 0;
    for (const Parameter* p : bucket.parameters) total += p->grad.numel();
    bucket.values = Tensor::zeros({total}, DType::kF32, model_.device());
  }
  if (options_.overlap) thread_ = std::thread([this] { communicate(); });
}

DataParallel::~DataParallel() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DataParallel::before_last_backward(const StepResult& step) {
  weight_ = static_cast<float>(step.samples);
  loss_sum_ = step.loss * static_cast<double>(step.samples);
  correct_ = step.correct;
}

void DataParallel::after_layer(size_t layer) {
  if (!options_.overlap) return;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!buckets_[b].queued && buckets_[b].lowest_layer == layer) queue(b);
  }
}

// Packs bucket b (gradients x this rank's samples; the last bucket also the
// step's counts) and hands it to the communication thread, or all-reduces
// it here without overlap.
void DataParallel::queue(size_t b) {
  Bucket& bucket = buckets_[b];
  int64_t at = 0;
  for (const Parameter* p : bucket.parameters) {
    Tensor slice = bucket.values.slice_rows(at, at + p->grad.numel());
    convert(p->grad, slice);
    scale(slice, weight_);
    at += p->grad.numel();
  }
  if (b + 1 == buckets_.size()) {
    float counts[kCounts] = {weight_, static_cast<float>(loss_sum_), static_cast<float>(correct_)};
    bucket.values.slice_rows(at, at + kCounts).copy_from(Tensor::view_of(counts, {kCounts}, DType::kF32));
  }
  bucket.queued = true;
  // The collective reads the bucket on its own stream: the packing first.
  if (model_.device() == Device::kCuda) cuda::synchronize(cuda::default_stream());
  if (!options_.overlap) {
    if (error_.is_ok()) error_ = communicator_.all_reduce_sum(values_of(bucket.values));
    return;
  }
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(b);
  }
  changed_.notify_all();
}

void DataParallel::communicate() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
    if (pending_.empty()) return;  // stopping
    const size_t b = pending_.front();
    pending_.pop_front();
    ++in_flight_;
    const bool failed = !error_.is_ok();
    lock.unlock();
    // After a failure the later buckets are not sent: the step fails anyway.
    Status s = failed ? Status::ok() : communicator_.all_reduce_sum(values_of(buckets_[b].values));
    lock.lock();
    --in_flight_;
    if (!s.is_ok() && error_.is_ok()) error_ = std::move(s);
    changed_.notify_all();
  }
}

Status DataParallel::finish(std::span<Parameter* const> parameters, StepResult& step) {
  (void)parameters;  // the buckets hold the model's parameters
  // A rank with no sample in this step (a short last batch) ran no backward
  // pass: its buckets go out here, with weight 0.
  if (step.samples == 0) before_last_backward(step);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!buckets_[b].queued) queue(b);
  }
  Status error;
  {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return pending_.empty() && in_flight_ == 0; });
    error = std::move(error_);
    error_ = Status::ok();
  }
  for (Bucket& bucket : buckets_) bucket.queued = false;
  FEDMESH_RETURN_IF_ERROR(error);
  const Tensor& last = buckets_.back().values;
  float counts[kCounts];
  Tensor::view_of(counts, {kCounts}, DType::kF32).copy_from(last.slice_rows(last.numel() - kCounts, last.numel()));
  const float all_samples = counts[0];
  if (!(all_samples > 0.0f)) return invalid_argument("data parallel: no rank had samples in this step");
  const float inverse = 1.0f / all_samples;
  for (Bucket& bucket : buckets_) {
    int64_t at = 0;
    for (Parameter* p : bucket.parameters) {
      convert(bucket.values.slice_rows(at, at + p->grad.numel()), p->grad);
      scale(p->grad, inverse);
      at += p->grad.numel();
    }
  }
  step.samples = static_cast<int64_t>(all_samples);
  step.loss = static_cast<double>(counts[1]) / static_cast<double>(all_samples);
  step.correct = static_cast<int64_t>(counts[2]);
  return Status::ok();
}

namespace {

struct SyncFailed {};

}  // namespace

Result<TrainSummary> fit_synced(Trainer& trainer, GradientSync& hook, DataParallel* data_parallel,
                                const data::Dataset& train, const data::Dataset* test, const TrainCallbacks& callbacks) {
  trainer.set_gradient_sync(&hook);
  ShardedOptimizer* sharded = dynamic_cast<ShardedOptimizer*>(&trainer.optimizer());
  if (data_parallel != nullptr && data_parallel->options().zero_one && sharded == nullptr) {
    auto optimizer = std::make_unique<ShardedOptimizer>(trainer.options(), data_parallel->communicator());
    sharded = optimizer.get();
    trainer.set_optimizer(std::move(optimizer));
  }
  TrainCallbacks checked = callbacks;
  checked.on_step = [&](const StepProgress& progress) {
    if (!trainer.last_hook_status().is_ok() || (sharded != nullptr && !sharded->status().is_ok())) throw SyncFailed{};
    if (callbacks.on_step) callbacks.on_step(progress);
  };
  TrainSummary summary;
  try {
    summary = trainer.fit(train, test, checked);
  } catch (const SyncFailed&) {
    trainer.set_gradient_sync(nullptr);
    return !trainer.last_hook_status().is_ok() ? trainer.last_hook_status() : sharded->status();
  }
  trainer.set_gradient_sync(nullptr);
  if (sharded != nullptr) FEDMESH_RETURN_IF_ERROR(sharded->status());
  if (data_parallel != nullptr) {
    FEDMESH_RETURN_IF_ERROR(check_replicas_equal(data_parallel->communicator(), data_parallel->model()));
  }
  return summary;
}

Result<TrainSummary> fit_data_parallel(Trainer& trainer, DataParallel& sync, const data::Dataset& train,
                                       const data::Dataset* test, const TrainCallbacks& callbacks) {
  return fit_synced(trainer, sync, &sync, train, test, callbacks);
}

Status broadcast_parameters(Communicator& communicator, Sequential& model) {
  // Every master in one buffer where the model lives (the communicator's memory).
  int64_t total = 0;
  for (Parameter* p : model.parameters()) total += p->value.numel();
  Tensor values = Tensor::empty({total}, DType::kF32, model.device());
  int64_t at = 0;
  for (Parameter* p : model.parameters()) {
    values.slice_rows(at, at + p->value.numel()).copy_from(p->value);
    at += p->value.numel();
  }
  if (model.device() == Device::kCuda) cuda::synchronize(cuda::default_stream());
  FEDMESH_RETURN_IF_ERROR(communicator.broadcast(std::span<float>(values.data<float>(), static_cast<size_t>(total)), 0));
  at = 0;
  for (Parameter* p : model.parameters()) {
    p->value.copy_from(values.slice_rows(at, at + p->value.numel()));
    at += p->value.numel();
  }
  model.refresh_compute();
  return Status::ok();
}

Status broadcast_training_state(Communicator& communicator, Sequential& model, Trainer& trainer) {
  FEDMESH_RETURN_IF_ERROR(broadcast_parameters(communicator, model));
  for (const OptimizerStateTensor& state : trainer.optimizer().state_tensors(model.parameters())) {
    FEDMESH_RETURN_IF_ERROR(
        communicator.broadcast(std::span<float>(state.tensor->data<float>(), static_cast<size_t>(state.tensor->numel())), 0));
  }
  return Status::ok();
}

Status check_replicas_equal(Communicator& communicator, Sequential& model) {
  // FNV-1a over the bytes, carried as two 16-bit halves (exact in fp32).
  uint32_t hash = 2166136261u;
  for (Parameter* p : model.parameters()) {
    const Tensor host = p->value.host();
    const auto* bytes = static_cast<const unsigned char*>(host.raw());
    for (size_t i = 0; i < host.nbytes(); ++i) hash = (hash ^ bytes[i]) * 16777619u;
  }
  float mine[2] = {static_cast<float>(hash >> 16), static_cast<float>(hash & 0xffffu)};
  const int64_t ranks = communicator.size();
  // Gathered in the communicator's memory: the model's device.
  Tensor mine_there = Tensor::empty({2}, DType::kF32, model.device());
  mine_there.copy_from(Tensor::view_of(mine, {2}, DType::kF32));
  Tensor all_there = Tensor::empty({2 * ranks}, DType::kF32, model.device());
  if (model.device() == Device::kCuda) cuda::synchronize(cuda::default_stream());
  FEDMESH_RETURN_IF_ERROR(communicator.all_gather(std::span<const float>(mine_there.data<float>(), 2),
                                                  std::span<float>(all_there.data<float>(), static_cast<size_t>(2 * ranks))));
  std::vector<float> all(static_cast<size_t>(2 * ranks));
  Tensor::view_of(all.data(), {2 * ranks}, DType::kF32).copy_from(all_there);
  for (int r = 1; r < communicator.size(); ++r) {
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) {
      return Status(StatusCode::kInternal, "data parallel: rank " + std::to_string(r) +
                                               "'s parameters differ from rank 0's after the same steps");
    }
  }
  return Status::ok();
}

}  // namespace fedmesh::train
