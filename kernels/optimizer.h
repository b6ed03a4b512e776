// Optimizers over fp32 master weights: SGD (momentum, Nesterov, decoupled or
// L2 weight decay) and AdamW; and learning-rate schedules.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/parameter.h"

namespace fedmesh {

struct SgdOptions {
  float momentum = 0.0f;
  bool nesterov = false;
  float weight_decay = 0.0f;  // L2 added to the gradient, as torch.optim.SGD does
};

struct AdamWOptions {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.01f;  // decoupled (Loshchilov & Hutter)
};

// One SGD step on n elements. momentum_buffer may be null when momentum == 0.
void sgd_step(float* weights, const float* grads, float* momentum_buffer, int64_t n, float lr,
              const SgdOptions& options);
// One AdamW step; `step` counts from 1 (bias correction).
void adamw_step(float* weights, const float* grads, float* first_moment, float* second_moment, int64_t n,
                int64_t step, float lr, const AdamWOptions& options);

// One piece of optimizer state, e.g. "fc1.weight.exp_avg" (AdamW's first
// moment), "fc1.weight.exp_avg_sq", "fc1.weight.momentum" (SGD).
struct OptimizerStateTensor {
  std::string name;
  Tensor* tensor = nullptr;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Applies one step to every parameter from its grad, at learning rate lr.
  // On the CUDA device it also refreshes each parameter's compute copy
  // (Parameter::refresh_compute's rounding) in the same kernel; on the CPU
  // the caller refreshes them.
  virtual void step(std::vector<Parameter*>& parameters, float lr) = 0;
  virtual std::string name() const = 0;
  int64_t steps_taken() const { return steps_; }
  // Every state tensor for these parameters, in parameter order, created as
  // zeros where missing (as the first step would), so that a fresh optimizer
  // can be loaded from a checkpoint. SGD without momentum has none.
  virtual std::vector<OptimizerStateTensor> state_tensors(const std::vector<Parameter*>& parameters) = 0;
  // With state_tensors(), restores a checkpoint (AdamW's bias correction reads it).
  void set_steps_taken(int64_t steps) { steps_ = steps; }

  // CUDA: device scalars that gate the next steps on parameters on the
  // device (kernels/cuda_ops.h's grad_scale_inverse and found_inf): every
  // gradient times *grad_scale_inverse first (loss scale and clipping in one
  // factor), and nothing done where *found_inf != 0, so a step needs no
  // host decision. Both null: ungated. CPU parameters ignore it.
  struct DeviceGate {
    const float* grad_scale_inverse = nullptr;
    const int* found_inf = nullptr;
  };
  void set_device_gate(DeviceGate gate) { gate_ = gate; }

 protected:
  int64_t steps_ = 0;
  DeviceGate gate_;
};

std::unique_ptr<Optimizer> make_sgd(const SgdOptions& options);
std::unique_ptr<Optimizer> make_adamw(const AdamWOptions& options);

// Learning-rate schedules, parsed from "constant", "step:EVERY:GAMMA" (multiply
// by GAMMA every EVERY steps) or "cosine:WARMUP" (linear warm-up over WARMUP
// steps, then cosine decay that reaches zero at step total_steps).
class LrSchedule {
 public:
  static Result<LrSchedule> parse(std::string_view text);
  // Learning rate for 0-based `step` of `total_steps`.
  float lr_at(float base_lr, int64_t step, int64_t total_steps) const;
  std::string to_string() const;

 private:
  enum class Kind { kConstant, kStep, kCosine };
  Kind kind_ = Kind::kConstant;
  int64_t every_ = 0;
  float gamma_ = 1.0f;
  int64_t warmup_ = 0;
};

}  // namespace fedmesh
