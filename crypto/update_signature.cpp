#include "crypto/update_signature.h"

#include <sodium.h>

#include <bit>

#include "crypto/tree_hash.h"


namespace fedmesh::crypto {

namespace {

constexpr std::string_view kUpdateDomain = "fedmesh-update-v1";
constexpr std::string_view kPeerUpdateDomain = "fedmesh-update-peer-v1";

void append_u64(std::vector<uint8_t>& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

void append_field(std::vector<uint8_t>& out, std::span<const uint8_t> bytes) {
  FEDMESH_CHECK(bytes.size() <= UINT32_MAX, "update field too large to encode");
  const auto size = static_cast<uint32_t>(bytes.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(size >> (8 * i)));
  out.insert(out.end(), bytes.begin(), bytes.end());
}

void append_field(std::vector<uint8_t>& out, std::string_view text) {
  append_field(out, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace

// Layout (u32 little-endian lengths, u64 little-endian integers):
//   field "fedmesh-update-v1", field federation, u64 round, u64 base_version,
//   field sender, field recipient, u64 sequence, u64 sample_count,
//   field descriptor_hash, u64 chunk count, field BLAKE2b-256(chunk hashes in
//   order). The chunk list enters by its hash, so what is signed stays small
//   however many chunks an update has, and any reordering changes it.
//   Chunk hashes other than BLAKE2b add a last u64, the ChunkHash (1:
//   BLAKE2bp): a BLAKE2b update's bytes are as they always were, and no
//   update's bytes are another's with a different chunk hash.
// With peer fields the domain is "fedmesh-update-peer-v1" and u64 kind,
// u64 weight (IEEE-754 binary64 bits), u64 slice, u64 slices follow
// sample_count.
std::vector<uint8_t> canonical_bytes(const UpdateSigningFields& fields) {
  std::vector<uint8_t> out;
  append_field(out, fields.peer ? kPeerUpdateDomain : kUpdateDomain);
  append_field(out, fields.federation);
  append_u64(out, fields.round);
  append_u64(out, fields.base_version);
  append_field(out, fields.sender);
  append_field(out, fields.recipient);
  append_u64(out, fields.sequence);
  append_u64(out, fields.sample_count);
  if (fields.peer) {
    append_u64(out, static_cast<uint64_t>(fields.peer->kind));
    append_u64(out, std::bit_cast<uint64_t>(fields.peer->weight));
    append_u64(out, fields.peer->slice);
    append_u64(out, fields.peer->slices);
  }
  append_field(out, fields.descriptor_hash);
  append_u64(out, fields.chunk_hashes.size());
  Hasher chunk_list;
  for (const Hash& hash : fields.chunk_hashes) chunk_list.update(hash);
  append_field(out, chunk_list.finish());
  if (fields.chunk_hash != ChunkHash::kBlake2b) append_u64(out, static_cast<uint64_t>(fields.chunk_hash));
  return out;
}

Hash hash_chunk(ChunkHash kind, std::span<const uint8_t> bytes) {
  return kind == ChunkHash::kBlake2bp ? tree_hash(bytes) : hash_bytes(bytes);
}

const char* chunk_hash_name(ChunkHash kind) { return kind == ChunkHash::kBlake2bp ? "BLAKE2bp-256" : "BLAKE2b-256"; }

Signature sign_update(const UpdateSigningFields& fields, const SiteKeys& sender) {
  return sign_detached(canonical_bytes(fields), sender.sign_secret);
}

bool verify_update(const UpdateSigningFields& fields, const Signature& signature, const SignPublicKey& sender_public) {
  return verify_detached(canonical_bytes(fields), signature, sender_public);
}

}  // namespace fedmesh::crypto
