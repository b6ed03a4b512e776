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

// Refuses, as corrupt and saying why, a payload that is cut short, of an
// unknown version, or whose delta does not have `expected_values` values.
Result<PendingPayload> decode_pending_payload(std::span<const uint8_t> bytes, size_t expected_values);

}  // namespace fedmesh::store
