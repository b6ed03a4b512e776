// Dynamic loss scaling for fp16 training: the loss is multiplied by `scale`
// so that small gradients survive fp16; a step whose gradients overflowed is
// skipped and the scale halved; after `growth_interval` clean steps in a row
// the scale doubles. bf16 and fp32 use a static scale of 1.
#pragma once

#include <cstdint>

namespace fedmesh::train {

struct LossScalerOptions {
  bool dynamic = true;
  float initial_scale = 65536.0f;  // 2^16, as torch.cuda.amp.GradScaler
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;
  float min_scale = 1.0f / 65536.0f;
  float max_scale = 16777216.0f;  // 2^24
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions options = {});
  static DynamicLossScaler fixed_unit_scale();

  float scale() const { return scale_; }
  // Reports whether this step's gradients were all finite. Returns true when
  // the optimizer step should be applied, false when it must be skipped.
  bool update(bool gradients_finite);
  int64_t skipped_steps() const { return skipped_; }
  int64_t clean_steps_in_a_row() const { return clean_run_; }

  // What a checkpoint keeps of the scaler (its options come from the run's flags).
  struct State {
    float scale = 1.0f;
    int64_t clean_run = 0;
    int64_t skipped = 0;
  };
  State state() const { return {scale_, clean_run_, skipped_}; }
  void restore(const State& state) {
    scale_ = state.scale;
    clean_run_ = state.clean_run;
    skipped_ = state.skipped;
  }

 private:
  LossScalerOptions options_;
  float scale_;
  int64_t clean_run_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace fedmesh::train
