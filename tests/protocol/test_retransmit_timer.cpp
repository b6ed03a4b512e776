// The retransmission timer under a fake clock: time points are handed in,
// so every wait, sample and backoff is exact and nothing sleeps.
#include "protocol/retransmit_timer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

namespace fp = fedmesh::protocol;
using namespace std::chrono_literals;
using std::chrono::microseconds;

namespace {

// A clock that moves only when told.
struct FakeClock {
  fp::RetransmitClock::time_point now{std::chrono::seconds(1000)};
  void advance(microseconds by) { now += by; }
};

fp::RetransmitOptions options() {
  fp::RetransmitOptions o;
  o.initial_timeout = 1s;
  o.min_timeout = 10ms;
  o.max_timeout = 5s;
  o.granularity = 1ms;
  return o;
}

// One request answered after `round_trip`.
void exchange(fp::RetransmitTimer& timer, FakeClock& clock, microseconds round_trip) {
  timer.sent(clock.now);
  clock.advance(round_trip);
  timer.answered(clock.now);
}

TEST(RoundTripEstimator, FollowsRfc6298) {
  fp::RoundTripEstimator estimator(options());
  EXPECT_FALSE(estimator.has_sample());
  EXPECT_EQ(estimator.timeout(), microseconds(1s));  // initial_timeout
  estimator.add_sample(200ms);                       // SRTT = R, RTTVAR = R / 2
  EXPECT_EQ(estimator.smoothed(), microseconds(200ms));
  EXPECT_EQ(estimator.variation(), microseconds(100ms));
  EXPECT_EQ(estimator.timeout(), microseconds(600ms));  // SRTT + 4 RTTVAR
  estimator.add_sample(100ms);
  // RTTVAR = 3/4 100 + 1/4 |200 - 100| = 100; SRTT = 7/8 200 + 1/8 100 = 187.5
  EXPECT_EQ(estimator.variation(), microseconds(100ms));
  EXPECT_EQ(estimator.smoothed(), microseconds(187500));
  EXPECT_EQ(estimator.timeout(), microseconds(587500));
  EXPECT_EQ(estimator.samples(), 2u);
}

TEST(RoundTripEstimator, ASteadyLinkConvergesAndTheBoundsHold) {
  fp::RoundTripEstimator estimator(options());
  for (int i = 0; i < 200; ++i) estimator.add_sample(20ms);
  EXPECT_EQ(estimator.smoothed(), microseconds(20ms));
  // The variation decays towards 0; G keeps the timeout above the round trip.
  EXPECT_LE(estimator.timeout(), microseconds(21ms) + microseconds(4));
  EXPECT_GE(estimator.timeout(), microseconds(21ms));

  fp::RoundTripEstimator fast(options());
  fast.add_sample(1ms);
  EXPECT_EQ(fast.timeout(), microseconds(10ms));  // min_timeout
  fp::RoundTripEstimator slow(options());
  slow.add_sample(4s);
  EXPECT_EQ(slow.timeout(), microseconds(5s));  // max_timeout
}

TEST(RetransmitTimer, BacksOffExponentiallyUpToTheCapAndProgressResetsIt) {
  FakeClock clock;
  fp::RetransmitTimer timer(options());
  exchange(timer, clock, 100ms);  // RTO = 100 + 4 * 50 = 300 ms
  ASSERT_EQ(timer.timeout(), microseconds(300ms));
  const microseconds expected[] = {600ms, 1200ms, 2400ms, 4800ms, 5s, 5s, 5s};
  for (const microseconds wait : expected) {
    timer.sent(clock.now, true);
    clock.advance(timer.timeout());
    timer.timed_out();
    EXPECT_EQ(timer.timeout(), wait) << "after " << timer.backoff() << " timeouts";
  }
  // An answer (even to a retransmission) is progress: back to the estimate.
  timer.sent(clock.now, true);
  clock.advance(50ms);
  timer.answered(clock.now);
  EXPECT_EQ(timer.backoff(), 0);
  EXPECT_EQ(timer.timeout(), microseconds(300ms));

  timer.sent(clock.now);
  timer.timed_out();
  EXPECT_EQ(timer.timeout(), microseconds(600ms));
  timer.progressed();  // e.g. the Ack of an earlier chunk
  EXPECT_EQ(timer.timeout(), microseconds(300ms));
}

TEST(RetransmitTimer, AnAnswerToARepeatedRequestGivesNoSample) {
  FakeClock clock;
  fp::RetransmitTimer timer(options());
  exchange(timer, clock, 100ms);
  ASSERT_EQ(timer.estimator().samples(), 1u);

  // Marked as a retransmission by the caller.
  timer.sent(clock.now, true);
  clock.advance(3s);
  timer.answered(clock.now);
  EXPECT_EQ(timer.estimator().samples(), 1u);

  // Sent after a timeout, before any answer: the answer may be the first copy's.
  timer.sent(clock.now);
  clock.advance(timer.timeout());
  timer.timed_out();
  timer.sent(clock.now);
  clock.advance(1ms);
  timer.answered(clock.now);
  EXPECT_EQ(timer.estimator().samples(), 1u);
  EXPECT_EQ(timer.estimator().smoothed(), microseconds(100ms));

  // A second answer to one request gives no second sample.
  exchange(timer, clock, 80ms);
  EXPECT_EQ(timer.estimator().samples(), 2u);
  clock.advance(5ms);
  timer.answered(clock.now);
  EXPECT_EQ(timer.estimator().samples(), 2u);
  EXPECT_FALSE(timer.outstanding());
}

TEST(RetransmitTimer, MeasuresLossAndSizesTheAttemptsFromIt) {
  FakeClock clock;
  fp::RetransmitTimer timer(options());
  EXPECT_EQ(timer.loss(), 0.0);
  EXPECT_EQ(timer.attempts_for(2, fp::kRetransmitGiveUpProbability, 4), 4);  // nothing lost: the floor

  // 3 of every 10 waits time out.
  for (int i = 0; i < 400; ++i) {
    timer.sent(clock.now);
    if (i % 10 < 3) {
      clock.advance(timer.timeout());
      timer.timed_out();
    } else {
      clock.advance(20ms);
      timer.answered(clock.now);
    }
  }
  EXPECT_NEAR(timer.loss(), 0.3, 0.1);

  // Two messages an attempt: an attempt fails with 1 - (1 - loss)^2, and it
  // takes enough attempts that all fail with at most the give-up probability.
  const double loss = timer.loss();
  const double attempt_fails = 1.0 - (1.0 - loss) * (1.0 - loss);
  const int expected = static_cast<int>(std::ceil(std::log(1e-3) / std::log(attempt_fails)));
  EXPECT_EQ(timer.attempts_for(2, 1e-3, 1), expected);
  EXPECT_GT(expected, 4);
  EXPECT_EQ(timer.attempts_for(2, 1e-3, 30), fp::kMaxRetransmitAttempts);  // the floor, within the bound

  // A dead link: every wait times out, the loss goes to 1, the attempts to the bound.
  for (int i = 0; i < 400; ++i) {
    timer.sent(clock.now);
    timer.timed_out();
  }
  EXPECT_GT(timer.loss(), 0.99);
  EXPECT_EQ(timer.attempts_for(1, 1e-3, 2), fp::kMaxRetransmitAttempts);
  EXPECT_EQ(timer.timeout(), microseconds(5s));
}

}  // namespace
