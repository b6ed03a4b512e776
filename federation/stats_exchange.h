// Normalization statistics computed together through the aggregator, before
// a federation trains: each site sends the count, sum and sum of squares of
// every numeric feature (or image channel) over its training part
// (train/data/data_stats.h) to the aggregator's endpoint; once every site on
// the roster has sent its sums, the aggregator adds them up, writes the
// federation's file and sends it back to each site, which writes it too.
// Every node then trains with data.normalize = "stats:FILE". No row leaves a
// site; what does is exactly what `fedmesh stats compute` writes.
//
// The exchange runs over the federation's own transport (CurveZMQ, roster
// keys only, the sender named by its key), as its own short phase:
// `fedmesh stats serve --config agg.toml` binds the aggregator's endpoint
// until the sums are in (then lingers so every site hears back), and
// `fedmesh stats send --config site.toml` dials it. A site's sums are
// untrusted input: decode_feature_sums (federation/stats_wire.h) bounds and
// checks every field, and a
// report whose kind or feature names differ from the others' is refused
// naming both (against the features of the aggregator's own validation data
// when it has some, so a first hostile report cannot set them), as is one
// from a key that is not a site's.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "federation/stats_wire.h"
#include "train/data/data_stats.h"

namespace fedmesh::federation {

// Who a node is in the federation, as its config names it.
struct StatsMembership {
  std::string keys, name, roster, admin_public, federation;
};

struct StatsServeOptions {
  std::string listen;                 // the aggregator's endpoint
  StatsMembership member;             // the aggregator's (as agg.toml has it)
  std::string out;                    // where the federation's statistics are written
  double timeout_seconds = 600.0;     // give up when the sums are not all in by then
  double linger_seconds = 10.0;       // after merging: keep answering sites that ask again
  // The kind and feature names every report must have (from the
  // aggregator's own validation data; its sums are not used). Without it
  // the first report in sets them.
  std::optional<train::data::DataStats> expected;
};

struct StatsSendOptions {
  std::string aggregator;             // the aggregator's endpoint
  std::string aggregator_name;
  StatsMembership member;             // this site's (as site.toml has it)
  std::string out;                    // where the federation's statistics are written
  double timeout_seconds = 600.0;
  double resend_seconds = 1.0;        // how often the sums are sent again until the merged ones come
};

using StatsEventSink = std::function<void(const nlohmann::json&)>;

// Waits for every site on the roster, merges, writes options.out, answers
// each site (and any that asks again while lingering). Events: "listening",
// "stats_report" (site, features), "refused" (site, reason), "merged"
// (parts, digest, out). kUnavailable when the time runs out, naming who has
// not sent.
Result<train::data::DataStats> serve_stats(const StatsServeOptions& options, const StatsEventSink& emit);

// Sends this site's sums until the federation's come back, checks that
// they name the same features, writes options.out. kInvalidArgument with
// the aggregator's reason when it refuses them; kUnavailable on timeout.
Result<train::data::DataStats> send_stats(const StatsSendOptions& options, const train::data::DataStats& mine,
                                          const StatsEventSink& emit);

}  // namespace fedmesh::federation
