// BLAKE2b-256 (libsodium's crypto_generichash): the hash of chunks, update
// descriptors, model versions and every other record fedmesh checks.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

namespace fedmesh::crypto {

inline constexpr size_t kHashBytes = 32;
using Hash = std::array<uint8_t, kHashBytes>;

Hash hash_bytes(std::span<const uint8_t> bytes);

// Incremental BLAKE2b-256 over several spans (a chunk built from parts).
class Hasher {
 public:
  Hasher();
  void update(std::span<const uint8_t> bytes);
  // Framing for hashes over records: a u64 as 8 little-endian bytes; text as
  // its length (u64) then its bytes, so no two field sequences collide.
  void update_u64(uint64_t value) {
    uint8_t bytes[8];
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(value >> (8 * i));
    update(bytes);
  }
  void update_text(std::string_view text) {
    update_u64(text.size());
    update({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  }
  Hash finish();

 private:
  alignas(64) std::array<uint8_t, 384> state_{};  // crypto_generichash_state
};

}  // namespace fedmesh::crypto
