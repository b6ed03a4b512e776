// A gossip replica peer's own update as its store keeps it (a pending
// update's bytes, node/replica_sync.h): written by the peer, read back after
// a restart. The bytes come from a file, so reading them refuses anything
// malformed with what is wrong (fuzzed: tests/fuzz/fuzz_own_update.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/status.h"
#include "protocol/codec.h"
#include "protocol/update_transfer.h"

namespace fedmesh::node {

// An own update as a pending update's bytes, format 2 (written since
// 2026-12-07): "FMRO", version 2, round, the tensor count, then per tensor
// its encoding, block size and segment count, and per segment its fields
// (tensor, encoding, offset, count, nnz, block size) and its index, value
// and scale bytes, little-endian: the update as it was sent, so a restarted
// peer sends the very same bytes again and a dense update (int4 after
// AdamW) costs its encoded size, not 12 bytes a coordinate.
std::vector<uint8_t> encode_own_segments(uint64_t round, std::span<const protocol::EncodedTensor> tensors);
// Refused (naming what is wrong) unless well formed, of `round`, with one
// tensor per manifest entry and every segment checked and decodable as a
// receiver would check and decode it.
Result<std::vector<protocol::EncodedTensor>> decode_own_segments(std::span<const uint8_t> bytes, uint64_t round,
                                                                 std::span<const protocol::TensorShape> manifest);
// The format of an own update's bytes (1 or 2), 0 when they are none.
uint32_t own_update_format(std::span<const uint8_t> bytes);

// Format 1 (read, no longer written): "FMRO", version 1, round, count, then
// count flat indices (u64, ascending) and count values (f32), little-endian.
std::vector<uint8_t> encode_own_update(uint64_t round, std::span<const uint64_t> index, std::span<const float> value);
// Refused (naming what is wrong) unless well formed, of `round`, with
// indices ascending below `elements` and finite values.
Status decode_own_update(std::span<const uint8_t> bytes, uint64_t round, uint64_t elements, std::vector<uint64_t>& index,
                         std::vector<float>& value);

}  // namespace fedmesh::node
