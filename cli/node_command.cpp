#include "cli/node_command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "cli/output.h"
#include "node/site/site_runtime.h"

namespace fedmesh::cli {

namespace {

struct NodeFlags {
  std::string config;
  bool json = false;
};

void print_event(const std::string& site, const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  const char* name = site.c_str();
  if (kind == "site") {
    std::fprintf(stderr, "[%s] %lld training images, %lld held out; store %s\n", name,
                 static_cast<long long>(e.value("shard_images", 0)), static_cast<long long>(e.value("holdout_images", 0)),
                 e.value("store", "").c_str());
  } else if (kind == "model") {
    std::fprintf(stderr, "[%s] global model version %lld verified (%s..., %lld bytes)\n", name,
                 static_cast<long long>(e.value("version", 0)), e.value("hash", "").c_str(),
                 static_cast<long long>(e.value("bytes", 0)));
  } else if (kind == "update") {
    std::fprintf(stderr, "[%s] round %lld: %lld local steps, train loss %.4f, local accuracy %.2f%%, update %s in %s\n",
                 name, static_cast<long long>(e.value("round", 0)), static_cast<long long>(e.value("steps", 0)),
                 e.value("train_loss", 0.0), 100.0 * e.value("local_accuracy", 0.0),
                 e.value("accepted", false) ? "accepted" : ("refused: " + e.value("reason", std::string())).c_str(),
                 format_duration(e.value("seconds", 0.0)).c_str());
  } else if (kind == "resume") {
    std::fprintf(stderr, "[%s] resuming from %s at model version %lld\n", name, e.value("store", "").c_str(),
                 static_cast<long long>(e.value("version", 0)));
  } else if (kind == "finished") {
    std::fprintf(stderr, "[%s] the federation finished (model version %lld)\n", name,
                 static_cast<long long>(e.value("version", 0)));
  } else if (kind == "waiting" || kind == "warning") {
    std::fprintf(stderr, "[%s] %s\n", name, e.value("message", "").c_str());
  } else if (kind == "connected") {
    std::fprintf(stderr, "[%s] connected to %s\n", name, e.value("aggregator", "").c_str());
  }
}

int run_node(const NodeFlags& flags) {
  // A config that cannot be used is the operator's to fix: exit 2 like a bad
  // flag; failures later (the store, the network) exit 1.
  const auto fail = [&](const Status& status, bool bad_config = false) {
    if (flags.json) {
      emit_json({{"event", "error"}, {"command", "node"}, {"code", status_code_name(status.code())},
                 {"message", status.message()}});
    }
    std::fprintf(stderr, "fedmesh node: %s\n", status.message().c_str());
    return bad_config || status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound ? 2 : 1;
  };
  Result<node::SiteConfig> config = node::read_site_config(flags.config);
  if (!config.is_ok()) return fail(config.status(), true);
  const std::string site = config->name;
  const node::SiteEventSink sink = [&](const nlohmann::json& event) {
    if (flags.json) emit_json(event);
    else print_event(site, event);
  };
  const std::atomic<bool>& stop = stop_on_signals();
  Result<std::unique_ptr<node::SiteRuntime>> runtime = node::SiteRuntime::start(*config, sink);
  if (!runtime.is_ok()) return fail(runtime.status());
  if (Status s = (*runtime)->run(stop); !s.is_ok()) return fail(s);
  return 0;
}

}  // namespace

void add_node_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<NodeFlags>();
  CLI::App* cmd = app.add_subcommand(
      "node",
      "Run one site of a federation: dial the aggregator, fetch and verify the global model, train on this "
      "site's own data, send signed updates; checkpoints after every round and resumes after a crash.");
  cmd->add_option("--config", flags->config, "site.toml (see README.md, 'Running a federation')")->required();
  cmd->add_flag("--json", flags->json, "Print JSON lines: site, model, update, finished, ...");
  cmd->callback([flags, &exit_code] { exit_code = run_node(*flags); });
}

}  // namespace fedmesh::cli
