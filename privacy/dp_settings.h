// The differential-privacy settings every role reads (a site's DP-SGD or
// clipped-update noise, the aggregator's DP-FedAvg, a gossip peer's noisy
// shares, `fedmesh train` and `fedmesh sim`), checked in one place. Each
// role names them its own way (config keys or command-line flags): the
// messages use the caller's names.
#pragma once

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

}  // namespace fedmesh::privacy
