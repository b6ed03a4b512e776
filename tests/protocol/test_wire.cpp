// Every message of fedmesh.capnp survives serialize -> parse with its fields;
// every malformed envelope or body is refused with the right code, never a
// crash; Hello/Welcome version negotiation picks the highest common version.
#include <gtest/gtest.h>

#include <cstring>

#include "base/random.h"
#include "protocol/wire.h"
#include "protocol/update_transfer.h"

namespace fp = fedmesh::protocol;
namespace wire = fedmesh::wire;

namespace {

std::unique_ptr<fp::ParsedMessage> round_trip(capnp::MallocMessageBuilder& builder, uint32_t chunk = 0, uint64_t sequence = 0) {
  const fp::OutgoingMessage out = fp::serialize(builder, chunk, sequence);
  std::unique_ptr<fp::ParsedMessage> parsed;
  fp::Rejection rejection;
  EXPECT_TRUE(fp::parse_message(out.bytes(), fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) << rejection.reason;
  return parsed;
}

std::vector<uint8_t> bytes_of(capnp::MallocMessageBuilder& builder) {
  const fp::OutgoingMessage out = fp::serialize(builder);
  return {out.bytes().begin(), out.bytes().end()};
}

fp::Rejection refusal(std::span<const uint8_t> frame, size_t limit = fp::kDefaultMaxMessageBytes) {
  std::unique_ptr<fp::ParsedMessage> parsed;
  fp::Rejection rejection;
  EXPECT_FALSE(fp::parse_message(frame, limit, nullptr, parsed, rejection));
  return rejection;
}

TEST(Wire, HelloAndWelcomeRoundTrip) {
  capnp::MallocMessageBuilder builder;
  auto hello = builder.initRoot<wire::Message>().initHello();
  hello.setFederation("fed");
  hello.setSiteName("site-a");
  hello.setRole(wire::Role::SITE);
  hello.setProtocolVersion(3);
  hello.setMinProtocolVersion(1);
  auto caps = hello.initCapabilities();
  auto encodings = caps.initEncodings(2);
  encodings.set(0, wire::TensorEncoding::DENSE_F32);
  encodings.set(1, wire::TensorEncoding::BLOCK_INT4);
  caps.setMaxMessageBytes(1234);
  auto parsed = round_trip(builder);
  ASSERT_TRUE(parsed);
  ASSERT_TRUE(parsed->root().isHello());
  const auto h = parsed->root().getHello();
  EXPECT_EQ(std::string(h.getFederation().cStr()), "fed");
  EXPECT_EQ(std::string(h.getSiteName().cStr()), "site-a");
  EXPECT_EQ(h.getProtocolVersion(), 3);
  EXPECT_EQ(h.getCapabilities().getEncodings()[1], wire::TensorEncoding::BLOCK_INT4);
  EXPECT_EQ(h.getCapabilities().getMaxMessageBytes(), 1234u);
  EXPECT_EQ(parsed->envelope().kind, wire::Message::HELLO);

  capnp::MallocMessageBuilder reply;
  auto welcome = reply.initRoot<wire::Message>().initWelcome();
  welcome.setSiteName("aggregator");
  welcome.setProtocolVersion(1);
  welcome.setRound(7);
  welcome.setModelVersion(6);
  auto w = round_trip(reply);
  ASSERT_TRUE(w && w->root().isWelcome());
  EXPECT_EQ(w->root().getWelcome().getRound(), 7u);
  EXPECT_EQ(w->root().getWelcome().getModelVersion(), 6u);
}

TEST(Wire, RoundModelAndControlMessagesRoundTrip) {
  {
    capnp::MallocMessageBuilder b;
    auto r = b.initRoot<wire::Message>().initRoundAnnounce();
    r.setRound(4);
    r.setModelVersion(3);
    const uint8_t hash[32] = {1, 2, 3};
    r.setModelHash(kj::arrayPtr(hash, 32));
    r.setDeadlineUnixMs(99);
    auto p = round_trip(b);
    ASSERT_TRUE(p && p->root().isRoundAnnounce());
    EXPECT_EQ(p->root().getRoundAnnounce().getModelHash()[2], 3);
    EXPECT_EQ(p->root().getRoundAnnounce().getDeadlineUnixMs(), 99u);
  }
  {
    capnp::MallocMessageBuilder b;
    auto r = b.initRoot<wire::Message>().initModelRequest();
    r.setVersion(5);
    r.setFromChunk(2);
    auto p = round_trip(b);
    ASSERT_TRUE(p && p->root().isModelRequest());
    EXPECT_EQ(p->root().getModelRequest().getFromChunk(), 2u);
  }
  {
    capnp::MallocMessageBuilder b;
    auto c = b.initRoot<wire::Message>().initModelChunk();
    c.setVersion(5);
    c.setChunkIndex(1);
    c.setChunkCount(3);
    auto t = c.initTensors(1)[0];
    t.setName("w");
    auto shape = t.initShape(2);
    shape.set(0, 4);
    shape.set(1, 5);
    fp::EncodedSegment segment;
    segment.tensor = 0;
    segment.count = 2;
    segment.values = {1, 2, 3, 4, 5, 6, 7, 8};
    fp::fill_segment(c.initSegments(1)[0], segment);
    auto p = round_trip(b, 1, 0);
    ASSERT_TRUE(p && p->root().isModelChunk());
    const auto chunk = p->root().getModelChunk();
    EXPECT_EQ(chunk.getTensors()[0].getShape()[1], 5u);
    fp::SegmentView view;
    fp::Rejection rejection;
    ASSERT_TRUE(fp::read_segment(chunk.getSegments()[0], view, rejection));
    EXPECT_EQ(view.count, 2u);
    ASSERT_EQ(view.values.size(), 8u);
    EXPECT_EQ(view.values[7], 8);
    EXPECT_EQ(p->envelope().chunk_index, 1u);
  }
  {
    capnp::MallocMessageBuilder b;
    auto a = b.initRoot<wire::Message>().initAck();
    a.setSequence(9);
    a.setNextChunk(4);
    a.setComplete(true);
    auto p = round_trip(b);
    ASSERT_TRUE(p && p->root().isAck());
    EXPECT_TRUE(p->root().getAck().getComplete());
    EXPECT_EQ(p->root().getAck().getNextChunk(), 4u);
  }
  {
    auto out = fp::make_reject(3, {wire::RejectCode::NON_FINITE, "NaN at element 5"});
    std::unique_ptr<fp::ParsedMessage> p;
    fp::Rejection rejection;
    ASSERT_TRUE(fp::parse_message(out.bytes(), fp::kDefaultMaxMessageBytes, nullptr, p, rejection));
    ASSERT_TRUE(p->root().isReject());
    EXPECT_EQ(p->root().getReject().getCode(), wire::RejectCode::NON_FINITE);
    EXPECT_EQ(std::string(p->root().getReject().getText().cStr()), "NaN at element 5");
  }
  {
    capnp::MallocMessageBuilder b;
    auto h = b.initRoot<wire::Message>().initHeartbeat();
    h.setSentUnixMs(123);
    auto p = round_trip(b);
    ASSERT_TRUE(p && p->root().isHeartbeat());
    EXPECT_EQ(p->root().getHeartbeat().getSentUnixMs(), 123u);
  }
}

TEST(Wire, MembershipMessagesRoundTrip) {
  capnp::MallocMessageBuilder b;
  auto ping = b.initRoot<wire::Message>().initPingReq();
  ping.setProbe(77);
  ping.setTarget("site-c");
  auto deltas = ping.initDeltas(2);
  deltas[0].setSite("site-a");
  deltas[0].setStatus(wire::MemberStatus::SUSPECT);
  deltas[0].setIncarnation(3);
  deltas[1].setSite("site-b");
  deltas[1].setStatus(wire::MemberStatus::DEAD);
  auto p = round_trip(b);
  ASSERT_TRUE(p && p->root().isPingReq());
  const auto r = p->root().getPingReq();
  EXPECT_EQ(r.getProbe(), 77u);
  EXPECT_EQ(std::string(r.getTarget().cStr()), "site-c");
  EXPECT_EQ(r.getDeltas()[0].getStatus(), wire::MemberStatus::SUSPECT);
  EXPECT_EQ(r.getDeltas()[0].getIncarnation(), 3u);
  EXPECT_EQ(r.getDeltas()[1].getStatus(), wire::MemberStatus::DEAD);

  capnp::MallocMessageBuilder a;
  a.initRoot<wire::Message>().initPingAck().setTarget("site-c");
  auto q = round_trip(a);
  ASSERT_TRUE(q && q->root().isPingAck());
  capnp::MallocMessageBuilder c;
  c.initRoot<wire::Message>().initPing().setProbe(5);
  auto s = round_trip(c);
  ASSERT_TRUE(s && s->root().isPing());
}

TEST(Wire, EnvelopeDefectsAreRefusedWithTheRightCode) {
  capnp::MallocMessageBuilder builder;
  builder.initRoot<wire::Message>().initHeartbeat().setRound(1);
  const std::vector<uint8_t> good = bytes_of(builder);

  EXPECT_EQ(refusal(std::span(good).first(10)).code, wire::RejectCode::MALFORMED);
  EXPECT_EQ(refusal(good, good.size() - 1).code, wire::RejectCode::TOO_LARGE);

  auto bad_magic = good;
  bad_magic[0] ^= 0xff;
  EXPECT_EQ(refusal(bad_magic).code, wire::RejectCode::MALFORMED);

  auto old_version = good;
  old_version[4] = 0;
  old_version[5] = 0;
  EXPECT_EQ(refusal(old_version).code, wire::RejectCode::VERSION_UNSUPPORTED);

  auto unknown_kind = good;
  unknown_kind[6] = 200;
  const auto unknown = refusal(unknown_kind);
  EXPECT_EQ(unknown.code, wire::RejectCode::MALFORMED);
  EXPECT_NE(unknown.reason.find("kind"), std::string::npos) << unknown.reason;

  auto wrong_kind = good;  // says Hello, holds a Heartbeat
  wrong_kind[6] = static_cast<uint8_t>(wire::Message::HELLO);
  EXPECT_EQ(refusal(wrong_kind).code, wire::RejectCode::MALFORMED);

  auto truncated = good;
  truncated.resize(truncated.size() - 8);
  EXPECT_EQ(refusal(truncated).code, wire::RejectCode::MALFORMED);

  auto lying_length = good;
  lying_length[8] += 8;
  EXPECT_EQ(refusal(lying_length).code, wire::RejectCode::MALFORMED);
}

TEST(Wire, GarbageBodiesNeverCrashTheParser) {
  fedmesh::Rng rng(42);
  capnp::MallocMessageBuilder builder;
  auto header = builder.initRoot<wire::Message>().initUpdateHeader();
  header.setSender("site-a");
  header.initTensors(3)[1].setName("layer.weight");
  const std::vector<uint8_t> good = bytes_of(builder);
  int refused = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    auto frame = good;
    const int flips = 1 + static_cast<int>(rng.below(8));
    for (int f = 0; f < flips; ++f) {
      const size_t at = fp::kEnvelopeBytes + rng.below(frame.size() - fp::kEnvelopeBytes);
      frame[at] = static_cast<uint8_t>(rng.below(256));
    }
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    if (!fp::parse_message(frame, fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) {
      ++refused;
      EXPECT_FALSE(rejection.reason.empty());
      continue;
    }
    // Parsed: every accessor either works or throws kj::Exception, never crashes.
    try {
      const auto h = parsed->root().getUpdateHeader();
      for (auto t : h.getTensors()) (void)t.getName().size();
      (void)h.getSender().size();
    } catch (const kj::Exception&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
}

TEST(Wire, AMisalignedFrameIsCopiedBeforeParsing) {
  capnp::MallocMessageBuilder builder;
  builder.initRoot<wire::Message>().initHeartbeat().setSentUnixMs(555);
  const std::vector<uint8_t> good = bytes_of(builder);
  std::vector<uint8_t> storage(good.size() + 1);
  std::memcpy(storage.data() + 1, good.data(), good.size());
  auto keep = std::make_shared<int>(0);
  std::unique_ptr<fp::ParsedMessage> parsed;
  fp::Rejection rejection;
  ASSERT_TRUE(fp::parse_message(std::span(storage).subspan(1), fp::kDefaultMaxMessageBytes, keep, parsed, rejection))
      << rejection.reason;
  EXPECT_EQ(parsed->root().getHeartbeat().getSentUnixMs(), 555u);
}

TEST(Wire, VersionNegotiationPicksTheHighestCommonVersion) {
  uint16_t chosen = 0;
  fp::Rejection rejection;
  EXPECT_TRUE(fp::negotiate_version(1, 9, chosen, rejection));  // a newer peer talks down to us
  EXPECT_EQ(chosen, fp::kProtocolVersion);
  EXPECT_TRUE(fp::negotiate_version(fp::kMinProtocolVersion, fp::kProtocolVersion, chosen, rejection));
  EXPECT_EQ(chosen, fp::kProtocolVersion);
  EXPECT_FALSE(fp::negotiate_version(fp::kProtocolVersion + 1, fp::kProtocolVersion + 5, chosen, rejection));
  EXPECT_EQ(rejection.code, wire::RejectCode::VERSION_UNSUPPORTED);
  EXPECT_NE(rejection.reason.find("this build speaks"), std::string::npos);
  EXPECT_FALSE(fp::negotiate_version(3, 2, chosen, rejection));
}

TEST(Wire, EncodingsMapOneToOneOntoTheSchema) {
  for (int e = 0; e < fp::kEncodingCount; ++e) {
    fp::Encoding back;
    ASSERT_TRUE(fp::from_wire(fp::to_wire(static_cast<fp::Encoding>(e)), back));
    EXPECT_EQ(static_cast<int>(back), e);
  }
  fp::Encoding out;
  EXPECT_FALSE(fp::from_wire(static_cast<wire::TensorEncoding>(fp::kEncodingCount), out));
}

}  // namespace

// A message built in the buffer it is sent from is the same bytes as the
// one serialize() copies out of a builder, whether it fits the size given
// (sent as built) or outgrows it (serialized after all, in more than one
// segment, with the same content).
TEST(Wire, AMessageBuiltInPlaceIsTheSerializedMessage) {
  const auto build = [](capnp::MessageBuilder& builder, size_t values) {
    auto chunk = builder.initRoot<fedmesh::wire::Message>().initUpdateChunk();
    chunk.setSequence(7);
    chunk.setChunkIndex(3);
    auto segment = chunk.initSegments(1)[0];
    segment.setCount(values);
    auto bytes = segment.initValues(static_cast<unsigned>(values * 4));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[static_cast<unsigned>(i)] = static_cast<uint8_t>(i * 7);
  };
  for (const size_t words : {size_t{4096}, size_t{8}}) {  // room enough; far too little
    SCOPED_TRACE(words);
    capnp::MallocMessageBuilder reference;
    build(reference, 1000);
    const fp::OutgoingMessage expected = fp::serialize(reference, 3, 7);
    fp::InPlaceMessage in_place(words);
    build(in_place.builder(), 1000);
    const fp::OutgoingMessage got = in_place.finish(3, 7);
    if (words > 8) {  // sent as built: one segment, as the reference's
      ASSERT_EQ(got.size(), expected.size());
      EXPECT_EQ(std::memcmp(got.bytes().data(), expected.bytes().data(), got.size()), 0);
    }
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    ASSERT_TRUE(fp::parse_message(got.bytes(), fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) << rejection.reason;
    EXPECT_EQ(parsed->envelope().chunk_index, 3u);
    EXPECT_EQ(parsed->envelope().sequence, 7u);
    const auto values = parsed->root().getUpdateChunk().getSegments()[0].getValues();
    ASSERT_EQ(values.size(), 4000u);
    for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(values[static_cast<unsigned>(i)], static_cast<uint8_t>(i * 7));
  }
}
