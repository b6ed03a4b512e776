#include "crypto/hash.h"

#include <sodium.h>

#include <new>

#include "base/status.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

namespace {

static_assert(kHashBytes == crypto_generichash_BYTES);

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

}  // namespace fedmesh::crypto
