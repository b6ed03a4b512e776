#include "cli/status_command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "base/http_endpoint.h"
#include "cli/output.h"

namespace fedmesh::cli {

namespace {

struct StatusFlags {
  std::string aggregator;
  std::string token;
  bool json = false;
};

int run_status(const StatusFlags& flags) {
  Result<std::string> body = http_get(flags.aggregator, "/status", 5, flags.token);
  nlohmann::json status;
  if (body.is_ok()) {
    status = nlohmann::json::parse(*body, nullptr, false);
    if (status.is_discarded() || !status.is_object()) {
      body = Status(StatusCode::kCorrupt, "http://" + flags.aggregator + "/status did not answer a JSON object");
    }
  }
  if (!body.is_ok()) {
    if (flags.json) {
      emit_json({{"event", "error"}, {"command", "status"}, {"code", status_code_name(body.status().code())},
                 {"message", body.status().message()}});
    }
    std::fprintf(stderr, "fedmesh status: %s\n", body.status().message().c_str());
    return 1;
  }
  if (flags.json) {
    emit_json(status);
    return 0;
  }
  std::printf("federation %s (%s rounds): round %lld, model version %lld%s%s\n",
              status.value("federation", "?").c_str(), status.value("mode", "?").c_str(),
              static_cast<long long>(status.value("round", 0)), static_cast<long long>(status.value("version", 0)),
              status.value("round_open", false) ? ", round open" : "", status.value("finished", false) ? ", finished" : "");
  if (status.contains("test_accuracy")) {
    std::printf("global test accuracy %.2f%%\n", 100.0 * status["test_accuracy"].get<double>());
  }
  std::printf("%-20s %-10s %-14s %9s %8s %10s\n", "site", "state", "last contact", "accepted", "refused",
              "local acc");
  for (const auto& site : status.value("sites", nlohmann::json::array())) {
    const double ago = site.value("last_contact_seconds", -1.0);
    const std::string state = site.value("state", site.value("connected", false) ? "connected" : "dropped");
    std::printf("%-20s %-10s %-14s %9lld %8lld %9.2f%%\n", site.value("site", "?").c_str(), state.c_str(),
                ago < 0 ? "never" : (format_duration(ago) + " ago").c_str(),
                static_cast<long long>(site.value("accepted", 0)), static_cast<long long>(site.value("refused", 0)),
                100.0 * site.value("local_accuracy", 0.0));
  }
  const auto recent = status.value("recent_rounds", nlohmann::json::array());
  if (!recent.empty()) std::printf("recent rounds:\n");
  for (const auto& round : recent) {
    std::printf("  round %lld -> version %lld: %zu updates", static_cast<long long>(round.value("round", 0)),
                static_cast<long long>(round.value("version", 0)), round.value("staleness", nlohmann::json::array()).size());
    if (round.contains("test_accuracy")) std::printf(", test accuracy %.2f%%", 100.0 * round["test_accuracy"].get<double>());
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void add_status_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<StatusFlags>();
  CLI::App* cmd = app.add_subcommand(
      "status", "Show a running federation at a glance: round, model version, sites and their last contact, "
                "recent accuracy (from the aggregator's metrics endpoint).");
  cmd->add_option("--aggregator", flags->aggregator, "The aggregator's metrics address HOST:PORT (its `metrics` setting)")
      ->required();
  cmd->add_option("--token", flags->token,
                  "The aggregator's access token (its metrics_token), when it has one; sent as Authorization: Bearer")
      ->envname("FEDMESH_METRICS_TOKEN");
  cmd->add_flag("--json", flags->json, "Print the aggregator's status object as one JSON line");
  cmd->callback([flags, &exit_code] { exit_code = run_status(*flags); });
}

}  // namespace fedmesh::cli
