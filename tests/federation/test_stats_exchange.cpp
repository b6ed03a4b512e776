// The statistics a site sends through the aggregator are untrusted input:
// decode_feature_sums refuses every malformed field by name, and what
// make_stats_report / make_stats_merged write decodes back exactly.
#include <gtest/gtest.h>

#include <capnp/message.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "federation/stats_exchange.h"

namespace fedmesh::federation {
namespace {

using train::data::DataStats;

DataStats two_features() {
  DataStats stats;
  stats.kind = "table";
  stats.features = {{"age", 118, 5034.0, 228000.5}, {"progression", 118, 17000.0, 2900000.0}};
  return stats;
}

// The sums as a parsed message (serialized, then parsed under the wire's limits).
bool round_trip(const protocol::OutgoingMessage& message, DataStats& out, protocol::Rejection& rejection,
                uint32_t* parts = nullptr) {
  std::unique_ptr<protocol::ParsedMessage> parsed;
  if (!protocol::parse_message(message.bytes(), protocol::kDefaultMaxMessageBytes, nullptr, parsed, rejection)) {
    return false;
  }
  const auto root = parsed->root();
  if (root.which() == wire::Message::STATS_REPORT) {
    return decode_feature_sums(root.getStatsReport().getFeatures(), root.getStatsReport().getKind().cStr(), out,
                               rejection);
  }
  if (parts != nullptr) *parts = root.getStatsMerged().getParts();
  return decode_feature_sums(root.getStatsMerged().getFeatures(), root.getStatsMerged().getKind().cStr(), out,
                             rejection);
}

TEST(StatsExchange, ReportsAndMergedSumsRoundTrip) {
  const DataStats sent = two_features();
  DataStats got;
  protocol::Rejection rejection;
  ASSERT_TRUE(round_trip(make_stats_report("fed", sent), got, rejection)) << rejection.reason;
  EXPECT_EQ(got.kind, "table");
  ASSERT_EQ(got.features.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got.features[i].name, sent.features[i].name);
    EXPECT_EQ(got.features[i].count, sent.features[i].count);
    EXPECT_EQ(got.features[i].sum, sent.features[i].sum);
    EXPECT_EQ(got.features[i].sum_squares, sent.features[i].sum_squares);
  }
  EXPECT_EQ(got.digest(), sent.digest()) << "the same sums, the same digest at every node";
  DataStats merged = sent;
  merged.parts = 3;
  uint32_t parts = 0;
  ASSERT_TRUE(round_trip(make_stats_merged("fed", merged), got, rejection, &parts)) << rejection.reason;
  EXPECT_EQ(parts, 3u);
}

TEST(StatsExchange, EveryMalformedFieldIsRefusedByName) {
  const auto refused = [](const DataStats& stats, wire::RejectCode code, const std::string& says) {
    DataStats got;
    protocol::Rejection rejection;
    EXPECT_FALSE(round_trip(make_stats_report("fed", stats), got, rejection)) << says;
    EXPECT_EQ(rejection.code, code) << rejection.reason;
    EXPECT_NE(rejection.reason.find(says), std::string::npos) << rejection.reason;
  };
  DataStats kind = two_features();
  kind.kind = "audio";
  refused(kind, wire::RejectCode::MALFORMED, "kind");
  DataStats none = two_features();
  none.features.clear();
  refused(none, wire::RejectCode::MALFORMED, "0 features");
  DataStats zero = two_features();
  zero.features[1].count = 0;
  refused(zero, wire::RejectCode::OUT_OF_RANGE, "feature 2 counts 0");
  DataStats nan = two_features();
  nan.features[0].sum = std::numeric_limits<double>::quiet_NaN();
  refused(nan, wire::RejectCode::NON_FINITE, "feature 1");
  DataStats inf = two_features();
  inf.features[1].sum_squares = std::numeric_limits<double>::infinity();
  refused(inf, wire::RejectCode::NON_FINITE, "feature 2");
  DataStats negative = two_features();
  negative.features[0].sum_squares = -1.0;
  refused(negative, wire::RejectCode::OUT_OF_RANGE, "negative sum of squares");
  DataStats long_name = two_features();
  long_name.features[0].name = std::string(5000, 'x');
  refused(long_name, wire::RejectCode::MALFORMED, "name is over");
}

}  // namespace
}  // namespace fedmesh::federation
