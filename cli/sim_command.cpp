#include "cli/sim_command.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "aggregator/simulation.h"
#include "cli/output.h"
#include "kernels/parallel.h"
#include "node/data/fashion_mnist.h"

namespace fedmesh::cli {

namespace {

constexpr int kMaxThreads = 1024;

struct SimFlags {
  aggregator::SimulationOptions options;
  std::string partition = "iid";
  std::string strategy = "fedavg";
  std::string rule = "mean";
  std::string staleness = "polynomial:0.5";
  std::string straggler = "0:1";
  std::string data = "fashion-mnist";
  std::string local_optimizer = "sgd";
  float server_lr = 0.0f;  // 0: the strategy's default
  int64_t max_staleness = -1;
  int64_t async_buffer = 0;  // 0: synchronous
  double fedasync = 0.0;
  double deadline = 0.0;     // 0: 3 x local steps
  int64_t train_limit = 0, test_limit = 0;
  int threads = 0;
  bool json = false;
  std::string compress = "identity";
  std::vector<std::string> compress_tensor;
  uint64_t dense_below = 0;
};

int fail(const SimFlags& flags, const Status& status) {
  if (flags.json) {
    emit_json({{"event", "error"}, {"command", "sim"}, {"code", status_code_name(status.code())},
               {"message", status.message()}});
  }
  std::fprintf(stderr, "fedmesh sim: %s\n", status.message().c_str());
  return 2;
}

int run_sim(SimFlags& flags) {
  const auto wall_start = std::chrono::steady_clock::now();
  aggregator::SimulationOptions& o = flags.options;
  if (flags.threads < 0 || flags.threads > kMaxThreads) return fail(flags, invalid_argument("--threads out of range"));
  set_cpu_threads(flags.threads);
  Result<data::PartitionSpec> partition = data::PartitionSpec::parse(flags.partition);
  if (!partition.is_ok()) return fail(flags, partition.status());
  o.partition = *partition;
  Result<aggregator::ServerOptimizerOptions> server = aggregator::ServerOptimizerOptions::defaults_for(flags.strategy);
  if (!server.is_ok()) return fail(flags, server.status());
  if (flags.server_lr > 0.0f) server->lr = flags.server_lr;
  o.rounds_options.server = *server;
  if (Status s = aggregator::parse_rule(flags.rule, o.rounds_options); !s.is_ok()) return fail(flags, s);
  Result<aggregator::StalenessFunction> staleness = aggregator::StalenessFunction::parse(flags.staleness, flags.max_staleness);
  if (!staleness.is_ok()) return fail(flags, staleness.status());
  o.rounds_options.staleness = *staleness;
  if (flags.async_buffer < 0) return fail(flags, invalid_argument("--async K must be at least 1"));
  o.rounds_options.asynchronous = flags.async_buffer > 0 || flags.fedasync > 0.0;
  if (flags.async_buffer > 0) o.rounds_options.buffer_size = flags.async_buffer;
  o.rounds_options.fedasync_mixing = flags.fedasync;
  o.rounds_options.seed = o.seed;
  o.rounds_options.round_deadline_seconds =
      flags.deadline > 0.0 ? flags.deadline : 3.0 * static_cast<double>(o.local_steps);
  o.local.optimizer = flags.local_optimizer;
  o.local.schedule = *LrSchedule::parse("constant");
  o.local.weight_decay = 0.0f;
  const size_t colon = flags.straggler.find(':');
  try {
    o.straggler_fraction = std::stod(flags.straggler.substr(0, colon));
    o.straggler_factor = colon == std::string::npos ? 1.0 : std::stod(flags.straggler.substr(colon + 1));
  } catch (const std::exception&) {
    return fail(flags, invalid_argument("--straggler '" + flags.straggler + "' is not P:FACTOR (e.g. 0.2:4)"));
  }
  Result<protocol::CompressionPlan> plan =
      protocol::make_compression_plan(flags.compress, flags.compress_tensor, flags.dense_below);
  if (!plan.is_ok()) return fail(flags, plan.status());
  o.compression = *plan;
  if (Status s = o.validate(); !s.is_ok()) return fail(flags, s);

  Result<data::FashionMnistSplits> splits =
      data::load_fashion_mnist_splits(flags.data, flags.train_limit, flags.test_limit);
  if (!splits.is_ok()) return fail(flags, splits.status());
  data::ImageDataset* train = &splits->train;
  data::ImageDataset* test = &splits->test;

  const std::string mode = o.rounds_options.asynchronous
                               ? (flags.fedasync > 0.0 ? "fedasync" : "fedbuff:" + std::to_string(flags.async_buffer))
                               : "sync";
  if (flags.json) {
    emit_json({{"event", "start"}, {"command", "sim"}, {"sites", o.sites}, {"partition", o.partition.to_string()},
               {"strategy", flags.strategy}, {"rule", flags.rule}, {"mode", mode}, {"rounds", o.rounds},
               {"local_steps", o.local_steps}, {"model", o.model}, {"seed", o.seed},
               {"compression", o.compression.to_string()}});
  } else {
    std::fprintf(stderr, "simulating %d sites (%s) of %lld Fashion-MNIST images: %s, %s, rule %s, %lld rounds of %lld local steps\n",
                 o.sites, o.partition.to_string().c_str(), static_cast<long long>(train->count), mode.c_str(),
                 flags.strategy.c_str(), flags.rule.c_str(), static_cast<long long>(o.rounds),
                 static_cast<long long>(o.local_steps));
    std::fprintf(stderr, "updates compressed as %s\n", o.compression.to_string().c_str());
  }
  Result<aggregator::SimulationSummary> summary =
      aggregator::run_simulation(o, *train, *test, [&](const aggregator::SimulationRound& r) {
        double mean_staleness = 0.0;
        for (const auto& applied : r.record.applied) mean_staleness += static_cast<double>(applied.staleness);
        if (!r.record.applied.empty()) mean_staleness /= static_cast<double>(r.record.applied.size());
        if (flags.json) {
          emit_json({{"event", "round"}, {"round", r.record.round}, {"version", r.record.version},
                     {"updates", r.updates}, {"dropped", r.dropped}, {"mean_staleness", mean_staleness},
                     {"test_accuracy", r.test_accuracy}, {"test_loss", r.test_loss},
                     {"virtual_time", r.virtual_time}, {"bytes", r.bytes}});
          return;
        }
        std::fprintf(stderr, "round %4lld  version %4lld  updates %3lld  dropped %2lld  staleness %.1f  test accuracy %.2f%%  loss %.4f\n",
                     static_cast<long long>(r.record.round), static_cast<long long>(r.record.version),
                     static_cast<long long>(r.updates), static_cast<long long>(r.dropped), mean_staleness,
                     100.0 * r.test_accuracy, r.test_loss);
      });
  if (!summary.is_ok()) return fail(flags, summary.status());
  const double wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "sim"}, {"test_accuracy", summary->final_accuracy},
               {"test_loss", summary->final_loss}, {"rounds", summary->rounds.size()},
               {"bytes_sent", summary->bytes_sent}, {"bytes_received", summary->bytes_received},
               {"refused_updates", summary->refused_updates}, {"virtual_time", summary->virtual_time},
               {"resumed_from_round", summary->resumed_from_round},
               {"wall_seconds", wall_seconds}});
  } else {
    std::printf("sim %s %s: test accuracy %.2f%% after %zu server steps, %.1f MB sent by sites, %s\n", mode.c_str(),
                flags.strategy.c_str(), 100.0 * summary->final_accuracy, summary->rounds.size(),
                static_cast<double>(summary->bytes_sent) / 1e6, format_duration(wall_seconds).c_str());
  }
  return 0;
}

}  // namespace

void add_sim_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<SimFlags>();
  aggregator::SimulationOptions& o = flags->options;
  o.local.batch_size = 32;
  o.local.lr = 0.05f;
  CLI::App* cmd = app.add_subcommand(
      "sim", "Simulate a federation in one process: virtual sites with their own data shards, the real round "
             "manager, strategies and staleness rules; deterministic for a seed.");
  cmd->add_option("--sites", o.sites, "Virtual sites")->capture_default_str();
  cmd->add_option("--partition", flags->partition, "How the training set is split: iid, dirichlet:A or shards:K")
      ->capture_default_str();
  cmd->add_option("--model", o.model, "mlp or cnn")->check(CLI::IsMember({"mlp", "cnn"}))->capture_default_str();
  cmd->add_option("--strategy", flags->strategy,
                  "Server optimizer: fedavg, fedavgm, fedadam, fedyogi, fedadagrad or diloco")
      ->capture_default_str();
  cmd->add_option("--server-lr", flags->server_lr, "Server learning rate (default: the strategy's)");
  cmd->add_option("--rule", flags->rule,
                  "Aggregation: mean (sample- and staleness-weighted), median, trimmed_mean[:BETA], krum[:F[:M]]")
      ->capture_default_str();
  cmd->add_option("--norm-bound", o.rounds_options.norm_bound, "Scale each update to at most this L2 norm (0: off)")
      ->capture_default_str();
  cmd->add_option("--rounds", o.rounds, "Rounds (synchronous) or server steps (asynchronous)")->capture_default_str();
  cmd->add_option("--sites-per-round", o.rounds_options.sites_per_round, "Sites sampled per round (0: all)")
      ->capture_default_str();
  cmd->add_option("--local-steps", o.local_steps, "Local optimizer steps per site per round")->capture_default_str();
  cmd->add_option("--batch-size", o.local.batch_size, "Local batch size")->capture_default_str();
  cmd->add_option("--lr", o.local.lr, "Local learning rate")->capture_default_str();
  cmd->add_option("--optimizer", flags->local_optimizer, "Local optimizer: sgd or adamw")->capture_default_str();
  cmd->add_option("--momentum", o.local.momentum, "Local SGD momentum")->capture_default_str();
  cmd->add_option("--async", flags->async_buffer,
                  "Asynchronous FedBuff: apply an aggregate every K updates (0: synchronous rounds)")
      ->capture_default_str();
  cmd->add_option("--fedasync", flags->fedasync, "Asynchronous FedAsync with this mixing alpha (0: off)")
      ->capture_default_str();
  cmd->add_option("--staleness", flags->staleness, "s(tau): constant, polynomial:A, hinge:A:B or inverse")
      ->capture_default_str();
  cmd->add_option("--max-staleness", flags->max_staleness, "Drop updates staler than this (-1: no cut-off)")
      ->capture_default_str();
  cmd->add_option("--deadline", flags->deadline,
                  "Synchronous round deadline in virtual time (local-step units; 0: 3 x local steps)");
  cmd->add_option("--dropout", o.dropout, "Chance that a sampled site never reports in a round")->capture_default_str();
  cmd->add_option("--straggler", flags->straggler, "P:FACTOR: a share P of the sites is FACTOR times slower")
      ->capture_default_str();
  cmd->add_option("--poisoned", o.poisoned_sites, "Sites that send -10x their update (robustness experiments)")
      ->capture_default_str();
  cmd->add_option("--db", o.db,
                  "Checkpoint store: every round is committed before it is reported; the same command resumes from "
                  "the newest intact round (synchronous rounds only)");
  cmd->add_option("--compress", flags->compress,
                  "How sites compress their updates, with error feedback: identity, fp16, bf16, "
                  "int8|int4[:stochastic][:block=N], topk:F[+fp16|+int8|+fp32][:warmup=R][:momentum=M], "
                  "powersgd:R, dct-sign:K (README: Compressing updates)")
      ->capture_default_str();
  cmd->add_option("--compress-tensor", flags->compress_tensor,
                  "GLOB=SPEC: another spec for the tensors whose name matches GLOB (repeatable; the first match "
                  "wins), e.g. '*.bias=identity'");
  cmd->add_option("--compress-device", o.compression_device,
                  "Where compression runs: cpu, cuda (fails without a usable GPU) or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->add_option("--dense-below", flags->dense_below,
                  "Tensors with fewer elements than this go dense fp32 unless --compress-tensor names them")
      ->capture_default_str();
  cmd->add_option("--data", flags->data, "fashion-mnist or a directory with the four IDX files")->capture_default_str();
  cmd->add_option("--train-limit", flags->train_limit, "Use only the first N training images (0 = all)")
      ->capture_default_str();
  cmd->add_option("--test-limit", flags->test_limit, "Evaluate on only the first N test images (0 = all)")
      ->capture_default_str();
  cmd->add_option("--threads", flags->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed for the split, sampling, dropouts and training")->capture_default_str();
  cmd->add_flag("--json", flags->json, "Print JSON lines; the last is {\"event\":\"summary\",...}");
  cmd->callback([flags, &exit_code] { exit_code = run_sim(*flags); });
}

}  // namespace fedmesh::cli
