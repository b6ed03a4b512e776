#include "privacy/dp_settings.h"

#include <cmath>

namespace fedmesh::privacy {

Status check_dp_settings(const DpSettings& settings, const DpSettingNames& names) {
  if (settings.clip && !names.clip.empty() && !(*settings.clip >= 0.0 && std::isfinite(*settings.clip))) {
    return invalid_argument(names.clip + " must be >= 0 (0: off)");
  }
  if (!(settings.noise_multiplier >= 0.0 && std::isfinite(settings.noise_multiplier))) {
    return invalid_argument(names.noise_multiplier + " must be >= 0");
  }
  if (settings.clip && !names.clip.empty() && settings.noise_multiplier > 0.0 && *settings.clip <= 0.0) {
    return invalid_argument(names.noise_multiplier + " needs " + names.clip +
                            " > 0: the noise is scaled to the clipping norm");
  }
  if (!names.delta.empty() && !(settings.delta > 0.0 && settings.delta < 1.0)) {
    return invalid_argument(names.delta + " must be in (0, 1)");
  }
  if (!names.target_epsilon.empty()) {
    if (!(settings.target_epsilon >= 0.0 && std::isfinite(settings.target_epsilon))) {
      return invalid_argument(names.target_epsilon + " must be >= 0 (0: no target)");
    }
    if (settings.target_epsilon > 0.0 && settings.noise_multiplier <= 0.0) {
      return invalid_argument(names.target_epsilon + " needs " + names.noise_multiplier + " > 0");
    }
  }
  return Status::ok();
}

}  // namespace fedmesh::privacy
