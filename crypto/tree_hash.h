// BLAKE2bp-256: the hash of bulk bytes (an update's chunks). Four BLAKE2b
// leaves take the input's 128-byte blocks in turn (block j to leaf j mod 4)
// and a BLAKE2b root hashes their four 64-byte digests into 32 bytes, with
// BLAKE2's tree parameters (fanout 4, depth 2, inner length 64, leaf i at
// node offset i, the last leaf and the root flagged last node). On CPUs with
// AVX2 (checked once, at run time) the four leaves run in the four lanes of
// one vector: about three times BLAKE2b's speed on one core. Elsewhere the
// same bits from portable code. As strong as BLAKE2b (RFC 7693's tree mode).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "crypto/hash.h"

namespace fedmesh::crypto {

Hash tree_hash(std::span<const uint8_t> bytes);

namespace detail {
// One BLAKE2b node: its chain value, the bytes it has compressed, and the
// tree parameters it started from.
struct TreeNode {
  std::array<uint64_t, 8> h{};
  uint64_t counter = 0;
  bool last_node = false;
};
}  // namespace detail

// tree_hash over bytes given in pieces of any size (the same hash as over
// their concatenation). Keeps under 1 KiB of input back for the finish.
class TreeHasher {
 public:
  TreeHasher();
  void update(std::span<const uint8_t> bytes);
  Hash finish();

 private:
  std::array<detail::TreeNode, 4> leaves_;
  std::vector<uint8_t> pending_;  // input not yet compressed: from a stripe's start
};

// Whether tree_hash runs its AVX2 lanes on this CPU (for reports).
bool tree_hash_uses_avx2();

}  // namespace fedmesh::crypto
