// Noise for differential privacy, drawn so that the released values leak
// nothing through floating point.
//
// Gaussian noise computed in floating point (Box-Muller in double, added to a
// float) is not differentially private as analysed: the low-order bits of a
// noised value reveal which inputs could have produced it (Mironov, "On
// significance of the least significant bits for differential privacy",
// CCS 2012). Here the noise is integral instead:
//
// - DiscreteGaussian draws k from the discrete Gaussian N_Z(0, s^2), exactly
//   (Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential
//   Privacy", NeurIPS 2020, Algorithms 1-3): rejection from a discrete
//   Laplace with Bernoulli(exp(-gamma)) trials in integer arithmetic, s^2
//   held as a rational n/d of 64-bit integers and every intermediate in
//   128 bits. It is exact except that a discrete-Laplace proposal of more
//   than 2^11 times its scale (probability below e^-2048) is rejected
//   outright; its true acceptance probability is below e^-(2^21).
// - add_grid_gaussian_noise snaps each value to a fixed-point grid (a power
//   of two), adds k x grid with k ~ N_Z(0, (stddev / grid)^2) in 64-bit
//   integers, and writes the noised integer back scaled by the grid. The
//   released value is a function of the noised integer alone, so it lies on
//   the grid and carries no trace of the unnoised input's bits.
//
// The discrete Gaussian with integer sensitivity D and scale s satisfies the
// same (D^2 / 2s^2)-concentrated DP, hence the same Renyi DP, as the
// continuous Gaussian (CKS 2020, Theorem 4), so the RDP accountant applies
// unchanged. Snapping costs at most half a grid step per coordinate before
// the noise: with the grid at most 2^-20 of the sensitivity, a vector of d
// coordinates has its L2 sensitivity raised by a factor of at most
// 1 + sqrt(d) x 2^-20 (1.001 for a million parameters).
//
// The randomness comes from a NoiseSource: SecureNoiseSource reads libsodium's
// CSPRNG (the operating system's generator) and is what every process that
// releases data uses; SeededNoiseSource replays a 64-bit seed and exists for
// simulations and tests that must reproduce a run. Seeded noise is public to
// whoever knows the seed: it is no privacy guarantee.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "base/random.h"

namespace fedmesh::crypto {

// Uniformly random 64-bit words.
class NoiseSource {
 public:
  virtual ~NoiseSource() = default;
  virtual uint64_t next_u64() = 0;
  // False for a seeded source: its noise replays and protects nothing.
  virtual bool is_private() const = 0;
};

// libsodium's randombytes (the OS CSPRNG), read 4 KiB at a time. Two
// instances never draw the same stream.
class SecureNoiseSource final : public NoiseSource {
 public:
  SecureNoiseSource();
  uint64_t next_u64() override;
  bool is_private() const override { return true; }

 private:
  std::array<uint64_t, 512> buffer_{};
  size_t next_ = buffer_.size();
};

// xoshiro256** from a seed (base/random.h): replays exactly; not private.
class SeededNoiseSource final : public NoiseSource {
 public:
  explicit SeededNoiseSource(uint64_t seed) : rng_(seed) {}
  uint64_t next_u64() override { return rng_.next_u64(); }
  bool is_private() const override { return false; }

 private:
  Rng rng_;
};

// Uniform in [0, bound), bound > 0, by rejection (no modulo bias).
unsigned __int128 uniform_below(NoiseSource& source, unsigned __int128 bound);

// Bernoulli(numerator / denominator), 0 <= numerator <= denominator, denominator > 0.
bool bernoulli_fraction(NoiseSource& source, unsigned __int128 numerator, unsigned __int128 denominator);

// Bernoulli(exp(-numerator / denominator)), denominator > 0 (CKS 2020, Algorithm 1).
bool bernoulli_exp_minus(NoiseSource& source, unsigned __int128 numerator, unsigned __int128 denominator);

// The discrete Laplace with scale `scale` >= 1: P(x) proportional to
// exp(-|x| / scale) (CKS 2020, Algorithm 2).
int64_t discrete_laplace(NoiseSource& source, uint64_t scale);

// The discrete Gaussian N_Z(0, sigma^2): P(k) proportional to
// exp(-k^2 / (2 sigma^2)) over the integers.
class DiscreteGaussian {
 public:
  // The largest sigma the 128-bit arithmetic takes.
  static constexpr double kMaxSigma = 0x1.0p26;

  // sigma in (0, kMaxSigma] (FEDMESH_CHECKed). sigma^2 is approximated by
  // n / d with d a power of two and n about 2^40 or more: a relative error
  // below 2^-40.
  explicit DiscreteGaussian(double sigma);

  int64_t sample(NoiseSource& source) const;

  uint64_t variance_numerator() const { return numerator_; }
  uint64_t variance_denominator() const { return denominator_; }
  // sigma^2 as the sampler holds it (n / d).
  double variance() const;

 private:
  uint64_t numerator_ = 0;    // n
  uint64_t denominator_ = 1;  // d
  uint64_t scale_ = 1;        // t = floor(sigma) + 1, the discrete Laplace's scale
};

// The grid for noise of standard deviation `stddev` on values of L2
// sensitivity `sensitivity`: the largest power of two at most 2^-20 of the
// smaller of the two, coarsened where needed so that stddev / grid stays at
// or below DiscreteGaussian::kMaxSigma. Both > 0 and finite.
double noise_grid(double sensitivity, double stddev);

// Adds Gaussian noise of standard deviation `stddev` > 0 to every value on
// the grid `grid` (a power of two, from noise_grid): value <- (round(value /
// grid) + k) x grid with k ~ N_Z(0, (stddev / grid)^2). Non-finite values are
// FEDMESH_CHECKed (callers clip first); values whose grid index exceeds 2^62
// are too.
void add_grid_gaussian_noise(std::span<float> values, double stddev, double grid, NoiseSource& source);
// The same on values held in double.
void add_grid_gaussian_noise(std::span<double> values, double stddev, double grid, NoiseSource& source);

}  // namespace fedmesh::crypto
