#include "sim/vopr/seeded_randomness.h"

#include <sodium.h>

#include <array>
#include <cstring>
#include <mutex>

namespace fedmesh::sim::vopr {
namespace {

struct Stream {
  std::mutex mutex;
  std::array<unsigned char, crypto_stream_chacha20_KEYBYTES> key{};
  uint64_t counter = 0;  // the nonce of the next draw
};

Stream& stream() {
  static Stream s;
  return s;
}

const char* name() { return "fedmesh-vopr-seeded"; }

void fill(void* const out, const size_t size) {
  Stream& s = stream();
  std::lock_guard lock(s.mutex);
  std::array<unsigned char, crypto_stream_chacha20_NONCEBYTES> nonce{};
  std::memcpy(nonce.data(), &s.counter, sizeof(s.counter));
  ++s.counter;
  crypto_stream_chacha20(static_cast<unsigned char*>(out), size, nonce.data(), s.key.data());
}

uint32_t random32() {
  uint32_t value = 0;
  fill(&value, sizeof(value));
  return value;
}

randombytes_implementation implementation = {name, random32, nullptr, nullptr, fill, nullptr};

}  // namespace

void install_seeded_randomness() {
  seed_randomness(0);
  randombytes_set_implementation(&implementation);
}

void seed_randomness(uint64_t seed) {
  Stream& s = stream();
  std::lock_guard lock(s.mutex);
  s.key.fill(0);
  std::memcpy(s.key.data(), &seed, sizeof(seed));
  s.counter = 0;
}

}  // namespace fedmesh::sim::vopr
