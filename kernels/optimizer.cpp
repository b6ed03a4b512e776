#include "kernels/optimizer.h"

#include <charconv>
#include <cmath>
#include <unordered_map>

#include "kernels/cuda_ops.h"
#include "kernels/device_ops.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"

namespace fedmesh {

namespace {
constexpr int64_t kOptimizerGrain = 1 << 14;
}

// The loops read only locals and __restrict pointers: a float field of the
// options struct could alias the arrays being written, which would stop the
// compiler from vectorizing.
void sgd_step(float* weights, const float* grads, float* momentum_buffer, int64_t n, float lr,
              const SgdOptions& options) {
  const ProfileScope profile(StepTime::kKernels);
  const float momentum = options.momentum, weight_decay = options.weight_decay;
  const bool nesterov = options.nesterov;
  parallel_for(n, kOptimizerGrain, [=](int64_t begin, int64_t end) {
    float* __restrict w = weights;
    const float* __restrict g = grads;
    float* __restrict buffer = momentum_buffer;
    if (momentum == 0.0f) {
      for (int64_t i = begin; i < end; ++i) w[i] -= lr * (g[i] + weight_decay * w[i]);
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const float d = g[i] + weight_decay * w[i];
      buffer[i] = momentum * buffer[i] + d;
      w[i] -= lr * (nesterov ? d + momentum * buffer[i] : buffer[i]);
    }
  });
}

void adamw_step(float* weights, const float* grads, float* first_moment, float* second_moment, int64_t n,
                int64_t step, float lr, const AdamWOptions& options) {
  const ProfileScope profile(StepTime::kKernels);
  const float beta1 = options.beta1, beta2 = options.beta2, epsilon = options.epsilon;
  const float correction1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  const float correction2 = 1.0f - std::pow(beta2, static_cast<float>(step));
  const float step_size = lr / correction1;
  const float inv_sqrt_correction2 = 1.0f / std::sqrt(correction2);
  const float decay = 1.0f - lr * options.weight_decay;
  parallel_for(n, kOptimizerGrain, [=](int64_t begin, int64_t end) {
    float* __restrict w = weights;
    const float* __restrict g = grads;
    float* __restrict m = first_moment;
    float* __restrict v = second_moment;
    for (int64_t i = begin; i < end; ++i) {
      m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
      v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
      const float denominator = std::sqrt(v[i]) * inv_sqrt_correction2 + epsilon;
      w[i] = w[i] * decay - step_size * m[i] / denominator;
    }
  });
}

namespace {

// On the device the step's kernel also writes the parameter's low-precision
// compute copy (rounded as Parameter::refresh_compute rounds it), so that no
// separate pass re-reads the master weights; null where the compute copy is
// the master itself.
std::pair<void*, DType> compute_copy(Parameter& p) {
  if (p.compute.raw() == p.value.raw()) return {nullptr, DType::kF32};
  return {p.compute.raw(), p.compute.dtype()};
}

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) {}
  void step(std::vector<Parameter*>& parameters, float lr) override {
    ++steps_;
    for (Parameter* p : parameters) {
      float* momentum = options_.momentum != 0.0f ? momentum_buffer(*p).data<float>() : nullptr;
      if (device::on_cuda(p->value)) {
        device::require_cuda("sgd step", {&p->value, &p->grad});
        const auto [copy, copy_type] = compute_copy(*p);
        cuda::sgd_step(cuda::default_stream(), p->value.data<float>(), p->grad.data<float>(), momentum, copy,
                       copy_type, p->value.numel(), lr, options_, gate_.grad_scale_inverse, gate_.found_inf);
      } else {
        device::require_host("sgd step", {&p->value, &p->grad});
        sgd_step(p->value.data<float>(), p->grad.data<float>(), momentum, p->value.numel(), lr, options_);
      }
    }
  }
  std::string name() const override { return "sgd"; }
  std::vector<OptimizerStateTensor> state_tensors(const std::vector<Parameter*>& parameters) override {
    std::vector<OptimizerStateTensor> result;
    if (options_.momentum == 0.0f) return result;
    for (Parameter* p : parameters) result.push_back({p->name + ".momentum", &momentum_buffer(*p)});
    return result;
  }

 private:
  Tensor& momentum_buffer(const Parameter& p) {
    auto [it, inserted] = momentum_.try_emplace(p.name);
    if (inserted) it->second = Tensor::zeros(p.value.shape(), DType::kF32, p.value.device());
    return it->second;
  }
  SgdOptions options_;
  std::unordered_map<std::string, Tensor> momentum_;
};

class AdamW final : public Optimizer {
 public:
  explicit AdamW(const AdamWOptions& options) : options_(options) {}
  void step(std::vector<Parameter*>& parameters, float lr) override {
    ++steps_;
    for (Parameter* p : parameters) {
      auto& [first, second] = moments(*p);
      if (device::on_cuda(p->value)) {
        device::require_cuda("adamw step", {&p->value, &p->grad, &first, &second});
        const auto [copy, copy_type] = compute_copy(*p);
        cuda::adamw_step(cuda::default_stream(), p->value.data<float>(), p->grad.data<float>(), first.data<float>(),
                         second.data<float>(), copy, copy_type, p->value.numel(), steps_, lr, options_,
                         gate_.grad_scale_inverse, gate_.found_inf);
      } else {
        device::require_host("adamw step", {&p->value, &p->grad, &first, &second});
        adamw_step(p->value.data<float>(), p->grad.data<float>(), first.data<float>(), second.data<float>(),
                   p->value.numel(), steps_, lr, options_);
      }
    }
  }
  std::string name() const override { return "adamw"; }
  std::vector<OptimizerStateTensor> state_tensors(const std::vector<Parameter*>& parameters) override {
    std::vector<OptimizerStateTensor> result;
    for (Parameter* p : parameters) {
      auto& [first, second] = moments(*p);
      result.push_back({p->name + ".exp_avg", &first});
      result.push_back({p->name + ".exp_avg_sq", &second});
    }
    return result;
  }

 private:
  std::pair<Tensor, Tensor>& moments(const Parameter& p) {
    auto [it, inserted] = moments_.try_emplace(p.name);
    if (inserted) {
      it->second = {Tensor::zeros(p.value.shape(), DType::kF32, p.value.device()),
                    Tensor::zeros(p.value.shape(), DType::kF32, p.value.device())};
    }
    return it->second;
  }
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
