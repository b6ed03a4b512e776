#include "aggregator/site_report.h"

#include <cmath>

namespace fedmesh::aggregator {

SiteReportCheck check_site_report(const SiteReportFields& report, uint64_t current_round, uint64_t current_version) {
  const struct {
    const char* name;
    double value;
  } metrics[] = {{"trainLoss", report.train_loss}, {"localLoss", report.local_loss},
                 {"localAccuracy", report.local_accuracy}, {"localR2", report.local_r2}, {"localMae", report.local_mae}};
  for (const auto& metric : metrics) {
    if (!std::isfinite(metric.value)) {
      return {SiteReportProblem::kNonFinite, std::string("site report: ") + metric.name + " is not finite"};
    }
  }
  auto out_of_range = [](std::string reason) { return SiteReportCheck{SiteReportProblem::kOutOfRange, std::move(reason)}; };
  if (report.local_accuracy < 0.0 || report.local_accuracy > 1.0) {
    return out_of_range("site report: localAccuracy " + std::to_string(report.local_accuracy) + " is outside [0, 1]");
  }
  if (report.regression && (report.local_r2 > 1.0 || report.local_mae < 0.0)) {
    return out_of_range("site report: localR2 " + std::to_string(report.local_r2) + " above 1 or localMae " +
                        std::to_string(report.local_mae) + " below 0");
  }
  if (!report.regression && (report.local_r2 != 0.0 || report.local_mae != 0.0)) {
    return out_of_range("site report: localR2 / localMae given for a classification task");
  }
  auto valid_loss = [](double loss) { return loss >= 0.0 || loss == kUnknownLoss; };
  if (!valid_loss(report.train_loss) || !valid_loss(report.local_loss)) {
    return out_of_range("site report: a loss is negative (trainLoss " + std::to_string(report.train_loss) +
                        ", localLoss " + std::to_string(report.local_loss) + ")");
  }
  if (report.round > current_round) {
    return out_of_range("site report: round " + std::to_string(report.round) + " is ahead of the current round " +
                        std::to_string(current_round));
  }
  if (report.base_version > current_version) {
    return out_of_range("site report: base version " + std::to_string(report.base_version) +
                        " is ahead of the current model version " + std::to_string(current_version));
  }
  return {};
}

}  // namespace fedmesh::aggregator
