// How long a requester waits for an answer before it asks again, sized from
// what the link has shown: the round trips it measured and the share of
// requests that went unanswered.
//
// RoundTripEstimator is TCP's (RFC 6298): the first sample R sets
// SRTT = R, RTTVAR = R / 2; each later one updates
//   RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|,  SRTT = 7/8 SRTT + 1/8 R,
// and the timeout is RTO = SRTT + max(granularity, 4 RTTVAR), kept within
// [min_timeout, max_timeout]. Before any sample it is initial_timeout.
//
// RetransmitTimer adds what a requester does with it: each timeout doubles
// the wait (exponential backoff, capped at max_timeout) until an answer
// shows progress, which resets the backoff. Karn's rule keeps samples
// honest: the answer to a request that was sent more than once gives no
// sample, since it cannot tell which copy it answers. The timer also keeps
// a moving estimate of the loss (the share of waits that ended in a
// timeout), from which attempts_for() sizes how many tries a requester
// makes before giving up.
//
// No clock of its own: the caller hands in the time points, so that tests
// drive it with a fake clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

namespace fedmesh::protocol {

using RetransmitClock = std::chrono::steady_clock;

inline constexpr int kMaxRetransmitAttempts = 16;  // tries of one request, whatever the measured loss
inline constexpr int kMaxBackoffDoublings = 16;
// attempts_for(): the chance of giving up on a request that a retry would
// still have delivered.
inline constexpr double kRetransmitGiveUpProbability = 1e-3;

struct RetransmitOptions {
  std::chrono::microseconds initial_timeout{std::chrono::seconds(1)};   // before the first sample
  std::chrono::microseconds min_timeout{std::chrono::milliseconds(100)};
  std::chrono::microseconds max_timeout{std::chrono::seconds(5)};      // the backoff's cap too
  std::chrono::microseconds granularity{std::chrono::milliseconds(1)}; // G in RFC 6298
  double loss_gain = 1.0 / 16.0;  // weight of each wait's outcome in the loss estimate
};

class RoundTripEstimator {
 public:
  explicit RoundTripEstimator(const RetransmitOptions& options = {}) : options_(options) {}

  void add_sample(std::chrono::microseconds round_trip);
  // SRTT + max(G, 4 RTTVAR) within [min_timeout, max_timeout]; initial_timeout before any sample.
  std::chrono::microseconds timeout() const;
  bool has_sample() const { return samples_ > 0; }
  uint64_t samples() const { return samples_; }
  std::chrono::microseconds smoothed() const { return srtt_; }
  std::chrono::microseconds variation() const { return rttvar_; }
  const RetransmitOptions& options() const { return options_; }

 private:
  RetransmitOptions options_;
  uint64_t samples_ = 0;
  std::chrono::microseconds srtt_{0};
  std::chrono::microseconds rttvar_{0};
};

class RetransmitTimer {
 public:
  explicit RetransmitTimer(const RetransmitOptions& options = {}) : estimator_(options) {}

  // A request left at `now`. `retransmission`: it repeats one whose answer
  // may still come, so an answer gives no sample (Karn); so does any request
  // sent after a timeout until an answer arrives.
  void sent(RetransmitClock::time_point now, bool retransmission = false);
  // An answer showing progress arrived at `now`: a round-trip sample from
  // the last request (unless it was a retransmission or was already
  // answered), the backoff reset, the loss estimate lowered.
  void answered(RetransmitClock::time_point now);
  // An answer showing progress that does not answer the last request (e.g.
  // the Ack of an earlier chunk): the backoff reset, no sample.
  void progressed();
  // Whether the last request is still unanswered.
  bool outstanding() const { return sent_at_.has_value(); }
  // No answer within timeout(): the backoff doubles (up to the cap) and the
  // loss estimate rises. The next request is a retransmission.
  void timed_out();

  // How long to wait for the answer: the estimator's timeout times 2^backoff,
  // at most max_timeout.
  std::chrono::microseconds timeout() const;

  // The moving share of waits that ended in a timeout, in [0, 1].
  double loss() const { return loss_; }
  // How many tries of a request made of `messages` messages (each lost with
  // probability loss()) it takes until all of them fail with probability at
  // most `give_up_probability`, within [at_least, kMaxRetransmitAttempts].
  int attempts_for(int messages, double give_up_probability, int at_least) const;

  int backoff() const { return backoff_; }
  const RoundTripEstimator& estimator() const { return estimator_; }

 private:
  RoundTripEstimator estimator_;
  int backoff_ = 0;
  double loss_ = 0.0;
  std::optional<RetransmitClock::time_point> sent_at_;  // the last request, while unanswered
  bool ambiguous_ = false;          // its answer may be another request's
  bool timed_out_unanswered_ = false;  // a wait timed out and no answer came since
};

}  // namespace fedmesh::protocol
