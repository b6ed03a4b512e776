// A SiteReport is shown only if its values are in their documented ranges
// (aggregator/site_report.h); each refusal names the field. A regression
// task's R² and MAE come with its flag only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "aggregator/site_report.h"

namespace fedmesh::aggregator {
namespace {

SiteReportFields honest() { return {/*round=*/7, /*base_version=*/7, 0.4, 0.5, 0.83}; }

TEST(SiteReport, AnHonestReportPasses) {
  EXPECT_TRUE(check_site_report(honest(), 7, 7).ok());
  SiteReportFields edges = honest();
  edges.local_accuracy = 0.0;
  EXPECT_TRUE(check_site_report(edges, 7, 7).ok());
  edges.local_accuracy = 1.0;
  edges.train_loss = kUnknownLoss;  // what a site whose loss was not finite sends
  EXPECT_TRUE(check_site_report(edges, 7, 7).ok());
  SiteReportFields regression = honest();
  regression.local_accuracy = 0.0;
  regression.regression = true;
  regression.local_r2 = -2.5;  // worse than the mean: R² has no lower bound
  regression.local_mae = 41.0;
  EXPECT_TRUE(check_site_report(regression, 7, 7).ok());
}

TEST(SiteReport, EachOutOfRangeValueIsRefusedNamingIt) {
  struct Case {
    const char* name;
    SiteReportFields report;
    SiteReportProblem problem;
    const char* phrase;
  };
  auto with = [](auto change) {
    SiteReportFields r = honest();
    change(r);
    return r;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const Case cases[] = {
      {"accuracy -5", with([](auto& r) { r.local_accuracy = -5; }), SiteReportProblem::kOutOfRange, "localAccuracy"},
      {"accuracy 1.5", with([](auto& r) { r.local_accuracy = 1.5; }), SiteReportProblem::kOutOfRange, "[0, 1]"},
      {"accuracy NaN", with([&](auto& r) { r.local_accuracy = nan; }), SiteReportProblem::kNonFinite, "localAccuracy"},
      {"loss inf", with([&](auto& r) { r.local_loss = inf; }), SiteReportProblem::kNonFinite, "localLoss"},
      {"loss -3", with([](auto& r) { r.train_loss = -3; }), SiteReportProblem::kOutOfRange, "negative"},
      {"round 2^64-1", with([](auto& r) { r.round = UINT64_MAX; }), SiteReportProblem::kOutOfRange,
       "ahead of the current round"},
      {"next round", with([](auto& r) { r.round = 8; }), SiteReportProblem::kOutOfRange, "ahead of the current round"},
      {"base version ahead", with([](auto& r) { r.base_version = 8; }), SiteReportProblem::kOutOfRange,
       "base version"},
      {"R2 NaN", with([&](auto& r) { r.regression = true; r.local_r2 = nan; }), SiteReportProblem::kNonFinite,
       "localR2"},
      {"MAE inf", with([&](auto& r) { r.regression = true; r.local_mae = inf; }), SiteReportProblem::kNonFinite,
       "localMae"},
      {"R2 above 1", with([](auto& r) { r.regression = true; r.local_r2 = 1.5; }), SiteReportProblem::kOutOfRange,
       "localR2"},
      {"MAE -1", with([](auto& r) { r.regression = true; r.local_mae = -1; }), SiteReportProblem::kOutOfRange,
       "localMae"},
      {"R2 without regression", with([](auto& r) { r.local_r2 = 0.5; }), SiteReportProblem::kOutOfRange,
       "classification"},
  };
  for (const Case& c : cases) {
    const SiteReportCheck checked = check_site_report(c.report, 7, 7);
    EXPECT_EQ(checked.problem, c.problem) << c.name;
    EXPECT_NE(checked.reason.find(c.phrase), std::string::npos) << c.name << ": " << checked.reason;
  }
}

}  // namespace
}  // namespace fedmesh::aggregator
