// Exact, order-independent weighted sums of updates. Each term w * x is
// rounded once, on its own, to a 64-bit fixed-point integer (units of
// 2^-kFractionBits); integer addition is exact and associative, so the same
// set of updates gives a bit-identical sum, and mean, whatever order they
// arrive in, and a committed aggregate can be recomputed from its recorded
// inputs and compared by hash. (A float or double sum depends on the order.)
//
// Resolution: 2^-40 (about 9.1e-13) absolute per term. Range: every term must
// satisfy |w * x| < 2^22 (about 4.2e6), and the sum of the largest terms of
// all updates added must stay below 2^23: an update that could break either
// bound is refused before it touches the sum (kInvalidArgument), so no sum
// ever overflows. Weights are in [0, 1] (the caller scales sample counts and
// staleness into that range); the total weight is summed the same way.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace fedmesh::federation {

inline constexpr int kFractionBits = 40;
inline constexpr double kMaxTermMagnitude = 4194304.0;         // 2^22
inline constexpr double kMaxSumOfLargestTerms = 8388607.0;     // 2^23 - 1: room for every term's rounding

// One value in the accumulator's fixed point (units of 2^-kFractionBits),
// rounded to nearest, ties to even; |value| must stay below 2^22.
int64_t to_fixed_point(double value);

class ExactAccumulator {
 public:
  explicit ExactAccumulator(int64_t elements);

  int64_t elements() const { return static_cast<int64_t>(sum_.size()); }
  int64_t updates() const { return updates_; }
  // The summed weights, exactly as summed.
  double total_weight() const;

  // sum += weight * values. Refuses (and changes nothing) when a value is not
  // finite, the weight is outside [0, 1], the length differs, or the bounds
  // above could be broken; the message says which.
  Status add(std::span<const float> values, double weight, double reserved = 0.0);
  // The same for one update given in pieces laid end to end (a model's
  // tensors, without copying them into one vector): added or refused whole.
  // `reserved`: bound taken by terms the caller adds elsewhere (a round's
  // updates folded later, slice by slice): the update is refused when the
  // bound could be broken with them.
  Status add(std::span<const std::span<const float>> pieces, double weight, double reserved = 0.0);
  // Sum of the largest weighted terms added so far (the overflow bound's use).
  double bound_used() const { return bound_used_; }
  // Whether an update whose largest weighted term is `largest_term` may join
  // a sum whose bound is `used` already: the checks add() makes, for a caller
  // that adds the update later, slice by slice.
  static Status check_bound(double used, double largest_term);
  // Values [first, first + elements) of this sum as an accumulator of their
  // own, with this one's total weight, bound and count: more updates' values
  // for those elements added to it give the slice of the sum this one would
  // hold with them added whole.
  ExactAccumulator slice(int64_t first, int64_t elements) const;
  // out = sum / total weight (zeros when nothing was added).
  void mean(std::span<float> out) const;
  // out = sum.
  void sum(std::span<float> out) const;
  // out = sum[first, first + out.size()) (one tensor of a model laid end to end).
  void sum(int64_t first, std::span<float> out) const;
  // The raw fixed-point sums, for hashing and for tests of exactness.
  std::span<const int64_t> raw() const { return sum_; }
  void clear();

  // A checkpoint of a sum that lives across rounds (gossip replicas): the
  // raw sums, the raw total weight, the bound used so far and the count.
  struct Saved {
    std::vector<int64_t> sum;
    int64_t weight = 0;
    double bound_used = 0.0;
    int64_t updates = 0;
  };
  Saved save() const { return {sum_, weight_sum_, bound_used_, updates_}; }
  // The same without the sums (a caller that writes raw() out itself).
  Saved save_counters() const { return {{}, weight_sum_, bound_used_, updates_}; }
  // Refuses a saved sum of another length, or whose bound is out of range.
  Status restore(Saved saved);

 private:
  std::vector<int64_t> sum_;
  int64_t weight_sum_ = 0;
  double bound_used_ = 0.0;  // sum over added updates of max |w * x|
  int64_t updates_ = 0;
};

}  // namespace fedmesh::federation
