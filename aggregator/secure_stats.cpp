#include "aggregator/secure_stats.h"

#include "federation/stats_fixed_point.h"
#include "protocol/secagg_wire.h"

namespace fedmesh::aggregator {

SecureStatsSum::SecureStatsSum(SecureOptions options, const crypto::Roster& roster, std::string federation,
                               SecureRound::EventSink emit)
    : options_(options), roster_(roster), federation_(std::move(federation)), emit_(std::move(emit)) {}

void SecureStatsSum::open(const std::vector<std::string>& sites, uint64_t words) {
  round_.emplace(options_, roster_, federation::stats_secagg_label(federation_), words, emit_);
  round_->open(0, 0, sites, SecureRound::Clock::now());
}

bool SecureStatsSum::handle(const std::string& site, wire::SecAggUp::Reader up,
                            std::optional<protocol::OutgoingMessage>& reply, protocol::Rejection& rejection) {
  if (!round_) {
    rejection = {wire::RejectCode::MALFORMED, "no secure-aggregation session is open yet"};
    return false;
  }
  protocol::SecAggUpMessage message;  // every field checked (protocol/secagg_wire.h)
  if (!protocol::decode_secagg_up(up, message, rejection)) return false;
  return round_->handle(site, message, reply, rejection);
}

std::optional<federation::MaskedStatsSum::Sum> SecureStatsSum::tick() {
  if (!round_) return std::nullopt;
  std::optional<SecureResult> result = round_->tick(SecureRound::Clock::now());
  if (!result) return std::nullopt;
  return Sum{std::move(result->contributors), std::move(result->sum)};
}

}  // namespace fedmesh::aggregator
