// An insider (a process holding a valid site key, here site-1's) against a
// real `fedmesh aggregator` whose honest site (site-0, a real `fedmesh
// node`) keeps training, on loopback (deploy/local_federation.sh):
//   - the insider opens as many signed update transfers as the aggregator
//     admits, sends chunk 0 of each and sends it (and the header) again every
//     second: the aggregator admits only the per-sender maximum, never
//     refuses the honest site as busy, and rounds keep closing with the
//     honest site's update;
//   - several connections under the insider's key each send many
//     ModelRequests and never read the replies: the aggregator's resident
//     memory stays within a stated bound per connection, and the honest site
//     keeps closing rounds.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "crypto/keys.h"
#include "crypto/roster.h"
#include "protocol/transport.h"
#include "protocol/update_transfer.h"
#include "protocol/wire.h"
#include "support/cluster.h"
#include "support/local_federation.h"
#include "support/process.h"
#include "train/model.h"

namespace {

namespace fp = fedmesh::protocol;
namespace fc = fedmesh::crypto;
namespace wire = fedmesh::wire;
using fedmesh::testing::ChildProcess;
using fedmesh::testing::LocalFederation;
using fedmesh::testing::wait_for;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kInsiderHeaders = 8;  // as many as one sender could hold when the bound was global

bool is_round(const json& e) { return e.value("event", "") == "round"; }

std::string last_events(const std::vector<json>& events) {
  std::string text;
  for (size_t i = events.size() > 8 ? events.size() - 8 : 0; i < events.size(); ++i) text += events[i].dump() + "\n";
  return text;
}

// Reads whatever the aggregator printed for `period` (its output never fills
// the pipe).
void drain(ChildProcess& aggregator, std::vector<json>& events, std::chrono::milliseconds period) {
  const auto until = std::chrono::steady_clock::now() + period;
  while (std::chrono::steady_clock::now() < until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    std::optional<std::string> line = aggregator.read_line(std::max(left, 1ms));
    if (!line) return;
    json event = json::parse(*line, nullptr, false);
    if (!event.is_discarded()) events.push_back(std::move(event));
  }
}

// Rounds that closed with at least one update, among `events` from `from` on.
int rounds_with_updates(const std::vector<json>& events, size_t from) {
  int count = 0;
  for (size_t i = from; i < events.size(); ++i) {
    if (is_round(events[i]) && events[i].value("updates", 0) >= 1) ++count;
  }
  return count;
}

int64_t resident_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// A connection made with a site's own key and the roster's aggregator key.
class Insider {
 public:
  Insider(const LocalFederation& federation, const std::string& endpoint, const std::string& name,
          int high_water_mark = fp::kDefaultHighWaterMark) {
    auto keys = fc::read_site_keys(federation.dir() / "keys" / (name + ".key"));
    auto roster = fc::read_roster(federation.dir() / "roster.toml");
    if (!keys.is_ok() || !roster.is_ok()) return;
    keys_ = std::make_unique<fc::SiteKeys>(std::move(*keys));
    federation_ = roster->federation;
    const fc::RosterEntry* aggregator = roster->find("aggregator");
    if (aggregator == nullptr) return;
    fp::TransportOptions options;
    options.high_water_mark = high_water_mark;
    auto socket = fp::ClientSocket::connect(endpoint, fp::CurveKeys::from(*keys_), aggregator->identity.box_public,
                                            options);
    if (socket.is_ok()) socket_ = std::move(*socket);
  }
  bool connected() const { return socket_ != nullptr; }
  const fc::SiteKeys& keys() const { return *keys_; }
  const std::string& federation() const { return federation_; }

  bool send(const fp::SharedMessage& message) { return socket_->send(message, 2000ms).is_ok(); }
  bool send(fp::OutgoingMessage message) { return socket_->send(std::move(message), 2000ms).is_ok(); }

  // The next message from the aggregator, parsed (null on timeout).
  std::unique_ptr<fp::ParsedMessage> next(std::chrono::milliseconds timeout = 5000ms) {
    auto incoming = socket_->receive(timeout);
    if (!incoming.is_ok() || !incoming->has_value()) return nullptr;
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    if (!fp::parse_message((*incoming)->bytes, fp::kDefaultMaxMessageBytes, (*incoming)->frame, parsed, rejection)) {
      return nullptr;
    }
    return parsed;
  }

  // A Heartbeat's answer: the round and model version on offer.
  std::optional<std::pair<uint64_t, uint64_t>> round_and_version() {
    capnp::MallocMessageBuilder builder;
    builder.initRoot<wire::Message>().initHeartbeat();
    if (!send(fp::serialize(builder))) return std::nullopt;
    for (int i = 0; i < 20; ++i) {
      auto reply = next();
      if (!reply) return std::nullopt;
      if (reply->root().isRoundAnnounce()) {
        const auto a = reply->root().getRoundAnnounce();
        return std::make_pair(a.getRound(), a.getModelVersion());
      }
    }
    return std::nullopt;
  }

 private:
  std::unique_ptr<fc::SiteKeys> keys_;
  std::string federation_;
  std::unique_ptr<fp::ClientSocket> socket_;
};

// One honest site (site-0) running, site-1's key left to the test; rounds
// close at a short deadline with whoever delivered.
struct Federation {
  std::unique_ptr<LocalFederation> federation;
  std::unique_ptr<ChildProcess> aggregator, site;
  std::vector<json> events;
  std::string endpoint;
};

void start(Federation& f, const std::string& name) {
  f.federation = std::make_unique<LocalFederation>(
      2, std::vector<std::string>{"--rounds", "1000", "--local-steps", "5", "--deadline", "4", "--min-sites", "1"},
      name);
  ASSERT_TRUE(f.federation->made()) << "deploy/local_federation.sh failed";
  f.aggregator = f.federation->aggregator();
  std::optional<json> listening =
      wait_for(*f.aggregator, f.events, [](const json& e) { return e.value("event", "") == "listening"; }, 60s);
  ASSERT_TRUE(listening.has_value()) << "the aggregator did not start:\n" << last_events(f.events);
  f.endpoint = (*listening)["endpoint"].get<std::string>();
  f.site = f.federation->site(0);
  ASSERT_TRUE(wait_for(*f.aggregator, f.events,
                       [](const json& e) { return is_round(e) && e.value("updates", 0) >= 1; }, 120s))
      << "the honest site's first update did not land:\n" << last_events(f.events);
}

std::vector<fp::TensorShape> mlp_manifest() {
  std::vector<fp::TensorShape> manifest;
  auto model = fedmesh::train::make_model("mlp", 1);
  EXPECT_TRUE(model.is_ok());
  if (!model.is_ok()) return manifest;
  for (fedmesh::Parameter* p : (*model)->parameters()) {
    manifest.push_back({p->name, std::vector<int64_t>(p->value.shape().begin(), p->value.shape().end())});
  }
  return manifest;
}

uint64_t unix_micros() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

TEST(PeerBounds, AnInsiderStallingItsMostTransfersLeavesRoundsClosing) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  Federation f;
  start(f, "stall");
  if (HasFatalFailure()) return;

  Insider insider(*f.federation, f.endpoint, "site-1");
  ASSERT_TRUE(insider.connected());
  auto offer = insider.round_and_version();
  ASSERT_TRUE(offer.has_value()) << "no RoundAnnounce for the insider";
  const std::vector<fp::TensorShape> manifest = mlp_manifest();
  ASSERT_FALSE(manifest.empty());
  std::vector<std::vector<float>> zeros;
  for (const auto& shape : manifest) zeros.emplace_back(shape.element_count(), 0.0f);
  std::vector<std::span<const float>> spans(zeros.begin(), zeros.end());
  std::vector<fp::TensorPlan> plans(manifest.size());

  // Signed headers, one after another; the aggregator admits some, refuses
  // the rest as busy. (A header that meets a round just closed is made
  // again for the new one.)
  std::vector<fp::PreparedUpdate> held;
  int busy = 0;
  uint64_t sequence = unix_micros();
  for (int i = 0, attempts = 0; i < kInsiderHeaders && attempts < 4 * kInsiderHeaders; ++attempts) {
    const fp::UpdateMetadata metadata{insider.federation(), offer->first, offer->second, "site-1", "aggregator",
                                      ++sequence, 100};
    auto prepared = fp::prepare_update(metadata, manifest, spans, plans, insider.keys(), 4096);
    ASSERT_TRUE(prepared.is_ok()) << prepared.status().to_string();
    ASSERT_GE(prepared->chunks.size(), 2u);
    ASSERT_TRUE(insider.send(prepared->header));
    auto reply = insider.next();
    ASSERT_NE(reply, nullptr) << "no answer to header " << i;
    if (reply->root().isReject() && reply->root().getReject().getCode() == wire::RejectCode::WRONG_ROUND) {
      offer = insider.round_and_version();
      ASSERT_TRUE(offer.has_value());
      continue;
    }
    ++i;
    if (reply->root().isAck()) {
      held.push_back(std::move(*prepared));
    } else {
      ASSERT_TRUE(reply->root().isReject());
      EXPECT_EQ(reply->root().getReject().getCode(), wire::RejectCode::BUSY)
          << reply->root().getReject().getText().cStr();
      ++busy;
    }
  }
  EXPECT_EQ(held.size(), fp::kMaxTransfersPerPeer) << "transfers the aggregator let one sender hold";
  EXPECT_EQ(busy, kInsiderHeaders - static_cast<int>(held.size()));

  // Stall: chunk 0 and the header of each held transfer, again and again,
  // while the honest site's rounds are watched.
  const size_t watched_from = f.events.size();
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (rounds_with_updates(f.events, watched_from) < 3 && std::chrono::steady_clock::now() < give_up) {
    for (const fp::PreparedUpdate& update : held) {
      ASSERT_TRUE(insider.send(update.chunks[0]));
      ASSERT_TRUE(insider.send(update.header));
    }
    for (auto reply = insider.next(0ms); reply; reply = insider.next(0ms)) {
    }
    drain(*f.aggregator, f.events, 1000ms);
    ASSERT_FALSE(f.aggregator->poll_exit().has_value()) << "the aggregator exited:\n" << last_events(f.events);
  }
  EXPECT_GE(rounds_with_updates(f.events, watched_from), 3)
      << "rounds stopped closing with the honest site's update:\n" << last_events(f.events);
  for (size_t i = watched_from; i < f.events.size(); ++i) {
    const json& e = f.events[i];
    if (e.value("event", "") == "rejected" && e.value("peer", "") == "site-0") {
      ADD_FAILURE() << "the honest site was refused: " << e.dump();
    }
  }
}

TEST(PeerBounds, UnreadModelRequestsKeepTheAggregatorWithinItsMemoryBound) {
  ASSERT_FALSE(fedmesh::testing::fedmesh_binary().empty()) << "FEDMESH_BINARY is not set";
  // What one connection that never reads may make the aggregator hold
  // (docs/security-model.md: one encrypted chunk being written and 64
  // queued references; the MLP's model is one chunk of about 1 MB).
  constexpr int kConnections = 8;
  constexpr int kRequestsPerConnection = 100;
  constexpr int64_t kBoundPerConnectionKib = 8 * 1024;
  constexpr int64_t kSlackKib = 32 * 1024;  // allocator and thread stacks of new connections
  Federation f;
  start(f, "unread");
  if (HasFatalFailure()) return;
  drain(*f.aggregator, f.events, 1000ms);
  const int64_t base_kib = resident_kib(f.aggregator->pid());
  ASSERT_GT(base_kib, 0);

  int64_t peak_kib = base_kib;
  {
    // The insider's connections keep one reply each in their own queue and
    // read nothing: the rest waits on the aggregator's side.
    std::vector<std::unique_ptr<Insider>> flood;
    for (int c = 0; c < kConnections; ++c) {
      flood.push_back(std::make_unique<Insider>(*f.federation, f.endpoint, "site-1", 1));
      ASSERT_TRUE(flood.back()->connected());
    }
    int sent = 0;
    for (auto& insider : flood) {
      const auto offer = insider->round_and_version();
      ASSERT_TRUE(offer.has_value());
      for (int r = 0; r < kRequestsPerConnection; ++r) {
        capnp::MallocMessageBuilder builder;
        auto request = builder.initRoot<wire::Message>().initModelRequest();
        request.setVersion(offer->second);
        request.setFromChunk(0);
        request.setTrustedVersion(offer->second);
        sent += insider->send(fp::serialize(builder)) ? 1 : 0;
      }
      drain(*f.aggregator, f.events, 100ms);
    }
    EXPECT_GE(sent, kConnections * kRequestsPerConnection / 2);
    const size_t watched_from = f.events.size();
    for (const auto until = std::chrono::steady_clock::now() + 6s; std::chrono::steady_clock::now() < until;) {
      drain(*f.aggregator, f.events, 250ms);
      peak_kib = std::max(peak_kib, resident_kib(f.aggregator->pid()));
    }
    // The honest site keeps closing rounds meanwhile.
    for (const auto give_up = std::chrono::steady_clock::now() + 60s;
         rounds_with_updates(f.events, watched_from) < 1 && std::chrono::steady_clock::now() < give_up;) {
      drain(*f.aggregator, f.events, 500ms);
      peak_kib = std::max(peak_kib, resident_kib(f.aggregator->pid()));
    }
    EXPECT_GE(rounds_with_updates(f.events, watched_from), 1)
        << "no round closed with the honest site's update under the flood:\n" << last_events(f.events);
  }
  std::printf("aggregator resident memory: %lld KiB before, %lld KiB at the peak of %d unread connections\n",
              static_cast<long long>(base_kib), static_cast<long long>(peak_kib), kConnections);
  EXPECT_LE(peak_kib, base_kib + kSlackKib + kConnections * kBoundPerConnectionKib)
      << "unread model replies grew the aggregator past its bound";
  // Closed: the aggregator stays within the bound and keeps serving.
  const size_t after_close = f.events.size();
  for (const auto give_up = std::chrono::steady_clock::now() + 60s;
       rounds_with_updates(f.events, after_close) < 1 && std::chrono::steady_clock::now() < give_up;) {
    drain(*f.aggregator, f.events, 500ms);
  }
  EXPECT_GE(rounds_with_updates(f.events, after_close), 1) << last_events(f.events);
  EXPECT_LE(resident_kib(f.aggregator->pid()), base_kib + kSlackKib + kConnections * kBoundPerConnectionKib);
  ASSERT_FALSE(f.aggregator->poll_exit().has_value());
}

}  // namespace
