#include "train/loss_scaler.h"

#include <algorithm>

namespace fedmesh::train {

DynamicLossScaler::DynamicLossScaler(LossScalerOptions options)
    : options_(options), scale_(options.dynamic ? options.initial_scale : 1.0f) {}

DynamicLossScaler DynamicLossScaler::fixed_unit_scale() {
  LossScalerOptions options;
  options.dynamic = false;
  return DynamicLossScaler(options);
}

bool DynamicLossScaler::update(bool gradients_finite) {
  if (!gradients_finite) {
    ++skipped_;
    clean_run_ = 0;
    if (options_.dynamic) scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
    return false;
  }
  ++clean_run_;
  if (options_.dynamic && clean_run_ >= options_.growth_interval) {
    scale_ = std::min(options_.max_scale, scale_ * options_.growth_factor);
    clean_run_ = 0;
  }
  return true;
}

}  // namespace fedmesh::train
