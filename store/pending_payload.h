// What the aggregator keeps of an acknowledged update until a committed
// round applies it (the pending_updates table's payload): the update's round,
// base version and sample count, the site's reported loss and accuracy, and
// the delta. A versioned format with a fixed byte order, so that a store
// moves between machines and survives the program's upgrades:
//   "FMPU" | u32 version (1) | i64 round | i64 base_version | i64 sample_count
//   | f64 local_loss | f64 local_accuracy | u64 values | values x f32
// every number little-endian (f64 and f32 as their IEEE-754 bits). Payloads
// written before the format had a version (the same fields without the
// magic, version and count, in the writer's byte order, which was
// little-endian on every machine fedmesh ran on) are still read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"

namespace fedmesh::store {

inline constexpr uint32_t kPendingPayloadVersion = 1;

struct PendingHeader {
  int64_t round = 0;
  int64_t base_version = 0;
  int64_t sample_count = 0;
  double local_loss = 0.0;
  double local_accuracy = 0.0;
};

struct PendingPayload {
  PendingHeader header;
  std::vector<float> delta;
};

// The delta is read where it lies (an update's may be hundreds of MB).
std::vector<uint8_t> encode_pending_payload(const PendingHeader& header, std::span<const float> delta);

// The bytes a payload of `values` values begins with; the values follow as
// f32 little-endian. For a writer that streams the values from its own
// memory (pending_value_bytes) instead of joining them into one payload.
std::vector<uint8_t> encode_pending_header(const PendingHeader& header, uint64_t values);
// Values as the payload lays them out (f32 little-endian): their own bytes.
std::span<const uint8_t> pending_value_bytes(std::span<const float> values);

// The most bytes read_pending_layout needs from a payload's front.
inline constexpr size_t kPendingHeaderBytes = 56;
struct PendingLayout {
  PendingHeader header;
  size_t values_offset = 0;  // where the delta's values begin
};
// A payload of `total_bytes` whose first min(total_bytes, kPendingHeaderBytes)
// bytes are `front`: its header and where its values begin, refused as
// decode_pending_payload refuses it (for a reader that streams the values).
Result<PendingLayout> read_pending_layout(std::span<const uint8_t> front, uint64_t total_bytes, size_t expected_values);

// Refuses, as corrupt and saying why, a payload that is cut short, of an
// unknown version, or whose delta does not have `expected_values` values.
Result<PendingPayload> decode_pending_payload(std::span<const uint8_t> bytes, size_t expected_values);

}  // namespace fedmesh::store
