// The RDP accountant against published values:
// - Google's dp_accounting (rdp_privacy_accountant_test.py): RDP of 50 steps
//   of the Poisson-sampled Gaussian with q = 0.01, σ = 2.5 at orders 2.5, 5,
//   50, 100 and ∞ (relative tolerance 1e-4, as there; at order 1.5 it
//   reports 6.7058e-4, a bound 3% above the exact moment, which numerical
//   integration of A_α puts at 6.50071e-4, the value checked here); the (ε, δ)
//   conversion of a constant RDP 1.1 over orders 2..32 at δ = 1e-5
//   (ε = 1.32783806176 at order 32); the Gaussian with σ = 4.530877117,
//   exactly (1, 1e-6)-DP;
// - Opacus (accountants_test.py): σ = 1.5, q = 0.04, 2250 steps, δ = 1e-5
//   gives ε = 7.32911117143 with its default orders;
// and the properties any accountant must have: no sampling costs nothing,
// no noise costs everything, RDP adds over steps, more noise costs less.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "privacy/rdp_accountant.h"

namespace fedmesh::privacy {
namespace {

TEST(RdpAccountant, PoissonSampledGaussianMatchesPublishedRdp) {
  const std::vector<double> orders = {1.5, 2.5, 5, 50, 100, std::numeric_limits<double>::infinity()};
  // Order 1.5: the integral ∫ N(z; 0, σ²) ((1 - q) + q e^((2z - 1) / 2σ²))^α dz
  // by the trapezoid rule on [-40, 40] with 400 000 steps, times 50 / (α - 1).
  const std::vector<double> expected = {6.50070889e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02, 1.67416308e02};
  RdpAccountant accountant(orders);
  ASSERT_TRUE(accountant.add(0.01, 2.5, 50).is_ok());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(accountant.rdp()[i], expected[i], 1e-4 * expected[i]) << "order " << orders[i];
  }
  EXPECT_TRUE(std::isinf(accountant.rdp()[5]));
}

TEST(RdpAccountant, ConversionToEpsilonDeltaMatchesPublishedValues) {
  std::vector<double> orders, rdp;
  for (int alpha = 2; alpha <= 32; ++alpha) {
    orders.push_back(alpha);
    rdp.push_back(1.1);  // pure DP
  }
  const PrivacySpent pure = epsilon_for(orders, rdp, 1e-5);
  EXPECT_NEAR(pure.epsilon, 1.32783806176, 1e-9);
  EXPECT_EQ(pure.order, 32.0);

  // q = 1: the plain Gaussian mechanism, whose σ here gives exactly (1, 1e-6)-DP.
  std::vector<double> fine;
  for (int i = 1001; i < 100000; ++i) fine.push_back(0.001 * i);
  const std::vector<double> gaussian = sampled_gaussian_rdp(1.0, 4.530877117, fine);
  EXPECT_NEAR(epsilon_for(fine, gaussian, 1e-6).epsilon, 1.0, 1e-6);
}

TEST(RdpAccountant, MatchesOpacusOnDpSgd) {
  RdpAccountant accountant;
  ASSERT_TRUE(accountant.add(0.04, 1.5, static_cast<int64_t>(90 / 0.04)).is_ok());
  EXPECT_NEAR(accountant.spent(1e-5).epsilon, 7.32911117143, 1e-6);
  // The same steps one at a time compose to the same total.
  RdpAccountant stepwise;
  for (int i = 0; i < 2250; ++i) ASSERT_TRUE(stepwise.add(0.04, 1.5).is_ok());
  EXPECT_NEAR(stepwise.spent(1e-5).epsilon, accountant.spent(1e-5).epsilon, 1e-9);
}

TEST(RdpAccountant, BoundaryCasesAndMonotonicity) {
  RdpAccountant none;
  ASSERT_TRUE(none.add(0.0, 1.0, 1000).is_ok());
  EXPECT_EQ(none.spent(1e-5).epsilon, 0.0) << "an example never sampled leaks nothing";
  RdpAccountant open;
  ASSERT_TRUE(open.add(0.1, 0.0).is_ok());
  EXPECT_TRUE(std::isinf(open.spent(1e-5).epsilon)) << "no noise: no privacy";
  double previous = std::numeric_limits<double>::infinity();
  for (const double sigma : {0.6, 0.8, 1.0, 1.5, 2.0, 4.0}) {
    RdpAccountant a;
    ASSERT_TRUE(a.add(0.01, sigma, 1000).is_ok());
    const double epsilon = a.spent(1e-5).epsilon;
    EXPECT_LT(epsilon, previous) << "more noise must cost less (σ " << sigma << ")";
    previous = epsilon;
  }
  RdpAccountant bad;
  EXPECT_FALSE(bad.add(1.5, 1.0).is_ok());
  EXPECT_FALSE(bad.add(0.1, -1.0).is_ok());
  EXPECT_FALSE(bad.add(0.1, 1.0, -3).is_ok());
  EXPECT_FALSE(bad.restore({1.0}).is_ok());
}

}  // namespace
}  // namespace fedmesh::privacy
