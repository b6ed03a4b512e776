// The receiving end of the protocol for one process: every frame a
// ServerSocket hands over goes through handle(), in the order of checks the
// protocol promises: the per-peer rate limit and the size limit, the
// envelope, then (chunks) the hash before the parse or (everything else)
// the parse, then the message's own checks. Each refusal is a Reject with a
// reason code, counted in the socket's counters, and remembered for logging;
// the process carries on with the next frame.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "crypto/replay_guard.h"
#include "crypto/roster.h"
#include "protocol/rate_limiter.h"
#include "protocol/transport.h"
#include "protocol/update_transfer.h"

namespace fedmesh::protocol {

class UpdateService {
 public:
  // Frames of the kinds the service does not take itself (ModelRequest,
  // SiteReport, Heartbeat) go to this handler once they passed the rate
  // limit, the envelope and the parse. It sets `reply` (or leaves it empty)
  // and returns true, or fills `rejection` and returns false.
  using OtherHandler = std::function<bool(const Incoming& incoming, const ParsedMessage& message,
                                          std::optional<OutgoingMessage>& reply, Rejection& rejection)>;

  UpdateService(ReceiverPolicy policy, const crypto::Roster& roster, crypto::ReplayGuard& replay, RateLimits limits,
                TransportCounters& counters);

  void set_other_handler(OtherHandler handler) { other_ = std::move(handler); }
  // The round and model version the service accepts updates for and names
  // in its Welcome.
  void set_round(uint64_t round, uint64_t version);
  // Non-empty: every UpdateHeader is refused (private-mode) with this reason;
  // a federation in private mode takes updates through secure aggregation only.
  void refuse_plain_updates(std::string reason) { refuse_updates_ = std::move(reason); }

  // The reply to send back to the frame's sender (none for a Heartbeat).
  std::optional<OutgoingMessage> handle(const Incoming& incoming);

  std::vector<ReceivedUpdate> take_completed() { return receiver_.take_completed(); }
  // Why the last handled frame was refused, if it was.
  const std::optional<Rejection>& last_rejection() const { return last_rejection_; }
  UpdateReceiver& receiver() { return receiver_; }

 private:
  OutgoingMessage refuse(Rejection rejection);
  // The receiver's reply, its rejection (if any) counted and remembered.
  OutgoingMessage noted(OutgoingMessage reply);
  // A Hello is answered only if its fields hold: a site name within the
  // limit and equal to the authenticated peer, our federation, and the role
  // this endpoint takes (sites for an aggregator, peers for a gossip peer).
  bool check_hello(const std::string& peer, wire::Hello::Reader hello, Rejection& rejection) const;
  OutgoingMessage welcome(const std::string& peer, const ParsedMessage& hello);

  ReceiverPolicy policy_;
  UpdateReceiver receiver_;
  RateLimiter limiter_;
  TransportCounters& counters_;
  std::optional<Rejection> last_rejection_;
  OtherHandler other_;
  std::string refuse_updates_;
};

}  // namespace fedmesh::protocol
