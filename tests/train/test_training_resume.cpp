// A run interrupted at step k and continued in a fresh model and trainer from
// a snapshot of (weights, optimizer tensors, TrainerState) ends with the same
// weights, bit for bit, and the same epoch reports as a run never interrupted:
// for AdamW and SGD with Nesterov momentum, fp32, bf16 and fp16 with dynamic
// loss scaling, gradient accumulation, a cosine schedule, and stops at an
// epoch boundary and at the last step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <optional>

#include "kernels/parallel.h"
#include "train/trainer.h"
#include "tests/support/fashion_data.h"

namespace fedmesh::train {
namespace {

using fedmesh::testing::fashion_split;

struct Snapshot {
  TrainerState state;
  std::vector<Tensor> weights;
  std::vector<Tensor> optimizer_tensors;
};

struct Outcome {
  std::vector<Tensor> weights;
  std::vector<StepProgress> steps;
  std::vector<EpochReport> epochs;
  TrainSummary summary;
};

struct Case {
  const char* name;
  TrainOptions options;
  int64_t interrupt_at;
};

std::unique_ptr<Sequential> fresh_model(uint64_t seed) {
  auto m = make_model("mlp", seed);
  EXPECT_TRUE(m.is_ok());
  return std::move(m).value();
}

std::vector<Tensor> copies(const std::vector<Parameter*>& parameters) {
  std::vector<Tensor> result;
  for (Parameter* p : parameters) result.push_back(p->value.clone());
  return result;
}

// Runs to the end; when interrupt_at > 0, snapshots the run after that step.
Outcome run(const TrainOptions& options, int64_t interrupt_at, std::optional<Snapshot>* snapshot,
            const Snapshot* resume_from) {
  const auto train = fashion_split(data::Split::kTrain).head(256);
  const auto test = fashion_split(data::Split::kTest).head(128);
  auto net = fresh_model(options.seed);
  Trainer trainer(*net, options);
  if (resume_from != nullptr) {
    std::vector<Parameter*> parameters = net->parameters();
    for (size_t i = 0; i < parameters.size(); ++i) {
      std::memcpy(parameters[i]->value.raw(), resume_from->weights[i].raw(), parameters[i]->value.nbytes());
    }
    net->refresh_compute();
    std::vector<OptimizerStateTensor> state = trainer.optimizer().state_tensors(parameters);
    EXPECT_EQ(state.size(), resume_from->optimizer_tensors.size());
    for (size_t i = 0; i < state.size(); ++i) {
      std::memcpy(state[i].tensor->raw(), resume_from->optimizer_tensors[i].raw(), state[i].tensor->nbytes());
    }
    EXPECT_TRUE(trainer.restore(resume_from->state).is_ok());
  }
  Outcome outcome;
  TrainCallbacks callbacks;
  callbacks.on_step = [&](const StepProgress& p) {
    outcome.steps.push_back(p);
    if (snapshot == nullptr || p.step != interrupt_at) return;
    Snapshot s;
    s.state = trainer.state();
    s.weights = copies(net->parameters());
    std::vector<Parameter*> parameters = net->parameters();
    for (const OptimizerStateTensor& t : trainer.optimizer().state_tensors(parameters)) {
      s.optimizer_tensors.push_back(t.tensor->clone());
    }
    *snapshot = std::move(s);
  };
  callbacks.on_epoch = [&](const EpochReport& r) { outcome.epochs.push_back(r); };
  outcome.summary = trainer.fit(train, &test, callbacks);
  outcome.weights = copies(net->parameters());
  return outcome;
}

void expect_resumes_exactly(const Case& c) {
  SCOPED_TRACE(c.name);
  set_cpu_threads(2);
  std::optional<Snapshot> snapshot;
  const Outcome whole = run(c.options, c.interrupt_at, &snapshot, nullptr);
  ASSERT_TRUE(snapshot.has_value()) << "the run never reached step " << c.interrupt_at;
  EXPECT_EQ(snapshot->state.step, c.interrupt_at);
  if (c.options.precision == DType::kF16) {
    EXPECT_GT(snapshot->state.loss_scaler.skipped, 0) << "the scaler should have backed off before the interruption";
    EXPECT_LT(snapshot->state.loss_scaler.scale, c.options.loss_scaling.initial_scale);
    EXPECT_GT(snapshot->state.optimizer_steps, 0);
    EXPECT_GT(whole.summary.skipped_steps, snapshot->state.skipped_steps) << "no step skipped after the interruption";
  }
  const Outcome resumed = run(c.options, 0, nullptr, &*snapshot);

  ASSERT_EQ(whole.weights.size(), resumed.weights.size());
  for (size_t i = 0; i < whole.weights.size(); ++i) {
    EXPECT_EQ(std::memcmp(whole.weights[i].raw(), resumed.weights[i].raw(), whole.weights[i].nbytes()), 0)
        << "parameter " << i << " differs after resuming";
  }
  if (c.options.precision == DType::kF16) {
    EXPECT_GT(whole.summary.skipped_steps, 0) << "the fp16 case should exercise the scaler's backoff";
  }
  EXPECT_EQ(whole.summary.steps, resumed.summary.steps);
  EXPECT_EQ(whole.summary.samples, resumed.summary.samples);
  EXPECT_EQ(whole.summary.skipped_steps, resumed.summary.skipped_steps);
  EXPECT_EQ(whole.summary.final_loss_scale, resumed.summary.final_loss_scale);
  EXPECT_EQ(whole.summary.test.accuracy, resumed.summary.test.accuracy);
  // Every step after the interruption runs at the same learning rate and
  // loss scale to the same loss.
  ASSERT_EQ(resumed.steps.size(), whole.steps.size() - static_cast<size_t>(c.interrupt_at));
  for (size_t i = 0; i < resumed.steps.size(); ++i) {
    const StepProgress& a = whole.steps[static_cast<size_t>(c.interrupt_at) + i];
    const StepProgress& b = resumed.steps[i];
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.epoch, b.epoch) << "step " << a.step;
    EXPECT_EQ(a.lr, b.lr) << "step " << a.step;
    EXPECT_EQ(a.loss_scale, b.loss_scale) << "step " << a.step;
    EXPECT_EQ(a.result.loss, b.result.loss) << "step " << a.step;
    EXPECT_EQ(a.result.applied, b.result.applied) << "step " << a.step;
  }
  // Every epoch that ended after the interruption is reported identically,
  // starting with the one in progress (even when its last step was taken).
  ASSERT_FALSE(resumed.epochs.empty());
  EXPECT_EQ(resumed.epochs.front().epoch, snapshot->state.epoch);
  ASSERT_EQ(resumed.epochs.size(), whole.epochs.size() - static_cast<size_t>(snapshot->state.epoch - 1));
  const size_t skipped = whole.epochs.size() - resumed.epochs.size();
  for (size_t i = 0; i < resumed.epochs.size(); ++i) {
    const EpochReport& a = whole.epochs[skipped + i];
    const EpochReport& b = resumed.epochs[i];
    EXPECT_EQ(a.epoch, b.epoch);
    EXPECT_EQ(a.train_loss, b.train_loss) << "epoch " << a.epoch;
    EXPECT_EQ(a.train_accuracy, b.train_accuracy) << "epoch " << a.epoch;
    EXPECT_EQ(a.test.accuracy, b.test.accuracy) << "epoch " << a.epoch;
  }
}

TrainOptions base_options() {
  TrainOptions options;
  options.max_steps = 25;  // 256 samples in batches of 32: 8 steps per epoch, 4 epochs (the last cut short)
  options.batch_size = 32;
  options.seed = 11;
  return options;
}

TEST(TrainingResume, AdamWFp32MidEpoch) { expect_resumes_exactly({"adamw fp32", base_options(), 11}); }

TEST(TrainingResume, AdamWAtAnEpochBoundary) { expect_resumes_exactly({"adamw boundary", base_options(), 16}); }

TEST(TrainingResume, SgdNesterovMomentum) {
  TrainOptions options = base_options();
  options.optimizer = "sgd";
  options.lr = 0.05f;
  options.nesterov = true;
  expect_resumes_exactly({"sgd nesterov", options, 5});
}

TEST(TrainingResume, CosineScheduleGoesOnFromTheStep) {
  TrainOptions options = base_options();
  auto schedule = LrSchedule::parse("cosine:3");
  ASSERT_TRUE(schedule.is_ok());
  options.schedule = *schedule;
  expect_resumes_exactly({"cosine", options, 13});
}

TEST(TrainingResume, AfterTheLastStepOnlyTheLastEpochReportRemains) {
  expect_resumes_exactly({"last step", base_options(), 25});
}

TEST(TrainingResume, Bf16ComputeCopies) {
  TrainOptions options = base_options();
  options.precision = DType::kBF16;
  expect_resumes_exactly({"bf16", options, 9});
}

TEST(TrainingResume, Fp16WithDynamicLossScaling) {
  TrainOptions options = base_options();
  options.precision = DType::kF16;
  // Overflows for the first 9 steps, then grows every 2 clean steps and
  // overflows on every third: the snapshot after step 13 (applied, one clean
  // step into the next growth) holds moments, a backed-off scale and a clean
  // run, and steps are skipped on both sides of it.
  options.loss_scaling.initial_scale = 1e9f;
  options.loss_scaling.growth_interval = 2;
  options.clip_grad_norm = 1.0f;
  expect_resumes_exactly({"fp16", options, 13});
}

TEST(TrainingResume, GradientAccumulation) {
  TrainOptions options = base_options();
  options.grad_accumulation = 2;
  options.max_steps = 12;
  expect_resumes_exactly({"accumulation", options, 6});
}

TEST(TrainingResume, TheSnapshotMattersForgettingTheMomentsChangesTheWeights) {
  set_cpu_threads(2);
  const TrainOptions options = base_options();
  std::optional<Snapshot> snapshot;
  const Outcome whole = run(options, 11, &snapshot, nullptr);
  ASSERT_TRUE(snapshot.has_value());
  for (Tensor& t : snapshot->optimizer_tensors) std::memset(t.raw(), 0, t.nbytes());
  const Outcome resumed = run(options, 0, nullptr, &*snapshot);
  bool any_difference = false;
  for (size_t i = 0; i < whole.weights.size(); ++i) {
    any_difference |= std::memcmp(whole.weights[i].raw(), resumed.weights[i].raw(), whole.weights[i].nbytes()) != 0;
  }
  EXPECT_TRUE(any_difference) << "the comparison would not notice lost optimizer state";
}

// A state taken from a trainer, with one field spoiled.
TrainerState taken_state() {
  auto net = fresh_model(1);
  Trainer trainer(*net, base_options());
  return trainer.state();
}

void expect_rejected(const TrainerState& state, const std::string& field, DType precision = DType::kF32) {
  auto net = fresh_model(1);
  TrainOptions options = base_options();
  options.precision = precision;
  Trainer trainer(*net, options);
  const Status s = trainer.restore(state);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
  EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
}

TEST(TrainingResume, RestoreRejectsAStateThatCannotBeARun) {
  const TrainerState good = taken_state();
  {
    auto net = fresh_model(1);
    Trainer trainer(*net, base_options());
    EXPECT_TRUE(trainer.restore(good).is_ok());
  }
  TrainerState s = good;
  s.step = -3;
  expect_rejected(s, "step -3 is negative");
  s = good;
  s.step = 26;  // the run has 25
  expect_rejected(s, "step 26 is beyond the run's 25 steps");
  s = good;
  s.epoch = 0;
  expect_rejected(s, "epoch 0");
  s = good;
  s.epoch = 3;  // with no epoch completed
  expect_rejected(s, "epochs_completed");
  s = good;
  s.epoch_offset = -32;
  expect_rejected(s, "epoch_offset");
  s = good;
  s.epoch_offset = 64;  // no sample counted
  expect_rejected(s, "epoch_samples");
  s = good;
  s.optimizer_steps = -1;
  expect_rejected(s, "optimizer_steps");
  s = good;
  s.skipped_steps = 1;  // more than the steps taken
  expect_rejected(s, "skipped_steps");
  s = good;
  s.epoch_rng = Rng::State{};
  expect_rejected(s, "epoch_rng");
  s = good;
  s.loss_scaler.scale = 1024.0f;  // an fp32 run has no loss scale
  expect_rejected(s, "loss scale");
  s = good;
  s.loss_scaler.scale = -1.0f;
  expect_rejected(s, "loss scale", DType::kF16);
  s = good;
  s.train_seconds = std::nan("");
  expect_rejected(s, "train_seconds");
  // Correct predictions are counted per target: more than the samples is
  // a flaw for one target per sample, a language model's state with 64.
  s = good;
  s.epoch_offset = s.epoch_samples = s.samples = 32;
  s.epoch_correct = 33;
  expect_rejected(s, "epoch_correct");
  auto net = fresh_model(1);
  Trainer trainer(*net, base_options());
  EXPECT_TRUE(trainer.restore(s, 64).is_ok());
  s.epoch_correct = s.epoch_samples * 64 + 1;
  EXPECT_FALSE(trainer.restore(s, 64).is_ok());
}

TEST(TrainingResume, ARejectedStateLeavesTheTrainerAsItWas) {
  set_cpu_threads(2);
  const auto train = fashion_split(data::Split::kTrain).head(256);
  TrainOptions options = base_options();
  options.max_steps = 4;
  auto net_a = fresh_model(options.seed);
  auto net_b = fresh_model(options.seed);
  Trainer a(*net_a, options), b(*net_b, options);
  TrainerState bad = b.state();
  bad.step = 2;
  bad.optimizer_steps = 2;
  bad.epoch_offset = 64;  // epoch_samples left at 0
  ASSERT_FALSE(b.restore(bad).is_ok());
  EXPECT_EQ(b.state().step, 0);
  EXPECT_EQ(b.optimizer().steps_taken(), 0);
  a.fit(train, nullptr, {});
  b.fit(train, nullptr, {});
  const std::vector<Parameter*> pa = net_a->parameters(), pb = net_b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(std::memcmp(pa[i]->value.raw(), pb[i]->value.raw(), pa[i]->value.nbytes()), 0) << pa[i]->name;
  }
}

// fit() without restore() after a finished run trains a new run, as before
// resuming existed: step 0, epoch 1, the generator and the optimizer going on.
TEST(TrainingResume, ASecondFitTrainsANewRun) {
  set_cpu_threads(2);
  const auto train = fashion_split(data::Split::kTrain).head(256);
  TrainOptions options = base_options();
  options.max_steps = 10;
  auto net = fresh_model(options.seed);
  Trainer trainer(*net, options);
  const TrainSummary first = trainer.fit(train, nullptr, {});
  EXPECT_EQ(first.steps, 10);
  EXPECT_EQ(trainer.state().step, 10);
  const std::vector<Tensor> after_first = copies(net->parameters());
  std::vector<int64_t> steps_seen;
  const TrainSummary second =
      trainer.fit(train, nullptr, {[&](const StepProgress& p) { steps_seen.push_back(p.step); }, nullptr});
  EXPECT_EQ(second.steps, 10);
  EXPECT_EQ(second.samples, first.samples);
  EXPECT_EQ(second.epochs_completed, 2);
  ASSERT_EQ(steps_seen.size(), 10u);
  EXPECT_EQ(steps_seen.front(), 1);
  EXPECT_EQ(trainer.optimizer().steps_taken(), 20);
  bool moved = false;
  const std::vector<Parameter*> parameters = net->parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    moved |= std::memcmp(parameters[i]->value.raw(), after_first[i].raw(), after_first[i].nbytes()) != 0;
  }
  EXPECT_TRUE(moved);
}

// A state taken before any step (the generator as seeded) restores into a
// fresh trainer and trains exactly as one never restored.
TEST(TrainingResume, AStateTakenBeforeFitRestoresToAFreshRun) {
  set_cpu_threads(2);
  const TrainOptions options = base_options();
  Snapshot s;
  {
    auto net = fresh_model(options.seed);
    Trainer trainer(*net, options);
    s.state = trainer.state();
    s.weights = copies(net->parameters());
    std::vector<Parameter*> parameters = net->parameters();
    for (const OptimizerStateTensor& t : trainer.optimizer().state_tensors(parameters)) {
      s.optimizer_tensors.push_back(t.tensor->clone());
    }
  }
  const Outcome whole = run(options, 0, nullptr, nullptr);
  const Outcome resumed = run(options, 0, nullptr, &s);
  ASSERT_EQ(whole.epochs.size(), resumed.epochs.size());
  for (size_t i = 0; i < whole.weights.size(); ++i) {
    EXPECT_EQ(std::memcmp(whole.weights[i].raw(), resumed.weights[i].raw(), whole.weights[i].nbytes()), 0);
  }
}

}  // namespace
}  // namespace fedmesh::train
