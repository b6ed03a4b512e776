// Secure aggregation's arithmetic (crypto/masking.h) on fixed vectors and
// its properties:
// - GF(2^8) products from FIPS-197 ({57}{83} = {c1}, {53}{ca} = {01});
// - Shamir: a hand-computed 2-of-3 vector (secret 0x42, coefficient 0x07:
//   shares 0x45, 0x4c, 0x4b), any t of n shares reconstruct, t - 1 do not,
//   bad share sets are refused;
// - the mask PRG is ChaCha20: RFC 8439 A.1 test vector #1 (zero key and
//   nonce: keystream 76 b8 e0 ad a0 f1 3d 90 ...);
// - pairwise seeds agree on both sides and differ per session;
// - pairwise masks cancel in the sum of 5 sites exactly (mod 2^32), also
//   after a site dropped out and the survivors' masks with it are removed;
// - fixed-point words add up to the fixed point of the sum.
#include <gtest/gtest.h>
#include <sodium.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "crypto/keys.h"
#include "crypto/masking.h"

namespace fedmesh::crypto {
namespace {

Seed filled(uint8_t byte) {
  Seed s;
  s.fill(byte);
  return s;
}

TEST(Masking, Gf256ProductsMatchFips197) {
  EXPECT_EQ(gf256_multiply(0x57, 0x83), 0xc1);
  EXPECT_EQ(gf256_multiply(0x53, 0xca), 0x01);
  EXPECT_EQ(gf256_multiply(0x57, 0x13), 0xfe);
  EXPECT_EQ(gf256_multiply(0x00, 0x9a), 0x00);
}

TEST(Masking, ShamirFixedVector) {
  const std::vector<Seed> coefficients = {filled(0x07)};
  const std::vector<ShamirShare> shares = shamir_split_with(filled(0x42), coefficients, 3).value();
  ASSERT_EQ(shares.size(), 3u);
  EXPECT_EQ(shares[0].x, 1);
  EXPECT_EQ(shares[0].y, filled(0x45));
  EXPECT_EQ(shares[1].y, filled(0x4c));
  EXPECT_EQ(shares[2].y, filled(0x4b));
  const std::vector<ShamirShare> pair = {shares[2], shares[0]};
  EXPECT_EQ(shamir_combine(pair).value(), filled(0x42));
}

TEST(Masking, AnyThresholdOfSharesReconstructsAndFewerDoNot) {
  Seed secret;
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(i * 37 + 11);
  const std::vector<ShamirShare> shares = shamir_split(secret, 3, 5).value();
  int subsets = 0;
  for (int a = 0; a < 5; ++a) {
    for (int b = a + 1; b < 5; ++b) {
      for (int c = b + 1; c < 5; ++c) {
        const std::vector<ShamirShare> three = {shares[static_cast<size_t>(a)], shares[static_cast<size_t>(b)],
                                                shares[static_cast<size_t>(c)]};
        EXPECT_EQ(shamir_combine(three).value(), secret);
        ++subsets;
      }
      const std::vector<ShamirShare> two = {shares[static_cast<size_t>(a)], shares[static_cast<size_t>(b)]};
      EXPECT_NE(shamir_combine(two).value(), secret) << "2 of a 3-of-5 sharing must not reveal the secret";
    }
  }
  EXPECT_EQ(subsets, 10);
  EXPECT_EQ(shamir_combine(shares).value(), secret) << "all five";
  EXPECT_FALSE(shamir_split(secret, 0, 5).is_ok());
  EXPECT_FALSE(shamir_split(secret, 6, 5).is_ok());
  EXPECT_FALSE(shamir_split(secret, 2, 256).is_ok());
  EXPECT_FALSE(shamir_combine(std::span<const ShamirShare>{}).is_ok());
  const std::vector<ShamirShare> twice = {shares[0], shares[0], shares[1]};
  EXPECT_NE(shamir_combine(twice).status().message().find("twice"), std::string::npos);
}

TEST(Masking, TheMaskIsTheChaCha20Keystream) {
  // RFC 8439, A.1, test vector #1: key 0, nonce 0, block 0.
  const std::vector<uint32_t> mask = expand_mask(Seed{}, 4);
  EXPECT_EQ(mask, (std::vector<uint32_t>{0xade0b876u, 0x903df1a0u, 0xe56a5d40u, 0x28bd8653u}));
  EXPECT_EQ(expand_mask(filled(1), 1000), expand_mask(filled(1), 1000));
  EXPECT_NE(expand_mask(filled(1), 8), expand_mask(filled(2), 8));
}

TEST(Masking, PairwiseSeedsAgreeOnBothSides) {
  ensure_sodium();
  std::array<uint8_t, 32> a_public{}, a_secret{}, b_public{}, b_secret{};
  crypto_box_keypair(a_public.data(), a_secret.data());
  crypto_box_keypair(b_public.data(), b_secret.data());
  const Seed ab = pairwise_seed(a_secret, b_public, "session-1", "site-a", "site-b").value();
  const Seed ba = pairwise_seed(b_secret, a_public, "session-1", "site-b", "site-a").value();
  EXPECT_EQ(ab, ba);
  EXPECT_NE(pairwise_seed(a_secret, b_public, "session-2", "site-a", "site-b").value(), ab) << "a fresh session, fresh masks";
  EXPECT_FALSE(pairwise_seed(a_secret, b_public, "s", "site-a", "site-a").is_ok());
  const std::array<uint8_t, 32> zero{};  // a low-order point
  EXPECT_FALSE(pairwise_seed(a_secret, zero, "s", "site-a", "site-b").is_ok());
}

TEST(Masking, PairwiseMasksCancelInTheSumAlsoAfterADropout) {
  constexpr int kSites = 5;
  constexpr size_t kWords = 1000;
  // Seeds by pattern: s_ij for i < j, and each site's self mask b_i.
  const auto pair_seed = [](int i, int j) { return filled(static_cast<uint8_t>(16 * std::min(i, j) + std::max(i, j))); };
  std::vector<std::vector<uint32_t>> inputs(kSites), masked(kSites);
  for (int i = 0; i < kSites; ++i) {
    inputs[static_cast<size_t>(i)] = expand_mask(filled(static_cast<uint8_t>(200 + i)), kWords);  // any values
    std::vector<uint32_t> y = inputs[static_cast<size_t>(i)];
    apply_mask(y, filled(static_cast<uint8_t>(100 + i)), +1);  // self mask
    for (int j = 0; j < kSites; ++j) {
      if (j != i) apply_mask(y, pair_seed(i, j), j > i ? +1 : -1);
    }
    masked[static_cast<size_t>(i)] = y;
  }
  const auto sum_of = [&](const std::vector<int>& sites, const std::vector<std::vector<uint32_t>>& vectors) {
    std::vector<uint32_t> total(kWords, 0);
    for (const int i : sites) {
      for (size_t k = 0; k < kWords; ++k) total[k] += vectors[static_cast<size_t>(i)][k];
    }
    return total;
  };
  // Everyone: the pairwise masks cancel; removing the self masks leaves the sum.
  std::vector<uint32_t> all = sum_of({0, 1, 2, 3, 4}, masked);
  for (int i = 0; i < kSites; ++i) apply_mask(all, filled(static_cast<uint8_t>(100 + i)), -1);
  EXPECT_EQ(all, sum_of({0, 1, 2, 3, 4}, inputs));
  // Site 3 dropped before sending: the survivors' masks with it are removed
  // (their seeds reconstructed from shares in the protocol).
  std::vector<uint32_t> survivors = sum_of({0, 1, 2, 4}, masked);
  for (const int i : {0, 1, 2, 4}) {
    apply_mask(survivors, filled(static_cast<uint8_t>(100 + i)), -1);
    apply_mask(survivors, pair_seed(i, 3), 3 > i ? -1 : +1);
  }
  EXPECT_EQ(survivors, sum_of({0, 1, 2, 4}, inputs));
  EXPECT_NE(masked[0], inputs[0]) << "a masked update is not the update";
}

TEST(Masking, FixedPointWordsSumToTheFixedPointOfTheSum) {
  const std::vector<float> values = {0.25f, -1.5f, 3.0e-4f, -0.75f, 2.0f, 9.0f};  // 9 is clipped to 4
  uint32_t total = 0;
  double expected = 0.0;
  for (const float v : values) {
    total += to_fixed_point(v, 4.0f, 20);
    expected += std::clamp(static_cast<double>(v), -4.0, 4.0);
  }
  EXPECT_NEAR(from_fixed_point(total, 20), expected, values.size() * std::ldexp(0.5, -20));
  EXPECT_EQ(from_fixed_point(to_fixed_point(-1.5f, 4.0f, 20), 20), -1.5);
}

}  // namespace
}  // namespace fedmesh::crypto
