// The differential-privacy settings every role reads (a site's DP-SGD or
// clipped-update noise, the aggregator's DP-FedAvg, a gossip peer's noisy
// shares, `fedmesh train` and `fedmesh sim`), checked in one place. Each
// role names them its own way (config keys or command-line flags): the
// messages use the caller's names.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/status.h"

namespace fedmesh::privacy {

struct DpSettings {
  // The L2 norm the noise is scaled to; absent where the role's clip is
  // another setting (the aggregator's secure_aggregation.clip).
  std::optional<double> clip;
  double noise_multiplier = 0.0;  // sigma; 0: no noise
  double delta = 1e-5;            // the delta epsilon is reported at
  double target_epsilon = 0.0;    // stop before spending more; 0: no target
};

// How a role spells each setting; an empty name means the role has no such
// setting, and its value is not checked.
struct DpSettingNames {
  std::string clip, noise_multiplier, delta, target_epsilon;
};
inline const DpSettingNames kDpConfigKeys{"dp.clip", "dp.noise_multiplier", "dp.delta", "dp.target_epsilon"};
inline const DpSettingNames kDpFlags{"--dp-clip", "--dp-noise", "--dp-delta", "--dp-target-epsilon"};

// kInvalidArgument naming the setting, unless: clip and noise are finite and
// >= 0, noise needs a clip (when the role has one), delta is in (0, 1), and
// a target epsilon is finite, >= 0 and needs noise.
Status check_dp_settings(const DpSettings& settings, const DpSettingNames& names);

// DP-FedAvg's noise against the signal it hides. The mean of k updates, each
// clipped to L2 norm C, moves the model by at most C a round, R C over R
// rounds. The noise on that mean, N(0, (sigma C / k)^2) on each of the d
// parameters, has an L2 norm of about sigma C sqrt(d) / k a round, and its R
// rounds add up (independently) to sigma C sqrt(d R) / k. The noise swamps
// the signal when that exceeds R C, even for updates that all point one way:
//   noise_to_signal = sigma sqrt(d / R) / k > 1,
// that is with fewer than sigma sqrt(d / R) sites a round.
struct DpFedAvgNoiseScale {
  double noise_to_signal = 0.0;  // sigma sqrt(d / R) / k
  int64_t sites_needed = 0;      // the fewest sites a round with noise_to_signal <= 1
  bool swamps() const { return noise_to_signal > 1.0; }
  std::string message() const;   // one line naming the numbers and the rule
  double sigma = 0.0;
  int64_t sites = 0, parameters = 0, rounds = 0;
};
// sigma >= 0, sites, parameters and rounds >= 1.
DpFedAvgNoiseScale dp_fedavg_noise_scale(double sigma, int64_t sites, int64_t parameters, int64_t rounds);

}  // namespace fedmesh::privacy
