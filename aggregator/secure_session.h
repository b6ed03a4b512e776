// One secure-aggregation session run in one process between honest virtual
// sites (crypto::SecAggClient) and the aggregator's crypto::SecAggServer,
// every message encoded as on the wire (protocol/secagg_wire.h) so that its
// bytes are counted: what `fedmesh sim --mode private` does each round.
// Sites listed in `dropped_at` stop answering from that phase on.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "aggregator/secure_round.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "crypto/secure_aggregation.h"

namespace fedmesh::aggregator {

struct VirtualSecureSite {
  const crypto::SiteKeys* keys = nullptr;
  std::vector<uint32_t> input;  // fixed point (crypto::quantize_clipped)
};

struct SecureSessionOutcome {
  bool done = false;            // false: aborted (reason)
  std::string reason;
  SecureResult result;          // done: the contributors and their sum
  uint64_t bytes_up = 0;        // every SecAggUp, framed as on a CurveZMQ connection
  uint64_t bytes_down = 0;      // every SecAggDown
};

Result<SecureSessionOutcome> run_secure_session(const crypto::Roster& roster, const crypto::SecAggParams& params,
                                                std::vector<VirtualSecureSite> sites,
                                                const std::map<std::string, crypto::SecAggPhase>& dropped_at = {});

}  // namespace fedmesh::aggregator
