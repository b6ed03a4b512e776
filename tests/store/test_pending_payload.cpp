// The pending-update payload (store/pending_payload.h): what the aggregator
// keeps of an acknowledged update, in a versioned little-endian format that
// reads back bit for bit, refuses damage by name, and still reads payloads
// written before it had a version.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "store/pending_payload.h"

namespace fedmesh::store {
namespace {

PendingPayload example() {
  PendingPayload p;
  p.header.round = 7;
  p.header.base_version = -3;  // any int64, the sign included
  p.header.sample_count = int64_t{1} << 40;
  p.header.local_loss = 0.125;
  p.header.local_accuracy = std::nextafter(0.5, 1.0);
  p.delta = {1.0f, -0.0f, std::numeric_limits<float>::denorm_min(), 3.0e38f, -2.25f};
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(PendingPayload, RoundTripsBitForBit) {
  const PendingPayload p = example();
  const std::vector<uint8_t> bytes = encode_pending_payload(p.header, p.delta);
  Result<PendingPayload> back = decode_pending_payload(bytes, p.delta.size());
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->header.round, p.header.round);
  EXPECT_EQ(back->header.base_version, p.header.base_version);
  EXPECT_EQ(back->header.sample_count, p.header.sample_count);
  EXPECT_EQ(std::bit_cast<uint64_t>(back->header.local_loss), std::bit_cast<uint64_t>(p.header.local_loss));
  EXPECT_EQ(std::bit_cast<uint64_t>(back->header.local_accuracy), std::bit_cast<uint64_t>(p.header.local_accuracy));
  EXPECT_TRUE(same_bits(back->delta, p.delta));
}

// The layout is pinned byte for byte: magic, version, little-endian fields.
TEST(PendingPayload, LayoutIsLittleEndianAndVersioned) {
  PendingHeader h;
  h.round = 0x0102030405060708;
  h.base_version = 1;
  h.sample_count = 2;
  h.local_loss = 1.0;  // 0x3ff0000000000000
  h.local_accuracy = 0.0;
  const std::vector<float> delta = {1.0f};  // 0x3f800000
  const std::vector<uint8_t> bytes = encode_pending_payload(h, delta);
  const std::vector<uint8_t> expected = {
      'F', 'M', 'P', 'U', 1, 0, 0, 0,
      8, 7, 6, 5, 4, 3, 2, 1,
      1, 0, 0, 0, 0, 0, 0, 0,
      2, 0, 0, 0, 0, 0, 0, 0,
      0, 0, 0, 0, 0, 0, 0xf0, 0x3f,
      0, 0, 0, 0, 0, 0, 0, 0,
      1, 0, 0, 0, 0, 0, 0, 0,
      0, 0, 0x80, 0x3f};
  EXPECT_EQ(bytes, expected);
}

TEST(PendingPayload, RefusesDamageByName) {
  const PendingPayload p = example();
  std::vector<uint8_t> bytes = encode_pending_payload(p.header, p.delta);
  // Cut short, inside the header and inside the delta.
  for (size_t size : {size_t{6}, size_t{20}, bytes.size() - 1}) {
    Result<PendingPayload> r = decode_pending_payload(std::span<const uint8_t>(bytes).first(size), p.delta.size());
    ASSERT_FALSE(r.is_ok()) << size;
    EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  }
  // Another model's size.
  Result<PendingPayload> other = decode_pending_payload(bytes, p.delta.size() + 1);
  ASSERT_FALSE(other.is_ok());
  EXPECT_NE(other.status().message().find("not the model's"), std::string::npos) << other.status().message();
  // A version from the future.
  bytes[4] = 2;
  Result<PendingPayload> future = decode_pending_payload(bytes, p.delta.size());
  ASSERT_FALSE(future.is_ok());
  EXPECT_NE(future.status().message().find("version 2"), std::string::npos) << future.status().message();
}

// A payload of the format without a version: three int64, two doubles, the
// delta, as the aggregator wrote them on a little-endian machine.
TEST(PendingPayload, ReadsThePayloadsWrittenBeforeTheVersion) {
  const PendingPayload p = example();
  std::vector<uint8_t> old(5 * 8 + p.delta.size() * sizeof(float));
  const int64_t ints[3] = {p.header.round, p.header.base_version, p.header.sample_count};
  const double reals[2] = {p.header.local_loss, p.header.local_accuracy};
  std::memcpy(old.data(), ints, sizeof ints);
  std::memcpy(old.data() + sizeof ints, reals, sizeof reals);
  std::memcpy(old.data() + 40, p.delta.data(), p.delta.size() * sizeof(float));
  Result<PendingPayload> back = decode_pending_payload(old, p.delta.size());
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->header.round, p.header.round);
  EXPECT_EQ(back->header.base_version, p.header.base_version);
  EXPECT_EQ(back->header.sample_count, p.header.sample_count);
  EXPECT_EQ(back->header.local_loss, p.header.local_loss);
  EXPECT_TRUE(same_bits(back->delta, p.delta));
  Result<PendingPayload> wrong = decode_pending_payload(std::span<const uint8_t>(old).first(old.size() - 4), p.delta.size());
  EXPECT_FALSE(wrong.is_ok());
}

}  // namespace
}  // namespace fedmesh::store
