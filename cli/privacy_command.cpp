#include "cli/privacy_command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "cli/output.h"
#include "store/checkpoint_store.h"

namespace fedmesh::cli {

namespace {

struct PrivacyFlags {
  std::string database;
  bool json = false;
};

int fail(const PrivacyFlags& flags, const Status& status) {
  return report_failure("privacy report", flags.json, status, 2);
}

int run_report(const PrivacyFlags& flags) {
  Result<store::CheckpointStore> store = store::CheckpointStore::open_existing(flags.database);
  if (!store.is_ok()) return fail(flags, store.status());
  Result<std::vector<store::PrivacyEntry>> ledger = store->privacy_ledger();
  if (!ledger.is_ok()) return fail(flags, ledger.status());
  const double epsilon = ledger->empty() ? 0.0 : ledger->back().epsilon;
  const double delta = ledger->empty() ? 0.0 : ledger->back().delta;
  size_t seeded = 0;
  for (const store::PrivacyEntry& e : *ledger) seeded += store::is_seeded_privacy_mechanism(e.mechanism) ? 1 : 0;
  const std::string seeded_note =
      std::to_string(seeded) + " of " + std::to_string(ledger->size()) +
      " rounds drew their noise from a seed for replay (a simulation or --dp-seeded-noise): the epsilon is what the "
      "mechanism would spend with secret noise, not a privacy guarantee";
  if (flags.json) {
    for (const store::PrivacyEntry& e : *ledger) {
      emit_json({{"event", "round"}, {"round", e.round}, {"mechanism", e.mechanism}, {"sampling_rate", e.sampling_rate},
                 {"noise_multiplier", e.noise_multiplier}, {"steps", e.steps}, {"epsilon", e.epsilon},
                 {"delta", e.delta}, {"committed_at", e.wall_time}});
    }
    if (seeded > 0) emit_json({{"event", "warning"}, {"kind", "seeded_noise"}, {"message", seeded_note}});
    emit_json({{"event", "summary"}, {"command", "privacy report"}, {"database", flags.database},
               {"rounds", ledger->size()}, {"epsilon", epsilon}, {"delta", delta}, {"private", !ledger->empty()},
               {"seeded_noise_rounds", seeded}});
    return 0;
  }
  if (ledger->empty()) {
    std::printf("%s: no privacy ledger entries (the run was not differentially private)\n", flags.database.c_str());
    return 0;
  }
  std::printf("%8s  %-16s  %10s  %8s  %8s  %10s  %8s  %s\n", "round", "mechanism", "q", "sigma", "steps", "epsilon",
              "delta", "committed");
  for (const store::PrivacyEntry& e : *ledger) {
    std::printf("%8lld  %-16s  %10.6g  %8.4g  %8lld  %10.4f  %8.2g  %s\n", static_cast<long long>(e.round),
                e.mechanism.c_str(), e.sampling_rate, e.noise_multiplier, static_cast<long long>(e.steps), e.epsilon,
                e.delta, e.wall_time.c_str());
  }
  std::printf("spent: (epsilon %.4f, delta %.2g) over %zu rounds\n", epsilon, delta, ledger->size());
  if (seeded > 0) std::printf("note: %s\n", seeded_note.c_str());
  return 0;
}

}  // namespace

void add_privacy_command(CLI::App& app, int& exit_code) {
  CLI::App* privacy = app.add_subcommand("privacy", "Differential privacy of a run: the budget it has spent");
  privacy->require_subcommand(1);
  auto flags = std::make_shared<PrivacyFlags>();
  CLI::App* report = privacy->add_subcommand(
      "report", "The privacy ledger of a store: per round the mechanism, its sampling rate and noise multiplier, the "
                "steps it took and the (epsilon, delta) spent so far, committed before that round's model was released");
  report->add_option("DB", flags->database, "The store (SQLite) of a run")->required();
  report->add_flag("--json", flags->json, "One JSON line per round, then {\"event\":\"summary\",\"epsilon\",\"delta\",...}");
  report->callback([flags, &exit_code] { exit_code = run_report(*flags); });
}

}  // namespace fedmesh::cli
