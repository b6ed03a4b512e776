// The DP settings' one check, as each role spells its settings.
#include "privacy/dp_settings.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace fedmesh::privacy {
namespace {

std::string refusal(const DpSettings& settings, const DpSettingNames& names = kDpConfigKeys) {
  const Status status = check_dp_settings(settings, names);
  EXPECT_FALSE(status.is_ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  return status.message();
}

TEST(DpSettings, TakesOffAndSoundSettings) {
  EXPECT_TRUE(check_dp_settings({0.0, 0.0, 1e-5, 0.0}, kDpConfigKeys).is_ok()) << "DP off";
  EXPECT_TRUE(check_dp_settings({1.0, 1.1, 1e-5, 8.0}, kDpConfigKeys).is_ok());
  EXPECT_TRUE(check_dp_settings({std::nullopt, 0.8, 1e-6, 3.0}, kDpConfigKeys).is_ok()) << "clip elsewhere";
}

TEST(DpSettings, RefusesEachUnsoundSettingByItsName) {
  EXPECT_EQ(refusal({-1.0, 0.0, 1e-5, 0.0}), "dp.clip must be >= 0 (0: off)");
  EXPECT_EQ(refusal({NAN, 0.0, 1e-5, 0.0}), "dp.clip must be >= 0 (0: off)");
  EXPECT_EQ(refusal({1.0, -0.5, 1e-5, 0.0}), "dp.noise_multiplier must be >= 0");
  EXPECT_EQ(refusal({1.0, INFINITY, 1e-5, 0.0}), "dp.noise_multiplier must be >= 0");
  EXPECT_NE(refusal({0.0, 1.0, 1e-5, 0.0}).find("needs dp.clip > 0"), std::string::npos);
  EXPECT_EQ(refusal({1.0, 1.0, 0.0, 0.0}), "dp.delta must be in (0, 1)");
  EXPECT_EQ(refusal({1.0, 1.0, 1.0, 0.0}), "dp.delta must be in (0, 1)");
  EXPECT_EQ(refusal({1.0, 1.0, NAN, 0.0}), "dp.delta must be in (0, 1)");
  EXPECT_EQ(refusal({1.0, 1.0, 1e-5, -2.0}), "dp.target_epsilon must be >= 0 (0: no target)");
  EXPECT_EQ(refusal({1.0, 0.0, 1e-5, 4.0}), "dp.target_epsilon needs dp.noise_multiplier > 0");
  // The same check in a command's spelling.
  EXPECT_EQ(refusal({1.0, 0.0, 1e-5, 4.0}, kDpFlags), "--dp-target-epsilon needs --dp-noise > 0");
  EXPECT_EQ(refusal({1.0, 1.0, 2.0, 0.0}, kDpFlags), "--dp-delta must be in (0, 1)");
}

TEST(DpSettings, LeavesUnnamedSettingsUnchecked) {
  // A role without a target epsilon (the simulator) is not refused for one.
  EXPECT_TRUE(check_dp_settings({std::nullopt, 1.0, 1e-5, -1.0}, {"", "--dp-noise", "--dp-delta", ""}).is_ok());
}

}  // namespace
}  // namespace fedmesh::privacy
