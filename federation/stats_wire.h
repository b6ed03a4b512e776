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
// naming it. `names_only` (a masked report): the kind and names are checked,
// the sums are not read (they are left 0).
bool decode_feature_sums(capnp::List<wire::FeatureSum>::Reader features, const std::string& kind,
                         train::data::DataStats& out, protocol::Rejection& rejection, bool names_only = false);

// `masked`: the kind and feature names only (private mode: the sums travel
// through secure aggregation, federation/stats_fixed_point.h).
protocol::OutgoingMessage make_stats_report(const std::string& federation, const train::data::DataStats& stats,
                                            bool masked = false);
protocol::OutgoingMessage make_stats_merged(const std::string& federation, const train::data::DataStats& merged);
// A StatsMerged of no parts: the aggregator still waits for `waiting`.
protocol::OutgoingMessage make_stats_waiting(const std::string& federation, const std::string& waiting);
// A StatsMerged of no parts in private mode: every site has named its
// features, the secure-aggregation session over them is open; join it.
protocol::OutgoingMessage make_stats_join(const std::string& federation);

}  // namespace fedmesh::federation
