// Rényi differential privacy accounting of the sampled Gaussian mechanism
// (Mironov 2017; Mironov, Talwar and Zhang 2019): the analysis behind
// Opacus and TensorFlow Privacy. One DP-SGD step (or one DP-FedAvg round)
// samples each example (site) with probability q, clips each one's
// contribution to norm C and adds N(0, (σC)²) noise to the sum; its RDP at
// order α is log(A_α) / (α - 1), where A_α is the α-th moment of the
// mechanism's privacy loss under Poisson subsampling. Steps compose by
// adding RDP per order; (ε, δ) is the best over the orders of the
// conversion of Canonne, Kamath and Steinke (2020), Balle et al. (2020):
//   ε = rdp(α) + log((α - 1) / α) - (log δ + log α) / (α - 1)
// (orders above 1.01), or ε = 0 where δ >= sqrt(1 - e^-rdp(α)) (RDP bounds
// the KL divergence). A_α is exact: the binomial sum for integer α, the
// two-sided series of Mironov et al. for fractional α (it equals numerical
// integration; Google's dp_accounting reports a looser 6.7058e-4 where this
// gives 6.5007e-4 at α = 1.5, q = 0.01, σ = 2.5, 50 steps).
// Neighbouring datasets differ by adding or removing one example (site).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace fedmesh::privacy {

// Orders 1.1, 1.2, ..., 10.9 and 12, 13, ..., 63 (what Opacus uses).
std::vector<double> default_orders();

// RDP of one step of the sampled Gaussian mechanism at each order: q in
// [0, 1], noise_multiplier σ >= 0 (0: no privacy, +inf RDP), orders > 1
// (+inf allowed).
std::vector<double> sampled_gaussian_rdp(double q, double noise_multiplier, std::span<const double> orders);

struct PrivacySpent {
  double epsilon = 0.0;
  double order = 0.0;  // the order that gave it
};

// The smallest ε over the orders for `delta` in (0, 1), given each order's
// total RDP. +inf when every order's RDP is infinite.
PrivacySpent epsilon_for(std::span<const double> orders, std::span<const double> rdp, double delta);

// A running total: steps with their own q and σ compose by adding RDP.
class RdpAccountant {
 public:
  explicit RdpAccountant(std::vector<double> orders = default_orders());
  // kInvalidArgument for q outside [0, 1], σ < 0 or steps < 0.
  Status add(double q, double noise_multiplier, int64_t steps = 1);
  PrivacySpent spent(double delta) const;
  const std::vector<double>& orders() const { return orders_; }
  const std::vector<double>& rdp() const { return rdp_; }
  // Restores a total saved with rdp() (same orders).
  Status restore(std::vector<double> rdp);

 private:
  std::vector<double> orders_, rdp_;
};

// The same mechanism every step (fixed q and σ): what a DP-SGD run or a
// DP-FedAvg federation spends after `steps` steps (rounds).
struct ConstantRateAccounting {
  double q = 0.0, sigma = 0.0, delta = 1e-5;
  PrivacySpent after(int64_t steps) const;
  std::vector<double> rdp(int64_t steps) const;
  // The most steps (at most `limit`) whose ε stays within `target`.
  int64_t steps_within(double target, int64_t limit) const;
};

}  // namespace fedmesh::privacy
