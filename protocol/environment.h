// What a runtime (the aggregator, a site, a gossip peer) takes from the world
// besides its config: the clock, the network, its helper threads and how its
// store reaches the disk. Production is the default: the real clock, CurveZMQ and SQLite's own
// file system. The fault simulator (sim/vopr) passes a virtual clock,
// in-process channels, threads that run one at a time and a VFS that loses unsynced writes on a power cut;
// the runtimes' logic is the same code in both.
#pragma once

#include <string>

#include "base/clock.h"
#include "base/threads.h"
#include "protocol/transport.h"

namespace fedmesh::protocol {

struct RuntimeEnvironment {
  Clock* clock = &real_clock();
  Network* network = &zmq_network();
  Threads* threads = &real_threads();
  // The SQLite VFS for the runtime's store ("" = SQLite's default) and
  // whether the store may copy its log on a thread of its own (a simulation
  // runs one thread at a time and says no).
  std::string store_vfs;
  bool store_background_maintenance = true;
};

}  // namespace fedmesh::protocol
