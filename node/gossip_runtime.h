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
// sender last heard it; the signed header's peer fields carry the kind
// (share or catch-up slice) and the push-sum weight or the slice
// (gossip::GossipUpdateMeta, gossip/exchange.h).
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
#include "node/gossip_config.h"
#include "protocol/environment.h"

namespace fedmesh::node {

using GossipEventSink = std::function<void(const nlohmann::json& event)>;

class GossipRuntime {
 public:
  // `env`: the clock, network, helper threads and store file system
  // (production: the real ones; the fault simulator passes its own).
  static Result<std::unique_ptr<GossipRuntime>> start(GossipConfig config, GossipEventSink emit,
                                                      protocol::RuntimeEnvironment env = {});
  ~GossipRuntime();
  Status run(const std::atomic<bool>& stop);
  const std::string& metrics_address() const;

 private:
  GossipRuntime() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fedmesh::node
