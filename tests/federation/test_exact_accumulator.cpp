// The exact accumulator: the same updates in any order give bit-identical
// sums; the mean matches a double-precision reference; bounds and bad input
// are refused without touching the sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "federation/exact_accumulator.h"

namespace fedmesh::federation {
namespace {

TEST(ExactAccumulator, ShuffledOrdersGiveBitIdenticalAggregates) {
  std::mt19937_64 random(9);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::uniform_real_distribution<double> uniform(0.01, 1.0);
  constexpr int kUpdates = 40, kElements = 1000;
  std::vector<std::vector<float>> updates(kUpdates, std::vector<float>(kElements));
  std::vector<double> weights(kUpdates);
  for (int u = 0; u < kUpdates; ++u) {
    for (float& v : updates[u]) v = normal(random) * (u == 7 ? 1000.0f : 1.0f);  // one loud site
    weights[u] = uniform(random);
  }
  std::vector<int> order(kUpdates);
  std::iota(order.begin(), order.end(), 0);
  std::vector<int64_t> first_raw;
  std::vector<float> first_mean(kElements);
  bool float_sums_differ = false;
  std::vector<float> first_float(kElements);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(order.begin(), order.end(), random);
    ExactAccumulator accumulator(kElements);
    std::vector<float> naive(kElements, 0.0f);  // what a float sum would give, for contrast
    for (int u : order) {
      ASSERT_TRUE(accumulator.add(updates[u], weights[u]).is_ok());
      for (int i = 0; i < kElements; ++i) naive[i] += static_cast<float>(weights[u]) * updates[u][i];
    }
    std::vector<float> mean(kElements);
    accumulator.mean(mean);
    if (trial == 0) {
      first_raw.assign(accumulator.raw().begin(), accumulator.raw().end());
      first_mean = mean;
      first_float = naive;
      continue;
    }
    EXPECT_TRUE(std::equal(first_raw.begin(), first_raw.end(), accumulator.raw().begin())) << "trial " << trial;
    EXPECT_EQ(std::memcmp(first_mean.data(), mean.data(), sizeof(float) * kElements), 0) << "trial " << trial;
    float_sums_differ |= std::memcmp(first_float.data(), naive.data(), sizeof(float) * kElements) != 0;
  }
  EXPECT_TRUE(float_sums_differ) << "the contrast: a float sum does depend on the order";
}

TEST(ExactAccumulator, MeanMatchesADoubleReference) {
  ExactAccumulator accumulator(3);
  ASSERT_TRUE(accumulator.add(std::vector<float>{1.0f, -2.0f, 0.25f}, 0.5).is_ok());
  ASSERT_TRUE(accumulator.add(std::vector<float>{3.0f, 4.0f, -0.75f}, 0.25).is_ok());
  std::vector<float> mean(3), sum(3);
  accumulator.mean(mean);
  accumulator.sum(sum);
  EXPECT_FLOAT_EQ(mean[0], (0.5f * 1.0f + 0.25f * 3.0f) / 0.75f);
  EXPECT_FLOAT_EQ(mean[1], (0.5f * -2.0f + 0.25f * 4.0f) / 0.75f);
  EXPECT_FLOAT_EQ(mean[2], (0.5f * 0.25f + 0.25f * -0.75f) / 0.75f);
  EXPECT_FLOAT_EQ(sum[0], 1.25f);
  EXPECT_DOUBLE_EQ(accumulator.total_weight(), 0.75);
  EXPECT_EQ(accumulator.updates(), 2);
}

TEST(ExactAccumulator, RefusesWhatItCannotSumExactlyAndChangesNothing) {
  ExactAccumulator accumulator(2);
  ASSERT_TRUE(accumulator.add(std::vector<float>{1.0f, 1.0f}, 1.0).is_ok());
  const std::vector<int64_t> before(accumulator.raw().begin(), accumulator.raw().end());
  EXPECT_FALSE(accumulator.add(std::vector<float>{NAN, 1.0f}, 1.0).is_ok());
  EXPECT_FALSE(accumulator.add(std::vector<float>{1.0f, INFINITY}, 1.0).is_ok());
  EXPECT_FALSE(accumulator.add(std::vector<float>{1.0f}, 1.0).is_ok());
  EXPECT_FALSE(accumulator.add(std::vector<float>{1.0f, 1.0f}, 1.5).is_ok());
  EXPECT_FALSE(accumulator.add(std::vector<float>{1.0f, 1.0f}, -0.1).is_ok());
  EXPECT_FALSE(accumulator.add(std::vector<float>{5e6f, 0.0f}, 1.0).is_ok()) << "a term beyond 2^22";
  EXPECT_TRUE(std::equal(before.begin(), before.end(), accumulator.raw().begin()));
  EXPECT_EQ(accumulator.updates(), 1);
  // Filling it up: the bound on the sum of the largest terms is enforced before anything overflows.
  int accepted = 0;
  Status last;
  while ((last = accumulator.add(std::vector<float>{4e6f, -4e6f}, 1.0)).is_ok()) ++accepted;
  EXPECT_EQ(accepted, 2);
  EXPECT_NE(last.message().find("full"), std::string::npos) << last.message();
  std::vector<float> sum(2);
  accumulator.sum(sum);
  EXPECT_FLOAT_EQ(sum[0], 1.0f + 8e6f);
  EXPECT_FLOAT_EQ(sum[1], 1.0f - 8e6f);
}

TEST(ExactAccumulator, AnUpdateInPiecesIsTheUpdateLaidEndToEnd) {
  std::mt19937_64 random(3);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  // Pieces of uneven sizes, one larger than a parallel grain.
  const std::vector<size_t> sizes = {3, 70000, 1, 129};
  size_t total = 0;
  for (size_t n : sizes) total += n;
  ExactAccumulator whole(static_cast<int64_t>(total)), pieces(static_cast<int64_t>(total));
  for (int u = 0; u < 3; ++u) {
    std::vector<std::vector<float>> parts;
    std::vector<float> flat;
    for (size_t n : sizes) {
      parts.emplace_back(n);
      for (float& v : parts.back()) v = normal(random);
      flat.insert(flat.end(), parts.back().begin(), parts.back().end());
    }
    const std::vector<std::span<const float>> views(parts.begin(), parts.end());
    ASSERT_TRUE(whole.add(flat, 0.25 + 0.25 * u).is_ok());
    ASSERT_TRUE(pieces.add(views, 0.25 + 0.25 * u).is_ok());
  }
  EXPECT_TRUE(std::equal(whole.raw().begin(), whole.raw().end(), pieces.raw().begin()));
  EXPECT_EQ(whole.total_weight(), pieces.total_weight());
  // A piece that is not finite refuses the whole update and names its place.
  std::vector<float> good(sizes[0], 1.0f), bad(sizes[1], 0.0f), rest(sizes[2] + sizes[3], 0.0f);
  bad[5] = NAN;
  const std::vector<int64_t> before(pieces.raw().begin(), pieces.raw().end());
  const std::span<const float> refused[] = {good, bad, rest};
  const Status status = pieces.add(refused, 1.0);
  EXPECT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("value 8 "), std::string::npos) << status.message();
  EXPECT_TRUE(std::equal(before.begin(), before.end(), pieces.raw().begin()));
  const std::span<const float> short_by_one[] = {good, bad};
  EXPECT_FALSE(pieces.add(short_by_one, 1.0).is_ok());
  // A range of the sum is that range of the whole sum.
  std::vector<float> all(total), range(sizes[1]);
  pieces.sum(all);
  pieces.sum(static_cast<int64_t>(sizes[0]), range);
  EXPECT_TRUE(std::equal(range.begin(), range.end(), all.begin() + static_cast<std::ptrdiff_t>(sizes[0])));
}

}  // namespace
}  // namespace fedmesh::federation
