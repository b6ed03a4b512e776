// The aggregator's bounds on what the model's downloads hold
// (protocol/model_serving.h) and the publisher's count of its chunk copies.
#include "protocol/model_serving.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <vector>

#include "protocol/model_transfer.h"

namespace fp = fedmesh::protocol;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kMB = uint64_t{1} << 20;

// Within the budget a request is granted; past it, refused and put in line;
// a request that needs no new copy is granted whatever is alive.
TEST(ModelServingBudget, GrantsWhatFitsAndLinesUpTheRest) {
  fp::ModelServingBudget budget(100 * kMB);
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  EXPECT_TRUE(budget.admit("a", 0, 32 * kMB, t0));
  EXPECT_TRUE(budget.admit("b", 32 * kMB, 32 * kMB, t0));
  EXPECT_TRUE(budget.admit("c", 64 * kMB, 36 * kMB, t0)) << "exactly full";
  EXPECT_FALSE(budget.admit("d", 100 * kMB, 1, t0));
  EXPECT_EQ(budget.waiting(), 1u);
  EXPECT_EQ(budget.position("d"), 0);
  EXPECT_TRUE(budget.admit("e", 100 * kMB, 0, t0)) << "sharing copies alive adds nothing";
  EXPECT_EQ(budget.position("e"), -1);
  // Nothing alive: a request larger than the whole budget still moves.
  fp::ModelServingBudget small(1 * kMB);
  EXPECT_TRUE(small.admit("a", 0, 32 * kMB, t0));
  EXPECT_FALSE(small.admit("b", 32 * kMB, 32 * kMB, t0));
  EXPECT_FALSE(small.admit("b", 1, 1 * kMB, t0)) << "alive + new past the budget";
  EXPECT_TRUE(small.admit("b", 0, 32 * kMB, t0));
  EXPECT_EQ(small.waiting(), 0u);
}

// Refused peers are served in the order they were first refused: once room
// is freed, a newcomer (or one further back) that would fit is refused
// while the first in line has not had its turn; the first is granted, and
// then the next.
TEST(ModelServingBudget, FreedRoomGoesToTheFirstInLine) {
  fp::ModelServingBudget budget(64 * kMB);
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  EXPECT_FALSE(budget.admit("slow", 64 * kMB, 32 * kMB, t0));
  EXPECT_FALSE(budget.admit("second", 64 * kMB, 32 * kMB, t0 + 10ms));
  EXPECT_EQ(budget.position("slow"), 0);
  EXPECT_EQ(budget.position("second"), 1);
  // Room for one window: not for the newcomer, nor for the second in line.
  EXPECT_FALSE(budget.admit("newcomer", 32 * kMB, 32 * kMB, t0 + 100ms));
  EXPECT_FALSE(budget.admit("second", 32 * kMB, 32 * kMB, t0 + 100ms));
  EXPECT_EQ(budget.position("newcomer"), 2);
  EXPECT_TRUE(budget.admit("slow", 32 * kMB, 32 * kMB, t0 + 150ms));
  EXPECT_EQ(budget.position("slow"), -1);
  EXPECT_EQ(budget.position("second"), 0);
  EXPECT_FALSE(budget.admit("newcomer", 32 * kMB, 32 * kMB, t0 + 200ms));
  EXPECT_TRUE(budget.admit("second", 32 * kMB, 32 * kMB, t0 + 200ms));
  EXPECT_TRUE(budget.admit("newcomer", 32 * kMB, 32 * kMB, t0 + 250ms));
  EXPECT_EQ(budget.waiting(), 0u);
}

// A peer in line that stops asking (gone, or no longer downloading) loses its
// place after the hold time, so it does not keep the others waiting; one
// that keeps asking keeps its place however long it waits.
TEST(ModelServingBudget, AQuietPeerLosesItsPlace) {
  fp::ModelServingBudget budget(64 * kMB, 2000ms);
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  EXPECT_FALSE(budget.admit("gone", 64 * kMB, 32 * kMB, t0));
  EXPECT_FALSE(budget.admit("patient", 64 * kMB, 32 * kMB, t0 + 1ms));
  for (int i = 1; i <= 4; ++i) {
    EXPECT_FALSE(budget.admit("patient", 64 * kMB, 32 * kMB, t0 + i * 900ms));
  }
  EXPECT_EQ(budget.position("gone"), -1) << "silent past 2 s";
  EXPECT_EQ(budget.position("patient"), 0) << "asked again every 0.9 s";
  EXPECT_TRUE(budget.admit("patient", 0, 32 * kMB, t0 + 4s));
}

// The publisher counts the values of every chunk copy alive, whichever peer
// holds it, until the last reference goes; admit is told the bytes of the
// copies a request would add (none for chunks alive), and a refusal encodes
// nothing and keeps its rejection.
TEST(ModelPublisher, CountsItsChunkCopiesAliveAndAsksBeforeEncoding) {
  const std::vector<fp::TensorShape> manifest = {{"w", {4096}}};
  std::vector<float> w(4096, 0.5f);
  const std::vector<std::span<const float>> tensors = {w};
  fedmesh::crypto::Hash v0{}, v1{};
  v1.fill(4);
  fp::ModelPublisher publisher(1024);  // 256 values a chunk: 16 chunks of 1 KiB
  ASSERT_TRUE(publisher.publish(1, {v0, v1}, manifest, tensors).is_ok());
  ASSERT_EQ(publisher.chunk_count(), 17u);
  capnp::MallocMessageBuilder builder;
  auto request = builder.initRoot<fedmesh::wire::Message>().initModelRequest();
  request.setVersion(1);
  request.setTrustedVersion(1);
  std::vector<std::pair<size_t, uint64_t>> asked;
  const auto note = [&](size_t replies, uint64_t new_bytes, fp::Rejection&) {
    asked.emplace_back(replies, new_bytes);
    return true;
  };
  fp::Rejection rejection;
  std::vector<fp::SharedMessage> first, second, refused;
  request.setFromChunk(0);
  ASSERT_TRUE(publisher.answer(request.asReader(), 4, first, rejection, note));
  EXPECT_EQ(asked.back(), std::make_pair(size_t{4}, uint64_t{3 * 1024})) << "chunk 0 carries no values";
  EXPECT_EQ(publisher.live_bytes(), 3u * 1024);
  request.setFromChunk(2);
  ASSERT_TRUE(publisher.answer(request.asReader(), 4, second, rejection, note));
  EXPECT_EQ(asked.back(), std::make_pair(size_t{4}, uint64_t{2 * 1024})) << "chunks 2 and 3 are alive";
  EXPECT_EQ(publisher.live_bytes(), 5u * 1024);
  request.setFromChunk(15);
  const auto refuse = [](size_t, uint64_t, fp::Rejection& r) {
    r = {fedmesh::wire::RejectCode::BUSY, "full"};
    return false;
  };
  EXPECT_FALSE(publisher.answer(request.asReader(), 4, refused, rejection, refuse));
  EXPECT_EQ(rejection.reason, "full");
  EXPECT_TRUE(refused.empty());
  EXPECT_EQ(publisher.live_bytes(), 5u * 1024) << "nothing encoded for a refused request";
  ASSERT_TRUE(publisher.answer(request.asReader(), 4, refused, rejection, note));
  EXPECT_EQ(asked.back(), std::make_pair(size_t{2}, uint64_t{2 * 1024})) << "two chunks left from 15";
  first.clear();
  EXPECT_EQ(publisher.live_bytes(), 6u * 1024) << "chunk 1 went; 2 and 3 live on in the second answer, beside 4, 5, 15 and 16";
  // A new version: the old copies still alive count until they go.
  v0 = v1;
  v1.fill(5);
  ASSERT_TRUE(publisher.publish(2, {v0, v0, v1}, manifest, tensors).is_ok());
  EXPECT_EQ(publisher.live_bytes(), 6u * 1024);
  second.clear();
  refused.clear();
  EXPECT_EQ(publisher.live_bytes(), 0u);
}

}  // namespace
