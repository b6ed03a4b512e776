#include "crypto/dp_noise.h"

#include <sodium.h>

#include <cmath>
#include <cstring>

#include "base/status.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

namespace {

using u128 = unsigned __int128;

constexpr u128 kU64Max = ~uint64_t{0};

// Bernoulli(exp(-numerator / denominator)) for numerator <= denominator
// (gamma in [0, 1]): K = 1; while Bernoulli(gamma / K) K++; return K odd.
// Bernoulli(gamma / K) is drawn as Bernoulli(gamma) and Bernoulli(1 / K).
bool bernoulli_exp_minus_at_most_one(NoiseSource& source, u128 numerator, u128 denominator) {
  uint64_t k = 1;
  for (;;) {
    if (!bernoulli_fraction(source, numerator, denominator)) break;
    if (k > 1 && !bernoulli_fraction(source, 1, k)) break;
    ++k;
  }
  return (k & 1) == 1;
}

uint64_t integer_sqrt(uint64_t x) {
  uint64_t r = static_cast<uint64_t>(std::sqrt(static_cast<double>(x)));
  while (r > 0 && static_cast<u128>(r) * r > x) --r;
  while (static_cast<u128>(r + 1) * (r + 1) <= x) ++r;
  return r;
}

}  // namespace

SecureNoiseSource::SecureNoiseSource() { ensure_sodium(); }

uint64_t SecureNoiseSource::next_u64() {
  if (next_ == buffer_.size()) {
    // A ChaCha20 stream under a fresh 256-bit key from the OS CSPRNG for
    // every buffer: libsodium's own construction, without a system call per word.
    std::array<unsigned char, randombytes_SEEDBYTES> key{};
    randombytes_buf(key.data(), key.size());
    randombytes_buf_deterministic(buffer_.data(), sizeof buffer_, key.data());
    sodium_memzero(key.data(), key.size());
    next_ = 0;
  }
  const uint64_t word = buffer_[next_];
  buffer_[next_++] = 0;
  return word;
}

u128 uniform_below(NoiseSource& source, u128 bound) {
  FEDMESH_CHECK(bound > 0, "uniform_below needs a positive bound");
  if (bound <= kU64Max) {
    // Lemire's multiply-and-reject.
    const uint64_t b = static_cast<uint64_t>(bound);
    u128 m = static_cast<u128>(source.next_u64()) * b;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < b) {
      const uint64_t threshold = (0 - b) % b;
      while (low < threshold) {
        m = static_cast<u128>(source.next_u64()) * b;
        low = static_cast<uint64_t>(m);
      }
    }
    return m >> 64;
  }
  // 128 bits masked to the bound's width, rejected at or above it (fewer than 2 tries expected).
  const u128 top = bound - 1;  // at least 2^64 here: its high word is not zero
  const int width = 128 - __builtin_clzll(static_cast<uint64_t>(top >> 64));
  const u128 mask = width == 128 ? ~u128{0} : ((u128{1} << width) - 1);
  for (;;) {
    const u128 x = ((static_cast<u128>(source.next_u64()) << 64) | source.next_u64()) & mask;
    if (x < bound) return x;
  }
}

bool bernoulli_fraction(NoiseSource& source, u128 numerator, u128 denominator) {
  FEDMESH_CHECK(denominator > 0 && numerator <= denominator, "bernoulli_fraction needs 0 <= p <= 1");
  if (numerator == denominator) return true;
  if (numerator == 0) return false;
  return uniform_below(source, denominator) < numerator;
}

bool bernoulli_exp_minus(NoiseSource& source, u128 numerator, u128 denominator) {
  FEDMESH_CHECK(denominator > 0, "bernoulli_exp_minus needs a positive denominator");
  // exp(-gamma) = exp(-1)^floor(gamma) x exp(-(gamma - floor(gamma))).
  const u128 whole = numerator < denominator ? 0 : numerator / denominator;
  for (u128 i = 0; i < whole; ++i) {
    if (!bernoulli_exp_minus_at_most_one(source, 1, 1)) return false;
  }
  return bernoulli_exp_minus_at_most_one(source, numerator - whole * denominator, denominator);
}

int64_t discrete_laplace(NoiseSource& source, uint64_t scale) {
  FEDMESH_CHECK(scale >= 1, "discrete_laplace needs a scale of at least 1");
  for (;;) {
    const uint64_t u = static_cast<uint64_t>(uniform_below(source, scale));
    if (!bernoulli_exp_minus(source, u, scale)) continue;
    uint64_t v = 0;
    while (bernoulli_exp_minus_at_most_one(source, 1, 1)) ++v;
    const u128 x = static_cast<u128>(u) + static_cast<u128>(scale) * v;
    const bool negative = (source.next_u64() & 1) == 1;
    if (negative && x == 0) continue;
    // x above 2^62 has probability below exp(-2^62 / scale): never, for any scale this library uses.
    if (x > (u128{1} << 62)) continue;
    return negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
  }
}

DiscreteGaussian::DiscreteGaussian(double sigma) {
  FEDMESH_CHECK(std::isfinite(sigma) && sigma >= 0x1.0p-4 && sigma <= kMaxSigma,
                "the discrete Gaussian's sigma must lie in [2^-4, 2^26]");
  const double variance = sigma * sigma;
  int exponent = 0;
  std::frexp(variance, &exponent);  // variance = f x 2^exponent, f in [0.5, 1)
  const int floor_log2 = exponent - 1;
  const int shift = floor_log2 >= 40 ? 0 : 40 - floor_log2;  // n in [2^40, 2^41) below 2^40
  denominator_ = uint64_t{1} << shift;
  numerator_ = static_cast<uint64_t>(std::llround(std::ldexp(variance, shift)));
  scale_ = integer_sqrt(numerator_ / denominator_) + 1;
}

double DiscreteGaussian::variance() const {
  return static_cast<double>(numerator_) / static_cast<double>(denominator_);
}

int64_t DiscreteGaussian::sample(NoiseSource& source) const {
  // CKS 2020, Algorithm 3: Y ~ discrete Laplace of scale t, kept with
  // probability exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)). With sigma^2 = n / d:
  // gamma = (|Y| t d - n)^2 / (2 n d t^2).
  const u128 n = numerator_, d = denominator_, t = scale_;
  const u128 denominator = 2 * n * d * t * t;  // below 2^107 for sigma in [2^-4, 2^26]
  for (;;) {
    const int64_t y = discrete_laplace(source, scale_);
    const u128 magnitude = static_cast<u128>(y < 0 ? -static_cast<__int128>(y) : static_cast<__int128>(y));
    // |Y| t d must stay below 2^64 for gamma's numerator to fit: true for
    // |Y| <= 2^11 t (t^2 d < 2^53). A larger Y (probability below e^-2048)
    // is rejected; its acceptance probability is below e^-(2^21).
    if (magnitude > (t << 11)) continue;
    const u128 scaled = magnitude * t * d;
    const u128 difference = scaled >= n ? scaled - n : n - scaled;
    if (bernoulli_exp_minus(source, difference * difference, denominator)) return y;
  }
}

double noise_grid(double sensitivity, double stddev) {
  FEDMESH_CHECK(std::isfinite(sensitivity) && sensitivity > 0 && std::isfinite(stddev) && stddev > 0,
                "the noise grid needs a positive, finite sensitivity and standard deviation");
  int exponent = 0;
  std::frexp(std::min(sensitivity, stddev), &exponent);  // floor(log2) = exponent - 1
  int grid_exponent = exponent - 1 - 20;
  while (stddev / std::ldexp(1.0, grid_exponent) > DiscreteGaussian::kMaxSigma) ++grid_exponent;
  return std::ldexp(1.0, grid_exponent);
}

namespace {

template <class T>
void add_noise_on_grid(std::span<T> values, double stddev, double grid, NoiseSource& source) {
  int exponent = 0;
  FEDMESH_CHECK(grid > 0 && std::frexp(grid, &exponent) == 0.5, "the noise grid must be a power of two");
  const DiscreteGaussian gaussian(stddev / grid);
  for (T& value : values) {
    const double index = static_cast<double>(value) / grid;  // exact: the grid is a power of two
    FEDMESH_CHECK(std::isfinite(index) && std::fabs(index) < 0x1.0p62, "a value to noise is not finite or too large for its grid");
    const int64_t noised = std::llround(index) + gaussian.sample(source);
    // A function of the noised integer alone: on the grid, whatever the input's low bits were.
    value = static_cast<T>(static_cast<double>(noised) * grid);
  }
}

}  // namespace

void add_grid_gaussian_noise(std::span<float> values, double stddev, double grid, NoiseSource& source) {
  add_noise_on_grid(values, stddev, grid, source);
}

void add_grid_gaussian_noise(std::span<double> values, double stddev, double grid, NoiseSource& source) {
  add_noise_on_grid(values, stddev, grid, source);
}

}  // namespace fedmesh::crypto
