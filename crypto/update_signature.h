// Signatures on model updates. A sender hashes every encoded chunk (BLAKE2b-
// 256, crypto_generichash), then signs the UpdateHeader's fields together
// with the hash of the list of chunk hashes. The header carries the chunk
// hashes, so a receiver verifies the signature once, on the header, and then
// each chunk on arrival against its hash: every byte it accumulates is
// authenticated, and a transfer can stream and resume chunk by chunk.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "crypto/hash.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

// What a peer-to-peer (gossip) update says of itself beside its tensors:
// a share of the sender's model with its push-sum weight, or slice `slice`
// of `slices` of its model that a member asked for to catch up. Updates to
// an aggregator carry none.
enum class PeerUpdateKind : uint8_t { kShare = 0, kCatchUpSlice = 1, kReplicaUpdate = 2 };
struct PeerUpdateFields {
  PeerUpdateKind kind = PeerUpdateKind::kShare;
  double weight = 0.0;             // a share's (push-sum; pairwise: 1)
  uint32_t slice = 0, slices = 0;  // a catch-up slice's
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
  std::optional<PeerUpdateFields> peer;  // gossip updates only
};

// Which hash an update's chunk hashes are (UpdateHeader.chunkHash): BLAKE2b-
// 256, or BLAKE2bp-256 (crypto/tree_hash.h: the same strength, about three
// times as fast on one core), which fedmesh's senders use.
enum class ChunkHash : uint8_t { kBlake2b = 0, kBlake2bp = 1 };
Hash hash_chunk(ChunkHash kind, std::span<const uint8_t> bytes);
const char* chunk_hash_name(ChunkHash kind);

// What the update signature covers. `descriptor_hash` is the hash of the
// header's tensor descriptors as sent (so shapes and encodings are signed).
struct UpdateSigningFields : UpdateMetadata {
  Hash descriptor_hash{};
  std::vector<Hash> chunk_hashes;
  ChunkHash chunk_hash = ChunkHash::kBlake2b;  // what chunk_hashes are
};

// Domain-separated, length-prefixed encoding of the fields: "fedmesh-update-v1"
// for an update without peer fields, "fedmesh-update-peer-v1" (the peer
// fields included) for one with them, so that neither kind of signature can
// be taken for the other.
std::vector<uint8_t> canonical_bytes(const UpdateSigningFields& fields);
Signature sign_update(const UpdateSigningFields& fields, const SiteKeys& sender);
bool verify_update(const UpdateSigningFields& fields, const Signature& signature,
                   const SignPublicKey& sender_public);

}  // namespace fedmesh::crypto
