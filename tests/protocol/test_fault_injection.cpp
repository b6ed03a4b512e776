// Fault injection (protocol/fault_injection.h): the plan parses and prints
// back and bad ones are refused by name; decisions on a fake clock drop the
// stated share, hold messages by delay +- jitter, and pace a burst at the
// bandwidth cap; over real CurveZMQ sockets a fully lossy link delivers
// nothing (counted) while the same link without faults delivers.
#include <gtest/gtest.h>

#include <capnp/message.h>

#include <chrono>
#include <cmath>

#include "crypto/keys.h"
#include "protocol/fault_injection.h"
#include "protocol/fedmesh.capnp.h"
#include "protocol/transport.h"
#include "protocol/update_upload.h"

namespace fp = fedmesh::protocol;
namespace fc = fedmesh::crypto;
using namespace std::chrono_literals;

namespace {

TEST(FaultPlan, ParsesPrintsBackAndRefusesBadPlans) {
  auto plan = fp::parse_fault_plan("drop=0.2,delay=50ms,jitter=10ms,bandwidth=2MB/s,seed=7");
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->drop, 0.2);
  EXPECT_NEAR(plan->delay_seconds, 0.05, 1e-12);
  EXPECT_NEAR(plan->jitter_seconds, 0.01, 1e-12);
  EXPECT_EQ(plan->bandwidth_bytes_per_second, 2e6);
  EXPECT_EQ(plan->seed, 7u);
  auto again = fp::parse_fault_plan(plan->to_string());
  ASSERT_TRUE(again.is_ok()) << plan->to_string();
  EXPECT_EQ(again->to_string(), plan->to_string());
  EXPECT_FALSE(fp::parse_fault_plan("").value().active());
  EXPECT_FALSE(fp::parse_fault_plan("none").value().active());
  EXPECT_NEAR(fp::parse_fault_plan("delay=1.5s").value().delay_seconds, 1.5, 1e-12);
  for (const char* bad : {"drop=2", "drop=-0.1", "loss=0.1", "delay=5", "delay=-1ms", "bandwidth=fast",
                          "drop", "seed=1.5", "drop=0.1,,delay=1ms"}) {
    auto refused = fp::parse_fault_plan(bad);
    EXPECT_FALSE(refused.is_ok()) << bad;
    if (!refused.is_ok()) {
      EXPECT_NE(refused.status().message().find("faults '"), std::string::npos);
    }
  }
}

TEST(FaultInjector, DropsTheStatedShareAndHoldsByDelayAndJitter) {
  fp::FaultInjector injector(fp::parse_fault_plan("drop=0.25,delay=100ms,jitter=20ms,seed=3").value());
  int dropped = 0;
  const int n = 20000;
  double min_hold = 1e9, max_hold = 0.0;
  for (int i = 0; i < n; ++i) {
    const auto d = injector.decide(100, static_cast<double>(i));
    if (d.drop) {
      ++dropped;
      continue;
    }
    min_hold = std::min(min_hold, d.hold_seconds);
    max_hold = std::max(max_hold, d.hold_seconds);
  }
  // Binomial(20000, 0.25): standard deviation 61; allow 5 of them.
  EXPECT_NEAR(dropped, n / 4, 306);
  EXPECT_GE(min_hold, 0.08 - 1e-12);
  EXPECT_LE(max_hold, 0.12 + 1e-12);
  EXPECT_LT(min_hold, 0.082) << "the jitter's range is used";
  EXPECT_GT(max_hold, 0.118);
}

TEST(FaultInjector, PacesABurstAtTheBandwidthCap) {
  fp::FaultInjector injector(fp::parse_fault_plan("bandwidth=1MB/s").value());
  // Ten 100 KB messages handed over at once leave 0.1 s apart.
  for (int i = 0; i < 10; ++i) {
    const auto d = injector.decide(100'000, 5.0);
    EXPECT_FALSE(d.drop);
    EXPECT_NEAR(d.hold_seconds, 0.1 * (i + 1), 1e-9) << i;
  }
  // After the link drained, a message waits only its own transmission.
  EXPECT_NEAR(injector.decide(100'000, 10.0).hold_seconds, 0.1, 1e-9);
}

class FaultySockets : public ::testing::Test {
 protected:
  void SetUp() override {
    server_keys_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("aggregator").value());
    site_keys_ = std::make_unique<fc::SiteKeys>(fc::generate_site_keys("site-a").value());
    allowlist_[server_keys_->identity.box_public] = "aggregator";
    allowlist_[site_keys_->identity.box_public] = "site-a";
  }
  static fp::OutgoingMessage heartbeat(uint64_t round) {
    capnp::MallocMessageBuilder builder;
    builder.initRoot<fedmesh::wire::Message>().initHeartbeat().setRound(round);
    return fp::serialize(builder);
  }
  // How many of `count` heartbeats reach the server through a client with `faults`.
  int delivered(const std::string& faults, int count, uint64_t* dropped) {
    auto server = fp::ServerSocket::bind("tcp://127.0.0.1:*", fp::CurveKeys::from(*server_keys_), allowlist_, {});
    EXPECT_TRUE(server.is_ok());
    fp::TransportOptions options;
    options.faults = fp::parse_fault_plan(faults).value();
    auto client = fp::ClientSocket::connect((*server)->endpoint(), fp::CurveKeys::from(*site_keys_),
                                            server_keys_->identity.box_public, options);
    EXPECT_TRUE(client.is_ok());
    EXPECT_TRUE(fp::wait_connected(**client, 10s).is_ok());
    for (int i = 0; i < count; ++i) EXPECT_TRUE((*client)->send(heartbeat(static_cast<uint64_t>(i)), 5s).is_ok());
    int received = 0;
    const auto deadline = std::chrono::steady_clock::now() + 2s;
    while (std::chrono::steady_clock::now() < deadline && received < count) {
      auto frame = (*server)->receive(50ms);
      if (frame.is_ok() && frame->has_value()) ++received;
    }
    *dropped = (*client)->counters().dropped_by_faults.load();
    return received;
  }
  std::unique_ptr<fc::SiteKeys> server_keys_, site_keys_;
  fp::Allowlist allowlist_;
};

TEST_F(FaultySockets, ALostLinkDeliversNothingAndCountsItAndACleanOneDelivers) {
  uint64_t dropped = 0;
  EXPECT_EQ(delivered("drop=1", 20, &dropped), 0);
  EXPECT_EQ(dropped, 20u);
  EXPECT_EQ(delivered("", 20, &dropped), 20);
  EXPECT_EQ(dropped, 0u);
  // Delayed and paced messages still all arrive, in order of sending.
  EXPECT_EQ(delivered("delay=5ms,jitter=2ms,bandwidth=1MB/s", 20, &dropped), 20);
}

}  // namespace
