#include "aggregator/exact_accumulator.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace fedmesh::aggregator {

namespace {

constexpr double kScale = 1099511627776.0;  // 2^40

// One term, rounded to nearest (ties to even, the FPU's mode) on its own.
int64_t fixed(double value) { return static_cast<int64_t>(std::nearbyint(value * kScale)); }

}  // namespace

ExactAccumulator::ExactAccumulator(int64_t elements) : sum_(static_cast<size_t>(std::max<int64_t>(elements, 0)), 0) {}

double ExactAccumulator::total_weight() const { return static_cast<double>(weight_sum_) / kScale; }

Status ExactAccumulator::add(std::span<const float> values, double weight) {
  if (values.size() != sum_.size()) {
    return invalid_argument("update has " + std::to_string(values.size()) + " values, the accumulator " +
                            std::to_string(sum_.size()));
  }
  if (!(weight >= 0.0 && weight <= 1.0)) return invalid_argument("update weight must be in [0, 1]");
  float largest = 0.0f;
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return invalid_argument("update value " + std::to_string(i) + " is not finite");
    }
    largest = std::max(largest, std::fabs(values[i]));
  }
  const double largest_term = weight * static_cast<double>(largest);
  if (largest_term >= kMaxTermMagnitude) {
    return invalid_argument("update has a weighted value of magnitude " + std::to_string(largest_term) +
                            ", beyond the exact accumulator's range (2^22)");
  }
  if (bound_used_ + largest_term >= kMaxSumOfLargestTerms) {
    return invalid_argument("the exact accumulator is full: its sum could overflow with this update; "
                            "apply the aggregate and start a new one");
  }
  for (size_t i = 0; i < values.size(); ++i) sum_[i] += fixed(weight * static_cast<double>(values[i]));
  weight_sum_ += fixed(weight);
  bound_used_ += largest_term;
  ++updates_;
  return Status::ok();
}

void ExactAccumulator::mean(std::span<float> out) const {
  const double total = static_cast<double>(weight_sum_);
  for (size_t i = 0; i < sum_.size() && i < out.size(); ++i) {
    out[i] = total > 0.0 ? static_cast<float>(static_cast<double>(sum_[i]) / total) : 0.0f;
  }
}

void ExactAccumulator::sum(std::span<float> out) const {
  for (size_t i = 0; i < sum_.size() && i < out.size(); ++i) {
    out[i] = static_cast<float>(static_cast<double>(sum_[i]) / kScale);
  }
}

void ExactAccumulator::clear() {
  std::fill(sum_.begin(), sum_.end(), 0);
  weight_sum_ = 0;
  bound_used_ = 0.0;
  updates_ = 0;
}

}  // namespace fedmesh::aggregator
