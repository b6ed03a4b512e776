#include "kernels/optimizer.h"

#include <charconv>
#include <cmath>
#include <unordered_map>

#include "kernels/parallel.h"

namespace fedmesh {

namespace {
constexpr int64_t kOptimizerGrain = 1 << 14;
}

void sgd_step(float* weights, const float* grads, float* momentum_buffer, int64_t n, float lr,
              const SgdOptions& options) {
  parallel_for(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float g = grads[i] + options.weight_decay * weights[i];
      if (options.momentum != 0.0f) {
        momentum_buffer[i] = options.momentum * momentum_buffer[i] + g;
        g = options.nesterov ? g + options.momentum * momentum_buffer[i] : momentum_buffer[i];
      }
      weights[i] -= lr * g;
    }
  });
}

void adamw_step(float* weights, const float* grads, float* first_moment, float* second_moment, int64_t n,
                int64_t step, float lr, const AdamWOptions& options) {
  const float correction1 = 1.0f - std::pow(options.beta1, static_cast<float>(step));
  const float correction2 = 1.0f - std::pow(options.beta2, static_cast<float>(step));
  const float step_size = lr / correction1;
  const float inv_sqrt_correction2 = 1.0f / std::sqrt(correction2);
  const float decay = 1.0f - lr * options.weight_decay;
  parallel_for(n, kOptimizerGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = grads[i];
      first_moment[i] = options.beta1 * first_moment[i] + (1.0f - options.beta1) * g;
      second_moment[i] = options.beta2 * second_moment[i] + (1.0f - options.beta2) * g * g;
      const float denominator = std::sqrt(second_moment[i]) * inv_sqrt_correction2 + options.epsilon;
      weights[i] = weights[i] * decay - step_size * first_moment[i] / denominator;
    }
  });
}

namespace {

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) {}
  void step(std::vector<Parameter*>& parameters, float lr) override {
    ++steps_;
    for (Parameter* p : parameters) {
      float* momentum = nullptr;
      if (options_.momentum != 0.0f) {
        auto [it, inserted] = momentum_.try_emplace(p->name);
        if (inserted) it->second = Tensor::zeros(p->value.shape());
        momentum = it->second.data<float>();
      }
      sgd_step(p->value.data<float>(), p->grad.data<float>(), momentum, p->value.numel(), lr, options_);
    }
  }
  std::string name() const override { return "sgd"; }

 private:
  SgdOptions options_;
  std::unordered_map<std::string, Tensor> momentum_;
};

class AdamW final : public Optimizer {
 public:
  explicit AdamW(const AdamWOptions& options) : options_(options) {}
  void step(std::vector<Parameter*>& parameters, float lr) override {
    ++steps_;
    for (Parameter* p : parameters) {
      auto [it, inserted] = moments_.try_emplace(p->name);
      if (inserted) it->second = {Tensor::zeros(p->value.shape()), Tensor::zeros(p->value.shape())};
      adamw_step(p->value.data<float>(), p->grad.data<float>(), it->second.first.data<float>(),
                 it->second.second.data<float>(), p->value.numel(), steps_, lr, options_);
    }
  }
  std::string name() const override { return "adamw"; }

 private:
  AdamWOptions options_;
  std::unordered_map<std::string, std::pair<Tensor, Tensor>> moments_;
};

template <class T>
bool parse_number(std::string_view text, T& out) {
  const char* end = text.data() + text.size();
  auto [ptr, error] = std::from_chars(text.data(), end, out);
  return error == std::errc() && ptr == end;
}

}  // namespace

std::unique_ptr<Optimizer> make_sgd(const SgdOptions& options) { return std::make_unique<Sgd>(options); }
std::unique_ptr<Optimizer> make_adamw(const AdamWOptions& options) { return std::make_unique<AdamW>(options); }

Result<LrSchedule> LrSchedule::parse(std::string_view text) {
  LrSchedule schedule;
  const auto fail = [&](const char* why) {
    return invalid_argument("bad learning-rate schedule '" + std::string(text) + "': " + why +
                            " (expected constant, step:EVERY:GAMMA or cosine:WARMUP)");
  };
  if (text == "constant") return schedule;
  if (text.starts_with("step:")) {
    const std::string_view rest = text.substr(5);
    const size_t colon = rest.find(':');
    if (colon == std::string_view::npos) return fail("missing GAMMA");
    if (!parse_number(rest.substr(0, colon), schedule.every_) || schedule.every_ < 1)
      return fail("EVERY must be a positive integer");
    if (!parse_number(rest.substr(colon + 1), schedule.gamma_) || !(schedule.gamma_ > 0.0f))
      return fail("GAMMA must be a positive number");
    schedule.kind_ = Kind::kStep;
    return schedule;
  }
  if (text.starts_with("cosine")) {
    schedule.kind_ = Kind::kCosine;
    if (text == "cosine") return schedule;
    if (text[6] != ':' || !parse_number(text.substr(7), schedule.warmup_) || schedule.warmup_ < 0)
      return fail("WARMUP must be a non-negative integer");
    return schedule;
  }
  return fail("unknown kind");
}

float LrSchedule::lr_at(float base_lr, int64_t step, int64_t total_steps) const {
  switch (kind_) {
    case Kind::kConstant: return base_lr;
    case Kind::kStep: return base_lr * std::pow(gamma_, static_cast<float>(step / every_));
    case Kind::kCosine: {
      if (step < warmup_) return base_lr * static_cast<float>(step + 1) / static_cast<float>(warmup_);
      const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_);
      const double progress = std::min(1.0, static_cast<double>(step - warmup_) / static_cast<double>(decay_steps));
      return static_cast<float>(base_lr * 0.5 * (1.0 + std::cos(M_PI * progress)));
    }
  }
  return base_lr;
}

std::string LrSchedule::to_string() const {
  switch (kind_) {
    case Kind::kConstant: return "constant";
    case Kind::kStep: return "step:" + std::to_string(every_) + ":" + std::to_string(gamma_);
    case Kind::kCosine: return "cosine:" + std::to_string(warmup_);
  }
  return "?";
}

}  // namespace fedmesh
