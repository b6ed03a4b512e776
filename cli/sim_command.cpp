#include "cli/sim_command.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "sim/simulation.h"
#include "base/text.h"
#include "cli/data_flags.h"
#include "cli/model_command.h"
#include "cli/output.h"
#include "gossip/replicas.h"
#include "sim/gossip_simulation.h"
#include "privacy/dp_settings.h"
#include "kernels/parallel.h"
#include "train/data/data_source.h"
#include "train/data/fashion_mnist.h"
#include "train/data/text_corpus.h"
#include "train/model.h"

namespace fedmesh::cli {

namespace {

constexpr const char* kSimulationNoiseNote =
    "DP-FedAvg noise seeded for replay (a simulation): not a privacy guarantee; epsilon is what the mechanism "
    "would spend with secret noise";

constexpr int kMaxThreads = 1024;

struct SimFlags {
  sim::SimulationOptions options;
  std::string partition = "iid";
  std::string strategy = "fedavg";
  std::string rule = "mean";
  std::string staleness = "polynomial:0.5";
  std::string straggler = "0:1";
  std::string data = "fashion-mnist";
  train::data::DataSource own;  // the own-data flags (--label, --test-data, ...); own.source is `data`
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
  double dp_clip = 1.0;  // --mode private
  CLI::Option* dp_clip_option = nullptr;
  // --mode gossip
  std::string mode = "aggregator";
  std::string topology = "random";
  int fanout = 1;
  std::string merge = "replicas";
  double loss = 0.0;
  std::string delay = "0";
  int64_t eval_every = 1;
  // The flags only one mode takes, refused in the other when given.
  std::vector<CLI::Option*> aggregator_only, gossip_only;
  CLI::Option* staleness_option = nullptr;
  CLI::Option* fanout_option = nullptr;
  CLI::Option* topology_option = nullptr;
  CLI::Option* compress_option = nullptr;
};

int fail(const SimFlags& flags, const Status& status) {
  return report_failure("sim", flags.json, status, 2);
}

// A flag of the other mode is a mistake worth saying, not one to ignore.
Status check_mode_flags(const SimFlags& flags) {
  const bool gossip = flags.mode == "gossip";
  for (const CLI::Option* option : gossip ? flags.aggregator_only : flags.gossip_only) {
    if (option->count() == 0) continue;
    return invalid_argument(option->get_name() + " does not apply to --mode " + flags.mode +
                            (gossip ? ": it configures the aggregator path (there is no server in gossip)"
                                    : ": it configures gossip (add --mode gossip)"));
  }
  return Status::ok();
}

// The sites' data: Fashion-MNIST for the image models, text (--data: the
// Bible by default, or a directory of .txt files) for the language models.
Result<sim::SimulationData> load_simulation_data(const SimFlags& flags) {
  const sim::SimulationOptions& o = flags.options;
  if (train::data::is_token_shard(flags.data)) {
    return invalid_argument("--data " + flags.data + ": fedmesh sim splits text among its virtual sites by document; "
                            "a token shard has no documents: train it with `fedmesh train`, or give each site its own "
                            "with `fedmesh node` (docs/data.md)");
  }
  if (train::data::is_own_data(flags.data) && train::language_model_config(o.model)) {
    return invalid_argument("--data " + flags.data + ": model " + o.model + " is a language model; own tables, images "
                            "and arrays train mlp or cnn");
  }
  if (train::data::is_own_data(flags.data)) {
    // Own data split among the virtual sites by --partition, as Fashion-MNIST is.
    train::data::DataSource source = flags.own;
    source.source = flags.data;
    Result<train::data::LoadedData> loaded = train::data::load_own_data(source, flags.train_limit, flags.test_limit);
    if (!loaded.is_ok()) return loaded.status();
    return sim::own_simulation_data(std::move(*loaded), o.sites, o.partition, o.seed);
  }
  if (flags.own.test != "" || flags.own.label != "") {
    return invalid_argument("--test-data and --label are for own data (csv:FILE, images:DIR, arrays:FILE), not --data " +
                            flags.data);
  }
  if (train::language_model_config(o.model)) {
    Result<train::data::TextCorpus> corpus = train::data::load_text_corpus(train::data::text_source(flags.data));
    if (!corpus.is_ok()) return corpus.status();
    return sim::text_simulation_data(o, *corpus, flags.train_limit, flags.test_limit);
  }
  Result<train::data::FashionMnistSplits> splits =
      train::data::load_fashion_mnist_splits(flags.data, flags.train_limit, flags.test_limit);
  if (!splits.is_ok()) return splits.status();
  return sim::image_simulation_data(o, splits->train, std::move(splits->test));
}

int64_t sample_count(const sim::SimulationData& data) {
  int64_t samples = 0;
  for (const auto& shard : data.shards) samples += shard->size();
  return samples;
}

// What the sites' samples are, for the start line.
std::string data_description(const SimFlags& flags, bool text) {
  if (train::data::is_own_data(flags.data)) return "samples of " + flags.data;
  return text ? "windows of " + train::data::text_source(flags.data) + " text" : "Fashion-MNIST images";
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "STEPS" or "STEPS:JITTER", in local steps.
Status parse_delay(const std::string& text, sim::GossipSimulationOptions& options) {
  const std::vector<std::string_view> parts = split(text, ':');
  options.delay_jitter_steps = 0;
  if (parts.size() > 2 || !parse_number(parts[0], options.delay_steps) ||
      (parts.size() == 2 && !parse_number(parts[1], options.delay_jitter_steps))) {
    return invalid_argument("--delay '" + text + "' is not STEPS[:JITTER] in local steps (e.g. 10 or 10:5)");
  }
  return Status::ok();
}

int run_gossip_sim(SimFlags& flags, const federation::StalenessFunction& staleness,
                   std::chrono::steady_clock::time_point wall_start) {
  const sim::SimulationOptions& o = flags.options;
  sim::GossipSimulationOptions g;
  g.peers = o.sites;
  g.partition = o.partition;
  g.model = o.model;
  g.init = o.init;
  g.rounds = o.rounds;
  g.local_steps = o.local_steps;
  g.local = o.local;
  g.compression = o.compression;
  g.compression_device = o.compression_device;
  g.seed = o.seed;
  Result<gossip::Topology> topology = gossip::parse_topology(flags.topology);
  if (!topology.is_ok()) return fail(flags, topology.status());
  g.topology = *topology;
  Result<gossip::MergeRule> merge = gossip::parse_merge_rule(flags.merge);
  if (!merge.is_ok()) return fail(flags, merge.status());
  g.merge = *merge;
  if (g.merge == gossip::MergeRule::kPushSum && flags.staleness_option->count() > 0) {
    return fail(flags, invalid_argument("--staleness weighs pairwise merges (--merge pairwise); push-sum takes "
                                        "staleness only as a cut-off (--max-staleness), because scaling the mass "
                                        "it carries would bias the average"));
  }
  if (g.merge == gossip::MergeRule::kReplicas &&
      (flags.topology_option->count() > 0 || flags.fanout_option->count() > 0)) {
    return fail(flags, invalid_argument("--topology and --fanout choose whom push-sum and pairwise send their model "
                                        "to; --merge replicas sends every update to every peer"));
  }
  if (flags.fanout_option->count() > 0 &&
      (g.topology == gossip::Topology::kExponential || g.topology == gossip::Topology::kOnePeerExponential)) {
    return fail(flags, invalid_argument("--fanout applies to the random and ring topologies: " + flags.topology +
                                        " picks its own peers (the members at distance 1, 2, 4, ...)"));
  }
  g.fanout = flags.fanout;
  g.staleness = staleness;
  g.loss = flags.loss;
  if (Status s = parse_delay(flags.delay, g); !s.is_ok()) return fail(flags, s);
  g.eval_every = flags.eval_every;
  if (Status s = g.validate(); !s.is_ok()) return fail(flags, s);

  Result<sim::SimulationData> data = load_simulation_data(flags);
  if (!data.is_ok()) return fail(flags, data.status());
  const bool text = data->tokens_per_byte > 0.0;
  const std::string merge_name = gossip::merge_rule_name(g.merge);
  const std::string topology_name =
      g.merge == gossip::MergeRule::kReplicas ? std::string("all-to-all") : gossip::topology_name(g.topology);
  if (flags.json) {
    emit_json({{"event", "start"}, {"command", "sim"}, {"mode", "gossip"}, {"sites", g.peers},
               {"partition", text ? o.text_partition : g.partition.to_string()}, {"topology", topology_name}, {"fanout", g.fanout},
               {"merge", merge_name}, {"rounds", g.rounds}, {"local_steps", g.local_steps}, {"model", g.model},
               {"seed", g.seed}, {"compression", g.compression.to_string()}, {"loss", g.loss},
               {"delay_steps", g.delay_steps}, {"delay_jitter_steps", g.delay_jitter_steps},
               {"staleness", g.staleness.to_string()}, {"max_staleness", g.staleness.max_staleness()},
               {"eval_every", g.eval_every}});
  } else {
    std::fprintf(stderr, "simulating %d gossip peers (%s) of %lld %s: %s merge on the %s topology, "
                 "%lld rounds of %lld local steps\n",
                 g.peers, text ? o.text_partition.c_str() : g.partition.to_string().c_str(),
                 static_cast<long long>(sample_count(*data)), data_description(flags, text).c_str(), merge_name.c_str(), topology_name.c_str(), static_cast<long long>(g.rounds),
                 static_cast<long long>(g.local_steps));
    std::fprintf(stderr, "shares compressed as %s; %.0f%% of messages lost; delay %lld+-%lld steps\n",
                 g.compression.to_string().c_str(), 100.0 * g.loss, static_cast<long long>(g.delay_steps),
                 static_cast<long long>(g.delay_jitter_steps));
  }
  Result<sim::GossipSimulationSummary> summary = sim::run_gossip_simulation(
      g, std::move(*data), [&](const sim::GossipSimulationRound& r) {
        if (flags.json) {
          nlohmann::json event = {{"event", "round"}, {"round", r.round}, {"virtual_time", r.virtual_time},
                                  {"messages_sent", r.messages_sent}, {"messages_lost", r.messages_lost},
                                  {"messages_merged", r.messages_merged}, {"messages_stale", r.messages_stale},
                                  {"messages_refused", r.messages_refused}, {"mean_staleness", r.mean_staleness},
                                  {"bytes", r.bytes}, {"bytes_sent", r.bytes_sent},
                                  {"wall_seconds", seconds_since(wall_start)}};
          if (r.evaluated) {
            event.update({{"test_accuracy", r.mean_test_accuracy}, {"min_test_accuracy", r.min_test_accuracy},
                          {"max_test_accuracy", r.max_test_accuracy}, {"test_loss", r.mean_test_loss},
                          {"max_model_distance", r.max_model_distance},
                          {"mean_model_distance", r.mean_model_distance}});
            if (text) event.update({{"bits_per_byte", r.mean_bits_per_byte}, {"max_bits_per_byte", r.max_bits_per_byte}});
          }
          emit_json(event);
          return;
        }
        std::fprintf(stderr, "round %4lld  sent %4lld  lost %3lld  merged %4lld  stale %3lld  %8.1f MB",
                     static_cast<long long>(r.round), static_cast<long long>(r.messages_sent),
                     static_cast<long long>(r.messages_lost), static_cast<long long>(r.messages_merged),
                     static_cast<long long>(r.messages_stale), static_cast<double>(r.bytes_sent) / 1e6);
        if (r.evaluated && text) {
          std::fprintf(stderr, "  held-out %.3f bits/byte (worst %.3f)  model distance %.4f", r.mean_bits_per_byte,
                       r.max_bits_per_byte, r.max_model_distance);
        } else if (r.evaluated) {
          std::fprintf(stderr, "  test accuracy %.2f%% (min %.2f%%)  loss %.4f  model distance %.4f",
                       100.0 * r.mean_test_accuracy, 100.0 * r.min_test_accuracy, r.mean_test_loss,
                       r.max_model_distance);
        }
        std::fprintf(stderr, "\n");
      });
  if (!summary.is_ok()) return fail(flags, summary.status());
  const double wall_seconds = seconds_since(wall_start);
  const sim::GossipSimulationRound& last = summary->last();
  if (flags.json) {
    nlohmann::json event = {
        {"event", "summary"}, {"command", "sim"}, {"mode", "gossip"},
        {"test_accuracy", last.mean_test_accuracy}, {"min_test_accuracy", last.min_test_accuracy},
        {"test_loss", last.mean_test_loss}, {"max_model_distance", last.max_model_distance},
        {"mean_model_distance", last.mean_model_distance}, {"rounds", summary->rounds.size()},
        {"bytes_sent", summary->bytes_sent}, {"bytes_received", summary->bytes_received},
        {"messages_sent", summary->messages_sent}, {"messages_lost", summary->messages_lost},
        {"messages_stale", summary->messages_stale}, {"messages_refused", summary->messages_refused},
        {"messages_in_flight", summary->messages_in_flight}, {"messages_duplicate", summary->messages_duplicate},
        {"updates_missed", summary->updates_missed}, {"virtual_time", last.virtual_time},
        {"wall_seconds", wall_seconds}};
    if (text) event.update({{"bits_per_byte", last.mean_bits_per_byte}, {"max_bits_per_byte", last.max_bits_per_byte}});
    emit_json(event);
  } else if (text) {
    std::printf("sim gossip %s %s: held-out %.3f bits/byte (worst peer %.3f), models within %.4f after %zu rounds, "
                "%.1f MB sent, %lld messages lost, %s\n",
                merge_name.c_str(), topology_name.c_str(), last.mean_bits_per_byte, last.max_bits_per_byte,
                last.max_model_distance, summary->rounds.size(), static_cast<double>(summary->bytes_sent) / 1e6,
                static_cast<long long>(summary->messages_lost), format_duration(wall_seconds).c_str());
  } else {
    std::printf("sim gossip %s %s: mean test accuracy %.2f%% (min %.2f%%), models within %.4f after %zu rounds, "
                "%.1f MB sent, %lld messages lost, %s\n",
                merge_name.c_str(), topology_name.c_str(), 100.0 * last.mean_test_accuracy,
                100.0 * last.min_test_accuracy, last.max_model_distance, summary->rounds.size(),
                static_cast<double>(summary->bytes_sent) / 1e6, static_cast<long long>(summary->messages_lost),
                format_duration(wall_seconds).c_str());
  }
  return 0;
}

int run_sim(SimFlags& flags) {
  const auto wall_start = std::chrono::steady_clock::now();
  sim::SimulationOptions& o = flags.options;
  if (flags.threads < 0 || flags.threads > kMaxThreads) return fail(flags, invalid_argument("--threads out of range"));
  set_cpu_threads(flags.threads);
  if (Status s = check_mode_flags(flags); !s.is_ok()) return fail(flags, s);
  const bool text = train::language_model_config(o.model).has_value();
  if (text) {
    // Language models split text as the nodes do (iid, books, contiguous, testament).
    if (Status s = train::data::check_text_partition(flags.partition); !s.is_ok()) return fail(flags, s);
    o.text_partition = flags.partition;
  } else {
    Result<train::data::PartitionSpec> partition = train::data::PartitionSpec::parse(flags.partition);
    if (!partition.is_ok()) return fail(flags, partition.status());
    o.partition = *partition;
  }
  Result<federation::StalenessFunction> staleness = federation::StalenessFunction::parse(flags.staleness, flags.max_staleness);
  if (!staleness.is_ok()) return fail(flags, staleness.status());
  o.local.optimizer = flags.local_optimizer;
  o.local.schedule = *LrSchedule::parse("constant");
  o.local.weight_decay = 0.0f;
  // Replicas' updates are compressed unless told otherwise (sparse after SGD,
  // less so for a language model; int4 after AdamW); push-sum and pairwise
  // send model states, dense.
  if (flags.mode == "gossip" && flags.compress_option->count() == 0) {
    flags.compress = flags.merge == "replicas" ? gossip::default_gossip_compression(
                                                     flags.local_optimizer, train::language_model_config(o.model).has_value())
                                               : "identity";
  }
  Result<protocol::CompressionPlan> plan =
      protocol::make_compression_plan(flags.compress, flags.compress_tensor, flags.dense_below);
  if (!plan.is_ok()) return fail(flags, plan.status());
  o.compression = *plan;
  if (flags.mode == "gossip") return run_gossip_sim(flags, *staleness, wall_start);
  o.secure = flags.mode == "private";
  o.secure_options.clip = static_cast<float>(flags.dp_clip);
  if (!o.secure && flags.dp_clip_option->count() > 0) {
    return fail(flags, invalid_argument("--dp-clip applies to --mode private (the sites clip before masking); in "
                                        "--mode aggregator bound updates with --norm-bound"));
  }

  Result<aggregator::ServerOptimizerOptions> server = aggregator::ServerOptimizerOptions::defaults_for(flags.strategy);
  if (!server.is_ok()) return fail(flags, server.status());
  if (flags.server_lr > 0.0f) server->lr = flags.server_lr;
  o.rounds_options.server = *server;
  if (Status s = aggregator::parse_rule(flags.rule, o.rounds_options); !s.is_ok()) return fail(flags, s);
  o.rounds_options.staleness = *staleness;
  if (flags.async_buffer < 0) return fail(flags, invalid_argument("--async K must be at least 1"));
  o.rounds_options.asynchronous = flags.async_buffer > 0 || flags.fedasync > 0.0;
  if (flags.async_buffer > 0) o.rounds_options.buffer_size = flags.async_buffer;
  o.rounds_options.fedasync_mixing = flags.fedasync;
  o.rounds_options.seed = o.seed;
  o.rounds_options.round_deadline_seconds =
      flags.deadline > 0.0 ? flags.deadline : 3.0 * static_cast<double>(o.local_steps);
  const size_t colon = flags.straggler.find(':');
  try {
    o.straggler_fraction = std::stod(flags.straggler.substr(0, colon));
    o.straggler_factor = colon == std::string::npos ? 1.0 : std::stod(flags.straggler.substr(colon + 1));
  } catch (const std::exception&) {
    return fail(flags, invalid_argument("--straggler '" + flags.straggler + "' is not P:FACTOR (e.g. 0.2:4)"));
  }
  if (Status s = o.validate(); !s.is_ok()) return fail(flags, s);

  Result<sim::SimulationData> data = load_simulation_data(flags);
  if (!data.is_ok()) return fail(flags, data.status());

  const std::string mode = o.rounds_options.asynchronous
                               ? (flags.fedasync > 0.0 ? "fedasync" : "fedbuff:" + std::to_string(flags.async_buffer))
                               : (o.secure ? "sync, private" : "sync");
  if (flags.json) {
    emit_json({{"event", "start"}, {"command", "sim"}, {"sites", o.sites},
               {"partition", text ? o.text_partition : o.partition.to_string()},
               {"strategy", flags.strategy}, {"rule", flags.rule}, {"mode", mode}, {"rounds", o.rounds},
               {"local_steps", o.local_steps}, {"model", o.model}, {"seed", o.seed},
               {"compression", o.compression.to_string()}});
  } else {
    std::fprintf(stderr, "simulating %d sites (%s) of %lld %s: %s, %s, rule %s, %lld rounds of %lld local steps\n",
                 o.sites, text ? o.text_partition.c_str() : o.partition.to_string().c_str(),
                 static_cast<long long>(sample_count(*data)), data_description(flags, text).c_str(),
                 mode.c_str(),
                 flags.strategy.c_str(), flags.rule.c_str(), static_cast<long long>(o.rounds),
                 static_cast<long long>(o.local_steps));
    std::fprintf(stderr, "updates compressed as %s\n", o.compression.to_string().c_str());
  }
  const bool dp = o.secure && o.dp_noise_multiplier > 0.0;
  if (dp) {
    if (!flags.json) std::fprintf(stderr, "%s\n", kSimulationNoiseNote);
    Result<std::unique_ptr<train::Sequential>> model =
        train::make_initial_model(o.model, o.seed, train::ModelInput{data->vocabulary, {}, 0, false}, o.init);
    if (!model.is_ok()) return fail(flags, model.status());
    int64_t parameters = 0;
    for (Parameter* p : (*model)->parameters()) parameters += p->value.numel();
    const int64_t per_round = o.rounds_options.sites_per_round > 0
                                  ? std::min<int64_t>(o.rounds_options.sites_per_round, o.sites)
                                  : static_cast<int64_t>(o.sites);
    const privacy::DpFedAvgNoiseScale scale =
        privacy::dp_fedavg_noise_scale(o.dp_noise_multiplier, per_round, parameters, o.rounds);
    if (scale.swamps()) {
      if (flags.json) {
        emit_json({{"event", "warning"}, {"kind", "dp_noise_swamps_signal"}, {"noise_to_signal", scale.noise_to_signal},
                   {"sites_per_round", per_round}, {"sites_needed", scale.sites_needed}, {"parameters", parameters},
                   {"rounds", o.rounds}, {"message", scale.message()}});
      }
      std::fprintf(stderr, "fedmesh sim: warning: %s\n", scale.message().c_str());
    }
  }
  Result<sim::SimulationSummary> summary =
      sim::run_simulation(o, std::move(*data), [&](const sim::SimulationRound& r) {
        double mean_staleness = 0.0;
        for (const auto& applied : r.record.applied) mean_staleness += static_cast<double>(applied.staleness);
        if (!r.record.applied.empty()) mean_staleness /= static_cast<double>(r.record.applied.size());
        if (flags.json) {
          nlohmann::json event = {{"event", "round"}, {"round", r.record.round}, {"version", r.record.version},
                                  {"updates", r.updates}, {"dropped", r.dropped}, {"mean_staleness", mean_staleness},
                                  {"test_accuracy", r.test_accuracy}, {"test_loss", r.test_loss},
                                  {"virtual_time", r.virtual_time}, {"bytes", r.bytes},
                                  {"wall_seconds", seconds_since(wall_start)}};
          if (r.epsilon >= 0.0) event["epsilon"] = r.epsilon;
          if (r.bits_per_byte >= 0.0) event["bits_per_byte"] = r.bits_per_byte;
          emit_json(event);
          return;
        }
        if (r.bits_per_byte >= 0.0) {
          std::fprintf(stderr, "round %4lld  version %4lld  updates %3lld  dropped %2lld  held-out loss %.4f  %.3f bits/byte\n",
                       static_cast<long long>(r.record.round), static_cast<long long>(r.record.version),
                       static_cast<long long>(r.updates), static_cast<long long>(r.dropped), r.test_loss,
                       r.bits_per_byte);
          return;
        }
        std::fprintf(stderr, "round %4lld  version %4lld  updates %3lld  dropped %2lld  staleness %.1f  test accuracy %.2f%%  loss %.4f",
                     static_cast<long long>(r.record.round), static_cast<long long>(r.record.version),
                     static_cast<long long>(r.updates), static_cast<long long>(r.dropped), mean_staleness,
                     100.0 * r.test_accuracy, r.test_loss);
        if (r.epsilon >= 0.0) std::fprintf(stderr, "  epsilon %.4f", r.epsilon);
        std::fprintf(stderr, "\n");
      });
  if (!summary.is_ok()) return fail(flags, summary.status());
  const double wall_seconds = seconds_since(wall_start);
  if (flags.json) {
    nlohmann::json event = {{"event", "summary"}, {"command", "sim"}, {"test_accuracy", summary->final_accuracy},
                            {"test_loss", summary->final_loss}, {"rounds", summary->rounds.size()},
                            {"bytes_sent", summary->bytes_sent}, {"bytes_received", summary->bytes_received},
                            {"refused_updates", summary->refused_updates}, {"virtual_time", summary->virtual_time},
                            {"resumed_from_round", summary->resumed_from_round}, {"wall_seconds", wall_seconds}};
    if (o.secure) event["mode"] = "private";
    if (summary->final_bits_per_byte >= 0.0) event["bits_per_byte"] = summary->final_bits_per_byte;
    if (summary->epsilon >= 0.0) {
      event["epsilon"] = summary->epsilon;
      event["delta"] = summary->delta;
      event["dp_noise"] = "seeded";
      event["dp_noise_note"] = kSimulationNoiseNote;
    }
    emit_json(event);
  } else if (summary->final_bits_per_byte >= 0.0) {
    std::printf("sim %s %s: held-out %.3f bits/byte (loss %.4f) after %zu server steps, %.1f MB sent by sites, %s\n",
                mode.c_str(), flags.strategy.c_str(), summary->final_bits_per_byte, summary->final_loss,
                summary->rounds.size(), static_cast<double>(summary->bytes_sent) / 1e6,
                format_duration(wall_seconds).c_str());
  } else {
    std::printf("sim %s %s: test accuracy %.2f%% after %zu server steps, %.1f MB sent by sites, %s\n", mode.c_str(),
                flags.strategy.c_str(), 100.0 * summary->final_accuracy, summary->rounds.size(),
                static_cast<double>(summary->bytes_sent) / 1e6, format_duration(wall_seconds).c_str());
  }
  if (!flags.json && summary->epsilon >= 0.0) {
    std::printf("differential privacy (DP-FedAvg, noise %g, delta %g): epsilon %.4f spent over %zu rounds\n%s\n",
                o.dp_noise_multiplier, summary->delta, summary->epsilon, summary->rounds.size(), kSimulationNoiseNote);
  }
  return 0;
}

}  // namespace

void add_sim_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<SimFlags>();
  sim::SimulationOptions& o = flags->options;
  o.local.batch_size = 32;
  o.local.lr = 0.05f;
  CLI::App* cmd = app.add_subcommand(
      "sim", "Simulate a federation in one process: virtual sites with their own data shards, the real round "
             "manager, strategies and staleness rules (--mode aggregator), or virtual peers gossiping with no "
             "server (--mode gossip); deterministic for a seed.");
  std::vector<CLI::Option*>& aggregator_only = flags->aggregator_only;
  std::vector<CLI::Option*>& gossip_only = flags->gossip_only;
  cmd->add_option("--mode", flags->mode,
                  "aggregator: sites and the real round manager; gossip: peers that train and gossip their models "
                  "with no server (--topology, --fanout, --merge, --loss, --delay, --eval-every); private: the "
                  "aggregator path through secure aggregation (the real protocol in one process: the mean of the "
                  "survivors' clipped updates, --dp-clip, --dp-noise)")
      ->check(CLI::IsMember({"aggregator", "gossip", "private"}))
      ->capture_default_str();
  cmd->add_option("--sites", o.sites, "Virtual sites (gossip: peers)")->capture_default_str();
  cmd->add_option("--partition", flags->partition,
                  "How the training set is split: iid, dirichlet:A or shards:K (images); iid, books, contiguous or "
                  "testament (text, as the nodes split it)")
      ->capture_default_str();
  cmd->add_option("--model", o.model,
                  "mlp or cnn (Fashion-MNIST), or a language model: gpt-nano, gpt-tiny, gpt-small, gpt2 (text, byte "
                  "tokens; reports held-out bits per byte), or a model spec file FILE.toml (docs/models.md)")
      ->check(model_name_check())
      ->capture_default_str();
  cmd->add_option("--init", o.init.path,
                  "Version 0 from these weights instead of the seed (as train --init): a federation fine-tuning a "
                  "pretrained model");
  cmd->add_option("--init-format", o.init.format, "fedmesh, or hf-gpt2 (Hugging Face's GPT-2 layout)")
      ->check(CLI::IsMember({"fedmesh", "hf-gpt2"}))
      ->capture_default_str();
  cmd->add_option("--lora-rank", o.init.lora.rank,
                  "Fine-tune by LoRA: every site trains and sends only the B factors of rank-R adapters (as train "
                  "--lora-rank; docs/models.md); the bytes reported are theirs. 0: off")
      ->capture_default_str();
  cmd->add_option("--lora-alpha", o.init.lora.alpha, "LoRA's alpha (0: 2 x rank)")->capture_default_str();
  cmd->add_option("--lora-targets", o.init.lora.targets, "Globs over parameter names of the weights to adapt (none: every weight)")
      ->expected(1, -1);
  aggregator_only.push_back(cmd->add_option("--strategy", flags->strategy,
                  "Server optimizer: fedavg, fedavgm, fedadam, fedyogi, fedadagrad or diloco")
      ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--server-lr", flags->server_lr, "Server learning rate (default: the strategy's)"));
  aggregator_only.push_back(
      cmd->add_option("--rule", flags->rule,
                      "Aggregation: mean (sample- and staleness-weighted), median, trimmed_mean[:BETA], krum[:F[:M]]")
          ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--norm-bound", o.rounds_options.norm_bound, "Scale each update to at most this L2 norm (0: off)")
          ->capture_default_str());
  cmd->add_option("--rounds", o.rounds, "Rounds (synchronous), server steps (asynchronous) or gossip rounds")
      ->capture_default_str();
  aggregator_only.push_back(
      cmd->add_option("--sites-per-round", o.rounds_options.sites_per_round, "Sites sampled per round (0: all)")
          ->capture_default_str());
  cmd->add_option("--local-steps", o.local_steps, "Local optimizer steps per site (peer) per round")
      ->capture_default_str();
  cmd->add_option("--batch-size", o.local.batch_size, "Local batch size")->capture_default_str();
  cmd->add_option("--lr", o.local.lr, "Local learning rate")->capture_default_str();
  cmd->add_option("--optimizer", flags->local_optimizer, "Local optimizer: sgd or adamw")->capture_default_str();
  cmd->add_option("--momentum", o.local.momentum, "Local SGD momentum")->capture_default_str();
  aggregator_only.push_back(
      cmd->add_option("--async", flags->async_buffer,
                      "Asynchronous FedBuff: apply an aggregate every K updates (0: synchronous rounds)")
          ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--fedasync", flags->fedasync, "Asynchronous FedAsync with this mixing alpha (0: off)")
          ->capture_default_str());
  flags->staleness_option =
      cmd->add_option("--staleness", flags->staleness,
                      "s(tau): constant, polynomial:A, hinge:A:B or inverse (gossip: weighs --merge pairwise steps, "
                      "tau in the receiver's rounds)")
          ->capture_default_str();
  cmd->add_option("--max-staleness", flags->max_staleness,
                  "Drop updates (gossip: messages) staler than this (-1: no cut-off)")
      ->capture_default_str();
  aggregator_only.push_back(
      cmd->add_option("--deadline", flags->deadline,
                      "Synchronous round deadline in virtual time (local-step units; 0: 3 x local steps)")
              ->check(CLI::NonNegativeNumber));
  aggregator_only.push_back(
      cmd->add_option("--dropout", o.dropout, "Chance that a sampled site never reports in a round")
          ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--straggler", flags->straggler, "P:FACTOR: a share P of the sites is FACTOR times slower")
          ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--poisoned", o.poisoned_sites, "Sites that send -10x their update (robustness experiments)")
          ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--db", o.db,
                      "Checkpoint store: every round is committed before it is reported; the same command resumes "
                      "from the newest intact round (synchronous rounds only)"));
  flags->topology_option =
      cmd->add_option("--topology", flags->topology,
                      "Gossip: whom a peer sends to each round: random (--fanout peers drawn anew), ring (the next "
                      "--fanout peers), exponential (the peers at distance 1, 2, 4, ...) or one-peer-exponential "
                      "(one of those per round, in turn); push-sum and pairwise only")
          ->capture_default_str();
  gossip_only.push_back(flags->topology_option);
  flags->fanout_option =
      cmd->add_option("--fanout", flags->fanout, "Gossip: peers per round for random and ring")->capture_default_str();
  gossip_only.push_back(flags->fanout_option);
  gossip_only.push_back(
      cmd->add_option("--merge", flags->merge,
                      "Gossip: replicas (every peer applies every peer's compressed update, spread through the "
                      "topology and pulled when lost: identical models; any --compress but powersgd), push-sum "
                      "(model states; weights travel with the values: the network average is kept) or pairwise "
                      "(x <- (1 - s/2) x + (s/2) x_peer, s = s(tau) from --staleness)")
          ->capture_default_str());
  gossip_only.push_back(
      cmd->add_option("--loss", flags->loss, "Gossip: chance that a message is lost on the way")
          ->capture_default_str());
  gossip_only.push_back(
      cmd->add_option("--delay", flags->delay,
                      "Gossip: STEPS[:JITTER]: messages arrive STEPS +- JITTER local steps late (uniform); a late "
                      "one is merged at the end of the round it arrives in, its staleness the receiver's rounds since")
          ->capture_default_str());
  gossip_only.push_back(
      cmd->add_option("--eval-every", flags->eval_every,
                      "Gossip: evaluate every peer on the test set every K rounds (and after the last)")
          ->capture_default_str());
  flags->compress_option =
      cmd->add_option("--compress", flags->compress,
                      std::string("How sites compress their updates, with error feedback: identity, fp16, bf16, "
                                  "int8|int4[:stochastic][:block=N], topk:F[+fp16|+int8|+fp32][:warmup=R][:momentum=M], "
                                  "powersgd:R, dct-sign:K (docs/compression.md); gossip replicas default to ") +
                          gossip::kSgdGossipCompression + " after --optimizer sgd (" +
                          gossip::kSgdLanguageModelGossipCompression + " for a language model) and to " +
                          gossip::kAdamGossipCompression +
                          " after adamw; push-sum and pairwise default to identity and take the dense ones only "
                          "(identity, fp16, bf16, int8, int4)")
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
  cmd->add_option("--data", flags->data,
                  "fashion-mnist or a directory with the four IDX files; your own data (csv:FILE with --label, "
                  "images:DIR, arrays:FILE: split among the sites by --partition, tested on --test-data or "
                  "--test-fraction of it; docs/data.md); language models: bible-kjv (the default) or a directory of "
                  ".txt files")
      ->capture_default_str();
  add_own_data_flags(cmd, flags->own);
  cmd->add_option("--train-limit", flags->train_limit,
                  "Use only the first N training images (0 = all); language models: N windows per site")
      ->capture_default_str();
  cmd->add_option("--test-limit", flags->test_limit,
                  "Evaluate on only the first N test images (0 = all); language models: N held-out windows")
      ->capture_default_str();
  cmd->add_option("--threads", flags->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed for the split, sampling, dropouts and training")->capture_default_str();
  flags->dp_clip_option = cmd->add_option("--dp-clip", flags->dp_clip,
                                          "--mode private: the L2 norm each site clips its update to before masking")
                              ->capture_default_str();
  aggregator_only.push_back(flags->dp_clip_option);
  aggregator_only.push_back(cmd->add_option("--dp-noise", o.dp_noise_multiplier,
                  "--mode private: DP-FedAvg noise multiplier sigma: N(0, (sigma clip / k)^2) on the mean of k "
                  "updates; the summary reports epsilon (RDP accountant, q = sites per round / sites)")
      ->capture_default_str());
  aggregator_only.push_back(
      cmd->add_option("--dp-delta", o.dp_delta, "--mode private: the delta epsilon is reported at")->capture_default_str());
  cmd->add_flag("--json", flags->json, "Print JSON lines; the last is {\"event\":\"summary\",...}");
  cmd->callback([flags, &exit_code] { exit_code = run_sim(*flags); });
}

}  // namespace fedmesh::cli
