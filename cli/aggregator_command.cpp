#include "cli/aggregator_command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "aggregator/server.h"
#include "base/large_buffers.h"
#include "cli/output.h"

namespace fedmesh::cli {

namespace {

struct AggregatorFlags {
  std::string config;
  bool json = false;
  aggregator::AggregatorConfigOverrides overrides;
};

// One line per event for a person reading a terminal.
void print_event(const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  if (kind == "listening") {
    std::fprintf(stderr, "aggregator listening on %s (metrics: %s), store %s, %s rounds, at round %lld version %lld\n",
                 e.value("endpoint", "").c_str(), e.value("metrics", "off").c_str(), e.value("store", "").c_str(),
                 e.value("mode", "").c_str(), static_cast<long long>(e.value("round", 0)),
                 static_cast<long long>(e.value("version", 0)));
    if (!e.value("dashboard", "").empty()) {
      std::fprintf(stderr, "dashboard: %s%s\n", e.value("dashboard", "").c_str(),
                   e.value("token_required", false) ? "?token=TOKEN (the metrics_token)" : "");
    }
  } else if (kind == "tokenizer") {
    std::fprintf(stderr, "text read with the BPE tokenizer %s (vocabulary %lld, %.3f bytes per held-out token)\n",
                 e.value("tokenizer", "").c_str(), static_cast<long long>(e.value("vocab_size", 0)),
                 e.value("held_out_bytes_per_token", 0.0));
  } else if (kind == "round_open") {
    std::fprintf(stderr, "round %lld open: %zu sites sampled%s\n", static_cast<long long>(e.value("round", 0)),
                 e["sampled"].size(), e.value("reopened", false) ? " (reopened after a restart)" : "");
  } else if (kind == "round") {
    std::string accuracy;
    if (e.contains("test_r2")) {
      char buffer[96];
      std::snprintf(buffer, sizeof buffer, "  test R² %.4f, MAE %.4g", e.value("test_r2", 0.0), e.value("test_mae", 0.0));
      accuracy = buffer;
    } else if (e.contains("test_accuracy")) {
      char buffer[64];
      std::snprintf(buffer, sizeof buffer, "  test accuracy %.2f%%", 100.0 * e["test_accuracy"].get<double>());
      accuracy = buffer;
      if (e.contains("val_bits_per_byte")) {
        std::snprintf(buffer, sizeof buffer, ", held-out %.3f bits/byte", e.value("val_bits_per_byte", 0.0));
        accuracy += buffer;
      }
    }
    std::fprintf(stderr, "round %lld -> version %lld: %zu updates%s%s in %s\n", static_cast<long long>(e.value("round", 0)),
                 static_cast<long long>(e.value("version", 0)), e["staleness"].size(), accuracy.c_str(),
                 e.value("closed_by_deadline", false) ? " (closed at the deadline)" : "",
                 format_duration(e.value("seconds", 0.0)).c_str());
  } else if (kind == "update" && !e.value("accepted", true)) {
    std::fprintf(stderr, "update %s refused: %s\n", e.value("id", "").c_str(), e.value("reason", "").c_str());
  } else if (kind == "rejected") {
    std::fprintf(stderr, "refused a message from %s (%s): %s\n", e.value("peer", "").c_str(), e.value("code", "").c_str(),
                 e.value("reason", "").c_str());
  } else if (kind == "resume") {
    std::fprintf(stderr, "resuming from %s: round %lld, version %lld (committed %s)\n", e.value("store", "").c_str(),
                 static_cast<long long>(e.value("round", 0)), static_cast<long long>(e.value("version", 0)),
                 e.value("committed", "").c_str());
  } else if (kind == "finished") {
    std::fprintf(stderr, "federation finished at version %lld; checkpoints in %s\n",
                 static_cast<long long>(e.value("version", 0)), e.value("store", "").c_str());
  } else if (kind == "warning" || kind == "error") {
    std::fprintf(stderr, "%s: %s\n", kind.c_str(), e.value("message", "").c_str());
  }
}

int run_aggregator(const AggregatorFlags& flags) {
  // A config that cannot be used is the operator's to fix: exit 2 like a bad
  // flag; failures later (the store, the network) exit 1.
  const auto fail = [&](const Status& status, bool bad_config = false) {
    if (flags.json) {
      emit_json({{"event", "error"}, {"command", "aggregator"}, {"code", status_code_name(status.code())},
                 {"message", status.message()}});
    }
    std::fprintf(stderr, "fedmesh aggregator: %s\n", status.message().c_str());
    return bad_config || status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound ? 2 : 1;
  };
  Result<aggregator::AggregatorConfig> config = aggregator::read_aggregator_config(flags.config, flags.overrides);
  if (!config.is_ok()) return fail(config.status(), true);
  const aggregator::EventSink sink = [&](const nlohmann::json& event) {
    if (flags.json) emit_json(event);
    else print_event(event);
  };
  return_large_buffers_to_system();
  const std::atomic<bool>& stop = stop_on_signals();
  Result<std::unique_ptr<aggregator::AggregatorServer>> server = aggregator::AggregatorServer::start(*config, sink);
  if (!server.is_ok()) return fail(server.status());
  if (Status s = (*server)->run(stop); !s.is_ok()) return fail(s);
  return 0;
}

}  // namespace

void add_aggregator_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<AggregatorFlags>();
  CLI::App* cmd = app.add_subcommand(
      "aggregator",
      "Run the federation's central aggregator: serve the global model, take signed updates from the sites on "
      "the roster, aggregate rounds (sync, FedBuff or FedAsync), commit every round to its store before "
      "announcing it. Killed at any moment, the same command resumes the round it was in.");
  cmd->add_option("--config", flags->config, "agg.toml (every key: docs/configuration.md)")->required();
  cmd->add_flag("--json", flags->json, "Print JSON lines: listening, round_open, update, round, finished, ...");
  cmd->add_option_function<std::string>(
      "--metrics", [flags](const std::string& value) { flags->overrides.metrics = value; },
      "HOST:PORT of /metrics, /status and the dashboard at /dashboard; wins over `metrics` in the config. A "
      "non-loopback address needs an access token");
  cmd->add_option_function<std::string>(
         "--metrics-token", [flags](const std::string& value) { flags->overrides.metrics_token = value; },
         "Access token of /metrics, /status and /dashboard (Authorization: Bearer TOKEN, or ?token=TOKEN); wins "
         "over `metrics_token` in the config. Prefer the config file or the environment: a command line is visible "
         "to other users of the machine")
      ->envname("FEDMESH_METRICS_TOKEN");
  cmd->callback([flags, &exit_code] { exit_code = run_aggregator(*flags); });
}

}  // namespace fedmesh::cli
