// libsodium's random bytes, decided by the seed: the fault simulator only.
//
// The runtimes draw secrets and session ids from libsodium (randombytes_buf:
// secure aggregation's masks and session ids, key generation). For a seed
// to replay bit for bit those draws must follow from the seed too, so
// fedmesh-vopr replaces libsodium's generator, process-wide, by a ChaCha20
// stream keyed by the run's seed. Nothing it draws is secret: never install
// it in a process that makes real keys.
#pragma once

#include <cstdint>

namespace fedmesh::sim::vopr {

// Installs the seeded generator (before anything else calls libsodium).
void install_seeded_randomness();
// Restarts its stream from `seed` (each run; draws nothing unless installed).
void seed_randomness(uint64_t seed);

}  // namespace fedmesh::sim::vopr
