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

#include "crypto/hash.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

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
