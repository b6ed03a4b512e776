#include "aggregator/server_optimizer.h"

#include <cmath>

namespace fedmesh::aggregator {

namespace {

bool in_unit_interval(float value) { return value >= 0.0f && value < 1.0f; }

class FedAvg final : public ServerOptimizer {
 public:
  explicit FedAvg(ServerOptimizerOptions options) : ServerOptimizer(std::move(options)) {}
  bool uses_first_moment() const override { return false; }
  bool uses_second_moment() const override { return false; }
  void apply(float* x, const float* delta, float*, float*, int64_t n) const override {
    const float lr = options_.lr;
    for (int64_t i = 0; i < n; ++i) x[i] += lr * delta[i];
  }
};

class FedAvgM final : public ServerOptimizer {
 public:
  explicit FedAvgM(ServerOptimizerOptions options) : ServerOptimizer(std::move(options)) {}
  bool uses_first_moment() const override { return true; }
  bool uses_second_moment() const override { return false; }
  void apply(float* x, const float* delta, float* m, float*, int64_t n) const override {
    const float lr = options_.lr, momentum = options_.momentum;
    for (int64_t i = 0; i < n; ++i) {
      m[i] = momentum * m[i] + delta[i];
      x[i] += lr * m[i];
    }
  }
};

enum class SecondMoment { kAdam, kYogi, kAdagrad };

template <SecondMoment kRule>
class Adaptive final : public ServerOptimizer {
 public:
  explicit Adaptive(ServerOptimizerOptions options) : ServerOptimizer(std::move(options)) {}
  bool uses_first_moment() const override { return true; }
  bool uses_second_moment() const override { return true; }
  void apply(float* x, const float* delta, float* m, float* v, int64_t n) const override {
    const float lr = options_.lr, b1 = options_.beta1, b2 = options_.beta2, tau = options_.tau;
    for (int64_t i = 0; i < n; ++i) {
      const float d = delta[i], d2 = d * d;
      m[i] = b1 * m[i] + (1.0f - b1) * d;
      if constexpr (kRule == SecondMoment::kAdam) {
        v[i] = b2 * v[i] + (1.0f - b2) * d2;
      } else if constexpr (kRule == SecondMoment::kYogi) {
        const float difference = v[i] - d2;
        const float sign = difference > 0.0f ? 1.0f : (difference < 0.0f ? -1.0f : 0.0f);
        v[i] = v[i] - (1.0f - b2) * d2 * sign;
      } else {
        v[i] = v[i] + d2;
      }
      x[i] += lr * m[i] / (std::sqrt(v[i]) + tau);
    }
  }
};

class DiLoCo final : public ServerOptimizer {
 public:
  explicit DiLoCo(ServerOptimizerOptions options) : ServerOptimizer(std::move(options)) {}
  bool uses_first_moment() const override { return true; }
  bool uses_second_moment() const override { return false; }
  void apply(float* x, const float* delta, float* m, float*, int64_t n) const override {
    const float lr = options_.lr, momentum = options_.momentum;
    for (int64_t i = 0; i < n; ++i) {
      const float g = -delta[i];
      m[i] = momentum * m[i] + g;
      x[i] -= lr * (g + momentum * m[i]);
    }
  }
};

}  // namespace

Result<ServerOptimizerOptions> ServerOptimizerOptions::defaults_for(std::string_view name) {
  ServerOptimizerOptions options;
  options.name = std::string(name);
  if (name == "fedavg" || name == "fedavgm") {
    options.lr = 1.0f;
  } else if (name == "fedadam" || name == "fedyogi" || name == "fedadagrad") {
    options.lr = 0.01f;
  } else if (name == "diloco") {
    options.lr = 0.7f;
  } else {
    return invalid_argument("unknown server optimizer '" + std::string(name) +
                            "' (expected fedavg, fedavgm, fedadam, fedyogi, fedadagrad or diloco)");
  }
  return options;
}

Status ServerOptimizerOptions::validate() const {
  if (!defaults_for(name).is_ok()) return defaults_for(name).status();
  if (!(lr > 0.0f) || !std::isfinite(lr)) return invalid_argument("server lr must be a positive number");
  if (!in_unit_interval(momentum)) return invalid_argument("server momentum must be in [0, 1)");
  if (!in_unit_interval(beta1) || !in_unit_interval(beta2)) return invalid_argument("server beta1 and beta2 must be in [0, 1)");
  if (!(tau > 0.0f) || !std::isfinite(tau)) return invalid_argument("server tau must be a positive number");
  return Status::ok();
}

Tensor& ServerOptimizer::state(const std::string& name, const char* suffix, const Shape& shape, float initial) {
  auto [it, inserted] = state_.try_emplace(name + suffix);
  if (inserted) {
    it->second = Tensor::empty(shape);
    float* values = it->second.data<float>();
    for (int64_t i = 0; i < it->second.numel(); ++i) values[i] = initial;
  }
  return it->second;
}

Status ServerOptimizer::step(const std::vector<ServerStepTensor>& tensors) {
  for (const ServerStepTensor& t : tensors) {
    if (t.model == nullptr || t.delta == nullptr || t.model->dtype() != DType::kF32 ||
        t.delta->dtype() != DType::kF32 || t.model->shape() != t.delta->shape()) {
      return invalid_argument("server step: tensor " + t.name + " and its update must be fp32 of the same shape");
    }
  }
  for (const ServerStepTensor& t : tensors) {
    FEDMESH_RETURN_IF_ERROR(
        step_range(t.name, *t.model, 0, {t.delta->data<float>(), static_cast<size_t>(t.delta->numel())}));
  }
  end_step();
  return Status::ok();
}

Status ServerOptimizer::step_range(const std::string& name, Tensor& model, int64_t first,
                                   std::span<const float> delta) {
  if (model.dtype() != DType::kF32 || first < 0 || first > model.numel() ||
      static_cast<int64_t>(delta.size()) > model.numel() - first) {
    return invalid_argument("server step: a range of tensor " + name + " outside it, or the tensor not fp32");
  }
  const float initial_v = options_.tau * options_.tau;
  float* m = uses_first_moment() ? state(name, ".server_m", model.shape(), 0.0f).data<float>() + first : nullptr;
  float* v = uses_second_moment() ? state(name, ".server_v", model.shape(), initial_v).data<float>() + first : nullptr;
  apply(model.data<float>() + first, delta.data(), m, v, static_cast<int64_t>(delta.size()));
  return Status::ok();
}

std::vector<OptimizerStateTensor> ServerOptimizer::state_tensors(
    const std::vector<std::pair<std::string, Shape>>& tensors) {
  std::vector<OptimizerStateTensor> result;
  const float initial_v = options_.tau * options_.tau;
  for (const auto& [name, shape] : tensors) {
    if (uses_first_moment()) result.push_back({name + ".server_m", &state(name, ".server_m", shape, 0.0f)});
    if (uses_second_moment()) result.push_back({name + ".server_v", &state(name, ".server_v", shape, initial_v)});
  }
  return result;
}

Result<std::unique_ptr<ServerOptimizer>> make_server_optimizer(const ServerOptimizerOptions& options) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  std::unique_ptr<ServerOptimizer> optimizer;
  if (options.name == "fedavg") optimizer.reset(new FedAvg(options));
  if (options.name == "fedavgm") optimizer.reset(new FedAvgM(options));
  if (options.name == "fedadam") optimizer.reset(new Adaptive<SecondMoment::kAdam>(options));
  if (options.name == "fedyogi") optimizer.reset(new Adaptive<SecondMoment::kYogi>(options));
  if (options.name == "fedadagrad") optimizer.reset(new Adaptive<SecondMoment::kAdagrad>(options));
  if (options.name == "diloco") optimizer.reset(new DiLoCo(options));
  return optimizer;
}

}  // namespace fedmesh::aggregator
