#include "federation/staleness.h"

#include <cmath>
#include <vector>

#include "base/text.h"

namespace fedmesh::federation {

namespace {

constexpr const char* kForms = "constant, polynomial:A, hinge:A:B or inverse";

}  // namespace

Result<StalenessFunction> StalenessFunction::parse(std::string_view text, int64_t max_staleness) {
  const std::vector<std::string_view> parts = split(text, ':');
  const std::string quoted = "staleness function '" + std::string(text) + "'";
  StalenessFunction function;
  function.max_staleness_ = max_staleness < 0 ? -1 : max_staleness;
  if (parts[0] == "constant" && parts.size() == 1) {
    function.kind_ = Kind::kConstant;
  } else if (parts[0] == "inverse" && parts.size() == 1) {
    function.kind_ = Kind::kInverse;
  } else if (parts[0] == "polynomial" && parts.size() == 2) {
    function.kind_ = Kind::kPolynomial;
    if (!parse_number(parts[1], function.exponent_) || !(function.exponent_ >= 0.0) ||
        function.exponent_ > kMaxStalenessExponent) {
      return invalid_argument(quoted + ": the exponent A of polynomial:A must be a number in [0, " +
                              format_number(kMaxStalenessExponent) + "]");
    }
  } else if (parts[0] == "hinge" && parts.size() == 3) {
    function.kind_ = Kind::kHinge;
    if (!parse_number(parts[1], function.slope_) || !(function.slope_ > 0.0) || function.slope_ > kMaxHingeSlope) {
      return invalid_argument(quoted + ": the slope A of hinge:A:B must be a number in (0, " +
                              format_number(kMaxHingeSlope) + "]");
    }
    if (!parse_number(parts[2], function.offset_) || function.offset_ < 0 || function.offset_ > kMaxHingeOffset) {
      return invalid_argument(quoted + ": the offset B of hinge:A:B must be an integer in [0, " +
                              std::to_string(kMaxHingeOffset) + "]");
    }
  } else {
    return invalid_argument("unknown " + quoted + " (expected " + kForms + ")");
  }
  return function;
}

double StalenessFunction::weight(int64_t tau) const {
  if (tau < 0) return 0.0;
  if (max_staleness_ >= 0 && tau > max_staleness_) return 0.0;
  const double t = static_cast<double>(tau);
  switch (kind_) {
    case Kind::kConstant: return 1.0;
    case Kind::kPolynomial: return std::pow(1.0 + t, -exponent_);
    case Kind::kHinge: return tau <= offset_ ? 1.0 : 1.0 / (slope_ * static_cast<double>(tau - offset_) + 1.0);
    case Kind::kInverse: return 1.0 / std::max(1.0, t);
  }
  return 0.0;
}

std::string StalenessFunction::to_string() const {
  switch (kind_) {
    case Kind::kConstant: return "constant";
    case Kind::kPolynomial: return "polynomial:" + format_number(exponent_);
    case Kind::kHinge: return "hinge:" + format_number(slope_) + ":" + std::to_string(offset_);
    case Kind::kInverse: return "inverse";
  }
  return "constant";
}

}  // namespace fedmesh::federation
