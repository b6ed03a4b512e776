// The DP noise sampler (crypto/dp_noise.h), checked statistically at fixed
// seeds with loose bounds (several standard errors):
// - Bernoulli(exp(-gamma)) hits exp(-gamma) for gamma below and above 1;
// - the discrete Gaussian has mean 0 and variance sigma^2, for a small sigma
//   and for one of the size the noise grid gives (2^20 and more);
// - its tails are Gaussian: P(|X| > 4 sigma) is tiny;
// - it is exact: P(k+1) / P(k) = exp(-(2k+1) / (2 sigma^2)) at sigma = 1,
//   which a rounded continuous Gaussian misses by 4 %;
// - noised values lie on the grid, and two inputs that snap to the same grid
//   point give the same output under the same draws (no low-bit leak);
// - the seeded source replays and says it is not private; two CSPRNG
//   sources never agree.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "crypto/dp_noise.h"

namespace fedmesh::crypto {
namespace {

struct Moments {
  double mean = 0.0, variance = 0.0;
  int64_t beyond_four_sigma = 0;
};

Moments moments_of(const DiscreteGaussian& gaussian, double sigma, int64_t count, uint64_t seed) {
  SeededNoiseSource source(seed);
  double sum = 0.0, squares = 0.0;
  Moments m;
  for (int64_t i = 0; i < count; ++i) {
    const double x = static_cast<double>(gaussian.sample(source));
    sum += x;
    squares += x * x;
    if (std::fabs(x) > 4.0 * sigma) ++m.beyond_four_sigma;
  }
  m.mean = sum / static_cast<double>(count);
  m.variance = squares / static_cast<double>(count) - m.mean * m.mean;
  return m;
}

TEST(DpNoise, BernoulliOfExpMinusGammaHasThatProbability) {
  SeededNoiseSource source(11);
  constexpr int kTrials = 200000;
  for (const auto& [numerator, denominator] : std::vector<std::pair<uint64_t, uint64_t>>{{1, 2}, {5, 2}, {7, 3}}) {
    int hits = 0;
    for (int i = 0; i < kTrials; ++i) hits += bernoulli_exp_minus(source, numerator, denominator) ? 1 : 0;
    const double p = std::exp(-static_cast<double>(numerator) / static_cast<double>(denominator));
    const double standard_error = std::sqrt(p * (1 - p) / kTrials);
    EXPECT_NEAR(static_cast<double>(hits) / kTrials, p, 5 * standard_error) << numerator << "/" << denominator;
  }
}

TEST(DpNoise, UniformBelowStaysBelowWideBounds) {
  SeededNoiseSource source(3);
  const unsigned __int128 bound = (static_cast<unsigned __int128>(1) << 100) + 12345;
  bool high_half = false;
  for (int i = 0; i < 1000; ++i) {
    const unsigned __int128 x = uniform_below(source, bound);
    ASSERT_LT(x, bound);
    high_half = high_half || x >= bound / 2;
  }
  EXPECT_TRUE(high_half) << "1000 draws never reached the upper half of the range";
  for (int i = 0; i < 1000; ++i) ASSERT_LT(uniform_below(source, 7), 7u);
}

TEST(DpNoise, SmallSigmaHasMeanZeroAndVarianceSigmaSquared) {
  const double sigma = 3.5;
  const DiscreteGaussian gaussian(sigma);
  EXPECT_DOUBLE_EQ(gaussian.variance(), sigma * sigma);
  constexpr int64_t kCount = 400000;
  const Moments m = moments_of(gaussian, sigma, kCount, 21);
  EXPECT_NEAR(m.mean, 0.0, 5 * sigma / std::sqrt(static_cast<double>(kCount)));
  // The variance's standard error is sigma^2 sqrt(2 / n), 0.22 % here.
  EXPECT_NEAR(m.variance, sigma * sigma, 0.02 * sigma * sigma);
  // P(|X| > 4 sigma) is 6.3e-5 for a Gaussian: about 25 of 400 000.
  EXPECT_LT(m.beyond_four_sigma, 100);
}

TEST(DpNoise, GridSizedSigmaHasMeanZeroAndVarianceSigmaSquared) {
  const double sigma = 1.37 * 0x1.0p20;  // the noise grid puts sigma at 2^20 or more
  const DiscreteGaussian gaussian(sigma);
  EXPECT_NEAR(gaussian.variance(), sigma * sigma, 1e-9 * sigma * sigma);
  constexpr int64_t kCount = 200000;
  const Moments m = moments_of(gaussian, sigma, kCount, 22);
  EXPECT_NEAR(m.mean, 0.0, 5 * sigma / std::sqrt(static_cast<double>(kCount)));
  EXPECT_NEAR(m.variance, sigma * sigma, 0.02 * sigma * sigma);
  EXPECT_LT(m.beyond_four_sigma, 60);  // about 13 expected
  const DiscreteGaussian largest(DiscreteGaussian::kMaxSigma);
  const Moments top = moments_of(largest, DiscreteGaussian::kMaxSigma, 50000, 23);
  EXPECT_NEAR(top.variance, DiscreteGaussian::kMaxSigma * DiscreteGaussian::kMaxSigma,
              0.04 * DiscreteGaussian::kMaxSigma * DiscreteGaussian::kMaxSigma);
}

TEST(DpNoise, ThePmfRatioIsTheDiscreteGaussians) {
  // sigma = 1: P(k+1) / P(k) = exp(-(2k+1) / 2) = 0.6065, 0.2231, 0.0821.
  // Rounding a continuous N(0, 1) gives 0.631 for the first: 4 % off.
  const DiscreteGaussian gaussian(1.0);
  SeededNoiseSource source(5);
  std::map<int64_t, int64_t> counts;
  constexpr int64_t kCount = 1000000;
  for (int64_t i = 0; i < kCount; ++i) ++counts[gaussian.sample(source)];
  // P(k) estimated from both signs (the distribution is symmetric).
  const auto p = [&](int64_t k) { return k == 0 ? counts[0] : (counts[k] + counts[-k]) / 2.0; };
  const double tolerances[] = {0.012, 0.025, 0.08};
  for (int64_t k = 0; k < 3; ++k) {
    const double expected = std::exp(-(2.0 * k + 1.0) / 2.0);
    const double measured = p(k + 1) / p(k);
    EXPECT_NEAR(measured / expected, 1.0, tolerances[k]) << "P(" << k + 1 << ") / P(" << k << ")";
  }
  EXPECT_NEAR(static_cast<double>(counts[1]) / static_cast<double>(counts[-1]), 1.0, 0.02) << "symmetric";
}

TEST(DpNoise, TheGridIsAPowerOfTwoBelowTheSensitivityAndTheNoise) {
  EXPECT_EQ(noise_grid(1.0, 1.0), 0x1.0p-20);
  EXPECT_EQ(noise_grid(1.0, 3.0), 0x1.0p-20);
  EXPECT_EQ(noise_grid(1.0, 0.01), 0x1.0p-27);  // 2^-7 <= 0.01 < 2^-6
  EXPECT_EQ(noise_grid(0.25, 0.5), 0x1.0p-22);
  const double coarse = noise_grid(1.0, 1e9);  // a huge sigma coarsens the grid
  EXPECT_LE(1e9 / coarse, DiscreteGaussian::kMaxSigma);
  EXPECT_GT(1e9 / (coarse / 2), DiscreteGaussian::kMaxSigma);
}

TEST(DpNoise, NoisedValuesLieExactlyOnTheGrid) {
  const double grid = noise_grid(1.0, 0.5);
  std::vector<float> values = {0.1f, 1.0f / 3.0f, -0.7777f, 0.0f, 12.345678f, 3000.0001f, -1e-7f, 1e-30f};
  std::vector<double> wide = {0.1, 1.0 / 3.0, -2.0 / 7.0, 1e-12};
  SeededNoiseSource source(8);
  for (int repeat = 0; repeat < 50; ++repeat) {
    std::vector<float> noised = values;
    add_grid_gaussian_noise(noised, 0.5, grid, source);
    for (size_t i = 0; i < noised.size(); ++i) {
      const double index = static_cast<double>(noised[i]) / grid;
      ASSERT_EQ(index, std::nearbyint(index)) << values[i] << " became " << noised[i] << ", off the grid";
    }
    std::vector<double> noised_wide = wide;
    add_grid_gaussian_noise(noised_wide, 0.5, grid, source);
    for (double v : noised_wide) {
      const double index = v / grid;
      ASSERT_EQ(index, std::nearbyint(index)) << v << " is off the grid";
    }
  }
}

TEST(DpNoise, InputsOnOneGridPointGiveOneOutputUnderTheSameDraws) {
  // The low bits of an input (those below the grid) never reach the output.
  const double grid = noise_grid(1.0, 1.0);
  std::vector<float> a = {0.5f, -0.25f, 0.125f};
  std::vector<float> b = {std::nextafter(0.5f, 1.0f), std::nextafter(-0.25f, 0.0f), std::nextafter(0.125f, 1.0f)};
  ASSERT_NE(a, b);
  SeededNoiseSource first(77), second(77);
  add_grid_gaussian_noise(a, 1.0, grid, first);
  add_grid_gaussian_noise(b, 1.0, grid, second);
  EXPECT_EQ(a, b);
}

TEST(DpNoise, TheNoiseOnTheGridHasTheAskedStandardDeviation) {
  const double stddev = 0.03;
  const double grid = noise_grid(1.0, stddev);
  std::vector<float> values(100000, 0.2f);
  SeededNoiseSource source(9);
  add_grid_gaussian_noise(values, stddev, grid, source);
  double sum = 0.0, squares = 0.0;
  for (float v : values) {
    const double d = static_cast<double>(v) - 0.2;
    sum += d;
    squares += d * d;
  }
  const double mean = sum / values.size();
  EXPECT_NEAR(mean, 0.0, 5 * stddev / std::sqrt(static_cast<double>(values.size())));
  EXPECT_NEAR(std::sqrt(squares / values.size() - mean * mean), stddev, 0.02 * stddev);
}

TEST(DpNoise, TheSeededSourceReplaysAndIsNotPrivate) {
  SeededNoiseSource a(42), b(42), c(43);
  EXPECT_FALSE(a.is_private());
  const DiscreteGaussian gaussian(5.0);
  std::vector<int64_t> xa, xb, xc;
  for (int i = 0; i < 64; ++i) {
    xa.push_back(gaussian.sample(a));
    xb.push_back(gaussian.sample(b));
    xc.push_back(gaussian.sample(c));
  }
  EXPECT_EQ(xa, xb);
  EXPECT_NE(xa, xc);
}

TEST(DpNoise, TwoSecureSourcesNeverAgree) {
  SecureNoiseSource a, b;
  EXPECT_TRUE(a.is_private());
  std::vector<uint64_t> wa, wb;
  for (int i = 0; i < 1100; ++i) {  // past one 4 KiB buffer
    wa.push_back(a.next_u64());
    wb.push_back(b.next_u64());
  }
  EXPECT_NE(wa, wb);
  EXPECT_NE(std::vector<uint64_t>(wa.begin(), wa.begin() + 4), std::vector<uint64_t>(wb.begin(), wb.begin() + 4));
  const DiscreteGaussian gaussian(1000.0);
  std::vector<int64_t> xa, xb;
  for (int i = 0; i < 16; ++i) {
    xa.push_back(gaussian.sample(a));
    xb.push_back(gaussian.sample(b));
  }
  EXPECT_NE(xa, xb);
}

}  // namespace
}  // namespace fedmesh::crypto
