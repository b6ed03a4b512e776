// Server optimizers: how the aggregator moves the global model x with the
// round's aggregated update delta (the weighted mean over sites of
// x_site - x, i.e. a pseudo-gradient pointing downhill). Per element:
//
//   fedavg      x += lr * delta                                   (McMahan et al., 2017)
//   fedavgm     m = momentum * m + delta;  x += lr * m            (Hsu et al., 2019)
//   fedadam     m = b1 m + (1 - b1) delta;  v = b2 v + (1 - b2) delta^2
//   fedyogi     m as fedadam;  v = v - (1 - b2) delta^2 sign(v - delta^2)
//   fedadagrad  m as fedadam;  v = v + delta^2
//               and for the three: x += lr * m / (sqrt(v) + tau), v starting at tau^2
//               (Reddi et al., "Adaptive Federated Optimization", 2021, Algorithm 2)
//   diloco      outer gradient g = -delta;  m = momentum * m + g;  x -= lr * (g + momentum * m)
//               (Nesterov SGD over the outer step, as DiLoCo: lr 0.7, momentum 0.9)
//
// State (m, v) is kept per tensor name and exposed for checkpoints.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/optimizer.h"
#include "kernels/tensor.h"

namespace fedmesh::aggregator {

struct ServerOptimizerOptions {
  std::string name = "fedavg";  // fedavg | fedavgm | fedadam | fedyogi | fedadagrad | diloco
  float lr = 1.0f;
  float momentum = 0.9f;  // fedavgm, diloco
  float beta1 = 0.9f;     // adaptive
  float beta2 = 0.99f;    // fedadam, fedyogi
  float tau = 1e-3f;      // adaptive: the denominator's floor, and sqrt of v's start

  // The defaults of the papers for `name` (fedavg lr 1; fedavgm lr 1,
  // momentum 0.9; fedadam/fedyogi lr 0.01, b1 0.9, b2 0.99, tau 1e-3;
  // fedadagrad lr 0.01, tau 1e-3; diloco lr 0.7, momentum 0.9).
  static Result<ServerOptimizerOptions> defaults_for(std::string_view name);
  Status validate() const;
};

// One tensor of the global model and the aggregated update for it.
struct ServerStepTensor {
  std::string name;
  Tensor* model = nullptr;        // fp32, updated in place
  const Tensor* delta = nullptr;  // fp32, same shape
};

class ServerOptimizer {
 public:
  virtual ~ServerOptimizer() = default;
  // One server step over every tensor. kInvalidArgument for a shape or dtype
  // mismatch (nothing is changed then).
  Status step(const std::vector<ServerStepTensor>& tensors);
  // The same step taken a range at a time (an aggregate made slice by slice
  // never whole): elements [first, first + delta.size()) of `model`, an fp32
  // tensor named `name`, then end_step() once every range is done. The rule
  // is per element, so the ranges give the bits step() gives.
  Status step_range(const std::string& name, Tensor& model, int64_t first, std::span<const float> delta);
  void end_step() { ++steps_; }
  const std::string& name() const { return options_.name; }
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // Every state tensor for these (name, shape) pairs, created where missing,
  // e.g. "fc1.weight.server_m", "fc1.weight.server_v". FedAvg has none.
  std::vector<OptimizerStateTensor> state_tensors(const std::vector<std::pair<std::string, Shape>>& tensors);

 protected:
  explicit ServerOptimizer(ServerOptimizerOptions options) : options_(std::move(options)) {}
  // Which state tensors this optimizer keeps: first moment, second moment.
  virtual bool uses_first_moment() const = 0;
  virtual bool uses_second_moment() const = 0;
  // Applies the rule to n elements.
  virtual void apply(float* model, const float* delta, float* m, float* v, int64_t n) const = 0;

  ServerOptimizerOptions options_;

 private:
  Tensor& state(const std::string& name, const char* suffix, const Shape& shape, float initial);
  std::map<std::string, Tensor> state_;  // node-based: pointers handed out stay valid
  int64_t steps_ = 0;
};

Result<std::unique_ptr<ServerOptimizer>> make_server_optimizer(const ServerOptimizerOptions& options);

}  // namespace fedmesh::aggregator
