// The normalization statistics' messages (StatsReport, StatsMerged in
// protocol/fedmesh.capnp): written from and read into
// train::data::DataStats. A peer's sums are untrusted: decode_feature_sums
// bounds and checks every field. The exchange itself is
// federation/stats_exchange.h.
#pragma once

#include <cstddef>
#include <string>

#include "protocol/fedmesh.capnp.h"
#include "protocol/wire.h"
#include "train/data/data_stats.h"

namespace fedmesh::federation {

inline constexpr size_t kMaxStatsFeatures = 100'000;  // as a table's features

// The sums of a StatsReport or StatsMerged, every field checked: a kind of
// "table" or "images", 1..kMaxStatsFeatures features with names of at most
// protocol::kMaxTextBytes bytes, counts >= 1, finite sums and sums of
// squares >= 0. A flaw is a MALFORMED / NON_FINITE / OUT_OF_RANGE rejection
// naming it.
bool decode_feature_sums(capnp::List<wire::FeatureSum>::Reader features, const std::string& kind,
                         train::data::DataStats& out, protocol::Rejection& rejection);

protocol::OutgoingMessage make_stats_report(const std::string& federation, const train::data::DataStats& stats);
protocol::OutgoingMessage make_stats_merged(const std::string& federation, const train::data::DataStats& merged);
// A StatsMerged of no parts: the aggregator still waits for `waiting`.
protocol::OutgoingMessage make_stats_waiting(const std::string& federation, const std::string& waiting);

}  // namespace fedmesh::federation
