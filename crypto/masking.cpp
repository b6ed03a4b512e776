#include "crypto/masking.h"

#include <sodium.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "crypto/keys.h"

namespace fedmesh::crypto {

uint8_t gf256_multiply(uint8_t a, uint8_t b) {
  uint8_t product = 0;
  for (int bit = 0; bit < 8; ++bit) {
    if (b & 1) product ^= a;
    const bool carry = (a & 0x80) != 0;
    a = static_cast<uint8_t>(a << 1);
    if (carry) a ^= 0x1b;  // x^8 = x^4 + x^3 + x + 1
    b >>= 1;
  }
  return product;
}

namespace {

uint8_t gf256_inverse(uint8_t a) {
  // a^254 = a^-1 in GF(2^8) (a != 0).
  uint8_t result = 1, base = a;
  for (int e = 254; e > 0; e >>= 1) {
    if (e & 1) result = gf256_multiply(result, base);
    base = gf256_multiply(base, base);
  }
  return result;
}

}  // namespace

Result<std::vector<ShamirShare>> shamir_split_with(const Seed& secret, std::span<const Seed> coefficients, int shares) {
  const int threshold = static_cast<int>(coefficients.size()) + 1;
  if (threshold < 1 || shares < threshold || shares > 255) {
    return invalid_argument("Shamir sharing needs 1 <= t <= n <= 255 (t " + std::to_string(threshold) + ", n " +
                            std::to_string(shares) + ")");
  }
  std::vector<ShamirShare> out(static_cast<size_t>(shares));
  for (int i = 0; i < shares; ++i) {
    const uint8_t x = static_cast<uint8_t>(i + 1);
    out[static_cast<size_t>(i)].x = x;
    for (size_t k = 0; k < secret.size(); ++k) {
      // Horner: ((c_{t-1} x + c_{t-2}) x + ... + c_1) x + s.
      uint8_t y = 0;
      for (size_t j = coefficients.size(); j-- > 0;) y = gf256_multiply(static_cast<uint8_t>(y ^ coefficients[j][k]), x);
      out[static_cast<size_t>(i)].y[k] = static_cast<uint8_t>(y ^ secret[k]);
    }
  }
  return out;
}

Result<std::vector<ShamirShare>> shamir_split(const Seed& secret, int threshold, int shares) {
  if (threshold < 1 || shares < threshold || shares > 255) {
    return invalid_argument("Shamir sharing needs 1 <= t <= n <= 255 (t " + std::to_string(threshold) + ", n " +
                            std::to_string(shares) + ")");
  }
  ensure_sodium();
  std::vector<Seed> coefficients(static_cast<size_t>(threshold - 1));
  for (Seed& c : coefficients) randombytes_buf(c.data(), c.size());
  Result<std::vector<ShamirShare>> out = shamir_split_with(secret, coefficients, shares);
  for (Seed& c : coefficients) sodium_memzero(c.data(), c.size());
  return out;
}

Result<Seed> shamir_combine(std::span<const ShamirShare> shares) {
  if (shares.empty()) return invalid_argument("no Shamir share to combine");
  for (size_t i = 0; i < shares.size(); ++i) {
    if (shares[i].x == 0) return invalid_argument("a Shamir share at point 0 (points are 1..255)");
    for (size_t j = 0; j < i; ++j) {
      if (shares[j].x == shares[i].x) return invalid_argument("Shamir point " + std::to_string(shares[i].x) + " given twice");
    }
  }
  Seed secret{};
  for (size_t i = 0; i < shares.size(); ++i) {
    // Lagrange basis at 0: Π_{j != i} x_j / (x_j - x_i); minus is xor.
    uint8_t numerator = 1, denominator = 1;
    for (size_t j = 0; j < shares.size(); ++j) {
      if (j == i) continue;
      numerator = gf256_multiply(numerator, shares[j].x);
      denominator = gf256_multiply(denominator, static_cast<uint8_t>(shares[j].x ^ shares[i].x));
    }
    const uint8_t basis = gf256_multiply(numerator, gf256_inverse(denominator));
    for (size_t k = 0; k < secret.size(); ++k) secret[k] ^= gf256_multiply(basis, shares[i].y[k]);
  }
  return secret;
}

std::vector<uint32_t> expand_mask(const Seed& seed, size_t count) {
  ensure_sodium();
  std::vector<uint8_t> bytes(count * 4, 0);
  std::array<uint8_t, crypto_stream_chacha20_ietf_NONCEBYTES> nonce{};
  crypto_stream_chacha20_ietf(bytes.data(), bytes.size(), nonce.data(), seed.data());
  std::vector<uint32_t> words(count);
  for (size_t i = 0; i < count; ++i) {
    words[i] = static_cast<uint32_t>(bytes[4 * i]) | static_cast<uint32_t>(bytes[4 * i + 1]) << 8 |
               static_cast<uint32_t>(bytes[4 * i + 2]) << 16 | static_cast<uint32_t>(bytes[4 * i + 3]) << 24;
  }
  return words;
}

Result<Seed> pairwise_seed(std::span<const uint8_t> my_secret_key, std::span<const uint8_t> their_public_key,
                           std::string_view session, std::string_view me, std::string_view them) {
  ensure_sodium();
  if (my_secret_key.size() != crypto_scalarmult_SCALARBYTES || their_public_key.size() != crypto_scalarmult_BYTES) {
    return invalid_argument("pairwise seed: X25519 keys are 32 bytes");
  }
  if (me == them) return invalid_argument("pairwise seed: a site has no pair with itself");
  std::array<uint8_t, crypto_scalarmult_BYTES> shared{};
  if (crypto_scalarmult(shared.data(), my_secret_key.data(), their_public_key.data()) != 0) {
    return invalid_argument("pairwise seed: the peer's public key is a low-order point");
  }
  const std::string_view first = std::min(me, them), second = std::max(me, them);
  crypto_generichash_state state;
  crypto_generichash_init(&state, nullptr, 0, 32);
  const auto absorb = [&state](std::string_view text) {
    const uint64_t length = text.size();
    crypto_generichash_update(&state, reinterpret_cast<const uint8_t*>(&length), sizeof length);
    crypto_generichash_update(&state, reinterpret_cast<const uint8_t*>(text.data()), text.size());
  };
  absorb("fedmesh-secagg-pairwise-v1");
  crypto_generichash_update(&state, shared.data(), shared.size());
  absorb(session);
  absorb(first);
  absorb(second);
  Seed seed{};
  crypto_generichash_final(&state, seed.data(), seed.size());
  sodium_memzero(shared.data(), shared.size());
  return seed;
}

static_assert(std::endian::native == std::endian::little, "masks read the keystream as little-endian words");

void apply_masks(std::span<uint32_t> values, std::span<const Seed> seeds, std::span<const int> signs) {
  // Block by block (16 KiB: 256 ChaCha20 blocks; block k starts at counter
  // 256 k), every seed's keystream for the block is added while the block
  // of values stays in cache, and no buffer of the vector's size is needed.
  FEDMESH_CHECK(seeds.size() == signs.size(), "apply_masks: one sign per seed");
  ensure_sodium();
  constexpr size_t kWords = 4096;
  static const std::array<uint8_t, kWords * 4> kZeros{};
  alignas(64) std::array<uint32_t, kWords> stream{};
  std::array<uint8_t, crypto_stream_chacha20_ietf_NONCEBYTES> nonce{};
  for (size_t start = 0; start < values.size(); start += kWords) {
    const size_t count = std::min(kWords, values.size() - start);
    const auto counter = static_cast<uint32_t>(start / kWords * (kWords * 4 / 64));
    uint32_t* __restrict out = values.data() + start;
    for (size_t s = 0; s < seeds.size(); ++s) {
      // The keystream's bytes read as little-endian words (this host's order).
      crypto_stream_chacha20_ietf_xor_ic(reinterpret_cast<uint8_t*>(stream.data()), kZeros.data(), count * 4,
                                         nonce.data(), counter, seeds[s].data());
      const uint32_t* __restrict word = stream.data();
      if (signs[s] >= 0) {
        for (size_t i = 0; i < count; ++i) out[i] += word[i];
      } else {
        for (size_t i = 0; i < count; ++i) out[i] -= word[i];
      }
    }
  }
  sodium_memzero(stream.data(), sizeof stream);
}

void apply_mask(std::span<uint32_t> values, const Seed& seed, int sign) {
  apply_masks(values, std::span<const Seed>(&seed, 1), std::span<const int>(&sign, 1));
}

uint32_t to_fixed_point(float value, float clip, int fraction_bits) {
  FEDMESH_CHECK(std::isfinite(value), "to_fixed_point: the caller refuses non-finite values first");
  const double clipped = std::clamp(static_cast<double>(value), -static_cast<double>(clip), static_cast<double>(clip));
  const int64_t fixed = std::llround(std::ldexp(clipped, fraction_bits));
  return static_cast<uint32_t>(fixed);
}

std::vector<uint32_t> quantize_clipped(std::span<const float> delta, float clip, int fraction_bits) {
  // As to_fixed_point value by value (clip, then round half away
  // from zero), with the scale folded into one multiplication.
  double squares = 0.0;
  for (float v : delta) squares += static_cast<double>(v) * v;
  const double norm = std::sqrt(squares);
  const double one = std::ldexp(1.0, fraction_bits);
  const double scale = (norm > clip ? clip / norm : 1.0) * one;
  const double limit = static_cast<double>(clip) * one;
  FEDMESH_CHECK(limit < std::ldexp(1.0, 31) - 1.0 && clip > 0.0f, "quantize_clipped: clip x 2^fraction_bits must be in (0, 2^31)");
  // |y| <= limit < 2^31 (FEDMESH_CHECK above), so int32 holds every word.
  std::vector<uint32_t> out(delta.size());
  const float* __restrict in = delta.data();
  uint32_t* __restrict words = out.data();
  for (size_t i = 0; i < delta.size(); ++i) {
    const double y = std::min(std::max(static_cast<double>(in[i]) * scale, -limit), limit);
    words[i] = static_cast<uint32_t>(static_cast<int32_t>(y + std::copysign(0.5, y)));
  }
  return out;
}

double from_fixed_point(uint32_t word, int fraction_bits) {
  return std::ldexp(static_cast<double>(static_cast<int32_t>(word)), -fraction_bits);
}

}  // namespace fedmesh::crypto
