// bf16 and fp16 conversions (kernels/half.h) and the bulk copies built on them
// (kernels/convert.h). Conversions are exact operations, so every assertion
// here is bit-exact: there is no tolerance anywhere in this file.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "base/random.h"
#include "kernels/convert.h"
#include "kernels/half.h"
#include "kernels/half_arrays.h"
#include "kernels/tensor.h"

namespace fedmesh {
namespace {

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float float_of(uint32_t bits) { return std::bit_cast<float>(bits); }

bool is_bf16_nan(uint16_t bits) { return (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0; }
bool is_fp16_nan(uint16_t bits) { return (bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0; }

// The bf16 nearest to finite x, ties to even, decided by exact arithmetic in
// double: x and both bf16 candidates have at most 24 significant bits within a
// factor of two of each other, so the two distances are exact in double.
uint16_t bf16_oracle(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  const uint16_t low = static_cast<uint16_t>(magnitude >> 16);  // truncation toward zero
  const uint16_t high = static_cast<uint16_t>(low + 1);
  const double value = std::fabs(static_cast<double>(x));
  const double low_value = static_cast<double>(float_of(static_cast<uint32_t>(low) << 16));
  // The successor of the largest finite bf16 is Inf; for rounding, IEEE treats
  // it as the next power of two, 2^128 (exact in double).
  const double high_value =
      high == 0x7f80u ? std::ldexp(1.0, 128) : static_cast<double>(float_of(static_cast<uint32_t>(high) << 16));
  const double down = value - low_value, up = high_value - value;
  uint16_t chosen;
  if (down < up) {
    chosen = low;
  } else if (up < down) {
    chosen = high;
  } else {
    chosen = (low & 1u) == 0 ? low : high;
  }
  return static_cast<uint16_t>(sign | chosen);
}

// A float with a random sign, an exponent drawn uniformly from
// [min_exponent, max_exponent] (biased, 0 = float subnormal) and random mantissa.
float random_float(Rng& rng, uint32_t min_exponent, uint32_t max_exponent) {
  const uint32_t sign = static_cast<uint32_t>(rng.below(2)) << 31;
  const uint32_t exponent = min_exponent + static_cast<uint32_t>(rng.below(max_exponent - min_exponent + 1));
  const uint32_t mantissa = static_cast<uint32_t>(rng.below(1u << 23));
  return float_of(sign | (exponent << 23) | mantissa);
}

// ---------------------------------------------------------------- bf16 ----

TEST(Bf16, EveryNonNanPatternRoundTripsExactly) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const bf16 h{static_cast<uint16_t>(b)};
    const float f = to_float(h);
    EXPECT_EQ(bits_of(f), b << 16) << "widening is a shift: pattern " << b;
    if (is_bf16_nan(h.bits)) continue;
    ASSERT_EQ(to_bf16(f).bits, h.bits) << "pattern 0x" << std::hex << b;
  }
}

TEST(Bf16, TiesRoundToEven) {
  // 1 + 2^-8 is exactly halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81).
  EXPECT_EQ(to_bf16(float_of(0x3f808000u)).bits, 0x3f80u);
  // Halfway between 0x3f81 (odd) and 0x3f82 (even) goes up.
  EXPECT_EQ(to_bf16(float_of(0x3f818000u)).bits, 0x3f82u);
  EXPECT_EQ(to_bf16(float_of(0xbf818000u)).bits, 0xbf82u);  // and symmetric in sign
  // One float ulp either side of a tie is no longer a tie.
  EXPECT_EQ(to_bf16(float_of(0x3f808001u)).bits, 0x3f81u);
  EXPECT_EQ(to_bf16(float_of(0x3f807fffu)).bits, 0x3f80u);
  EXPECT_EQ(to_bf16(float_of(0x3f817fffu)).bits, 0x3f81u);

  // Every tie, built explicitly from a random finite bf16 b as b's bits with
  // the first dropped bit set, lands on whichever of b, b+1 is even.
  Rng rng(11);
  for (int i = 0; i < 200000; ++i) {
    const uint16_t b = static_cast<uint16_t>(rng.below(0x7f7fu));  // finite, successor finite too
    const uint16_t sign = rng.below(2) ? 0x8000u : 0u;
    const float tie = float_of((static_cast<uint32_t>(sign | b) << 16) | 0x8000u);
    const uint16_t expected = static_cast<uint16_t>(sign | ((b & 1u) ? b + 1 : b));
    ASSERT_EQ(to_bf16(tie).bits, expected) << "tie above 0x" << std::hex << b;
  }
}

TEST(Bf16, OverflowLargestFiniteAndInfinity) {
  const float largest = float_of(0x7f7f0000u);  // (2 - 2^-7) * 2^127
  EXPECT_EQ(to_bf16(largest).bits, 0x7f7fu);
  EXPECT_EQ(to_bf16(-largest).bits, 0xff7fu);
  // Just below the halfway point to 2^128 stays finite; the halfway point is a
  // tie with an odd largest-finite, so it rounds up to Inf (as IEEE requires).
  EXPECT_EQ(to_bf16(float_of(0x7f7f7fffu)).bits, 0x7f7fu);
  EXPECT_EQ(to_bf16(float_of(0x7f7f8000u)).bits, 0x7f80u);
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);
  EXPECT_EQ(to_bf16(-std::numeric_limits<float>::max()).bits, 0xff80u);
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::infinity()).bits, 0x7f80u);
  EXPECT_EQ(to_bf16(-std::numeric_limits<float>::infinity()).bits, 0xff80u);
  EXPECT_TRUE(std::isinf(to_float(bf16{0x7f80u})));
}

TEST(Bf16, SubnormalsAndSignedZero) {
  // bf16 shares float's exponent range, so float subnormals with a zero low
  // half convert exactly, and the smallest bf16 subnormal is 2^-133.
  EXPECT_EQ(to_bf16(float_of(0x00010000u)).bits, 0x0001u);
  EXPECT_EQ(to_float(bf16{0x0001u}), std::ldexp(1.0f, -133));
  EXPECT_EQ(to_bf16(float_of(0x00008000u)).bits, 0x0000u);  // half of 2^-133: tie to even zero
  EXPECT_EQ(to_bf16(float_of(0x00008001u)).bits, 0x0001u);
  EXPECT_EQ(to_bf16(float_of(0x00018000u)).bits, 0x0002u);  // tie between 1 (odd) and 2
  EXPECT_EQ(to_bf16(float_of(0x807fffffu)).bits, 0x8080u);  // largest subnormal rounds up to -2^-126

  EXPECT_EQ(to_bf16(0.0f).bits, 0x0000u);
  EXPECT_EQ(to_bf16(-0.0f).bits, 0x8000u);
  EXPECT_TRUE(std::signbit(to_float(bf16{0x8000u})));
  EXPECT_EQ(to_float(bf16{0x8000u}), 0.0f);
  EXPECT_EQ(to_bf16(-std::numeric_limits<float>::denorm_min()).bits, 0x8000u);  // underflows to -0
}

TEST(Bf16, NanStaysNan) {
  // A NaN whose payload lives only in the dropped low bits must not turn into
  // Inf by truncation.
  for (uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7f80ffffu}) {
    const bf16 h = to_bf16(float_of(u));
    EXPECT_TRUE(is_bf16_nan(h.bits)) << std::hex << u << " -> " << h.bits;
    EXPECT_EQ(h.bits & 0x8000u, (u >> 16) & 0x8000u) << "sign kept";
    EXPECT_TRUE(std::isnan(to_float(h)));
  }
  EXPECT_TRUE(std::isnan(to_float(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Bf16, MatchesExactArithmeticOracle) {
  Rng rng(12);
  // Random floats spanning the whole exponent range, subnormals included.
  for (int i = 0; i < 3000000; ++i) {
    const float x = random_float(rng, 0, 254);
    ASSERT_EQ(to_bf16(x).bits, bf16_oracle(x)) << "x bits 0x" << std::hex << bits_of(x);
  }
  // Values within a few float ulps of a tie, where rounding mistakes live.
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t b = static_cast<uint32_t>(rng.below(0x7f7fu)) | (rng.below(2) ? 0x8000u : 0u);
    const uint32_t u = (b << 16) + 0x8000u - 3u + static_cast<uint32_t>(rng.below(7));
    const float x = float_of(u);
    ASSERT_EQ(to_bf16(x).bits, bf16_oracle(x)) << "x bits 0x" << std::hex << u;
  }
  // A stride through all 2^32 patterns (finite ones only).
  for (uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    const float x = float_of(static_cast<uint32_t>(u));
    if (!std::isfinite(x)) continue;
    ASSERT_EQ(to_bf16(x).bits, bf16_oracle(x)) << "x bits 0x" << std::hex << u;
  }
}

// ---------------------------------------------------------------- fp16 ----

TEST(Fp16, EveryNonNanPatternRoundTripsExactly) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const fp16 h{static_cast<uint16_t>(b)};
    if (is_fp16_nan(h.bits)) {
      EXPECT_TRUE(std::isnan(to_float(h)));
      continue;
    }
    ASSERT_EQ(to_fp16(to_float(h)).bits, h.bits) << "pattern 0x" << std::hex << b;
  }
}

TEST(Fp16, KnownValues) {
  EXPECT_EQ(to_fp16(1.0f).bits, 0x3c00u);
  EXPECT_EQ(to_fp16(-2.0f).bits, 0xc000u);
  EXPECT_EQ(to_fp16(0.5f).bits, 0x3800u);
  EXPECT_EQ(to_float(fp16{0x3555u}), 0x1.554p-2f);  // 0.333251953125
  EXPECT_EQ(to_fp16(1.0f / 3.0f).bits, 0x3555u);
}

TEST(Fp16, TiesRoundToEven) {
  // fp16 has 10 stored mantissa bits: near 1 the ulp is 2^-10.
  EXPECT_EQ(to_fp16(1.0f + 0x1p-11f).bits, 0x3c00u);            // halfway to 0x3c01: stay even
  EXPECT_EQ(to_fp16(1.0f + 3 * 0x1p-11f).bits, 0x3c02u);        // halfway 0x3c01..0x3c02: go to even
  EXPECT_EQ(to_fp16(-(1.0f + 3 * 0x1p-11f)).bits, 0xbc02u);
  EXPECT_EQ(to_fp16(std::nextafter(1.0f + 0x1p-11f, 2.0f)).bits, 0x3c01u);
  EXPECT_EQ(to_fp16(std::nextafter(1.0f + 3 * 0x1p-11f, 0.0f)).bits, 0x3c01u);
  // A tie that carries into the exponent: halfway between 2 - 2^-10 and 2.
  EXPECT_EQ(to_fp16(2.0f - 0x1p-11f).bits, 0x4000u);

  // Every tie between adjacent finite fp16 values (normal and subnormal),
  // computed exactly in float as the midpoint of the two.
  for (uint16_t b = 0; b < 0x7bffu; ++b) {
    for (const uint16_t sign : {uint16_t{0}, uint16_t{0x8000u}}) {
      const float low = to_float(fp16{static_cast<uint16_t>(sign | b)});
      const float high = to_float(fp16{static_cast<uint16_t>(sign | (b + 1))});
      const float tie = (low + high) * 0.5f;  // exact: 12 significant bits at most
      ASSERT_EQ(static_cast<double>(tie), (static_cast<double>(low) + high) / 2);
      const uint16_t expected = static_cast<uint16_t>(sign | ((b & 1u) ? b + 1 : b));
      ASSERT_EQ(to_fp16(tie).bits, expected) << "tie above 0x" << std::hex << b;
    }
  }
}

TEST(Fp16, OverflowAndLargestFinite) {
  EXPECT_EQ(to_fp16(65504.0f).bits, 0x7bffu);  // largest finite
  EXPECT_EQ(to_float(fp16{0x7bffu}), 65504.0f);
  EXPECT_EQ(to_fp16(-65504.0f).bits, 0xfbffu);
  // 65520 is halfway between 65504 (odd mantissa) and 65536 (= Inf): rounds to Inf.
  EXPECT_EQ(to_fp16(std::nextafter(65520.0f, 0.0f)).bits, 0x7bffu);
  EXPECT_EQ(to_fp16(65520.0f).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(-65520.0f).bits, 0xfc00u);
  EXPECT_EQ(to_fp16(65536.0f).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(1e30f).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(std::numeric_limits<float>::max()).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(std::numeric_limits<float>::infinity()).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(-std::numeric_limits<float>::infinity()).bits, 0xfc00u);
  EXPECT_TRUE(std::isinf(to_float(fp16{0x7c00u})));
  EXPECT_LT(to_float(fp16{0xfc00u}), 0.0f);
}

TEST(Fp16, Subnormals) {
  const float min_subnormal = 0x1p-24f;
  EXPECT_EQ(to_fp16(min_subnormal).bits, 0x0001u);
  EXPECT_EQ(to_float(fp16{0x0001u}), min_subnormal);
  EXPECT_EQ(to_float(fp16{0x8001u}), -min_subnormal);
  EXPECT_EQ(to_float(fp16{0x03ffu}), 1023 * min_subnormal);  // largest subnormal
  EXPECT_EQ(to_fp16(0x1p-14f).bits, 0x0400u);                // smallest normal
  // Rounding near the smallest subnormal: half of it is a tie with even zero.
  EXPECT_EQ(to_fp16(0x1p-25f).bits, 0x0000u);
  EXPECT_EQ(to_fp16(-0x1p-25f).bits, 0x8000u);
  EXPECT_EQ(to_fp16(std::nextafter(0x1p-25f, 1.0f)).bits, 0x0001u);
  EXPECT_EQ(to_fp16(std::nextafter(0x1p-25f, 0.0f)).bits, 0x0000u);
  EXPECT_EQ(to_fp16(1.5f * min_subnormal).bits, 0x0002u);  // tie between 1 and 2
  EXPECT_EQ(to_fp16(2.5f * min_subnormal).bits, 0x0002u);  // tie between 2 and 3
  EXPECT_EQ(to_fp16(0.75f * min_subnormal).bits, 0x0001u);
  EXPECT_EQ(to_fp16(0.25f * min_subnormal).bits, 0x0000u);
  // Halfway between the largest subnormal (odd) and the smallest normal.
  EXPECT_EQ(to_fp16(1023.5f * min_subnormal).bits, 0x0400u);
  EXPECT_EQ(to_fp16(std::nextafter(1023.5f * min_subnormal, 0.0f)).bits, 0x03ffu);
  // Float subnormals are far below fp16's range.
  EXPECT_EQ(to_fp16(std::numeric_limits<float>::denorm_min()).bits, 0x0000u);
}

TEST(Fp16, SignedZeroAndNan) {
  EXPECT_EQ(to_fp16(0.0f).bits, 0x0000u);
  EXPECT_EQ(to_fp16(-0.0f).bits, 0x8000u);
  EXPECT_TRUE(std::signbit(to_float(fp16{0x8000u})));
  EXPECT_EQ(to_float(fp16{0x8000u}), 0.0f);
  EXPECT_EQ(to_fp16(-1e-30f).bits, 0x8000u);  // underflow keeps the sign

  for (uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7f801fffu, 0x7fffffffu}) {
    const fp16 h = to_fp16(float_of(u));
    EXPECT_TRUE(is_fp16_nan(h.bits)) << std::hex << u << " -> " << h.bits;
    EXPECT_EQ(h.bits & 0x8000u, (u >> 16) & 0x8000u) << "sign kept";
    EXPECT_TRUE(std::isnan(to_float(h)));
  }
}

#if defined(__FLT16_MAX__)
// GCC's _Float16 (software conversions on plain x86-64) is IEEE binary16 with
// round-to-nearest-even: an independent oracle.
TEST(Fp16, WideningMatchesFloat16ForAllPatterns) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float expected = static_cast<float>(std::bit_cast<_Float16>(bits));
    const float actual = to_float(fp16{bits});
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(actual)) << std::hex << b;
      ASSERT_EQ(std::signbit(actual), std::signbit(expected)) << std::hex << b;
    } else {
      ASSERT_EQ(bits_of(actual), bits_of(expected)) << "pattern 0x" << std::hex << b;
    }
  }
}

TEST(Fp16, NarrowingMatchesFloat16) {
  Rng rng(16);
  const auto check = [](float x) {
    const uint16_t expected = std::bit_cast<uint16_t>(static_cast<_Float16>(x));
    const uint16_t actual = to_fp16(x).bits;
    if (std::isnan(x)) {
      ASSERT_TRUE(is_fp16_nan(actual));
    } else {
      ASSERT_EQ(actual, expected) << "x = " << x << " bits 0x" << std::hex << bits_of(x);
    }
  };
  // Exponents 2^-40 .. 2^20: below the subnormal range, through the normals, past overflow.
  for (int i = 0; i < 4000000; ++i) check(random_float(rng, 127 - 40, 127 + 20));
  // Arbitrary bit patterns (all exponents, Inf and NaN included).
  for (int i = 0; i < 1000000; ++i) check(float_of(static_cast<uint32_t>(rng.next_u64())));
  // Within a few float ulps of the midpoint between adjacent fp16 values.
  for (int i = 0; i < 1000000; ++i) {
    const uint16_t b = static_cast<uint16_t>(rng.below(0x7bffu));
    const float tie = (to_float(fp16{b}) + to_float(fp16{static_cast<uint16_t>(b + 1)})) * 0.5f;
    const float x = float_of(bits_of(tie) - 3u + static_cast<uint32_t>(rng.below(7)));
    check(rng.below(2) ? x : -x);
  }
}
#else
TEST(Fp16, Float16Oracle) { GTEST_SKIP() << "this compiler has no _Float16"; }
#endif

// ------------------------------------------------------- array conversion ----

// kernels/half_arrays.h converts whole arrays (with F16C/AVX2 where the CPU
// has them): the bits of half.h's element-wise functions, NaNs included, at
// every length and alignment.
TEST(HalfArrays, NarrowingGivesHalfHBitsForASweepOfAllPatterns) {
  SCOPED_TRACE(half_arrays_use_f16c() ? "F16C/AVX2" : "portable loops");
  // Every 1021st fp32 pattern (odd: every low-bit residue is visited),
  // plus the ranges where rounding decides: around 65504..65520 and the
  // subnormal boundary.
  std::vector<float> x;
  for (uint64_t u = 0; u <= 0xffffffffu; u += 1021) x.push_back(float_of(static_cast<uint32_t>(u)));
  for (uint32_t u = 0x477fe000u; u <= 0x47800100u; ++u) x.push_back(float_of(u));
  for (uint32_t u = 0x33000000u - 4096; u <= 0x38800000u + 4096; u += 7) x.push_back(float_of(u));
  for (uint32_t u = 0x7f7f7000u; u <= 0x7f800010u; ++u) x.push_back(float_of(u));
  const size_t n = x.size();
  for (size_t i = 0; i < n; ++i) x.push_back(-x[i]);
  std::vector<uint8_t> fp16_bytes(2 * x.size() + 1), bf16_bytes(2 * x.size() + 1);
  // At an odd byte address: halves in a segment's bytes need not be aligned.
  fp32_to_fp16(x.data(), fp16_bytes.data() + 1, x.size());
  fp32_to_bf16(x.data(), bf16_bytes.data() + 1, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint16_t h, b;
    std::memcpy(&h, fp16_bytes.data() + 1 + 2 * i, 2);
    std::memcpy(&b, bf16_bytes.data() + 1 + 2 * i, 2);
    ASSERT_EQ(h, to_fp16(x[i]).bits) << "fp16 of bits 0x" << std::hex << bits_of(x[i]);
    ASSERT_EQ(b, to_bf16(x[i]).bits) << "bf16 of bits 0x" << std::hex << bits_of(x[i]);
  }
}

TEST(HalfArrays, WideningGivesHalfHBitsForAllPatterns) {
  std::vector<uint16_t> halves(0x10000 + 5);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  for (const size_t skip : {size_t{0}, size_t{3}}) {  // lengths not a multiple of 8, starts not aligned
    const size_t n = halves.size() - skip;
    std::vector<float> from_fp16(n), from_bf16(n);
    fp16_to_fp32(halves.data() + skip, from_fp16.data(), n);
    bf16_to_fp32(halves.data() + skip, from_bf16.data(), n);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t bits = halves[skip + i];
      ASSERT_EQ(bits_of(from_fp16[i]), bits_of(to_float(fp16{bits}))) << "fp16 0x" << std::hex << bits;
      ASSERT_EQ(bits_of(from_bf16[i]), bits_of(to_float(bf16{bits}))) << "bf16 0x" << std::hex << bits;
    }
  }
}

TEST(HalfArrays, EveryLengthUpToTwoVectorsAndNoWritePastTheEnd) {
  Rng rng(17);
  std::vector<float> x(40);
  for (float& v : x) v = random_float(rng, 127 - 30, 127 + 17);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[9] = -std::numeric_limits<float>::infinity();
  for (size_t n = 0; n <= 17; ++n) {
    std::vector<uint16_t> out(n + 4, 0xabcd);
    fp32_to_fp16(x.data(), out.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], to_fp16(x[i]).bits) << n << " " << i;
    for (size_t i = n; i < out.size(); ++i) ASSERT_EQ(out[i], 0xabcd) << "written past " << n;
    std::vector<float> back(n + 4, 7.0f);
    fp16_to_fp32(out.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(back[i]), bits_of(to_float(fp16{out[i]}))) << n << " " << i;
    for (size_t i = n; i < back.size(); ++i) ASSERT_EQ(back[i], 7.0f) << "written past " << n;
  }
}

// ------------------------------------------------------- bulk conversion ----

// Random floats across exponents that matter for both formats, plus specials.
std::vector<float> conversion_inputs(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> values(static_cast<size_t>(n));
  for (auto& v : values) v = random_float(rng, 127 - 30, 127 + 18);
  if (n > 3) {
    values[0] = std::numeric_limits<float>::quiet_NaN();
    values[1] = -std::numeric_limits<float>::infinity();
    values[static_cast<size_t>(n - 1)] = -0.0f;
  }
  return values;
}

// Bit patterns equal, except that any NaN matches any NaN.
template <class T>
void expect_same_narrowing(const std::vector<float>& src, const T* out) {
  for (size_t i = 0; i < src.size(); ++i) {
    const T expected = from_float<T>(src[i]);
    if (std::isnan(src[i])) {
      ASSERT_TRUE(std::isnan(to_float(out[i]))) << i;
    } else {
      ASSERT_EQ(out[i].bits, expected.bits) << "element " << i;
    }
  }
}

TEST(Convert, NarrowAndWidenMatchScalarConversions) {
  // 100003 elements: several parallel_for chunks of kConvertGrain, and a tail.
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{100003}}) {
    const std::vector<float> src = conversion_inputs(n, 20 + static_cast<uint64_t>(n));
    std::vector<bf16> as_bf16(static_cast<size_t>(n));
    std::vector<fp16> as_fp16(static_cast<size_t>(n));
    narrow_from_f32(src.data(), as_bf16.data(), DType::kBF16, n);
    narrow_from_f32(src.data(), as_fp16.data(), DType::kF16, n);
    expect_same_narrowing(src, as_bf16.data());
    expect_same_narrowing(src, as_fp16.data());

    std::vector<float> widened(static_cast<size_t>(n));
    widen_to_f32(as_bf16.data(), DType::kBF16, widened.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const auto s = static_cast<size_t>(i);
      ASSERT_EQ(bits_of(widened[s]), bits_of(to_float(as_bf16[s]))) << i;
    }
    widen_to_f32(as_fp16.data(), DType::kF16, widened.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const auto s = static_cast<size_t>(i);
      ASSERT_EQ(bits_of(widened[s]), bits_of(to_float(as_fp16[s]))) << i;
    }
    std::vector<float> copied(static_cast<size_t>(n));
    narrow_from_f32(src.data(), copied.data(), DType::kF32, n);
    if (n > 0) {
      EXPECT_EQ(std::memcmp(copied.data(), src.data(), src.size() * sizeof(float)), 0);
    }
  }
}

TEST(Convert, TensorConversionsBetweenAllDtypes) {
  const int64_t n = 100003;
  const std::vector<float> src_values = conversion_inputs(n, 31);
  Tensor source = Tensor::empty({n}, DType::kF32);
  std::memcpy(source.raw(), src_values.data(), src_values.size() * sizeof(float));

  const Tensor as_bf16 = to_dtype(source, DType::kBF16);
  const Tensor as_fp16 = to_dtype(source, DType::kF16);
  EXPECT_EQ(as_bf16.shape(), source.shape());
  expect_same_narrowing(src_values, as_bf16.data<bf16>());
  expect_same_narrowing(src_values, as_fp16.data<fp16>());

  // Low precision to low precision goes through fp32 (exact), then rounds once.
  const Tensor bf16_to_fp16 = to_dtype(as_bf16, DType::kF16);
  const Tensor fp16_to_bf16 = to_dtype(as_fp16, DType::kBF16);
  for (int64_t i = 0; i < n; ++i) {
    const float via_bf16 = to_float(as_bf16.data<bf16>()[i]);
    const float via_fp16 = to_float(as_fp16.data<fp16>()[i]);
    if (std::isnan(via_bf16)) {
      ASSERT_TRUE(std::isnan(to_float(bf16_to_fp16.data<fp16>()[i])));
      ASSERT_TRUE(std::isnan(to_float(fp16_to_bf16.data<bf16>()[i])));
      continue;
    }
    ASSERT_EQ(bf16_to_fp16.data<fp16>()[i].bits, to_fp16(via_bf16).bits) << i;
    ASSERT_EQ(fp16_to_bf16.data<bf16>()[i].bits, to_bf16(via_fp16).bits) << i;
  }

  // Same dtype: a plain copy; converting a tensor onto itself is a no-op.
  Tensor copy = to_dtype(as_bf16, DType::kBF16);
  EXPECT_EQ(std::memcmp(copy.raw(), as_bf16.raw(), as_bf16.nbytes()), 0);
  convert(copy, copy);
  EXPECT_EQ(std::memcmp(copy.raw(), as_bf16.raw(), as_bf16.nbytes()), 0);

  // Widening back to fp32 reproduces the rounded values.
  const Tensor widened = to_dtype(as_fp16, DType::kF32);
  for (int64_t i = 0; i < n; ++i) {
    const float expected = to_float(as_fp16.data<fp16>()[i]);
    if (std::isnan(expected)) continue;
    ASSERT_EQ(bits_of(widened.data<float>()[i]), bits_of(expected)) << i;
  }
}

}  // namespace
}  // namespace fedmesh
