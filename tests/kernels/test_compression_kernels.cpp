// The CPU backend of CompressionKernels against its definitions
// (kernels/compression_math.h): top-k keeps exactly the k largest magnitudes,
// the sampled threshold selects the same set as exact selection, stochastic
// rounding is unbiased, round-to-nearest stays within scale / 2, the DCT is
// orthonormal, and PowerSGD's orthonormalization gives P^T P = I.
#include <gtest/gtest.h>

#include <cstring>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "base/random.h"
#include "kernels/compression_kernels.h"
#include "kernels/half.h"
#include "tests/support/topk_inputs.h"

namespace fedmesh::kernels {
namespace {

std::vector<float> random_values(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(rng.normal()) * scale;
  return x;
}

// The reference: sort every position by the selection order.
std::vector<uint64_t> exact_top_k(const std::vector<float>& x, uint64_t k) {
  std::vector<uint64_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
    return larger_magnitude_first(std::fabs(x[a]), a, std::fabs(x[b]), b);
  });
  order.resize(std::min<uint64_t>(k, x.size()));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(TopK, KeepsExactlyTheKLargestMagnitudes) {
  CompressionKernels& cpu = cpu_compression_kernels();
  for (const size_t n : {1ul, 7ul, 1000ul, 65536ul, 200'003ul}) {
    const std::vector<float> x = random_values(n, n);
    for (const uint64_t k : {uint64_t{1}, uint64_t{n / 100 + 1}, uint64_t{n / 3 + 1}, uint64_t{n}}) {
      const TopKSelection got = cpu.top_k(x, k, TopKOptions{.exact_below = 4096, .seed = 5});
      ASSERT_EQ(got.indices.size(), std::min<uint64_t>(k, n)) << "n " << n << " k " << k;
      EXPECT_EQ(got.indices, exact_top_k(x, k)) << "n " << n << " k " << k;
      // Every kept magnitude is at least every dropped one.
      std::vector<bool> kept(n);
      float smallest_kept = INFINITY, largest_dropped = 0.0f;
      for (const uint64_t i : got.indices) kept[i] = true;
      for (size_t i = 0; i < n; ++i) {
        (kept[i] ? smallest_kept : largest_dropped) =
            kept[i] ? std::min(smallest_kept, std::fabs(x[i])) : std::max(largest_dropped, std::fabs(x[i]));
      }
      EXPECT_GE(smallest_kept, largest_dropped);
    }
  }
}

TEST(TopK, SampledThresholdSelectsTheSameSetAndRefinesWhenTheSampleMisses) {
  CompressionKernels& cpu = cpu_compression_kernels();
  std::vector<float> x = random_values(1'000'000, 3);
  const TopKSelection sampled = cpu.top_k(x, 10'000, TopKOptions{.seed = 9});
  EXPECT_TRUE(sampled.sampled);
  EXPECT_EQ(sampled.indices, exact_top_k(x, 10'000));
  EXPECT_GE(sampled.candidates, 10'000u);
  EXPECT_LT(sampled.candidates, 20'000u) << "a 1% sample should put the threshold near the 1% quantile";
  // An input whose 1% sample overestimates the threshold: it must be lowered.
  const std::vector<float> skewed = fedmesh::testing::topk_refinement_input(1'000'000, 1);
  const TopKSelection refined = cpu.top_k(skewed, 20'000, TopKOptions{.seed = 1});
  EXPECT_TRUE(refined.sampled);
  EXPECT_GE(refined.refinements, 1);
  EXPECT_EQ(refined.indices, exact_top_k(skewed, 20'000));
  // Ties among equal magnitudes go to the lower index.
  std::vector<float> ties(100'000, 1.0f);
  EXPECT_EQ(cpu.top_k(ties, 10, TopKOptions{.exact_below = 10}).indices,
            (std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

// add_top_k forms a = e + delta in e and selects from it in one pass: the
// same sums bit for bit and the same selection as add then top_k, on the
// exact path, the sampled path, a sample that must be refined (its later
// gathers read the a already formed), ties, and the many equal magnitudes
// the radix selection splits by index.
TEST(TopK, AddTopKFormsTheSumAndSelectsAsAddThenTopK) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const auto check = [&](const std::vector<float>& e0, const std::vector<float>& delta, uint64_t k,
                         const TopKOptions& options, const std::string& what) {
    std::vector<float> fused = e0, apart = e0;
    const TopKSelection got = cpu.add_top_k(fused, delta, k, options);
    cpu.add(apart, delta, apart);
    const TopKSelection expected = cpu.top_k(apart, k, options);
    EXPECT_EQ(got.indices, expected.indices) << what;
    EXPECT_EQ(got.indices, exact_top_k(apart, k)) << what;
    EXPECT_EQ(got.sampled, expected.sampled) << what;
    EXPECT_EQ(got.refinements, expected.refinements) << what;
    EXPECT_EQ(got.candidates, expected.candidates) << what;
    EXPECT_EQ(0, std::memcmp(fused.data(), apart.data(), fused.size() * sizeof(float))) << what << ": e is not e + delta";
    return got;
  };
  for (const size_t n : {5ul, 4096ul, 300'007ul}) {
    for (const uint64_t k : {uint64_t{1}, uint64_t{n / 100 + 1}, uint64_t{n / 2}}) {
      check(random_values(n, n + 1), random_values(n, n + 2), k, TopKOptions{.exact_below = 4096, .seed = 3},
            "n " + std::to_string(n) + " k " + std::to_string(k));
    }
  }
  const std::vector<float> skewed = fedmesh::testing::topk_refinement_input(1'000'000, 1);
  const TopKSelection refined =
      check(std::vector<float>(skewed.size(), 0.0f), skewed, 20'000, TopKOptions{.seed = 1}, "refined");
  EXPECT_GE(refined.refinements, 1) << "the sample was meant to miss";
  // Equal magnitudes: a half of them +1 and a half -1 after the add; the
  // radix selection keeps the lowest indices among the equal ones.
  std::vector<float> ones(200'000, 0.5f), halves(200'000);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = i % 2 == 0 ? 0.5f : -1.5f;
  check(ones, halves, 1000, TopKOptions{.seed = 2}, "ties");
  EXPECT_EQ(cpu.top_k(std::vector<float>(100'000, -2.0f), 3, TopKOptions{.seed = 4}).indices,
            (std::vector<uint64_t>{0, 1, 2}));
}

TEST(BlockQuantization, NearestRoundingStaysWithinHalfAScaleAndStochasticIsUnbiased) {
  CompressionKernels& cpu = cpu_compression_kernels();
  for (const int bits : {8, 4}) {
    const int q_max = bits == 8 ? kInt8Max : kInt4Max;
    for (const uint32_t block : {1u, 256u, 4096u}) {
      const std::vector<float> x = random_values(10'001, block + bits);
      const size_t blocks = (x.size() + block - 1) / block;
      std::vector<uint8_t> packed(bits == 8 ? x.size() : (x.size() + 1) / 2);
      std::vector<float> scales(blocks), back(x.size());
      const BlockQuantization q{bits, block, Rounding::kNearest, 0};
      cpu.quantize_blocks(x, q, packed, scales);
      cpu.dequantize_blocks(packed, q, scales, back);
      for (size_t i = 0; i < x.size(); ++i) {
        float max_abs = 0.0f;
        for (size_t j = i / block * block; j < std::min<size_t>(x.size(), (i / block + 1) * block); ++j) {
          max_abs = std::max(max_abs, std::fabs(x[j]));
        }
        ASSERT_FLOAT_EQ(scales[i / block], max_abs / static_cast<float>(q_max));
        ASSERT_LE(std::fabs(back[i] - x[i]), scales[i / block] / 2 * (1 + 1e-5f)) << "bits " << bits << " i " << i;
      }
    }
  }
  // Unbiased: the mean of 4000 stochastic draws (different seeds) of int4
  // converges to x. One draw errs by at most one scale, with variance at most
  // scale^2 / 4, so the mean's standard error is at most scale / (2 sqrt(4000))
  // = 0.0079 scale; allow 5 standard errors (0.04 scale) per element.
  const std::vector<float> x = random_values(512, 77);
  const uint32_t block = 256;
  std::vector<double> mean(x.size(), 0.0);
  std::vector<uint8_t> packed(x.size() / 2);
  std::vector<float> scales(x.size() / block), back(x.size());
  const int draws = 4000;
  for (int d = 0; d < draws; ++d) {
    const BlockQuantization q{4, block, Rounding::kStochastic, static_cast<uint64_t>(d)};
    cpu.quantize_blocks(x, q, packed, scales);
    cpu.dequantize_blocks(packed, q, scales, back);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_LT(std::fabs(back[i] - x[i]), scales[i / block] * (1 + 1e-5f));
      mean[i] += back[i] / draws;
    }
  }
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(mean[i], x[i], 0.04 * scales[i / block]) << i;
  // Round to nearest is biased on the same input (a control: the test can fail).
  const BlockQuantization nearest{4, block, Rounding::kNearest, 0};
  cpu.quantize_blocks(x, nearest, packed, scales);
  cpu.dequantize_blocks(packed, nearest, scales, back);
  size_t off = 0;
  for (size_t i = 0; i < x.size(); ++i) off += std::fabs(back[i] - x[i]) > 0.04 * scales[i / block];
  EXPECT_GT(off, x.size() / 2);
}

TEST(BlockQuantization, DrawsDependOnTheSeedAndThePositionOnly) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const std::vector<float> x = random_values(300'000, 4);
  const BlockQuantization q{8, 4096, Rounding::kStochastic, 11};
  std::vector<uint8_t> whole(x.size()), part(x.size() - 4096 * 10);
  std::vector<float> scales((x.size() + 4095) / 4096), part_scales(scales.size() - 10);
  cpu.quantize_blocks(x, q, whole, scales);
  // The same elements quantized from position 40960 on draw the same numbers.
  quantize_blocks(x.data() + 40960, part.size(), 8, 4096, Rounding::kStochastic, 11, 40960, part.data(),
                  part_scales.data());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + 40960));
}

// int4 with round-to-nearest, two elements a byte, against its definition
// written out element by element: scale = max |x| / 7 per block, q =
// clamp(nearest(x / scale), -7, 7) (ties to even) in the low nibble first;
// decoding gives q * scale. Even and odd block sizes, a tensor ending on a
// half byte, an all-zero block.
TEST(BlockQuantization, Int4MatchesItsDefinitionElementByElement) {
  std::vector<float> x = random_values(20'003, 31, 3.0f);
  std::fill(x.begin() + 4096, x.begin() + 8192, 0.0f);
  for (const uint32_t block : {4096u, 64u, 333u, 1u}) {
    const size_t blocks = (x.size() + block - 1) / block;
    std::vector<uint8_t> packed((x.size() + 1) / 2, 0xaa);
    std::vector<float> scales(blocks), out(x.size());
    quantize_blocks(x.data(), x.size(), 4, block, Rounding::kNearest, 0, 0, packed.data(), scales.data());
    dequantize_blocks(packed.data(), x.size(), 4, block, scales.data(), out.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const size_t b = i / block;
      float max_abs = 0.0f;
      for (size_t j = b * block; j < std::min(x.size(), (b + 1) * block); ++j) max_abs = std::max(max_abs, std::fabs(x[j]));
      const float scale = quantization_scale(max_abs, kInt4Max);
      ASSERT_EQ(scales[b], scale) << "block " << b;
      const int q = scale > 0.0f ? static_cast<int>(std::clamp(std::nearbyint(x[i] / scale), -7.0f, 7.0f)) : 0;
      const int nibble = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
      ASSERT_EQ((nibble ^ 8) - 8, q) << "element " << i << " block size " << block;
      ASSERT_EQ(out[i], static_cast<float>(q) * scale) << "element " << i;
    }
    EXPECT_EQ(packed.back() >> 4, 0) << "the last high nibble of an odd count stays 0";
  }
}

// Error feedback's fused step gives the very bits of its three passes
// (quantize, dequantize, subtract): packed values, scales, residual and the
// decoded values, with and without decoded asked for, for int8 and int4,
// both roundings, a length that ends mid-block, and an odd block size (int4
// then takes the three passes).
TEST(BlockQuantization, TheFusedResidualStepEqualsItsThreePasses) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const std::vector<float> a = random_values(300'001, 21);
  for (const int bits : {8, 4}) {
    for (const Rounding rounding : {Rounding::kNearest, Rounding::kStochastic}) {
      for (const uint32_t block : {4096u, 1000u, 333u}) {
        const BlockQuantization q{bits, block, rounding, 5};
        const size_t bytes = bits == 4 ? (a.size() + 1) / 2 : a.size();
        const size_t blocks = (a.size() + block - 1) / block;
        std::vector<uint8_t> packed(bytes), fused_packed(bytes);
        std::vector<float> scales(blocks), fused_scales(blocks), decoded(a.size()), residual(a.size());
        cpu.quantize_blocks(a, q, packed, scales);
        cpu.dequantize_blocks(packed, q, scales, decoded);
        cpu.subtract(a, decoded, residual);
        for (const bool want_decoded : {true, false}) {
          std::vector<float> fused_residual(a.size()), fused_decoded(want_decoded ? a.size() : 0), scratch;
          cpu.quantize_blocks_with_residual(a, q, fused_packed, fused_scales, fused_residual, fused_decoded, scratch);
          const std::string what = "int" + std::to_string(bits) + " block " + std::to_string(block) +
                                   (rounding == Rounding::kNearest ? " nearest" : " stochastic") +
                                   (want_decoded ? " with decoded" : "");
          EXPECT_EQ(fused_packed, packed) << what;
          EXPECT_EQ(fused_scales, scales) << what;
          EXPECT_EQ(fused_residual, residual) << what;
          if (want_decoded) EXPECT_EQ(fused_decoded, decoded) << what;
        }
      }
    }
  }
}

TEST(Casts, MatchHalfConversions) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const std::vector<float> x = random_values(100'000, 8, 100.0f);
  std::vector<uint16_t> bits(x.size());
  std::vector<float> back(x.size());
  cpu.cast_half(x, HalfType::kFp16, bits);
  cpu.widen_half(bits, HalfType::kFp16, back);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(bits[i], to_fp16(x[i]).bits);
    ASSERT_LE(std::fabs(back[i] - x[i]), std::ldexp(std::fabs(x[i]), -11) + 1e-7f);
  }
  cpu.cast_half(x, HalfType::kBf16, bits);
  cpu.widen_half(bits, HalfType::kBf16, back);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(bits[i], to_bf16(x[i]).bits);
    ASSERT_LE(std::fabs(back[i] - x[i]), std::ldexp(std::fabs(x[i]), -8));
  }
}

TEST(Dct, IsOrthonormalAndInvertible) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const std::vector<float> x = random_values(3 * kDctChunk, 12);
  std::vector<float> y(x.size()), back(x.size());
  cpu.dct_chunks(x, y, false);
  cpu.dct_chunks(y, back, true);
  double x_energy = 0.0, y_energy = 0.0, max_error = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    x_energy += static_cast<double>(x[i]) * x[i];
    y_energy += static_cast<double>(y[i]) * y[i];
    max_error = std::max(max_error, static_cast<double>(std::fabs(back[i] - x[i])));
  }
  EXPECT_NEAR(y_energy / x_energy, 1.0, 1e-4);  // Parseval: energy is kept
  EXPECT_LT(max_error, 1e-4);
  // A constant chunk is all DC: coefficient 0 is 64 * c, the rest vanish.
  std::vector<float> flat(kDctChunk, 0.5f), flat_y(kDctChunk);
  cpu.dct_chunks(flat, flat_y, false);
  EXPECT_NEAR(flat_y[0], 32.0f, 1e-4);
  for (size_t i = 1; i < kDctChunk; ++i) ASSERT_NEAR(flat_y[i], 0.0f, 1e-4) << i;
}

TEST(ChunkTopK, KeepsTheKLargestOfEveryChunk) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const std::vector<float> x = random_values(3 * 4096 + 100, 13);
  const std::vector<uint64_t> got = cpu.chunk_top_k(x, 4096, 32);
  ASSERT_EQ(got.size(), 4u * 32u);
  for (uint64_t c = 0; c < 4; ++c) {
    const uint64_t first = c * 4096, last = std::min<uint64_t>(x.size(), first + 4096);
    std::vector<float> chunk(x.begin() + static_cast<int64_t>(first), x.begin() + static_cast<int64_t>(last));
    std::vector<uint64_t> expected = exact_top_k(chunk, 32);
    for (uint64_t& i : expected) i += first;
    EXPECT_EQ(std::vector<uint64_t>(got.begin() + static_cast<int64_t>(c * 32), got.begin() + static_cast<int64_t>(c * 32 + 32)),
              expected);
  }
}

TEST(PowerSgdKernels, OrthonormalizedColumnsAreOrthonormalAndMatmulMatchesLoops) {
  CompressionKernels& cpu = cpu_compression_kernels();
  const int64_t m = 300, r = 4, n = 70;
  std::vector<float> p = random_values(static_cast<size_t>(m * r), 14);
  cpu.orthonormalize_columns(p, m, r);
  for (int64_t a = 0; a < r; ++a) {
    for (int64_t b = 0; b < r; ++b) {
      double dot = 0.0;
      for (int64_t i = 0; i < m; ++i) dot += static_cast<double>(p[static_cast<size_t>(i * r + a)]) * p[static_cast<size_t>(i * r + b)];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5);
    }
  }
  // A column that is a combination of the earlier ones vanishes.
  std::vector<float> dependent(static_cast<size_t>(m * 2));
  for (int64_t i = 0; i < m; ++i) dependent[static_cast<size_t>(i * 2)] = dependent[static_cast<size_t>(i * 2 + 1)] = static_cast<float>(i % 7);
  cpu.orthonormalize_columns(dependent, m, 2);
  for (int64_t i = 0; i < m; ++i) EXPECT_NEAR(dependent[static_cast<size_t>(i * 2 + 1)], 0.0f, 1e-5);
  // c = a^T b for a (n x m) and b (n x r): the product PowerSGD's second phase takes.
  const std::vector<float> a = random_values(static_cast<size_t>(n * m), 15);
  std::vector<float> c(static_cast<size_t>(m * r));
  const std::vector<float> b = random_values(static_cast<size_t>(n * r), 16);
  cpu.matmul(true, false, m, r, n, a, b, c);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      double sum = 0.0;
      for (int64_t t = 0; t < n; ++t) sum += static_cast<double>(a[static_cast<size_t>(t * m + i)]) * b[static_cast<size_t>(t * r + j)];
      ASSERT_NEAR(c[static_cast<size_t>(i * r + j)], sum, 1e-4);
    }
  }
}

}  // namespace
}  // namespace fedmesh::kernels
