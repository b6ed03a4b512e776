// The CUDA backend of CompressionKernels against the CPU backend, the oracle
// (tests/kernels/test_compression_kernels.cpp holds the CPU to its
// definitions), on seeded inputs of awkward sizes: 1, 7, 4095, 4096, 4097 and
// 1'000'003 elements, quantization blocks of 1, 256 and 4096. Every test asks
// cuda_compression_kernels() first and skips with its reason where there is
// no backend (a CPU-only build, or no usable GPU): the binary then exits 77
// and meson reports SKIP.
//
// Tolerances:
// - add/subtract, quantize (packed bytes and scales), dequantize, casts,
//   top-k (indices, and sampled/candidates/refinements: the CUDA backend
//   draws the same sample and walks the same thresholds) and chunk top-k:
//   bit-identical. Each output element is the same sequence of IEEE
//   operations on both backends; only the order across elements differs.
// - DCT: max |gpu - cpu| <= 1e-4 * max |input|. Each output is two rounds of
//   64-term fp32 dot products with an orthonormal basis, about 1e-6 relative
//   in practice on either backend; a wrong basis entry or a transposed
//   product is off by O(max |input|).
// - matmul: |gpu - cpu| <= 1e-5 * sum_p |a_ip * b_pj| per element: both are
//   fp32 sums of k products in some order (Higham's bound is k * 2^-24 of
//   that sum in the worst case, typically sqrt(k) * 2^-24), and TF32 (10-bit
//   mantissa, ~5e-4) would fail it.
// - orthonormalize_columns: |P^T P - I| <= 1e-4 entrywise and
//   |gpu - cpu| <= 1e-4 entrywise: dots and norms accumulate in double on
//   both, so they differ by a few fp32 ulps of the unit-norm columns.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "base/random.h"
#include "base/status.h"
#include "kernels/compression_kernels.h"
#include "tests/support/topk_inputs.h"

namespace fedmesh::kernels {
namespace {

constexpr std::array<size_t, 6> kSizes = {1, 7, 4095, 4096, 4097, 1'000'003};
// FEDMESH_TEST_SANITIZER set and not empty: deploy/gpu_kit.sh's racecheck
// runs, where a kernel runs hundreds of times slower, so the parity tests
// run fewer cases.
bool under_sanitizer() {
  static const bool set = [] {
    const char* value = std::getenv("FEDMESH_TEST_SANITIZER");
    return value != nullptr && *value != '\0';
  }();
  return set;
}
// The sizes the parity tests run: all of kSizes, or under a sanitizer those
// up to 4097, which still take every path of the shared-memory kernels (a
// partial block, one full block, one more).
std::span<const size_t> test_sizes() {
  return under_sanitizer() ? std::span<const size_t>(kSizes).first(kSizes.size() - 1) : std::span<const size_t>(kSizes);
}
constexpr std::array<uint32_t, 3> kBlockSizes = {1, 256, 4096};

// ---- helpers -----------------------------------------------------------------

// An output span with guard elements on either side holding a byte pattern
// that no correct kernel writes over.
template <class T>
class Guarded {
 public:
  static constexpr size_t kGuard = 16;
  static constexpr unsigned char kPattern = 0xA5;

  explicit Guarded(size_t n) : storage_(n + 2 * kGuard) {
    std::memset(storage_.data(), kPattern, storage_.size() * sizeof(T));
  }
  std::span<T> span() { return {storage_.data() + kGuard, storage_.size() - 2 * kGuard}; }
  std::vector<T> values() const { return {storage_.begin() + kGuard, storage_.end() - kGuard}; }
  bool guards_intact() const {
    const auto* bytes = reinterpret_cast<const unsigned char*>(storage_.data());
    const size_t guard_bytes = kGuard * sizeof(T), total = storage_.size() * sizeof(T);
    for (size_t i = 0; i < guard_bytes; ++i) {
      if (bytes[i] != kPattern || bytes[total - 1 - i] != kPattern) return false;
    }
    return true;
  }

 private:
  std::vector<T> storage_;
};

template <class T>
auto bits_of(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<uint32_t>(v);
  } else {
    return v;
  }
}

// Equal bit patterns element by element (so NaN payloads and -0 count).
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& expected, const std::vector<T>& got) {
  if (expected.size() != got.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << expected.size() << " vs " << got.size();
  }
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (bits_of(expected[i]) != bits_of(got[i])) {
      if (mismatches++ == 0) first = i;
    }
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << mismatches << " of " << expected.size() << " differ; first at " << first
                                       << ": cpu bits " << +bits_of(expected[first]) << " (" << +expected[first]
                                       << "), gpu bits " << +bits_of(got[first]) << " (" << +got[first] << ")";
}

std::vector<float> normal_values(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(rng.normal() * scale);
  return x;
}

// Regions of n / 16 elements (1 to 8192, so that the large size has whole
// 4096-element blocks of each) cycling through the cases quantization must
// get right: plain values, all-zero blocks (scale 0), max |x| = FLT_MAX (the
// scale is nudged down), subnormals (subnormal scales), exact ties at scale 1
// for int8 (max 127) and for int4 (max 7), tiny normal values.
std::vector<float> awkward_values(size_t n, uint64_t seed) {
  Rng rng(seed);
  const size_t region = std::clamp<size_t>(n / 16, 1, 8192);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const double u = 2.0 * rng.uniform() - 1.0;
    const float sign = u < 0.0 ? -1.0f : 1.0f;
    switch ((i / region) % 7) {
      case 0: x[i] = static_cast<float>(rng.normal()); break;
      case 1: x[i] = 0.0f; break;
      case 2: x[i] = i % 97 == 0 ? sign * FLT_MAX : static_cast<float>(u * FLT_MAX); break;
      case 3: x[i] = sign * static_cast<float>(rng.below(300)) * std::numeric_limits<float>::denorm_min(); break;
      case 4: x[i] = i % 64 == 0 ? 127.0f : static_cast<float>(rng.below(254)) - 126.5f; break;
      case 5: x[i] = i % 16 == 0 ? -7.0f : static_cast<float>(rng.below(14)) - 6.5f; break;
      default: x[i] = static_cast<float>(rng.normal() * 1e-30); break;
    }
  }
  return x;
}

// Magnitudes from {0, 0.25, ..., 2.5} with both signs: ties everywhere.
std::vector<float> tied_values(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (float& v : x) v = (static_cast<float>(rng.below(21)) - 10.0f) * 0.25f;
  return x;
}

float max_abs(std::span<const float> x) {
  float m = 0.0f;
  for (const float v : x) m = std::max(m, std::fabs(v));
  return m;
}

// Every test runs against the backend, or skips saying why there is none.
class CudaParity : public ::testing::Test {
 protected:
  void SetUp() override {
    const Result<CompressionKernels*> cuda = cuda_compression_kernels();
    if (!cuda.is_ok()) GTEST_SKIP() << "no CUDA backend: " << cuda.status().to_string();
    gpu_ = cuda.value();
  }
  CompressionKernels& gpu() { return *gpu_; }
  static CompressionKernels& cpu() { return cpu_compression_kernels(); }

 private:
  CompressionKernels* gpu_ = nullptr;
};

// ---- the factory -------------------------------------------------------------

TEST(CudaCompressionKernels, NamesItsDeviceOrSaysWhyThereIsNone) {
  const Result<CompressionKernels*> first = cuda_compression_kernels();
  const Result<CompressionKernels*> second = cuda_compression_kernels();
  ASSERT_EQ(first.is_ok(), second.is_ok()) << "the answer is made once per process";
  if (!first.is_ok()) {
    EXPECT_EQ(first.status().code(), StatusCode::kUnavailable) << first.status().to_string();
    EXPECT_FALSE(first.status().message().empty());
    EXPECT_EQ(first.status().message(), second.status().message());
    GTEST_SKIP() << "no CUDA backend: " << first.status().to_string();
  }
  EXPECT_EQ(first.value(), second.value()) << "one backend per process";
  const std::string name = first.value()->device_name();
  EXPECT_EQ(name.rfind("cuda:0 ", 0), 0u) << name;
  EXPECT_GT(name.size(), std::string("cuda:0 ").size()) << "the device's name follows";
}

// ---- elementwise -------------------------------------------------------------

TEST_F(CudaParity, AddAndSubtractAreBitIdentical) {
  for (const size_t n : test_sizes()) {
    SCOPED_TRACE("n " + std::to_string(n));
    // Finite inputs over many magnitudes (sums may overflow to Inf on both;
    // NaN inputs are left out: x86 and CUDA propagate different NaN bits).
    std::vector<float> a = normal_values(n, n, 1e3), b = normal_values(n, n + 1, 1e-3);
    for (size_t i = 0; i < n; i += 5) b[i] = a[i] * (i % 2 ? 1.0f : -1.0f);
    if (n > 3) a[3] = b[3] = FLT_MAX;
    for (const bool subtract : {false, true}) {
      std::vector<float> expected(n);
      Guarded<float> got(n);
      if (subtract) {
        cpu().subtract(a, b, expected);
        gpu().subtract(a, b, got.span());
      } else {
        cpu().add(a, b, expected);
        gpu().add(a, b, got.span());
      }
      EXPECT_TRUE(same_bits(expected, got.values())) << (subtract ? "subtract" : "add");
      EXPECT_TRUE(got.guards_intact());
    }
  }
}

// ---- quantization ------------------------------------------------------------

struct Encoding {
  std::vector<uint8_t> packed;
  std::vector<float> scales;
};

Encoding cpu_encoding(std::span<const float> x, const BlockQuantization& q) {
  const size_t n = x.size();
  Encoding e{std::vector<uint8_t>(q.bits == 8 ? n : (n + 1) / 2),
             std::vector<float>((n + q.block_size - 1) / q.block_size)};
  cpu_compression_kernels().quantize_blocks(x, q, e.packed, e.scales);
  return e;
}

std::string describe(const BlockQuantization& q, size_t n) {
  return "n " + std::to_string(n) + " bits " + std::to_string(q.bits) + " block " + std::to_string(q.block_size) +
         (q.rounding == Rounding::kNearest ? " nearest" : " stochastic");
}

TEST_F(CudaParity, QuantizeIsBitIdentical) {
  for (const size_t n : test_sizes()) {
    const std::vector<float> x = awkward_values(n, 11 + n);
    for (const uint32_t block_size : kBlockSizes) {
      for (const int bits : {8, 4}) {
        for (const Rounding rounding : {Rounding::kNearest, Rounding::kStochastic}) {
          const BlockQuantization q{.bits = bits, .block_size = block_size, .rounding = rounding, .seed = 0x5eed + n};
          SCOPED_TRACE(describe(q, n));
          const Encoding expected = cpu_encoding(x, q);
          Guarded<uint8_t> packed(expected.packed.size());
          Guarded<float> scales(expected.scales.size());
          gpu().quantize_blocks(x, q, packed.span(), scales.span());
          EXPECT_TRUE(same_bits(expected.scales, scales.values())) << "scales";
          EXPECT_TRUE(same_bits(expected.packed, packed.values())) << "packed values";
          EXPECT_TRUE(packed.guards_intact() && scales.guards_intact());
        }
      }
    }
  }
}

TEST_F(CudaParity, DequantizeIsBitIdentical) {
  for (const size_t n : test_sizes()) {
    const std::vector<float> x = awkward_values(n, 23 + n);
    for (const uint32_t block_size : kBlockSizes) {
      for (const int bits : {8, 4}) {
        const BlockQuantization q{.bits = bits, .block_size = block_size, .rounding = Rounding::kStochastic, .seed = 7};
        SCOPED_TRACE(describe(q, n));
        const Encoding encoding = cpu_encoding(x, q);
        std::vector<float> expected(n);
        cpu().dequantize_blocks(encoding.packed, q, encoding.scales, expected);
        Guarded<float> got(n);
        gpu().dequantize_blocks(encoding.packed, q, encoding.scales, got.span());
        EXPECT_TRUE(same_bits(expected, got.values()));
        EXPECT_TRUE(got.guards_intact());
      }
    }
  }
}

// ---- casts -------------------------------------------------------------------

// The edges of both formats, then random bit patterns (every exponent, NaNs
// with payloads, subnormals), then normals over many scales.
std::vector<float> cast_inputs() {
  const auto f = [](uint32_t bits) { return std::bit_cast<float>(bits); };
  std::vector<float> x = {
      0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, f(0x7f800001u), f(0xff812345u), f(0x7fc00001u),
      FLT_MAX, -FLT_MAX, FLT_MIN, std::numeric_limits<float>::denorm_min(),
      65504.0f, 65519.996f, 65520.0f, -65520.0f, 65536.0f,  // fp16 max, the last below Inf, Inf
      0x1p-14f, 0x1p-24f, 0x1p-25f, 0x3p-25f, 0x1.8p-24f,   // fp16 smallest normal, subnormal ties
      1.0f + 0x1p-11f, 1.0f + 0x3p-11f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f,  // ties at fp16 / bf16 precision
      f(0x7f7f7fffu), f(0x7f7f8000u), f(0x7f7f8001u),  // around bf16's rounding to Inf
      f(0x00008000u), f(0x00018000u), f(0x807f8000u),  // bf16 subnormal ties
  };
  Rng rng(31);
  for (int i = 0; i < 500'000; ++i) x.push_back(f(static_cast<uint32_t>(rng.next_u64())));
  while (x.size() < kSizes.back()) {
    x.push_back(static_cast<float>(rng.normal() * std::pow(10.0, 16.0 * rng.uniform() - 10.0)));
  }
  return x;
}

TEST_F(CudaParity, CastsAreBitIdentical) {
  const std::vector<float> all = cast_inputs();
  for (const size_t n : test_sizes()) {
    const std::span<const float> x(all.data(), n);
    for (const HalfType type : {HalfType::kFp16, HalfType::kBf16}) {
      SCOPED_TRACE("n " + std::to_string(n) + (type == HalfType::kBf16 ? " bf16" : " fp16"));
      std::vector<uint16_t> expected(n);
      cpu().cast_half(x, type, expected);
      Guarded<uint16_t> got(n);
      gpu().cast_half(x, type, got.span());
      EXPECT_TRUE(same_bits(expected, got.values()));
      EXPECT_TRUE(got.guards_intact());
    }
  }
}

TEST_F(CudaParity, WideningEveryBitPatternIsBitIdentical) {
  std::vector<uint16_t> patterns(65536);
  for (size_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<uint16_t>(i);
  for (const HalfType type : {HalfType::kFp16, HalfType::kBf16}) {
    for (const size_t n : {size_t{1}, size_t{7}, patterns.size()}) {
      SCOPED_TRACE("n " + std::to_string(n) + (type == HalfType::kBf16 ? " bf16" : " fp16"));
      const std::span<const uint16_t> x(patterns.data(), n);
      std::vector<float> expected(n);
      cpu().widen_half(x, type, expected);
      Guarded<float> got(n);
      gpu().widen_half(x, type, got.span());
      EXPECT_TRUE(same_bits(expected, got.values()));
      EXPECT_TRUE(got.guards_intact());
    }
  }
}

// ---- top-k -------------------------------------------------------------------

void expect_same_selection(const TopKSelection& expected, const TopKSelection& got) {
  EXPECT_EQ(expected.indices.size(), got.indices.size());
  EXPECT_TRUE(expected.indices == got.indices) << "indices differ";
  EXPECT_EQ(expected.sampled, got.sampled);
  EXPECT_EQ(expected.candidates, got.candidates);
  EXPECT_EQ(expected.refinements, got.refinements);
}

TEST_F(CudaParity, TopKSelectsTheSameIndices) {
  const std::array<TopKOptions, 3> all_options = {
      TopKOptions{},                                                        // exact below 2^16, sampled above
      TopKOptions{.exact_below = 0, .seed = 3},                             // sampled wherever 4k <= n
      TopKOptions{.exact_below = 0, .sample_fraction = 0.001, .seed = 77},  // 1024 samples: more refinements
  };
  int sampled_runs = 0;
  for (const size_t n : test_sizes()) {
    for (const bool tied : {false, true}) {
      const std::vector<float> x = tied ? tied_values(n, n) : normal_values(n, n);
      for (const uint64_t k : {uint64_t{1}, uint64_t{7}, uint64_t{n / 100 + 1}, uint64_t{n / 4}, uint64_t{n / 3 + 1},
                               uint64_t{n}, uint64_t{n + 5}}) {
        for (size_t o = 0; o < all_options.size(); ++o) {
          SCOPED_TRACE("n " + std::to_string(n) + " k " + std::to_string(k) + " options " + std::to_string(o) +
                       (tied ? " tied" : " normal"));
          const TopKSelection expected = cpu().top_k(x, k, all_options[o]);
          const TopKSelection got = gpu().top_k(x, k, all_options[o]);
          expect_same_selection(expected, got);
          sampled_runs += got.sampled;
        }
      }
    }
  }
  EXPECT_GT(sampled_runs, 0) << "the sampled path ran";
}

// The CPU test's adversarial input: the sampled positions hold large values,
// so the first threshold is too high and must be lowered.
TEST_F(CudaParity, TopKRefinesLikeTheCpu) {
  const std::vector<float> skewed = fedmesh::testing::topk_refinement_input(1'000'000, 1);
  const TopKSelection expected = cpu().top_k(skewed, 20'000, TopKOptions{.seed = 1});
  const TopKSelection got = gpu().top_k(skewed, 20'000, TopKOptions{.seed = 1});
  expect_same_selection(expected, got);
  EXPECT_GT(got.refinements, 0) << "the input was built to need a refinement";
}

// ---- DCT ---------------------------------------------------------------------

TEST_F(CudaParity, DctMatchesWithinFp32Rounding) {
  for (const size_t chunks : {size_t{1}, size_t{3}, size_t{245}}) {
    const size_t n = chunks * kDctChunk;
    std::vector<float> x = normal_values(n, chunks, 0.01);
    for (size_t i = 0; i < n; i += 4096 * 2) x[i] = 3.0f;  // a DC-heavy chunk now and then
    for (const bool inverse : {false, true}) {
      SCOPED_TRACE("chunks " + std::to_string(chunks) + (inverse ? " inverse" : " forward"));
      std::vector<float> input = x;
      if (inverse) cpu().dct_chunks(x, input, /*inverse=*/false);  // coefficients to invert
      std::vector<float> expected(n);
      cpu().dct_chunks(input, expected, inverse);
      Guarded<float> got(n);
      gpu().dct_chunks(input, got.span(), inverse);
      const std::vector<float> values = got.values();
      float worst = 0.0f;
      for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(values[i] - expected[i]));
      EXPECT_LE(worst, 1e-4f * max_abs(input));
      EXPECT_TRUE(got.guards_intact());
    }
  }
}

// ---- chunk top-k -------------------------------------------------------------

TEST_F(CudaParity, ChunkTopKSelectsTheSameIndices) {
  // 5000 and 65536 are past the shared-memory sort (4096): the radix-sort
  // path. Under a sanitizer, the chunks and k that take every branch of the
  // shared-memory sort: a full 4096-key chunk, an odd one, and a k below, at
  // and above the chunk.
  const bool sanitizer = under_sanitizer();
  const std::vector<uint32_t> chunks =
      sanitizer ? std::vector<uint32_t>{4096u, 7u} : std::vector<uint32_t>{4096u, 1u, 7u, 256u, 4095u, 5000u, 65536u};
  const std::vector<uint32_t> ks =
      sanitizer ? std::vector<uint32_t>{3u, 4096u} : std::vector<uint32_t>{1u, 3u, 100u, 4096u, 10'000u};
  for (const size_t n : test_sizes()) {
    for (const bool tied : {false, true}) {
      const std::vector<float> x = tied ? tied_values(n, 100 + n) : normal_values(n, 100 + n);
      for (const uint32_t chunk : chunks) {
        for (const uint32_t k : ks) {
          SCOPED_TRACE("n " + std::to_string(n) + " chunk " + std::to_string(chunk) + " k " + std::to_string(k) +
                       (tied ? " tied" : " normal"));
          const std::vector<uint64_t> expected = cpu().chunk_top_k(x, chunk, k);
          const std::vector<uint64_t> got = gpu().chunk_top_k(x, chunk, k);
          EXPECT_EQ(expected.size(), got.size());
          EXPECT_TRUE(expected == got) << "indices differ";
        }
      }
    }
  }
}

// ---- matmul ------------------------------------------------------------------

TEST_F(CudaParity, MatmulMatchesWithinFp32Rounding) {
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{7, 5, 3}, Shape{64, 33, 4097}, Shape{300, 8, 1000}, Shape{1, 4096, 7},
                        Shape{513, 4, 256}}) {
    const std::vector<float> a = normal_values(static_cast<size_t>(s.m * s.k), static_cast<uint64_t>(s.m * 7 + s.k));
    const std::vector<float> b = normal_values(static_cast<size_t>(s.k * s.n), static_cast<uint64_t>(s.n * 11 + s.k));
    for (const bool transpose_a : {false, true}) {
      for (const bool transpose_b : {false, true}) {
        SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " + std::to_string(s.k) +
                     (transpose_a ? " a^T" : " a") + (transpose_b ? " b^T" : " b"));
        std::vector<float> expected(static_cast<size_t>(s.m * s.n));
        cpu().matmul(transpose_a, transpose_b, s.m, s.n, s.k, a, b, expected);
        Guarded<float> got(expected.size());
        gpu().matmul(transpose_a, transpose_b, s.m, s.n, s.k, a, b, got.span());
        const std::vector<float> values = got.values();
        int64_t bad = 0;
        double worst_ratio = 0.0;
        for (int64_t i = 0; i < s.m; ++i) {
          for (int64_t j = 0; j < s.n; ++j) {
            double magnitude = 0.0;  // sum_p |op(a)_ip * op(b)_pj|
            for (int64_t p = 0; p < s.k; ++p) {
              const float av = transpose_a ? a[static_cast<size_t>(p * s.m + i)] : a[static_cast<size_t>(i * s.k + p)];
              const float bv = transpose_b ? b[static_cast<size_t>(j * s.k + p)] : b[static_cast<size_t>(p * s.n + j)];
              magnitude += std::fabs(static_cast<double>(av) * bv);
            }
            const size_t at = static_cast<size_t>(i * s.n + j);
            const double error = std::fabs(static_cast<double>(values[at]) - expected[at]);
            worst_ratio = std::max(worst_ratio, error / std::max(magnitude, 1e-30));
            bad += error > 1e-5 * magnitude;
          }
        }
        EXPECT_EQ(bad, 0) << "worst error / sum |a b| = " << worst_ratio;
        EXPECT_TRUE(got.guards_intact());
      }
    }
  }
}

// ---- Gram-Schmidt ------------------------------------------------------------

// P^T P for p (m x r, row-major), in double.
std::vector<double> gram(const std::vector<float>& p, int64_t m, int64_t r) {
  std::vector<double> g(static_cast<size_t>(r * r));
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      double sum = 0.0;
      for (int64_t row = 0; row < m; ++row) {
        sum += static_cast<double>(p[static_cast<size_t>(row * r + i)]) * p[static_cast<size_t>(row * r + j)];
      }
      g[static_cast<size_t>(i * r + j)] = sum;
    }
  }
  return g;
}

void expect_orthonormalized_alike(std::vector<float> p, int64_t m, int64_t r, const std::vector<bool>& vanishes) {
  std::vector<float> expected = p;
  cpu_compression_kernels().orthonormalize_columns(expected, m, r);
  Result<CompressionKernels*> cuda = cuda_compression_kernels();
  ASSERT_TRUE(cuda.is_ok());
  Guarded<float> got(p.size());
  std::copy(p.begin(), p.end(), got.span().begin());
  cuda.value()->orthonormalize_columns(got.span(), m, r);
  const std::vector<float> values = got.values();
  EXPECT_TRUE(got.guards_intact());
  float worst = 0.0f;
  for (size_t i = 0; i < values.size(); ++i) worst = std::max(worst, std::fabs(values[i] - expected[i]));
  EXPECT_LE(worst, 1e-4f) << "gpu vs cpu";
  const std::vector<double> g = gram(values, m, r);
  double worst_gram = 0.0;
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      const bool unit = i == j && !vanishes[static_cast<size_t>(i)];
      worst_gram = std::max(worst_gram, std::fabs(g[static_cast<size_t>(i * r + j)] - (unit ? 1.0 : 0.0)));
    }
  }
  EXPECT_LE(worst_gram, 1e-4) << "P^T P against the identity (zero where a column vanished)";
}

TEST_F(CudaParity, OrthonormalizeColumnsMatches) {
  struct Shape {
    int64_t m, r;
  };
  for (const Shape s : {Shape{1, 1}, Shape{7, 4}, Shape{1000, 16}, Shape{4097, 64}, Shape{65536, 8}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " r " + std::to_string(s.r));
    expect_orthonormalized_alike(normal_values(static_cast<size_t>(s.m * s.r), static_cast<uint64_t>(s.m + s.r)),
                                 s.m, s.r, std::vector<bool>(static_cast<size_t>(s.r), false));
  }
  // A column that vanishes exactly: column 1 = 2.5 * column 0 = 2.5 * 2 e_0
  // (exact arithmetic), then a random column; m = 8, r = 3.
  SCOPED_TRACE("a vanishing column");
  const int64_t m = 8, r = 3;
  std::vector<float> p = normal_values(static_cast<size_t>(m * r), 5);
  for (int64_t row = 0; row < m; ++row) {
    p[static_cast<size_t>(row * r + 0)] = row == 0 ? 2.0f : 0.0f;
    p[static_cast<size_t>(row * r + 1)] = row == 0 ? 5.0f : 0.0f;
  }
  expect_orthonormalized_alike(p, m, r, {false, true, false});
}

}  // namespace
}  // namespace fedmesh::kernels
