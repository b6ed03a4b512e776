// The aggregator's side of secure aggregation in private mode: one
// SecAggServer session at a time for the open synchronous round, driven by
// the sites' SecAggUp messages (each answered with the session as that site
// sees it, protocol/secagg_wire.h) and by phase deadlines. A phase closes
// when every member has answered or its deadline passes; a session that
// aborts (fewer than t sites left) is followed by a new one, with a new id
// and new keys, for as long as the round is open. A session is never
// resumed: after an aggregator restart the round reopens with a new session.
//
// The aggregator learns only the sum of the survivors' fixed-point inputs;
// nothing here stores or logs an individual input (the masked pieces are
// summed as they complete and dropped).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/random.h"
#include "crypto/dp_noise.h"
#include "crypto/secure_aggregation.h"
#include "protocol/secagg_wire.h"

namespace fedmesh::aggregator {

struct SecureOptions {
  uint32_t threshold = 0;       // t; 0: a strict majority of the sites invited
  double phase_seconds = 30.0;  // a phase closes with whoever answered after this long
  float clip = 1.0f;            // sites clip their update to this L2 norm before masking
  int fraction_bits = 16;       // fixed point: round(v * 2^fraction_bits) in Z_2^32

  // `sites`: the most that can ever add up (the roster's sites): the sum of
  // their fixed-point values must stay within int32.
  Status validate(size_t sites) const;
};

struct SecureResult {
  int64_t round = 0, base_version = 0;
  std::string session;
  std::vector<std::string> contributors;  // U3
  std::vector<uint32_t> sum;              // Σ fixed-point inputs, mod 2^32
  // The mean update: sum decoded from fixed point over the contributors.
  std::vector<float> mean(int fraction_bits) const;
};

// What `site` is shown of `server`'s session now: the phase, whether it is a
// member and has answered, and what the phase asks of a member (the key
// list, its shares until its masked input starts arriving, the survivors,
// the unmasking request). The one view both the aggregator (SecureRound)
// and the simulation (secure_session.h) send.
protocol::SecAggDownMessage secagg_view(const crypto::SecAggServer& server, const std::string& site);

// DP-FedAvg: N(0, (noise_multiplier clip / contributors)^2) added to each
// coordinate of the mean of `contributors` updates clipped to `clip`, as a
// discrete Gaussian on a power-of-two grid of at most 2^-20 clip /
// contributors (crypto/dp_noise.h), drawn from `source`: the aggregator's
// CSPRNG, or a simulation's seeded source (replay, not private).
void add_dp_fedavg_noise(std::span<float> mean, double noise_multiplier, double clip, size_t contributors,
                         crypto::NoiseSource& source);

class SecureRound {
 public:
  using Clock = std::chrono::steady_clock;
  using EventSink = std::function<void(const nlohmann::json&)>;

  SecureRound(SecureOptions options, const crypto::Roster& roster, std::string federation, uint64_t length,
              EventSink emit);

  // A synchronous round opened: its first session invites `sampled`.
  void open(int64_t round, int64_t base_version, std::vector<std::string> sampled, Clock::time_point now);
  // The round closed without a result (its deadline): the session ends.
  void close();
  bool session_running() const { return server_.has_value() && round_open_; }

  // A SecAggUp from `site` (the transport's authenticated name). False with
  // `rejection` for a contribution the session refuses.
  bool handle(const std::string& site, const protocol::SecAggUpMessage& up, std::optional<protocol::OutgoingMessage>& reply,
              protocol::Rejection& rejection);
  // Phase deadlines; returns a finished session's result once.
  std::optional<SecureResult> tick(Clock::time_point now);

 private:
  void start_session(Clock::time_point now);
  protocol::SecAggDownMessage view(const std::string& site) const;
  void after_change(Clock::time_point now);

  SecureOptions options_;
  const crypto::Roster& roster_;
  std::string federation_;
  uint64_t length_ = 0;
  EventSink emit_;
  bool round_open_ = false;
  int64_t round_ = 0, base_version_ = 0;
  std::vector<std::string> sampled_;
  std::optional<crypto::SecAggServer> server_;
  crypto::SecAggPhase announced_ = crypto::SecAggPhase::kAdvertise;
  Clock::time_point phase_deadline_{};
  int64_t sessions_ = 0;
  std::string last_abort_;
};

}  // namespace fedmesh::aggregator
