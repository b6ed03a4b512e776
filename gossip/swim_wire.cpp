#include "gossip/swim_wire.h"

#include <capnp/message.h>
#include <kj/exception.h>

namespace fedmesh::gossip {

namespace {

wire::MemberStatus to_wire(gossip::MemberState state) {
  switch (state) {
    case gossip::MemberState::kAlive: return wire::MemberStatus::ALIVE;
    case gossip::MemberState::kSuspect: return wire::MemberStatus::SUSPECT;
    case gossip::MemberState::kDead: return wire::MemberStatus::DEAD;
    case gossip::MemberState::kLeft: return wire::MemberStatus::LEFT;
  }
  return wire::MemberStatus::ALIVE;
}

void fill(capnp::List<wire::MembershipDelta>::Builder list, const std::vector<gossip::MemberUpdate>& updates) {
  for (size_t i = 0; i < updates.size(); ++i) {
    list[static_cast<unsigned>(i)].setSite(updates[i].name);
    list[static_cast<unsigned>(i)].setStatus(to_wire(updates[i].state));
    list[static_cast<unsigned>(i)].setIncarnation(updates[i].incarnation);
    list[static_cast<unsigned>(i)].setAccuser(updates[i].accuser);
  }
}

bool refuse(protocol::Rejection& rejection, std::string reason) {
  rejection = {wire::RejectCode::MALFORMED, std::move(reason)};
  return false;
}

bool read_name(capnp::Text::Reader text, const std::function<bool(std::string_view)>& is_member, bool allow_empty,
               std::string& out, const char* what, protocol::Rejection& rejection) {
  if (text.size() > protocol::kMaxTextBytes) return refuse(rejection, std::string(what) + " is too long");
  out.assign(text.cStr(), text.size());
  if (out.empty() && allow_empty) return true;
  if (!is_member(out)) return refuse(rejection, std::string(what) + " '" + out + "' is not a member of the roster");
  return true;
}

bool read_updates(capnp::List<wire::MembershipDelta>::Reader list, const std::function<bool(std::string_view)>& is_member,
                  std::vector<gossip::MemberUpdate>& out, protocol::Rejection& rejection) {
  if (list.size() > kMaxSwimUpdates) {
    return refuse(rejection, std::to_string(list.size()) + " membership updates in one message (at most " +
                                 std::to_string(kMaxSwimUpdates) + ")");
  }
  for (const auto delta : list) {
    gossip::MemberUpdate update;
    if (!read_name(delta.getSite(), is_member, false, update.name, "a membership update's site", rejection)) return false;
    if (!read_name(delta.getAccuser(), is_member, true, update.accuser, "a suspicion's accuser", rejection)) return false;
    switch (delta.getStatus()) {
      case wire::MemberStatus::ALIVE: update.state = gossip::MemberState::kAlive; break;
      case wire::MemberStatus::SUSPECT: update.state = gossip::MemberState::kSuspect; break;
      case wire::MemberStatus::DEAD: update.state = gossip::MemberState::kDead; break;
      case wire::MemberStatus::LEFT: update.state = gossip::MemberState::kLeft; break;
      default: return refuse(rejection, "unknown member status " + std::to_string(static_cast<int>(delta.getStatus())));
    }
    update.incarnation = delta.getIncarnation();
    out.push_back(std::move(update));
  }
  return true;
}

}  // namespace

protocol::OutgoingMessage swim_to_wire(const gossip::SwimMessage& message, uint64_t version) {
  capnp::MallocMessageBuilder builder;
  auto root = builder.initRoot<wire::Message>();
  const auto count = static_cast<unsigned>(std::min(message.updates.size(), kMaxSwimUpdates));
  std::vector<gossip::MemberUpdate> updates(message.updates.begin(), message.updates.begin() + count);
  switch (message.kind) {
    case gossip::SwimMessageKind::kPing: {
      auto ping = root.initPing();
      ping.setProbe(message.sequence);
      ping.setVersion(version);
      fill(ping.initDeltas(count), updates);
      break;
    }
    case gossip::SwimMessageKind::kPingReq: {
      auto req = root.initPingReq();
      req.setProbe(message.sequence);
      req.setTarget(message.target);
      req.setVersion(version);
      fill(req.initDeltas(count), updates);
      break;
    }
    case gossip::SwimMessageKind::kAck: {
      auto ack = root.initPingAck();
      ack.setProbe(message.sequence);
      ack.setTarget(message.target);
      ack.setVersion(version);
      fill(ack.initDeltas(count), updates);
      break;
    }
  }
  return protocol::serialize(builder);
}

bool swim_from_wire(const protocol::ParsedMessage& parsed, const std::string& from, const std::string& self,
                    const std::function<bool(std::string_view)>& is_member, gossip::SwimMessage& out,
                    uint64_t& version, protocol::Rejection& rejection) {
  out = gossip::SwimMessage{};
  out.from = from;
  out.to = self;
  try {
    const auto root = parsed.root();
    switch (root.which()) {
      case wire::Message::PING: {
        const auto ping = root.getPing();
        out.kind = gossip::SwimMessageKind::kPing;
        out.sequence = ping.getProbe();
        version = ping.getVersion();
        return read_updates(ping.getDeltas(), is_member, out.updates, rejection);
      }
      case wire::Message::PING_REQ: {
        const auto req = root.getPingReq();
        out.kind = gossip::SwimMessageKind::kPingReq;
        out.sequence = req.getProbe();
        version = req.getVersion();
        if (!read_name(req.getTarget(), is_member, false, out.target, "a ping-req's target", rejection)) return false;
        return read_updates(req.getDeltas(), is_member, out.updates, rejection);
      }
      case wire::Message::PING_ACK: {
        const auto ack = root.getPingAck();
        out.kind = gossip::SwimMessageKind::kAck;
        out.sequence = ack.getProbe();
        version = ack.getVersion();
        if (!read_name(ack.getTarget(), is_member, true, out.target, "an ack's target", rejection)) return false;
        return read_updates(ack.getDeltas(), is_member, out.updates, rejection);
      }
      default:
        return refuse(rejection, "not a membership message");
    }
  } catch (const kj::Exception& e) {
    return refuse(rejection, std::string("malformed membership message: ") + e.getDescription().cStr());
  }
}

}  // namespace fedmesh::gossip
