// `fedmesh node --mode gossip`: one institution's node in a federation with
// no aggregator. It binds its roster address (CurveZMQ, roster keys only),
// joins the membership through seed members (SWIM, gossip/swim.h, over the
// real transport), and then repeats a round:
//
//   1. if a member is well ahead of it (it joined late or comes back from a
//      crash), catch up first: ask several donors for one slice of the model
//      each (CatchUpRequest) and adopt what they send;
//   2. train H local steps on its own shard from the model it holds, serving
//      the network between steps (probes, acks, shares arriving);
//   3. merge the shares that arrived, waiting up to wait_for_share_seconds
//      for one if none did (push-sum, or pairwise averaging weighed
//      by staleness measured in its own version counter; a share older than
//      max_staleness is dropped) and raise its version;
//   4. send a compressed, signed share (gossip/exchange.h) to the peers the
//      topology picks among the members it believes alive; a share that
//      could not leave comes back (push-sum mass is never dropped on our side);
//   5. evaluate, report, and checkpoint everything in its own store: the
//      push-sum sum and weight, the version, the compression residual, the
//      replay counters (per accepted update, before it is merged).
//
// Shares travel as ordinary signed updates (UpdateHeader + chunks, checked
// by the same UpdateReceiver as the aggregator's) whose round is the
// sender's version and whose base version is the receiver's version as the
// sender last heard it; a small extra tensor "@gossip.meta" carries the kind
// (share or catch-up slice) and the push-sum weight (gossip::weight_to_wire)
// or the slice.
//
// On SIGTERM (stop) the node leaves gracefully (SWIM Left), commits and
// exits; after `rounds` rounds (0: until stopped) it does the same.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "gossip/swim.h"
#include "node/site_config.h"

namespace fedmesh::node {

struct GossipConfig {
  SiteConfig site;                   // identity, model, data, training, compression, transport
  std::string listen;                // default: our roster address
  std::vector<std::string> seeds;    // roster names to join through (default: every other member)
  std::string topology = "exponential";
  int fanout = 1;                    // random and ring
  std::string merge = "push-sum";    // or pairwise
  int64_t local_steps = 50;          // H
  int64_t rounds = 0;                // 0: until stopped
  std::string staleness = "polynomial:0.5";
  int64_t max_staleness = 32;        // versions; -1: no cut-off
  int catch_up_donors = 3;
  int64_t catch_up_lag = 10;         // catch up when a member is this many versions ahead
  double catch_up_timeout_seconds = 10.0;
  int64_t test_limit = 2000;         // test images evaluated (0: all)
  int64_t eval_every = 1;            // rounds
  double wait_for_share_seconds = 1.0;  // after training, wait up to this long for a share if none came
  // [dp] Local differential privacy of what this node sends: each round's
  // training delta is clipped to dp.clip (L2) and gets N(0, (sigma clip)^2)
  // noise before it enters the model the node shares, so every share is a
  // post-processing of noisy deltas. Each round is one Gaussian mechanism on
  // the node's data (q = 1), composed by the RDP accountant; the ledger entry
  // of a round is committed with its model, and dp.target_epsilon stops the
  // node before a round that would exceed it.
  double dp_clip = 0.0;              // 0: off
  double dp_noise_multiplier = 0.0;
  double dp_delta = 1e-5;
  double dp_target_epsilon = 0.0;    // 0: no target
  gossip::SwimOptions swim;

  Status validate() const;
};

Result<GossipConfig> read_gossip_config(const std::string& path);

using GossipEventSink = std::function<void(const nlohmann::json& event)>;

// The federation name a gossip peer's shares carry and the name it takes
// shares for: the federation's, with "/tokenizer=FINGERPRINT" appended when
// the peer reads its text with a BPE tokenizer (data.tokenizer). Peers
// merge only models of the same vocabulary and merges: a share from a peer
// with another tokenizer, or none, is refused (wrong federation) with both
// names in the reason, and counted.
std::string gossip_federation(const std::string& federation, const std::string& tokenizer_fingerprint);

class GossipRuntime {
 public:
  static Result<std::unique_ptr<GossipRuntime>> start(GossipConfig config, GossipEventSink emit);
  ~GossipRuntime();
  Status run(const std::atomic<bool>& stop);
  const std::string& metrics_address() const;

 private:
  GossipRuntime() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fedmesh::node
