// A gossip peer's links (node/peer_link.h) over real loopback CurveZMQ: a
// link whose every message is held back 600 ms (transport faults) delays
// only its own messages: queuing is immediate, the other link's messages
// arrive and its share is reported delivered long before the slow link's
// first message leaves; the slow link still delivers everything, in order,
// and reports its share with every byte. A link that cannot dial reports
// its share undelivered and says why; a full link refuses more (a share
// whole); a closing link sends what was queued.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "crypto/keys.h"
#include "node/peer_link.h"
#include "protocol/fault_injection.h"
#include "protocol/transport.h"

namespace fedmesh::node {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class PeerLinks : public ::testing::Test {
 protected:
  void SetUp() override {
    server_keys_ = crypto::generate_site_keys("site-b").value();
    client_keys_ = crypto::generate_site_keys("site-a").value();
    allowlist_[server_keys_.identity.box_public] = "site-b";
    allowlist_[client_keys_.identity.box_public] = "site-a";
  }

  std::unique_ptr<protocol::ServerSocket> bind() {
    auto server = protocol::ServerSocket::bind("tcp://127.0.0.1:*", protocol::CurveKeys::from(server_keys_), allowlist_,
                                               protocol::TransportOptions{});
    EXPECT_TRUE(server.is_ok()) << server.status().to_string();
    return server.is_ok() ? std::move(server.value()) : nullptr;
  }

  PeerLink::Dial dial(const protocol::ServerSocket& server, const std::string& faults = "") {
    protocol::TransportOptions options;
    if (!faults.empty()) options.faults = protocol::parse_fault_plan(faults).value();
    return [endpoint = server.endpoint(), keys = protocol::CurveKeys::from(client_keys_),
            server_public = server_keys_.identity.box_public, options] {
      return protocol::zmq_network().connect(endpoint, keys, server_public, options);
    };
  }

  static protocol::SharedMessage message(size_t bytes) {
    const std::vector<uint8_t> payload(bytes, 0x5a);
    return protocol::SharedMessage(protocol::OutgoingMessage::from_bytes(payload));
  }

  // Frames received by `server` until `count` arrived or the time is up,
  // with when each arrived.
  static std::vector<std::pair<size_t, Clock::time_point>> receive(protocol::ServerSocket& server, size_t count,
                                                                   std::chrono::milliseconds timeout) {
    std::vector<std::pair<size_t, Clock::time_point>> got;
    const auto deadline = Clock::now() + timeout;
    while (got.size() < count && Clock::now() < deadline) {
      auto frame = server.receive(20ms);
      if (frame.is_ok() && frame->has_value()) got.emplace_back((*frame)->bytes.size(), Clock::now());
    }
    return got;
  }

  // Takes reports from `link` until the share's outcome arrives.
  static std::optional<PeerLink::ShareOutcome> outcome(PeerLink& link, uint64_t share, std::chrono::milliseconds timeout,
                                                       std::vector<std::string>* warnings = nullptr) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      PeerLink::Report report = link.take();
      if (warnings) warnings->insert(warnings->end(), report.warnings.begin(), report.warnings.end());
      for (const PeerLink::ShareOutcome& o : report.shares) {
        if (o.share == share) return o;
      }
      std::this_thread::sleep_for(10ms);
    }
    return std::nullopt;
  }

  crypto::SiteKeys server_keys_, client_keys_;
  protocol::Allowlist allowlist_;
};

TEST_F(PeerLinks, ASlowLinkDelaysOnlyItsOwnMessages) {
  std::unique_ptr<protocol::ServerSocket> fast_server = bind(), slow_server = bind();
  ASSERT_TRUE(fast_server && slow_server);
  PeerLink fast("fast", dial(*fast_server), 20ms);
  PeerLink slow("slow", dial(*slow_server, "delay=600ms"), 20ms);
  const auto began = Clock::now();
  const std::vector<size_t> sizes = {100, 2000, 300, 4000};
  std::vector<protocol::SharedMessage> fast_share, slow_share;
  for (const size_t size : sizes) {
    fast_share.push_back(message(size));
    slow_share.push_back(message(size + 1));
  }
  ASSERT_TRUE(slow.send_share(slow_share, 9));
  ASSERT_TRUE(fast.send_share(fast_share, 7));
  EXPECT_LT(Clock::now() - began, 50ms) << "queuing waited for a link";
  const auto fast_got = receive(*fast_server, sizes.size(), 5s);
  ASSERT_EQ(fast_got.size(), sizes.size());
  const std::optional<PeerLink::ShareOutcome> fast_done = outcome(fast, 7, 5s);
  ASSERT_TRUE(fast_done);
  EXPECT_TRUE(fast_done->delivered);
  EXPECT_EQ(fast_done->bytes, 100u + 2000u + 300u + 4000u);
  const auto fast_took = fast_got.back().second - began;
  EXPECT_LT(fast_took, 500ms) << "the fast link waited for the slow one";
  const auto slow_got = receive(*slow_server, sizes.size(), 10s);
  ASSERT_EQ(slow_got.size(), sizes.size()) << "the slow link lost messages";
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(slow_got[i].first, sizes[i] + 1) << "out of order at " << i;
  EXPECT_GE(slow_got.front().second - began, 550ms) << "the slow link's faults did not hold it back";
  const std::optional<PeerLink::ShareOutcome> slow_done = outcome(slow, 9, 5s);
  ASSERT_TRUE(slow_done);
  EXPECT_TRUE(slow_done->delivered);
  EXPECT_EQ(slow_done->bytes, 101u + 2001u + 301u + 4001u);
  std::printf("fast link: all 4 messages in %.0f ms; slow link (600 ms a message): first after %.0f ms, last after %.0f ms\n",
              std::chrono::duration<double, std::milli>(fast_took).count(),
              std::chrono::duration<double, std::milli>(slow_got.front().second - began).count(),
              std::chrono::duration<double, std::milli>(slow_got.back().second - began).count());
}

TEST_F(PeerLinks, ALinkThatCannotDialReportsItsShareUndelivered) {
  PeerLink nowhere("nowhere", [] { return Result<std::unique_ptr<protocol::ClientChannel>>(unavailable("no route")); }, 20ms);
  ASSERT_TRUE(nowhere.send_share({message(64), message(64)}, 3));
  ASSERT_TRUE(nowhere.send(message(64)));  // not a share: dropped quietly
  std::vector<std::string> warnings;
  const std::optional<PeerLink::ShareOutcome> done = outcome(nowhere, 3, 5s, &warnings);
  ASSERT_TRUE(done);
  EXPECT_FALSE(done->delivered);
  ASSERT_FALSE(warnings.empty());
  EXPECT_NE(warnings.front().find("cannot dial nowhere: no route"), std::string::npos) << warnings.front();
  // Reported once, whatever the share's later messages did.
  std::this_thread::sleep_for(100ms);
  for (const PeerLink::ShareOutcome& o : nowhere.take().shares) EXPECT_NE(o.share, 3u);
}

// A link holds at most kMaxQueued messages: a share that does not fit is
// refused whole (the peer takes it back), a single message beyond is refused.
TEST_F(PeerLinks, AFullLinkRefusesMore) {
  std::unique_ptr<protocol::ServerSocket> server = bind();
  ASSERT_TRUE(server);
  PeerLink stuck("stuck", dial(*server, "delay=3s"), 20ms);
  for (size_t i = 0; i < PeerLink::kMaxQueued; ++i) ASSERT_TRUE(stuck.send(message(8)));
  std::this_thread::sleep_for(50ms);  // the link takes the first one and holds it 3 s
  EXPECT_TRUE(stuck.send(message(8)));
  EXPECT_FALSE(stuck.send(message(8)));
  EXPECT_FALSE(stuck.send_share({message(8), message(8)}, 5));
}

TEST_F(PeerLinks, AClosingLinkSendsWhatWasQueued) {
  std::unique_ptr<protocol::ServerSocket> server = bind();
  ASSERT_TRUE(server);
  {
    PeerLink link("b", dial(*server, "delay=100ms"), 20ms);
    for (int i = 0; i < 3; ++i) link.send(message(50 + static_cast<size_t>(i)));
  }  // the destructor sends the three first (about 300 ms)
  EXPECT_EQ(receive(*server, 3, 3s).size(), 3u);
}

}  // namespace
}  // namespace fedmesh::node
