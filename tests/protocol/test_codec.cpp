// The update codec (protocol/codec.h): round trips for every encoding over
// seeded random shapes (1 element, primes, non-multiples of the block size,
// random sparsity), the stated error bounds, accumulate semantics, segment
// size limits, and rejection of every malformed form a peer can send, each
// of which must come back kCorrupt with target left bit-for-bit unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "base/random.h"
#include "kernels/half.h"
#include "protocol/codec.h"

namespace fedmesh::protocol {
namespace {

constexpr uint64_t kSeed = 0xc0dec5eed;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kFloatMax = std::numeric_limits<float>::max();

const std::vector<uint64_t> kSizes = {1, 2, 3, 5, 7, 31, 97, 255, 256, 257, 1000, 4099, 65537};
const std::vector<Encoding> kDenseEncodings = {Encoding::kDenseF32, Encoding::kDenseBf16, Encoding::kDenseF16};
const std::vector<Encoding> kSparseEncodings = {Encoding::kSparseF32,       Encoding::kSparseF16,
                                                Encoding::kSparseInt8,      Encoding::kSparseBitmapF32,
                                                Encoding::kSparseBitmapF16, Encoding::kSparseBitmapInt8};
const std::vector<Encoding> kBlockEncodings = {Encoding::kBlockInt8, Encoding::kBlockInt4};

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }

std::vector<TensorShape> one_tensor(uint64_t n) {
  return {TensorShape{"t", {static_cast<int64_t>(n)}}};
}

// Values across a wide range of magnitudes, with exact zeros and both signs.
std::vector<float> random_values(Rng& rng, uint64_t n, double max_log2 = 10.0) {
  std::vector<float> values(n);
  for (auto& v : values) {
    if (rng.below(16) == 0) {
      v = 0.0f;
    } else {
      const double exponent = (rng.uniform() * 2.0 - 1.0) * max_log2;
      v = static_cast<float>(rng.normal() * std::exp2(exponent));
    }
  }
  return values;
}

// max_segment_bytes from just enough for one element/block to more than the whole tensor.
size_t random_segment_bytes(Rng& rng, size_t minimum) {
  switch (rng.below(3)) {
    case 0: return minimum;
    case 1: return minimum + rng.below(64);
    default: return minimum + rng.below(1 << 20);
  }
}

// Checks the segments tile [0, n) in order, each non-empty, within the byte
// limit, and valid by check_segment.
void expect_tiling(const std::vector<EncodedSegment>& segments, uint64_t n, size_t max_segment_bytes,
                   std::span<const TensorShape> manifest) {
  uint64_t next = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const EncodedSegment& s = segments[i];
    SCOPED_TRACE("segment " + std::to_string(i));
    EXPECT_EQ(s.offset, next);
    EXPECT_GE(s.count, 1u);
    EXPECT_LE(s.payload_bytes(), max_segment_bytes);
    EXPECT_TRUE(check_segment(s.view(), manifest).is_ok()) << check_segment(s.view(), manifest).to_string();
    next = s.offset + s.count;
  }
  EXPECT_EQ(next, n);
}

std::vector<float> decode_all(const std::vector<EncodedSegment>& segments, std::span<const TensorShape> manifest,
                              uint64_t n) {
  std::vector<float> out(n, -12345.0f);  // every element must be overwritten
  for (const auto& s : segments) {
    const Status status = decode_segment(s.view(), manifest, out);
    EXPECT_TRUE(status.is_ok()) << status.to_string();
  }
  return out;
}

// ---- names and shapes -------------------------------------------------------------

Result<std::vector<EncodedSegment>> encode_random_dct(Rng& rng, uint64_t n, uint64_t k, size_t max_bytes);

TEST(CodecNames, EveryEncodingHasANameAndKind) {
  const char* names[] = {"dense-f32",         "dense-bf16",        "dense-f16",          "sparse-f32",
                         "sparse-f16",        "sparse-int8",       "block-int8",         "block-int4",
                         "sparse-bitmap-f32", "sparse-bitmap-f16", "sparse-bitmap-int8", "dct-sign"};
  static_assert(std::size(names) == kEncodingCount);
  for (int i = 0; i < kEncodingCount; ++i) {
    const auto e = static_cast<Encoding>(i);
    EXPECT_STREQ(encoding_name(e), names[i]);
    EXPECT_EQ(encoding_is_sparse(e), (i >= 3 && i <= 5) || (i >= 8 && i <= 10)) << names[i];
    EXPECT_EQ(encoding_has_bitmap(e), i >= 8 && i <= 10) << names[i];
    EXPECT_EQ(encoding_is_block(e), i == 6 || i == 7) << names[i];
    EXPECT_EQ(encoding_is_lossless(e), i == 0 || i == 3 || i == 8) << names[i];
  }
  EXPECT_STREQ(encoding_name(static_cast<Encoding>(kEncodingCount)), "unknown");
}

TEST(CodecShape, ElementCount) {
  EXPECT_EQ((TensorShape{"s", {}}).element_count(), 1u);
  EXPECT_EQ((TensorShape{"v", {7}}).element_count(), 7u);
  EXPECT_EQ((TensorShape{"m", {3, 5, 2}}).element_count(), 30u);
  EXPECT_EQ((TensorShape{"z", {0, int64_t{1} << 62}}).element_count(), 0u);
  EXPECT_EQ((TensorShape{"max", {int64_t{1} << 18, int64_t{1} << 18}}).element_count(), kMaxTensorElements);
  EXPECT_GT((TensorShape{"big", {int64_t{1} << 18, (int64_t{1} << 18) + 1}}).element_count(), kMaxTensorElements);
  EXPECT_GT((TensorShape{"wrap", {int64_t{1} << 32, int64_t{1} << 32, 2}}).element_count(), kMaxTensorElements);
  EXPECT_GT((TensorShape{"neg", {-1, 4}}).element_count(), kMaxTensorElements);
  EXPECT_GT((TensorShape{"neg0", {0, -4}}).element_count(), kMaxTensorElements);
}

TEST(CodecShape, InvalidManifestTensorIsRejected) {
  const std::vector<float> values = {1.0f, 2.0f};
  auto segments = encode_dense(0, values, Encoding::kDenseF32, 1024);
  ASSERT_TRUE(segments.is_ok());
  for (const auto& dims : {std::vector<int64_t>{-2}, std::vector<int64_t>{int64_t{1} << 40, 2}}) {
    const std::vector<TensorShape> manifest = {TensorShape{"bad", dims}};
    const Status status = check_segment(segments->front().view(), manifest);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
    EXPECT_NE(status.message().find("'bad'"), std::string::npos) << status.message();
  }
}

// ---- round trips ---------------------------------------------------------------

TEST(CodecRoundTrip, ZeroElementTensorHasNoSegments) {
  const std::vector<float> none;
  for (Encoding e : kDenseEncodings) {
    auto r = encode_dense(0, none, e, 64);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_TRUE(r->empty()) << encoding_name(e);
  }
  for (Encoding e : kSparseEncodings) {
    auto r = encode_sparse(0, 0, {}, {}, e, 64);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_TRUE(r->empty()) << encoding_name(e);
  }
  for (Encoding e : kBlockEncodings) {
    auto r = encode_blocks(0, none, e, 32, 1024);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_TRUE(r->empty()) << encoding_name(e);
  }
  // And a segment for a 0-element tensor is refused: it could cover nothing.
  const std::vector<TensorShape> manifest = {TensorShape{"empty", {0, 3}}};
  SegmentView view;
  view.count = 1;
  std::vector<uint8_t> four(4, 0);
  view.values = four;
  EXPECT_EQ(check_segment(view, manifest).code(), StatusCode::kCorrupt);
}

TEST(CodecRoundTrip, DenseF32IsBitExact) {
  Rng rng(kSeed);
  for (uint64_t n : kSizes) {
    std::vector<float> values = random_values(rng, n, 60.0);
    // Special finite values survive too.
    const float specials[] = {-0.0f, std::numeric_limits<float>::denorm_min(), kFloatMax, -kFloatMax,
                              std::numeric_limits<float>::min()};
    for (size_t i = 0; i < std::size(specials) && i < n; ++i) values[rng.below(n)] = specials[i];
    const size_t max_bytes = random_segment_bytes(rng, 4);
    auto segments = encode_dense(2, values, Encoding::kDenseF32, max_bytes);
    ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
    std::vector<TensorShape> manifest = {TensorShape{"a", {1}}, TensorShape{"b", {2}},
                                         TensorShape{"c", {static_cast<int64_t>(n)}}};
    SCOPED_TRACE("n=" + std::to_string(n) + " max_bytes=" + std::to_string(max_bytes));
    expect_tiling(*segments, n, max_bytes, manifest);
    for (const auto& s : *segments) EXPECT_EQ(s.tensor, 2u);
    const std::vector<float> decoded = decode_all(*segments, manifest, n);
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(decoded[i]), bits_of(values[i])) << "element " << i;
  }
}

// Fills every part on a thread of its own, last part first.
void backwards_on_threads(size_t count, const std::function<void(size_t)>& fill) {
  std::vector<std::thread> threads;
  for (size_t i = count; i-- > 0;) threads.emplace_back([&fill, i] { fill(i); });
  for (std::thread& thread : threads) thread.join();
}

// A SegmentRunner may fill the segments in any order on any threads: the
// bytes are those of the codec's own one-after-the-other loop.
TEST(CodecRoundTrip, SegmentsFilledOnThreadsInAnyOrderAreTheSameBytes) {
  auto same = [](const std::vector<EncodedSegment>& a, const std::vector<EncodedSegment>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].offset, b[i].offset) << i;
      EXPECT_EQ(a[i].count, b[i].count) << i;
      EXPECT_EQ(a[i].values, b[i].values) << i;
      EXPECT_EQ(a[i].scales, b[i].scales) << i;
    }
  };
  Rng rng(kSeed + 40);
  const uint64_t n = 50001;  // odd: the last int4 byte holds one element
  const std::vector<float> values = random_values(rng, n, 3.0);
  for (Encoding e : {Encoding::kDenseF32, Encoding::kDenseF16, Encoding::kDenseBf16}) {
    SCOPED_TRACE(encoding_name(e));
    auto serial = encode_dense(0, values, e, 4096);
    auto threaded = encode_dense(0, values, e, 4096, backwards_on_threads);
    ASSERT_TRUE(serial.is_ok() && threaded.is_ok());
    ASSERT_GT(serial->size(), 10u);
    same(*serial, *threaded);
  }
  for (const auto& [e, bits, block] : {std::tuple{Encoding::kBlockInt8, 8, 256u}, std::tuple{Encoding::kBlockInt4, 4, 256u},
                                       std::tuple{Encoding::kBlockInt4, 4, 255u}}) {
    SCOPED_TRACE(std::string(encoding_name(e)) + " block " + std::to_string(block));
    std::vector<uint8_t> packed(bits == 4 ? (n + 1) / 2 : n);
    std::vector<float> scales((n + block - 1) / block);
    kernels::quantize_blocks(values.data(), n, bits, block, kernels::Rounding::kNearest, 0, 0, packed.data(),
                             scales.data());
    auto serial = encode_quantized_blocks(0, n, packed, scales, e, block, 2048);
    auto threaded = encode_quantized_blocks(0, n, packed, scales, e, block, 2048, backwards_on_threads);
    ASSERT_TRUE(serial.is_ok() && threaded.is_ok()) << serial.status().message();
    ASSERT_GT(serial->size(), 10u);
    same(*serial, *threaded);
  }
}

// A decoder given a runner writes a validated segment's parts on its
// threads, in any order: the same floats as one thread, added or written;
// and a segment that fails validation still leaves the target untouched.
TEST(CodecRoundTrip, SegmentsDecodedInPartsOnThreadsGiveTheSameFloats) {
  Rng rng(kSeed + 41);
  const uint64_t n = 300001;  // several write parts per segment, an odd tail
  const std::vector<float> values = random_values(rng, n, 3.0);
  std::vector<uint64_t> picked;
  std::vector<float> picked_values;
  for (uint64_t i = 0; i < n; i += 1 + rng.below(40)) {
    picked.push_back(i);
    picked_values.push_back(values[i]);
  }
  std::vector<std::vector<EncodedSegment>> encoded;
  for (Encoding e : {Encoding::kDenseF32, Encoding::kDenseF16, Encoding::kDenseBf16}) {
    encoded.push_back(*encode_dense(0, values, e, 1 << 20));
  }
  for (Encoding e : {Encoding::kBlockInt8, Encoding::kBlockInt4}) {
    for (uint32_t block : {256u, 4096u, 777u}) encoded.push_back(*encode_blocks(0, values, e, block, 1 << 20));
  }
  for (Encoding e : {Encoding::kSparseF32, Encoding::kSparseInt8, Encoding::kSparseBitmapF16}) {
    encoded.push_back(*encode_sparse(0, n, picked, picked_values, e, 1 << 20));
  }
  const auto manifest = one_tensor(n);
  for (const std::vector<EncodedSegment>& segments : encoded) {
    SCOPED_TRACE(std::string(encoding_name(segments[0].encoding)) + " block " + std::to_string(segments[0].block_size));
    std::vector<float> serial(n, 0.5f), threaded(n, 0.5f), added(n, 0.5f), added_threaded(n, 0.5f);
    for (const EncodedSegment& segment : segments) {
      ASSERT_TRUE(decode_segment(segment.view(), manifest, serial).is_ok());
      ASSERT_TRUE(decode_segment(segment.view(), manifest, threaded, backwards_on_threads).is_ok());
      ASSERT_TRUE(accumulate_segment(segment.view(), manifest, 0.25f, added).is_ok());
      ASSERT_TRUE(accumulate_segment(segment.view(), manifest, 0.25f, added_threaded, backwards_on_threads).is_ok());
    }
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(bits_of(serial[i]), bits_of(threaded[i])) << "element " << i;
      ASSERT_EQ(bits_of(added[i]), bits_of(added_threaded[i])) << "element " << i;
    }
  }
  // A block scale so large that q * scale overflows: refused, nothing written.
  EncodedSegment bad = encoded[3][0];  // int8, block 256
  const float huge = kFloatMax;
  std::memcpy(bad.scales.data() + 4 * 5, &huge, 4);
  bad.values[5 * 256 + 3] = 100;
  std::vector<float> target(n, 0.5f);
  EXPECT_EQ(decode_segment(bad.view(), manifest, target, backwards_on_threads).code(), StatusCode::kCorrupt);
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(target[i], 0.5f) << "element " << i;
}

// A sparse segment of many entries (65536 or more) is decoded from the
// positions its validation pass kept, written on the runner's threads: the
// same floats as visiting its entries (zeros elsewhere), with or without a
// runner; one with a non-finite value writes nothing.
TEST(CodecRoundTrip, ManySparseEntriesAreWrittenOnThreadsAsVisited) {
  Rng rng(kSeed + 43);
  const uint64_t n = 1000003;
  const std::vector<float> values = random_values(rng, n, 2.0);
  std::vector<uint64_t> picked;
  std::vector<float> picked_values;
  for (uint64_t i = rng.below(3); i < n; i += 1 + rng.below(6)) {
    picked.push_back(i);
    picked_values.push_back(values[i]);
  }
  const auto manifest = one_tensor(n);
  for (Encoding e : {Encoding::kSparseF32, Encoding::kSparseInt8, Encoding::kSparseBitmapF16,
                     Encoding::kSparseBitmapInt8}) {
    SCOPED_TRACE(encoding_name(e));
    const std::vector<EncodedSegment> segments = *encode_sparse(0, n, picked, picked_values, e, 1 << 22);
    std::vector<float> expected(n, 0.0f), serial(n, 0.5f), threaded(n, 0.5f);
    uint64_t largest = 0;
    for (const EncodedSegment& segment : segments) {
      largest = std::max(largest, segment.nnz);
      ASSERT_TRUE(visit_sparse_entries(segment.view(), manifest, [&](uint64_t i, float v) { expected[i] = v; }).is_ok());
      ASSERT_TRUE(decode_segment(segment.view(), manifest, serial).is_ok());
      ASSERT_TRUE(decode_segment(segment.view(), manifest, threaded, backwards_on_threads).is_ok());
    }
    ASSERT_GE(largest, uint64_t{1} << 16) << "no segment took the threaded path";
    for (uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(bits_of(serial[i]), bits_of(expected[i])) << "element " << i;
      ASSERT_EQ(bits_of(threaded[i]), bits_of(expected[i])) << "element " << i;
    }
  }
  EncodedSegment bad = *encode_sparse(0, n, picked, picked_values, Encoding::kSparseF32, 1 << 22)->begin();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad.values.data() + 4 * (bad.nnz - 7), &nan, 4);
  std::vector<float> target(n, 0.5f);
  EXPECT_EQ(decode_segment(bad.view(), manifest, target, backwards_on_threads).code(), StatusCode::kCorrupt);
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(target[i], 0.5f) << "element " << i;
}

// encode_sparse checks and writes its entries in parts on the runner's
// threads, in any order: the bytes of its one-thread loop (bitmap parts start
// on a new byte; varint parts where the gaps before them end), and the
// values it reports as decoded are, bit for bit, what the decoder gives.
TEST(CodecRoundTrip, SparseEntriesEncodedOnThreadsAreTheSameBytesAndDecodeAsReported) {
  Rng rng(kSeed + 44);
  const uint64_t n = 2000003;
  const std::vector<float> values = random_values(rng, n, 2.0);
  for (const uint64_t stride : {2u, 9u, 300u}) {  // bytes of a bitmap shared by neighbours; gaps of 1 to 2 varint bytes
    std::vector<uint64_t> picked;
    std::vector<float> picked_values;
    for (uint64_t i = rng.below(3); i < n; i += 1 + rng.below(stride)) {
      picked.push_back(i);
      picked_values.push_back(values[i]);
    }
    const auto manifest = one_tensor(n);
    for (Encoding e : {Encoding::kSparseF32, Encoding::kSparseF16, Encoding::kSparseInt8, Encoding::kSparseBitmapF32,
                       Encoding::kSparseBitmapF16, Encoding::kSparseBitmapInt8}) {
      for (const size_t max_bytes : {size_t{1} << 22, size_t{300000}}) {
        SCOPED_TRACE(std::string(encoding_name(e)) + " stride " + std::to_string(stride) + " segments of " +
                     std::to_string(max_bytes) + " bytes");
        std::vector<float> reported(picked.size(), -1.0f);
        auto serial = encode_sparse(0, n, picked, picked_values, e, max_bytes);
        auto threaded = encode_sparse(0, n, picked, picked_values, e, max_bytes, backwards_on_threads, reported);
        ASSERT_TRUE(serial.is_ok() && threaded.is_ok()) << serial.status().message();
        ASSERT_EQ(serial->size(), threaded->size());
        uint64_t entry = 0;
        for (size_t i = 0; i < serial->size(); ++i) {
          const EncodedSegment &a = (*serial)[i], &b = (*threaded)[i];
          ASSERT_EQ(a.offset, b.offset) << i;
          ASSERT_EQ(a.count, b.count) << i;
          ASSERT_EQ(a.nnz, b.nnz) << i;
          ASSERT_EQ(a.indices, b.indices) << i;
          ASSERT_EQ(a.values, b.values) << i;
          ASSERT_EQ(a.scales, b.scales) << i;
          ASSERT_TRUE(visit_sparse_entries(b.view(), manifest, [&](uint64_t index, float v) {
                        ASSERT_EQ(index, picked[entry]);
                        ASSERT_EQ(bits_of(reported[entry]), bits_of(v)) << "entry " << entry;
                        ++entry;
                      }).is_ok());
        }
        EXPECT_EQ(entry, picked.size());
      }
    }
  }
  // A refused entry is named as the one-thread loop names it.
  std::vector<uint64_t> indices(200000);
  std::vector<float> two(indices.size(), 1.0f);
  for (size_t k = 0; k < indices.size(); ++k) indices[k] = 3 * k;
  indices[150000] = indices[149999];
  auto refused = encode_sparse(0, n, indices, two, Encoding::kSparseInt8, 1 << 22, backwards_on_threads);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("index 150000"), std::string::npos) << refused.status().message();
  std::vector<float> wrong_room(3);
  EXPECT_EQ(encode_sparse(0, n, {}, {}, Encoding::kSparseF32, 64, {}, wrong_room).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(CodecRoundTrip, DenseHalvesWithinBound) {
  Rng rng(kSeed + 1);
  for (Encoding e : {Encoding::kDenseBf16, Encoding::kDenseF16}) {
    for (uint64_t n : kSizes) {
      // fp16's bound holds in its normal range [2^-14, 65504]: keep values there (or 0).
      std::vector<float> values = random_values(rng, n, e == Encoding::kDenseF16 ? 8.0 : 60.0);
      const size_t max_bytes = random_segment_bytes(rng, 2);
      auto segments = encode_dense(0, values, e, max_bytes);
      ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
      const auto manifest = one_tensor(n);
      SCOPED_TRACE(std::string(encoding_name(e)) + " n=" + std::to_string(n));
      expect_tiling(*segments, n, max_bytes, manifest);
      const std::vector<float> decoded = decode_all(*segments, manifest, n);
      for (uint64_t i = 0; i < n; ++i) {
        const float x = values[i];
        if (e == Encoding::kDenseBf16) {
          ASSERT_EQ(bits_of(decoded[i]), bits_of(to_float(to_bf16(x)))) << i;
          ASSERT_LE(std::fabs(x - decoded[i]), std::ldexp(std::fabs(x), -8)) << i << " x=" << x;
        } else {
          ASSERT_EQ(bits_of(decoded[i]), bits_of(to_float(to_fp16(x)))) << i;
          const float bound = std::fabs(x) >= 0x1p-14f ? std::ldexp(std::fabs(x), -11) : 0x1p-25f;
          ASSERT_LE(std::fabs(x - decoded[i]), bound) << i << " x=" << x;
        }
      }
    }
  }
}

// The stated bound scale / 2 with scale = max|x| / q_max, plus the few fp32
// roundings in computing the scale, x / scale and q * scale.
float quantization_bound(float max_abs, int q_max) {
  return max_abs / static_cast<float>(q_max) / 2.0f + max_abs * 1e-6f;
}

TEST(CodecRoundTrip, BlocksWithinBound) {
  Rng rng(kSeed + 2);
  const uint32_t block_sizes[] = {1, 2, 3, 7, 32, 100, 256, 3001};  // 3001: odd, past one int4 decode chunk
  for (Encoding e : kBlockEncodings) {
    const int q_max = e == Encoding::kBlockInt8 ? 127 : 7;
    for (uint64_t n : kSizes) {
      const uint32_t block_size = block_sizes[rng.below(std::size(block_sizes))];
      std::vector<float> values = random_values(rng, n, 20.0);
      // An all-zero block.
      if (n >= 2 * block_size) std::fill(values.begin() + block_size, values.begin() + 2 * block_size, 0.0f);
      const size_t one_block = 4 + (e == Encoding::kBlockInt8 ? block_size : (block_size + 1) / 2);
      const size_t max_bytes = random_segment_bytes(rng, one_block);
      auto segments = encode_blocks(1, values, e, block_size, max_bytes);
      ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
      const std::vector<TensorShape> manifest = {TensorShape{"x", {3}}, TensorShape{"t", {static_cast<int64_t>(n)}}};
      SCOPED_TRACE(std::string(encoding_name(e)) + " n=" + std::to_string(n) + " block_size=" +
                   std::to_string(block_size) + " max_bytes=" + std::to_string(max_bytes));
      expect_tiling(*segments, n, max_bytes, manifest);
      for (size_t i = 0; i < segments->size(); ++i) {
        const auto& s = (*segments)[i];
        EXPECT_EQ(s.block_size, block_size);
        if (i + 1 < segments->size()) {
          EXPECT_EQ(s.count % block_size, 0u) << "only the last segment may end mid-block";
        }
      }
      const std::vector<float> decoded = decode_all(*segments, manifest, n);
      for (uint64_t first = 0; first < n; first += block_size) {
        const uint64_t last = std::min<uint64_t>(n, first + block_size);
        float max_abs = 0.0f;
        for (uint64_t i = first; i < last; ++i) max_abs = std::max(max_abs, std::fabs(values[i]));
        for (uint64_t i = first; i < last; ++i) {
          ASSERT_LE(std::fabs(values[i] - decoded[i]), quantization_bound(max_abs, q_max))
              << "element " << i << " x=" << values[i] << " decoded=" << decoded[i];
          if (max_abs == 0.0f) {
            ASSERT_EQ(bits_of(decoded[i]), 0u) << "an all-zero block decodes to +0";
          }
        }
      }
    }
  }
}

TEST(CodecRoundTrip, BlockScalesAreMaxOverQmaxAndZeroForZeroBlocks) {
  const std::vector<float> values = {0.5f, -1.27f, 0.0f, 0.0f, 0.0f, 0.0f, 3.5f};
  auto int8 = encode_blocks(0, values, Encoding::kBlockInt8, 2, 1 << 20);
  ASSERT_TRUE(int8.is_ok());
  ASSERT_EQ(int8->size(), 1u);
  const auto& s = int8->front();
  ASSERT_EQ(s.scales.size(), 16u);
  float scales[4];
  std::memcpy(scales, s.scales.data(), 16);
  EXPECT_EQ(scales[0], 1.27f / 127.0f);
  EXPECT_EQ(scales[1], 0.0f);
  EXPECT_EQ(scales[2], 0.0f);
  EXPECT_EQ(scales[3], 3.5f / 127.0f);
  EXPECT_EQ(static_cast<int8_t>(s.values[1]), -127);
  EXPECT_EQ(static_cast<int8_t>(s.values[6]), 127);

  auto int4 = encode_blocks(0, values, Encoding::kBlockInt4, 7, 1 << 20);
  ASSERT_TRUE(int4.is_ok());
  const auto& s4 = int4->front();
  ASSERT_EQ(s4.values.size(), 4u);
  // 3.5 is the block's max: q = 7, in the low nibble of byte 3, high nibble 0.
  EXPECT_EQ(s4.values[3], 0x07);
  // -1.27 / 0.5 = -2.54 -> -3 = 0xd in the high nibble of byte 0; 0.5 / 0.5 = 1 low.
  EXPECT_EQ(s4.values[0], 0xd1);
}

TEST(CodecRoundTrip, QuantizationOfExtremeValuesStaysFinite) {
  // max|x| = FLT_MAX: q_max * scale must not round to Inf.
  const std::vector<float> values = {kFloatMax, -kFloatMax, 1.0f, kFloatMax / 3};
  for (Encoding e : kBlockEncodings) {
    auto segments = encode_blocks(0, values, e, 4, 1 << 10);
    ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
    const auto manifest = one_tensor(values.size());
    const std::vector<float> decoded = decode_all(*segments, manifest, values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_TRUE(std::isfinite(decoded[i])) << encoding_name(e) << " " << i;
      EXPECT_LE(std::fabs(values[i] - decoded[i]), quantization_bound(kFloatMax, e == Encoding::kBlockInt8 ? 127 : 7));
    }
  }
  const std::vector<uint64_t> indices = {0, 3};
  const std::vector<float> sparse_values = {kFloatMax, -kFloatMax};
  auto sparse = encode_sparse(0, 4, indices, sparse_values, Encoding::kSparseInt8, 1 << 10);
  ASSERT_TRUE(sparse.is_ok());
  const auto decoded = decode_all(*sparse, one_tensor(4), 4);
  EXPECT_TRUE(std::isfinite(decoded[0]) && std::isfinite(decoded[3]));
  EXPECT_GT(decoded[0], kFloatMax * 0.99f);
}

struct SparseInput {
  std::vector<uint64_t> indices;
  std::vector<float> values;
};

SparseInput random_sparse(Rng& rng, uint64_t n, double density, double max_log2) {
  SparseInput input;
  for (uint64_t i = 0; i < n; ++i) {
    if (rng.uniform() < density) {
      input.indices.push_back(i);
      float v = 0.0f;
      while (v == 0.0f) v = static_cast<float>(rng.normal() * std::exp2((rng.uniform() * 2 - 1) * max_log2));
      input.values.push_back(v);
    }
  }
  return input;
}

TEST(CodecRoundTrip, SparseWithinBoundAndZerosElsewhere) {
  Rng rng(kSeed + 3);
  const double densities[] = {0.0, 0.001, 0.01, 0.1, 0.5, 1.0};
  for (Encoding encoding : kSparseEncodings) {
    const Encoding e = sparse_with_bitmap(encoding, false);  // the value form
    const size_t entry_bytes = e == Encoding::kSparseF32 ? 5 : e == Encoding::kSparseF16 ? 3 : 6;
    for (uint64_t n : kSizes) {
      for (double density : densities) {
        const SparseInput input = random_sparse(rng, n, density, e == Encoding::kSparseF16 ? 8.0 : 30.0);
        const size_t max_bytes = random_segment_bytes(rng, entry_bytes);
        auto segments = encode_sparse(0, n, input.indices, input.values, encoding, max_bytes);
        ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
        const auto manifest = one_tensor(n);
        SCOPED_TRACE(std::string(encoding_name(encoding)) + " n=" + std::to_string(n) + " density=" +
                     std::to_string(density) + " max_bytes=" + std::to_string(max_bytes));
        expect_tiling(*segments, n, max_bytes, manifest);
        uint64_t total_nnz = 0;
        for (const auto& s : *segments) total_nnz += s.nnz;
        EXPECT_EQ(total_nnz, input.indices.size());

        const std::vector<float> decoded = decode_all(*segments, manifest, n);
        std::vector<float> expected(n, 0.0f);
        std::vector<float> bound(n, 0.0f);
        // The int8 scale is per segment: max|value| over the segment's
        // values. Segments and indices are both in order: one sweep.
        size_t k = 0;
        for (const auto& s : *segments) {
          const size_t first = k;
          float max_abs = 0.0f;
          for (; k < input.indices.size() && input.indices[k] < s.offset + s.count; ++k) {
            max_abs = std::max(max_abs, std::fabs(input.values[k]));
          }
          for (size_t j = first; j < k; ++j) {
            const uint64_t i = input.indices[j];
            const float x = input.values[j];
            expected[i] = x;
            bound[i] = e == Encoding::kSparseF32  ? 0.0f
                       : e == Encoding::kSparseF16 ? (std::fabs(x) >= 0x1p-14f ? std::ldexp(std::fabs(x), -11)
                                                                              : 0x1p-25f)
                                                   : quantization_bound(max_abs, 127);
          }
        }
        ASSERT_EQ(k, input.indices.size());
        for (uint64_t i = 0; i < n; ++i) {
          if (e == Encoding::kSparseF32) {
            ASSERT_EQ(bits_of(decoded[i]), bits_of(expected[i])) << "element " << i;
          } else {
            ASSERT_LE(std::fabs(decoded[i] - expected[i]), bound[i]) << "element " << i << " x=" << expected[i];
          }
        }
      }
    }
  }
}

TEST(CodecRoundTrip, SparseFirstIndexFarFromZeroWithTinySegments) {
  // The first index's gap does not fit a minimal segment: an empty segment
  // covers [0, index) and the value starts the next one.
  const std::vector<uint64_t> indices = {1000000, 1000001, 5000000};
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  auto segments = encode_sparse(0, 6000000, indices, values, Encoding::kSparseF32, 5);
  ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
  const auto manifest = one_tensor(6000000);
  expect_tiling(*segments, 6000000, 5, manifest);
  std::vector<float> decoded(6000000, 7.0f);
  for (const auto& s : *segments) ASSERT_TRUE(decode_segment(s.view(), manifest, decoded).is_ok());
  for (size_t k = 0; k < indices.size(); ++k) EXPECT_EQ(decoded[indices[k]], values[k]);
  EXPECT_EQ(std::count(decoded.begin(), decoded.end(), 0.0f), 6000000 - 3);
}

TEST(CodecRoundTrip, DctSignDecodesToTheInverseDctOfSignedScales) {
  // Two chunks and a 100-element tail (zero-padded to a third chunk).
  const uint64_t n = 2 * kernels::kDctChunk + 100;
  const std::vector<uint64_t> positions = {0, 5, 4095, 4096 + 17, 8192 + 1, 8192 + 4000};
  const std::vector<uint8_t> negative = {0, 1, 0, 1, 1, 0};
  const std::vector<float> scales = {0.5f, 2.0f, 0.25f};
  for (const size_t max_bytes : {size_t{16}, size_t{1} << 20}) {
    auto segments = encode_dct_sign(0, n, positions, negative, scales, max_bytes);
    ASSERT_TRUE(segments.is_ok()) << segments.status().to_string();
    EXPECT_EQ(segments->size(), max_bytes == 16 ? 3u : 1u) << "a tiny budget puts one chunk in each segment";
    const auto manifest = one_tensor(n);
    const std::vector<float> decoded = decode_all(*segments, manifest, n);
    std::vector<float> coefficients(3 * kernels::kDctChunk, 0.0f), expected(coefficients.size());
    for (size_t k = 0; k < positions.size(); ++k) {
      const float scale = scales[positions[k] / kernels::kDctChunk];
      coefficients[positions[k]] = negative[k] ? -scale : scale;
    }
    for (uint64_t c = 0; c < 3; ++c) {
      kernels::idct_chunk(coefficients.data() + c * kernels::kDctChunk, expected.data() + c * kernels::kDctChunk);
    }
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(decoded[i], expected[i]) << i;
  }
}

TEST(CodecRejects, MalformedBitmapsAndDctSegments) {
  const uint64_t n = 20;
  const auto manifest = one_tensor(n);
  std::vector<float> target(n, 1.0f);
  const std::vector<uint64_t> indices = {1, 9, 19};
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  auto bitmap = encode_sparse(0, n, indices, values, Encoding::kSparseBitmapF32, 1 << 20);
  ASSERT_TRUE(bitmap.is_ok());
  EncodedSegment s = (*bitmap)[0];
  ASSERT_EQ(s.indices.size(), 3u);
  const auto rejects = [&](const EncodedSegment& segment, const std::string& phrase) {
    const Status status = accumulate_segment(segment.view(), manifest, 1.0f, target);
    EXPECT_EQ(status.code(), StatusCode::kCorrupt);
    EXPECT_NE(status.message().find(phrase), std::string::npos) << status.message();
    EXPECT_EQ(target, std::vector<float>(n, 1.0f)) << "a rejected segment writes nothing";
  };
  EncodedSegment past = s;
  past.indices[2] |= 0x80;  // bit 23 of a 20-element segment
  rejects(past, "past the segment");
  EncodedSegment extra = s;
  extra.indices[0] |= 0x01;  // a fourth set bit for nnz 3
  rejects(extra, "more than nnz");
  EncodedSegment fewer = s;
  fewer.indices[1] = 0;  // index 9 cleared: 2 bits for nnz 3
  rejects(fewer, "sets 2 bits");
  EncodedSegment short_map = s;
  short_map.indices.pop_back();
  rejects(short_map, "bitmap of 20 elements");

  const uint64_t m = kernels::kDctChunk + 10;
  const auto dct_manifest = one_tensor(m);
  Rng rng(kSeed + 9);
  auto dct = encode_random_dct(rng, m, 3, 1 << 20);
  ASSERT_TRUE(dct.is_ok());
  std::vector<float> dct_target(m, 1.0f);
  const auto dct_rejects = [&](const EncodedSegment& segment, const std::string& phrase) {
    const Status status = accumulate_segment(segment.view(), dct_manifest, 1.0f, dct_target);
    EXPECT_EQ(status.code(), StatusCode::kCorrupt);
    EXPECT_NE(status.message().find(phrase), std::string::npos) << status.message();
  };
  EncodedSegment shifted = (*dct)[0];
  shifted.offset = 1;
  shifted.count -= 1;
  dct_rejects(shifted, "4096-element DCT chunk");
  EncodedSegment signs = (*dct)[0];
  signs.values.back() |= 0x80;  // 6 signs: bit 7 is padding
  dct_rejects(signs, "sign bits past nnz");
  EncodedSegment scales = (*dct)[0];
  scales.scales.pop_back();
  dct_rejects(scales, "chunk scales");
  EncodedSegment partial = (*dct)[0];
  partial.count = 4100;  // neither whole chunks nor the tensor's end
  dct_rejects(partial, "whole 4096-element chunks");
  EXPECT_EQ(dct_target, std::vector<float>(m, 1.0f));
}

// ---- accumulate ----------------------------------------------------------------

TEST(CodecAccumulate, AddsWeightTimesDecodedForEveryEncoding) {
  Rng rng(kSeed + 4);
  for (int i = 0; i < kEncodingCount; ++i) {
    const auto e = static_cast<Encoding>(i);
    for (uint64_t n : {uint64_t{1}, uint64_t{97}, uint64_t{4099}}) {
      std::vector<EncodedSegment> segments;
      const std::vector<float> values = random_values(rng, n, 6.0);
      if (e == Encoding::kDctSign) {
        auto r = encode_random_dct(rng, n, 10, 100);
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        segments = std::move(r).value();
      } else if (encoding_is_sparse(e)) {
        const SparseInput input = random_sparse(rng, n, 0.3, 6.0);
        auto r = encode_sparse(0, n, input.indices, input.values, e, 200);
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        segments = std::move(r).value();
      } else if (encoding_is_block(e)) {
        auto r = encode_blocks(0, values, e, 32, 300);
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        segments = std::move(r).value();
      } else {
        auto r = encode_dense(0, values, e, 400);
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        segments = std::move(r).value();
      }
      const auto manifest = one_tensor(n);
      const std::vector<float> decoded = decode_all(segments, manifest, n);
      std::vector<float> target = random_values(rng, n, 4.0);
      const std::vector<float> before = target;
      const float weight = static_cast<float>(rng.uniform() * 4 - 2);
      for (const auto& s : segments) {
        const Status status = accumulate_segment(s.view(), manifest, weight, target);
        ASSERT_TRUE(status.is_ok()) << status.to_string();
      }
      for (uint64_t j = 0; j < n; ++j) {
        const float expected = before[j] + weight * decoded[j];
        ASSERT_EQ(target[j], expected) << encoding_name(e) << " n=" << n << " element " << j;
      }
    }
  }
}

TEST(CodecAccumulate, DenseF32AccumulatesIntoALargeTarget) {
  Rng rng(kSeed + 5);
  const uint64_t n = 1 << 20;
  const std::vector<float> values = random_values(rng, n, 4.0);
  auto segments = encode_dense(0, values, Encoding::kDenseF32, 1 << 18);
  ASSERT_TRUE(segments.is_ok());
  EXPECT_EQ(segments->size(), 16u);
  const auto manifest = one_tensor(n);
  std::vector<float> target(n, 1.0f);
  for (const auto& s : *segments) ASSERT_TRUE(accumulate_segment(s.view(), manifest, 0.5f, target).is_ok());
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(target[i], 1.0f + 0.5f * values[i]) << i;
}

TEST(CodecAccumulate, RejectsNonFiniteWeightAndWrongTargetSize) {
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  auto segments = encode_dense(0, values, Encoding::kDenseF32, 1024);
  ASSERT_TRUE(segments.is_ok());
  const auto manifest = one_tensor(3);
  std::vector<float> target(3, 1.0f);
  EXPECT_EQ(accumulate_segment(segments->front().view(), manifest, kNaN, target).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(accumulate_segment(segments->front().view(), manifest, kInf, target).code(), StatusCode::kInvalidArgument);
  std::vector<float> small(2, 1.0f);
  EXPECT_EQ(accumulate_segment(segments->front().view(), manifest, 1.0f, small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_segment(segments->front().view(), manifest, small).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(target, std::vector<float>(3, 1.0f));
  EXPECT_EQ(small, std::vector<float>(2, 1.0f));
}

// ---- encoder arguments ------------------------------------------------------------

TEST(CodecEncode, RejectsNonFiniteInputs) {
  for (float bad : {kNaN, kInf, -kInf}) {
    const std::vector<float> values = {1.0f, bad, 2.0f};
    for (Encoding e : kDenseEncodings) {
      EXPECT_EQ(encode_dense(0, values, e, 1024).status().code(), StatusCode::kInvalidArgument) << encoding_name(e);
    }
    for (Encoding e : kBlockEncodings) {
      EXPECT_EQ(encode_blocks(0, values, e, 2, 1024).status().code(), StatusCode::kInvalidArgument);
    }
    const std::vector<uint64_t> indices = {0, 4, 9};
    for (Encoding e : kSparseEncodings) {
      EXPECT_EQ(encode_sparse(0, 10, indices, values, e, 1024).status().code(), StatusCode::kInvalidArgument);
    }
  }
  // Finite in fp32 but Inf once rounded to the half type.
  const std::vector<float> big = {1e6f};
  EXPECT_EQ(encode_dense(0, big, Encoding::kDenseF16, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_dense(0, big, Encoding::kDenseBf16, 64).is_ok());
  const std::vector<float> huge = {kFloatMax};
  EXPECT_EQ(encode_dense(0, huge, Encoding::kDenseBf16, 64).status().code(), StatusCode::kInvalidArgument);
  const std::vector<uint64_t> one = {0};
  EXPECT_EQ(encode_sparse(0, 1, one, big, Encoding::kSparseF16, 64).status().code(), StatusCode::kInvalidArgument);
  // Each side of the magnitude that rounds to Inf (the check compares bits
  // instead of converting): fp16 below 65520 is kept, 65520 is not; bf16 the
  // same halfway past its largest finite value. Both signs, among many
  // values, and with the element named.
  for (const auto& [e, last_finite] : {std::pair{Encoding::kDenseF16, 0x477fefffu},
                                       std::pair{Encoding::kDenseBf16, 0x7f7f7fffu}}) {
    for (const float sign : {1.0f, -1.0f}) {
      SCOPED_TRACE(std::string(encoding_name(e)) + (sign < 0 ? " negative" : " positive"));
      std::vector<float> values(1000, 0.5f);
      values[777] = sign * std::bit_cast<float>(last_finite);
      EXPECT_TRUE(encode_dense(0, values, e, 1 << 12).is_ok());
      values[777] = sign * std::bit_cast<float>(last_finite + 1);
      const auto refused = encode_dense(0, values, e, 1 << 12);
      ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.status().message().find("element 777"), std::string::npos) << refused.status().message();
    }
  }
}

TEST(CodecEncode, RejectsBadArguments) {
  const std::vector<float> values(10, 1.0f);
  // Too small for one element or block.
  EXPECT_EQ(encode_dense(0, values, Encoding::kDenseF32, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_dense(0, values, Encoding::kDenseF16, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_dense(0, values, Encoding::kDenseF16, 2).is_ok());
  EXPECT_EQ(encode_blocks(0, values, Encoding::kBlockInt8, 8, 11).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_blocks(0, values, Encoding::kBlockInt8, 8, 12).is_ok());
  EXPECT_EQ(encode_blocks(0, values, Encoding::kBlockInt4, 7, 7).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_blocks(0, values, Encoding::kBlockInt4, 7, 8).is_ok());
  // Block sizes and encodings.
  EXPECT_EQ(encode_blocks(0, values, Encoding::kBlockInt8, 0, 1024).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_blocks(0, values, Encoding::kBlockInt8, kMaxBlockSize + 1, 1 << 20).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_blocks(0, values, Encoding::kDenseF32, 8, 1024).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_dense(0, values, Encoding::kBlockInt8, 1024).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_dense(0, values, Encoding::kSparseF32, 1024).status().code(), StatusCode::kInvalidArgument);
  // Sparse: sorted, unique, in range, one value each, room for one entry.
  const std::vector<float> two = {1.0f, 2.0f};
  const std::vector<uint64_t> unsorted = {5, 2}, duplicate = {3, 3}, outside = {1, 10}, good = {1, 9};
  EXPECT_EQ(encode_sparse(0, 10, unsorted, two, Encoding::kSparseF32, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_sparse(0, 10, duplicate, two, Encoding::kSparseF32, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_sparse(0, 10, outside, two, Encoding::kSparseF32, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_sparse(0, 10, good, values, Encoding::kSparseF32, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_sparse(0, 10, good, two, Encoding::kDenseF32, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_sparse(0, 10, good, two, Encoding::kSparseF32, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(encode_sparse(0, 10, good, two, Encoding::kSparseInt8, 5).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(encode_sparse(0, 10, good, two, Encoding::kSparseInt8, 6).is_ok());
}

// ---- rejection of malformed segments ------------------------------------------------

// A target filled with a recognizable pattern; after a rejected segment it must
// be bit-for-bit the same.
std::vector<float> pattern_target(uint64_t n) {
  std::vector<float> target(n);
  for (uint64_t i = 0; i < n; ++i) target[i] = static_cast<float>(i % 13) * 0.25f - 1.0f;
  return target;
}

// Every malformed segment must be rejected as kCorrupt by decode and by
// accumulate, without touching the target; where check_segment can see the
// problem (lengths, header, scales) it must reject it too. message_part names
// what the message must mention.
void expect_rejected(const SegmentView& view, std::span<const TensorShape> manifest, uint64_t target_size,
                     const std::string& message_part, bool check_sees_it) {
  SCOPED_TRACE("expecting \"" + message_part + "\"");
  const std::vector<float> original = pattern_target(target_size);
  std::vector<float> target = original;
  const Status decoded = decode_segment(view, manifest, target);
  EXPECT_EQ(decoded.code(), StatusCode::kCorrupt) << decoded.to_string();
  EXPECT_NE(decoded.message().find(message_part), std::string::npos) << decoded.message();
  EXPECT_EQ(std::memcmp(target.data(), original.data(), target_size * sizeof(float)), 0) << "decode touched target";
  for (float weight : {1.0f, -0.5f}) {
    const Status accumulated = accumulate_segment(view, manifest, weight, target);
    EXPECT_EQ(accumulated.code(), StatusCode::kCorrupt) << accumulated.to_string();
    EXPECT_NE(accumulated.message().find(message_part), std::string::npos) << accumulated.message();
    EXPECT_EQ(std::memcmp(target.data(), original.data(), target_size * sizeof(float)), 0)
        << "accumulate touched target";
  }
  const Status checked = check_segment(view, manifest);
  if (check_sees_it) {
    EXPECT_EQ(checked.code(), StatusCode::kCorrupt) << checked.to_string();
  } else {
    EXPECT_TRUE(checked.is_ok()) << "check_segment is documented not to parse values/indices: " << checked.to_string();
  }
}

class CodecReject : public ::testing::Test {
 protected:
  static constexpr uint64_t kN = 40;
  const std::vector<TensorShape> manifest_ = {TensorShape{"first", {3}}, TensorShape{"w", {5, 8}}};

  // A valid segment of tensor 1 covering [8, 8 + values.size()).
  EncodedSegment dense(Encoding e, std::vector<float> values) {
    auto r = encode_dense(1, values, e, 1 << 20);
    EXPECT_TRUE(r.is_ok());
    EncodedSegment s = r->front();
    s.offset = 8;
    EXPECT_TRUE(check_segment(s.view(), manifest_).is_ok());
    return s;
  }
  EncodedSegment blocks(Encoding e, std::vector<float> values, uint32_t block_size) {
    auto r = encode_blocks(1, values, e, block_size, 1 << 20);
    EXPECT_TRUE(r.is_ok());
    EXPECT_EQ(r->size(), 1u);
    EncodedSegment s = r->front();
    s.offset = 8;
    EXPECT_TRUE(check_segment(s.view(), manifest_).is_ok());
    return s;
  }
  // Sparse segment covering the whole tensor 1.
  EncodedSegment sparse(Encoding e, std::vector<uint64_t> indices, std::vector<float> values) {
    auto r = encode_sparse(1, kN, indices, values, e, 1 << 20);
    EXPECT_TRUE(r.is_ok());
    EXPECT_EQ(r->size(), 1u);
    return r->front();
  }
  void expect_ok(const EncodedSegment& s) {
    std::vector<float> target = pattern_target(kN);
    const Status status = accumulate_segment(s.view(), manifest_, 1.0f, target);
    EXPECT_TRUE(status.is_ok()) << status.to_string();
  }
  void rejected(const EncodedSegment& s, const std::string& message_part, bool check_sees_it = true) {
    expect_rejected(s.view(), manifest_, kN, message_part, check_sees_it);
  }
};

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) + 0.5f;
  return v;
}

TEST_F(CodecReject, HeaderFields) {
  EncodedSegment s = dense(Encoding::kDenseF32, ramp(16));
  expect_ok(s);

  EncodedSegment bad = s;
  bad.tensor = 2;
  rejected(bad, "manifest has 2 tensors");
  bad.tensor = 0xffffffffu;
  rejected(bad, "manifest has 2 tensors");

  bad = s;
  bad.offset = 25;  // [25, 41) in a 40-element tensor
  rejected(bad, "outside the tensor's 40 elements");
  bad.offset = std::numeric_limits<uint64_t>::max() - 3;  // offset + count wraps
  rejected(bad, "outside the tensor's 40 elements");

  bad = s;
  bad.count = 0;
  bad.values.clear();
  rejected(bad, "covers no elements");

  bad = s;
  bad.encoding = static_cast<Encoding>(kEncodingCount);
  rejected(bad, "unknown encoding 12");
  bad.encoding = static_cast<Encoding>(255);
  rejected(bad, "unknown encoding 255");

  bad = s;
  bad.nnz = 3;
  rejected(bad, "nnz is 3");
  bad = s;
  bad.block_size = 16;
  rejected(bad, "block_size is 16");
  bad = s;
  bad.indices = {0};
  rejected(bad, "indices has 1 bytes");
  bad = s;
  bad.scales = {0, 0, 0, 0};
  rejected(bad, "scales has 4 bytes");
}

TEST_F(CodecReject, DenseByteLengths) {
  for (Encoding e : kDenseEncodings) {
    SCOPED_TRACE(encoding_name(e));
    EncodedSegment s = dense(e, ramp(4));
    expect_ok(s);
    const size_t bytes = s.values.size();
    EncodedSegment bad = s;
    bad.values.pop_back();
    rejected(bad, "values has " + std::to_string(bytes - 1) + " bytes, " + std::to_string(bytes) + " expected for 4 ");
    bad = s;
    bad.values.push_back(0);
    rejected(bad, "values has " + std::to_string(bytes + 1) + " bytes");
    bad = s;
    bad.count = 5;  // the values of 4
    rejected(bad, "expected for 5 ");
  }
  // The exact message of the brief's example.
  EncodedSegment s = dense(Encoding::kDenseF32, ramp(4));
  s.values.resize(12);
  rejected(s, "values has 12 bytes, 16 expected for 4 fp32 values");
}

TEST_F(CodecReject, NonFiniteDenseValues) {
  // The bad value is the last one: a half-applying decoder would have
  // written the others before seeing it.
  for (float bad_value : {kNaN, kInf, -kInf}) {
    EncodedSegment s = dense(Encoding::kDenseF32, ramp(16));
    std::memcpy(s.values.data() + 15 * 4, &bad_value, 4);
    rejected(s, "element 23", /*check_sees_it=*/false);

    // bf16 and fp16 NaN/Inf bit patterns.
    EncodedSegment b = dense(Encoding::kDenseBf16, ramp(16));
    const uint16_t bf = to_bf16(bad_value).bits;
    std::memcpy(b.values.data() + 15 * 2, &bf, 2);
    rejected(b, "element 23", false);
    EncodedSegment h = dense(Encoding::kDenseF16, ramp(16));
    const uint16_t hb = to_fp16(bad_value).bits;
    std::memcpy(h.values.data() + 15 * 2, &hb, 2);
    rejected(h, "element 23", false);
  }
}

TEST_F(CodecReject, AccumulateOverflowLeavesTargetUnchanged) {
  EncodedSegment s = dense(Encoding::kDenseF32, std::vector<float>(16, kFloatMax));
  // Decoding is fine; accumulating FLT_MAX into a positive target is not.
  std::vector<float> target(kN, 0.0f);
  ASSERT_TRUE(decode_segment(s.view(), manifest_, target).is_ok());
  target = pattern_target(kN);
  target[20] = kFloatMax;
  const std::vector<float> before = target;
  const Status status = accumulate_segment(s.view(), manifest_, 1.0f, target);
  EXPECT_EQ(status.code(), StatusCode::kCorrupt) << status.to_string();
  EXPECT_NE(status.message().find("element 20"), std::string::npos) << status.message();
  EXPECT_EQ(std::memcmp(target.data(), before.data(), kN * 4), 0);
  // Weight large enough to overflow on its own.
  EncodedSegment one = dense(Encoding::kDenseF32, std::vector<float>(4, 1e30f));
  target = pattern_target(kN);
  const std::vector<float> fresh = target;
  EXPECT_EQ(accumulate_segment(one.view(), manifest_, 1e10f, target).code(), StatusCode::kCorrupt);
  EXPECT_EQ(std::memcmp(target.data(), fresh.data(), kN * 4), 0);
}

TEST_F(CodecReject, SparseIndices) {
  const std::vector<float> three = {1.0f, 2.0f, 3.0f};
  EncodedSegment s = sparse(Encoding::kSparseF32, {2, 5, 39}, three);
  expect_ok(s);
  ASSERT_EQ(s.indices, (std::vector<uint8_t>{2, 3, 34}));

  EncodedSegment bad = s;
  bad.indices = {5, 0, 34};  // gap 0: index 1 repeats index 0
  rejected(bad, "repeats index 0", false);
  bad.indices = {2, 3, 35};  // 5 + 35 = 40: one past the end
  rejected(bad, "past the segment's end 40", false);
  bad.indices = {40, 1, 1};  // the first index past the end
  rejected(bad, "index 0 is offset + 40", false);
  // Unsorted (5, then 2): the gap is -3 as an unsigned 64-bit number, so it
  // wraps past the end.
  bad.indices = {5, 0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 1};
  rejected(bad, "past the segment's end", false);
  // A segment that covers part of the tensor: indices relative to its offset.
  EncodedSegment part = s;
  part.offset = 10;
  part.count = 20;
  part.indices = {0, 1, 18};  // 10, 11, 29: fine
  expect_ok(part);
  part.indices = {0, 1, 19};  // 30: past [10, 30)
  rejected(part, "past the segment's end 30", false);
}

TEST_F(CodecReject, SparseVarints) {
  const std::vector<float> three = {1.0f, 2.0f, 3.0f};
  EncodedSegment s = sparse(Encoding::kSparseF32, {2, 5, 39}, three);
  EncodedSegment bad = s;
  bad.indices = {2, 3, 0x80};  // truncated: continuation bit on the last byte
  rejected(bad, "truncated", false);
  bad.indices = {2, 0x83, 0x80, 0x80};  // the second varint swallows the third's bytes
  rejected(bad, "truncated", false);
  bad.indices = {2, 3, 34, 0};  // one byte after the third varint
  rejected(bad, "1 trailing bytes", false);
  bad.indices = {2, 0x83, 0x00, 34};  // 3 in two bytes
  rejected(bad, "overlong", false);
  bad.indices = {2, 3, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00};  // 11 bytes
  rejected(bad, "longer than 10 bytes", false);
  bad.indices = {2, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02};  // 2^64 or more
  rejected(bad, "64 bits", false);
  // Lengths check_segment can see without parsing: fewer bytes than varints,
  // more than ten bytes each.
  bad.indices = {2, 3};
  rejected(bad, "too few for 3 varints");
  bad.indices.assign(31, 0x80);
  rejected(bad, "more than 3 varints can take");
  bad = s;
  bad.nnz = 0;
  bad.values.clear();
  rejected(bad, "more than 0 varints can take");
  bad = s;
  bad.nnz = 41;
  rejected(bad, "nnz 41 is more than the 40 elements");
}

TEST_F(CodecReject, SparseValues) {
  const std::vector<float> three = {1.0f, 2.0f, 3.0f};
  EncodedSegment s = sparse(Encoding::kSparseF32, {2, 5, 39}, three);
  EncodedSegment bad = s;
  bad.values.pop_back();
  rejected(bad, "values has 11 bytes, 12 expected for 3 fp32 values");
  bad = s;
  std::memcpy(bad.values.data() + 8, &kNaN, 4);
  rejected(bad, "element 39 decodes to nan", false);

  EncodedSegment h = sparse(Encoding::kSparseF16, {2, 5, 39}, three);
  expect_ok(h);
  const uint16_t inf16 = to_fp16(kInf).bits;
  std::memcpy(h.values.data() + 4, &inf16, 2);
  rejected(h, "element 39 decodes to inf", false);
  h.scales = {0, 0, 0, 0};
  rejected(h, "scales has 4 bytes, 0 expected");

  EncodedSegment q = sparse(Encoding::kSparseInt8, {2, 5, 39}, three);
  expect_ok(q);
  ASSERT_EQ(q.scales.size(), 4u);
  EncodedSegment bad_scale = q;
  std::memcpy(bad_scale.scales.data(), &kInf, 4);
  rejected(bad_scale, "scale 0 is inf");
  std::memcpy(bad_scale.scales.data(), &kNaN, 4);
  rejected(bad_scale, "scale 0 is nan");
  const float negative = -1.0f;
  std::memcpy(bad_scale.scales.data(), &negative, 4);
  rejected(bad_scale, "scale 0 is -1");
  // A finite scale so large that q * scale overflows.
  std::memcpy(bad_scale.scales.data(), &kFloatMax, 4);
  rejected(bad_scale, "decodes to inf", false);
  bad_scale.scales.clear();
  rejected(bad_scale, "scales has 0 bytes, 4 expected for one fp32 scale");
}

TEST_F(CodecReject, Blocks) {
  for (Encoding e : kBlockEncodings) {
    SCOPED_TRACE(encoding_name(e));
    EncodedSegment s = blocks(e, ramp(20), 8);  // blocks of 8, 8, 4
    expect_ok(s);
    ASSERT_EQ(s.scales.size(), 12u);
    EncodedSegment bad = s;
    bad.block_size = 0;
    rejected(bad, "block_size 0 is outside [1, 65536]");
    bad.block_size = kMaxBlockSize + 1;
    rejected(bad, "block_size 65537");
    bad = s;
    bad.block_size = 7;  // 3 blocks of 7: scales fit, and the values still do
    expect_ok(bad);
    bad.block_size = 4;  // 5 blocks: 20 bytes of scales expected
    rejected(bad, "scales has 12 bytes, 20 expected for 5 fp32 scales");
    bad = s;
    bad.scales.push_back(0);
    rejected(bad, "scales has 13 bytes");
    bad = s;
    bad.values.pop_back();
    rejected(bad, "values has");
    bad = s;
    bad.nnz = 1;
    rejected(bad, "nnz is 1");
    // Scales: Inf, NaN, negative; the last block's, so nothing could be half-applied.
    for (float scale : {kInf, kNaN, -2.0f}) {
      bad = s;
      std::memcpy(bad.scales.data() + 8, &scale, 4);
      rejected(bad, "scale 2 is ");
    }
    // A finite scale whose products overflow.
    bad = s;
    std::memcpy(bad.scales.data() + 8, &kFloatMax, 4);
    rejected(bad, "decodes to inf", false);
  }
}

TEST_F(CodecReject, Int4Nibbles) {
  EncodedSegment s = blocks(Encoding::kBlockInt4, ramp(20), 8);
  EncodedSegment bad = s;
  bad.values.back() = static_cast<uint8_t>((bad.values.back() & 0x0f) | 0x80);  // element 19 = -8
  rejected(bad, "int4 value 19 is -8", false);
  bad = s;
  bad.values[0] = static_cast<uint8_t>((bad.values[0] & 0xf0) | 0x08);  // element 0 = -8
  rejected(bad, "int4 value 0 is -8", false);
  // Odd count: the high nibble of the last byte is unused and must be 0.
  EncodedSegment odd = blocks(Encoding::kBlockInt4, ramp(7), 4);
  expect_ok(odd);
  ASSERT_EQ(odd.values.size(), 4u);
  EXPECT_EQ(odd.values[3] >> 4, 0);
  odd.values[3] |= 0x10;
  rejected(odd, "unused high nibble", false);
  // -7..7 round-trips (and int8 -128 is an int8).
  EncodedSegment full = blocks(Encoding::kBlockInt4, {-7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7}, 16);
  std::vector<float> target(kN, 0.0f);
  ASSERT_TRUE(decode_segment(full.view(), manifest_, target).is_ok());
  for (int i = 0; i < 15; ++i) EXPECT_EQ(target[8 + i], static_cast<float>(i - 7));
}

TEST_F(CodecReject, ErrorMessagesNameTheTensor) {
  EncodedSegment s = dense(Encoding::kDenseF32, ramp(4));
  s.values.resize(12);
  std::vector<float> target(kN);
  const Status status = decode_segment(s.view(), manifest_, target);
  EXPECT_EQ(status.message(),
            "tensor 1 ('w') segment at offset 8 (dense-f32): values has 12 bytes, 16 expected for 4 fp32 values");
}

// A dct-sign selection: k random coefficients per 4096-element chunk.
Result<std::vector<EncodedSegment>> encode_random_dct(Rng& rng, uint64_t n, uint64_t k, size_t max_bytes) {
  const uint64_t chunks = (n + kernels::kDctChunk - 1) / kernels::kDctChunk;
  std::vector<uint64_t> positions;
  std::vector<uint8_t> negative;
  std::vector<float> scales;
  for (uint64_t c = 0; c < chunks; ++c) {
    std::vector<uint64_t> chosen;
    while (chosen.size() < k) {
      const uint64_t p = c * kernels::kDctChunk + rng.below(kernels::kDctChunk);
      if (std::find(chosen.begin(), chosen.end(), p) == chosen.end()) chosen.push_back(p);
    }
    std::sort(chosen.begin(), chosen.end());
    for (const uint64_t p : chosen) {
      positions.push_back(p);
      negative.push_back(rng.below(2) == 1);
    }
    scales.push_back(static_cast<float>(rng.uniform() * 2));
  }
  return encode_dct_sign(0, n, positions, negative, scales, max_bytes);
}

Result<std::vector<EncodedSegment>> encode_random(Rng& rng, Encoding e, uint64_t n) {
  if (e == Encoding::kDctSign) return encode_random_dct(rng, n, 1 + rng.below(20), 64 + rng.below(200));
  if (encoding_is_sparse(e)) {
    const SparseInput input = random_sparse(rng, n, 0.2, 6.0);
    return encode_sparse(0, n, input.indices, input.values, e, 64 + rng.below(200));
  }
  const std::vector<float> values = random_values(rng, n, 6.0);
  if (encoding_is_block(e)) {
    return encode_blocks(0, values, e, 1 + static_cast<uint32_t>(rng.below(40)), 300 + rng.below(300));
  }
  return encode_dense(0, values, e, 64 + rng.below(400));
}

// Seeded random corruption of valid segments of every encoding: whatever
// comes back, a rejection leaves the target as it was, and a success writes
// only finite values inside the segment's range.
TEST(CodecMutations, RejectedOrFiniteAndInRange) {
  Rng rng(kSeed + 6);
  const uint64_t n = 300;
  const auto manifest = one_tensor(n);
  int rejected = 0, accepted = 0;
  for (int round = 0; round < 3000; ++round) {
    const auto e = static_cast<Encoding>(rng.below(kEncodingCount));
    Result<std::vector<EncodedSegment>> r = encode_random(rng, e, n);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EncodedSegment s = (*r)[rng.below(r->size())];
    std::vector<uint8_t>* fields[] = {&s.indices, &s.values, &s.scales};
    const int mutations = 1 + static_cast<int>(rng.below(3));
    for (int m = 0; m < mutations; ++m) {
      std::vector<uint8_t>& field = *fields[rng.below(3)];
      switch (rng.below(8)) {
        case 0: if (!field.empty()) field[rng.below(field.size())] ^= static_cast<uint8_t>(1u << rng.below(8)); break;
        case 1: if (!field.empty()) field[rng.below(field.size())] = static_cast<uint8_t>(rng.next_u64()); break;
        case 2: if (!field.empty()) field.pop_back(); break;
        case 3: field.push_back(static_cast<uint8_t>(rng.next_u64())); break;
        case 4: s.offset += rng.below(3); break;
        case 5: s.count = s.count + rng.below(3) - 1; break;
        case 6: if (encoding_is_sparse(s.encoding)) s.nnz = s.nnz + rng.below(3) - 1; break;
        default: if (field.size() >= 4) std::fill(field.end() - 4, field.end(), 0xff); break;
      }
    }
    std::vector<float> target = pattern_target(n);
    const std::vector<float> before = target;
    const Status status = accumulate_segment(s.view(), manifest, 0.75f, target);
    if (!status.is_ok()) {
      ++rejected;
      ASSERT_EQ(status.code(), StatusCode::kCorrupt) << status.to_string();
      ASSERT_EQ(std::memcmp(target.data(), before.data(), n * 4), 0) << status.to_string();
    } else {
      ++accepted;
      for (uint64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(target[i])) << i;
        if (i < s.offset || i >= s.offset + s.count) {
          ASSERT_EQ(bits_of(target[i]), bits_of(before[i])) << i;
        }
      }
    }
  }
  EXPECT_GT(rejected, 1000);
  EXPECT_GT(accepted, 100);
}

}  // namespace
}  // namespace fedmesh::protocol
