#include "crypto/update_signature.h"

#include <sodium.h>

#include <new>

namespace fedmesh::crypto {

namespace {

constexpr std::string_view kUpdateDomain = "fedmesh-update-v1";

static_assert(kHashBytes == crypto_generichash_BYTES);

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

crypto_generichash_state* state_of(std::array<uint8_t, 384>& storage) {
  return std::launder(reinterpret_cast<crypto_generichash_state*>(storage.data()));
}

}  // namespace

// The header reserves raw storage so that it need not include sodium.h.
static_assert(sizeof(crypto_generichash_state) <= 384);
static_assert(alignof(crypto_generichash_state) <= 64);

Hash hash_bytes(std::span<const uint8_t> bytes) {
  ensure_sodium();
  Hash hash{};
  FEDMESH_CHECK(crypto_generichash(hash.data(), hash.size(), bytes.data(), bytes.size(), nullptr, 0) == 0);
  return hash;
}

Hasher::Hasher() {
  ensure_sodium();
  FEDMESH_CHECK(crypto_generichash_init(state_of(state_), nullptr, 0, kHashBytes) == 0);
}

void Hasher::update(std::span<const uint8_t> bytes) {
  FEDMESH_CHECK(crypto_generichash_update(state_of(state_), bytes.data(), bytes.size()) == 0);
}

// Starts over afterwards, so one Hasher can hash several messages in turn.
Hash Hasher::finish() {
  Hash hash{};
  FEDMESH_CHECK(crypto_generichash_final(state_of(state_), hash.data(), hash.size()) == 0);
  FEDMESH_CHECK(crypto_generichash_init(state_of(state_), nullptr, 0, kHashBytes) == 0);
  return hash;
}

// Layout (u32 little-endian lengths, u64 little-endian integers):
//   field "fedmesh-update-v1", field federation, u64 round, u64 base_version,
//   field sender, field recipient, u64 sequence, u64 sample_count,
//   field descriptor_hash, u64 chunk count, field BLAKE2b-256(chunk hashes in
//   order). The chunk list enters by its hash, so what is signed stays small
//   however many chunks an update has, and any reordering changes it.
std::vector<uint8_t> canonical_bytes(const UpdateSigningFields& fields) {
  std::vector<uint8_t> out;
  append_field(out, kUpdateDomain);
  append_field(out, fields.federation);
  append_u64(out, fields.round);
  append_u64(out, fields.base_version);
  append_field(out, fields.sender);
  append_field(out, fields.recipient);
  append_u64(out, fields.sequence);
  append_u64(out, fields.sample_count);
  append_field(out, fields.descriptor_hash);
  append_u64(out, fields.chunk_hashes.size());
  Hasher chunk_list;
  for (const Hash& hash : fields.chunk_hashes) chunk_list.update(hash);
  append_field(out, chunk_list.finish());
  return out;
}

Signature sign_update(const UpdateSigningFields& fields, const SiteKeys& sender) {
  return sign_detached(canonical_bytes(fields), sender.sign_secret);
}

bool verify_update(const UpdateSigningFields& fields, const Signature& signature, const SignPublicKey& sender_public) {
  return verify_detached(canonical_bytes(fields), signature, sender_public);
}

}  // namespace fedmesh::crypto
