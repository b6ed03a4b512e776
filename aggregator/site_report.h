// What a SiteReport (a site's local evaluation) must hold before the
// aggregator shows it on /status, the dashboard and in its events:
//   round          not ahead of the aggregator's current round (asynchronous:
//                  its model version), which it announces to every site
//   base_version   not ahead of the aggregator's model version
//   losses         finite and >= 0 (cross-entropy), or -1: not known (a
//                  site whose training loss was not finite sends -1)
//   local_accuracy finite and in [0, 1] (a fraction of examples)
//   regression     local_r2 finite and <= 1, local_mae finite and >= 0
//                  (a regression task's held-out metrics; both 0 otherwise)
// A report that fails is refused (nonFinite or outOfRange) and changes nothing.
#pragma once

#include <cstdint>
#include <string>

namespace fedmesh::aggregator {

inline constexpr double kUnknownLoss = -1.0;

struct SiteReportFields {
  uint64_t round = 0;
  uint64_t base_version = 0;
  double train_loss = 0.0;
  double local_loss = 0.0;
  double local_accuracy = 0.0;
  bool regression = false;
  double local_r2 = 0.0, local_mae = 0.0;
};

enum class SiteReportProblem { kNone, kNonFinite, kOutOfRange };

struct SiteReportCheck {
  SiteReportProblem problem = SiteReportProblem::kNone;
  std::string reason;  // names the field and the bound, when refused
  bool ok() const { return problem == SiteReportProblem::kNone; }
};

SiteReportCheck check_site_report(const SiteReportFields& report, uint64_t current_round, uint64_t current_version);

}  // namespace fedmesh::aggregator
