// SWIM messages (gossip/swim.h) on the wire: Ping, PingReq and PingAck of
// fedmesh.capnp, each carrying its piggybacked membership updates and the
// sender's model version (gossip staleness is measured against it). Every
// field of a received message is untrusted: the sender is who the transport
// says (the ZAP User-Id), every member named must be on the roster, the
// list of updates is bounded, and anything else is refused with the reason.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "gossip/swim.h"
#include "protocol/wire.h"

namespace fedmesh::gossip {

inline constexpr size_t kMaxSwimUpdates = 64;  // per message (SwimOptions::max_piggyback is far below)

protocol::OutgoingMessage swim_to_wire(const gossip::SwimMessage& message, uint64_t version);

// `from` is the transport's name for the sender, `self` our own; is_member
// says whether a name may appear at all. Fills `out` (its `to` is self) and
// `version`, or `rejection`.
bool swim_from_wire(const protocol::ParsedMessage& parsed, const std::string& from, const std::string& self,
                    const std::function<bool(std::string_view)>& is_member, gossip::SwimMessage& out,
                    uint64_t& version, protocol::Rejection& rejection);

}  // namespace fedmesh::gossip
