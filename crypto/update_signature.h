// Signatures on model updates. A sender hashes every encoded chunk (BLAKE2b-
// 256, crypto_generichash), then signs the UpdateHeader's fields together
// with the hash of the list of chunk hashes. The header carries the chunk
// hashes, so a receiver verifies the signature once, on the header, and then
// each chunk on arrival against its hash: every byte it accumulates is
// authenticated, and a transfer can stream and resume chunk by chunk.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "crypto/keys.h"

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

// Who sent an update, to whom, for which round: the header fields the
// signature covers (protocol/ carries them as its UpdateMetadata).
struct UpdateMetadata {
  std::string federation;
  uint64_t round = 0;
  uint64_t base_version = 0;
  std::string sender;
  std::string recipient;
  uint64_t sequence = 0;
  uint64_t sample_count = 0;
};

// What the update signature covers. `descriptor_hash` is the hash of the
// header's tensor descriptors as sent (so shapes and encodings are signed).
struct UpdateSigningFields : UpdateMetadata {
  Hash descriptor_hash{};
  std::vector<Hash> chunk_hashes;
};

// Domain-separated, length-prefixed encoding of the fields ("fedmesh-update-v1").
std::vector<uint8_t> canonical_bytes(const UpdateSigningFields& fields);
Signature sign_update(const UpdateSigningFields& fields, const SiteKeys& sender);
bool verify_update(const UpdateSigningFields& fields, const Signature& signature,
                   const SignPublicKey& sender_public);

}  // namespace fedmesh::crypto
