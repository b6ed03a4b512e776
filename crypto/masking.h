// The arithmetic of secure aggregation (Bonawitz et al., CCS 2017), its
// building blocks: Shamir t-of-n secret sharing of 32-byte secrets,
// the cryptographic expansion of a 256-bit seed into a mask in Z_2^32
// (ChaCha20, libsodium's IETF variant), pairwise seeds agreed by X25519,
// and fixed-point quantization of an update into Z_2^32. Pairwise masks
// cancel in the sum: site i adds PRG(s_ij) for every peer j > i and
// subtracts it for every j < i, so Σ masked = Σ inputs (+ the self masks,
// which the survivors' shares remove). crypto/secure_aggregation.h is the
// protocol that drives these.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace fedmesh::crypto {

using Seed = std::array<uint8_t, 32>;

// ---- Shamir secret sharing over GF(2^8) (the AES field, x^8 + x^4 + x^3 + x + 1),
// byte by byte: share x of a secret byte s is p(x), p(0) = s, degree t - 1.

struct ShamirShare {
  uint8_t x = 0;  // 1..255: the holder's evaluation point
  Seed y{};
};

uint8_t gf256_multiply(uint8_t a, uint8_t b);

// n shares (points 1..n) of which any t reconstruct `secret`; t - 1 reveal
// nothing. The polynomial's other coefficients are drawn from libsodium's
// randombytes. kInvalidArgument unless 1 <= t <= n <= 255.
Result<std::vector<ShamirShare>> shamir_split(const Seed& secret, int threshold, int shares);
// The same with the coefficients given (t - 1 of them, each a Seed: byte k
// of coefficient j is the x^(j+1) coefficient of byte k's polynomial): for
// fixed test vectors.
Result<std::vector<ShamirShare>> shamir_split_with(const Seed& secret, std::span<const Seed> coefficients, int shares);
// Lagrange interpolation at 0 from exactly the shares given (at least t of
// them, or the result is not the secret). kInvalidArgument for no share, a
// point 0 or a point given twice.
Result<Seed> shamir_combine(std::span<const ShamirShare> shares);

// ---- masks

// `count` words of Z_2^32 from the ChaCha20 (IETF) keystream of `seed` with
// a zero nonce, little-endian: the same seed gives the same mask anywhere.
std::vector<uint32_t> expand_mask(const Seed& seed, size_t count);

// The pairwise seed of two sites: BLAKE2b-256 over the X25519 shared secret
// of one's secret key and the other's public key, the session id and the
// two names in sorted order; both sides compute the same one.
Result<Seed> pairwise_seed(std::span<const uint8_t> my_secret_key, std::span<const uint8_t> their_public_key,
                           std::string_view session, std::string_view me, std::string_view them);

// values (mod 2^32) += sign * expand_mask(seed), sign +1 or -1.
void apply_mask(std::span<uint32_t> values, const Seed& seed, int sign);
// The same for several seeds in one pass over `values` (one sign each).
void apply_masks(std::span<uint32_t> values, std::span<const Seed> seeds, std::span<const int> signs);

// Fixed point: v clipped to [-clip, clip], round(v * 2^fraction_bits) as a
// two's-complement 32-bit word. A sum of n such words decodes exactly (up
// to the rounding of each) while n * clip * 2^fraction_bits < 2^31.
uint32_t to_fixed_point(float value, float clip, int fraction_bits);
double from_fixed_point(uint32_t word, int fraction_bits);
// A whole update: scaled to L2 norm `clip` when above it, then each value
// to fixed point as to_fixed_point does (clip * 2^fraction_bits < 2^31).
std::vector<uint32_t> quantize_clipped(std::span<const float> values, float clip, int fraction_bits);

}  // namespace fedmesh::crypto
