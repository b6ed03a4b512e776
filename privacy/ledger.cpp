#include "privacy/ledger.h"

#include <nlohmann/json.hpp>

namespace fedmesh::privacy {

store::PrivacyEntry ledger_entry(const ConstantRateAccounting& accounting, std::string mechanism, int64_t round,
                                 int64_t steps) {
  store::PrivacyEntry e;
  e.round = round;
  e.mechanism = std::move(mechanism);
  e.sampling_rate = accounting.q;
  e.noise_multiplier = accounting.sigma;
  e.steps = steps;
  e.epsilon = accounting.after(steps).epsilon;
  e.delta = accounting.delta;
  e.rdp_json = nlohmann::json(accounting.rdp(steps)).dump();
  return e;
}

}  // namespace fedmesh::privacy
