// Server optimizers against values computed by hand from their update rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "aggregator/server_optimizer.h"

namespace fedmesh::aggregator {
namespace {

Tensor vector_of(std::initializer_list<float> values) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

std::unique_ptr<ServerOptimizer> make(const std::string& name, float lr) {
  auto options = ServerOptimizerOptions::defaults_for(name);
  EXPECT_TRUE(options.is_ok());
  options->lr = lr;
  options->tau = 0.01f;
  auto optimizer = make_server_optimizer(*options);
  EXPECT_TRUE(optimizer.is_ok()) << optimizer.status().to_string();
  return std::move(optimizer).value();
}

// One step of `name` on x = [1, -2] with delta = [0.5, -1].
std::pair<float, float> one_step(const std::string& name, float lr) {
  auto optimizer = make(name, lr);
  Tensor x = vector_of({1.0f, -2.0f});
  const Tensor delta = vector_of({0.5f, -1.0f});
  EXPECT_TRUE(optimizer->step({{"w", &x, &delta}}).is_ok());
  return {x.data<float>()[0], x.data<float>()[1]};
}

TEST(ServerOptimizer, FedAvgAddsTheScaledDelta) {
  const auto [a, b] = one_step("fedavg", 1.0f);
  EXPECT_FLOAT_EQ(a, 1.5f);
  EXPECT_FLOAT_EQ(b, -3.0f);
  EXPECT_FLOAT_EQ(one_step("fedavg", 0.5f).first, 1.25f);
}

TEST(ServerOptimizer, FedAvgMAccumulatesMomentum) {
  auto optimizer = make("fedavgm", 1.0f);  // momentum 0.9
  Tensor x = vector_of({0.0f});
  const Tensor d1 = vector_of({0.5f}), d2 = vector_of({1.0f});
  ASSERT_TRUE(optimizer->step({{"w", &x, &d1}}).is_ok());  // m = 0.5, x = 0.5
  ASSERT_TRUE(optimizer->step({{"w", &x, &d2}}).is_ok());  // m = 0.45 + 1 = 1.45, x = 1.95
  EXPECT_FLOAT_EQ(x.data<float>()[0], 1.95f);
}

TEST(ServerOptimizer, AdaptiveRulesByHand) {
  // lr 0.1, b1 0.9, b2 0.99, tau 0.01, v starts at tau^2 = 1e-4; delta = 0.5, so m = 0.05.
  const double m = 0.05;
  const double v_adam = 0.99 * 1e-4 + 0.01 * 0.25;     // 0.002599
  const double v_yogi = 1e-4 + 0.01 * 0.25;            // v < delta^2: v grows by (1 - b2) delta^2
  const double v_adagrad = 1e-4 + 0.25;
  EXPECT_NEAR(one_step("fedadam", 0.1f).first, 1.0 + 0.1 * m / (std::sqrt(v_adam) + 0.01), 1e-6);
  EXPECT_NEAR(one_step("fedyogi", 0.1f).first, 1.0 + 0.1 * m / (std::sqrt(v_yogi) + 0.01), 1e-6);
  EXPECT_NEAR(one_step("fedadagrad", 0.1f).first, 1.0 + 0.1 * m / (std::sqrt(v_adagrad) + 0.01), 1e-6);
  // The second coordinate moves the other way by the same rules (delta = -1, m = -0.1).
  EXPECT_NEAR(one_step("fedadam", 0.1f).second, -2.0 - 0.1 * 0.1 / (std::sqrt(0.99e-4 + 0.01) + 0.01), 1e-6);
}

TEST(ServerOptimizer, YogiShrinksVWhenItExceedsTheSquaredDelta) {
  auto options = *ServerOptimizerOptions::defaults_for("fedyogi");
  options.tau = 1.0f;  // v starts at 1 > delta^2 = 0.25
  auto optimizer = std::move(make_server_optimizer(options)).value();
  Tensor x = vector_of({0.0f});
  const Tensor delta = vector_of({0.5f});
  ASSERT_TRUE(optimizer->step({{"w", &x, &delta}}).is_ok());
  auto state = optimizer->state_tensors({{"w", {1}}});
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[1].name, "w.server_v");
  EXPECT_FLOAT_EQ(state[1].tensor->data<float>()[0], 1.0f - 0.01f * 0.25f);
}

TEST(ServerOptimizer, DiLoCoIsNesterovOnTheOuterGradient) {
  auto optimizer = make("diloco", 0.7f);  // momentum 0.9
  Tensor x = vector_of({0.0f});
  const Tensor delta = vector_of({0.5f});
  ASSERT_TRUE(optimizer->step({{"w", &x, &delta}}).is_ok());  // g = -0.5, m = -0.5, x += 0.7 * 0.95
  EXPECT_FLOAT_EQ(x.data<float>()[0], 0.665f);
  ASSERT_TRUE(optimizer->step({{"w", &x, &delta}}).is_ok());  // m = -0.95, x += 0.7 * (0.5 + 0.855)
  EXPECT_NEAR(x.data<float>()[0], 0.665 + 0.7 * 1.355, 1e-6);
}

TEST(ServerOptimizer, StateRestoredIntoAFreshOptimizerContinuesExactly) {
  for (const char* name : {"fedavgm", "fedadam", "fedyogi", "fedadagrad", "diloco"}) {
    SCOPED_TRACE(name);
    auto first = make(name, 0.05f);
    Tensor x = vector_of({0.3f, -0.7f, 1.1f});
    const Tensor d1 = vector_of({0.2f, 0.1f, -0.4f}), d2 = vector_of({-0.3f, 0.05f, 0.2f});
    ASSERT_TRUE(first->step({{"layer", &x, &d1}}).is_ok());
    auto second = make(name, 0.05f);
    Tensor y = x.clone();
    auto from = first->state_tensors({{"layer", {3}}});
    auto to = second->state_tensors({{"layer", {3}}});
    ASSERT_EQ(from.size(), to.size());
    for (size_t i = 0; i < from.size(); ++i) std::memcpy(to[i].tensor->raw(), from[i].tensor->raw(), 12);
    second->set_steps_taken(first->steps_taken());
    ASSERT_TRUE(first->step({{"layer", &x, &d2}}).is_ok());
    ASSERT_TRUE(second->step({{"layer", &y, &d2}}).is_ok());
    EXPECT_EQ(std::memcmp(x.raw(), y.raw(), 12), 0);
  }
}

TEST(ServerOptimizer, BadOptionsAndShapesAreRefused) {
  EXPECT_FALSE(ServerOptimizerOptions::defaults_for("sgd").is_ok());
  auto options = *ServerOptimizerOptions::defaults_for("fedadam");
  options.beta2 = 1.0f;
  EXPECT_FALSE(make_server_optimizer(options).is_ok());
  options = *ServerOptimizerOptions::defaults_for("fedavg");
  options.lr = 0.0f;
  EXPECT_FALSE(make_server_optimizer(options).is_ok());
  auto optimizer = make("fedavg", 1.0f);
  Tensor x = vector_of({1.0f, 2.0f});
  const Tensor wrong = vector_of({1.0f});
  const Status s = optimizer->step({{"w", &x, &wrong}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_FLOAT_EQ(x.data<float>()[0], 1.0f);
  EXPECT_EQ(optimizer->steps_taken(), 0);
}

}  // namespace
}  // namespace fedmesh::aggregator
