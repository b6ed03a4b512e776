#include "federation/exact_accumulator.h"

#include <emmintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <string>

#include "kernels/parallel.h"

namespace fedmesh::federation {

namespace {

constexpr double kScale = 1099511627776.0;  // 2^40

constexpr int64_t kGrain = 1 << 16;

// One term, rounded to nearest, ties to even (cvtsd2si under the default
// rounding mode), on its own: the same term whatever else is summed.
inline int64_t fixed(double value) { return _mm_cvtsd_si64(_mm_set_sd(value * kScale)); }

}  // namespace

int64_t to_fixed_point(double value) { return fixed(value); }

ExactAccumulator::ExactAccumulator(int64_t elements) : sum_(static_cast<size_t>(std::max<int64_t>(elements, 0)), 0) {}

double ExactAccumulator::total_weight() const { return static_cast<double>(weight_sum_) / kScale; }

Status ExactAccumulator::check_bound(double used, double largest_term) {
  if (largest_term >= kMaxTermMagnitude) {
    return invalid_argument("update has a weighted value of magnitude " + std::to_string(largest_term) +
                            ", beyond the exact accumulator's range (2^22)");
  }
  if (used + largest_term >= kMaxSumOfLargestTerms) {
    return invalid_argument("the exact accumulator is full: its sum could overflow with this update; "
                            "apply the aggregate and start a new one");
  }
  return Status::ok();
}

Status ExactAccumulator::add(std::span<const float> values, double weight, double reserved) {
  const std::span<const float> pieces[] = {values};
  return add(pieces, weight, reserved);
}

Status ExactAccumulator::add(std::span<const std::span<const float>> pieces, double weight, double reserved) {
  size_t total = 0;
  for (const std::span<const float> piece : pieces) total += piece.size();
  if (total != sum_.size()) {
    return invalid_argument("update has " + std::to_string(total) + " values, the accumulator " +
                            std::to_string(sum_.size()));
  }
  if (!(weight >= 0.0 && weight <= 1.0)) return invalid_argument("update weight must be in [0, 1]");
  // One vectorizable pass: the largest magnitude as bits; an exponent of all
  // ones (Inf or NaN) sorts above every finite magnitude.
  std::atomic<uint32_t> largest_bits{0};
  for (const std::span<const float> piece : pieces) {
    parallel_for(static_cast<int64_t>(piece.size()), kGrain, [&](int64_t begin, int64_t end) {
      uint32_t local = 0;
      const float* v = piece.data();
      for (int64_t i = begin; i < end; ++i) local = std::max(local, std::bit_cast<uint32_t>(v[i]) & 0x7fffffffu);
      uint32_t seen = largest_bits.load();
      while (local > seen && !largest_bits.compare_exchange_weak(seen, local)) {
      }
    });
  }
  if (largest_bits.load() >= 0x7f800000u) {
    size_t position = 0;
    for (const std::span<const float> piece : pieces) {
      for (size_t i = 0; i < piece.size(); ++i) {
        if (!std::isfinite(piece[i])) {
          return invalid_argument("update value " + std::to_string(position + i) + " is not finite");
        }
      }
      position += piece.size();
    }
  }
  const float largest = std::bit_cast<float>(largest_bits.load());
  const double largest_term = weight * static_cast<double>(largest);
  FEDMESH_RETURN_IF_ERROR(check_bound(bound_used_ + reserved, largest_term));
  int64_t* first = sum_.data();  // where the piece's values land
  for (const std::span<const float> piece : pieces) {
    parallel_for(static_cast<int64_t>(piece.size()), kGrain, [&](int64_t begin, int64_t end) {
      int64_t* __restrict sum = first;
      const float* __restrict v = piece.data();
      for (int64_t i = begin; i < end; ++i) sum[i] += fixed(weight * static_cast<double>(v[i]));
    });
    first += piece.size();
  }
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
  sum(0, out.first(std::min(out.size(), sum_.size())));
}

void ExactAccumulator::sum(int64_t first, std::span<float> out) const {
  const auto offset = static_cast<size_t>(std::clamp<int64_t>(first, 0, elements()));
  const int64_t n = static_cast<int64_t>(std::min(out.size(), sum_.size() - offset));
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    const int64_t* __restrict s = sum_.data() + offset;
    float* __restrict o = out.data();
    for (int64_t i = begin; i < end; ++i) o[i] = static_cast<float>(static_cast<double>(s[i]) / kScale);
  });
}

ExactAccumulator ExactAccumulator::slice(int64_t first, int64_t elements) const {
  ExactAccumulator part(0);
  const auto begin = sum_.begin() + std::clamp<int64_t>(first, 0, this->elements());
  part.sum_.assign(begin, begin + std::clamp<int64_t>(elements, 0, sum_.end() - begin));
  part.weight_sum_ = weight_sum_;
  part.bound_used_ = bound_used_;
  part.updates_ = updates_;
  return part;
}

Status ExactAccumulator::restore(Saved saved) {
  if (saved.sum.size() != sum_.size()) {
    return invalid_argument("a saved sum of " + std::to_string(saved.sum.size()) + " values, the accumulator has " +
                            std::to_string(sum_.size()));
  }
  if (!(saved.bound_used >= 0.0 && saved.bound_used < kMaxSumOfLargestTerms) || saved.updates < 0) {
    return invalid_argument("a saved sum whose bound or count is out of range");
  }
  sum_ = std::move(saved.sum);
  weight_sum_ = saved.weight;
  bound_used_ = saved.bound_used;
  updates_ = saved.updates;
  return Status::ok();
}

void ExactAccumulator::clear() {
  std::fill(sum_.begin(), sum_.end(), 0);
  weight_sum_ = 0;
  bound_used_ = 0.0;
  updates_ = 0;
}

}  // namespace fedmesh::federation
