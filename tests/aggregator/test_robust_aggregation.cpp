// Robust aggregation rules against hand-computed values, their resistance to
// one poisoned update, and independence of arrival order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "aggregator/robust_aggregation.h"

namespace fedmesh::aggregator {
namespace {

std::vector<BufferedUpdate> view(const std::vector<std::vector<float>>& values) {
  std::vector<BufferedUpdate> updates;
  for (size_t i = 0; i < values.size(); ++i) updates.push_back({"site-" + std::to_string(i), values[i]});
  return updates;
}

TEST(RobustAggregation, NormBoundingScalesOnlyWhatIsTooLong) {
  std::vector<float> long_one = {3.0f, 4.0f};
  auto norm = bound_norm(long_one, 1.0);
  ASSERT_TRUE(norm.is_ok());
  EXPECT_DOUBLE_EQ(*norm, 5.0);
  EXPECT_FLOAT_EQ(long_one[0], 0.6f);
  EXPECT_FLOAT_EQ(long_one[1], 0.8f);
  std::vector<float> short_one = {0.3f, 0.4f};
  ASSERT_TRUE(bound_norm(short_one, 1.0).is_ok());
  EXPECT_FLOAT_EQ(short_one[0], 0.3f);
  std::vector<float> poisoned = {NAN, 1.0f};
  EXPECT_FALSE(bound_norm(poisoned, 1.0).is_ok()) << "NaN passes every comparison with the bound";
  EXPECT_FALSE(bound_norm(short_one, 0.0).is_ok());
}

TEST(RobustAggregation, MedianAndTrimmedMeanByHand) {
  const std::vector<std::vector<float>> values = {{1, 10}, {2, 20}, {3, 30}, {4, 40}, {100, -1000}};
  std::vector<float> out(2);
  ASSERT_TRUE(coordinate_median(view(values), out).is_ok());
  EXPECT_FLOAT_EQ(out[0], 3.0f);
  EXPECT_FLOAT_EQ(out[1], 20.0f);
  ASSERT_TRUE(trimmed_mean(view(values), 0.2, out).is_ok());  // drop 1 at each end
  EXPECT_FLOAT_EQ(out[0], 3.0f);                               // (2 + 3 + 4) / 3
  EXPECT_FLOAT_EQ(out[1], 20.0f);                              // (10 + 20 + 30) / 3
  ASSERT_TRUE(trimmed_mean(view(values), 0.0, out).is_ok());   // the plain mean
  EXPECT_FLOAT_EQ(out[0], 22.0f);
  const std::vector<std::vector<float>> even = {{1}, {2}, {3}, {10}};
  std::vector<float> one(1);
  ASSERT_TRUE(coordinate_median(view(even), one).is_ok());
  EXPECT_FLOAT_EQ(one[0], 2.5f);
  EXPECT_FALSE(trimmed_mean(view(values), 0.5, out).is_ok());
}

TEST(RobustAggregation, KrumPicksTheUpdateAmongItsNeighboursAndDropsTheOutlier) {
  // Four honest updates near (1, 1) and one far away; f = 1: score = sum of the n - f - 2 = 2 nearest.
  const std::vector<std::vector<float>> values = {
      {1.0f, 1.0f}, {1.1f, 1.0f}, {1.0f, 1.1f}, {0.9f, 1.0f}, {-50.0f, 80.0f}};
  auto chosen = multi_krum_select(view(values), 1, 1);
  ASSERT_TRUE(chosen.is_ok()) << chosen.status().to_string();
  EXPECT_EQ((*chosen)[0], 0u) << "the centre of the honest cluster";
  auto three = multi_krum_select(view(values), 1, 3);
  ASSERT_TRUE(three.is_ok());
  EXPECT_EQ(std::count(three->begin(), three->end(), 4u), 0) << "the outlier is never kept";
  std::vector<float> out(2);
  ASSERT_TRUE(multi_krum(view(values), 1, 4, out).is_ok());
  EXPECT_NEAR(out[0], 1.0f, 1e-6);  // mean of the four honest: (1 + 1.1 + 1 + 0.9) / 4
  EXPECT_NEAR(out[1], 1.025f, 1e-6);
  EXPECT_FALSE(multi_krum_select(view(values), 2, 1).is_ok()) << "n = 5 < 2f + 3 = 7";
  EXPECT_FALSE(multi_krum_select(view(values), 1, 5).is_ok()) << "m > n - f";
}

TEST(RobustAggregation, OnePoisonedSiteMovesTheMeanButNotTheRobustRules) {
  std::mt19937 random(5);
  std::normal_distribution<float> noise(0.0f, 0.01f);
  constexpr int kElements = 200;
  std::vector<std::vector<float>> values(5, std::vector<float>(kElements));
  for (int s = 0; s < 4; ++s) {
    for (float& v : values[s]) v = 0.1f + noise(random);
  }
  for (float& v : values[4]) v = -10.0f;  // a scaled, sign-flipped update
  std::vector<float> mean(kElements), trimmed(kElements), krum(kElements), median(kElements);
  ASSERT_TRUE(trimmed_mean(view(values), 0.0, mean).is_ok());
  ASSERT_TRUE(trimmed_mean(view(values), 0.2, trimmed).is_ok());
  ASSERT_TRUE(multi_krum(view(values), 1, 3, krum).is_ok());
  ASSERT_TRUE(coordinate_median(view(values), median).is_ok());
  for (int i = 0; i < kElements; ++i) {
    EXPECT_LT(mean[i], -1.0f);
    EXPECT_NEAR(trimmed[i], 0.1f, 0.03f);
    EXPECT_NEAR(krum[i], 0.1f, 0.03f);
    EXPECT_NEAR(median[i], 0.1f, 0.03f);
  }
}

TEST(RobustAggregation, ResultsDoNotDependOnArrivalOrder) {
  std::mt19937 random(8);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<std::vector<float>> values(9, std::vector<float>(300));
  for (auto& update : values) {
    for (float& v : update) v = noise(random);
  }
  auto updates = view(values);
  std::vector<float> median_a(300), trimmed_a(300), krum_a(300), median_b(300), trimmed_b(300), krum_b(300);
  ASSERT_TRUE(coordinate_median(updates, median_a).is_ok());
  ASSERT_TRUE(trimmed_mean(updates, 0.25, trimmed_a).is_ok());
  ASSERT_TRUE(multi_krum(updates, 2, 4, krum_a).is_ok());
  std::shuffle(updates.begin(), updates.end(), random);
  ASSERT_TRUE(coordinate_median(updates, median_b).is_ok());
  ASSERT_TRUE(trimmed_mean(updates, 0.25, trimmed_b).is_ok());
  ASSERT_TRUE(multi_krum(updates, 2, 4, krum_b).is_ok());
  EXPECT_EQ(std::memcmp(median_a.data(), median_b.data(), 1200), 0);
  EXPECT_EQ(std::memcmp(trimmed_a.data(), trimmed_b.data(), 1200), 0);
  EXPECT_EQ(std::memcmp(krum_a.data(), krum_b.data(), 1200), 0);
}

TEST(RobustAggregation, BadInputIsRefused) {
  std::vector<float> out(2);
  EXPECT_FALSE(coordinate_median({}, out).is_ok());
  const std::vector<std::vector<float>> ragged = {{1, 2}, {1}};
  EXPECT_FALSE(coordinate_median(view(ragged), out).is_ok());
  const std::vector<std::vector<float>> nan = {{1, 2}, {NAN, 2}};
  EXPECT_FALSE(trimmed_mean(view(nan), 0.1, out).is_ok());
}

}  // namespace
}  // namespace fedmesh::aggregator
