// Every layer's backward pass against central finite differences of the
// scalar loss sum(r ⊙ forward(x)) for a fixed random r; then whole models
// against finite differences of their cross-entropy loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kernels/loss.h"
#include "train/layers/layers.h"
#include "train/layers/spec_layers.h"
#include "train/model.h"
#include "tests/support/gradient_check.h"
#include "tests/support/model_gradient_check.h"

namespace fedmesh::train {
namespace {

using fedmesh::testing::expect_gradient_matches;
using fedmesh::testing::random_tensor;

double projected_loss(Layer& layer, const Tensor& x, const Tensor& r) {
  const Tensor y = layer.forward(x, /*training=*/false);
  const float* py = y.data<float>();
  const float* pr = r.data<float>();
  double total = 0.0;
  for (int64_t i = 0; i < y.numel(); ++i) total += static_cast<double>(py[i]) * pr[i];
  return total;
}

void check_layer(Layer& layer, Tensor x, uint64_t seed) {
  Rng rng(seed);
  const Tensor y = layer.forward(x, /*training=*/true);
  ASSERT_EQ(y.shape(), layer.output_shape(x.shape()));
  const Tensor r = random_tensor(y.shape(), rng);
  for (Parameter* p : layer.parameters()) std::fill_n(p->grad.data<float>(), p->grad.numel(), 0.0f);
  const Tensor dx = layer.backward(r, /*need_input_grad=*/true).clone();
  ASSERT_EQ(dx.shape(), x.shape());
  const auto loss = [&] { return projected_loss(layer, x, r); };
  expect_gradient_matches(layer.kind() + " input", x.data<float>(), dx.data<float>(), x.numel(), loss, [] {}, rng);
  for (Parameter* p : layer.parameters()) {
    const Tensor analytic = p->grad.clone();
    expect_gradient_matches(p->name, p->value.data<float>(), analytic.data<float>(), p->value.numel(), loss,
                            [p] { p->refresh_compute(); }, rng);
  }
}

// Values bounded away from zero so that no finite-difference step crosses
// the ReLU kink.
Tensor away_from_zero(Shape shape, Rng& rng) {
  Tensor t = Tensor::empty(std::move(shape));
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float magnitude = 0.1f + static_cast<float>(rng.uniform());
    p[i] = rng.uniform() < 0.5 ? -magnitude : magnitude;
  }
  return t;
}

TEST(LayerGradients, Linear) {
  Rng rng(1);
  Linear layer("fc", 7, 5);
  layer.initialize(rng);
  check_layer(layer, random_tensor({3, 7}, rng), 11);
}

TEST(LayerGradients, LinearFlattensTrailingDimensions) {
  Rng rng(2);
  Linear layer("fc", 12, 3);
  layer.initialize(rng);
  check_layer(layer, random_tensor({2, 3, 4}, rng), 12);
}

TEST(LayerGradients, ReLU) {
  Rng rng(3);
  ReLU layer;
  check_layer(layer, away_from_zero({4, 9}, rng), 13);
}

TEST(LayerGradients, Gelu) {
  Rng rng(4);
  Gelu layer;
  check_layer(layer, random_tensor({4, 9}, rng, 2.0f), 14);
}

TEST(LayerGradients, Flatten) {
  Rng rng(5);
  Flatten layer;
  check_layer(layer, random_tensor({2, 3, 2, 2}, rng), 15);
}

TEST(LayerGradients, Conv2dSamePadding) {
  Rng rng(6);
  Conv2d layer("conv", 2, 3, 3, 1, 1);
  layer.initialize(rng);
  check_layer(layer, random_tensor({2, 2, 5, 6}, rng), 16);
}

TEST(LayerGradients, Conv2dStrideTwoNoPadding) {
  Rng rng(7);
  Conv2d layer("conv", 3, 2, 3, 2, 0);
  layer.initialize(rng);
  check_layer(layer, random_tensor({1, 3, 7, 9}, rng), 17);
}

TEST(LayerGradients, MaxPool2d) {
  // Distinct values 0.05 apart (far more than the 1e-2 step) so no step changes the argmax.
  Tensor x = Tensor::empty({2, 2, 4, 6});
  std::vector<int> order(static_cast<size_t>(x.numel()));
  std::iota(order.begin(), order.end(), 0);
  Rng rng(8);
  rng.shuffle(std::span<int>(order));
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = 0.05f * static_cast<float>(order[i]) - 2.0f;
  MaxPool2d layer(2, 2);
  check_layer(layer, x, 18);
}

TEST(LayerGradients, LayerNorm) {
  Rng rng(9);
  LayerNorm layer("ln", 8);
  // Non-trivial affine parameters so their gradients matter.
  for (Parameter* p : layer.parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] += 0.3f * static_cast<float>(rng.normal());
  }
  check_layer(layer, random_tensor({5, 8}, rng), 19);
}

// The layers config-defined models add (train/layers/spec_layers.h).
TEST(LayerGradients, Silu) {
  Rng rng(31);
  Silu layer;
  check_layer(layer, random_tensor({3, 7}, rng), 32);
}

TEST(LayerGradients, AvgPool2d) {
  Rng rng(33);
  AvgPool2d pool(2, 2);
  check_layer(pool, random_tensor({2, 3, 5, 6}, rng), 34);  // odd side: the last row dropped
  AvgPool2d overlapping(3, 1);
  check_layer(overlapping, random_tensor({1, 2, 5, 5}, rng), 35);
}

TEST(LayerGradients, GlobalAvgPool2d) {
  Rng rng(36);
  GlobalAvgPool2d pool;
  check_layer(pool, random_tensor({2, 4, 3, 5}, rng), 37);
  const Tensor x = random_tensor({1, 2, 2, 2}, rng);
  const Tensor y = pool.forward(x, false);
  const float* px = x.data<float>();
  EXPECT_NEAR(y.data<float>()[1], (px[4] + px[5] + px[6] + px[7]) / 4.0f, 1e-6f);
}

TEST(LayerGradients, GroupNorm) {
  Rng rng(40);
  GroupNorm norm("gn", 3, 6);
  // Weights away from 1 and biases away from 0, so that both are exercised.
  for (int64_t c = 0; c < 6; ++c) {
    norm.parameters()[0]->value.data<float>()[c] = 0.5f + 0.25f * static_cast<float>(c);
    norm.parameters()[1]->value.data<float>()[c] = 0.1f * static_cast<float>(c) - 0.2f;
  }
  check_layer(norm, random_tensor({2, 6, 3, 3}, rng), 41);
  GroupNorm table("gn2", 2, 4);  // (batch, features): each group over its features only
  check_layer(table, random_tensor({3, 4}, rng), 42);
}

TEST(LayerGradients, ResidualWithAndWithoutAShortcut) {
  Rng rng(43);
  {
    std::vector<std::unique_ptr<Layer>> body;
    auto conv = std::make_unique<Conv2d>("res1.conv1", 3, 3, 3, 1, 1);
    conv->initialize(rng);
    body.push_back(std::move(conv));
    body.push_back(std::make_unique<Gelu>());
    Residual same(std::move(body), nullptr);
    check_layer(same, random_tensor({2, 3, 5, 5}, rng), 44);
  }
  std::vector<std::unique_ptr<Layer>> body;
  auto conv = std::make_unique<Conv2d>("res2.conv1", 2, 4, 3, 2, 1);
  conv->initialize(rng);
  body.push_back(std::move(conv));
  body.push_back(std::make_unique<Silu>());
  auto shortcut = std::make_unique<Conv2d>("res2.shortcut", 2, 4, 1, 2, 0);
  shortcut->initialize(rng);
  Residual projected(std::move(body), std::move(shortcut));
  check_layer(projected, random_tensor({2, 2, 6, 6}, rng), 45);
  EXPECT_EQ(projected.parameters().size(), 4u);
}

TEST(LayerGradients, DropoutZeroesAFractionAndScalesTheRest) {
  Rng rng(38);
  Dropout dropout(0.25, 7);
  const Tensor x = away_from_zero({4, 1000}, rng);
  EXPECT_EQ(dropout.forward(x, /*training=*/false).data<float>(), x.data<float>()) << "inference: the identity";
  const Tensor y = dropout.forward(x, /*training=*/true).clone();
  const Tensor dy = random_tensor({4, 1000}, rng);
  const Tensor dx = dropout.backward(dy, true).clone();
  int64_t zeroed = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float kept = y.data<float>()[i] / x.data<float>()[i];
    if (y.data<float>()[i] == 0.0f) {
      ++zeroed;
      EXPECT_EQ(dx.data<float>()[i], 0.0f);
    } else {
      EXPECT_NEAR(kept, 1.0f / 0.75f, 1e-5f);
      EXPECT_NEAR(dx.data<float>()[i], dy.data<float>()[i] / 0.75f, 1e-5f) << "the same mask backward";
    }
  }
  EXPECT_NEAR(static_cast<double>(zeroed) / static_cast<double>(x.numel()), 0.25, 0.03);
  Dropout again(0.25, 7);
  const Tensor y2 = again.forward(x, true);
  EXPECT_EQ(0, std::memcmp(y.data<float>(), y2.data<float>(), y.nbytes())) << "the same seed, the same masks";
}

// Whole models: d(mean cross-entropy)/d(parameters) against finite differences.
void check_model(const std::string& name) {
  auto model = make_model(name, 21);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  Rng rng(22);
  fedmesh::testing::expect_model_gradients_match(name, **model, random_tensor({3, 1, 28, 28}, rng), {1, 7, 4}, rng);
}

TEST(ModelGradients, Mlp) { check_model("mlp"); }
TEST(ModelGradients, Cnn) { check_model("cnn"); }

TEST(Models, StableParameterNamesAndShapes) {
  auto cnn = make_model("cnn", 0);
  ASSERT_TRUE(cnn.is_ok());
  std::vector<std::string> names;
  for (Parameter* p : (*cnn)->parameters()) names.push_back(p->name);
  EXPECT_EQ(names, (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight",
                                             "fc1.bias", "fc2.weight", "fc2.bias"}));
  EXPECT_EQ((*cnn)->parameter_count(), 32 * 9 + 32 + 64 * 32 * 9 + 64 + 3136 * 128 + 128 + 128 * 10 + 10);
  auto mlp = make_model("mlp", 0);
  ASSERT_TRUE(mlp.is_ok());
  EXPECT_EQ((*mlp)->parameter_count(), 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
}

TEST(Models, UnknownModelIsRejectedWithTheChoices) {
  auto model = make_model("resnet", 0);
  ASSERT_FALSE(model.is_ok());
  EXPECT_EQ(model.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(model.status().message().find("mlp, cnn"), std::string::npos);
}

TEST(Models, SameSeedSameInitialization) {
  auto a = make_model("cnn", 5), b = make_model("cnn", 5), c = make_model("cnn", 6);
  const auto pa = (*a)->parameters(), pb = (*b)->parameters(), pc = (*c)->parameters();
  bool any_different = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(pa[i]->value.raw(), pb[i]->value.raw(), pa[i]->value.nbytes())) << pa[i]->name;
    any_different |= std::memcmp(pa[i]->value.raw(), pc[i]->value.raw(), pa[i]->value.nbytes()) != 0;
  }
  EXPECT_TRUE(any_different);
}

}  // namespace
}  // namespace fedmesh::train
