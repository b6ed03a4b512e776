// The privacy ledger's entry of a mechanism with a fixed rate (the store's
// PrivacyEntry from privacy::ConstantRateAccounting): one builder for every
// writer of the ledger (DP-SGD in `train`, DP-FedAvg at the aggregator,
// local DP of gossip peers).
#pragma once

#include <cstdint>
#include <string>

#include "privacy/rdp_accountant.h"
#include "store/checkpoint_store.h"

namespace fedmesh::privacy {

// The entry of ledger round `round` after `steps` steps of `accounting`'s mechanism.
store::PrivacyEntry ledger_entry(const ConstantRateAccounting& accounting, std::string mechanism, int64_t round,
                                 int64_t steps);

}  // namespace fedmesh::privacy
