// Staleness weights against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>

#include "federation/staleness.h"

namespace fedmesh::federation {
namespace {

StalenessFunction parsed(const char* text, int64_t max_staleness = -1) {
  auto function = StalenessFunction::parse(text, max_staleness);
  EXPECT_TRUE(function.is_ok()) << function.status().to_string();
  return *function;
}

TEST(Staleness, HandComputedValues) {
  EXPECT_EQ(parsed("constant").weight(0), 1.0);
  EXPECT_EQ(parsed("constant").weight(1000), 1.0);

  const StalenessFunction fedbuff = parsed("polynomial:0.5");
  EXPECT_DOUBLE_EQ(fedbuff.weight(0), 1.0);
  EXPECT_DOUBLE_EQ(fedbuff.weight(3), 0.5);  // 1/sqrt(4)
  EXPECT_DOUBLE_EQ(fedbuff.weight(8), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(parsed("polynomial:1").weight(4), 0.2);
  EXPECT_DOUBLE_EQ(parsed("polynomial:2").weight(1), 0.25);

  const StalenessFunction hinge = parsed("hinge:10:4");  // 1 up to 4, then 1/(10(t-4)+1)
  EXPECT_EQ(hinge.weight(0), 1.0);
  EXPECT_EQ(hinge.weight(4), 1.0);
  EXPECT_DOUBLE_EQ(hinge.weight(5), 1.0 / 11.0);
  EXPECT_DOUBLE_EQ(hinge.weight(7), 1.0 / 31.0);

  const StalenessFunction inverse = parsed("inverse");
  EXPECT_EQ(inverse.weight(0), 1.0);
  EXPECT_EQ(inverse.weight(1), 1.0);
  EXPECT_DOUBLE_EQ(inverse.weight(4), 0.25);
}

TEST(Staleness, CutOffAppliesOnTopOfAnyFunction) {
  for (const char* text : {"constant", "polynomial:0.5", "hinge:2:1", "inverse"}) {
    const StalenessFunction f = parsed(text, 5);
    EXPECT_GT(f.weight(5), 0.0) << text;
    EXPECT_EQ(f.weight(6), 0.0) << text;
    EXPECT_EQ(f.weight(1000), 0.0) << text;
  }
  EXPECT_EQ(parsed("constant").weight(-1), 0.0) << "an update from the future weighs nothing";
}

TEST(Staleness, WeightsNeverIncreaseWithStaleness) {
  for (const char* text : {"constant", "polynomial:0.5", "polynomial:3", "hinge:0.5:2", "inverse"}) {
    const StalenessFunction f = parsed(text);
    for (int64_t tau = 0; tau < 200; ++tau) {
      EXPECT_LE(f.weight(tau + 1), f.weight(tau)) << text << " at " << tau;
      EXPECT_GT(f.weight(tau), 0.0);
      EXPECT_LE(f.weight(tau), 1.0);
    }
  }
}

TEST(Staleness, ParseRoundTripsAndRefusesWithTheAcceptedForms) {
  for (const char* text : {"constant", "polynomial:0.5", "hinge:10:4", "inverse"}) {
    EXPECT_EQ(parsed(text).to_string(), text);
  }
  for (const char* bad : {"", "linear", "polynomial", "polynomial:-1", "polynomial:x", "polynomial:99",
                          "hinge:10", "hinge:0:4", "hinge:1:-2", "hinge:1:2:3", "constant:1", "inverse:"}) {
    auto f = StalenessFunction::parse(bad);
    ASSERT_FALSE(f.is_ok()) << bad;
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_NE(StalenessFunction::parse("linear").status().message().find("polynomial:A"), std::string::npos);
}

}  // namespace
}  // namespace fedmesh::federation
