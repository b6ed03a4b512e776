// The statistics a site sends through the aggregator are untrusted input:
// decode_feature_sums refuses every malformed field by name, and what
// make_stats_report / make_stats_merged write decodes back exactly. In
// private mode a report names the features only, and the sums travel as
// fixed-point words (federation/stats_fixed_point.h): sites' words added up
// mod 2^32, with masks that cancel, or through a real secure-aggregation
// session in which a site drops, decode to the plain merge of the sites
// whose words are in the sum; words that are not sums are refused by name.
#include <gtest/gtest.h>

#include <capnp/message.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "aggregator/secure_session.h"
#include "base/random.h"
#include "crypto/keys.h"
#include "federation/stats_exchange.h"
#include "federation/stats_fixed_point.h"

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

TEST(StatsExchange, AMaskedReportNamesTheFeaturesOnly) {
  const DataStats sent = two_features();
  std::unique_ptr<protocol::ParsedMessage> parsed;
  protocol::Rejection rejection;
  ASSERT_TRUE(protocol::parse_message(make_stats_report("fed", sent, true).bytes(), protocol::kDefaultMaxMessageBytes,
                                      nullptr, parsed, rejection));
  const auto report = parsed->root().getStatsReport();
  EXPECT_TRUE(report.getMasked());
  for (const auto f : report.getFeatures()) {
    EXPECT_EQ(f.getCount(), 0u) << "no sum leaves a private site in the clear";
    EXPECT_EQ(f.getSum(), 0.0);
    EXPECT_EQ(f.getSumSquares(), 0.0);
  }
  DataStats got;
  ASSERT_TRUE(decode_feature_sums(report.getFeatures(), report.getKind().cStr(), got, rejection, true)) << rejection.reason;
  ASSERT_EQ(got.features.size(), 2u);
  EXPECT_EQ(got.features[1].name, "progression");
  EXPECT_FALSE(decode_feature_sums(report.getFeatures(), report.getKind().cStr(), got, rejection))
      << "read as sums, a names-only report counts nothing";
}

// Three sites' statistics of very different sizes and signs.
std::vector<DataStats> three_sites() {
  std::vector<DataStats> sites(3);
  const double scales[3] = {1e-9, 1.0, 3.7e11};
  for (size_t s = 0; s < 3; ++s) {
    sites[s].kind = "table";
    sites[s].features = {{"tiny", 10 + static_cast<int64_t>(s), -2.5e-8 * scales[0] * (s + 1), 7.3e-16 * (s + 1)},
                         {"signed", 100 * static_cast<int64_t>(s + 1), -123.456 + 50.0 * s, 98765.4321 * (s + 1)},
                         {"wide", 1'000'000, scales[s] * 1e6, scales[s] * scales[s] * 1e6}};
  }
  return sites;
}

void expect_same_statistics(const DataStats& got, const DataStats& want) {
  ASSERT_EQ(got.features.size(), want.features.size());
  EXPECT_EQ(got.kind, want.kind);
  EXPECT_EQ(got.parts, want.parts);
  for (size_t i = 0; i < want.features.size(); ++i) {
    const auto& g = got.features[i];
    const auto& w = want.features[i];
    EXPECT_EQ(g.name, w.name);
    EXPECT_EQ(g.count, w.count) << w.name << ": counts are exact";
    // Each site's value is rounded once to 2^-81; the rest is double rounding.
    EXPECT_NEAR(g.sum, w.sum, 1e-14 * std::fabs(w.sum) + 1e-23) << w.name;
    EXPECT_NEAR(g.sum_squares, w.sum_squares, 1e-14 * std::fabs(w.sum_squares) + 1e-23) << w.name;
  }
}

TEST(StatsFixedPoint, MaskedWordsAddUpToThePlainMerge) {
  const std::vector<DataStats> sites = three_sites();
  std::vector<std::vector<uint32_t>> words;
  for (const DataStats& site : sites) words.push_back(encode_stats_words(site).value());
  ASSERT_EQ(words[0].size(), 3 * kStatsWordsPerFeature);
  // Pairwise masks as secure aggregation adds them: +m at one site, -m at
  // the other, every word wrapping mod 2^32.
  Rng rng(11);
  for (size_t k = 0; k < words[0].size(); ++k) {
    const auto m = static_cast<uint32_t>(rng.next_u64());
    words[0][k] += m;
    words[2][k] -= m;
  }
  std::vector<uint32_t> summed(words[0].size(), 0);
  for (const auto& w : words) {
    for (size_t k = 0; k < w.size(); ++k) summed[k] += w[k];
  }
  const DataStats decoded = decode_stats_words(summed, sites[0], 3).value();
  expect_same_statistics(decoded, train::data::merge_data_stats(sites).value());
  EXPECT_EQ(stats_secagg_label("hospitals"), "hospitals#stats");
}

TEST(StatsFixedPoint, AValueBeyondTheRangeIsRefusedNamingItsFeature) {
  DataStats big = two_features();
  big.features[1].sum_squares = 1e32;
  Result<std::vector<uint32_t>> refused = encode_stats_words(big);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("'progression'"), std::string::npos) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("sum of squares"), std::string::npos) << refused.status().to_string();
  DataStats nan = two_features();
  nan.features[0].sum = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(encode_stats_words(nan).is_ok());
}

TEST(StatsFixedPoint, WordsThatAreNotStatisticsAreRefused) {
  const DataStats schema = two_features();
  std::vector<uint32_t> words = encode_stats_words(schema).value();
  EXPECT_FALSE(decode_stats_words(std::span<const uint32_t>(words).subspan(1), schema, 1).is_ok()) << "length";
  // A count with a fraction (a limb below the point), a count of zero, a
  // negative sum of squares: a site that masked something else.
  std::vector<uint32_t> fraction = words;
  fraction[0] = 1;
  Result<DataStats> r = decode_stats_words(fraction, schema, 1);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("'age'"), std::string::npos) << r.status().to_string();
  EXPECT_NE(r.status().message().find("whole number"), std::string::npos) << r.status().to_string();
  DataStats zero = schema;
  zero.features[1].count = 0;
  EXPECT_FALSE(decode_stats_words(encode_stats_words(zero).value(), schema, 1).is_ok());
  DataStats negative = schema;
  negative.features[0].sum_squares = -4.0;
  r = decode_stats_words(encode_stats_words(negative).value(), schema, 1);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("negative sum of squares"), std::string::npos) << r.status().to_string();
  // Random words never crash the decoder.
  Rng rng(5);
  for (int trial = 0; trial < 1000; ++trial) {
    for (uint32_t& w : words) w = static_cast<uint32_t>(rng.next_u64());
    (void)decode_stats_words(words, schema, 2);
  }
}

// The sums through a real secure-aggregation session (every message encoded
// as on the wire), four sites of which one stops answering before its
// masked input: the aggregator's sum is the plain merge of the three others.
TEST(StatsFixedPoint, ASecureSessionWithADroppedSiteSumsTheSurvivors) {
  std::vector<DataStats> sites = three_sites();
  DataStats fourth = sites[1];
  fourth.features[1].sum = 1e6;  // would show if it were counted
  sites.push_back(fourth);
  crypto::Roster roster;
  roster.federation = stats_secagg_label("f");
  std::vector<crypto::SiteKeys> keys;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(crypto::generate_site_keys("site-" + std::to_string(i)).value());
    roster.sites.push_back({keys.back().identity, crypto::Role::kSite, ""});
  }
  std::vector<aggregator::VirtualSecureSite> virtual_sites;
  for (int i = 0; i < 4; ++i) virtual_sites.push_back({&keys[static_cast<size_t>(i)], encode_stats_words(sites[static_cast<size_t>(i)]).value()});
  crypto::SecAggParams params{roster.federation, 0, "stats-session", 3, virtual_sites[0].input.size()};
  const aggregator::SecureSessionOutcome outcome =
      aggregator::run_secure_session(roster, params, virtual_sites, {{"site-3", crypto::SecAggPhase::kMaskedInput}}).value();
  ASSERT_TRUE(outcome.done) << outcome.reason;
  EXPECT_EQ(outcome.result.contributors, (std::vector<std::string>{"site-0", "site-1", "site-2"}));
  const DataStats decoded =
      decode_stats_words(outcome.result.sum, sites[0], static_cast<int64_t>(outcome.result.contributors.size())).value();
  sites.pop_back();
  expect_same_statistics(decoded, train::data::merge_data_stats(sites).value());
}

}  // namespace
}  // namespace fedmesh::federation
