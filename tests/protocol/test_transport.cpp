// The transport in one process, over real loopback TCP: roster keys get in
// and are named by the handshake, strangers are refused, the self-test
// refuses to run a socket that would admit anyone, and a message over the
// hard cap costs its sender the connection but not the server its service.
// Over a lossy link (fault injection), uploads and model downloads paced by
// a retransmission timer arrive whole.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "crypto/keys.h"
#include "crypto/roster.h"
#include "protocol/transport.h"
#include "crypto/replay_guard.h"
#include "protocol/model_transfer.h"
#include "protocol/update_service.h"
#include "protocol/sealed_update.h"
#include "protocol/update_upload.h"

namespace fp = fedmesh::protocol;
namespace fc = fedmesh::crypto;
using namespace std::chrono_literals;

namespace {

class Transport : public ::testing::Test {
 protected:
  void SetUp() override {
    server_keys_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("aggregator").value());
    site_keys_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("site-a").value());
    stranger_keys_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("stranger").value());
    allowlist_[server_keys_->identity.box_public] = "aggregator";
    allowlist_[site_keys_->identity.box_public] = "site-a";
  }

  // The roster of site-a alone, and the aggregator's policy for a 64x64 tensor.
  fc::Roster site_roster() const {
    fc::Roster roster;
    roster.federation = "fed";
    roster.sites.push_back({site_keys_->identity, fc::Role::kSite, ""});
    return roster;
  }
  static fp::ReceiverPolicy aggregator_policy() {
    fp::ReceiverPolicy policy;
    policy.federation = "fed";
    policy.self = "aggregator";
    policy.manifest = {{"w", {64, 64}}};
    return policy;
  }

  // The 64x64 update `values` from site-a, in 1 KiB chunks.
  fedmesh::Result<fp::PreparedUpdate> small_update(const std::vector<float>& values) const {
    const std::vector<std::span<const float>> spans = {values};
    const std::vector<fp::TensorPlan> plans(1);
    return fp::prepare_update({"fed", 0, 0, "site-a", "aggregator", 1, 10}, aggregator_policy().manifest, spans, plans,
                              *site_keys_, 1024);
  }
  static bool is_update_chunk(const fp::Incoming& frame) {
    fp::Envelope envelope;
    fp::Rejection rejection;
    return fp::read_envelope(frame.bytes, fp::kDefaultMaxMessageBytes, envelope, rejection) &&
           envelope.kind == fedmesh::wire::Message::UPDATE_CHUNK;
  }

  std::unique_ptr<fp::ServerSocket> bind(fp::TransportOptions options = {}) {
    auto server = fp::ServerSocket::bind("tcp://127.0.0.1:*", fp::CurveKeys::from(*server_keys_), allowlist_, options);
    EXPECT_TRUE(server.is_ok()) << server.status().to_string();
    return server.is_ok() ? std::move(server.value()) : nullptr;
  }

  std::unique_ptr<fp::ClientSocket> dial(const fp::ServerSocket& server, const fc::SiteKeys& keys,
                                         fp::TransportOptions options = {}) {
    auto client = fp::ClientSocket::connect(server.endpoint(), fp::CurveKeys::from(keys),
                                            server_keys_->identity.box_public, options);
    EXPECT_TRUE(client.is_ok()) << client.status().to_string();
    return std::move(client.value());
  }

  static fp::OutgoingMessage heartbeat(uint64_t round) {
    capnp::MallocMessageBuilder builder;
    builder.initRoot<fedmesh::wire::Message>().initHeartbeat().setRound(round);
    return fp::serialize(builder);
  }

  // Receives on the server until a frame arrives or the time is up.
  static std::optional<fp::Incoming> next(fp::ServerSocket& server, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      auto frame = server.receive(50ms);
      if (frame.is_ok() && frame->has_value()) return std::move(**frame);
    }
    return std::nullopt;
  }

  std::unique_ptr<fc::SiteKeys> server_keys_, site_keys_, stranger_keys_;
  fp::Allowlist allowlist_;
};

TEST_F(Transport, ARosterSiteIsNamedByTheHandshake) {
  auto server = bind();
  ASSERT_TRUE(server);
  EXPECT_NE(server->endpoint().find("tcp://127.0.0.1:"), std::string::npos);
  auto client = dial(*server, *site_keys_);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());
  ASSERT_TRUE(client->send(heartbeat(7), 5s).is_ok());
  auto frame = next(*server, 10s);
  ASSERT_TRUE(frame.has_value());
  EXPECT_EQ(frame->peer, "site-a");  // the ZAP User-Id, not anything the message says
  std::unique_ptr<fp::ParsedMessage> parsed;
  fp::Rejection rejection;
  ASSERT_TRUE(fp::parse_message(frame->bytes, fp::kDefaultMaxMessageBytes, frame->frame, parsed, rejection));
  EXPECT_EQ(parsed->root().getHeartbeat().getRound(), 7u);
  // And the answer finds its way back by routing id.
  ASSERT_TRUE(server->send(frame->routing_id, heartbeat(8)).is_ok());
  auto reply = client->receive(10s);
  ASSERT_TRUE(reply.is_ok() && reply->has_value());
  EXPECT_EQ(server->counters().zap_allowed.load(), 1u);
}

TEST_F(Transport, AStrangerIsRefusedAtTheHandshakeAndNothingArrives) {
  auto server = bind();
  ASSERT_TRUE(server);
  auto client = dial(*server, *stranger_keys_);
  const fedmesh::Status connected = fp::wait_connected(*client, 10s);
  EXPECT_FALSE(connected.is_ok());
  EXPECT_NE(connected.message().find("refused"), std::string::npos) << connected.message();
  (void)client->send(heartbeat(1), 200ms);
  EXPECT_FALSE(next(*server, 500ms).has_value());
  EXPECT_GE(server->counters().zap_denied.load(), 1u);
}

TEST_F(Transport, TheSelfTestRefusesASocketThatAdmitsAnyone) {
  fp::TransportOptions options;
  options.omit_zap_handler_to_test_the_self_test = true;
  auto server = fp::ServerSocket::bind("tcp://127.0.0.1:*", fp::CurveKeys::from(*server_keys_), allowlist_, options);
  ASSERT_FALSE(server.is_ok());
  EXPECT_EQ(server.status().code(), fedmesh::StatusCode::kInternal);
  EXPECT_NE(server.status().message().find("completed the CURVE handshake"), std::string::npos)
      << server.status().message();
}

TEST_F(Transport, AMessageOverTheHardCapCostsOnlyItsSenderTheConnection) {
  fp::TransportOptions options;
  options.max_message_bytes = 4096;  // hard cap: kTransportCapFactor times that
  auto server = bind(options);
  ASSERT_TRUE(server);
  auto flooder = dial(*server, *site_keys_);
  ASSERT_TRUE(fp::wait_connected(*flooder, 10s).is_ok());
  std::vector<uint8_t> huge(options.max_message_bytes * fp::kTransportCapFactor * 2, 0);
  ASSERT_TRUE(flooder->send(fp::OutgoingMessage::from_bytes(huge), 5s).is_ok());
  EXPECT_FALSE(next(*server, 1s).has_value());  // libzmq dropped it (and the connection) unread

  auto honest = dial(*server, *site_keys_);
  ASSERT_TRUE(fp::wait_connected(*honest, 10s).is_ok());
  ASSERT_TRUE(honest->send(heartbeat(3), 5s).is_ok());
  auto frame = next(*server, 10s);
  ASSERT_TRUE(frame.has_value());
  EXPECT_EQ(frame->peer, "site-a");
}

}  // namespace

namespace {

TEST(Backoff, DoublesWithJitterUpToTheCap) {
  fp::RetryPolicy policy;
  policy.first_backoff = 100ms;
  policy.max_backoff = 1000ms;
  fedmesh::Rng rng(1);
  for (int attempt = 1; attempt <= 8; ++attempt) {
    const int64_t full = std::min<int64_t>(1000, 100 << (attempt - 1));
    for (int trial = 0; trial < 50; ++trial) {
      const auto wait = fp::backoff_delay(attempt, policy, rng).count();
      EXPECT_GE(wait, full / 2);
      EXPECT_LE(wait, full);
    }
  }
  // Two sites with different seeds do not wait the same.
  fedmesh::Rng a(1), b(2);
  int same = 0;
  for (int i = 0; i < 20; ++i) same += fp::backoff_delay(5, policy, a) == fp::backoff_delay(5, policy, b) ? 1 : 0;
  EXPECT_LT(same, 5);
}

TEST_F(Transport, AQuietReceiverIsRetriedAndTheTransferResumes) {
  auto server = bind();
  ASSERT_TRUE(server);
  const fc::Roster roster = site_roster();
  const fp::ReceiverPolicy policy = aggregator_policy();
  auto replay = fc::ReplayGuard::in_memory();

  // The server goes quiet once, after the third chunk: it drops what arrives
  // for 800 ms, as a receiver behind a flapping link would.
  std::atomic<bool> stop{false};
  std::vector<fp::ReceivedUpdate> received;
  std::thread receiver([&] {
    fp::UpdateService service(policy, roster, replay, {}, server->counters());
    int chunks_seen = 0;
    std::optional<std::chrono::steady_clock::time_point> quiet_until;
    while (!stop.load()) {
      auto frame = server->receive(20ms);
      if (!frame.is_ok() || !frame->has_value()) continue;
      if (quiet_until && std::chrono::steady_clock::now() < *quiet_until) continue;
      auto reply = service.handle(**frame);
      if (is_update_chunk(**frame) && ++chunks_seen == 3 && !quiet_until) {
        quiet_until = std::chrono::steady_clock::now() + 800ms;
        continue;  // this Ack is lost too
      }
      if (reply) (void)server->send((**frame).routing_id, std::move(*reply));
      for (auto& update : service.take_completed()) received.push_back(std::move(update));
    }
  });

  std::vector<float> values(64 * 64);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  auto update = small_update(values);
  ASSERT_TRUE(update.is_ok());
  ASSERT_GE(update->chunks.size(), 10u);

  auto client = dial(*server, *site_keys_);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());
  fp::UploadOptions options;
  options.window_chunks = 1;  // one chunk at a time: the quiet spell hits mid-transfer
  options.reply_timeout = 300ms;
  fp::RetryPolicy retry;
  retry.first_backoff = 200ms;
  retry.jitter_seed = 9;
  retry.max_attempts = 20;  // a slow CI machine may time out more often; each retry resumes
  int attempts = 0;
  auto outcome = fp::upload_with_retries(*client, *update, options, retry, &attempts);
  stop.store(true);
  receiver.join();
  ASSERT_TRUE(outcome.is_ok()) << outcome.status().to_string();
  EXPECT_TRUE(outcome->accepted);
  EXPECT_GE(attempts, 2);
  EXPECT_GT(outcome->started_at_chunk, 0u);  // resumed, not restarted
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].tensors[0], values);
}

// A receiver that is busy, not unreachable: it stops for 700 ms at the
// third chunk (as an aggregator writing a large update to its store does)
// and then works through everything queued, in order. The sender's attempt
// times out and resumes; the Acks of the chunks still queued arrive before
// the header's, and are taken as progress, not as the header's answer, so
// no chunk is sent twice.
TEST_F(Transport, ABusyReceiverIsNotSentTheChunksItStillHasQueued) {
  auto server = bind();
  ASSERT_TRUE(server);
  const fc::Roster roster = site_roster();
  const fp::ReceiverPolicy policy = aggregator_policy();
  auto replay = fc::ReplayGuard::in_memory();
  std::atomic<bool> stop{false};
  std::atomic<int> chunks_seen{0};
  std::vector<fp::ReceivedUpdate> received;
  std::thread receiver([&] {
    fp::UpdateService service(policy, roster, replay, {}, server->counters());
    while (!stop.load()) {
      auto frame = server->receive(20ms);
      if (!frame.is_ok() || !frame->has_value()) continue;
      if (is_update_chunk(**frame) && chunks_seen.fetch_add(1) + 1 == 3) {
        std::this_thread::sleep_for(700ms);
      }
      auto reply = service.handle(**frame);
      if (reply) (void)server->send((**frame).routing_id, std::move(*reply));
      for (auto& update : service.take_completed()) received.push_back(std::move(update));
    }
  });
  std::vector<float> values(64 * 64);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.75f;
  auto update = small_update(values);
  ASSERT_TRUE(update.is_ok());
  ASSERT_GE(update->chunks.size(), 10u);
  auto client = dial(*server, *site_keys_);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());
  fp::UploadOptions options;
  options.window_chunks = 4;
  options.reply_timeout = 200ms;
  fp::RetryPolicy retry;
  retry.first_backoff = 50ms;
  retry.jitter_seed = 3;
  retry.max_attempts = 20;
  int attempts = 0;
  auto outcome = fp::upload_with_retries(*client, *update, options, retry, &attempts);
  // Let anything still in flight arrive before counting.
  std::this_thread::sleep_for(300ms);
  stop.store(true);
  receiver.join();
  ASSERT_TRUE(outcome.is_ok()) << outcome.status().to_string();
  EXPECT_TRUE(outcome->accepted);
  EXPECT_GE(attempts, 2) << "the sender never timed out: the test tested nothing";
  EXPECT_EQ(chunks_seen.load(), static_cast<int>(update->chunks.size())) << "chunks sent more than once";
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].tensors[0], values);
}

}  // namespace

namespace {

// A lossy sender (30% of its messages dropped by the fault injector) with a
// retransmission timer: every update arrives whole, and the timer learnt the
// round trip from the Acks. No time is asserted.
TEST_F(Transport, ALossySenderWithARetransmitTimerDeliversEveryUpdate) {
  auto server = bind();
  ASSERT_TRUE(server);
  const fc::Roster roster = site_roster();
  const fp::ReceiverPolicy policy = aggregator_policy();
  auto replay = fc::ReplayGuard::in_memory();
  std::atomic<bool> stop{false};
  std::vector<fp::ReceivedUpdate> received;
  std::mutex received_mutex;
  std::thread receiver([&] {
    fp::UpdateService service(policy, roster, replay, {}, server->counters());
    while (!stop.load()) {
      auto frame = server->receive(20ms);
      if (!frame.is_ok() || !frame->has_value()) continue;
      auto reply = service.handle(**frame);
      if (reply) (void)server->send((**frame).routing_id, std::move(*reply));
      std::lock_guard lock(received_mutex);
      for (auto& update : service.take_completed()) received.push_back(std::move(update));
    }
  });

  fp::TransportOptions lossy;
  lossy.faults.drop = 0.3;
  lossy.faults.seed = 11;
  auto client = dial(*server, *site_keys_, lossy);
  ASSERT_TRUE(client != nullptr);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());

  fp::RetransmitTimer timer;
  fp::UploadOptions options;
  options.window_chunks = 4;
  options.timer = &timer;
  fp::RetryPolicy retry;
  retry.max_attempts = 12;  // in a row without an Ack: 0.6^12 at this loss, even for a slow machine
  // The last three are sealed: their chunks are made while the first are
  // sent, and their seals are lost and resent as chunks are; their streams
  // hold a window of chunks (those acknowledged let go).
  constexpr int kUpdates = 6;
  std::vector<std::vector<float>> sent;
  int total_attempts = 0;
  for (int u = 0; u < kUpdates; ++u) {
    std::vector<float> values(64 * 64);
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.25f + static_cast<float>(u);
    const std::vector<std::span<const float>> spans = {values};
    const std::vector<fp::TensorPlan> plans(1);
    const fp::UpdateMetadata metadata{"fed", 0, 0, "site-a", "aggregator", static_cast<uint64_t>(u + 1), 10};
    const uint32_t held_limit = fp::held_limit_for_window(options.window_chunks);
    auto update = u < 3 ? fp::prepare_update(metadata, policy.manifest, spans, plans, *site_keys_, 1024)
                        : fp::prepare_sealed_update(metadata, policy.manifest, spans, plans, *site_keys_, 1024,
                                                    held_limit);
    ASSERT_TRUE(update.is_ok());
    if (!update->stream) {
      ASSERT_GE(update->chunks.size(), 10u);
    }
    int attempts = 0;
    auto outcome = fp::upload_with_retries(*client, *update, options, retry, &attempts);
    ASSERT_TRUE(outcome.is_ok()) << "update " << u << ": " << outcome.status().to_string();
    if (update->stream) {
      EXPECT_GE(fp::wire_bytes(*update), 16u * 1024u) << "fewer than 16 chunks of 1 KB";
      EXPECT_LE(update->stream->most_held(), held_limit);
    }
    EXPECT_TRUE(outcome->accepted) << "update " << u << ": "
                                   << (outcome->rejection ? outcome->rejection->reason : std::string("no rejection"));
    total_attempts += attempts;
    sent.push_back(std::move(values));
  }
  // Give the receiver's loop a moment to hand over the last one.
  for (int i = 0; i < 100; ++i) {
    {
      std::lock_guard lock(received_mutex);
      if (received.size() == static_cast<size_t>(kUpdates)) break;
    }
    std::this_thread::sleep_for(20ms);
  }
  stop.store(true);
  receiver.join();
  EXPECT_GT(client->counters().dropped_by_faults.load(), 0u) << "the link lost nothing: the test tested nothing";
  EXPECT_GT(total_attempts, kUpdates) << "no update needed a second attempt";
  ASSERT_EQ(received.size(), static_cast<size_t>(kUpdates));
  for (int u = 0; u < kUpdates; ++u) EXPECT_EQ(received[static_cast<size_t>(u)].tensors[0], sent[static_cast<size_t>(u)]);
  EXPECT_TRUE(timer.estimator().has_sample());
  EXPECT_GT(timer.loss(), 0.0);
}

using ModelRequest = fedmesh::wire::ModelRequest::Reader;

// A thread that passes every ModelRequest `server` receives to
// answer(routing id, request) until `stop`.
std::thread answer_model_requests(fp::ServerSocket& server, std::atomic<bool>& stop,
                                  std::function<void(const std::string&, ModelRequest)> answer) {
  return std::thread([&server, &stop, answer = std::move(answer)] {
    while (!stop.load()) {
      auto frame = server.receive(20ms);
      if (!frame.is_ok() || !frame->has_value()) continue;
      std::unique_ptr<fp::ParsedMessage> parsed;
      fp::Rejection rejection;
      if (!fp::parse_message((**frame).bytes, fp::kDefaultMaxMessageBytes, (**frame).frame, parsed, rejection)) continue;
      const auto root = parsed->root();
      if (root.isModelRequest()) answer((**frame).routing_id, root.getModelRequest());
    }
  });
}

// The publisher's answer to `request`: up to `window` chunks, sent to `to`.
void send_window(fp::ServerSocket& server, const fp::ModelPublisher& publisher, const std::string& to,
                 ModelRequest request, uint32_t window) {
  std::vector<fp::SharedMessage> chunks;
  fp::Rejection rejection;
  if (!publisher.answer(request, window, chunks, rejection)) return;
  for (const fp::SharedMessage& chunk : chunks) (void)server.send(to, fp::OutgoingMessage::from_bytes(chunk.bytes()));
}

// The model download over a lossy link with a retransmission timer: the
// requests and windows lost on the way are asked for again from the first
// missing chunk, and the model arrives whole.
TEST_F(Transport, AModelFetchedOverALossyLinkArrivesWhole) {
  auto server = bind();
  ASSERT_TRUE(server);
  const std::vector<fp::TensorShape> manifest = {{"w", {64, 64}}, {"b", {64}}};
  std::vector<float> w(64 * 64), b(64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5f - 7.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i);
  const std::vector<std::span<const float>> tensors = {w, b};
  fc::Hash v0{}, v1{};
  v0.fill(1);
  v1.fill(2);
  fp::ModelPublisher publisher(1024);
  ASSERT_TRUE(publisher.publish(1, {v0, v1}, manifest, tensors).is_ok());
  ASSERT_GE(publisher.chunk_count(), 10u);

  std::atomic<bool> stop{false};
  std::thread answering = answer_model_requests(*server, stop, [&](const std::string& to, ModelRequest request) {
    send_window(*server, publisher, to, request, 4);
  });

  fp::TransportOptions lossy;
  lossy.faults.drop = 0.3;
  lossy.faults.seed = 5;
  auto client = dial(*server, *site_keys_, lossy);
  ASSERT_TRUE(client != nullptr);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());
  fp::RetransmitTimer timer;
  fp::FetchOptions options;
  options.window = 4;
  options.timer = &timer;
  options.max_attempts = 12;
  // Several fetches of the same version: enough requests that some are lost.
  uint32_t requests = 0;
  for (int fetch = 0; fetch < 3; ++fetch) {
    auto fetched = fp::fetch_model(*client, 1, 0, manifest, options);
    ASSERT_TRUE(fetched.is_ok()) << fetched.status().to_string();
    EXPECT_EQ(fetched->tensors[0], w);
    EXPECT_EQ(fetched->tensors[1], b);
    EXPECT_EQ(fetched->hash, v1);
    ASSERT_EQ(fetched->chain.size(), 1u);
    requests += fetched->requests;
  }
  stop.store(true);
  answering.join();
  EXPECT_GT(client->counters().dropped_by_faults.load(), 0u) << "the link lost nothing: the test tested nothing";
  EXPECT_TRUE(timer.estimator().has_sample());
  EXPECT_GT(requests, 3u * ((publisher.chunk_count() + 3) / 4));  // more requests than windows: some were asked again
}

// An aggregator whose queue of model chunks for a site is full answers BUSY
// (a window asked for again after a timeout on a slow link): the site
// keeps what it holds, pauses, and asks again from its first missing chunk
// (never from the start), and the model arrives whole; one that says BUSY
// past FetchOptions::max_busy_answers in a row is given up on, and says so.
TEST_F(Transport, AModelFetchToldBusyKeepsItsProgressAndAsksAgain) {
  auto server = bind();
  ASSERT_TRUE(server);
  const std::vector<fp::TensorShape> manifest = {{"w", {64, 64}}};
  std::vector<float> w(64 * 64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.25f - 3.0f;
  const std::vector<std::span<const float>> tensors = {w};
  fc::Hash v0{}, v1{};
  v1.fill(2);
  fp::ModelPublisher publisher(1024);
  ASSERT_TRUE(publisher.publish(1, {v0, v1}, manifest, tensors).is_ok());
  ASSERT_GE(publisher.chunk_count(), 12u);

  std::atomic<bool> stop{false};
  std::atomic<int> busy_left{0};       // BUSY answers still to give in a row
  std::atomic<bool> every_other{true};  // then BUSY to every other request
  std::vector<uint32_t> asked_from;     // fromChunk of every request answered with chunks
  std::mutex asked_mutex;
  int requests = 0;
  std::thread answering = answer_model_requests(*server, stop, [&](const std::string& to, ModelRequest request) {
    ++requests;
    if (busy_left.load() > 0 || (every_other.load() && requests % 2 == 0)) {
      if (busy_left.load() > 0) busy_left.fetch_sub(1);
      (void)server->send(to, fp::make_reject(0, {fedmesh::wire::RejectCode::BUSY, "model chunks queued"}));
      return;
    }
    {
      std::lock_guard lock(asked_mutex);
      asked_from.push_back(request.getFromChunk());
    }
    send_window(*server, publisher, to, request, 3);
  });
  auto client = dial(*server, *site_keys_);
  ASSERT_TRUE(client != nullptr);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());
  fp::FetchOptions options;
  options.window = 3;
  options.busy_pause = 5ms;
  auto fetched = fp::fetch_model(*client, 1, 0, manifest, options);
  ASSERT_TRUE(fetched.is_ok()) << fetched.status().to_string();
  EXPECT_EQ(fetched->tensors[0], w);
  {
    std::lock_guard lock(asked_mutex);
    ASSERT_FALSE(asked_from.empty());
    for (size_t i = 1; i < asked_from.size(); ++i) {
      EXPECT_GT(asked_from[i], asked_from[i - 1]) << "a request after BUSY starts again from the first missing chunk";
    }
  }
  EXPECT_GT(fetched->requests, (publisher.chunk_count() + 2) / 3) << "no request was answered BUSY";

  every_other.store(false);
  busy_left.store(1000);
  options.max_busy_answers = 3;
  auto given_up = fp::fetch_model(*client, 1, 0, manifest, options);
  stop.store(true);
  answering.join();
  ASSERT_FALSE(given_up.is_ok());
  EXPECT_EQ(given_up.status().code(), fedmesh::StatusCode::kUnavailable);
  EXPECT_NE(given_up.status().message().find("busy 3 times in a row"), std::string::npos) << given_up.status().to_string();
}

// Four sites download one model at once from a publisher whose chunk copies
// alive are bounded for all of them together (protocol/model_serving.h),
// as the aggregator serves it: the copies alive never pass the budget by
// more than the window one request may add, some requests are told BUSY,
// and every site still gets the model whole.
TEST_F(Transport, DownloadsTogetherStayWithinTheServingBudget) {
  auto server = bind();
  ASSERT_TRUE(server);
  const std::vector<fp::TensorShape> manifest = {{"w", {256, 64}}};
  std::vector<float> w(256 * 64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 1000) * 0.125f - 9.0f;
  const std::vector<std::span<const float>> tensors = {w};
  fc::Hash v0{}, v1{};
  v1.fill(6);
  fp::ModelPublisher publisher(1024);  // 64 chunks of 1 KiB
  ASSERT_TRUE(publisher.publish(1, {v0, v1}, manifest, tensors).is_ok());
  constexpr uint32_t kWindow = 3;
  constexpr uint64_t kBudget = 4 * 1024;
  fp::ModelServingBudget budget(kBudget);
  fp::QueuedModelReplies queued(2 * kWindow);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> most_alive{0};
  std::atomic<int> busy{0};
  std::thread answering = answer_model_requests(*server, stop, [&](const std::string& to, ModelRequest request) {
    const auto admit = [&](size_t replies, uint64_t new_bytes, fp::Rejection& refused) {
      if (queued.has_room(to, replies) &&
          budget.admit(to, publisher.live_bytes(), new_bytes, std::chrono::steady_clock::now())) {
        return true;
      }
      refused = {fedmesh::wire::RejectCode::BUSY, "over the serving budget"};
      return false;
    };
    std::vector<fp::SharedMessage> chunks;
    fp::Rejection rejection;
    if (!publisher.answer(request, kWindow, chunks, rejection, admit)) {
      busy.fetch_add(1);
      (void)server->send(to, fp::make_reject(0, rejection));
      return;
    }
    most_alive.store(std::max(most_alive.load(), publisher.live_bytes()));
    for (const fp::SharedMessage& chunk : chunks) (void)server->send(to, queued.track(to, chunk));
  });
  constexpr int kSites = 4;
  std::vector<std::unique_ptr<fp::ClientSocket>> clients;
  for (int i = 0; i < kSites; ++i) {
    clients.push_back(dial(*server, *site_keys_));
    ASSERT_TRUE(clients.back() != nullptr);
    ASSERT_TRUE(fp::wait_connected(*clients.back(), 10s).is_ok());
  }
  std::vector<fedmesh::Result<fp::FetchedModel>> fetched(kSites, fedmesh::unavailable("not fetched"));
  std::vector<std::thread> sites;
  for (int i = 0; i < kSites; ++i) {
    sites.emplace_back([&, i] {
      fp::FetchOptions options;
      options.window = kWindow;
      options.busy_pause = 2ms;
      options.busy_max_pause = 20ms;
      options.max_busy_answers = 100000;
      for (int repeat = 0; repeat < 3 && (repeat == 0 || fetched[static_cast<size_t>(i)].is_ok()); ++repeat) {
        fetched[static_cast<size_t>(i)] = fp::fetch_model(*clients[static_cast<size_t>(i)], 1, 0, manifest, options);
      }
    });
  }
  for (std::thread& site : sites) site.join();
  stop.store(true);
  answering.join();
  for (int i = 0; i < kSites; ++i) {
    ASSERT_TRUE(fetched[static_cast<size_t>(i)].is_ok()) << fetched[static_cast<size_t>(i)].status().to_string();
    EXPECT_EQ(fetched[static_cast<size_t>(i)]->tensors[0], w);
  }
  EXPECT_GT(busy.load(), 0) << "no request waited: the budget was never reached";
  EXPECT_LE(most_alive.load(), kBudget + kWindow * 1024);
}

// The publisher serves the model from the tensors where they lie (it keeps
// no copy: a large model's aggregator would otherwise hold it twice): each
// chunk is encoded when asked for, segments of at most a chunk packed in
// order, and together they carry every value exactly once; requests for a
// chunk while a copy of it lives share that copy. A model with a non-finite
// value is not published.
TEST(ModelPublisher, ServesTheTensorsWhereTheyLieChunkByChunk) {
  const std::vector<fp::TensorShape> manifest = {{"w", {3000}}, {"b", {7}}};
  std::vector<float> w(3000), b(7);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.25f - 100.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
  const std::vector<std::span<const float>> tensors = {w, b};
  fc::Hash v0{}, v1{};
  v1.fill(3);
  fp::ModelPublisher publisher(1024);  // 256 values a chunk
  ASSERT_TRUE(publisher.publish(1, {v0, v1}, manifest, tensors).is_ok());
  EXPECT_EQ(publisher.chunk_count(), 1u + 12u) << "11 full chunks of w, then w's last 184 values with b's 7";
  capnp::MallocMessageBuilder builder;
  auto request = builder.initRoot<fedmesh::wire::Message>().initModelRequest();
  request.setVersion(1);
  request.setTrustedVersion(1);
  std::vector<std::vector<float>> rebuilt = {std::vector<float>(w.size(), NAN), std::vector<float>(b.size(), NAN)};
  size_t values_seen = 0;
  for (uint32_t from = 1; from < publisher.chunk_count(); from += 4) {
    request.setFromChunk(from);
    std::vector<fp::SharedMessage> replies;
    fp::Rejection rejection;
    ASSERT_TRUE(publisher.answer(request.asReader(), 4, replies, rejection)) << rejection.reason;
    for (const fp::SharedMessage& reply : replies) {
      std::unique_ptr<fp::ParsedMessage> parsed;
      ASSERT_TRUE(fp::parse_message(reply.bytes(), fp::kDefaultMaxMessageBytes, {}, parsed, rejection)) << rejection.reason;
      const auto chunk = parsed->root().getModelChunk();
      EXPECT_EQ(chunk.getVersion(), 1u);
      size_t bytes = 0;
      for (const auto segment : chunk.getSegments()) {
        const auto values = segment.getValues();
        ASSERT_EQ(values.size(), segment.getCount() * sizeof(float));
        std::vector<float>& into = rebuilt[segment.getTensor()];
        ASSERT_LE(segment.getOffset() + segment.getCount(), into.size());
        std::memcpy(into.data() + segment.getOffset(), values.begin(), values.size());
        values_seen += segment.getCount();
        bytes += values.size();
      }
      EXPECT_LE(bytes, 1024u);
    }
  }
  EXPECT_EQ(values_seen, w.size() + b.size()) << "every value once";
  // Peers downloading together share one copy of each chunk while it lives.
  request.setFromChunk(2);
  std::vector<fp::SharedMessage> one, other;
  fp::Rejection rejection;
  ASSERT_TRUE(publisher.answer(request.asReader(), 2, one, rejection));
  ASSERT_TRUE(publisher.answer(request.asReader(), 2, other, rejection));
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(one[0].shared().get(), other[0].shared().get());
  EXPECT_EQ(one[1].shared().get(), other[1].shared().get());
  EXPECT_EQ(rebuilt[0], w);
  EXPECT_EQ(rebuilt[1], b);

  b[3] = INFINITY;
  fp::ModelPublisher refusing(1024);
  EXPECT_FALSE(refusing.publish(1, {v0, v1}, manifest, tensors).is_ok());
  EXPECT_FALSE(refusing.published());
}

// A peer's model replies count from the moment they are queued until the
// transport lets go of them: past two windows the peer has no room (another
// peer does); once the client has read them, or they are dropped, the count
// is back to zero.
TEST_F(Transport, QueuedModelRepliesCountUntilTheTransportLetsGo) {
  const std::vector<fp::TensorShape> manifest = {{"w", {64, 64}}};
  std::vector<float> w(64 * 64, 0.25f);
  const std::vector<std::span<const float>> tensors = {w};
  fc::Hash v0{}, v1{};
  v1.fill(2);
  fp::ModelPublisher publisher(1024);
  ASSERT_TRUE(publisher.publish(1, {v0, v1}, manifest, tensors).is_ok());
  capnp::MallocMessageBuilder builder;
  auto request = builder.initRoot<fedmesh::wire::Message>().initModelRequest();
  request.setVersion(1);
  request.setTrustedVersion(1);
  std::vector<fp::SharedMessage> window;
  fp::Rejection rejection;
  ASSERT_TRUE(publisher.answer(request.asReader(), fp::kDefaultModelWindow, window, rejection));
  ASSERT_EQ(window.size(), fp::kDefaultModelWindow);

  fp::QueuedModelReplies queue;
  EXPECT_EQ(queue.max_per_peer(), fp::kMaxQueuedModelRepliesPerPeer);
  {
    std::vector<fp::SharedMessage> held;
    for (int copy = 0; copy < 2; ++copy) {
      ASSERT_TRUE(queue.has_room("site-a", window.size()));
      for (const auto& chunk : window) held.push_back(queue.track("site-a", chunk));
    }
    EXPECT_EQ(queue.queued("site-a"), 2 * window.size());
    EXPECT_FALSE(queue.has_room("site-a", 1));
    EXPECT_TRUE(queue.has_room("site-b", window.size()));
    EXPECT_EQ(held[0].bytes().data(), window[0].bytes().data());  // the same bytes, not a copy
  }
  EXPECT_EQ(queue.queued("site-a"), 0u);

  // Through a socket: counted while queued, released once sent and read.
  auto server = bind();
  ASSERT_TRUE(server);
  auto client = dial(*server, *site_keys_);
  ASSERT_TRUE(fp::wait_connected(*client, 10s).is_ok());
  ASSERT_TRUE(client->send(heartbeat(1), 5s).is_ok());
  auto frame = next(*server, 10s);
  ASSERT_TRUE(frame.has_value());
  for (const auto& chunk : window) ASSERT_TRUE(server->send(frame->routing_id, queue.track("site-a", chunk)).is_ok());
  for (size_t i = 0; i < window.size(); ++i) {
    auto reply = client->receive(10s);
    ASSERT_TRUE(reply.is_ok() && reply->has_value());
  }
  for (const auto until = std::chrono::steady_clock::now() + 10s;
       queue.queued("site-a") > 0 && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(queue.queued("site-a"), 0u);
}

}  // namespace
