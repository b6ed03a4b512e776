// libFuzzer target for everything the receiver does with a peer's bytes:
// the envelope, the Cap'n Proto parse under limits, the update header
// checks, and, past authentication, the chunk decode of a signed update.
//
// byte 0, bit 0 clear: the rest is one received frame. It is parsed; an
//   UpdateHeader goes through UpdateReceiver::handle_header (a roster of one
//   site, "site-a"), any other message has every field walked.
//   An UpdateSeal goes to UpdateReceiver::handle_seal after a sealed header
//   of sequence 1 opened a transfer for it.
// byte 0, bit 0 set: the rest is the body of an UpdateChunk. The target
//   signs a header whose one chunk hash is that body's (as an authenticated
//   but hostile site could), then delivers header and chunk: this reaches
//   segment decoding, which sits behind the hash check. Bits 1-6 pick the
//   tensors' encoding. Bit 7 set: the update is sealed instead (the chunk
//   is decoded on arrival, before anything is signed), and a seal signed
//   over its hash follows it.
// Either way the receiver must answer with an Ack or a Reject, never crash,
// and never hand on an update with a non-finite value. A membership message
// (Ping, PingReq, PingAck) goes through swim_from_wire and, if accepted,
// into a SWIM state machine: every name it names must be on the roster.
// Secure aggregation's messages are decoded (protocol/secagg_wire.h); a
// SecAggUp is fed to a SecAggServer of two sites, a SecAggDown drives a
// SecAggClient through every phase it gets past: each refusal must leave
// the client aborted with its secrets wiped. Normalization statistics
// (StatsReport, StatsMerged) go through decode_feature_sums: what it
// accepts has counts >= 1 and finite sums, what it refuses says why.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "crypto/keys.h"
#include "crypto/replay_guard.h"
#include "crypto/roster.h"
#include "crypto/secure_aggregation.h"
#include "federation/stats_wire.h"
#include "protocol/secagg_wire.h"
#include "protocol/update_transfer.h"
#include "protocol/wire.h"
#include "gossip/swim.h"
#include "gossip/swim_wire.h"

namespace fp = fedmesh::protocol;
namespace fc = fedmesh::crypto;

namespace {

struct Fixture {
  fc::SiteKeys site = fc::generate_site_keys("site-a").value();
  fc::Roster roster;
  std::vector<fp::TensorShape> manifest = {{"w", {8, 4}}, {"b", {8}}};
  Fixture() {
    roster.federation = "fed";
    roster.sites.push_back({site.identity, fc::Role::kSite, ""});
  }
  fp::ReceiverPolicy policy() const {
    fp::ReceiverPolicy p;
    p.federation = "fed";
    p.self = "aggregator";
    p.manifest = manifest;
    p.current_round = 1;
    p.current_version = 1;
    return p;
  }
};

const Fixture& fixture() {
  static const Fixture f;
  return f;
}

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_wire: %s\n", what);
    std::abort();
  }
}

// The fixture's tensors, all in one encoding (block ones with 4 per block).
std::vector<fp::TensorDescriptorFields> dense_descriptors(const Fixture& f, fp::Encoding encoding) {
  std::vector<fp::TensorDescriptorFields> descriptors;
  for (const auto& shape : f.manifest) {
    descriptors.push_back({shape.name, shape.dims, encoding, fp::encoding_is_block(encoding) ? 4u : 0u});
  }
  return descriptors;
}

// The reply must itself parse and be an Ack or a Reject.
void check_reply(const fp::OutgoingMessage& reply) {
  std::unique_ptr<fp::ParsedMessage> parsed;
  fp::Rejection rejection;
  require(fp::parse_message(reply.bytes(), fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection), "reply does not parse");
  require(parsed->root().isAck() || parsed->root().isReject(), "reply is neither Ack nor Reject");
}

void check_completed(fp::UpdateReceiver& receiver) {
  for (const auto& update : receiver.take_completed()) {
    for (const auto& tensor : update.tensors) {
      for (float v : tensor) require(std::isfinite(v), "a completed update holds a non-finite value");
    }
  }
}

struct SecAggFixture {
  fc::SiteKeys a = fc::generate_site_keys("site-a").value();
  fc::SiteKeys b = fc::generate_site_keys("site-b").value();
  fc::Roster roster;
  SecAggFixture() {
    roster.federation = "fed";
    roster.sites.push_back({a.identity, fc::Role::kSite, ""});
    roster.sites.push_back({b.identity, fc::Role::kSite, ""});
  }
};

const SecAggFixture& secagg() {
  static const SecAggFixture f;
  return f;
}

void feed_server(const fp::SecAggUpMessage& up) {
  fc::SecAggServer server = fc::SecAggServer::create({"fed", 1, "s", 2, 8}, secagg().roster, {"site-a", "site-b"}).value();
  using K = fp::SecAggUpMessage::Kind;
  fedmesh::Status s;
  switch (up.kind) {
    case K::kAdvertise: s = server.advertise("site-a", up.advertisement); break;
    case K::kShares: s = server.share_keys("site-a", up.shares); break;
    case K::kMasked: s = server.masked_input("site-a", up.offset, up.words); break;
    case K::kConsistency: s = server.consistency("site-a", up.signature); break;
    case K::kReveals: s = server.unmask("site-a", up.reveals); break;
    default: break;
  }
  server.advance();
}

void feed_client(const fp::SecAggDownMessage& d) {
  if (d.length == 0 || d.length > 4096) return;
  fedmesh::Result<fc::SecAggClient> started =
      fc::SecAggClient::start({"fed", d.round, d.session, d.threshold, d.length}, secagg().a, secagg().roster, d.invited);
  if (!started.is_ok()) return;
  fc::SecAggClient& c = *started;
  const auto refused = [&c](const fedmesh::Status& s) {
    if (s.is_ok()) return false;
    require(c.phase() == fc::SecAggPhase::kAborted && !c.holds_secrets(), "a refusing client kept its secrets");
    return true;
  };
  if (refused(c.advertise().status())) return;
  if (refused(c.share_keys(d.advertisements).status())) return;
  const std::vector<uint32_t> input(d.length, 7);
  if (refused(c.masked_input(d.shares, input).status())) return;
  if (refused(c.consistency(d.alive).status())) return;
  (void)refused(c.unmask({d.alive, d.dropped, d.signatures}).status());
}

void walk(const fp::ParsedMessage& message) {
  // Touch every field a handler might read; kj exceptions are the parser's
  // way of refusing and are caught by every real handler.
  try {
    const auto root = message.root();
    switch (root.which()) {
      case fedmesh::wire::Message::HELLO: {
        const auto h = root.getHello();
        (void)h.getFederation().size();
        (void)h.getSiteName().size();
        for (auto e : h.getCapabilities().getEncodings()) (void)e;
        break;
      }
      case fedmesh::wire::Message::MODEL_CHUNK: {
        for (auto s : root.getModelChunk().getSegments()) {
          fp::SegmentView view;
          fp::Rejection rejection;
          if (fp::read_segment(s, view, rejection)) {
            std::vector<float> target(fixture().manifest[0].element_count());
            (void)fp::check_segment(view, fixture().manifest);
          }
        }
        break;
      }
      case fedmesh::wire::Message::PING:
      case fedmesh::wire::Message::PING_REQ:
      case fedmesh::wire::Message::PING_ACK: {
        const auto member = [](std::string_view name) { return name == "site-a" || name == "site-b" || name == "site-c"; };
        fedmesh::gossip::SwimMessage swim_message;
        uint64_t version = 0;
        fp::Rejection rejection;
        if (!fedmesh::gossip::swim_from_wire(message, "site-b", "site-a", member, swim_message, version, rejection)) {
          require(!rejection.reason.empty(), "a membership message refused without a reason");
          break;
        }
        require(swim_message.updates.size() <= fedmesh::gossip::kMaxSwimUpdates, "too many membership updates accepted");
        for (const auto& update : swim_message.updates) require(member(update.name), "a stranger in a membership update");
        fedmesh::gossip::Swim swim("site-a", "tcp://a", fedmesh::gossip::SwimOptions{}, 1);
        swim.join({{"site-b", "tcp://b"}, {"site-c", "tcp://c"}}, 0.0);
        swim.receive(swim_message, 0.5);
        swim.tick(10.0);
        for (const auto& out : swim.take_outbox()) require(member(out.to), "SWIM wrote to a stranger");
        break;
      }
      case fedmesh::wire::Message::REJECT:
        (void)root.getReject().getText().size();
        break;
      case fedmesh::wire::Message::SEC_AGG_UP: {
        fp::SecAggUpMessage up;
        fp::Rejection rejection;
        if (fp::decode_secagg_up(root.getSecAggUp(), up, rejection)) feed_server(up);
        else require(!rejection.reason.empty(), "a secure-aggregation message refused without a reason");
        break;
      }
      case fedmesh::wire::Message::SEC_AGG_DOWN: {
        fp::SecAggDownMessage down;
        fp::Rejection rejection;
        if (fp::decode_secagg_down(root.getSecAggDown(), down, rejection)) feed_client(down);
        else require(!rejection.reason.empty(), "a secure-aggregation message refused without a reason");
        break;
      }
      case fedmesh::wire::Message::STATS_REPORT:
      case fedmesh::wire::Message::STATS_MERGED: {
        const bool report = root.which() == fedmesh::wire::Message::STATS_REPORT;
        const auto features = report ? root.getStatsReport().getFeatures() : root.getStatsMerged().getFeatures();
        const std::string kind = report ? root.getStatsReport().getKind().cStr() : root.getStatsMerged().getKind().cStr();
        // A masked report (private mode) is read for its names only, as the aggregator reads it.
        const bool names_only = report && root.getStatsReport().getMasked();
        fedmesh::train::data::DataStats sums;
        fp::Rejection rejection;
        if (fedmesh::federation::decode_feature_sums(features, kind, sums, rejection, names_only)) {
          require(!sums.features.empty(), "statistics accepted with no feature");
          for (const auto& f : sums.features) {
            if (names_only) continue;
            require(f.count >= 1 && std::isfinite(f.sum) && std::isfinite(f.sum_squares) && f.sum_squares >= 0.0,
                    "statistics accepted with a count below 1 or a sum that is not finite");
          }
        } else {
          require(!rejection.reason.empty(), "statistics refused without a reason");
        }
        break;
      }
      default:
        break;
    }
  } catch (const kj::Exception&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Fixture& f = fixture();
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(f.policy(), f.roster, replay);
  const std::span<const uint8_t> rest(data + 1, size - 1);

  if ((data[0] & 1) == 0) {
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    if (!fp::parse_message(rest, fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) {
      require(!rejection.reason.empty(), "a rejection without a reason");
      return 0;
    }
    if (parsed->envelope().kind == fedmesh::wire::Message::UPDATE_HEADER) {
      check_reply(receiver.handle_header("site-a", *parsed));
    } else if (parsed->envelope().kind == fedmesh::wire::Message::UPDATE_SEAL) {
      std::unique_ptr<fp::ParsedMessage> header;
      require(fp::parse_message(fp::sealed_header({"fed", 1, 1, "site-a", "aggregator", 1, 1},
                                                  dense_descriptors(f, fp::Encoding::kDenseF32), fp::kSentChunkHash),
                                fp::kDefaultMaxMessageBytes, nullptr, header, rejection),
              "own sealed header does not parse");
      check_reply(receiver.handle_header("site-a", *header));
      require(!receiver.last_rejection().has_value(), "own sealed header refused");
      check_reply(receiver.handle_seal("site-a", *parsed));
    } else if (parsed->envelope().kind == fedmesh::wire::Message::UPDATE_CHUNK) {
      check_reply(receiver.handle_chunk("site-a", parsed->envelope(), rest));
    } else {
      walk(*parsed);
    }
    check_completed(receiver);
    return 0;
  }

  // A chunk body of whole words, with an envelope in front.
  const size_t body_bytes = rest.size() / 8 * 8;
  if (body_bytes == 0) return 0;
  std::vector<uint8_t> frame(fp::kEnvelopeBytes + body_bytes);
  const uint32_t magic = fp::kEnvelopeMagic, body32 = static_cast<uint32_t>(body_bytes), chunk_index = 0;
  const uint16_t version = fp::kProtocolVersion, kind = static_cast<uint16_t>(fedmesh::wire::Message::UPDATE_CHUNK);
  const uint64_t sequence = 1;
  std::memcpy(frame.data(), &magic, 4);
  std::memcpy(frame.data() + 4, &version, 2);
  std::memcpy(frame.data() + 6, &kind, 2);
  std::memcpy(frame.data() + 8, &body32, 4);
  std::memcpy(frame.data() + 12, &chunk_index, 4);
  std::memcpy(frame.data() + 16, &sequence, 8);
  std::memcpy(frame.data() + fp::kEnvelopeBytes, rest.data(), body_bytes);

  // A header signed over that body: built by the real sender path with an
  // empty update, then given this chunk's hash.
  fp::UpdateMetadata metadata{"fed", 1, 1, "site-a", "aggregator", sequence, 1};
  const auto encoding = static_cast<fp::Encoding>(((data[0] >> 1) & 0x3f) % fp::kEncodingCount);
  const std::vector<fp::TensorDescriptorFields> descriptors = dense_descriptors(f, encoding);
  const bool sealed = (data[0] & 0x80) != 0;
  const auto body = std::span<const uint8_t>(frame).subspan(fp::kEnvelopeBytes);
  const fc::ChunkHash hash_kind = sealed ? fp::kSentChunkHash : fc::ChunkHash::kBlake2b;
  const fc::Hash chunk_hash = fc::hash_chunk(hash_kind, body);
  const fp::SharedMessage header_bytes = sealed ? fp::sealed_header(metadata, descriptors, hash_kind)
                                                : fp::signed_header(metadata, descriptors, {&chunk_hash, 1}, f.site);
  std::unique_ptr<fp::ParsedMessage> header;
  fp::Rejection rejection;
  require(fp::parse_message(header_bytes, fp::kDefaultMaxMessageBytes, nullptr, header, rejection),
          "own header does not parse");
  const fp::OutgoingMessage accepted = receiver.handle_header("site-a", *header);
  check_reply(accepted);
  require(!receiver.last_rejection().has_value(), "own header refused");
  fp::Envelope envelope;
  require(fp::read_envelope(frame, fp::kDefaultMaxMessageBytes, envelope, rejection), "own envelope refused");
  check_reply(receiver.handle_chunk("site-a", envelope, frame));
  if (sealed && !receiver.last_rejection().has_value()) {
    const fp::SharedMessage seal = fp::update_seal(metadata, descriptors, {&chunk_hash, 1}, f.site, hash_kind);
    std::unique_ptr<fp::ParsedMessage> parsed;
    require(fp::parse_message(seal, fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection), "own seal does not parse");
    check_reply(receiver.handle_seal("site-a", *parsed));
  }
  check_completed(receiver);
  return 0;
}
