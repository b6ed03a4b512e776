#include "cli/node_command.h"

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "base/large_buffers.h"
#include "base/text.h"
#include "cli/output.h"
#include "node/gossip_runtime.h"
#include "node/site_ranks.h"
#include "node/site_runtime.h"

namespace fedmesh::cli {

namespace {

struct NodeFlags {
  std::string config;
  std::string mode;  // "" : the config's `mode` key (default aggregator)
  bool json = false;
  std::string device;     // --device: overrides training.device ("" = the config's)
  int gpus = 0;           // --gpus N: --device cuda --ranks N
  bool ranks_given = false;
  train::RankFlags group;  // --ranks N (aggregator mode): data-parallel CPU ranks
  bool zero_one = false;  // --zero-1
  bool tensor_parallel_given = false;  // --tensor-parallel (else training.tensor_parallel)
};

void print_event(const std::string& site, const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  const char* name = site.c_str();
  if (kind == "site") {
    std::fprintf(stderr, "[%s] %lld training images, %lld held out; store %s%s\n", name,
                 static_cast<long long>(e.value("shard_images", 0)), static_cast<long long>(e.value("holdout_images", 0)),
                 e.value("store", "").c_str(),
                 e.value("ranks", 1) > 1 ? ("; " + std::to_string(e.value("ranks", 1)) + " data-parallel ranks").c_str() : "");
    if (e.value("tensor_parallel", 1) > 1) {
      std::fprintf(stderr, "[%s] each transformer block split over %d tensor-parallel ranks\n", name,
                   e.value("tensor_parallel", 1));
    }
    if (e.contains("tokenizer")) {
      std::fprintf(stderr, "[%s] text read with the BPE tokenizer %s (vocabulary %lld)\n", name,
                   e.value("tokenizer", "").c_str(), static_cast<long long>(e.value("vocab_size", 0)));
    }
  } else if (kind == "model") {
    std::fprintf(stderr, "[%s] global model version %lld verified (%s..., %lld bytes)\n", name,
                 static_cast<long long>(e.value("version", 0)), e.value("hash", "").c_str(),
                 static_cast<long long>(e.value("bytes", 0)));
  } else if (kind == "update") {
    const bool secure = e.value("secure", false), accepted = e.value("accepted", false);
    const std::string outcome = secure ? (accepted ? "masked and in the secure sum (session " + e.value("session", std::string()) + ")"
                                                   : "not in the secure sum: " + e.value("reason", std::string()))
                                       : (accepted ? "accepted" : "refused: " + e.value("reason", std::string()));
    char local[96];
    if (e.contains("local_r2")) {
      std::snprintf(local, sizeof local, "local R² %.4f, MAE %.4g", e.value("local_r2", 0.0), e.value("local_mae", 0.0));
    } else {
      std::snprintf(local, sizeof local, "local accuracy %.2f%%", 100.0 * e.value("local_accuracy", 0.0));
    }
    std::fprintf(stderr, "[%s] round %lld: %lld local steps, train loss %.4f, %s, update %s in %s\n",
                 name, static_cast<long long>(e.value("round", 0)), static_cast<long long>(e.value("steps", 0)),
                 e.value("train_loss", 0.0), local, outcome.c_str(), format_duration(e.value("seconds", 0.0)).c_str());
  } else if (kind == "secure_session") {
    std::fprintf(stderr, "[%s] round %lld: secure-aggregation session %s (%lld sites invited, threshold %lld)\n", name,
                 static_cast<long long>(e.value("round", 0)), e.value("session", "").c_str(),
                 static_cast<long long>(e.value("invited", 0)), static_cast<long long>(e.value("threshold", 0)));
  } else if (kind == "secure_abort") {
    std::fprintf(stderr, "[%s] round %lld: left secure-aggregation session %s, secrets wiped: %s\n", name,
                 static_cast<long long>(e.value("round", 0)), e.value("session", "").c_str(),
                 e.value("reason", "").c_str());
  } else if (kind == "resume") {
    std::fprintf(stderr, "[%s] resuming from %s at model version %lld\n", name, e.value("store", "").c_str(),
                 static_cast<long long>(e.value("version", 0)));
  } else if (kind == "finished" && e.contains("bytes_sent")) {
    std::fprintf(stderr, "[%s] left the gossip at version %lld\n", name, static_cast<long long>(e.value("version", 0)));
  } else if (kind == "finished") {
    std::fprintf(stderr, "[%s] the federation finished (model version %lld)\n", name,
                 static_cast<long long>(e.value("version", 0)));
  } else if (kind == "waiting" || kind == "warning") {
    std::fprintf(stderr, "[%s] %s\n", name, e.value("message", "").c_str());
  } else if (kind == "peer") {
    std::fprintf(stderr, "[%s] gossip peer on %s: %lld members on the roster, %lld training images, %s over %s, "
                 "compression %s; store %s\n", name, e.value("listen", "").c_str(),
                 static_cast<long long>(e.value("members", 0)), static_cast<long long>(e.value("shard_images", 0)),
                 e.value("merge", "").c_str(), e.value("topology", "").c_str(), e.value("compress", "").c_str(),
                 e.value("store", "").c_str());
  } else if (kind == "member") {
    std::fprintf(stderr, "[%s] member %s is %s (incarnation %lld)\n", name, e.value("member", "").c_str(),
                 e.value("state", "").c_str(), static_cast<long long>(e.value("incarnation", 0)));
  } else if (kind == "round") {
    std::string accuracy = e.contains("test_accuracy") ? format_number(100.0 * e.value("test_accuracy", 0.0), 4) + "%" : "-";
    std::fprintf(stderr, "[%s] round %lld: train loss %.4f, test accuracy %s, consensus distance %.4g over %lld shares, "
                 "%lld alive / %lld suspect / %lld dead, %s sent\n", name, static_cast<long long>(e.value("round", 0)),
                 e.value("train_loss", 0.0), accuracy.c_str(), e.value("consensus", -1.0),
                 static_cast<long long>(e.value("heard", 0)), static_cast<long long>(e.value("alive", 0)),
                 static_cast<long long>(e.value("suspect", 0)), static_cast<long long>(e.value("dead", 0)),
                 format_bytes(e.value("bytes_sent", int64_t{0})).c_str());
  } else if (kind == "catch-up") {
    std::fprintf(stderr, "[%s] caught up from %zu donors (%lld of %lld slices) to version %lld\n", name,
                 e.value("donors", nlohmann::json::array()).size(), static_cast<long long>(e.value("received", 0)),
                 static_cast<long long>(e.value("slices", 0)), static_cast<long long>(e.value("version", 0)));
  } else if (kind == "refused") {
    std::fprintf(stderr, "[%s] refused a message from %s (%s): %s\n", name, e.value("from", "").c_str(),
                 e.value("code", "").c_str(), e.value("reason", "").c_str());
  } else if (kind == "connected") {
    std::fprintf(stderr, "[%s] connected to %s\n", name, e.value("aggregator", "").c_str());
  }
}

// A config that cannot be used is the operator's to fix: exit 2 like a bad
// flag; a key the federation revoked exits 3 (a service manager must not
// restart it: deploy/systemd sets RestartPreventExitStatus=3); failures
// later (the store, the network) exit 1.
int fail(const NodeFlags& flags, const Status& status, bool bad_config = false) {
  if (status.code() == StatusCode::kRevoked) return report_failure("node", flags.json, status, 3);
  const bool bad_input = bad_config || status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound;
  return report_failure("node", flags.json, status, bad_input ? 2 : 1);
}

// Runs one role's runtime (aggregator-mode site or gossip peer) until it
// ends or a signal stops it.
template <typename Runtime, typename Config, typename... Extra>
int run_runtime(const NodeFlags& flags, Result<Config> config, const std::string& site, Extra&&... extra) {
  if (!config.is_ok()) return fail(flags, config.status(), true);
  const std::function<void(const nlohmann::json&)> sink = [&](const nlohmann::json& event) {
    if (flags.json) emit_json(event);
    else print_event(site, event);
  };
  const std::atomic<bool>& stop = stop_on_signals();
  Result<std::unique_ptr<Runtime>> runtime = Runtime::start(std::move(*config), sink, std::forward<Extra>(extra)...);
  if (!runtime.is_ok()) return fail(flags, runtime.status());
  if (Status s = (*runtime)->run(stop); !s.is_ok()) return fail(flags, s);
  return 0;
}

int run_node(const NodeFlags& given, const node::SecureUploadFaults& faults) {
  NodeFlags flags = given;
  return_large_buffers_to_system();
  if (flags.gpus != 0) {
    // --gpus N: --device cuda --ranks N.
    if (flags.gpus < 1) return fail(flags, invalid_argument("--gpus must be at least 1"), true);
    if (flags.ranks_given && flags.group.ranks != flags.gpus) {
      return fail(flags, invalid_argument("--gpus " + std::to_string(flags.gpus) + " and --ranks " +
                                          std::to_string(flags.group.ranks) + " disagree: --gpus N is --ranks N on GPUs"),
                  true);
    }
    if (!flags.device.empty() && flags.device != "cuda") {
      return fail(flags, invalid_argument("--gpus with --device " + flags.device + ": --gpus trains on GPUs"), true);
    }
    flags.group.ranks = flags.gpus;
    flags.device = "cuda";
  }
  std::string mode = flags.mode;
  if (mode.empty()) {
    Result<std::string> configured = node::read_node_mode(flags.config);
    if (!configured.is_ok()) return fail(flags, configured.status(), true);
    mode = *configured;
  }
  if (mode == "gossip" && (flags.group.ranks > 1 || flags.group.tensor_parallel > 1)) {
    return fail(flags, invalid_argument("--ranks, --tensor-parallel: a gossip peer trains in one process for now (use "
                                        "them with --mode aggregator)"), true);
  }
  if (mode == "gossip" && !flags.device.empty() && flags.device != "cpu") {
    return fail(flags, invalid_argument("--device " + flags.device + ": a gossip peer trains on the cpu for now (use "
                                        "--device with --mode aggregator)"), true);
  }
  if (mode == "gossip") {
    if (Status s = flags.group.validate(); !s.is_ok()) return fail(flags, s, true);
    Result<node::GossipConfig> config = node::read_gossip_config(flags.config);
    const std::string site = config.is_ok() ? config->site.name : "";
    return run_runtime<node::GossipRuntime>(flags, std::move(config), site);
  }
  Result<node::SiteConfig> config = node::read_site_config(flags.config);
  const std::string site = config.is_ok() ? config->name : "";
  if (flags.zero_one && flags.group.ranks < 2) {
    return fail(flags, invalid_argument("--zero-1 needs --ranks N with N >= 2"), true);
  }
  if (config.is_ok()) {
    if (!flags.device.empty()) config->device = flags.device;
    if (config->device == "cuda" && flags.zero_one) {
      return fail(flags, invalid_argument("--zero-1 with --device cuda: the sharded optimizer keeps its shards in host "
                                          "memory for now; drop --zero-1"), true);
    }
    config->ranks = flags.group.ranks;
    config->zero_one = flags.zero_one;
    // --tensor-parallel overrides training.tensor_parallel; a launched rank
    // counts the group's processes with the config's.
    if (flags.tensor_parallel_given) config->tensor_parallel = flags.group.tensor_parallel;
    flags.group.tensor_parallel = config->tensor_parallel;
    if (Status s = config->validate(); !s.is_ok()) config = s;
  }
  if (Status s = flags.group.validate(); !s.is_ok()) return fail(flags, s, true);
  if (flags.group.launched()) {
    // A rank launched by this node's rank 0: no output of its own.
    if (!config.is_ok()) return fail(flags, config.status(), true);
    const Status s = node::run_site_rank(*config, flags.group);
    return s.is_ok() ? 0 : fail(flags, s);
  }
  return run_runtime<node::SiteRuntime>(flags, std::move(config), site, faults);
}

}  // namespace

void add_node_command(CLI::App& app, int& exit_code, const node::SecureUploadFaults& faults) {
  auto flags = std::make_shared<NodeFlags>();
  CLI::App* cmd = app.add_subcommand(
      "node",
      "Run one site of a federation. Aggregator mode: dial the aggregator, fetch and verify the global model, train "
      "on this site's own data, send signed updates. Gossip mode: no aggregator; join the members through SWIM, "
      "train H local steps, gossip compressed signed shares to peers chosen by a topology, catch up from several "
      "donors after a crash. Both checkpoint after every round and resume after a crash; SIGTERM stops cleanly.");
  cmd->add_option("--config", flags->config, "site.toml (every key: docs/configuration.md)")->required();
  cmd->add_option("--mode", flags->mode, "aggregator or gossip (default: the config's `mode` key, else aggregator)")
      ->check(CLI::IsMember({"aggregator", "gossip"}));
  cmd->add_option("--device", flags->device,
                  "Aggregator mode: cpu or cuda, where the site trains (overrides training.device; cuda with --ranks N: one rank per GPU, NCCL)");
  cmd->add_option("--gpus", flags->gpus,
                  "Aggregator mode: train on N GPUs of this machine, one rank per GPU with NCCL (--device cuda "
                  "--ranks N)");
  CLI::Option* ranks_option =
      cmd->add_option("--ranks", flags->group.ranks,
                      "Aggregator mode: data-parallel ranks, processes launched by this one that train every round "
                      "together (1/N of every batch each, gradients all-reduced: Gloo on CPUs, NCCL with --device "
                      "cuda); the federation still sees one site and one update")
          ->capture_default_str();
  cmd->add_flag("--zero-1", flags->zero_one, "With --ranks: shard the optimizer state across the ranks (ZeRO stage 1)");
  CLI::Option* tensor_option =
      cmd->add_option("--tensor-parallel", flags->group.tensor_parallel,
                      "Aggregator mode, GPTs: split every transformer block over N ranks (attention heads and MLP "
                      "features; Gloo on CPUs, NCCL with --device cuda), times --ranks data-parallel groups "
                      "(overrides training.tensor_parallel)");
  cmd->add_option("--rank", flags->group.rank)->group("");  // set by rank 0 for the ranks it launches
  cmd->add_option("--rendezvous", flags->group.rendezvous)->group("");
  cmd->add_flag("--json", flags->json, "Print JSON lines: site, model, update, finished (aggregator); peer, member, "
                                       "round, catch-up, refused, finished (gossip)");
  cmd->callback([flags, ranks_option, tensor_option, faults, &exit_code] {
    flags->ranks_given = ranks_option->count() > 0;
    flags->tensor_parallel_given = tensor_option->count() > 0;
    exit_code = run_node(*flags, faults);
  });
}

}  // namespace fedmesh::cli
