// The DP settings' one check, as each role spells its settings, and the rule for when
// DP-FedAvg's noise swamps the signal.
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

// sigma sqrt(d / R) / k: above 1 the noise outweighs the most the updates can move the model.
TEST(DpSettings, DpFedAvgNoiseSwampsTheSignalBelowSigmaSqrtDOverRSites) {
  const DpFedAvgNoiseScale few = dp_fedavg_noise_scale(1.0, 4, 535818, 10);
  EXPECT_NEAR(few.noise_to_signal, std::sqrt(53581.8) / 4.0, 1e-9);
  EXPECT_TRUE(few.swamps());
  EXPECT_EQ(few.sites_needed, 232);  // ceil(sqrt(53 581.8)) = ceil(231.48)
  EXPECT_NE(few.message().find("at least 232 sites"), std::string::npos) << few.message();
  EXPECT_FALSE(dp_fedavg_noise_scale(1.0, 232, 535818, 10).swamps());
  EXPECT_FALSE(dp_fedavg_noise_scale(0.01, 4, 535818, 10).swamps());  // 0.58
  EXPECT_TRUE(dp_fedavg_noise_scale(0.01, 4, 535818, 1).swamps());    // one round: 1.83
}

}  // namespace
}  // namespace fedmesh::privacy
