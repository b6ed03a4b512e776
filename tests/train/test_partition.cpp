#include "train/data/partition.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace fedmesh::train::data {
namespace {

using Parts = std::vector<std::vector<int64_t>>;

// Label i mod classes: every class the same size, interleaved.
std::vector<uint8_t> cyclic_labels(int64_t samples, int classes) {
  std::vector<uint8_t> labels(static_cast<size_t>(samples));
  for (int64_t i = 0; i < samples; ++i) labels[i] = static_cast<uint8_t>(i % classes);
  return labels;
}

// Labels in ascending runs: the worst case for a partitioner that forgets to
// shuffle, and the layout the shards partitioner sorts into.
std::vector<uint8_t> sorted_labels(int64_t samples, int classes) {
  std::vector<uint8_t> labels(static_cast<size_t>(samples));
  for (int64_t i = 0; i < samples; ++i) labels[i] = static_cast<uint8_t>(i * classes / samples);
  return labels;
}

PartitionSpec spec_of(const std::string& text) {
  Result<PartitionSpec> spec = PartitionSpec::parse(text);
  EXPECT_TRUE(spec.is_ok()) << text << ": " << spec.status().to_string();
  return spec.is_ok() ? *spec : PartitionSpec{};
}

Parts partition_ok(const std::vector<uint8_t>& labels, int classes, int sites, const std::string& spec,
                   uint64_t seed) {
  Result<Parts> parts = partition_indices(labels, classes, sites, spec_of(spec), seed);
  EXPECT_TRUE(parts.is_ok()) << spec << ": " << parts.status().to_string();
  return parts.is_ok() ? *parts : Parts{};
}

// Every index in [0, samples) exactly once, each site ascending and non-empty.
void expect_exact_cover(const Parts& parts, int64_t samples, int sites) {
  ASSERT_EQ(parts.size(), static_cast<size_t>(sites));
  std::vector<int> seen(static_cast<size_t>(samples), 0);
  for (size_t site = 0; site < parts.size(); ++site) {
    EXPECT_FALSE(parts[site].empty()) << "site " << site << " is empty";
    EXPECT_TRUE(std::is_sorted(parts[site].begin(), parts[site].end())) << "site " << site;
    for (const int64_t index : parts[site]) {
      ASSERT_GE(index, 0);
      ASSERT_LT(index, samples);
      ++seen[index];
    }
  }
  for (int64_t i = 0; i < samples; ++i) ASSERT_EQ(seen[i], 1) << "index " << i;
}

int distinct_labels(const std::vector<int64_t>& histogram) {
  return static_cast<int>(std::count_if(histogram.begin(), histogram.end(), [](int64_t n) { return n > 0; }));
}

// Mean over sites of the total variation distance between a site's label
// distribution and the whole set's: 0 for a perfectly iid split, near 1 when
// each site holds labels the others barely have.
double mean_label_skew(const std::vector<uint8_t>& labels, const Parts& parts, int classes) {
  const std::vector<std::vector<int64_t>> histograms = label_histograms(labels, parts, classes);
  std::vector<double> global(static_cast<size_t>(classes), 0.0);
  for (const uint8_t label : labels) global[label] += 1.0 / static_cast<double>(labels.size());
  double total = 0.0;
  for (const std::vector<int64_t>& histogram : histograms) {
    double size = 0.0;
    for (const int64_t count : histogram) size += static_cast<double>(count);
    double distance = 0.0;
    for (int label = 0; label < classes; ++label) {
      distance += std::abs(static_cast<double>(histogram[label]) / size - global[label]);
    }
    total += distance / 2.0;
  }
  return total / static_cast<double>(histograms.size());
}

TEST(PartitionSpecTest, ParsesTheThreeForms) {
  Result<PartitionSpec> iid = PartitionSpec::parse("iid");
  ASSERT_TRUE(iid.is_ok());
  EXPECT_EQ(iid->kind, PartitionSpec::Kind::kIid);
  EXPECT_EQ(iid->to_string(), "iid");

  Result<PartitionSpec> dirichlet = PartitionSpec::parse("dirichlet:0.5");
  ASSERT_TRUE(dirichlet.is_ok());
  EXPECT_EQ(dirichlet->kind, PartitionSpec::Kind::kDirichlet);
  EXPECT_EQ(dirichlet->alpha, 0.5);
  EXPECT_EQ(dirichlet->to_string(), "dirichlet:0.5");

  Result<PartitionSpec> shards = PartitionSpec::parse("shards:2");
  ASSERT_TRUE(shards.is_ok());
  EXPECT_EQ(shards->kind, PartitionSpec::Kind::kShards);
  EXPECT_EQ(shards->shards_per_site, 2);
  EXPECT_EQ(shards->to_string(), "shards:2");

  for (const std::string text : {"dirichlet:0.1", "dirichlet:100", "dirichlet:1e-05", "dirichlet:0.30000000000000004",
                                 "shards:1", "shards:10"}) {
    Result<PartitionSpec> spec = PartitionSpec::parse(text);
    ASSERT_TRUE(spec.is_ok()) << text << ": " << spec.status().to_string();
    EXPECT_EQ(spec->to_string(), text);
    Result<PartitionSpec> again = PartitionSpec::parse(spec->to_string());
    ASSERT_TRUE(again.is_ok());
    EXPECT_EQ(again->alpha, spec->alpha);
    EXPECT_EQ(again->shards_per_site, spec->shards_per_site);
  }
  Result<PartitionSpec> exponent = PartitionSpec::parse("dirichlet:1e-3");
  ASSERT_TRUE(exponent.is_ok());
  EXPECT_EQ(exponent->alpha, 0.001);
}

TEST(PartitionSpecTest, RejectsEverythingElseWithTheAcceptedForms) {
  struct Case {
    std::string text;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {"", "unknown partition ''"},
      {"IID", "unknown partition 'IID'"},
      {"iid:2", "unknown partition 'iid:2'"},
      {"random", "expected iid, dirichlet:A with A > 0 (e.g. dirichlet:0.5) or shards:K with K >= 1"},
      {"dirichlet", "dirichlet concentration must be a finite number > 0"},
      {"dirichlet:", "dirichlet concentration must be a finite number > 0"},
      {"dirichlet:0", "partition 'dirichlet:0': the dirichlet concentration must be a finite number > 0"},
      {"dirichlet:-1", "must be a finite number > 0"},
      {"dirichlet:abc", "must be a finite number > 0"},
      {"dirichlet:0.5x", "must be a finite number > 0"},
      {"dirichlet: 0.5", "must be a finite number > 0"},
      {"dirichlet:inf", "must be a finite number > 0"},
      {"dirichlet:nan", "must be a finite number > 0"},
      {"dirichlet:1e999", "must be a finite number > 0"},
      {"shards", "shards per site must be an integer in [1, 1000000]"},
      {"shards:0", "partition 'shards:0': shards per site must be an integer in [1, 1000000]"},
      {"shards:-2", "shards per site must be an integer"},
      {"shards:2.5", "shards per site must be an integer"},
      {"shards:1000001", "shards per site must be an integer"},
      {"shards:99999999999999", "shards per site must be an integer"},
  };
  for (const Case& c : cases) {
    Result<PartitionSpec> spec = PartitionSpec::parse(c.text);
    ASSERT_FALSE(spec.is_ok()) << "'" << c.text << "' was accepted";
    EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(spec.status().message().find(c.problem), std::string::npos)
        << "'" << c.text << "': missing '" << c.problem << "' in: " << spec.status().message();
  }
}

TEST(PartitionTest, EveryIndexLandsInExactlyOneSite) {
  for (const std::string spec : {"iid", "dirichlet:0.1", "dirichlet:1", "dirichlet:100", "shards:1", "shards:2"}) {
    for (const auto& [samples, sites] : {std::pair<int64_t, int>{1000, 10}, {1003, 7}, {60, 1}, {120, 12}}) {
      SCOPED_TRACE(spec + " with " + std::to_string(samples) + " samples, " + std::to_string(sites) + " sites");
      const std::vector<uint8_t> labels = cyclic_labels(samples, 10);
      expect_exact_cover(partition_ok(labels, 10, sites, spec, 7), samples, sites);
      const std::vector<uint8_t> sorted = sorted_labels(samples, 10);
      expect_exact_cover(partition_ok(sorted, 10, sites, spec, 7), samples, sites);
    }
  }
}

TEST(PartitionTest, DeterministicForASeedAndDifferentAcrossSeeds) {
  const std::vector<uint8_t> labels = cyclic_labels(2000, 10);
  for (const std::string spec : {"iid", "dirichlet:0.5", "shards:2"}) {
    SCOPED_TRACE(spec);
    const Parts first = partition_ok(labels, 10, 8, spec, 42);
    EXPECT_EQ(first, partition_ok(labels, 10, 8, spec, 42));
    EXPECT_NE(first, partition_ok(labels, 10, 8, spec, 43));
  }
}

TEST(PartitionTest, IidSitesDifferByAtMostOneAndMixLabels) {
  const std::vector<uint8_t> labels = sorted_labels(1003, 10);
  const Parts parts = partition_ok(labels, 10, 10, "iid", 1);
  size_t smallest = SIZE_MAX, largest = 0;
  for (const std::vector<int64_t>& part : parts) {
    smallest = std::min(smallest, part.size());
    largest = std::max(largest, part.size());
  }
  EXPECT_EQ(smallest, 100u);
  EXPECT_EQ(largest, 101u);
  // Shuffled before dealing: on label-sorted data every site still sees
  // (nearly) every label.
  for (const std::vector<int64_t>& histogram : label_histograms(labels, parts, 10)) {
    EXPECT_GE(distinct_labels(histogram), 9);
  }
  EXPECT_LT(mean_label_skew(labels, parts, 10), 0.15);
}

TEST(PartitionTest, SmallDirichletAlphaIsMoreSkewedThanLarge) {
  const std::vector<uint8_t> labels = cyclic_labels(10000, 10);
  double skew_small = 0.0, skew_large = 0.0;
  const int seeds = 3;
  for (uint64_t seed = 0; seed < seeds; ++seed) {
    const Parts small = partition_ok(labels, 10, 10, "dirichlet:0.1", seed);
    const Parts large = partition_ok(labels, 10, 10, "dirichlet:100", seed);
    expect_exact_cover(small, 10000, 10);
    expect_exact_cover(large, 10000, 10);
    skew_small += mean_label_skew(labels, small, 10) / seeds;
    skew_large += mean_label_skew(labels, large, 10) / seeds;
  }
  // Dir(0.1) puts most of a class on one or two sites; Dir(100) is close to
  // uniform proportions (expected distance about 0.03).
  EXPECT_GT(skew_small, 0.5);
  EXPECT_LT(skew_large, 0.1);
  EXPECT_GT(skew_small, 5 * skew_large);
}

TEST(PartitionTest, DirichletSitesHoldAtLeastTheMinimum) {
  // Tiny alpha with many sites: each class lands almost whole on one site, so
  // the bounded redraws fail and the fix-up has to fill the short sites.
  for (const auto& [samples, sites, alpha] :
       {std::tuple<int64_t, int, std::string>{1000, 50, "0.001"}, {1000, 50, "0.01"}, {500, 10, "0.1"},
        {40, 20, "0.001"}, {25, 25, "0.01"}, {25, 3, "1e-08"}}) {
    SCOPED_TRACE(std::to_string(samples) + " samples, " + std::to_string(sites) + " sites, alpha " + alpha);
    const std::vector<uint8_t> labels = cyclic_labels(samples, 10);
    const Parts parts = partition_ok(labels, 10, sites, "dirichlet:" + alpha, 3);
    expect_exact_cover(parts, samples, sites);
    const int64_t minimum = std::min<int64_t>(kDirichletMinSiteSamples, samples / sites);
    for (const std::vector<int64_t>& part : parts) EXPECT_GE(static_cast<int64_t>(part.size()), minimum);
  }
}

TEST(PartitionTest, ShardsGiveEachSiteAboutKLabels) {
  // 10 classes of 100, 10 sites with 2 shards of 50: a shard never straddles
  // a class boundary, so each site has at most 2 labels.
  const std::vector<uint8_t> labels = sorted_labels(1000, 10);
  const Parts parts = partition_ok(labels, 10, 10, "shards:2", 5);
  expect_exact_cover(parts, 1000, 10);
  for (const std::vector<int64_t>& part : parts) EXPECT_EQ(part.size(), 100u);
  for (const std::vector<int64_t>& histogram : label_histograms(labels, parts, 10)) {
    EXPECT_GE(distinct_labels(histogram), 1);
    EXPECT_LE(distinct_labels(histogram), 2);
  }

  // Shards that do not align with classes (1003 samples, 21 shards of 47 or
  // 48): a shard spans at most two labels, so a site holds at most 2K.
  const std::vector<uint8_t> uneven = cyclic_labels(1003, 10);
  const Parts uneven_parts = partition_ok(uneven, 10, 7, "shards:3", 5);
  expect_exact_cover(uneven_parts, 1003, 7);
  for (const std::vector<int64_t>& part : uneven_parts) {
    EXPECT_GE(part.size(), 141u);
    EXPECT_LE(part.size(), 144u);
  }
  int total_distinct = 0;
  for (const std::vector<int64_t>& histogram : label_histograms(uneven, uneven_parts, 10)) {
    EXPECT_LE(distinct_labels(histogram), 6);
    total_distinct += distinct_labels(histogram);
  }
  // Far from iid, where every site would hold all 10 labels.
  EXPECT_LE(total_distinct, 7 * 5);
}

TEST(PartitionTest, OneSiteGetsEverything) {
  const std::vector<uint8_t> labels = cyclic_labels(37, 4);
  for (const std::string spec : {"iid", "dirichlet:0.3", "shards:3"}) {
    const Parts parts = partition_ok(labels, 4, 1, spec, 11);
    expect_exact_cover(parts, 37, 1);
  }
}

TEST(PartitionTest, RejectsBadArguments) {
  const std::vector<uint8_t> labels = cyclic_labels(100, 10);
  PartitionSpec iid;
  PartitionSpec dirichlet_zero;
  dirichlet_zero.kind = PartitionSpec::Kind::kDirichlet;
  PartitionSpec dirichlet_negative = dirichlet_zero;
  dirichlet_negative.alpha = -0.5;
  PartitionSpec dirichlet_nan = dirichlet_zero;
  dirichlet_nan.alpha = std::nan("");
  PartitionSpec shards_zero;
  shards_zero.kind = PartitionSpec::Kind::kShards;
  PartitionSpec shards_six = shards_zero;
  shards_six.shards_per_site = 6;
  std::vector<uint8_t> bad_label = labels;
  bad_label[42] = 10;

  struct Case {
    std::vector<uint8_t> labels;
    int classes;
    int sites;
    PartitionSpec spec;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {labels, 10, 0, iid, "sites must be at least 1, got 0"},
      {labels, 10, -3, iid, "sites must be at least 1, got -3"},
      {labels, 10, 101, iid, "cannot split 100 samples among 101 sites"},
      {{}, 10, 1, iid, "cannot split 0 samples among 1 sites"},
      {labels, 10, 4, dirichlet_zero, "dirichlet concentration must be a finite number > 0, got 0"},
      {labels, 10, 4, dirichlet_negative, "dirichlet concentration must be a finite number > 0, got -0.5"},
      {labels, 10, 4, dirichlet_nan, "dirichlet concentration must be a finite number > 0"},
      {labels, 10, 4, shards_zero, "shards per site must be at least 1, got 0"},
      {labels, 10, 17, shards_six, "shards:6 with 17 sites needs 102 shards but there are only 100 samples"},
      {bad_label, 10, 4, iid, "label 10 at index 42 is not below 10 classes"},
      {labels, 5, 4, iid, "label 5 at index 5 is not below 5 classes"},
      {labels, 0, 4, iid, "num_classes 0 is outside [1, 256]"},
      {labels, 300, 4, iid, "num_classes 300 is outside [1, 256]"},
  };
  for (const Case& c : cases) {
    Result<Parts> parts = partition_indices(c.labels, c.classes, c.sites, c.spec, 1);
    ASSERT_FALSE(parts.is_ok()) << "accepted, expected: " << c.problem;
    EXPECT_EQ(parts.status().code(), StatusCode::kInvalidArgument) << c.problem;
    EXPECT_NE(parts.status().message().find(c.problem), std::string::npos)
        << "missing '" << c.problem << "' in: " << parts.status().message();
  }
  // The edges of the valid range are accepted.
  Result<Parts> one_each = partition_indices(labels, 10, 100, iid, 1);
  ASSERT_TRUE(one_each.is_ok());
  expect_exact_cover(*one_each, 100, 100);
  shards_six.shards_per_site = 5;
  Result<Parts> one_per_shard = partition_indices(labels, 10, 20, shards_six, 1);
  ASSERT_TRUE(one_per_shard.is_ok());
  expect_exact_cover(*one_per_shard, 100, 20);
}

TEST(PartitionTest, LabelHistogramsCountEachSite) {
  const std::vector<uint8_t> labels = {0, 1, 2, 2, 1, 0, 2};
  const Parts parts = {{0, 2, 3}, {1, 4}, {5, 6}};
  const std::vector<std::vector<int64_t>> histograms = label_histograms(labels, parts, 3);
  const std::vector<std::vector<int64_t>> expected = {{1, 0, 2}, {0, 2, 0}, {1, 0, 1}};
  EXPECT_EQ(histograms, expected);

  EXPECT_EQ(format_label_histograms(histograms),
            "site  samples | 0 1 2\n"
            "   0        3 | 1 0 2\n"
            "   1        2 | 0 2 0\n"
            "   2        2 | 1 0 1\n");
}

TEST(PartitionTest, FormattedTableWidensForLargeCounts) {
  const std::vector<uint8_t> labels = cyclic_labels(60000, 10);
  const Parts parts = partition_ok(labels, 10, 3, "shards:1", 0);
  const std::string table = format_label_histograms(label_histograms(labels, parts, 10));
  // A header and one row per site, all the same width.
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t end = table.find('\n'); end != std::string::npos; end = table.find('\n', start)) {
    lines.push_back(table.substr(start, end - start));
    start = end + 1;
  }
  ASSERT_EQ(lines.size(), 4u);
  for (const std::string& line : lines) EXPECT_EQ(line.size(), lines[0].size()) << table;
  EXPECT_EQ(lines[0].rfind("site  samples |", 0), 0u) << table;
  EXPECT_NE(lines[1].find("20000 |"), std::string::npos) << table;
}

}  // namespace
}  // namespace fedmesh::train::data
