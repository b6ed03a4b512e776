// SWIM messages on the wire (gossip/swim_wire.h): every kind survives
// the round trip through bytes with its updates and the sender's version,
// and a message naming a stranger, carrying too many updates, or of the
// wrong kind is refused with a reason.
#include <gtest/gtest.h>

#include <capnp/message.h>

#include <string>
#include <vector>

#include "gossip/swim_wire.h"

namespace fedmesh::gossip {
namespace {

bool member(std::string_view name) { return name == "a" || name == "b" || name == "c"; }

bool decode(const protocol::OutgoingMessage& bytes, gossip::SwimMessage& out, uint64_t& version,
            protocol::Rejection& rejection) {
  std::unique_ptr<protocol::ParsedMessage> parsed;
  if (!protocol::parse_message(bytes.bytes(), protocol::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) return false;
  return swim_from_wire(*parsed, "b", "a", member, out, version, rejection);
}

TEST(SwimWire, EveryKindRoundTrips) {
  for (const gossip::SwimMessageKind kind :
       {gossip::SwimMessageKind::kPing, gossip::SwimMessageKind::kPingReq, gossip::SwimMessageKind::kAck}) {
    gossip::SwimMessage sent;
    sent.kind = kind;
    sent.from = "b";
    sent.to = "a";
    sent.sequence = 42;
    sent.target = kind == gossip::SwimMessageKind::kPing ? "" : "c";
    sent.updates = {{"c", "", 3, gossip::MemberState::kSuspect, "b"}, {"a", "", 1, gossip::MemberState::kDead, ""},
                    {"b", "", 7, gossip::MemberState::kLeft, ""}};
    gossip::SwimMessage received;
    uint64_t version = 0;
    protocol::Rejection rejection;
    ASSERT_TRUE(decode(swim_to_wire(sent, 99), received, version, rejection)) << rejection.reason;
    EXPECT_EQ(received.kind, sent.kind);
    EXPECT_EQ(received.from, "b");
    EXPECT_EQ(received.to, "a");
    EXPECT_EQ(received.sequence, 42u);
    EXPECT_EQ(received.target, sent.target);
    EXPECT_EQ(received.updates, sent.updates);
    EXPECT_EQ(version, 99u);
  }
}

TEST(SwimWire, StrangersAndFloodsAreRefused) {
  gossip::SwimMessage message;
  message.kind = gossip::SwimMessageKind::kPing;
  message.updates = {{"mallory", "", 1, gossip::MemberState::kAlive, ""}};
  gossip::SwimMessage out;
  uint64_t version = 0;
  protocol::Rejection rejection;
  EXPECT_FALSE(decode(swim_to_wire(message, 1), out, version, rejection));
  EXPECT_NE(rejection.reason.find("mallory"), std::string::npos) << rejection.reason;

  message.updates = {{"c", "", 1, gossip::MemberState::kSuspect, "mallory"}};
  EXPECT_FALSE(decode(swim_to_wire(message, 1), out, version, rejection)) << "a stranger as accuser";

  message.kind = gossip::SwimMessageKind::kPingReq;
  message.updates.clear();
  message.target = "mallory";
  EXPECT_FALSE(decode(swim_to_wire(message, 1), out, version, rejection)) << "a stranger as target";

  // More updates than a message may carry: built by hand, since
  // swim_to_wire itself never writes more than kMaxSwimUpdates.
  capnp::MallocMessageBuilder builder;
  auto ping = builder.initRoot<wire::Message>().initPing();
  auto deltas = ping.initDeltas(kMaxSwimUpdates + 1);
  for (auto delta : deltas) delta.setSite("c");
  EXPECT_FALSE(decode(protocol::serialize(builder), out, version, rejection));
  EXPECT_NE(rejection.reason.find("membership updates"), std::string::npos) << rejection.reason;

  capnp::MallocMessageBuilder heartbeat;
  heartbeat.initRoot<wire::Message>().initHeartbeat();
  EXPECT_FALSE(decode(protocol::serialize(heartbeat), out, version, rejection)) << "not a membership message";
}

}  // namespace
}  // namespace fedmesh::gossip
