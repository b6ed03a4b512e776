#include "aggregator/site_state.h"

namespace fedmesh::aggregator {

SiteState classify_site(const SiteFacts& facts, double site_timeout_seconds) {
  if (!facts.on_roster) return SiteState::kRevoked;
  if (facts.seconds_since_contact < 0.0 || facts.seconds_since_contact >= site_timeout_seconds) {
    return SiteState::kDropped;
  }
  if (facts.missed_last_round) return SiteState::kLate;
  if (facts.asynchronous) return SiteState::kTraining;
  if (facts.sampled_in_open_round && !facts.delivered_this_round) return SiteState::kTraining;
  return SiteState::kConnected;
}

const char* site_state_name(SiteState state) {
  switch (state) {
    case SiteState::kConnected: return "connected";
    case SiteState::kTraining: return "training";
    case SiteState::kLate: return "late";
    case SiteState::kDropped: return "dropped";
    case SiteState::kRevoked: return "revoked";
  }
  return "unknown";
}

}  // namespace fedmesh::aggregator
