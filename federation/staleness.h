// Staleness weights for asynchronous updates: an update computed from server
// version v and applied at version V has staleness tau = V - v >= 0 and is
// weighted by s(tau) in (0, 1], or dropped (weight 0) beyond a cut-off.
//
//   constant        s(tau) = 1
//   polynomial:A    s(tau) = (1 + tau)^-A        (A = 0.5: FedBuff's 1/sqrt(1 + tau))
//   hinge:A:B       s(tau) = 1 if tau <= B, else 1 / (A (tau - B) + 1)
//   inverse         s(tau) = 1 / max(1, tau)
// and, on top of any of them, max_staleness: s(tau) = 0 for tau > max_staleness
// (a negative max_staleness means no cut-off). Xie et al. (FedAsync, 2019)
// and Nguyen et al. (FedBuff, 2022) define these.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace fedmesh::federation {

// Bounds on what a flag or config may ask for.
inline constexpr double kMaxStalenessExponent = 16.0;
inline constexpr double kMaxHingeSlope = 1e6;
inline constexpr int64_t kMaxHingeOffset = 1'000'000;

class StalenessFunction {
 public:
  enum class Kind { kConstant, kPolynomial, kHinge, kInverse };

  StalenessFunction() = default;  // constant, no cut-off
  // "constant", "polynomial:0.5", "hinge:10:4", "inverse"; the message of an
  // error lists the accepted forms.
  static Result<StalenessFunction> parse(std::string_view text, int64_t max_staleness = -1);

  // The weight of an update of staleness tau; a negative tau (an update from
  // a version the server has not reached) is a caller error and weighs 0.
  double weight(int64_t tau) const;
  // parse(to_string()) gives back the same function (without the cut-off).
  std::string to_string() const;
  Kind kind() const { return kind_; }
  int64_t max_staleness() const { return max_staleness_; }

 private:
  Kind kind_ = Kind::kConstant;
  double exponent_ = 0.0;  // polynomial
  double slope_ = 0.0;     // hinge A
  int64_t offset_ = 0;     // hinge B
  int64_t max_staleness_ = -1;
};

}  // namespace fedmesh::federation
