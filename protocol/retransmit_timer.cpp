#include "protocol/retransmit_timer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace fedmesh::protocol {

using std::chrono::microseconds;

void RoundTripEstimator::add_sample(microseconds round_trip) {
  round_trip = std::max(round_trip, microseconds(0));
  if (samples_ == 0) {
    srtt_ = round_trip;
    rttvar_ = round_trip / 2;
  } else {
    const microseconds error = microseconds(std::llabs((srtt_ - round_trip).count()));
    rttvar_ = (3 * rttvar_ + error) / 4;
    srtt_ = (7 * srtt_ + round_trip) / 8;
  }
  ++samples_;
}

microseconds RoundTripEstimator::timeout() const {
  if (samples_ == 0) return std::clamp(options_.initial_timeout, options_.min_timeout, options_.max_timeout);
  const microseconds rto = srtt_ + std::max(options_.granularity, 4 * rttvar_);
  return std::clamp(rto, options_.min_timeout, options_.max_timeout);
}

void RetransmitTimer::sent(RetransmitClock::time_point now, bool retransmission) {
  sent_at_ = now;
  ambiguous_ = retransmission || timed_out_unanswered_;
}

void RetransmitTimer::answered(RetransmitClock::time_point now) {
  if (sent_at_) {
    if (!ambiguous_) estimator_.add_sample(std::chrono::duration_cast<microseconds>(now - *sent_at_));
    loss_ += estimator_.options().loss_gain * (0.0 - loss_);
    sent_at_.reset();
  }
  timed_out_unanswered_ = false;
  backoff_ = 0;
}

void RetransmitTimer::progressed() {
  timed_out_unanswered_ = false;
  backoff_ = 0;
}

void RetransmitTimer::timed_out() {
  loss_ += estimator_.options().loss_gain * (1.0 - loss_);
  timed_out_unanswered_ = true;
  sent_at_.reset();
  if (backoff_ < kMaxBackoffDoublings && timeout() < estimator_.options().max_timeout) ++backoff_;
}

microseconds RetransmitTimer::timeout() const {
  const microseconds cap = estimator_.options().max_timeout;
  microseconds wait = estimator_.timeout();
  for (int i = 0; i < backoff_ && wait < cap; ++i) wait *= 2;
  return std::min(wait, cap);
}

int RetransmitTimer::attempts_for(int messages, double give_up_probability, int at_least) const {
  at_least = std::clamp(at_least, 1, kMaxRetransmitAttempts);
  const double delivered = std::pow(1.0 - std::clamp(loss_, 0.0, 1.0), std::max(1, messages));
  const double attempt_fails = 1.0 - delivered;
  if (attempt_fails <= 0.0) return at_least;
  if (attempt_fails >= 1.0 || give_up_probability <= 0.0) return kMaxRetransmitAttempts;
  const double needed = std::ceil(std::log(give_up_probability) / std::log(attempt_fails));
  if (!(needed < kMaxRetransmitAttempts)) return kMaxRetransmitAttempts;
  return std::max(at_least, static_cast<int>(needed));
}

}  // namespace fedmesh::protocol
