// SGD and AdamW steps (kernels/optimizer.h) against the update rules of
// torch.optim.SGD and torch.optim.AdamW, the Optimizer classes' per-parameter
// state, and learning-rate schedules.
//
// Tolerances: the kernels update in fp32; each step is a handful of fp32
// operations on O(1) values, so after a few steps the weights are within a
// few dozen u32 (u32 = 2^-24 ~ 6e-8) of the double-precision reference. We
// allow 1e-6 relative to the magnitudes involved: ~16 u32, with margin.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/optimizer.h"
#include "kernels/parameter.h"
#include "kernels/tensor.h"

namespace fedmesh {
namespace {

constexpr double kTolerance = 1e-6;

// ------------------------------------------------------------------- SGD ----

// torch.optim.SGD, dampening 0, in double:
//   g = grad + weight_decay * w
//   if momentum: buf = momentum * buf + g (buf starts at g, the same as at 0)
//                g = nesterov ? g + momentum * buf : buf
//   w -= lr * g
void sgd_reference(std::vector<double>& w, const std::vector<double>& grad, std::vector<double>& buffer, double lr,
                   double momentum, bool nesterov, double weight_decay) {
  for (size_t i = 0; i < w.size(); ++i) {
    double g = grad[i] + weight_decay * w[i];
    if (momentum != 0.0) {
      buffer[i] = momentum * buffer[i] + g;
      g = nesterov ? g + momentum * buffer[i] : buffer[i];
    }
    w[i] -= lr * g;
  }
}

// One weight, three steps with gradients 0.5, 0.25, -1 at lr 0.1; the expected
// weights below were worked out by hand from the update rule above.
TEST(Sgd, HandComputedThreeSteps) {
  const float grads[] = {0.5f, 0.25f, -1.0f};
  struct Case {
    const char* name;
    SgdOptions options;
    double expected[3];
  };
  const Case cases[] = {
      // w -= 0.1 g: 1 - 0.05 = 0.95; - 0.025 = 0.925; + 0.1 = 1.025.
      {"plain", SgdOptions{0.0f, false, 0.0f}, {0.95, 0.925, 1.025}},
      // buf 0.5, 0.9*0.5+0.25 = 0.7, 0.63-1 = -0.37; w 0.95, 0.88, 0.917.
      {"momentum", SgdOptions{0.9f, false, 0.0f}, {0.95, 0.88, 0.917}},
      // g + 0.9 buf: 0.95, 0.25+0.63 = 0.88, -1-0.333 = -1.333; w 0.905, 0.817, 0.9503.
      {"nesterov", SgdOptions{0.9f, true, 0.0f}, {0.905, 0.817, 0.9503}},
      // g + 0.1 w: 0.6 -> 0.94; 0.25+0.094 = 0.344 -> 0.9056; -1+0.09056 -> 0.996544.
      {"weight decay", SgdOptions{0.0f, false, 0.1f}, {0.94, 0.9056, 0.996544}},
  };
  for (const Case& c : cases) {
    float w = 1.0f, buffer = 0.0f;
    for (int step = 0; step < 3; ++step) {
      sgd_step(&w, &grads[step], c.options.momentum != 0.0f ? &buffer : nullptr, 1, 0.1f, c.options);
      EXPECT_NEAR(w, c.expected[step], kTolerance) << c.name << " step " << step + 1;
    }
  }
}

TEST(Sgd, MatchesTorchRuleOnManyElements) {
  // 100003 elements: several parallel_for chunks.
  const int64_t n = 100003;
  const SgdOptions variants[] = {{0.0f, false, 0.0f}, {0.9f, false, 0.0f}, {0.9f, true, 0.0f},
                                 {0.0f, false, 5e-4f}, {0.8f, true, 1e-2f}, {0.5f, false, 1e-1f}};
  for (const SgdOptions& options : variants) {
    Rng rng(1);
    std::vector<float> w(static_cast<size_t>(n)), buffer(static_cast<size_t>(n), 0.0f);
    for (auto& v : w) v = static_cast<float>(rng.normal());
    std::vector<double> w_ref(w.begin(), w.end()), buffer_ref(static_cast<size_t>(n), 0.0);
    for (int step = 0; step < 3; ++step) {
      std::vector<float> grad(static_cast<size_t>(n));
      for (auto& v : grad) v = static_cast<float>(rng.normal());
      const float lr = 0.05f * static_cast<float>(step + 1);
      sgd_step(w.data(), grad.data(), options.momentum != 0.0f ? buffer.data() : nullptr, n, lr, options);
      sgd_reference(w_ref, std::vector<double>(grad.begin(), grad.end()), buffer_ref, lr, options.momentum,
                    options.nesterov, options.weight_decay);
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto s = static_cast<size_t>(i);
      ASSERT_NEAR(w[s], w_ref[s], kTolerance * (1 + std::fabs(w_ref[s]))) << "momentum " << options.momentum
                                                                          << " nesterov " << options.nesterov
                                                                          << " decay " << options.weight_decay;
      if (options.momentum != 0.0f) {
        ASSERT_NEAR(buffer[s], buffer_ref[s], kTolerance * (1 + std::fabs(buffer_ref[s])));
      }
    }
  }
}

// ----------------------------------------------------------------- AdamW ----

struct AdamWState {
  std::vector<double> w, m, v;
  // Error scales: m sums terms of both signs, so its rounding error is
  // relative to the running sum of |terms| (m_scale), not to |m|; likewise w's
  // error is relative to |w| plus the sum of the sizes of its updates.
  std::vector<double> m_scale, w_scale;
};

// torch.optim.AdamW (amsgrad off), in double, `step` counting from 1:
//   w *= 1 - lr * weight_decay                      (decoupled decay, first)
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
void adamw_reference(AdamWState& s, const std::vector<double>& grad, int64_t step, double lr,
                     const AdamWOptions& o) {
  const double beta1 = o.beta1, beta2 = o.beta2, epsilon = o.epsilon;
  const double correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  for (size_t i = 0; i < s.w.size(); ++i) {
    s.w[i] *= 1.0 - lr * o.weight_decay;
    s.m[i] = beta1 * s.m[i] + (1.0 - beta1) * grad[i];
    s.v[i] = beta2 * s.v[i] + (1.0 - beta2) * grad[i] * grad[i];
    const double denominator = std::sqrt(s.v[i]) / std::sqrt(correction2) + epsilon;
    s.w[i] -= lr / correction1 * s.m[i] / denominator;
    s.m_scale[i] = beta1 * s.m_scale[i] + (1.0 - beta1) * std::fabs(grad[i]);
    s.w_scale[i] += lr / correction1 * s.m_scale[i] / denominator;
  }
}

TEST(AdamW, MatchesTorchRuleOverSeveralSteps) {
  const int64_t n = 100003;
  const AdamWOptions variants[] = {
      AdamWOptions{},                                // 0.9, 0.999, 1e-8, decay 0.01
      AdamWOptions{0.8f, 0.99f, 1e-6f, 0.1f},        // stronger decay, faster moments
      AdamWOptions{0.9f, 0.999f, 1e-8f, 0.0f},       // plain Adam
  };
  for (const AdamWOptions& options : variants) {
    Rng rng(2);
    std::vector<float> w(static_cast<size_t>(n)), m(static_cast<size_t>(n), 0.0f), v(static_cast<size_t>(n), 0.0f);
    for (auto& x : w) x = static_cast<float>(rng.normal());
    const std::vector<double> zeros(static_cast<size_t>(n), 0.0);
    AdamWState ref{std::vector<double>(w.begin(), w.end()), zeros, zeros, zeros, zeros};
    for (int64_t step = 1; step <= 6; ++step) {
      std::vector<float> grad(static_cast<size_t>(n));
      // Gradients of varying scale, including some near zero, where the
      // bias-corrected denominator and epsilon matter most.
      for (auto& g : grad) g = static_cast<float>(rng.normal() * (rng.below(4) == 0 ? 1e-3 : 1.0));
      const float lr = 1e-2f / static_cast<float>(step);
      adamw_step(w.data(), grad.data(), m.data(), v.data(), n, step, lr, options);
      adamw_reference(ref, std::vector<double>(grad.begin(), grad.end()), step, lr, options);
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto s = static_cast<size_t>(i);
      ASSERT_NEAR(w[s], ref.w[s], kTolerance * (std::fabs(ref.w[s]) + ref.w_scale[s])) << "element " << i;
      ASSERT_NEAR(m[s], ref.m[s], kTolerance * ref.m_scale[s]) << "element " << i;
      ASSERT_NEAR(v[s], ref.v[s], kTolerance * ref.v[s]) << "element " << i;  // sums of squares: no cancellation
    }
  }
}

TEST(AdamW, FirstStepMovesByLearningRateTimesSign) {
  // With bias correction, step 1 gives m_hat = g, v_hat = g^2, so without
  // decay every weight moves by lr * g / (|g| + eps) ~ lr * sign(g).
  std::vector<float> w = {1.0f, -2.0f, 0.5f}, g = {3.0f, -0.25f, 1e-2f}, m(3, 0.0f), v(3, 0.0f);
  AdamWOptions options;
  options.weight_decay = 0.0f;
  adamw_step(w.data(), g.data(), m.data(), v.data(), 3, 1, 0.1f, options);
  EXPECT_NEAR(w[0], 0.9f, 1e-6);
  EXPECT_NEAR(w[1], -1.9f, 1e-6);
  EXPECT_NEAR(w[2], 0.4f, 1e-6);
  // Decoupled decay: with a zero gradient only the decay acts, w *= 1 - lr * wd.
  std::vector<float> w2 = {2.0f}, zero = {0.0f}, m2 = {0.0f}, v2 = {0.0f};
  options.weight_decay = 0.5f;
  adamw_step(w2.data(), zero.data(), m2.data(), v2.data(), 1, 1, 0.1f, options);
  EXPECT_FLOAT_EQ(w2[0], 2.0f * (1.0f - 0.1f * 0.5f));
}

// ------------------------------------------------------ Optimizer classes ----

std::vector<float> values_of(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

void fill_random(Tensor& t, Rng& rng) {
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
}

TEST(OptimizerClasses, SgdKeepsSeparateMomentumPerParameter) {
  Rng rng(3);
  Parameter a("layer.weight", {3, 4}), b("layer.bias", {4});
  fill_random(a.value, rng);
  fill_random(b.value, rng);
  SgdOptions options{0.9f, true, 1e-2f};
  auto optimizer = make_sgd(options);
  EXPECT_EQ(optimizer->name(), "sgd");
  EXPECT_EQ(optimizer->steps_taken(), 0);

  // The same updates by hand, with one momentum buffer per parameter.
  std::vector<float> a_ref = values_of(a.value), b_ref = values_of(b.value);
  std::vector<float> a_buffer(12, 0.0f), b_buffer(4, 0.0f);
  std::vector<Parameter*> parameters = {&a, &b};
  for (int step = 0; step < 3; ++step) {
    fill_random(a.grad, rng);
    fill_random(b.grad, rng);
    sgd_step(a_ref.data(), a.grad.data<float>(), a_buffer.data(), 12, 0.1f, options);
    sgd_step(b_ref.data(), b.grad.data<float>(), b_buffer.data(), 4, 0.1f, options);
    optimizer->step(parameters, 0.1f);
    // Same fp32 operations in the same order: bit-identical.
    EXPECT_EQ(values_of(a.value), a_ref) << "step " << step;
    EXPECT_EQ(values_of(b.value), b_ref) << "step " << step;
  }
  EXPECT_EQ(optimizer->steps_taken(), 3);

  // State follows the name: a new Parameter object with an existing name
  // continues that name's momentum.
  Parameter a_again("layer.weight", {3, 4});
  std::copy(a.value.data<float>(), a.value.data<float>() + 12, a_again.value.data<float>());
  fill_random(a_again.grad, rng);
  sgd_step(a_ref.data(), a_again.grad.data<float>(), a_buffer.data(), 12, 0.1f, options);
  std::vector<Parameter*> just_a = {&a_again};
  optimizer->step(just_a, 0.1f);
  EXPECT_EQ(values_of(a_again.value), a_ref);
}

TEST(OptimizerClasses, PlainSgdNeedsNoState) {
  Parameter p("w", {5});
  for (int64_t i = 0; i < 5; ++i) {
    p.value.data<float>()[i] = static_cast<float>(i);
    p.grad.data<float>()[i] = 1.0f;
  }
  auto optimizer = make_sgd(SgdOptions{});
  std::vector<Parameter*> parameters = {&p};
  optimizer->step(parameters, 0.5f);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(p.value.data<float>()[i], static_cast<float>(i) - 0.5f);
}

TEST(OptimizerClasses, AdamWKeepsSeparateMomentsPerParameter) {
  Rng rng(4);
  Parameter a("encoder.weight", {7}), b("decoder.weight", {7});  // same shape, different names
  fill_random(a.value, rng);
  fill_random(b.value, rng);
  const AdamWOptions options;
  auto optimizer = make_adamw(options);
  EXPECT_EQ(optimizer->name(), "adamw");

  std::vector<float> a_ref = values_of(a.value), b_ref = values_of(b.value);
  std::vector<float> a_m(7, 0.0f), a_v(7, 0.0f), b_m(7, 0.0f), b_v(7, 0.0f);
  std::vector<Parameter*> parameters = {&a, &b};
  for (int64_t step = 1; step <= 4; ++step) {
    fill_random(a.grad, rng);
    for (int64_t i = 0; i < 7; ++i) b.grad.data<float>()[i] = -3.0f * a.grad.data<float>()[i];  // very different
    adamw_step(a_ref.data(), a.grad.data<float>(), a_m.data(), a_v.data(), 7, step, 1e-2f, options);
    adamw_step(b_ref.data(), b.grad.data<float>(), b_m.data(), b_v.data(), 7, step, 1e-2f, options);
    optimizer->step(parameters, 1e-2f);
    EXPECT_EQ(values_of(a.value), a_ref) << "step " << step;
    EXPECT_EQ(values_of(b.value), b_ref) << "step " << step;
  }
  EXPECT_EQ(optimizer->steps_taken(), 4);
}

// ------------------------------------------------------ state tensors ----

std::vector<std::string> names_of(const std::vector<OptimizerStateTensor>& tensors) {
  std::vector<std::string> names;
  for (const OptimizerStateTensor& t : tensors) names.push_back(t.name);
  return names;
}

TEST(OptimizerState, NamesInParameterOrderAndZerosBeforeTheFirstStep) {
  Parameter a("fc1.weight", {3, 2}), b("fc1.bias", {2});
  std::vector<Parameter*> parameters = {&a, &b};

  auto adamw = make_adamw(AdamWOptions{});
  const std::vector<OptimizerStateTensor> moments = adamw->state_tensors(parameters);
  EXPECT_EQ(names_of(moments), (std::vector<std::string>{"fc1.weight.exp_avg", "fc1.weight.exp_avg_sq",
                                                          "fc1.bias.exp_avg", "fc1.bias.exp_avg_sq"}));
  for (const OptimizerStateTensor& t : moments) {
    ASSERT_NE(t.tensor, nullptr);
    EXPECT_EQ(t.tensor->dtype(), DType::kF32);
    EXPECT_EQ(t.tensor->numel(), t.name.starts_with("fc1.weight") ? 6 : 2);
    EXPECT_EQ(values_of(*t.tensor), std::vector<float>(static_cast<size_t>(t.tensor->numel()), 0.0f));
  }
  // Asked again, the same tensors.
  EXPECT_EQ(adamw->state_tensors(parameters)[2].tensor, moments[2].tensor);

  auto sgd = make_sgd(SgdOptions{0.9f, false, 0.0f});
  EXPECT_EQ(names_of(sgd->state_tensors(parameters)),
            (std::vector<std::string>{"fc1.weight.momentum", "fc1.bias.momentum"}));
  EXPECT_TRUE(make_sgd(SgdOptions{})->state_tensors(parameters).empty());
}

// Creating the state before the first step (to load a checkpoint into it)
// leaves every step's arithmetic as it was.
TEST(OptimizerState, CreatingTheStateEarlyChangesNoStep) {
  for (const bool use_adamw : {true, false}) {
    SCOPED_TRACE(use_adamw ? "adamw" : "sgd");
    Rng rng(7);
    Parameter early("w", {37}), late("w", {37});
    fill_random(early.value, rng);
    std::copy(early.value.data<float>(), early.value.data<float>() + 37, late.value.data<float>());
    const auto make = [&] {
      return use_adamw ? make_adamw(AdamWOptions{}) : make_sgd(SgdOptions{0.9f, true, 1e-2f});
    };
    auto early_optimizer = make(), late_optimizer = make();
    std::vector<Parameter*> early_parameters = {&early}, late_parameters = {&late};
    early_optimizer->state_tensors(early_parameters);
    for (int step = 0; step < 3; ++step) {
      fill_random(early.grad, rng);
      std::copy(early.grad.data<float>(), early.grad.data<float>() + 37, late.grad.data<float>());
      early_optimizer->step(early_parameters, 1e-2f);
      late_optimizer->step(late_parameters, 1e-2f);
      EXPECT_EQ(std::memcmp(early.value.raw(), late.value.raw(), early.value.nbytes()), 0) << "step " << step;
    }
  }
}

// A fresh optimizer loaded with another's state tensors and step count goes
// on exactly as the other does; without the step count AdamW's bias
// correction would differ.
TEST(OptimizerState, LoadedIntoAFreshOptimizerContinuesBitForBit) {
  for (const bool use_adamw : {true, false}) {
    SCOPED_TRACE(use_adamw ? "adamw" : "sgd");
    const auto make = [&] {
      return use_adamw ? make_adamw(AdamWOptions{}) : make_sgd(SgdOptions{0.9f, true, 1e-2f});
    };
    Rng rng(8);
    Parameter a("layer.weight", {5, 3}), b("layer.bias", {3});
    fill_random(a.value, rng);
    fill_random(b.value, rng);
    std::vector<Parameter*> parameters = {&a, &b};
    auto original = make();
    for (int step = 0; step < 4; ++step) {
      fill_random(a.grad, rng);
      fill_random(b.grad, rng);
      original->step(parameters, 1e-2f);
    }

    Parameter a2("layer.weight", {5, 3}), b2("layer.bias", {3});
    std::copy(a.value.data<float>(), a.value.data<float>() + 15, a2.value.data<float>());
    std::copy(b.value.data<float>(), b.value.data<float>() + 3, b2.value.data<float>());
    std::vector<Parameter*> parameters2 = {&a2, &b2};
    auto loaded = make();
    const std::vector<OptimizerStateTensor> from = original->state_tensors(parameters);
    const std::vector<OptimizerStateTensor> into = loaded->state_tensors(parameters2);
    ASSERT_EQ(names_of(from), names_of(into));
    for (size_t i = 0; i < from.size(); ++i) {
      std::memcpy(into[i].tensor->raw(), from[i].tensor->raw(), from[i].tensor->nbytes());
    }
    loaded->set_steps_taken(original->steps_taken());

    for (int step = 0; step < 3; ++step) {
      fill_random(a.grad, rng);
      fill_random(b.grad, rng);
      std::copy(a.grad.data<float>(), a.grad.data<float>() + 15, a2.grad.data<float>());
      std::copy(b.grad.data<float>(), b.grad.data<float>() + 3, b2.grad.data<float>());
      original->step(parameters, 1e-2f);
      loaded->step(parameters2, 1e-2f);
    }
    EXPECT_EQ(loaded->steps_taken(), 7);
    EXPECT_EQ(values_of(a2.value), values_of(a.value));
    EXPECT_EQ(values_of(b2.value), values_of(b.value));
  }
}

TEST(OptimizerState, AdamWStepCountDecidesTheBiasCorrection) {
  Rng rng(9);
  Parameter a("w", {9}), b("w", {9});
  fill_random(a.value, rng);
  fill_random(a.grad, rng);
  std::copy(a.value.data<float>(), a.value.data<float>() + 9, b.value.data<float>());
  std::copy(a.grad.data<float>(), a.grad.data<float>() + 9, b.grad.data<float>());
  auto first = make_adamw(AdamWOptions{}), later = make_adamw(AdamWOptions{});
  later->set_steps_taken(100);
  std::vector<Parameter*> pa = {&a}, pb = {&b};
  first->step(pa, 1e-2f);
  later->step(pb, 1e-2f);
  EXPECT_EQ(later->steps_taken(), 101);
  EXPECT_NE(values_of(a.value), values_of(b.value));
}

// ------------------------------------------------------------ schedules ----

TEST(LrSchedule, ParsesValidSpecifications) {
  for (const char* text : {"constant", "step:10:0.5", "cosine:5", "cosine", "cosine:0", "step:1:2"}) {
    const Result<LrSchedule> schedule = LrSchedule::parse(text);
    EXPECT_TRUE(schedule.is_ok()) << text << ": " << schedule.status().to_string();
  }
  // to_string names the same schedule again.
  for (const char* text : {"constant", "step:10:0.5", "cosine:5"}) {
    Result<LrSchedule> schedule = LrSchedule::parse(text);
    ASSERT_TRUE(schedule.is_ok());
    Result<LrSchedule> again = LrSchedule::parse(schedule->to_string());
    ASSERT_TRUE(again.is_ok()) << schedule->to_string();
    for (int64_t step = 0; step < 40; ++step)
      EXPECT_EQ(again->lr_at(0.1f, step, 40), schedule->lr_at(0.1f, step, 40)) << text << " step " << step;
  }
}

TEST(LrSchedule, RejectsGarbage) {
  for (const char* text : {"step:0:0.5", "step:10", "cosine:-1", "linear", "", "step:10:0", "step:10:-1",
                           "step:x:0.5", "step:10:0.5x", "cosine:", "cosine:abc", "cosinex", "constant ",
                           "step:-3:0.5"}) {
    const Result<LrSchedule> schedule = LrSchedule::parse(text);
    ASSERT_FALSE(schedule.is_ok()) << "'" << text << "' should be rejected";
    EXPECT_EQ(schedule.status().code(), StatusCode::kInvalidArgument) << "'" << text << "'";
    EXPECT_FALSE(schedule.status().message().empty());
  }
}

LrSchedule parse_or_die(const char* text) {
  Result<LrSchedule> schedule = LrSchedule::parse(text);
  EXPECT_TRUE(schedule.is_ok()) << text;
  return schedule.value();
}

TEST(LrSchedule, ConstantAndStepValues) {
  const LrSchedule constant = parse_or_die("constant");
  for (const int64_t step : {0, 1, 50, 99}) EXPECT_EQ(constant.lr_at(0.1f, step, 100), 0.1f);

  // Multiply by 0.5 every 10 steps: 0.1 for steps 0-9, 0.05 for 10-19, ...
  const LrSchedule step_decay = parse_or_die("step:10:0.5");
  EXPECT_FLOAT_EQ(step_decay.lr_at(0.1f, 0, 100), 0.1f);
  EXPECT_FLOAT_EQ(step_decay.lr_at(0.1f, 9, 100), 0.1f);
  EXPECT_FLOAT_EQ(step_decay.lr_at(0.1f, 10, 100), 0.05f);
  EXPECT_FLOAT_EQ(step_decay.lr_at(0.1f, 19, 100), 0.05f);
  EXPECT_FLOAT_EQ(step_decay.lr_at(0.1f, 25, 100), 0.025f);
  EXPECT_FLOAT_EQ(step_decay.lr_at(0.1f, 99, 100), 0.1f / 512);
}

TEST(LrSchedule, CosineWarmupAndDecay) {
  // Linear warm-up over 5 steps (lr (step + 1) / 5), then half a cosine from
  // the base rate to 0 over the remaining 100 of 105 steps.
  const LrSchedule cosine = parse_or_die("cosine:5");
  const float base = 0.2f;
  const int64_t total = 105;
  for (int64_t step = 0; step < 5; ++step)
    EXPECT_FLOAT_EQ(cosine.lr_at(base, step, total), base * static_cast<float>(step + 1) / 5) << step;
  EXPECT_FLOAT_EQ(cosine.lr_at(base, 5, total), base);           // decay starts at the base rate
  EXPECT_FLOAT_EQ(cosine.lr_at(base, 55, total), base * 0.5f);   // half-way: cos(pi/2) = 0
  EXPECT_NEAR(cosine.lr_at(base, 30, total), base * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-7);
  // The last step is ~0: 0.5 (1 + cos(pi * 99/100)) ~ 2.5e-4 of the base.
  EXPECT_LT(cosine.lr_at(base, total - 1, total), 1e-3f * base);
  EXPECT_GE(cosine.lr_at(base, total - 1, total), 0.0f);
  // Monotone after the warm-up.
  for (int64_t step = 6; step < total; ++step)
    EXPECT_LE(cosine.lr_at(base, step, total), cosine.lr_at(base, step - 1, total)) << step;

  // "cosine" has no warm-up: the base rate at step 0, half at the middle.
  const LrSchedule plain = parse_or_die("cosine");
  EXPECT_FLOAT_EQ(plain.lr_at(base, 0, 100), base);
  EXPECT_FLOAT_EQ(plain.lr_at(base, 50, 100), base * 0.5f);
  EXPECT_LT(plain.lr_at(base, 99, 100), 1e-3f * base);
  for (int64_t step = 1; step < 100; ++step) EXPECT_GT(plain.lr_at(base, step, 100), 0.0f) << step;
}

}  // namespace
}  // namespace fedmesh
