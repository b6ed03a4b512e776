// DP-SGD in the trainer (TrainOptions::dp_clip_norm, dp_noise_multiplier):
// - without noise, a step moves the weights by exactly -lr times the mean of
//   the examples' gradients each clipped to the norm on its own (computed
//   here one example at a time), within 1e-6;
// - the noise is N(0, (σC)²) per coordinate of the summed gradient: the
//   step's deviation from the noiseless step, divided by lr, has standard
//   deviation σC / B over fc1's 401 408 coordinates (within 2%), and with
//   dp_seeded_noise the same seed draws the same noise while another seed
//   does not;
// - without dp_seeded_noise the noise comes from the CSPRNG: two runs with
//   the same seed draw different noise, of the same scale;
// - options that cannot be private are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/elementwise.h"
#include "kernels/loss.h"
#include "train/model.h"
#include "train/trainer.h"
#include "tests/support/fashion_data.h"

namespace fedmesh::train {
namespace {

using fedmesh::testing::fashion_split;

constexpr int64_t kBatch = 8;

TrainOptions dp_options(float clip, float noise, uint64_t seed, bool seeded = true) {
  TrainOptions o;
  o.optimizer = "sgd";
  o.momentum = 0.0f;
  o.weight_decay = 0.0f;
  o.lr = 1.0f;
  o.batch_size = kBatch;
  o.dp_clip_norm = clip;
  o.dp_noise_multiplier = noise;
  o.dp_seed = seed;
  o.dp_seeded_noise = seeded;
  return o;
}

std::vector<float> weights(Sequential& model) {
  std::vector<float> out;
  for (Parameter* p : model.parameters()) out.insert(out.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
  return out;
}

// The weights after one DP step on the first kBatch images.
std::vector<float> one_step(const data::ImageDataset& images, const TrainOptions& options) {
  std::unique_ptr<Sequential> model = std::move(make_model("mlp", 3).value());
  Trainer trainer(*model, options);
  std::vector<int64_t> batch(kBatch);
  for (int64_t i = 0; i < kBatch; ++i) batch[static_cast<size_t>(i)] = i;
  const StepResult r = trainer.train_step(images, batch, options.lr);
  EXPECT_TRUE(r.applied);
  EXPECT_EQ(r.samples, kBatch);
  return weights(*model);
}

TEST(DpSgd, ANoiselessStepIsTheMeanOfClippedPerExampleGradients) {
  const data::ImageDataset images = fashion_split(data::Split::kTrain).head(kBatch);
  const float clip = 0.05f;  // far below the examples' gradient norms: every one is clipped
  const std::vector<float> after = one_step(images, dp_options(clip, 0.0f, 1));
  // By hand: each example's gradient, clipped, averaged.
  std::unique_ptr<Sequential> model = std::move(make_model("mlp", 3).value());
  const std::vector<float> before = weights(*model);
  std::vector<double> mean(before.size(), 0.0);
  Tensor inputs;
  std::vector<int32_t> labels;
  int clipped = 0;
  for (int64_t i = 0; i < kBatch; ++i) {
    model->zero_grad();
    const std::vector<int64_t> one = {i};
    data::ImageBatches(images).make_batch(one, DType::kF32, inputs, labels);
    const Tensor logits = model->forward(inputs, true);
    Tensor dlogits = Tensor::empty(logits.shape());
    softmax_cross_entropy(logits, labels, &dlogits, 1.0f, 1.0f);
    model->backward(dlogits);
    double squared = 0.0;
    for (Parameter* p : model->parameters()) squared += squared_l2_norm(p->grad);
    const double factor = std::min(1.0, clip / std::sqrt(squared));
    clipped += factor < 1.0;
    size_t at = 0;
    for (Parameter* p : model->parameters()) {
      for (int64_t k = 0; k < p->grad.numel(); ++k) mean[at++] += factor * p->grad.data<float>()[k] / kBatch;
    }
  }
  EXPECT_EQ(clipped, kBatch);
  double worst = 0.0, moved = 0.0;
  for (size_t k = 0; k < before.size(); ++k) {
    worst = std::max(worst, std::fabs((static_cast<double>(before[k]) - mean[k]) - after[k]));
    moved = std::max(moved, std::fabs(static_cast<double>(after[k]) - before[k]));
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(moved, 1e-4);
}

TEST(DpSgd, TheNoiseHasTheStatedScaleAndFollowsTheSeed) {
  const data::ImageDataset images = fashion_split(data::Split::kTrain).head(kBatch);
  const float clip = 1.0f, sigma = 2.0f;
  const std::vector<float> quiet = one_step(images, dp_options(clip, 0.0f, 5));
  const std::vector<float> noisy = one_step(images, dp_options(clip, sigma, 5));
  EXPECT_EQ(one_step(images, dp_options(clip, sigma, 5)), noisy) << "the same seed draws the same noise";
  EXPECT_NE(one_step(images, dp_options(clip, sigma, 6)), noisy) << "another seed, other noise";
  // fc1.weight: the first 784 x 512 values. lr = 1: the difference is the noise / B.
  const size_t n = 784 * 512;
  double sum = 0.0, squares = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const double d = static_cast<double>(quiet[k]) - noisy[k];
    sum += d;
    squares += d * d;
  }
  const double mean = sum / n, deviation = std::sqrt(squares / n - mean * mean);
  const double expected = sigma * clip / kBatch;
  EXPECT_NEAR(deviation, expected, 0.02 * expected);
  EXPECT_NEAR(mean, 0.0, 0.01 * expected);
}

TEST(DpSgd, CsprngNoiseDiffersBetweenRunsAndHasTheStatedScale) {
  const data::ImageDataset images = fashion_split(data::Split::kTrain).head(kBatch);
  const float clip = 1.0f, sigma = 2.0f;
  const std::vector<float> quiet = one_step(images, dp_options(clip, 0.0f, 5, false));
  const std::vector<float> first = one_step(images, dp_options(clip, sigma, 5, false));
  const std::vector<float> second = one_step(images, dp_options(clip, sigma, 5, false));
  EXPECT_NE(first, second) << "the CSPRNG drew the same noise twice";
  const size_t n = 784 * 512;
  double squares = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const double d = static_cast<double>(quiet[k]) - first[k];
    squares += d * d;
  }
  const double expected = sigma * clip / kBatch;
  EXPECT_NEAR(std::sqrt(squares / n), expected, 0.02 * expected);
}

TEST(DpSgd, OptionsThatCannotBePrivateAreRefused) {
  TrainOptions o = dp_options(1.0f, 1.0f, 0);
  EXPECT_TRUE(o.validate().is_ok());
  o.precision = DType::kF16;
  EXPECT_NE(o.validate().message().find("fp16"), std::string::npos);
  o = dp_options(0.0f, 1.0f, 0);
  EXPECT_NE(o.validate().message().find("--dp-noise needs --dp-clip"), std::string::npos);
  o = dp_options(1.0f, 1.0f, 0);
  o.data_parallel_ranks = 2;
  EXPECT_NE(o.validate().message().find("data-parallel"), std::string::npos);
  o = dp_options(-1.0f, 1.0f, 0);
  EXPECT_NE(o.validate().message().find("--dp-clip"), std::string::npos);
}

}  // namespace
}  // namespace fedmesh::train
