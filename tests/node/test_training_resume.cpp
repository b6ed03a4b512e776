// A run interrupted at step k and continued in a fresh model and trainer from
// a snapshot of (weights, optimizer tensors, TrainerState) ends with the same
// weights, bit for bit, and the same epoch reports as a run never interrupted:
// for AdamW and SGD with Nesterov momentum, fp32, bf16 and fp16 with dynamic
// loss scaling, gradient accumulation, and a stop at an epoch boundary.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>

#include "kernels/parallel.h"
#include "node/trainer.h"
#include "tests/support/fashion_data.h"

namespace fedmesh::node {
namespace {

using fedmesh::testing::fashion_split;

struct Snapshot {
  TrainerState state;
  std::vector<Tensor> weights;
  std::vector<Tensor> optimizer_tensors;
};

struct Outcome {
  std::vector<Tensor> weights;
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
  // Every epoch that ended after the interruption is reported identically.
  ASSERT_FALSE(resumed.epochs.empty());
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

TEST(TrainingResume, Bf16ComputeCopies) {
  TrainOptions options = base_options();
  options.precision = DType::kBF16;
  expect_resumes_exactly({"bf16", options, 9});
}

TEST(TrainingResume, Fp16WithDynamicLossScaling) {
  TrainOptions options = base_options();
  options.precision = DType::kF16;
  options.loss_scaling.initial_scale = 1e9f;  // overflows first: the scaler's backoff is part of the state
  options.loss_scaling.growth_interval = 4;
  options.clip_grad_norm = 1.0f;
  expect_resumes_exactly({"fp16", options, 7});
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

TEST(TrainingResume, RestoreRejectsAStateThatCannotBeARun) {
  auto net = fresh_model(1);
  Trainer trainer(*net, base_options());
  TrainerState state;
  state.step = -3;
  Status s = trainer.restore(state);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("step"), std::string::npos) << s.message();
  state = TrainerState{};
  state.loss_scaler.scale = 1024.0f;  // an fp32 run has no loss scale
  s = trainer.restore(state);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("loss scale"), std::string::npos) << s.message();
  state = TrainerState{};
  state.epoch = 3;  // with no epoch completed
  EXPECT_FALSE(trainer.restore(state).is_ok());
}

}  // namespace
}  // namespace fedmesh::node
