// The aggregator's side of the federation's statistics in private mode
// (federation/stats_exchange.h): one SecureRound over every roster site,
// its signatures bound to "<federation>#stats" (stats_secagg_label), at
// round 0, summing the sites' fixed-point words
// (federation/stats_fixed_point.h). Sessions that abort (fewer than the
// threshold left) are followed by new ones, as in a training round; the
// aggregator learns the survivors' sum only.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "aggregator/secure_round.h"
#include "crypto/roster.h"
#include "federation/stats_exchange.h"

namespace fedmesh::aggregator {

class SecureStatsSum : public federation::MaskedStatsSum {
 public:
  // `options`: the aggregator config's [secure_aggregation] (threshold,
  // phase_seconds; clip and fraction_bits do not apply to statistics).
  SecureStatsSum(SecureOptions options, const crypto::Roster& roster, std::string federation,
                 SecureRound::EventSink emit);

  void open(const std::vector<std::string>& sites, uint64_t words) override;
  bool handle(const std::string& site, wire::SecAggUp::Reader up, std::optional<protocol::OutgoingMessage>& reply,
              protocol::Rejection& rejection) override;
  std::optional<Sum> tick() override;

 private:
  SecureOptions options_;
  const crypto::Roster& roster_;
  std::string federation_;
  SecureRound::EventSink emit_;
  std::optional<SecureRound> round_;
};

}  // namespace fedmesh::aggregator
