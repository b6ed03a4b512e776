// Mixed precision on the CPU: bf16/fp16 compute copies of fp32 master
// weights, fp32 accumulation, and dynamic loss scaling for fp16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/convert.h"
#include "train/trainer.h"
#include "tests/support/fashion_data.h"
#include "tests/support/gradient_check.h"

namespace fedmesh::train {
namespace {

using fedmesh::testing::fashion_split;

TEST(LossScaler, OverflowSkipsAndHalvesThenGrowsAfterCleanSteps) {
  LossScalerOptions options;
  options.initial_scale = 1024.0f;
  options.growth_interval = 3;
  DynamicLossScaler scaler(options);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 512.0f);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 256.0f);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_TRUE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 256.0f);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 512.0f) << "doubles after growth_interval clean steps";
  EXPECT_EQ(scaler.skipped_steps(), 2);
}

TEST(LossScaler, StaysWithinBounds) {
  LossScalerOptions options;
  options.initial_scale = 2.0f;
  options.min_scale = 1.0f;
  options.max_scale = 4.0f;
  options.growth_interval = 1;
  DynamicLossScaler scaler(options);
  for (int i = 0; i < 5; ++i) scaler.update(false);
  EXPECT_EQ(scaler.scale(), 1.0f);
  for (int i = 0; i < 5; ++i) scaler.update(true);
  EXPECT_EQ(scaler.scale(), 4.0f);
}

TEST(LossScaler, FixedUnitScaleNeverChangesButStillSkipsOverflow) {
  DynamicLossScaler scaler = DynamicLossScaler::fixed_unit_scale();
  EXPECT_FALSE(scaler.update(false));
  EXPECT_EQ(scaler.scale(), 1.0f);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_EQ(scaler.scale(), 1.0f);
}

// Low-precision logits stay close to fp32 ones: the error is that of rounding
// weights and activations to 8 (bf16) or 11 (fp16) significant bits.
TEST(MixedPrecision, ForwardStaysCloseToFp32) {
  Rng rng(3);
  const Tensor x = fedmesh::testing::random_tensor({4, 1, 28, 28}, rng);
  for (const auto& [dtype, tolerance] : {std::pair{DType::kBF16, 0.05}, std::pair{DType::kF16, 0.01}}) {
    auto reference = make_model("cnn", 9), low = make_model("cnn", 9);
    const Tensor expected = (*reference)->forward(x, false).clone();
    (*low)->set_compute_dtype(dtype);
    const Tensor logits = (*low)->forward(to_dtype(x, dtype), false);
    ASSERT_EQ(logits.dtype(), dtype);
    const Tensor widened = to_dtype(logits, DType::kF32);
    double max_error = 0.0, max_value = 0.0;
    for (int64_t i = 0; i < expected.numel(); ++i) {
      max_error = std::max(max_error, std::fabs(static_cast<double>(widened.data<float>()[i]) - expected.data<float>()[i]));
      max_value = std::max(max_value, std::fabs(static_cast<double>(expected.data<float>()[i])));
    }
    EXPECT_LT(max_error, tolerance * std::max(1.0, max_value)) << dtype_name(dtype);
    EXPECT_GT(max_error, 0.0) << dtype_name(dtype) << " should really compute in low precision";
  }
}

TEST(MixedPrecision, MasterWeightsStayFp32AndComputeCopiesFollowThem) {
  auto net = make_model("mlp", 1);
  (*net)->set_compute_dtype(DType::kBF16);
  for (Parameter* p : (*net)->parameters()) {
    EXPECT_EQ(p->value.dtype(), DType::kF32);
    EXPECT_EQ(p->compute.dtype(), DType::kBF16);
    p->value.data<float>()[0] = 1.0f + 1.0f / 1024.0f;  // not representable in bf16
  }
  (*net)->refresh_compute();
  for (Parameter* p : (*net)->parameters()) {
    EXPECT_EQ(to_float(p->compute.data<bf16>()[0]), 1.0f) << "rounded to nearest bf16";
    EXPECT_EQ(p->value.data<float>()[0], 1.0f + 1.0f / 1024.0f) << "master keeps full precision";
  }
}

// An injected overflow: a loss scale of 2^40 makes every fp16 gradient Inf.
// The trainer must skip those steps without touching the weights, halve the
// scale until gradients fit, and then learn normally.
TEST(MixedPrecision, Fp16OverflowIsSkippedAndTheScaleBacksOff) {
  const auto train = fashion_split(data::Split::kTrain).head(6400);
  const auto test = fashion_split(data::Split::kTest).head(1000);
  auto net = make_model("mlp", 4);
  TrainOptions options;
  options.precision = DType::kF16;
  options.loss_scaling.initial_scale = std::ldexp(1.0f, 40);
  options.epochs = 2;
  Trainer trainer(**net, options);

  std::vector<float> before;
  for (Parameter* p : (*net)->parameters())
    before.insert(before.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
  std::vector<int64_t> first(64);
  std::iota(first.begin(), first.end(), 0);
  const StepResult overflowed = trainer.train_step(train, first, options.lr);
  EXPECT_FALSE(overflowed.applied);
  EXPECT_EQ(trainer.loss_scaler().scale(), std::ldexp(1.0f, 39));
  std::vector<float> after;
  for (Parameter* p : (*net)->parameters())
    after.insert(after.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
  EXPECT_EQ(0, std::memcmp(before.data(), after.data(), before.size() * sizeof(float))) << "a skipped step changed weights";

  const TrainSummary summary = trainer.fit(train, &test, {});
  EXPECT_GT(summary.skipped_steps, 0);
  EXPECT_LT(summary.final_loss_scale, std::ldexp(1.0f, 30));
  EXPECT_LT(summary.skipped_steps, summary.steps / 4) << "the scale should settle quickly";
  EXPECT_GE(summary.test.accuracy, 0.75) << "fp16 training with loss scaling should still learn";
}

TEST(MixedPrecision, Bf16TrainingLearns) {
  const auto train = fashion_split(data::Split::kTrain).head(6400);
  const auto test = fashion_split(data::Split::kTest).head(1000);
  auto net = make_model("cnn", 6);
  TrainOptions options;
  options.precision = DType::kBF16;
  options.epochs = 1;
  Trainer trainer(**net, options);
  const TrainSummary summary = trainer.fit(train, &test, {});
  EXPECT_EQ(summary.skipped_steps, 0) << "bf16 has fp32's range: nothing should overflow";
  EXPECT_EQ(summary.final_loss_scale, 1.0f);
  EXPECT_GE(summary.test.accuracy, 0.75);
}

}  // namespace
}  // namespace fedmesh::train
