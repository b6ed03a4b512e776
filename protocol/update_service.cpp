#include "protocol/update_service.h"

#include <kj/exception.h>

namespace fedmesh::protocol {

UpdateService::UpdateService(ReceiverPolicy policy, const crypto::Roster& roster, crypto::ReplayGuard& replay,
                             RateLimits limits, TransportCounters& counters)
    : policy_(policy), receiver_(std::move(policy), roster, replay), limiter_(limits), counters_(counters) {}

void UpdateService::set_round(uint64_t round, uint64_t version) {
  policy_.current_round = round;
  policy_.current_version = version;
  receiver_.set_round(round, version);
}

OutgoingMessage UpdateService::refuse(Rejection rejection) {
  counters_.count_rejection(rejection.code);
  last_rejection_ = std::move(rejection);
  return make_reject(0, *last_rejection_);
}

OutgoingMessage UpdateService::noted(OutgoingMessage reply) {
  if (const auto& refused = receiver_.last_rejection()) {
    counters_.count_rejection(refused->code);
    last_rejection_ = refused;
  }
  return reply;
}

bool UpdateService::check_hello(const std::string& peer, wire::Hello::Reader hello, Rejection& rejection) const {
  // Sizes first: nothing of an oversized field is copied or echoed.
  const auto name = hello.getSiteName();
  const auto federation = hello.getFederation();
  if (name.size() > crypto::kMaxSiteNameBytes) {
    rejection = {wire::RejectCode::MALFORMED, "Hello siteName is " + std::to_string(name.size()) +
                                                  " bytes; a site name is at most " +
                                                  std::to_string(crypto::kMaxSiteNameBytes)};
    return false;
  }
  if (federation.size() > crypto::kMaxFederationIdBytes) {
    rejection = {wire::RejectCode::MALFORMED, "Hello federation is " + std::to_string(federation.size()) +
                                                  " bytes; a federation id is at most " +
                                                  std::to_string(crypto::kMaxFederationIdBytes)};
    return false;
  }
  const std::string_view site_name(name.cStr(), name.size());
  if (Status s = crypto::check_site_name(site_name); !s.is_ok()) {
    rejection = {wire::RejectCode::MALFORMED, "Hello siteName: " + s.message()};
    return false;
  }
  if (!policy_.insecure && site_name != peer) {
    rejection = {wire::RejectCode::UNAUTHENTICATED, "Hello names site '" + std::string(site_name) +
                                                        "' but the connection is authenticated as '" + peer + "'"};
    return false;
  }
  if (std::string_view(federation.cStr(), federation.size()) != policy_.federation) {
    rejection = {wire::RejectCode::WRONG_FEDERATION, "Hello is for federation '" + std::string(federation.cStr()) +
                                                         "', this is '" + policy_.federation + "'"};
    return false;
  }
  const wire::Role expected = policy_.peer_updates ? wire::Role::PEER : wire::Role::SITE;
  if (hello.getRole() != expected) {
    rejection = {wire::RejectCode::WRONG_ROLE,
                 "Hello has role " + std::to_string(static_cast<int>(hello.getRole())) + "; this endpoint takes " +
                     (policy_.peer_updates ? "peers (role 2)" : "sites (role 0)")};
    return false;
  }
  return true;
}

OutgoingMessage UpdateService::welcome(const std::string& peer, const ParsedMessage& message) {
  try {
    const auto hello = message.root().getHello();
    uint16_t version = 0;
    Rejection rejection;
    if (!check_hello(peer, hello, rejection)) return refuse(std::move(rejection));
    if (!negotiate_version(hello.getMinProtocolVersion(), hello.getProtocolVersion(), version, rejection)) {
      return refuse(std::move(rejection));
    }
    capnp::MallocMessageBuilder builder;
    auto welcome = builder.initRoot<wire::Message>().initWelcome();
    welcome.setSiteName(policy_.self);
    welcome.setRole(wire::Role::AGGREGATOR);
    welcome.setProtocolVersion(version);
    welcome.setRound(policy_.current_round);
    welcome.setModelVersion(policy_.current_version);
    auto capabilities = welcome.initCapabilities();
    auto encodings = capabilities.initEncodings(kEncodingCount);
    for (int e = 0; e < kEncodingCount; ++e) encodings.set(static_cast<unsigned>(e), to_wire(static_cast<Encoding>(e)));
    capabilities.setMaxMessageBytes(static_cast<uint32_t>(policy_.max_message_bytes));
    return serialize(builder);
  } catch (const kj::Exception& e) {
    return refuse({wire::RejectCode::MALFORMED, std::string("Hello does not parse: ") + e.getDescription().cStr()});
  }
}

std::optional<OutgoingMessage> UpdateService::handle(const Incoming& incoming) {
  last_rejection_.reset();
  // One bucket per key, not per name: a revoked key still connected under a
  // site's name must not spend the budget of the site's new key.
  const std::string& bucket = incoming.peer_key.empty() ? incoming.peer : incoming.peer_key;
  if (!limiter_.admit(bucket, incoming.bytes.size(), policy_.clock())) {
    return refuse({wire::RejectCode::RATE_LIMITED, "peer '" + incoming.peer + "' (key " + bucket.substr(0, 16) +
                                                       "…) is over its message or byte rate"});
  }
  Envelope envelope;
  Rejection rejection;
  if (!read_envelope(incoming.bytes, policy_.max_message_bytes, envelope, rejection)) return refuse(std::move(rejection));

  if (envelope.kind == wire::Message::UPDATE_CHUNK) {
    return noted(receiver_.handle_chunk(incoming.peer, envelope, incoming.bytes, incoming.frame));
  }
  std::unique_ptr<ParsedMessage> parsed;
  if (!parse_body(incoming.bytes, envelope, incoming.frame, parsed, rejection)) return refuse(std::move(rejection));
  switch (envelope.kind) {
    case wire::Message::UPDATE_HEADER:
      if (!refuse_updates_.empty()) return refuse({wire::RejectCode::PRIVATE_MODE, refuse_updates_});
      return noted(receiver_.handle_header(incoming.peer, *parsed));
    case wire::Message::UPDATE_SEAL:
      if (!refuse_updates_.empty()) return refuse({wire::RejectCode::PRIVATE_MODE, refuse_updates_});
      return noted(receiver_.handle_seal(incoming.peer, *parsed));
    case wire::Message::HELLO:
      return welcome(incoming.peer, *parsed);
    case wire::Message::HEARTBEAT:
      if (!other_) return std::nullopt;
      [[fallthrough]];
    default:
      if (other_) {
        std::optional<OutgoingMessage> reply;
        try {
          if (other_(incoming, *parsed, reply, rejection)) return reply;
        } catch (const kj::Exception& e) {
          rejection = {wire::RejectCode::MALFORMED, std::string("message does not parse: ") + e.getDescription().cStr()};
        }
        return refuse(std::move(rejection));
      }
      return refuse({wire::RejectCode::MALFORMED, "a " + std::to_string(static_cast<int>(envelope.kind)) +
                                                      " message is not one this endpoint takes"});
  }
}

}  // namespace fedmesh::protocol
