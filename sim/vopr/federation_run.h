// One seeded run of a federation under the fault simulator: the real
// AggregatorServer and N real SiteRuntimes (aggregator/server.cpp,
// node/site_runtime.cpp, unchanged), or N real GossipRuntimes
// (node/gossip_runtime.cpp), in one World on virtual time, their
// stores real SQLite files reached through the crash VFS. While faults are
// on, the seed decides message loss, duplication and delay, partitions of a
// site, crashes of any process while it waits or between any two writes or
// syncs of its store, power cuts that lose unsynced writes (some torn),
// failed fsyncs, a full disk, and wall-clock jumps of up to a minute. Then faults stop and the federation must
// finish its rounds.
//
// Checked while it runs, not only at the end (DESIGN.md, "what nothing lost
// means"):
//   1. an update the aggregator acknowledged as complete is, after any crash
//      of the aggregator, in its store: pending or applied;
//   2. in sync rounds no site has two updates applied in one round, and an
//      update is applied once (the store's key);
//   4. one model per version: every RoundAnnounce ever sent for version v
//      carries the same hash;
//   5. after every crash the process's store opens, passes
//      PRAGMA integrity_check and its newest round verifies;
//   8. liveness: once faults stop, every round is committed by the deadline
//      and every process exits cleanly;
//   9. gossip: every peer finishes its rounds lacking no update a member
//      keeps, and all hold the same exact sum over as many updates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/vopr/world.h"

namespace fedmesh::sim::vopr {

struct FaultRates {
  double message_drop = 0.05;
  double message_duplicate = 0.02;
  double long_delay = 0.02;
  Nanos mean_between_faults = 3 * kSecond;  // crashes and partitions, all processes together
  // Per write or sync of a store: a commit of the small model takes a few
  // hundred, so about one commit in ten is cut somewhere.
  double crash_at_file_operation = 0.001;
  double fsync_failure = 0.005;
  double disk_full = 0.0002;
  double power_cut = 0.5;                   // a crash is also a power cut
};

struct RunOptions {
  uint64_t seed = 1;
  int sites = 3;
  int rounds = 3;
  int local_steps = 3;
  std::string work_dir;           // keys, data and stores (a folder per run inside)
  Nanos faults_until = 90 * kSecond;
  Nanos deadline = 600 * kSecond; // liveness: everything done by then
  bool faults = true;
  // How the federation runs rounds: "sync", "async" (FedBuff, 2 updates per
  // step), "private" (sync rounds through secure aggregation), "gossip" (the
  // sites are peers, no aggregator), or "mixed": the seed picks (seed % 4:
  // sync, async, private, gossip).
  std::string mode = "mixed";
  FaultRates rates;
};

// The mode a run uses (RunOptions::mode, resolved for "mixed").
std::string run_mode(const RunOptions& options);

struct RunResult {
  bool ok = true;
  std::string violation;          // empty when ok
  Nanos at = 0;                   // virtual time of the violation (or the end)
  uint64_t steps = 0;
  uint64_t digest = 0;            // of the whole trace: equal seeds give equal digests
  int64_t rounds_committed = 0;
  int crashes = 0, restarts = 0, partitions = 0, stores_checked = 0, acks_checked = 0;
  uint64_t messages = 0, messages_dropped = 0;
  std::vector<std::string> recent;  // the last events, for a violation's report
};

// Writes keys, a signed roster, each site's table and the configs under
// work_dir (once; later calls reuse them).
Status prepare_federation(const RunOptions& options);
RunResult run_federation(const RunOptions& options);

}  // namespace fedmesh::sim::vopr
