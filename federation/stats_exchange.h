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
//
// In private mode (privacy.mode = "private" on both sides) no site's sums
// leave it in the clear: each site first names its features (a masked
// StatsReport: kind and names, no sums); once every roster site has named
// the same ones the aggregator opens a secure-aggregation session over them
// (MaskedStatsSum, aggregator/secure_stats.h) and each site takes part with
// its sums as fixed-point words (federation/stats_fixed_point.h) through
// node/secure_upload.h's secure_upload_words. The aggregator learns only
// the survivors' sum: the statistics `stats merge` would have written, each
// value rounded to 2^-81 at its site. A sum from fewer than every site (some dropped during
// the session, at least the session's threshold in it) counts those sites
// only, and says so in `parts`.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "crypto/roster.h"
#include "protocol/transport.h"
#include "federation/stats_wire.h"
#include "train/data/data_stats.h"

namespace fedmesh::federation {

// Who a node is in the federation, as its config names it.
struct StatsMembership {
  std::string keys, name, roster, admin_public, federation;
};

// Private mode, the aggregator's side: the secure-aggregation session that
// adds up the sites' masked sums. serve_stats opens it once every roster
// site has named the same features, hands it each SecAggUp, and ticks it
// until the sum is in.
class MaskedStatsSum {
 public:
  struct Sum {
    std::vector<std::string> contributors;  // whose words are in it
    std::vector<uint32_t> words;            // their sum, mod 2^32
  };
  virtual ~MaskedStatsSum() = default;
  virtual void open(const std::vector<std::string>& sites, uint64_t words) = 0;
  // A SecAggUp from `site` (the transport's authenticated name): the reply,
  // or false with `rejection`.
  virtual bool handle(const std::string& site, wire::SecAggUp::Reader up, std::optional<protocol::OutgoingMessage>& reply,
                      protocol::Rejection& rejection) = 0;
  // Phase deadlines; the finished sum, once.
  virtual std::optional<Sum> tick() = 0;
};

// Private mode, a site's side: take part in the aggregator's session with
// `words` over `socket` (the one the exchange holds). True when they are in
// the sum, false when the session finished without them.
using MaskedStatsContribution = std::function<Result<bool>(protocol::ClientChannel& socket,
                                                           const crypto::Membership& member,
                                                           std::span<const uint32_t> words)>;

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
  // Set: private mode, the sums are taken masked only.
  MaskedStatsSum* masked = nullptr;
};

struct StatsSendOptions {
  std::string aggregator;             // the aggregator's endpoint
  std::string aggregator_name;
  StatsMembership member;             // this site's (as site.toml has it)
  std::string out;                    // where the federation's statistics are written
  double timeout_seconds = 600.0;
  double resend_seconds = 1.0;        // how often the sums are sent again until the merged ones come
  // Set: private mode, the sums leave this site masked only.
  MaskedStatsContribution masked;
};

using StatsEventSink = std::function<void(const nlohmann::json&)>;

// Waits for every site on the roster, merges, writes options.out, answers
// each site (and any that asks again while lingering). Events: "listening",
// "stats_report" (site, features, masked), "refused" (site, reason),
// "masked_sum" (contributors; private mode), "merged" (parts, digest, out). kUnavailable when the time runs out, naming who has
// not sent.
Result<train::data::DataStats> serve_stats(const StatsServeOptions& options, const StatsEventSink& emit);

// Sends this site's sums until the federation's come back, checks that
// they name the same features, writes options.out. kInvalidArgument with
// the aggregator's reason when it refuses them; kUnavailable on timeout.
Result<train::data::DataStats> send_stats(const StatsSendOptions& options, const train::data::DataStats& mine,
                                          const StatsEventSink& emit);

}  // namespace fedmesh::federation
