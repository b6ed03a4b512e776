#include "privacy/rdp_accountant.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace fedmesh::privacy {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// log(exp(a) + exp(b)) and log(exp(a) - exp(b)) (a >= b) without overflow.
double log_add(double a, double b) {
  if (a == -kInfinity) return b;
  if (b == -kInfinity) return a;
  const double high = std::max(a, b), low = std::min(a, b);
  return high + std::log1p(std::exp(low - high));
}

double log_subtract(double a, double b) {
  if (b == -kInfinity) return a;
  if (a <= b) return -kInfinity;  // the terms cancel (or rounding made them): nothing left
  return a + std::log1p(-std::exp(b - a));
}

// log(erfc(x)), also where erfc underflows (x beyond ~26): its asymptotic
// expansion.
double log_erfc(double x) {
  const double r = std::erfc(x);
  if (r > 0.0) return std::log(r);
  const double x2 = x * x;
  return -0.5 * std::log(M_PI) - std::log(x) - x2 - 0.5 / x2 + 0.625 / (x2 * x2) - 37.0 / 24.0 / (x2 * x2 * x2) +
         353.0 / 64.0 / (x2 * x2 * x2 * x2);
}

// log A_α for integer α: the binomial expansion
//   A_α = Σ_{k=0..α} C(α, k) (1 - q)^(α - k) q^k exp((k² - k) / (2σ²)).
double log_a_integer(double q, double sigma, int64_t alpha) {
  double log_a = -kInfinity;
  double log_binomial = 0.0;  // log C(α, 0)
  for (int64_t k = 0; k <= alpha; ++k) {
    if (k > 0) log_binomial += std::log(static_cast<double>(alpha - k + 1)) - std::log(static_cast<double>(k));
    const double term = log_binomial + static_cast<double>(k) * std::log(q) +
                        static_cast<double>(alpha - k) * std::log1p(-q) +
                        static_cast<double>(k * k - k) / (2.0 * sigma * sigma);
    log_a = log_add(log_a, term);
  }
  return log_a;
}

// log A_α for fractional α: the integral split at z0 where the two
// Gaussians' densities cross, each part a series in the generalized
// binomial coefficients C(α, i) (whose sign alternates once i > α), summed
// until both terms fall below e^-30.
double log_a_fractional(double q, double sigma, double alpha) {
  double log_a0 = -kInfinity, log_a1 = -kInfinity;
  const double z0 = sigma * sigma * std::log(1.0 / q - 1.0) + 0.5;
  double log_binomial = 0.0;  // log |C(α, i)|
  bool positive = true;       // sign of C(α, i)
  for (int64_t i = 0;; ++i) {
    if (i > 0) {
      const double factor = (alpha - static_cast<double>(i - 1)) / static_cast<double>(i);
      log_binomial += std::log(std::fabs(factor));
      if (factor < 0.0) positive = !positive;
    }
    const double j = alpha - static_cast<double>(i), di = static_cast<double>(i);
    const double log_t0 = log_binomial + di * std::log(q) + j * std::log1p(-q);
    const double log_t1 = log_binomial + j * std::log(q) + di * std::log1p(-q);
    const double log_e0 = std::log(0.5) + log_erfc((di - z0) / (std::sqrt(2.0) * sigma));
    const double log_e1 = std::log(0.5) + log_erfc((z0 - j) / (std::sqrt(2.0) * sigma));
    const double log_s0 = log_t0 + (di * di - di) / (2.0 * sigma * sigma) + log_e0;
    const double log_s1 = log_t1 + (j * j - j) / (2.0 * sigma * sigma) + log_e1;
    if (positive) {
      log_a0 = log_add(log_a0, log_s0);
      log_a1 = log_add(log_a1, log_s1);
    } else {
      log_a0 = log_subtract(log_a0, log_s0);
      log_a1 = log_subtract(log_a1, log_s1);
    }
    if (std::max(log_s0, log_s1) < -30.0 || i > 100000) break;
  }
  return log_add(log_a0, log_a1);
}

double rdp_at(double q, double sigma, double alpha) {
  if (q == 0.0) return 0.0;
  if (sigma == 0.0) return kInfinity;
  if (std::isinf(alpha)) return kInfinity;
  if (q == 1.0) return alpha / (2.0 * sigma * sigma);
  const double log_a = alpha == std::floor(alpha) ? log_a_integer(q, sigma, static_cast<int64_t>(alpha))
                                                  : log_a_fractional(q, sigma, alpha);
  return log_a / (alpha - 1.0);
}

}  // namespace

std::vector<double> default_orders() {
  std::vector<double> orders;
  for (int x = 1; x < 100; ++x) orders.push_back(1.0 + x / 10.0);
  for (int x = 12; x < 64; ++x) orders.push_back(x);
  return orders;
}

std::vector<double> sampled_gaussian_rdp(double q, double noise_multiplier, std::span<const double> orders) {
  std::vector<double> rdp;
  rdp.reserve(orders.size());
  for (const double alpha : orders) rdp.push_back(rdp_at(q, noise_multiplier, alpha));
  return rdp;
}

PrivacySpent epsilon_for(std::span<const double> orders, std::span<const double> rdp, double delta) {
  PrivacySpent best{kInfinity, 0.0};
  const double log_delta = std::log(delta);
  for (size_t i = 0; i < orders.size() && i < rdp.size(); ++i) {
    const double alpha = orders[i];
    if (!(alpha > 1.0) || std::isinf(rdp[i]) || std::isinf(alpha)) continue;
    double epsilon;
    if (delta * delta + std::expm1(-rdp[i]) > 0.0) {
      // RDP at any order bounds the KL divergence, and δ <= sqrt(1 - e^-KL): ε = 0 will do.
      epsilon = 0.0;
    } else if (alpha > 1.01) {  // the conversion loses its footing as α -> 1
      epsilon = std::max(0.0, rdp[i] + std::log1p(-1.0 / alpha) - (log_delta + std::log(alpha)) / (alpha - 1.0));
    } else {
      continue;
    }
    if (epsilon < best.epsilon) best = {epsilon, alpha};
  }
  return best;
}

RdpAccountant::RdpAccountant(std::vector<double> orders) : orders_(std::move(orders)), rdp_(orders_.size(), 0.0) {}

Status RdpAccountant::add(double q, double noise_multiplier, int64_t steps) {
  if (!(q >= 0.0 && q <= 1.0)) return invalid_argument("sampling rate q must be in [0, 1]");
  if (!(noise_multiplier >= 0.0) || std::isinf(noise_multiplier)) {
    return invalid_argument("noise multiplier must be a number >= 0");
  }
  if (steps < 0) return invalid_argument("steps must be >= 0");
  const std::vector<double> one = sampled_gaussian_rdp(q, noise_multiplier, orders_);
  for (size_t i = 0; i < rdp_.size(); ++i) {
    if (steps > 0) rdp_[i] += one[i] * static_cast<double>(steps);
  }
  return Status::ok();
}

PrivacySpent RdpAccountant::spent(double delta) const { return epsilon_for(orders_, rdp_, delta); }

Status RdpAccountant::restore(std::vector<double> rdp) {
  if (rdp.size() != orders_.size()) return invalid_argument("saved RDP has " + std::to_string(rdp.size()) + " orders, not " + std::to_string(orders_.size()));
  for (const double r : rdp) {
    if (!(r >= 0.0)) return invalid_argument("saved RDP values must be >= 0");
  }
  rdp_ = std::move(rdp);
  return Status::ok();
}

PrivacySpent ConstantRateAccounting::after(int64_t steps) const {
  RdpAccountant accountant;
  (void)accountant.add(q, sigma, steps);
  return accountant.spent(delta);
}

std::vector<double> ConstantRateAccounting::rdp(int64_t steps) const {
  RdpAccountant accountant;
  (void)accountant.add(q, sigma, steps);
  return accountant.rdp();
}

int64_t ConstantRateAccounting::steps_within(double target, int64_t limit) const {
  int64_t low = 0, high = limit;
  while (low < high) {
    const int64_t middle = low + (high - low + 1) / 2;
    if (after(middle).epsilon <= target) low = middle;
    else high = middle - 1;
  }
  return low;
}

}  // namespace fedmesh::privacy
