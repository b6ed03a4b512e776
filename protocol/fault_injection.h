// Fault injection for experiments and tests: a lossy, slow, narrow link made
// in user space (this kernel has no netem). Off by default. A socket given
// an active FaultPlan (TransportOptions::faults; `transport.faults` in the
// aggregator's and a node's config) runs every outgoing message past its
// FaultInjector, which drops it with probability `drop`, or holds it back
// by the link's delay (plus uniform jitter) and, with a bandwidth cap, until
// the link has had time to carry the bytes before it (a token bucket per
// socket: a message leaves at max(now, link free) + bytes / rate).
//
// The sending thread waits out the hold (a sleep before zmq_send), so a
// socket's messages keep their order, and a burst is paced as a narrow link
// would pace it. A gossip peer sends on one thread per link
// (node/peer_link.h), so a held link holds only its own messages; elsewhere
// the hold is the caller's. What it does not model is latency that overlaps
// within one link: each message waits the delay after the one before.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "base/random.h"
#include "base/status.h"

namespace fedmesh::protocol {

struct FaultPlan {
  double drop = 0.0;                        // probability a message is lost, in [0, 1]
  double delay_seconds = 0.0;               // added to every message
  double jitter_seconds = 0.0;              // uniform in [-jitter, +jitter]; the delay never goes below 0
  double bandwidth_bytes_per_second = 0.0;  // 0: unlimited
  uint64_t seed = 0;

  bool active() const { return drop > 0.0 || delay_seconds > 0.0 || jitter_seconds > 0.0 || bandwidth_bytes_per_second > 0.0; }
  Status validate() const;
  std::string to_string() const;  // parses back to the same plan
};

// "drop=0.2,delay=50ms,jitter=10ms,bandwidth=1MB/s,seed=7"; "" or "none": no faults.
// Durations take s or ms; bandwidth takes B/s, KB/s, MB/s or GB/s (powers of 1000).
Result<FaultPlan> parse_fault_plan(std::string_view text);

class FaultInjector {
 public:
  explicit FaultInjector(FaultPlan plan);
  struct Decision {
    bool drop = false;
    double hold_seconds = 0.0;  // how long to wait before sending
  };
  // For one message of `bytes` handed over at `now` (seconds on any steady
  // clock). Thread-safe.
  Decision decide(uint64_t bytes, double now);
  const FaultPlan& plan() const { return plan_; }

 private:
  FaultPlan plan_;
  std::mutex mutex_;
  Rng rng_;
  double link_free_at_ = 0.0;
};

}  // namespace fedmesh::protocol
