#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>

#include "kernels/cuda_ops.h"
#include "kernels/device_ops.h"
#include "kernels/elementwise.h"
#include "kernels/loss.h"
#include "kernels/step_profile.h"
#include "train/data/batch.h"

namespace fedmesh::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

DynamicLossScaler make_loss_scaler(const TrainOptions& options) {
  if (options.precision != DType::kF16) return DynamicLossScaler::fixed_unit_scale();
  return DynamicLossScaler(options.loss_scaling);
}

std::unique_ptr<Optimizer> make_optimizer(const TrainOptions& options) {
  if (options.optimizer == "sgd") {
    SgdOptions sgd;
    sgd.momentum = options.momentum;
    sgd.nesterov = options.nesterov;
    sgd.weight_decay = options.weight_decay;
    return make_sgd(sgd);
  }
  AdamWOptions adamw;
  adamw.weight_decay = options.weight_decay;
  return make_adamw(adamw);
}

}  // namespace

Status TrainOptions::validate() const {
  if (epochs < 1 && max_steps < 1) return invalid_argument("--epochs must be at least 1 (or give --steps)");
  if (max_steps < 0) return invalid_argument("--steps must not be negative");
  if (batch_size < 1 || batch_size > 65536) return invalid_argument("--batch-size must be in [1, 65536]");
  if (grad_accumulation < 1 || grad_accumulation > 4096)
    return invalid_argument("--grad-accumulation must be in [1, 4096]");
  if (data_parallel_ranks < 1 || data_parallel_ranks > 1024 || data_parallel_rank < 0 ||
      data_parallel_rank >= data_parallel_ranks) {
    return invalid_argument("data-parallel rank " + std::to_string(data_parallel_rank) + " of " +
                            std::to_string(data_parallel_ranks) + " is not a rank");
  }
  if (optimizer != "adamw" && optimizer != "sgd")
    return invalid_argument("unknown --optimizer '" + optimizer + "' (expected adamw or sgd)");
  if (!(lr > 0.0f) || !std::isfinite(lr)) return invalid_argument("--lr must be a positive number");
  if (!(momentum >= 0.0f && momentum < 1.0f)) return invalid_argument("--momentum must be in [0, 1)");
  if (!(weight_decay >= 0.0f) || !std::isfinite(weight_decay))
    return invalid_argument("--weight-decay must be a non-negative number");
  if (!(clip_grad_norm >= 0.0f) || !std::isfinite(clip_grad_norm))
    return invalid_argument("--clip-grad-norm must be a non-negative number (0 disables clipping)");
  if (eval_batch_size < 1 || eval_batch_size > 65536) return invalid_argument("eval batch size must be in [1, 65536]");
  if (!(loss_scaling.initial_scale > 0.0f) || !std::isfinite(loss_scaling.initial_scale))
    return invalid_argument("--loss-scale must be a positive number");
  if (!(dp_clip_norm >= 0.0f) || !std::isfinite(dp_clip_norm)) return invalid_argument("--dp-clip must be a number >= 0");
  if (!(dp_noise_multiplier >= 0.0f) || !std::isfinite(dp_noise_multiplier)) {
    return invalid_argument("--dp-noise must be a number >= 0");
  }
  if (dp_noise_multiplier > 0.0f && dp_clip_norm == 0.0f) {
    return invalid_argument("--dp-noise needs --dp-clip: the noise is scaled to the clipping norm");
  }
  if (dp_clip_norm > 0.0f && precision == DType::kF16) {
    return invalid_argument("--dp-clip with fp16 is not supported: loss scaling would scale the clipping");
  }
  if (dp_clip_norm > 0.0f && data_parallel_ranks > 1) {
    return invalid_argument("--dp-clip with data-parallel ranks is not supported yet (the noise would be added once "
                            "per rank)");
  }
  return Status::ok();
}

Result<Device> training_device(std::string_view device, bool dp_sgd, bool regression) {
  if (device == "cpu") return Device::kCpu;
  if (device != "cuda") return invalid_argument("unknown device '" + std::string(device) + "' (expected cpu or cuda)");
  if (dp_sgd) return invalid_argument("device cuda with DP-SGD (--dp-clip): per-example gradients run on the CPU only");
  if (regression) {
    return invalid_argument("device cuda with regression (data.task = \"regression\"): its loss runs on the CPU only; "
                            "use --device cpu (training.device = \"cpu\" for a site)");
  }
  if (Status s = cuda::available(); !s.is_ok()) {
    return unavailable("device cuda: " + s.message() + "; use --device cpu (training.device = \"cpu\" for a site; "
                       "`fedmesh doctor` lists the GPUs this build can see)");
  }
  return Device::kCuda;
}

Trainer::Trainer(Sequential& model, TrainOptions options)
    : model_(model),
      options_(std::move(options)),
      optimizer_(make_optimizer(options_)),
      loss_scaler_(make_loss_scaler(options_)),
      shuffle_rng_(options_.seed ^ 0x5eed5eed5eedull) {
  FEDMESH_CHECK(options_.validate().is_ok(), options_.validate().to_string());
  position_.epoch_rng = shuffle_rng_.state();
  model_.set_compute_dtype(options_.precision);
}

StepResult Trainer::train_step(const data::ImageDataset& dataset, std::span<const int64_t> indices, float lr) {
  return train_step(data::ImageBatches(dataset), indices, lr);
}

EvalResult Trainer::evaluate(const data::ImageDataset& dataset) { return evaluate(data::ImageBatches(dataset)); }

TrainSummary Trainer::fit(const data::ImageDataset& train, const data::ImageDataset* test,
                          const TrainCallbacks& callbacks) {
  const data::ImageBatches train_batches(train);
  if (test == nullptr) return fit(train_batches, nullptr, callbacks);
  const data::ImageBatches test_batches(*test);
  return fit(train_batches, &test_batches, callbacks);
}

// DP-SGD's gradient: per-example gradients clipped to options_.dp_clip_norm,
// summed, noised, divided by the samples; left in the parameters' grads.
// Returns the step's loss sum and correct count in `result`.
void Trainer::private_gradient(const data::Dataset& dataset, std::span<const int64_t> indices, StepResult& result) {
  FEDMESH_CHECK(model_.device() == Device::kCpu, "DP-SGD runs on the CPU only");
  std::vector<Parameter*> parameters = model_.parameters();
  dp_sum_.resize(parameters.size());
  for (size_t p = 0; p < parameters.size(); ++p) {
    dp_sum_[p].assign(static_cast<size_t>(parameters[p]->grad.numel()), 0.0f);
  }
  const double clip = options_.dp_clip_norm;
  double loss_sum = 0.0;
  for (size_t i = 0; i < indices.size(); ++i) {
    model_.zero_grad();
    const Tensor logits = model_.forward(load_batch(dataset, indices.subspan(i, 1)), /*training=*/true);
    Tensor::reuse(dlogits_, logits.shape(), logits.dtype());
    add_loss(logits, &dlogits_, 1.0f, static_cast<float>(dataset.targets_per_sample()), loss_sum, result.correct);
    model_.backward(dlogits_);
    double squared = 0.0;
    for (Parameter* p : parameters) squared += squared_l2_norm(p->grad);
    const double norm = std::sqrt(squared);
    const float factor = static_cast<float>(norm > clip ? clip / norm : 1.0);
    for (size_t p = 0; p < parameters.size(); ++p) {
      const float* g = parameters[p]->grad.data<float>();
      float* sum = dp_sum_[p].data();
      for (size_t k = 0; k < dp_sum_[p].size(); ++k) sum[k] += factor * g[k];
    }
  }
  // N(0, (sigma C)^2) on the sum as a discrete Gaussian on a grid of at most
  // 2^-20 C (crypto/dp_noise.h): the noised sum lies on the grid and keeps
  // no trace of the unnoised sum's low bits. From the CSPRNG, or with
  // dp_seeded_noise from the seed and the optimizer step (a resumed run
  // draws the same; not private).
  const double deviation = static_cast<double>(options_.dp_noise_multiplier) * clip;
  if (deviation > 0.0) {
    std::optional<crypto::SeededNoiseSource> seeded;
    crypto::NoiseSource* source = nullptr;
    if (options_.dp_seeded_noise) {
      source = &seeded.emplace(mix_seed(options_.dp_seed ^ 0xd1ff5eedull, static_cast<uint64_t>(optimizer_->steps_taken())));
    } else {
      if (!secure_noise_) secure_noise_ = std::make_unique<crypto::SecureNoiseSource>();
      source = secure_noise_.get();
    }
    const double grid = crypto::noise_grid(clip, deviation);
    for (std::vector<float>& sum : dp_sum_) crypto::add_grid_gaussian_noise(sum, deviation, grid, *source);
  }
  const float inverse = indices.empty() ? 0.0f : 1.0f / static_cast<float>(indices.size());
  for (size_t p = 0; p < parameters.size(); ++p) {
    float* g = parameters[p]->grad.data<float>();
    for (size_t k = 0; k < dp_sum_[p].size(); ++k) g[k] = dp_sum_[p][k] * inverse;
  }
  result.loss = indices.empty() ? 0.0
                                : loss_sum / static_cast<double>(static_cast<int64_t>(indices.size()) *
                                                                 dataset.targets_per_sample());
}

StepResult Trainer::train_step(const data::Dataset& dataset, std::span<const int64_t> indices, float lr) {
  StepResult result;
  if (options_.dp_clip_norm > 0.0f) {
    private_gradient(dataset, indices, result);
    result.samples = static_cast<int64_t>(indices.size());
    return apply_gradients(result, lr);
  }
  model_.zero_grad();
  const float scale = loss_scaler_.scale();
  // The loss is the mean over every target of the step's samples.
  const int64_t targets = static_cast<int64_t>(indices.size()) * dataset.targets_per_sample();
  const float normalizer = static_cast<float>(targets);
  // On a CUDA device the loss and the correct count stay there, with the
  // gradient norm and the optimizer's gate, until the whole step is
  // enqueued: one wait per step (step_on_device).
  const bool on_device = model_.device() == Device::kCuda;
  if (on_device) device_scalars_.clear();
  bool sums_read = false;  // CUDA: the device's loss sums are in loss_sum and result.correct
  double loss_sum = 0.0;
  for (size_t begin = 0; begin < indices.size(); begin += static_cast<size_t>(options_.batch_size)) {
    const size_t end = std::min(indices.size(), begin + static_cast<size_t>(options_.batch_size));
    const Tensor& input = load_batch(dataset, indices.subspan(begin, end - begin));
    const Tensor logits = model_.forward(input, /*training=*/true);
    Tensor::reuse(dlogits_, logits.shape(), logits.dtype(), logits.device());
    add_loss(logits, &dlogits_, scale, normalizer, loss_sum, result.correct);
    if (sync_ != nullptr && end == indices.size()) {
      if (on_device) {
        // The sync sends the step's loss with the gradients: read it now.
        read_device_loss(loss_sum, result.correct);
        sums_read = true;
      }
      result.samples = static_cast<int64_t>(indices.size());
      result.loss = loss_sum / static_cast<double>(targets);
      sync_->before_last_backward(result);
      model_.backward(dlogits_, [this](size_t layer) { sync_->after_layer(layer); });
    } else {
      model_.backward(dlogits_);
    }
  }
  result.samples = static_cast<int64_t>(indices.size());
  // A data-parallel rank may get no sample of a short last batch.
  result.loss = indices.empty() ? 0.0 : loss_sum / static_cast<double>(targets);
  if (on_device) return step_on_device(result, lr, sums_read ? -1 : targets);
  return apply_gradients(result, lr);
}

bool Trainer::sync_gradients(std::span<Parameter* const> parameters, StepResult& result) {
  if (sync_ == nullptr) return true;
  const ProfileScope profile(StepTime::kCommunication);
  hook_status_ = sync_->finish(parameters, result);
  if (hook_status_.is_ok()) return true;
  result.applied = false;
  return false;
}

// apply_gradients on the CUDA device, decided there: the squared norm of
// every gradient, the factor that unscales and clips, and found_inf (a
// non-finite norm) go to device scalars that gate the optimizer's kernels,
// so the host enqueues the whole step and then reads the step's scalars
// once. A skipped step leaves the weights as they were, as on the CPU (the
// optimizer's kernels do nothing, and AdamW's step count is taken back).
StepResult Trainer::step_on_device(StepResult result, float lr, int64_t targets) {
  const float scale = loss_scaler_.scale();
  std::vector<Parameter*> parameters = model_.parameters();
  if (!sync_gradients(parameters, result)) return result;
  Result<bool> whole = sync_ != nullptr ? sync_->device_squared_norm(parameters, device_scalars_.squared_norm())
                                        : Result<bool>(false);
  if (!whole.is_ok()) {
    hook_status_ = whole.status();
    result.applied = false;
    return result;
  }
  if (!*whole) {
    for (Parameter* p : parameters) device::add_squared_l2_norm(p->grad, device_scalars_.squared_norm());
  }
  cuda::gradient_scale_factor(cuda::default_stream(), device_scalars_.squared_norm(), scale, options_.clip_grad_norm,
                              device_scalars_.factor(), device_scalars_.found_inf());
  optimizer_->set_device_gate({device_scalars_.factor(), device_scalars_.found_inf()});
  optimizer_->step(parameters, lr);  // on the device it also rounds the compute copies
  optimizer_->set_device_gate({});
  model_.merge_adapters();  // LoRA: the weights from the new B (a skipped step merges the same B again)
  const device::StepScalars::Values values = device_scalars_.read();  // the step's one wait
  if (targets >= 0) {
    result.loss = targets > 0 ? values.loss_sum / static_cast<double>(targets) : 0.0;
    result.correct = values.correct;
  }
  const bool finite = values.found_inf == 0;
  if (!loss_scaler_.update(finite)) {
    result.applied = false;
    optimizer_->set_steps_taken(optimizer_->steps_taken() - 1);
    return result;
  }
  result.grad_norm = std::sqrt(values.squared_norm) / scale;
  return result;
}

void Trainer::add_loss(const Tensor& logits, Tensor* dlogits, float grad_scale, float normalizer, double& loss_sum,
                       int64_t& correct) {
  if (regression_) {
    FEDMESH_CHECK(logits.device() == Device::kCpu, "regression trains on the CPU only (training_device refuses cuda)");
    const SquaredErrorResult se = squared_error(logits, values_, dlogits, grad_scale, normalizer);
    loss_sum += se.loss_sum;
    abs_sum_ += se.abs_sum;
    return;
  }
  if (logits.device() == Device::kCuda) {
    FEDMESH_CHECK(device_label_ids_ != nullptr, "Trainer::add_loss on the device before load_batch");
    device::softmax_cross_entropy(logits, device_label_ids_, dlogits, grad_scale, normalizer, device_scalars_);
    return;
  }
  const CrossEntropyResult ce = softmax_cross_entropy(logits, targets_, dlogits, grad_scale, normalizer);
  loss_sum += ce.loss_sum;
  correct += ce.correct;
}

void Trainer::read_device_loss(double& loss_sum, int64_t& correct) {
  const device::StepScalars::Values sums = device_scalars_.read();
  loss_sum = sums.loss_sum;
  correct = sums.correct;
}

const Tensor& Trainer::load_batch(const data::Dataset& dataset, std::span<const int64_t> indices) {
  {
    ProfileScope timed(StepTime::kData);
    dataset.make_batch(indices, model_.compute_dtype(), inputs_, targets_);
    regression_ = dataset.regression();
    if (regression_) dataset.batch_values(indices, values_);
  }
  if (model_.device() == Device::kCpu) return inputs_;
  // The labels go up with the inputs, before the forward pass is enqueued:
  // a copy from pageable memory first waits for the stream, which here is
  // idle, where after the forward pass it would drain it mid-step.
  Tensor::reuse(device_inputs_, inputs_.shape(), inputs_.dtype(), model_.device()).copy_from(inputs_);
  device_label_ids_ =
      regression_ ? nullptr : device_labels_.upload(targets_.data(), static_cast<int64_t>(targets_.size()));
  return device_inputs_;
}

StepResult Trainer::apply_gradients(StepResult result, float lr) {
  const float scale = loss_scaler_.scale();
  std::vector<Parameter*> parameters = model_.parameters();
  if (!sync_gradients(parameters, result)) return result;
  // The sync's whole norm (tensor parallelism) when it has one: it already
  // summed these gradients' squares, and a non-finite one makes it so.
  const std::optional<double> whole = sync_ != nullptr ? sync_->whole_squared_norm() : std::nullopt;
  bool finite = !whole || std::isfinite(*whole);
  double squared_norm = whole.value_or(0.0);
  for (Parameter* p : whole ? std::span<Parameter* const>() : std::span<Parameter* const>(parameters)) {
    const double s = squared_l2_norm(p->grad);
    finite &= std::isfinite(s);
    squared_norm += s;
  }
  if (!loss_scaler_.update(finite)) {
    result.applied = false;
    return result;
  }
  // Unscale and clip in one multiplication.
  const double norm = std::sqrt(squared_norm) / scale;
  result.grad_norm = norm;
  double factor = 1.0 / scale;
  if (options_.clip_grad_norm > 0.0f && norm > options_.clip_grad_norm) factor *= options_.clip_grad_norm / norm;
  if (factor != 1.0) {
    for (Parameter* p : parameters) fedmesh::scale(p->grad, static_cast<float>(factor));
  }
  optimizer_->step(parameters, lr);
  model_.refresh_compute();
  return result;
}

EvalResult Trainer::evaluate(const data::Dataset& dataset) {
  const ProfilePause not_step_time;
  EvalResult result;
  std::vector<int64_t> indices(static_cast<size_t>(options_.eval_batch_size));
  double loss_sum = 0.0;
  int64_t correct = 0;
  double value_sum = 0.0, value_squares = 0.0;  // regression: for the total sum of squares
  abs_sum_ = 0.0;
  const int64_t count = dataset.size();
  const bool on_device = model_.device() == Device::kCuda;
  if (on_device) device_scalars_.clear();
  for (int64_t begin = 0; begin < count; begin += options_.eval_batch_size) {
    const int64_t end = std::min(count, begin + options_.eval_batch_size);
    indices.resize(static_cast<size_t>(end - begin));
    std::iota(indices.begin(), indices.end(), begin);
    const Tensor logits = model_.forward(load_batch(dataset, indices), /*training=*/false);
    add_loss(logits, nullptr, 1.0f, 1.0f, loss_sum, correct);
    for (const float v : regression_ ? std::span<const float>(values_) : std::span<const float>()) {
      value_sum += v;
      value_squares += static_cast<double>(v) * v;
    }
  }
  if (on_device) read_device_loss(loss_sum, correct);
  result.count = count;
  result.regression = dataset.regression();
  if (count > 0) {
    const double targets = static_cast<double>(count * dataset.targets_per_sample());
    result.loss = loss_sum / targets;
    result.accuracy = static_cast<double>(correct) / targets;
    if (result.regression) {
      const double n = static_cast<double>(count), scale = dataset.target_scale();
      const double total = value_squares - value_sum * value_sum / n;
      result.mae = abs_sum_ / n * scale;
      result.rmse = std::sqrt(loss_sum / n) * scale;
      result.r2 = total > 0.0 ? 1.0 - loss_sum / total : 0.0;
    }
  }
  return result;
}

TrainerState Trainer::state() const {
  TrainerState state = position_;
  state.optimizer_steps = optimizer_->steps_taken();
  state.loss_scaler = loss_scaler_.state();
  return state;
}

Status Trainer::restore(const TrainerState& state, int64_t targets_per_sample) {
  const auto bad = [](const std::string& why) { return invalid_argument("trainer state: " + why); };
  using std::to_string;
  if (state.step < 0) return bad("step " + to_string(state.step) + " is negative");
  if (options_.max_steps > 0 && state.step > options_.max_steps) {
    return bad("step " + to_string(state.step) + " is beyond the run's " + to_string(options_.max_steps) + " steps");
  }
  if (state.epoch < 1) return bad("epoch " + to_string(state.epoch) + " is below 1");
  // After the last epoch's on_epoch the run is at epoch `epochs + 1`.
  if (options_.max_steps == 0 && state.epoch > options_.epochs + 1) {
    return bad("epoch " + to_string(state.epoch) + " is beyond the run's " + to_string(options_.epochs) + " epochs");
  }
  if (state.epochs_completed != state.epoch - 1) {
    return bad("epochs_completed " + to_string(state.epochs_completed) + " does not fit epoch " +
               to_string(state.epoch));
  }
  if (state.epoch_offset < 0) return bad("epoch_offset " + to_string(state.epoch_offset) + " is negative");
  // Every sample of the epoch's order consumed so far is counted once.
  if (state.epoch_samples != state.epoch_offset) {
    return bad("epoch_samples " + to_string(state.epoch_samples) + " differs from epoch_offset " +
               to_string(state.epoch_offset));
  }
  // Correct predictions are counted per target (a language model's positions).
  if (targets_per_sample < 1) return bad("targets per sample " + to_string(targets_per_sample) + " below 1");
  if (state.epoch_correct < 0 || state.epoch_correct > state.epoch_samples * targets_per_sample) {
    return bad("epoch_correct " + to_string(state.epoch_correct) + " outside [0, epoch_samples x " +
               to_string(targets_per_sample) + " targets]");
  }
  if (state.samples < state.epoch_samples) {
    return bad("samples " + to_string(state.samples) + " fewer than the epoch's " + to_string(state.epoch_samples));
  }
  if (state.skipped_steps < 0 || state.skipped_steps > state.step) {
    return bad("skipped_steps " + to_string(state.skipped_steps) + " outside [0, step]");
  }
  // Not bounded by `step`: the optimizer's count goes on across fit() calls
  // and train_step() calls outside fit().
  if (state.optimizer_steps < 0) return bad("optimizer_steps " + to_string(state.optimizer_steps) + " is negative");
  if (!(state.train_seconds >= 0.0) || !std::isfinite(state.train_seconds)) {
    return bad("train_seconds must be a non-negative number");
  }
  if (std::all_of(state.epoch_rng.words.begin(), state.epoch_rng.words.end(), [](uint64_t w) { return w == 0; })) {
    return bad("epoch_rng is all zeros, which xoshiro256** never reaches");
  }
  const DynamicLossScaler::State& scaler = state.loss_scaler;
  if (!(scaler.scale > 0.0f) || !std::isfinite(scaler.scale)) return bad("loss scale must be a positive number");
  if (options_.precision != DType::kF16 && scaler.scale != 1.0f) {
    return bad("a loss scale other than 1 outside fp16 training");
  }
  if (scaler.clean_run < 0) return bad("loss scaler clean_run " + to_string(scaler.clean_run) + " is negative");
  if (scaler.skipped < 0) return bad("loss scaler skipped " + to_string(scaler.skipped) + " is negative");
  position_ = state;
  run_in_progress_ = true;
  optimizer_->set_steps_taken(state.optimizer_steps);
  loss_scaler_.restore(state.loss_scaler);
  return Status::ok();
}

TrainSummary Trainer::fit(const data::Dataset& train, const data::Dataset* test, const TrainCallbacks& callbacks) {
  TrainSummary summary;
  const int64_t train_count = train.size();
  if (train_count == 0) return summary;  // nothing to learn from; the loaders reject empty files
  const int64_t step_samples = options_.batch_size * options_.grad_accumulation;
  const int64_t steps_per_epoch = (train_count + step_samples - 1) / step_samples;
  int64_t epochs = options_.epochs;
  int64_t total_steps = epochs * steps_per_epoch;
  if (options_.max_steps > 0) {
    total_steps = options_.max_steps;
    epochs = (total_steps + steps_per_epoch - 1) / steps_per_epoch;
  }
  // A new run starts at epoch 1 with the generator where it is (as seeded, in
  // a fresh trainer); a restored or interrupted one where it left off.
  if (!run_in_progress_) {
    position_ = TrainerState{};
    position_.epoch_rng = shuffle_rng_.state();
  }
  run_in_progress_ = true;
  TrainerState& at = position_;
  std::vector<int64_t> order(static_cast<size_t>(train_count));
  while (at.epoch <= epochs && (at.step < total_steps || at.epoch_offset > 0)) {
    const auto epoch_start = Clock::now();
    shuffle_rng_.set_state(at.epoch_rng);
    std::iota(order.begin(), order.end(), 0);
    shuffle_rng_.shuffle(std::span<int64_t>(order));
    for (; at.epoch_offset < train_count && at.step < total_steps; ) {
      const int64_t begin = at.epoch_offset;
      const int64_t end = std::min(train_count, begin + step_samples);
      const float lr = options_.schedule.lr_at(options_.lr, at.step, total_steps);
      const auto step_start = Clock::now();
      // This rank's part of the step's samples (all of them for one rank).
      const int64_t n = end - begin, ranks = options_.data_parallel_ranks, rank = options_.data_parallel_rank;
      const int64_t mine_begin = begin + n * rank / ranks, mine_end = begin + n * (rank + 1) / ranks;
      const StepResult result =
          train_step(train, std::span<const int64_t>(order).subspan(static_cast<size_t>(mine_begin),
                                                                    static_cast<size_t>(mine_end - mine_begin)),
                     lr);
      at.train_seconds += seconds_since(step_start);
      ++at.step;
      at.epoch_offset = end;
      at.samples += result.samples;
      if (!result.applied) ++at.skipped_steps;
      at.epoch_loss_sum += result.loss * static_cast<double>(result.samples);
      at.epoch_samples += result.samples;
      at.epoch_correct += result.correct;
      at.final_train_loss = result.loss;
      if (callbacks.on_step) {
        StepProgress progress;
        progress.epoch = at.epoch;
        progress.epochs = epochs;
        progress.step = at.step;
        progress.total_steps = total_steps;
        progress.result = result;
        progress.lr = lr;
        progress.loss_scale = loss_scaler_.scale();
        progress.samples_per_second = static_cast<double>(at.samples) / at.train_seconds;
        progress.eta_seconds = at.train_seconds / static_cast<double>(at.step) *
                               static_cast<double>(total_steps - at.step);
        callbacks.on_step(progress);
      }
    }
    EpochReport report;
    report.epoch = at.epoch;
    report.train_loss = at.epoch_samples ? at.epoch_loss_sum / static_cast<double>(at.epoch_samples) : 0.0;
    report.train_accuracy = at.epoch_samples ? static_cast<double>(at.epoch_correct) /
                                                   static_cast<double>(at.epoch_samples * train.targets_per_sample())
                                             : 0.0;
    if (test != nullptr) report.test = evaluate(*test);
    report.seconds = seconds_since(epoch_start);
    summary.test = report.test;
    // The next epoch begins (so a state taken in on_epoch resumes there): its
    // generator state is the one after this epoch's shuffle.
    at.epochs_completed = at.epoch;
    ++at.epoch;
    at.epoch_offset = 0;
    at.epoch_loss_sum = 0.0;
    at.epoch_samples = at.epoch_correct = 0;
    at.epoch_rng = shuffle_rng_.state();
    if (callbacks.on_epoch) callbacks.on_epoch(report);
  }
  run_in_progress_ = false;
  summary.steps = at.step;
  summary.epochs_completed = at.epochs_completed;
  summary.samples = at.samples;
  summary.skipped_steps = at.skipped_steps;
  summary.train_seconds = at.train_seconds;
  summary.final_train_loss = at.final_train_loss;
  summary.samples_per_second =
      summary.train_seconds > 0.0 ? static_cast<double>(summary.samples) / summary.train_seconds : 0.0;
  summary.final_loss_scale = loss_scaler_.scale();
  return summary;
}

}  // namespace fedmesh::train
