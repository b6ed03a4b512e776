#include "privacy/dp_settings.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

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

DpFedAvgNoiseScale dp_fedavg_noise_scale(double sigma, int64_t sites, int64_t parameters, int64_t rounds) {
  DpFedAvgNoiseScale scale;
  scale.sigma = sigma;
  scale.sites = std::max<int64_t>(sites, 1);
  scale.parameters = std::max<int64_t>(parameters, 1);
  scale.rounds = std::max<int64_t>(rounds, 1);
  const double per_site = sigma * std::sqrt(static_cast<double>(scale.parameters) / static_cast<double>(scale.rounds));
  scale.noise_to_signal = per_site / static_cast<double>(scale.sites);
  scale.sites_needed = static_cast<int64_t>(std::ceil(per_site));
  return scale;
}

std::string DpFedAvgNoiseScale::message() const {
  char line[512];
  std::snprintf(line, sizeof line,
                "DP-FedAvg noise swamps the signal: over %lld rounds the noise on the mean of %lld sites "
                "(sigma %g, %lld parameters) is %.3g times the most the clipped updates can move the model "
                "(sigma sqrt(parameters / rounds) / sites > 1); the model will not learn. Use at least %lld sites a "
                "round, a smaller noise multiplier, or DP-SGD inside each site",
                static_cast<long long>(rounds), static_cast<long long>(sites), sigma,
                static_cast<long long>(parameters), noise_to_signal, static_cast<long long>(sites_needed));
  return line;
}

}  // namespace fedmesh::privacy
