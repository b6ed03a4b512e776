// The trainer end to end on real Fashion-MNIST subsets: it learns, it replays
// exactly for a seed, and accumulation, clipping and step limits do what they say.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/parallel.h"
#include "train/trainer.h"
#include "tests/support/fashion_data.h"

namespace fedmesh::train {
namespace {

using fedmesh::testing::fashion_split;

std::unique_ptr<Sequential> model(const std::string& name, uint64_t seed) {
  auto m = make_model(name, seed);
  EXPECT_TRUE(m.is_ok());
  return std::move(m).value();
}

TEST(Training, MlpLearnsOnASubset) {
  const auto train = fashion_split(data::Split::kTrain).head(12000);
  const auto test = fashion_split(data::Split::kTest).head(2000);
  auto net = model("mlp", 1);
  TrainOptions options;
  options.epochs = 2;
  options.seed = 1;
  Trainer trainer(*net, options);
  std::vector<EpochReport> epochs;
  const TrainSummary summary = trainer.fit(train, &test, {nullptr, [&](const EpochReport& r) { epochs.push_back(r); }});
  ASSERT_EQ(epochs.size(), 2u);
  EXPECT_LT(epochs[1].train_loss, epochs[0].train_loss);
  EXPECT_GE(summary.test.accuracy, 0.80) << "mlp stopped learning";
  EXPECT_EQ(summary.test.count, 2000);
  EXPECT_EQ(summary.steps, 2 * ((12000 + 63) / 64));
  EXPECT_EQ(summary.skipped_steps, 0);
}

TEST(Training, CnnLearnsOnASubset) {
  const auto train = fashion_split(data::Split::kTrain).head(8000);
  const auto test = fashion_split(data::Split::kTest).head(2000);
  auto net = model("cnn", 2);
  TrainOptions options;
  options.epochs = 1;
  options.seed = 2;
  Trainer trainer(*net, options);
  const TrainSummary summary = trainer.fit(train, &test, {});
  EXPECT_GE(summary.test.accuracy, 0.78) << "cnn stopped learning";
}

TEST(Training, SameSeedReplaysBitForBit) {
  const auto train = fashion_split(data::Split::kTrain).head(1280);
  set_cpu_threads(2);
  const auto run = [&](uint64_t seed) {
    auto net = model("cnn", seed);
    TrainOptions options;
    options.max_steps = 8;
    options.seed = seed;
    Trainer trainer(*net, options);
    trainer.fit(train, nullptr, {});
    std::vector<float> weights;
    for (Parameter* p : net->parameters())
      weights.insert(weights.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
    return weights;
  };
  const auto a = run(7), b = run(7), c = run(8);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
}

TEST(Training, GradientAccumulationEqualsOneLargeBatch) {
  const auto& train = fashion_split(data::Split::kTrain);
  std::vector<int64_t> indices(64);
  std::iota(indices.begin(), indices.end(), 100);
  const auto step_with = [&](int64_t batch_size, int64_t accumulation) {
    auto net = model("mlp", 3);
    TrainOptions options;
    options.optimizer = "sgd";
    options.momentum = 0.0f;
    options.weight_decay = 0.0f;
    options.batch_size = batch_size;
    options.grad_accumulation = accumulation;
    Trainer trainer(*net, options);
    trainer.train_step(train, indices, 0.1f);
    return net;
  };
  auto whole = step_with(64, 1), split = step_with(16, 4);
  const auto pw = whole->parameters(), ps = split->parameters();
  for (size_t i = 0; i < pw.size(); ++i) {
    for (int64_t j = 0; j < pw[i]->value.numel(); ++j) {
      // Same sum in a different order: fp32 rounding differences only.
      ASSERT_NEAR(pw[i]->value.data<float>()[j], ps[i]->value.data<float>()[j], 1e-6) << pw[i]->name << " " << j;
    }
  }
}

TEST(Training, ClippingBoundsTheUpdate) {
  const auto& train = fashion_split(data::Split::kTrain);
  std::vector<int64_t> indices(32);
  std::iota(indices.begin(), indices.end(), 0);
  auto net = model("mlp", 4);
  std::vector<std::vector<float>> before;
  for (Parameter* p : net->parameters())
    before.emplace_back(p->value.data<float>(), p->value.data<float>() + p->value.numel());
  TrainOptions options;
  options.optimizer = "sgd";
  options.momentum = 0.0f;
  options.weight_decay = 0.0f;
  options.clip_grad_norm = 0.01f;
  Trainer trainer(*net, options);
  const StepResult result = trainer.train_step(train, indices, 1.0f);
  ASSERT_GT(result.grad_norm, 0.01) << "the unclipped gradient should exceed the clip";
  double squared_change = 0.0;
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    for (int64_t j = 0; j < params[i]->value.numel(); ++j) {
      const double d = params[i]->value.data<float>()[j] - before[i][static_cast<size_t>(j)];
      squared_change += d * d;
    }
  // SGD with lr 1: the update is exactly the clipped gradient.
  EXPECT_NEAR(std::sqrt(squared_change), 0.01, 1e-4);
}

TEST(Training, StepLimitAndScheduleAreHonoured) {
  const auto train = fashion_split(data::Split::kTrain).head(640);
  auto net = model("mlp", 5);
  TrainOptions options;
  options.max_steps = 25;  // more than one epoch of 10 steps
  options.schedule = LrSchedule::parse("cosine:5").value();
  Trainer trainer(*net, options);
  std::vector<float> lrs;
  const TrainSummary summary = trainer.fit(train, nullptr, {[&](const StepProgress& p) { lrs.push_back(p.lr); }, nullptr});
  EXPECT_EQ(summary.steps, 25);
  EXPECT_EQ(summary.epochs_completed, 3);
  ASSERT_EQ(lrs.size(), 25u);
  EXPECT_FLOAT_EQ(lrs[0], options.lr / 5);
  EXPECT_FLOAT_EQ(lrs[4], options.lr);
  EXPECT_LT(lrs[24], 0.01f * options.lr);
}

TEST(TrainOptions, RejectsBadValuesByName) {
  const auto message = [](auto mutate) {
    TrainOptions options;
    mutate(options);
    return options.validate().message();
  };
  EXPECT_NE(message([](TrainOptions& o) { o.batch_size = 0; }).find("--batch-size"), std::string::npos);
  EXPECT_NE(message([](TrainOptions& o) { o.lr = -1; }).find("--lr"), std::string::npos);
  EXPECT_NE(message([](TrainOptions& o) { o.lr = NAN; }).find("--lr"), std::string::npos);
  EXPECT_NE(message([](TrainOptions& o) { o.optimizer = "lion"; }).find("--optimizer"), std::string::npos);
  EXPECT_NE(message([](TrainOptions& o) { o.grad_accumulation = 0; }).find("--grad-accumulation"), std::string::npos);
  EXPECT_NE(message([](TrainOptions& o) { o.clip_grad_norm = -1; }).find("--clip-grad-norm"), std::string::npos);
  EXPECT_TRUE(TrainOptions{}.validate().is_ok());
}

}  // namespace
}  // namespace fedmesh::train
