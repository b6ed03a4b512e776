// The checksums the store keeps of a tensor's or a pending update's bytes,
// and the hashers that make them as the bytes are written or read.
//
// Stored form (a BLOB): BLAKE2b-256 as its 32 bytes (stores before schema
// version 8 for tensors, 9 for pending updates), BLAKE2bp-256 as the kind
// byte 1 and its 32 (crypto/tree_hash.h: the same strength, two to three
// times as fast on one core), which is what the store writes now.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "crypto/hash.h"
#include "crypto/tree_hash.h"
#include "crypto/update_signature.h"

namespace fedmesh::store {

struct StoredChecksum {
  crypto::ChunkHash kind = crypto::ChunkHash::kBlake2b;
  crypto::Hash hash{};
};

std::vector<uint8_t> checksum_blob(const StoredChecksum& checksum);
// nullopt: neither 32 bytes nor the kind byte 1 and 32.
std::optional<StoredChecksum> parse_checksum_blob(std::span<const uint8_t> blob);

// Bytes hashed as they come, with the kind a checksum is.
class ChecksumHasher {
 public:
  explicit ChecksumHasher(crypto::ChunkHash kind) : tree_(kind == crypto::ChunkHash::kBlake2bp) {}
  void update(std::span<const uint8_t> bytes) {
    if (tree_) {
      tree_hasher_.update(bytes);
    } else {
      hasher_.update(bytes);
    }
  }
  crypto::Hash finish() { return tree_ ? tree_hasher_.finish() : hasher_.finish(); }

 private:
  bool tree_;
  crypto::Hasher hasher_;
  crypto::TreeHasher tree_hasher_;
};

}  // namespace fedmesh::store
