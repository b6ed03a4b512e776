// A seeded random number generator whose streams are identical on every
// platform and standard library (std::*_distribution are not), so that a seed
// replays a run exactly.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>

namespace fedmesh {

// xoshiro256** seeded through SplitMix64.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { reseed(seed); }

  // Everything that decides the rest of the stream, for checkpoints.
  struct State {
    std::array<uint64_t, 4> words{};
    double spare_normal = 0.0;
    bool has_spare_normal = false;
  };
  State state() const { return {{state_[0], state_[1], state_[2], state_[3]}, spare_normal_, has_spare_normal_}; }
  void set_state(const State& state) {
    for (size_t i = 0; i < 4; ++i) state_[i] = state.words[i];
    spare_normal_ = state.spare_normal;
    has_spare_normal_ = state.has_spare_normal;
  }

  void reseed(uint64_t seed) {
    uint64_t x = seed;
    for (auto& word : state_) word = splitmix64(x);
    has_spare_normal_ = false;
  }

  uint64_t next_u64() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 bits of randomness.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

  // Uniform integer in [0, bound), bound > 0, without modulo bias (Lemire).
  uint64_t below(uint64_t bound) {
    __uint128_t m = static_cast<__uint128_t>(next_u64()) * bound;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < bound) {
      const uint64_t threshold = -bound % bound;
      while (low < threshold) {
        m = static_cast<__uint128_t>(next_u64()) * bound;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }

  // Standard normal by the Box-Muller transform.
  double normal() {
    if (has_spare_normal_) {
      has_spare_normal_ = false;
      return spare_normal_;
    }
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    spare_normal_ = radius * std::sin(2.0 * M_PI * u2);
    has_spare_normal_ = true;
    return radius * std::cos(2.0 * M_PI * u2);
  }

  // Gamma(shape, 1) by Marsaglia and Tsang; shape > 0.
  double gamma(double shape) {
    if (shape < 1.0) {
      double u = uniform();
      while (u <= 0.0) u = uniform();
      return gamma(shape + 1.0) * std::pow(u, 1.0 / shape);
    }
    const double d = shape - 1.0 / 3.0;
    const double c = 1.0 / std::sqrt(9.0 * d);
    for (;;) {
      double x = normal();
      double v = 1.0 + c * x;
      if (v <= 0.0) continue;
      v = v * v * v;
      const double u = uniform();
      if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
      if (u > 0.0 && std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
    }
  }

  template <class T>
  void shuffle(std::span<T> items) {
    for (size_t i = items.size(); i > 1; --i) {
      std::swap(items[i - 1], items[below(i)]);
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static uint64_t splitmix64(uint64_t& x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  uint64_t state_[4];
  double spare_normal_ = 0.0;
  bool has_spare_normal_ = false;
};

// Derives a seed for one stream from a run's seed and a label (a site, a
// round, a purpose), so each stream is independent and reproducible.
inline uint64_t mix_seed(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

}  // namespace fedmesh
