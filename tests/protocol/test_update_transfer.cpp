// The update transfer state machine without sockets: prepare_update on one
// side, UpdateReceiver on the other, with every check the receiver makes
// exercised by a message that fails exactly that check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

#include "base/random.h"
#include "crypto/replay_guard.h"
#include "crypto/tree_hash.h"
#include "protocol/rate_limiter.h"
#include "protocol/sealed_update.h"
#include "protocol/update_service.h"
#include "protocol/update_transfer.h"

namespace fp = fedmesh::protocol;
namespace fc = fedmesh::crypto;
namespace wire = fedmesh::wire;

namespace {

class UpdateTransfer : public ::testing::Test {
 protected:
  void SetUp() override {
    admin_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("admin").value());
    site_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("site-a").value());
    other_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("site-b").value());
    roster_.federation = "fed";
    roster_.admin_public = admin_->identity.sign_public;
    roster_.sites.push_back({site_->identity, fc::Role::kSite, ""});
    roster_.sites.push_back({other_->identity, fc::Role::kSite, ""});
    manifest_ = {{"w", {37, 11}}, {"b", {37}}};
    fedmesh::Rng rng(7);
    for (const auto& shape : manifest_) {
      std::vector<float> values(shape.element_count());
      for (auto& v : values) v = static_cast<float>(rng.normal() * 0.1);
      values_.push_back(std::move(values));
    }
  }

  fp::ReceiverPolicy policy() const {
    fp::ReceiverPolicy p;
    p.federation = "fed";
    p.self = "aggregator";
    p.manifest = manifest_;
    p.current_round = 5;
    p.max_round_lag = 1;
    p.current_version = 5;
    return p;
  }

  fp::UpdateMetadata metadata(uint64_t sequence) const {
    return {"fed", 5, 5, "site-a", "aggregator", sequence, 40};
  }

  // prepare_update of values_ (or, sealed, prepare_sealed_update), every
  // tensor in `encoding` (blocks of 32).
  fp::PreparedUpdate prepare(const fp::UpdateMetadata& m, fp::Encoding encoding = fp::Encoding::kDenseF32,
                             size_t chunk_bytes = 256, const fc::SiteKeys* signer = nullptr, bool sealed = false) {
    std::vector<std::span<const float>> spans(values_.begin(), values_.end());
    std::vector<fp::TensorPlan> plans(manifest_.size(), fp::TensorPlan{encoding, 32});
    const fc::SiteKeys& keys = signer ? *signer : *site_;
    auto prepared = sealed ? fp::prepare_sealed_update(m, manifest_, spans, plans, keys, chunk_bytes)
                           : fp::prepare_update(m, manifest_, spans, plans, keys, chunk_bytes);
    EXPECT_TRUE(prepared.is_ok()) << prepared.status().to_string();
    return std::move(prepared.value());
  }

  static std::unique_ptr<fp::ParsedMessage> parse(std::span<const uint8_t> bytes) {
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    EXPECT_TRUE(fp::parse_message(bytes, fp::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) << rejection.reason;
    return parsed;
  }

  // Sends header and every chunk; returns the last reply.
  std::unique_ptr<fp::ParsedMessage> deliver(fp::UpdateReceiver& receiver, const fp::PreparedUpdate& update,
                                             const std::string& peer = "site-a") {
    auto header = parse(update.header);
    auto reply = receiver.handle_header(peer, *header);
    auto parsed = parse(reply.bytes());
    if (!parsed->root().isAck()) return parsed;
    for (uint32_t c = parsed->root().getAck().getNextChunk(); c < update.chunks.size(); ++c) {
      fp::Envelope envelope;
      fp::Rejection rejection;
      EXPECT_TRUE(fp::read_envelope(update.chunks[c], fp::kDefaultMaxMessageBytes, envelope, rejection));
      auto out = receiver.handle_chunk(peer, envelope, update.chunks[c]);
      parsed = parse(out.bytes());
      if (!parsed->root().isAck()) return parsed;
    }
    return parsed;
  }

  fp::PreparedUpdate prepare_sealed(const fp::UpdateMetadata& m, fp::Encoding encoding = fp::Encoding::kDenseF32,
                                    size_t chunk_bytes = 256, const fc::SiteKeys* signer = nullptr) {
    return prepare(m, encoding, chunk_bytes, signer, /*sealed=*/true);
  }

  static std::unique_ptr<fp::ParsedMessage> send_chunk(fp::UpdateReceiver& receiver, const fp::SharedMessage& chunk,
                                                       const std::string& peer = "site-a") {
    fp::Envelope envelope;
    fp::Rejection rejection;
    EXPECT_TRUE(fp::read_envelope(chunk, fp::kDefaultMaxMessageBytes, envelope, rejection)) << rejection.reason;
    return parse(receiver.handle_chunk(peer, envelope, chunk).bytes());
  }

  // A sealed update's header, its chunks from the first the receiver lacks,
  // and its seal after `seal_after` of them (all, by default); returns the
  // last reply, or the first Reject.
  std::unique_ptr<fp::ParsedMessage> deliver_sealed(fp::UpdateReceiver& receiver, const fp::PreparedUpdate& update,
                                                    size_t seal_after = SIZE_MAX, const std::string& peer = "site-a") {
    auto parsed = parse(receiver.handle_header(peer, *parse(update.header)).bytes());
    if (!parsed->root().isAck()) return parsed;
    const std::vector<fp::SharedMessage> chunks = update.stream->all_chunks();
    auto seal = update.stream->seal();
    EXPECT_TRUE(seal.is_ok()) << seal.status().to_string();
    const auto send_seal = [&] { return parse(receiver.handle_seal(peer, *parse(*seal)).bytes()); };
    for (size_t c = parsed->root().getAck().getNextChunk(); c < chunks.size(); ++c) {
      if (c == seal_after) {
        parsed = send_seal();
        if (!parsed->root().isAck()) return parsed;
      }
      parsed = send_chunk(receiver, chunks[c], peer);
      if (!parsed->root().isAck()) return parsed;
    }
    if (seal_after >= chunks.size()) parsed = send_seal();
    return parsed;
  }

  static wire::RejectCode code_of(const fp::ParsedMessage& reply) {
    EXPECT_TRUE(reply.root().isReject());
    return reply.root().isReject() ? reply.root().getReject().getCode() : wire::RejectCode::MALFORMED;
  }

  static uint64_t now_micros() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  }

  std::unique_ptr<fc::SiteKeys> admin_, site_, other_;
  fc::Roster roster_;
  std::vector<fp::TensorShape> manifest_;
  std::vector<std::vector<float>> values_;
};

// A gossip update's peer fields travel in its signed header and come out
// as sent; a gossip peer refuses an update without them and an aggregator
// one with them, both as malformed, before any chunk is taken.
TEST_F(UpdateTransfer, PeerFieldsTravelSignedAndOnlyToPeers) {
  fp::UpdateMetadata share = metadata(1);
  share.peer = fc::PeerUpdateFields{fc::PeerUpdateKind::kShare, std::ldexp(0.75, -700), 0, 0};
  fp::UpdateMetadata slice = metadata(2);
  slice.peer = fc::PeerUpdateFields{fc::PeerUpdateKind::kCatchUpSlice, 0.0, 2, 3};

  auto replay = fc::ReplayGuard::in_memory();
  fp::ReceiverPolicy peer_policy = policy();
  peer_policy.peer_updates = true;
  fp::UpdateReceiver peer(peer_policy, roster_, replay);
  for (const fp::UpdateMetadata& sent : {share, slice}) {
    auto reply = deliver(peer, prepare(sent));
    ASSERT_TRUE(reply->root().isAck());
    EXPECT_TRUE(reply->root().getAck().getComplete());
  }
  auto done = peer.take_completed();
  ASSERT_EQ(done.size(), 2u);
  ASSERT_TRUE(done[0].metadata.peer.has_value());
  EXPECT_EQ(done[0].metadata.peer->kind, fc::PeerUpdateKind::kShare);
  EXPECT_EQ(done[0].metadata.peer->weight, share.peer->weight);
  ASSERT_TRUE(done[1].metadata.peer.has_value());
  EXPECT_EQ(done[1].metadata.peer->kind, fc::PeerUpdateKind::kCatchUpSlice);
  EXPECT_EQ(done[1].metadata.peer->slice, 2u);
  EXPECT_EQ(done[1].metadata.peer->slices, 3u);

  auto plain = deliver(peer, prepare(metadata(3)));
  EXPECT_EQ(code_of(*plain), wire::RejectCode::MALFORMED);
  EXPECT_NE(std::string(plain->root().getReject().getText().cStr()).find("without gossip fields"), std::string::npos);

  auto replay2 = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver aggregator(policy(), roster_, replay2);
  share.sequence = 4;
  auto refused = deliver(aggregator, prepare(share));
  EXPECT_EQ(code_of(*refused), wire::RejectCode::MALFORMED);
  EXPECT_NE(std::string(refused->root().getReject().getText().cStr()).find("gossip update sent to an aggregator"),
            std::string::npos);
  EXPECT_TRUE(aggregator.take_completed().empty());
}

TEST_F(UpdateTransfer, LosslessUpdateArrivesBitForBitInManyChunks) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  const auto update = prepare(metadata(1));
  ASSERT_GT(update.chunks.size(), 5u);
  auto reply = deliver(receiver, update);
  ASSERT_TRUE(reply->root().isAck()) << reply->root().getReject().getText().cStr();
  EXPECT_TRUE(reply->root().getAck().getComplete());
  auto done = receiver.take_completed();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].metadata.sample_count, 40u);
  EXPECT_EQ(done[0].tensors, values_);
  EXPECT_EQ(replay.last_accepted(fc::replay_key(site_->identity.sign_public)), 1u);
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
}

TEST_F(UpdateTransfer, EveryEncodingDecodesWithinItsBound) {
  const std::pair<fp::Encoding, double> cases[] = {
      {fp::Encoding::kDenseBf16, 1.0 / 256}, {fp::Encoding::kDenseF16, 1.0 / 2048},
      {fp::Encoding::kBlockInt8, 0.5 / 127}, {fp::Encoding::kBlockInt4, 0.5 / 7},
      {fp::Encoding::kSparseF32, 0.0},       {fp::Encoding::kSparseF16, 1.0 / 2048},
      {fp::Encoding::kSparseInt8, 0.5 / 127},
  };
  uint64_t sequence = 1;
  for (const auto& [encoding, relative] : cases) {
    auto replay = fc::ReplayGuard::in_memory();
    fp::UpdateReceiver receiver(policy(), roster_, replay);
    auto reply = deliver(receiver, prepare(metadata(sequence++), encoding));
    ASSERT_TRUE(reply->root().isAck()) << fp::encoding_name(encoding);
    auto done = receiver.take_completed();
    ASSERT_EQ(done.size(), 1u);
    for (size_t t = 0; t < values_.size(); ++t) {
      float max_abs = 0;
      for (float v : values_[t]) max_abs = std::max(max_abs, std::fabs(v));
      for (size_t i = 0; i < values_[t].size(); ++i) {
        // Relative bound for the float forms; scale-relative for quantized ones.
        const double bound = relative * (encoding == fp::Encoding::kDenseBf16 || encoding == fp::Encoding::kDenseF16 ||
                                                  encoding == fp::Encoding::kSparseF16
                                              ? std::fabs(values_[t][i]) + 1e-7
                                              : max_abs) + 1e-9;
        ASSERT_LE(std::fabs(done[0].tensors[t][i] - values_[t][i]), bound)
            << fp::encoding_name(encoding) << " tensor " << t << " element " << i;
      }
    }
  }
}

// A receiver given a spill directory stages each transfer in an unnamed file
// there as its chunks verify, and hands over exactly what a receiver that
// stages in memory does, for every encoding; nothing is left in the
// directory. A sparse tensor wider than the receiver's write window (2^20
// values) is written in windows, zeros where nothing is stored.
TEST_F(UpdateTransfer, AReceiverWithASpillDirectoryStagesOnDiskAndHandsOverTheSameValues) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "fedmesh-spill-test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto spilled_values = [](const fp::ReceivedUpdate& update, const std::vector<fp::TensorShape>& manifest) {
    std::vector<std::vector<float>> tensors;
    uint64_t at = 0;
    for (const auto& shape : manifest) {
      std::vector<float> values(shape.element_count());
      EXPECT_TRUE(update.spilled->read(at, {reinterpret_cast<uint8_t*>(values.data()), values.size() * 4}).is_ok());
      at += values.size() * 4;
      tensors.push_back(std::move(values));
    }
    EXPECT_EQ(at, update.spilled->size());
    return tensors;
  };
  // The wide sparse tensor: a few values over 2^21 + 5 elements.
  const std::vector<fp::TensorShape> wide_manifest = {{"wide", {(int64_t{1} << 21) + 5}}, {"b", {37}}};
  std::vector<std::vector<float>> wide_values = {std::vector<float>((size_t{1} << 21) + 5, 0.0f), values_[1]};
  for (size_t i = 3; i < wide_values[0].size(); i += 65537) wide_values[0][i] = 0.25f * static_cast<float>(i % 7 + 1);
  wide_values[0].back() = -1.5f;
  {
    std::vector<uint64_t> indices;
    std::vector<float> stored;
    for (size_t i = 0; i < wide_values[0].size(); ++i) {
      if (wide_values[0][i] != 0.0f) indices.push_back(i), stored.push_back(wide_values[0][i]);
    }
    auto segments = fp::encode_sparse(0, wide_values[0].size(), indices, stored, fp::Encoding::kSparseF32, 1 << 16);
    ASSERT_TRUE(segments.is_ok());
    ASSERT_GT(segments->front().count, uint64_t{1} << 20) << "the wide case must pass the receiver's window";
  }

  uint64_t sequence = 1;
  for (const fp::Encoding encoding :
       {fp::Encoding::kDenseF32, fp::Encoding::kDenseBf16, fp::Encoding::kDenseF16, fp::Encoding::kBlockInt8,
        fp::Encoding::kBlockInt4, fp::Encoding::kSparseF32, fp::Encoding::kSparseF16, fp::Encoding::kSparseInt8}) {
    for (const bool wide : {false, true}) {
      if (wide && !fp::encoding_is_sparse(encoding)) continue;
      fp::ReceiverPolicy in_memory = policy();
      if (wide) in_memory.manifest = wide_manifest;
      fp::ReceiverPolicy on_disk = in_memory;
      on_disk.spill_dir = dir;
      const std::vector<std::vector<float>>& sent = wide ? wide_values : values_;
      std::vector<std::span<const float>> spans(sent.begin(), sent.end());
      std::vector<fp::TensorPlan> plans(sent.size(), fp::TensorPlan{encoding, 32});
      auto prepared = fp::prepare_update(metadata(sequence++), in_memory.manifest, spans, plans, *site_,
                                         wide ? 1 << 16 : 256);
      ASSERT_TRUE(prepared.is_ok()) << prepared.status().to_string();

      auto replay_a = fc::ReplayGuard::in_memory();
      auto replay_b = fc::ReplayGuard::in_memory();
      fp::UpdateReceiver memory_receiver(in_memory, roster_, replay_a);
      fp::UpdateReceiver disk_receiver(on_disk, roster_, replay_b);
      ASSERT_TRUE(deliver(memory_receiver, *prepared)->root().isAck()) << fp::encoding_name(encoding);
      // Half-way, the transfer is staged and the directory still lists nothing.
      auto header = parse(prepared->header);
      ASSERT_TRUE(parse(disk_receiver.handle_header("site-a", *header).bytes())->root().isAck());
      EXPECT_TRUE(std::filesystem::is_empty(dir));
      auto reply = deliver(disk_receiver, *prepared);
      ASSERT_TRUE(reply->root().isAck() && reply->root().getAck().getComplete()) << fp::encoding_name(encoding);
      auto from_memory = memory_receiver.take_completed();
      auto from_disk = disk_receiver.take_completed();
      ASSERT_EQ(from_memory.size(), 1u);
      ASSERT_EQ(from_disk.size(), 1u);
      ASSERT_TRUE(from_disk[0].spilled);
      EXPECT_TRUE(from_disk[0].tensors.empty());
      EXPECT_EQ(spilled_values(from_disk[0], in_memory.manifest), from_memory[0].tensors)
          << fp::encoding_name(encoding) << (wide ? " (wide)" : "");
      if (encoding == fp::Encoding::kDenseF32 || encoding == fp::Encoding::kSparseF32) {
        EXPECT_EQ(from_memory[0].tensors, sent) << fp::encoding_name(encoding);
      }
    }
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));

  // A directory that cannot take the file: the header is answered BUSY,
  // naming it, and nothing is taken.
  fp::ReceiverPolicy missing = policy();
  missing.spill_dir = dir / "not-there";
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(missing, roster_, replay);
  auto refused = deliver(receiver, prepare(metadata(sequence++)));
  EXPECT_EQ(code_of(*refused), wire::RejectCode::BUSY);
  EXPECT_NE(std::string(refused->root().getReject().getText().cStr()).find("not-there"), std::string::npos);
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
  std::filesystem::remove_all(dir);
}

TEST_F(UpdateTransfer, EachHeaderDefectIsRefusedForItsReason) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  struct Case {
    const char* name;
    fp::UpdateMetadata metadata;
    std::string peer;
    wire::RejectCode code;
    const fc::SiteKeys* signer;
  };
  auto m = [&](auto change) {
    fp::UpdateMetadata x = metadata(10);
    change(x);
    return x;
  };
  const Case cases[] = {
      {"impostor", metadata(10), "site-b", wire::RejectCode::UNAUTHENTICATED, nullptr},
      {"not on roster", m([](auto& x) { x.sender = "site-z"; }), "site-z", wire::RejectCode::UNAUTHENTICATED, nullptr},
      {"other federation", m([](auto& x) { x.federation = "evil"; }), "site-a", wire::RejectCode::WRONG_FEDERATION, nullptr},
      {"other recipient", m([](auto& x) { x.recipient = "site-b"; }), "site-a", wire::RejectCode::WRONG_RECIPIENT, nullptr},
      {"forged", metadata(10), "site-a", wire::RejectCode::BAD_SIGNATURE, other_.get()},
      {"future round", m([](auto& x) { x.round = 6; }), "site-a", wire::RejectCode::WRONG_ROUND, nullptr},
      {"stale round", m([](auto& x) { x.round = 3; }), "site-a", wire::RejectCode::WRONG_ROUND, nullptr},
      {"future version", m([](auto& x) { x.base_version = 6; }), "site-a", wire::RejectCode::WRONG_ROUND, nullptr},
      {"sequence a year ahead", m([](auto& x) { x.sequence = now_micros() + 365ull * 24 * 3600 * 1'000'000; }),
       "site-a", wire::RejectCode::SEQUENCE_AHEAD, nullptr},
      {"largest sequence", m([](auto& x) { x.sequence = UINT64_MAX; }), "site-a", wire::RejectCode::SEQUENCE_AHEAD,
       nullptr},
      {"samples over the cap", m([](auto& x) { x.sample_count = fp::kDefaultMaxSampleCount + 1; }), "site-a",
       wire::RejectCode::TOO_MANY_SAMPLES, nullptr},
  };
  for (const auto& c : cases) {
    auto header = parse(prepare(c.metadata, fp::Encoding::kDenseF32, 4096, c.signer).header);
    auto reply = parse(receiver.handle_header(c.peer, *header).bytes());
    EXPECT_EQ(code_of(*reply), c.code) << c.name << ": " << reply->root().getReject().getText().cStr();
    ASSERT_TRUE(receiver.last_rejection().has_value()) << c.name;
  }
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);

  // Wrong shape: the same layer with another width.
  auto wrong = manifest_;
  wrong[0].dims = {37, 12};
  std::vector<float> w(37 * 12, 0.5f), b(37, 0.5f);
  const std::vector<std::span<const float>> spans = {w, b};
  const std::vector<fp::TensorPlan> plans(2);
  auto prepared = fp::prepare_update(metadata(11), wrong, spans, plans, *site_, 4096);
  ASSERT_TRUE(prepared.is_ok());
  auto reply = parse(receiver.handle_header("site-a", *parse(prepared->header)).bytes());
  EXPECT_EQ(code_of(*reply), wire::RejectCode::WRONG_SHAPE);
  EXPECT_NE(std::string(reply->root().getReject().getText().cStr()).find("37x11"), std::string::npos);
}

TEST_F(UpdateTransfer, ReplayedUpdatesAreRefusedAndCountersPersist) {
  const auto file = std::filesystem::temp_directory_path() / ("fedmesh-replay-" + std::to_string(getpid()));
  std::filesystem::remove(file);
  {
    auto replay = fc::ReplayGuard::open(file);
    ASSERT_TRUE(replay.is_ok());
    fp::UpdateReceiver receiver(policy(), roster_, *replay);
    const auto update = prepare(metadata(3));
    ASSERT_TRUE(deliver(receiver, update)->root().getAck().getComplete());
    EXPECT_EQ(receiver.take_completed().size(), 1u);
    // The same update sent again (its sender missed the final Ack): the Ack
    // again, and nothing taken twice.
    auto again = deliver(receiver, update);
    ASSERT_TRUE(again->root().isAck());
    EXPECT_TRUE(again->root().getAck().getComplete());
    EXPECT_TRUE(receiver.take_completed().empty());
    // Another update under the same sequence, or an older one, is the replay.
    fp::UpdateMetadata other = metadata(3);
    other.sample_count = 41;
    EXPECT_EQ(code_of(*deliver(receiver, prepare(other))), wire::RejectCode::REPLAYED);
    EXPECT_EQ(code_of(*deliver(receiver, prepare(metadata(2)))), wire::RejectCode::REPLAYED);
  }
  auto reopened = fc::ReplayGuard::open(file);
  ASSERT_TRUE(reopened.is_ok());
  fp::UpdateReceiver receiver(policy(), roster_, *reopened);
  EXPECT_EQ(code_of(*deliver(receiver, prepare(metadata(3)))), wire::RejectCode::REPLAYED);
  EXPECT_TRUE(deliver(receiver, prepare(metadata(4)))->root().getAck().getComplete());
  std::filesystem::remove(file);
}

// A receiver whose store cannot take the update (a full disk): refused as
// notStored, nothing recorded, and the same update sent again is taken.
TEST_F(UpdateTransfer, AnUpdateTheStoreCannotTakeIsRefusedRetryablyAndTakenWhenResent) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  bool disk_full = true;
  std::vector<fp::ReceivedUpdate> stored;
  receiver.set_store_update([&](fp::ReceivedUpdate update) -> fedmesh::Status {
    if (disk_full) return fedmesh::io_error("database or disk is full");
    stored.push_back(std::move(update));
    return fedmesh::Status::ok();
  });
  const auto update = prepare(metadata(9));
  auto refused = deliver(receiver, update);
  EXPECT_EQ(code_of(*refused), wire::RejectCode::NOT_STORED);
  EXPECT_TRUE(fp::reject_is_retryable(code_of(*refused)));
  EXPECT_NE(std::string(refused->root().getReject().getText().cStr()).find("disk is full"), std::string::npos);
  EXPECT_EQ(replay.last_accepted(fc::replay_key(site_->identity.sign_public)), 0u)
      << "a counter was raised for an update that was not stored";
  EXPECT_TRUE(stored.empty());
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);

  disk_full = false;
  auto taken = deliver(receiver, update);
  ASSERT_TRUE(taken->root().isAck());
  EXPECT_TRUE(taken->root().getAck().getComplete());
  ASSERT_EQ(stored.size(), 1u);
  EXPECT_EQ(stored[0].tensors, values_);
  EXPECT_EQ(replay.last_accepted(fc::replay_key(site_->identity.sign_public)), 9u);
  EXPECT_TRUE(receiver.take_completed().empty()) << "the store hook owns a stored update";
  // Now it is durable, a resend is acknowledged and not stored twice.
  auto resent = deliver(receiver, update);
  ASSERT_TRUE(resent->root().isAck());
  EXPECT_TRUE(resent->root().getAck().getComplete());
  EXPECT_EQ(stored.size(), 1u);
  EXPECT_FALSE(fp::reject_is_retryable(wire::RejectCode::REPLAYED));
}

// A replay counter that cannot be saved is a storage failure, not a replay:
// the sender is told to send again, and the counter stays where it was.
TEST_F(UpdateTransfer, AReplayCounterThatCannotBeSavedIsNotReportedAsAReplay) {
  bool failing = true;
  auto replay = fc::ReplayGuard::persisted_by({}, [&](const std::string&, uint64_t) {
    return failing ? fedmesh::io_error("disk I/O error") : fedmesh::Status::ok();
  });
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  const auto update = prepare(metadata(4));
  auto refused = deliver(receiver, update);
  EXPECT_EQ(code_of(*refused), wire::RejectCode::NOT_STORED);
  EXPECT_EQ(replay.last_accepted(fc::replay_key(site_->identity.sign_public)), 0u);
  EXPECT_TRUE(receiver.take_completed().empty());
  failing = false;
  EXPECT_TRUE(deliver(receiver, update)->root().getAck().getComplete());
  EXPECT_EQ(receiver.take_completed().size(), 1u);
  EXPECT_EQ(replay.last_accepted(fc::replay_key(site_->identity.sign_public)), 4u);
}

TEST_F(UpdateTransfer, ChunksAreAuthenticatedBeforeTheyAreParsed) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  auto update = prepare(metadata(1));
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  std::vector<uint8_t> tampered(update.chunks[0].bytes().begin(), update.chunks[0].bytes().end());
  tampered.back() ^= 1;
  fp::Envelope envelope;
  fp::Rejection rejection;
  ASSERT_TRUE(fp::read_envelope(tampered, fp::kDefaultMaxMessageBytes, envelope, rejection));
  EXPECT_EQ(code_of(*parse(receiver.handle_chunk("site-a", envelope, tampered).bytes())), wire::RejectCode::BAD_CHUNK_HASH);
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);  // dropped, nothing delivered
  EXPECT_TRUE(receiver.take_completed().empty());
  // A chunk with no header in flight.
  ASSERT_TRUE(fp::read_envelope(update.chunks[1], fp::kDefaultMaxMessageBytes, envelope, rejection));
  EXPECT_EQ(code_of(*parse(receiver.handle_chunk("site-a", envelope, update.chunks[1]).bytes())),
            wire::RejectCode::UNKNOWN_TRANSFER);
  // Another site cannot send chunks into site-a's transfer.
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  EXPECT_EQ(code_of(*parse(receiver.handle_chunk("site-b", envelope, update.chunks[1]).bytes())),
            wire::RejectCode::UNKNOWN_TRANSFER);
}

// fedmesh's senders hash chunks with BLAKE2bp and say so in the signed
// header; a header that says nothing (a sender from before) has BLAKE2b
// chunk hashes and is still taken; and the kind a header states is the one
// its chunks are checked with.
TEST_F(UpdateTransfer, ChunkHashesAreBlake2bpAndBlake2bIsStillTaken) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  const auto body_of = [](const fp::SharedMessage& chunk) {
    fp::Envelope envelope;
    fp::Rejection rejection;
    EXPECT_TRUE(fp::read_envelope(chunk, fp::kDefaultMaxMessageBytes, envelope, rejection));
    return chunk.bytes().subspan(fp::kEnvelopeBytes, envelope.body_bytes);
  };
  const auto completes = [&](const fp::PreparedUpdate& update) {
    auto reply = deliver(receiver, update);
    return reply->root().isAck() && reply->root().getAck().getComplete();
  };
  const std::vector<fp::TensorDescriptorFields> descriptors = {
      {manifest_[0].name, manifest_[0].dims, fp::Encoding::kDenseF32, 0},
      {manifest_[1].name, manifest_[1].dims, fp::Encoding::kDenseF32, 0}};

  fp::PreparedUpdate sent = prepare(metadata(1));
  ASSERT_GT(sent.chunks.size(), 2u);
  {
    auto header = parse(sent.header);
    const auto h = header->root().getUpdateHeader();
    EXPECT_EQ(h.getChunkHash(), wire::ChunkHashKind::BLAKE2BP);
    for (size_t c = 0; c < sent.chunks.size(); ++c) {
      const fc::Hash expected = fc::tree_hash(body_of(sent.chunks[c]));
      const auto got = h.getChunkHashes()[static_cast<unsigned>(c)];
      ASSERT_TRUE(std::equal(got.begin(), got.end(), expected.begin())) << "chunk " << c;
    }
  }
  EXPECT_TRUE(completes(sent));

  // An older sender's: BLAKE2b hashes and no kind in the header.
  fp::PreparedUpdate old = prepare(metadata(2));
  std::vector<fc::Hash> blake2b;
  for (const auto& chunk : old.chunks) blake2b.push_back(fc::hash_bytes(body_of(chunk)));
  old.header = fp::signed_header(metadata(2), descriptors, blake2b, *site_);
  EXPECT_EQ(parse(old.header)->root().getUpdateHeader().getChunkHash(), wire::ChunkHashKind::BLAKE2B);
  EXPECT_TRUE(completes(old));
  auto completed = receiver.take_completed();
  ASSERT_EQ(completed.size(), 2u);
  EXPECT_EQ(completed[1].tensors, values_);

  // Signed as BLAKE2b over BLAKE2bp hashes: the chunks do not match.
  fp::PreparedUpdate mislabeled = prepare(metadata(3));
  std::vector<fc::Hash> tree;
  for (const auto& chunk : mislabeled.chunks) tree.push_back(fc::tree_hash(body_of(chunk)));
  mislabeled.header = fp::signed_header(metadata(3), descriptors, tree, *site_, fc::ChunkHash::kBlake2b);
  EXPECT_EQ(code_of(*deliver(receiver, mislabeled)), wire::RejectCode::BAD_CHUNK_HASH);
}

// A sealed update (its chunks made while the first are sent, hashes and
// signature in a seal after them) arrives as the same update would with
// its hashes in the header, in every encoding, whether its seal comes after
// the last chunk or between them; the header names no chunk and carries no
// signature.
TEST_F(UpdateTransfer, SealedUpdatesDecodeAsHeaderSignedOnesDo) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  uint64_t sequence = 1;
  for (const fp::Encoding encoding :
       {fp::Encoding::kDenseF32, fp::Encoding::kDenseF16, fp::Encoding::kDenseBf16, fp::Encoding::kBlockInt8,
        fp::Encoding::kBlockInt4, fp::Encoding::kSparseF32}) {
    for (const size_t chunk_bytes : {size_t{256}, size_t{64} << 10}) {
      SCOPED_TRACE(std::string(fp::encoding_name(encoding)) + ", chunks of " + std::to_string(chunk_bytes) + " B");
      const auto reference = prepare(metadata(sequence++), encoding, chunk_bytes);
      ASSERT_TRUE(deliver(receiver, reference)->root().getAck().getComplete());
      auto expected = receiver.take_completed();
      ASSERT_EQ(expected.size(), 1u);

      const auto sealed = prepare_sealed(metadata(sequence++), encoding, chunk_bytes);
      const auto header = parse(sealed.header)->root().getUpdateHeader();
      EXPECT_TRUE(header.getSealed());
      EXPECT_EQ(header.getChunkCount(), 0u);
      EXPECT_EQ(header.getChunkHashes().size(), 0u);
      EXPECT_EQ(header.getSignature().size(), 0u);
      const size_t chunks = sealed.stream->all_chunks().size();
      ASSERT_GE(chunks, 1u);
      for (const size_t seal_after : {chunks, chunks / 2}) {
        const auto again = seal_after == chunks ? sealed : prepare_sealed(metadata(sequence++), encoding, chunk_bytes);
        auto reply = deliver_sealed(receiver, again, seal_after);
        ASSERT_TRUE(reply->root().isAck()) << reply->root().getReject().getText().cStr();
        EXPECT_TRUE(reply->root().getAck().getComplete());
        auto got = receiver.take_completed();
        ASSERT_EQ(got.size(), 1u);
        EXPECT_EQ(got[0].tensors, expected[0].tensors);
        EXPECT_EQ(got[0].metadata.sequence, again.metadata.sequence);
        // Its seal or a chunk resent after it completed (in the window that
        // completed it) gets the Ack{complete} again, not a refusal.
        const auto late_seal = parse(receiver.handle_seal("site-a", *parse(*again.stream->seal())).bytes());
        ASSERT_TRUE(late_seal->root().isAck());
        EXPECT_TRUE(late_seal->root().getAck().getComplete());
        const auto late_chunk = send_chunk(receiver, again.stream->all_chunks().back());
        ASSERT_TRUE(late_chunk->root().isAck());
        EXPECT_TRUE(late_chunk->root().getAck().getComplete());
        EXPECT_TRUE(receiver.take_completed().empty());
      }
    }
  }
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
}

// Nothing of a sealed update is taken before its seal verifies: a chunk
// changed on the way, a seal signed by another key, a seal that disowns a
// chunk that came, or a second seal that differs drops the transfer; a seal
// without its sealed header, a sealed header with hashes or a signature, or
// one on a receiver without transport identities is refused by name.
TEST_F(UpdateTransfer, ASealedUpdateIsTakenOnlyWhenItsSealVerifies) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  const auto refused = [&](const fp::ParsedMessage& reply, wire::RejectCode code) {
    EXPECT_EQ(code_of(reply), code) << (reply.root().isReject() ? reply.root().getReject().getText().cStr() : "");
    EXPECT_EQ(receiver.transfers_in_flight(), 0u);
    EXPECT_TRUE(receiver.take_completed().empty());
  };

  // A chunk changed on the way: decoded on arrival, refused at the seal.
  {
    const auto update = prepare_sealed(metadata(1));
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
    const auto chunks = update.stream->all_chunks();
    ASSERT_GE(chunks.size(), 3u);
    std::vector<uint8_t> tampered(chunks[1].bytes().begin(), chunks[1].bytes().end());
    tampered[tampered.size() / 2] ^= 1;  // a low bit of a value near 0.1: still finite
    for (size_t c = 0; c < chunks.size(); ++c) {
      const auto reply = c == 1 ? send_chunk(receiver, fp::SharedMessage(fp::copy_message(tampered)))
                                : send_chunk(receiver, chunks[c]);
      ASSERT_TRUE(reply->root().isAck()) << "chunk " << c;
    }
    refused(*parse(receiver.handle_seal("site-a", *parse(*update.stream->seal())).bytes()),
            wire::RejectCode::BAD_CHUNK_HASH);
  }
  // A seal signed by another key (site-b's, over site-a's update).
  {
    const auto update = prepare_sealed(metadata(2));
    const auto forged = prepare_sealed(metadata(2), fp::Encoding::kDenseF32, 256, other_.get());
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
    for (const auto& chunk : update.stream->all_chunks()) ASSERT_TRUE(send_chunk(receiver, chunk)->root().isAck());
    refused(*parse(receiver.handle_seal("site-a", *parse(*forged.stream->seal())).bytes()),
            wire::RejectCode::BAD_SIGNATURE);
  }
  // A seal naming fewer chunks than came.
  {
    const auto update = prepare_sealed(metadata(3));
    const auto chunks = update.stream->all_chunks();
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
    for (const auto& chunk : chunks) ASSERT_TRUE(send_chunk(receiver, chunk)->root().isAck());
    std::vector<fc::Hash> fewer(chunks.size() - 1);
    const std::vector<fp::TensorDescriptorFields> descriptors = {
        {manifest_[0].name, manifest_[0].dims, fp::Encoding::kDenseF32, 0},
        {manifest_[1].name, manifest_[1].dims, fp::Encoding::kDenseF32, 0}};
    const auto short_seal = fp::update_seal(metadata(3), descriptors, fewer, *site_, fp::kSentChunkHash);
    refused(*parse(receiver.handle_seal("site-a", *parse(short_seal)).bytes()), wire::RejectCode::MALFORMED);
  }
  // The seal sent again is answered as the first was; a different one drops
  // the transfer.
  {
    const auto update = prepare_sealed(metadata(4));
    const auto chunks = update.stream->all_chunks();
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
    ASSERT_TRUE(send_chunk(receiver, chunks[0])->root().isAck());
    const auto seal = *update.stream->seal();
    for (int i = 0; i < 2; ++i) {
      const auto reply = parse(receiver.handle_seal("site-a", *parse(seal)).bytes());
      ASSERT_TRUE(reply->root().isAck());
      EXPECT_EQ(reply->root().getAck().getNextChunk(), 1u);
      EXPECT_FALSE(reply->root().getAck().getComplete());
    }
    // A resent header resumes it at the first chunk missing.
    const auto resumed = parse(receiver.handle_header("site-a", *parse(update.header)).bytes());
    ASSERT_TRUE(resumed->root().isAck());
    EXPECT_EQ(resumed->root().getAck().getNextChunk(), 1u);
    const auto other = prepare_sealed(metadata(4), fp::Encoding::kDenseF16);
    refused(*parse(receiver.handle_seal("site-a", *parse(*other.stream->seal())).bytes()), wire::RejectCode::MALFORMED);
  }
  // A seal for an update whose header carried its hashes, and one for no
  // transfer at all.
  {
    const auto update = prepare(metadata(5));
    const auto sealed = prepare_sealed(metadata(5));
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
    refused(*parse(receiver.handle_seal("site-a", *parse(*sealed.stream->seal())).bytes()), wire::RejectCode::MALFORMED);
    refused(*parse(receiver.handle_seal("site-a", *parse(*sealed.stream->seal())).bytes()),
            wire::RejectCode::UNKNOWN_TRANSFER);
  }
  // Before its seal, a sealed transfer's chunks are bounded by max_chunks.
  {
    auto p = policy();
    p.max_chunks = 3;
    fp::UpdateReceiver small(p, roster_, replay);
    const auto update = prepare_sealed(metadata(6));
    const auto chunks = update.stream->all_chunks();
    ASSERT_GT(chunks.size(), 3u);
    ASSERT_TRUE(parse(small.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
    EXPECT_EQ(code_of(*send_chunk(small, chunks[3])), wire::RejectCode::TOO_MANY_CHUNKS);
  }
  // A sealed header with hashes or a signature in it.
  {
    capnp::MallocMessageBuilder builder;
    auto parsed = parse(prepare_sealed(metadata(7)).header);
    builder.setRoot(parsed->root());
    auto header = builder.getRoot<wire::Message>().getUpdateHeader();
    header.setSignature(kj::heapArray<kj::byte>(64).asPtr());
    const auto bytes = fp::serialize(builder);
    refused(*parse(receiver.handle_header("site-a", *parse(bytes.bytes())).bytes()), wire::RejectCode::MALFORMED);
  }
  // A receiver that cannot tell who is on the other end takes no sealed header.
  {
    auto p = policy();
    p.insecure = true;
    fp::UpdateReceiver insecure(p, roster_, replay);
    EXPECT_EQ(code_of(*parse(insecure.handle_header("site-a", *parse(prepare_sealed(metadata(8)).header)).bytes())),
              wire::RejectCode::UNAUTHENTICATED);
  }
}

// A sealed update's stream stops with a reason at a non-finite value, after
// the chunks before it were made.
TEST_F(UpdateTransfer, ASealedUpdatesStreamEndsAtANonFiniteValue) {
  values_[0][300] = std::nanf("");
  const auto update = prepare_sealed(metadata(1));
  const auto seal = update.stream->seal();
  ASSERT_FALSE(seal.is_ok());
  EXPECT_EQ(seal.status().code(), fedmesh::StatusCode::kInvalidArgument) << seal.status().to_string();
  EXPECT_NE(seal.status().message().find("tensor 'w', counting from its element 256: "), std::string::npos)
      << seal.status().to_string();
  EXPECT_NE(seal.status().message().find("element 44 is nan"), std::string::npos) << seal.status().to_string();
  EXPECT_FALSE(fp::chunk_to_send(update, static_cast<uint32_t>(update.stream->all_chunks().size())).has_value());
}

// A sealed stream with a held limit keeps a window of chunks, not the whole
// update: those before the receiver's Ack are let go (and those too far
// behind the chunk asked for), the producer waiting for room. It makes the
// bytes of a stream that keeps every chunk, and makes a chunk let go again
// when asked for it: a receiver that lost its staging (a restart) gets the
// whole update again from the first chunk, and the same seal.
TEST_F(UpdateTransfer, ASealedStreamHoldsAWindowAndMakesALetGoChunkAgain) {
  const std::vector<std::span<const float>> spans(values_.begin(), values_.end());
  const std::vector<fp::TensorPlan> plans(manifest_.size(), fp::TensorPlan{fp::Encoding::kDenseF32, 32});
  const auto kept = prepare_sealed(metadata(1));
  const std::vector<fp::SharedMessage> reference = kept.stream->all_chunks();
  auto reference_seal = kept.stream->seal();
  ASSERT_TRUE(reference_seal.is_ok());
  ASSERT_GE(reference.size(), 6u);
  const auto same = [](const fp::SharedMessage& a, const fp::SharedMessage& b) {
    return std::ranges::equal(a.bytes(), b.bytes());
  };
  constexpr uint32_t kLimit = 3;
  auto held = fp::prepare_sealed_update(metadata(1), manifest_, spans, plans, *site_, 256, kLimit);
  ASSERT_TRUE(held.is_ok()) << held.status().to_string();
  auto replay = fc::ReplayGuard::in_memory();
  const auto send_acknowledged = [&](fp::UpdateReceiver& receiver, uint32_t c) {
    const auto chunk = fp::chunk_to_send(*held, c);
    if (!chunk) return false;
    EXPECT_LT(c, reference.size());
    if (c >= reference.size()) return false;
    EXPECT_TRUE(same(*chunk, reference[c])) << "chunk " << c;
    const auto reply = send_chunk(receiver, *chunk);
    EXPECT_TRUE(reply->root().isAck());
    held->stream->release_before(reply->root().getAck().getNextChunk());
    return true;
  };
  {
    // The first receiver takes half of them, then is gone with its staging.
    fp::UpdateReceiver first(policy(), roster_, replay);
    ASSERT_TRUE(parse(first.handle_header("site-a", *parse(held->header)).bytes())->root().isAck());
    for (uint32_t c = 0; c < reference.size() / 2; ++c) ASSERT_TRUE(send_acknowledged(first, c));
  }
  EXPECT_EQ(held->stream->runs(), 1);
  fp::UpdateReceiver second(policy(), roster_, replay);
  auto reply = parse(second.handle_header("site-a", *parse(held->header)).bytes());
  ASSERT_TRUE(reply->root().isAck());
  ASSERT_EQ(reply->root().getAck().getNextChunk(), 0u);
  uint32_t sent = 0;
  while (send_acknowledged(second, sent)) ++sent;
  EXPECT_EQ(sent, reference.size());
  EXPECT_EQ(held->stream->runs(), 2);  // made again from the first chunk
  EXPECT_LE(held->stream->most_held(), kLimit);
  auto seal = held->stream->seal();
  ASSERT_TRUE(seal.is_ok()) << seal.status().to_string();
  EXPECT_TRUE(same(*seal, *reference_seal));
  reply = parse(second.handle_seal("site-a", *parse(*seal)).bytes());
  ASSERT_TRUE(reply->root().isAck());
  EXPECT_TRUE(reply->root().getAck().getComplete());
  const auto got = second.take_completed();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tensors, values_);
  EXPECT_EQ(held->stream->chunk_wire_bytes(), kept.stream->chunk_wire_bytes());

  // Asking for a chunk far ahead lets go of those more than the limit
  // before it, without a release; a stream nobody reads still counts its bytes.
  auto ahead = fp::prepare_sealed_update(metadata(2), manifest_, spans, plans, *site_, 256, kLimit);
  ASSERT_TRUE(ahead.is_ok());
  const auto last = fp::chunk_to_send(*ahead, static_cast<uint32_t>(reference.size() - 1));
  ASSERT_TRUE(last);
  EXPECT_LE(ahead->stream->most_held(), kLimit);
  EXPECT_FALSE(fp::chunk_to_send(*ahead, static_cast<uint32_t>(reference.size())).has_value());
  auto unread = fp::prepare_sealed_update(metadata(1), manifest_, spans, plans, *site_, 256, kLimit);
  ASSERT_TRUE(unread.is_ok());
  EXPECT_EQ(unread->stream->chunk_wire_bytes(), kept.stream->chunk_wire_bytes());
  EXPECT_LE(unread->stream->most_held(), kLimit);
}

// A receiver staging in memory grows each tensor's copy as segments come
// (nothing is zero-filled ahead of them): what no segment reaches, before,
// between or after the segments, and chunks taken out of order, still come
// out as zeros and values where they belong.
TEST_F(UpdateTransfer, WhatNoSegmentReachesIsZeroWhateverTheOrder) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  // Tensor w (407 values): its values [50, 120) and [300, 330) only; b: nothing.
  std::vector<fp::EncodedTensor> tensors(2);
  tensors[0].descriptor = {manifest_[0].name, manifest_[0].dims, fp::Encoding::kDenseF32, 0};
  tensors[1].descriptor = {manifest_[1].name, manifest_[1].dims, fp::Encoding::kDenseF32, 0};
  for (const auto& [first, count] : {std::pair<size_t, size_t>{300, 30}, {50, 70}}) {  // the later range first
    auto segments = fp::encode_dense(0, std::span<const float>(values_[0]).subspan(first, count),
                                     fp::Encoding::kDenseF32, 64);
    ASSERT_TRUE(segments.is_ok());
    for (auto& segment : *segments) {
      segment.offset += first;
      tensors[0].segments.push_back(std::move(segment));
    }
  }
  const auto update = fp::prepare_encoded_update(metadata(1), std::move(tensors), *site_, 64);
  ASSERT_GT(update.chunks.size(), 4u);
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  // Chunks in reverse order.
  std::unique_ptr<fp::ParsedMessage> reply;
  for (size_t c = update.chunks.size(); c-- > 0;) reply = send_chunk(receiver, update.chunks[c]);
  ASSERT_TRUE(reply->root().isAck() && reply->root().getAck().getComplete());
  auto done = receiver.take_completed();
  ASSERT_EQ(done.size(), 1u);
  ASSERT_EQ(done[0].tensors[0].size(), values_[0].size());
  ASSERT_EQ(done[0].tensors[1].size(), values_[1].size());
  for (size_t i = 0; i < values_[0].size(); ++i) {
    const bool sent = (i >= 50 && i < 120) || (i >= 300 && i < 330);
    ASSERT_EQ(done[0].tensors[0][i], sent ? values_[0][i] : 0.0f) << "w[" << i << "]";
  }
  for (const float v : done[0].tensors[1]) ASSERT_EQ(v, 0.0f);
}

TEST_F(UpdateTransfer, AResentHeaderResumesFromTheFirstMissingChunk) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  const auto update = prepare(metadata(1));
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  for (uint32_t c = 0; c < 3; ++c) {
    fp::Envelope envelope;
    fp::Rejection rejection;
    ASSERT_TRUE(fp::read_envelope(update.chunks[c], fp::kDefaultMaxMessageBytes, envelope, rejection));
    (void)receiver.handle_chunk("site-a", envelope, update.chunks[c]);
  }
  auto resumed = parse(receiver.handle_header("site-a", *parse(update.header)).bytes());
  ASSERT_TRUE(resumed->root().isAck());
  EXPECT_EQ(resumed->root().getAck().getNextChunk(), 3u);
  ASSERT_TRUE(deliver(receiver, update)->root().getAck().getComplete());
  auto done = receiver.take_completed();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].tensors, values_);
}

// Gossip replicas ask for the chunks they lack by name: in_flight() reports
// a transfer's sequence and the chunks held; the sender's very header
// resumes it and the missing chunks alone complete it. A transfer that can
// no longer complete (a later update of the sender's was taken first) is
// dropped at once.
TEST_F(UpdateTransfer, AReplicaFetchesOnlyTheChunksItLacks) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  auto send_chunk = [&](const fp::PreparedUpdate& update, uint32_t c) {
    fp::Envelope envelope;
    fp::Rejection rejection;
    EXPECT_TRUE(fp::read_envelope(update.chunks[c], fp::kDefaultMaxMessageBytes, envelope, rejection));
    return parse(receiver.handle_chunk("site-a", envelope, update.chunks[c]).bytes());
  };
  fp::UpdateMetadata of_round_4 = metadata(10);
  of_round_4.round = 4;
  const auto update = prepare(of_round_4);
  ASSERT_GE(update.chunks.size(), 4u);
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  for (uint32_t c = 0; c < update.chunks.size(); c += 2) ASSERT_TRUE(send_chunk(update, c)->root().isAck());
  EXPECT_FALSE(receiver.in_flight("site-a", 5).has_value());
  EXPECT_FALSE(receiver.in_flight("site-b", 4).has_value());
  std::optional<fp::TransferProgress> partial = receiver.in_flight("site-a", 4);
  ASSERT_TRUE(partial.has_value());
  EXPECT_EQ(partial->sequence, 10u);
  ASSERT_EQ(partial->received.size(), update.chunks.size());
  for (size_t c = 0; c < update.chunks.size(); ++c) EXPECT_EQ(partial->received[c], c % 2 == 0) << c;

  // A later update of the sender's completes meanwhile: the first one could
  // only be refused as a replay now, so it is dropped at once (its slot and
  // staging freed), in_flight() no longer offers it, and its header, resent,
  // is a replay.
  fp::UpdateMetadata of_round_5 = metadata(20);
  const auto later = prepare(of_round_5);
  ASSERT_TRUE(deliver(receiver, later)->root().getAck().getComplete());
  EXPECT_EQ(receiver.transfers_superseded(), 1u);
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
  EXPECT_FALSE(receiver.in_flight("site-a", 4).has_value());
  EXPECT_EQ(code_of(*parse(receiver.handle_header("site-a", *parse(update.header)).bytes())), wire::RejectCode::REPLAYED);
  std::unique_ptr<fp::ParsedMessage> last = send_chunk(update, 1);
  EXPECT_EQ(code_of(*last), wire::RejectCode::UNKNOWN_TRANSFER);

  // Without a later update in between, the missing chunks complete it.
  fp::UpdateMetadata again = metadata(30);
  again.round = 4;
  const auto second = prepare(again);
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(second.header)).bytes())->root().isAck());
  for (uint32_t c = 0; c < second.chunks.size(); c += 2) ASSERT_TRUE(send_chunk(second, c)->root().isAck());
  partial = receiver.in_flight("site-a", 4);
  ASSERT_TRUE(partial.has_value());
  EXPECT_EQ(partial->sequence, 30u);
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(second.header)).bytes())->root().isAck());
  for (uint32_t c = 1; c < second.chunks.size(); c += 2) last = send_chunk(second, c);
  ASSERT_TRUE(last->root().isAck());
  EXPECT_TRUE(last->root().getAck().getComplete());
  std::vector<fp::ReceivedUpdate> done = receiver.take_completed();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[1].metadata.sequence, 30u);
  EXPECT_EQ(done[1].tensors, values_);
  EXPECT_FALSE(receiver.in_flight("site-a", 4).has_value());
}

TEST_F(UpdateTransfer, TooManyChunksAreBounded) {
  auto replay = fc::ReplayGuard::in_memory();
  auto p = policy();
  p.max_chunks = 3;
  fp::UpdateReceiver small(p, roster_, replay);
  EXPECT_EQ(code_of(*parse(small.handle_header("site-a", *parse(prepare(metadata(1)).header)).bytes())),
            wire::RejectCode::TOO_MANY_CHUNKS);
}

// One sender holding its most transfers in flight is refused the next as
// busy; another sender is still admitted.
TEST_F(UpdateTransfer, TransfersInFlightAreBoundedPerSender) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::UpdateReceiver receiver(policy(), roster_, replay);
  EXPECT_EQ(receiver.transfer_capacity(), std::max(fp::kMaxTransfersInFlight, fp::kMaxTransfersPerPeer * 2));
  for (uint64_t s = 1; s <= fp::kMaxTransfersPerPeer; ++s) {
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(prepare(metadata(s)).header)).bytes())->root().isAck());
  }
  EXPECT_EQ(code_of(*parse(receiver.handle_header("site-a", *parse(prepare(metadata(99)).header)).bytes())),
            wire::RejectCode::BUSY);
  fp::UpdateMetadata from_b = metadata(1);
  from_b.sender = "site-b";
  const auto update_b = prepare(from_b, fp::Encoding::kDenseF32, 256, other_.get());
  auto reply = deliver(receiver, update_b, "site-b");
  ASSERT_TRUE(reply->root().isAck()) << reply->root().getReject().getText().cStr();
  EXPECT_TRUE(reply->root().getAck().getComplete());
  EXPECT_EQ(receiver.take_completed().size(), 1u);
  EXPECT_EQ(receiver.transfers_in_flight(), fp::kMaxTransfersPerPeer);
}

// A staging budget of one model: one transfer in flight in all, whatever the
// roster. Another sender is answered BUSY until it completes; a newer update
// from the sender in flight (a site restarted mid-upload) replaces its older
// one at once rather than waiting out the idle timeout.
TEST_F(UpdateTransfer, AStagingBudgetBoundsTransfersInFlightWhateverTheRoster) {
  auto replay = fc::ReplayGuard::in_memory();
  auto p = policy();
  const uint64_t model_bytes = fp::staged_bytes(manifest_);
  p.staging_budget_bytes = model_bytes + model_bytes / 2;
  fp::UpdateReceiver receiver(p, roster_, replay);
  EXPECT_EQ(receiver.transfer_capacity(), 1u);
  EXPECT_EQ(receiver.per_peer_capacity(), 1u);
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(prepare(metadata(10)).header)).bytes())->root().isAck());
  fp::UpdateMetadata from_b = metadata(1);
  from_b.sender = "site-b";
  const auto update_b = prepare(from_b, fp::Encoding::kDenseF32, 256, other_.get());
  EXPECT_EQ(code_of(*deliver(receiver, update_b, "site-b")), wire::RejectCode::BUSY);
  // site-a's newer update replaces its older one; the older is not taken back.
  const auto newer = prepare(metadata(11));
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(newer.header)).bytes())->root().isAck());
  EXPECT_EQ(receiver.transfers_in_flight(), 1u);
  EXPECT_EQ(receiver.transfers_superseded(), 1u);
  EXPECT_EQ(code_of(*parse(receiver.handle_header("site-a", *parse(prepare(metadata(10)).header)).bytes())),
            wire::RejectCode::BUSY);
  auto done = deliver(receiver, newer);
  ASSERT_TRUE(done->root().isAck());
  EXPECT_TRUE(done->root().getAck().getComplete());
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
  auto reply = deliver(receiver, update_b, "site-b");
  ASSERT_TRUE(reply->root().isAck()) << reply->root().getReject().getText().cStr();
  EXPECT_TRUE(reply->root().getAck().getComplete());
  EXPECT_EQ(receiver.take_completed().size(), 2u);

  // Without a budget (or one it does not bind), the roster's caps hold.
  p.staging_budget_bytes = 1000 * model_bytes;
  fp::UpdateReceiver roomy(p, roster_, replay);
  EXPECT_EQ(roomy.transfer_capacity(), std::max(fp::kMaxTransfersInFlight, fp::kMaxTransfersPerPeer * 2));
  EXPECT_EQ(roomy.per_peer_capacity(), fp::kMaxTransfersPerPeer);
}

// Only a chunk that adds bytes counts as progress: a transfer whose chunk 0
// and header are sent again and again is still dropped once the idle
// timeout has passed since its last new chunk, and the drop is counted.
TEST_F(UpdateTransfer, RepeatsAreNoProgressAndStalledTransfersAreDropped) {
  auto replay = fc::ReplayGuard::in_memory();
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  auto p = policy();
  p.clock = [&now] { return now; };
  fp::UpdateReceiver receiver(p, roster_, replay);
  const auto update = prepare(metadata(1));
  ASSERT_GE(update.chunks.size(), 3u);
  fp::Envelope first, second;
  fp::Rejection rejection;
  ASSERT_TRUE(fp::read_envelope(update.chunks[0], fp::kDefaultMaxMessageBytes, first, rejection));
  ASSERT_TRUE(fp::read_envelope(update.chunks[1], fp::kDefaultMaxMessageBytes, second, rejection));
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  ASSERT_TRUE(parse(receiver.handle_chunk("site-a", first, update.chunks[0]).bytes())->root().isAck());
  const auto progressed = now;
  // Every quarter of the timeout: chunk 0 and the header again, each answered.
  for (int i = 0; i < 3; ++i) {
    now += fp::kTransferIdleTimeout / 4;
    EXPECT_TRUE(parse(receiver.handle_chunk("site-a", first, update.chunks[0]).bytes())->root().isAck());
    EXPECT_TRUE(parse(receiver.handle_header("site-a", *parse(update.header)).bytes())->root().isAck());
  }
  now = progressed + fp::kTransferIdleTimeout + std::chrono::seconds(1);
  EXPECT_TRUE(parse(receiver.handle_chunk("site-a", first, update.chunks[0]).bytes())->root().isAck());
  receiver.expire(now);
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
  EXPECT_EQ(receiver.transfers_expired(), 1u);
  EXPECT_EQ(code_of(*parse(receiver.handle_chunk("site-a", second, update.chunks[1]).bytes())),
            wire::RejectCode::UNKNOWN_TRANSFER);

  // A new chunk is progress: it moves the deadline on.
  const auto again = prepare(metadata(2));
  ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(again.header)).bytes())->root().isAck());
  fp::Envelope first_again, second_again;
  ASSERT_TRUE(fp::read_envelope(again.chunks[0], fp::kDefaultMaxMessageBytes, first_again, rejection));
  ASSERT_TRUE(fp::read_envelope(again.chunks[1], fp::kDefaultMaxMessageBytes, second_again, rejection));
  ASSERT_TRUE(parse(receiver.handle_chunk("site-a", first_again, again.chunks[0]).bytes())->root().isAck());
  now += fp::kTransferIdleTimeout * 3 / 4;
  ASSERT_TRUE(parse(receiver.handle_chunk("site-a", second_again, again.chunks[1]).bytes())->root().isAck());
  now += fp::kTransferIdleTimeout * 3 / 4;
  receiver.expire(now);
  EXPECT_EQ(receiver.transfers_in_flight(), 1u);
  now += fp::kTransferIdleTimeout / 2;
  receiver.expire(now);
  EXPECT_EQ(receiver.transfers_in_flight(), 0u);
  EXPECT_EQ(receiver.transfers_expired(), 2u);
}

// Sequences are Unix microseconds: one more than a day ahead of the
// receiver's clock is refused before it can touch the key's counter, and the
// site's honest next update is still taken. At the limit it is taken.
TEST_F(UpdateTransfer, SequencesFarAheadOfTheClockAreRefused) {
  auto replay = fc::ReplayGuard::in_memory();
  auto p = policy();
  const uint64_t clock = 1'800'000'000'000'000;  // the receiver's Unix time, in microseconds
  p.unix_micros = [clock] { return clock; };
  fp::UpdateReceiver receiver(p, roster_, replay);
  const std::string key = fc::replay_key(site_->identity.sign_public);

  auto ahead = deliver(receiver, prepare(metadata(clock + fp::kMaxSequenceAheadMicros + 1)));
  EXPECT_EQ(code_of(*ahead), wire::RejectCode::SEQUENCE_AHEAD);
  EXPECT_NE(std::string(ahead->root().getReject().getText().cStr()).find("ahead of this receiver's clock"),
            std::string::npos);
  EXPECT_EQ(replay.last_accepted(key), 0u);

  auto honest = deliver(receiver, prepare(metadata(clock - 5)));
  ASSERT_TRUE(honest->root().isAck());
  EXPECT_TRUE(honest->root().getAck().getComplete());
  auto at_limit = deliver(receiver, prepare(metadata(clock + fp::kMaxSequenceAheadMicros)));
  ASSERT_TRUE(at_limit->root().isAck());
  EXPECT_EQ(replay.last_accepted(key), clock + fp::kMaxSequenceAheadMicros);
}

// The worst case the clock bound prevents: a stolen key gets sequence
// 2^64 - 1 accepted (here with the bound switched off). Counters are kept by
// key, so once the admin re-keys the site under the same name, the site's
// next update, numbered as usual, is taken; and it stays so after a restart
// of the receiver (the table is persisted by key).
TEST_F(UpdateTransfer, AReKeyedSiteStartsAfreshAfterItsOldKeySentTheLargestSequence) {
  const auto file = std::filesystem::temp_directory_path() / ("fedmesh-rekey-" + std::to_string(getpid()));
  std::filesystem::remove(file);
  auto p = policy();
  p.max_sequence_ahead_micros = UINT64_MAX;
  const fc::SiteKeys stolen = fc::generate_site_keys("site-a").value();
  roster_.sites[0].identity = stolen.identity;  // the key the attacker holds
  {
    auto replay = fc::ReplayGuard::open(file);
    ASSERT_TRUE(replay.is_ok()) << replay.status().to_string();
    fp::UpdateReceiver receiver(p, roster_, *replay);
    auto largest = deliver(receiver, prepare(metadata(UINT64_MAX), fp::Encoding::kDenseF32, 256, &stolen));
    ASSERT_TRUE(largest->root().isAck());
    EXPECT_TRUE(largest->root().getAck().getComplete());
    auto locked = deliver(receiver, prepare(metadata(now_micros()), fp::Encoding::kDenseF32, 256, &stolen));
    EXPECT_EQ(code_of(*locked), wire::RejectCode::REPLAYED);

    // The admin revokes the stolen key and adds the site's new one, same name.
    roster_.sites[0].identity = site_->identity;
    auto rekeyed = deliver(receiver, prepare(metadata(now_micros())));
    ASSERT_TRUE(rekeyed->root().isAck()) << rekeyed->root().getReject().getText().cStr();
    EXPECT_TRUE(rekeyed->root().getAck().getComplete());
    EXPECT_EQ(receiver.take_completed().size(), 2u);
    // The old key no longer signs for site-a.
    auto old_key = deliver(receiver, prepare(metadata(now_micros()), fp::Encoding::kDenseF32, 256, &stolen));
    EXPECT_EQ(code_of(*old_key), wire::RejectCode::BAD_SIGNATURE);
  }
  auto reopened = fc::ReplayGuard::open(file);
  ASSERT_TRUE(reopened.is_ok()) << reopened.status().to_string();
  EXPECT_EQ(reopened->last_accepted(fc::replay_key(stolen.identity.sign_public)), UINT64_MAX);
  const uint64_t kept = reopened->last_accepted(fc::replay_key(site_->identity.sign_public));
  EXPECT_GT(kept, 0u);
  EXPECT_LT(kept, UINT64_MAX);
  fp::UpdateReceiver restarted(p, roster_, *reopened);
  auto next = deliver(restarted, prepare(metadata(std::max(kept + 1, now_micros()))));
  ASSERT_TRUE(next->root().isAck()) << next->root().getReject().getText().cStr();
  EXPECT_TRUE(next->root().getAck().getComplete());
  std::filesystem::remove(file);
}

TEST_F(UpdateTransfer, AbandonedTransfersDoNotKeepANewOneOut) {
  auto replay = fc::ReplayGuard::in_memory();
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  auto p = policy();
  p.clock = [&now] { return now; };
  fp::UpdateReceiver receiver(p, roster_, replay);
  for (uint64_t s = 1; s <= fp::kMaxTransfersPerPeer; ++s) {
    ASSERT_TRUE(parse(receiver.handle_header("site-a", *parse(prepare(metadata(s)).header)).bytes())->root().isAck());
  }
  // Their sender never sends a chunk; after the idle timeout a new header
  // is admitted rather than refused as busy.
  now += fp::kTransferIdleTimeout + std::chrono::seconds(1);
  EXPECT_TRUE(parse(receiver.handle_header("site-a", *parse(prepare(metadata(99)).header)).bytes())->root().isAck());
  EXPECT_EQ(receiver.transfers_in_flight(), 1u);
  EXPECT_EQ(receiver.transfers_expired(), fp::kMaxTransfersPerPeer);
}

// Rate buckets are kept by the transport key, not the name: a key flooding
// under a site's name (one revoked while still connected) is refused, and
// the site's current key, under the same name, is not.
TEST_F(UpdateTransfer, AFloodingKeyDoesNotSpendTheBudgetOfAnotherKeyWithTheSameName) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::TransportCounters counters;
  fp::UpdateService service(policy(), roster_, replay, {/*messages_per_second=*/1, /*bytes_per_second=*/1e9}, counters);
  capnp::MallocMessageBuilder builder;
  builder.initRoot<wire::Message>().initHeartbeat().setRound(5);
  const fp::OutgoingMessage heartbeat = fp::serialize(builder);
  auto from = [&](const std::string& key) {
    fp::Incoming incoming;
    incoming.peer = "site-a";
    incoming.peer_key = key;
    incoming.bytes = heartbeat.bytes();
    (void)service.handle(incoming);
    return service.last_rejection().has_value() ? service.last_rejection()->code : wire::RejectCode::MALFORMED;
  };
  const std::string flooder(64, 'f'), honest(64, 'a');
  int refused = 0;
  for (int i = 0; i < 50; ++i) {
    (void)from(flooder);
    if (service.last_rejection() && service.last_rejection()->code == wire::RejectCode::RATE_LIMITED) ++refused;
  }
  EXPECT_EQ(refused, 48);  // a burst of two seconds at one message a second, then nothing
  (void)from(honest);
  EXPECT_FALSE(service.last_rejection().has_value()) << service.last_rejection()->reason;
  EXPECT_EQ(counters.rejections(wire::RejectCode::RATE_LIMITED), 48u);
}

// Hello fields are checked before anything is answered: the name is the
// authenticated peer's and within the name limit, the federation is ours,
// the role is one this endpoint takes. An honest Hello is welcomed.
TEST_F(UpdateTransfer, HelloFieldsAreRefusedByName) {
  auto replay = fc::ReplayGuard::in_memory();
  fp::TransportCounters counters;
  fp::UpdateService service(policy(), roster_, replay, {}, counters);
  struct Case {
    const char* name;
    std::string site, federation;
    wire::Role role;
    wire::RejectCode code;
    const char* phrase;
  };
  const Case cases[] = {
      {"100 KiB name", std::string(100 * 1024, 's'), "fed", wire::Role::SITE, wire::RejectCode::MALFORMED,
       "siteName is 102400 bytes"},
      {"another site's name", "site-b", "fed", wire::Role::SITE, wire::RejectCode::UNAUTHENTICATED,
       "authenticated as 'site-a'"},
      {"not a site name", "Site A!", "fed", wire::Role::SITE, wire::RejectCode::MALFORMED, "siteName"},
      {"other federation", "site-a", "evil", wire::Role::SITE, wire::RejectCode::WRONG_FEDERATION, "'evil'"},
      {"aggregator role", "site-a", "fed", wire::Role::AGGREGATOR, wire::RejectCode::WRONG_ROLE, "takes sites"},
      {"peer role", "site-a", "fed", wire::Role::PEER, wire::RejectCode::WRONG_ROLE, "takes sites"},
  };
  auto hello = [&](const std::string& site, const std::string& federation, wire::Role role) {
    capnp::MallocMessageBuilder builder;
    auto h = builder.initRoot<wire::Message>().initHello();
    h.setSiteName(site);
    h.setFederation(federation);
    h.setRole(role);
    h.setProtocolVersion(fp::kProtocolVersion);
    h.setMinProtocolVersion(fp::kMinProtocolVersion);
    const fp::OutgoingMessage message = fp::serialize(builder);
    fp::Incoming incoming;
    incoming.peer = "site-a";
    incoming.bytes = message.bytes();
    auto reply = service.handle(incoming);
    EXPECT_TRUE(reply.has_value());
    return parse(reply->bytes());
  };
  for (const Case& c : cases) {
    auto reply = hello(c.site, c.federation, c.role);
    EXPECT_EQ(code_of(*reply), c.code) << c.name;
    if (reply->root().isReject()) {
      EXPECT_NE(std::string(reply->root().getReject().getText().cStr()).find(c.phrase), std::string::npos)
          << c.name << ": " << reply->root().getReject().getText().cStr();
    }
  }
  auto welcomed = hello("site-a", "fed", wire::Role::SITE);
  EXPECT_TRUE(welcomed->root().isWelcome());
  EXPECT_EQ(counters.rejections(wire::RejectCode::WRONG_ROLE), 2u);
}

TEST(RateLimiter, RefusesBeyondTheBurstAndRefillsWithTime) {
  fp::RateLimiter limiter({/*messages_per_second=*/10, /*bytes_per_second=*/1000});
  const auto start = fp::RateLimiter::Clock::time_point{};
  int admitted = 0;
  for (int i = 0; i < 100; ++i) admitted += limiter.admit("site-a", 1, start) ? 1 : 0;
  EXPECT_EQ(admitted, 20);  // two seconds of burst
  EXPECT_TRUE(limiter.admit("site-b", 1, start));  // per peer
  EXPECT_FALSE(limiter.admit("site-a", 1, start + std::chrono::milliseconds(50)));
  EXPECT_TRUE(limiter.admit("site-a", 1, start + std::chrono::milliseconds(150)));
  EXPECT_FALSE(limiter.admit("site-c", 5000, start));  // more bytes than the bucket holds
}

}  // namespace
