#include "cli/stats_command.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/toml_input.h"
#include "cli/data_flags.h"
#include "cli/output.h"
#include "aggregator/secure_stats.h"
#include "aggregator/server_config.h"
#include "federation/stats_exchange.h"
#include "federation/stats_fixed_point.h"
#include "node/secure_upload.h"
#include "node/site_config.h"
#include "train/data/data_stats.h"

namespace fedmesh::cli {

namespace {

struct StatsFlags {
  train::data::DataSource data;
  std::string config;  // a site or aggregator config: its data.* keys
  std::vector<std::string> inputs;
  std::string out;
  bool json = false;
  double timeout_seconds = 600.0;  // serve / send
  double linger_seconds = 10.0;    // serve
};

// serve / send: their events as JSON lines, or one line each on stderr.
federation::StatsEventSink stats_events(const StatsFlags& flags, const char* who) {
  return [json = flags.json, who](const nlohmann::json& e) {
    if (json) {
      emit_json(e);
      return;
    }
    const std::string kind = e.value("event", "");
    if (kind == "listening") {
      std::fprintf(stderr, "[%s] waiting for the sums of %zu site(s) on %s\n", who, e["sites"].size(),
                   e.value("endpoint", "").c_str());
    } else if (kind == "stats_report") {
      std::fprintf(stderr, "[%s] sums of %lld features from %s\n", who,
                   static_cast<long long>(e.value("features", 0)), e.value("site", "").c_str());
    } else if (kind == "refused") {
      std::fprintf(stderr, "[%s] refused %s (%s): %s\n", who, e.value("site", "").c_str(), e.value("code", "").c_str(),
                   e.value("reason", "").c_str());
    } else if (kind == "waiting") {
      std::fprintf(stderr, "[%s] the aggregator still waits for %s\n", who, e.value("for", "").c_str());
    } else if (kind == "secure_session") {
      std::fprintf(stderr, "[%s] secure-aggregation session %s over %zu site(s), threshold %lld\n", who,
                   e.value("session", "").c_str(), e.contains("invited") && e["invited"].is_array() ? e["invited"].size() : 0,
                   static_cast<long long>(e.value("threshold", 0)));
    } else if (kind == "secure_session_aborted") {
      std::fprintf(stderr, "[%s] secure-aggregation session aborted: %s\n", who, e.value("reason", "").c_str());
    } else if (kind == "masked_sum") {
      std::fprintf(stderr, "[%s] the masked sums of %zu site(s) added up (no site's own sums were seen)\n", who,
                   e["contributors"].size());
    } else if (kind == "secure_join") {
      std::fprintf(stderr, "[%s] every site named its features: sending this site's sums masked (%lld words)\n", who,
                   static_cast<long long>(e.value("words", 0)));
    } else if (kind == "masked" && !e.value("contributed", false)) {
      std::fprintf(stderr, "[%s] the secure-aggregation session finished without this site's sums\n", who);
    } else if (kind == "merged") {
      std::fprintf(stderr, "[%s] the federation's statistics (%lld sites, %s) written to %s\n", who,
                   static_cast<long long>(e.value("parts", 0)), e.value("digest", "").c_str(),
                   e.value("out", "").c_str());
    }
  };
}

int fail(const StatsFlags& flags, const Status& status) {
  return report_failure("stats", flags.json, status, status.code() == StatusCode::kIoError ? 1 : 2);
}

void print_stats(const train::data::DataStats& stats) {
  const std::vector<double> mean = stats.mean(), std = stats.std();
  std::printf("%s statistics of %lld node(s), digest %s\n", stats.kind.c_str(), static_cast<long long>(stats.parts),
              stats.digest().c_str());
  std::printf("%-32s %12s %14s %14s\n", "feature", "count", "mean", "std");
  for (size_t i = 0; i < stats.features.size(); ++i) {
    std::printf("%-32s %12lld %14.6g %14.6g\n", stats.features[i].name.substr(0, 32).c_str(),
                static_cast<long long>(stats.features[i].count), mean[i], std[i]);
  }
}

int finish(const StatsFlags& flags, const std::string& action, const train::data::DataStats& stats) {
  if (!flags.out.empty()) {
    if (Status s = train::data::write_data_stats(stats, flags.out); !s.is_ok()) return fail(flags, s);
  }
  if (flags.json) {
    nlohmann::json summary = nlohmann::json::parse(stats.to_json());
    summary["event"] = "summary";
    summary["command"] = "stats " + action;
    if (!flags.out.empty()) summary["out"] = flags.out;
    emit_json(summary);
    return 0;
  }
  print_stats(stats);
  if (!flags.out.empty()) std::fprintf(stderr, "wrote %s\n", flags.out.c_str());
  return 0;
}

int run_compute(StatsFlags flags) {
  if (!flags.config.empty()) {
    Result<toml::table> table = read_toml_file(flags.config);
    if (!table.is_ok()) return fail(flags, table.status());
    ConfigReader reader(*table, flags.config);
    train::data::read_data_source(reader, flags.data);
    // Only data.* is read here: the config's other keys are not this command's.
    const Status read = reader.finish();
    if (!read.is_ok() && read.message().find("unknown key") == std::string::npos) return fail(flags, read);
  }
  Result<train::data::DataStats> stats = train::data::compute_data_stats(flags.data);
  if (!stats.is_ok()) return fail(flags, stats.status());
  if (!flags.json) {
    std::fprintf(stderr, "the sums over this node's training part (%s); no row is in them. Send the file to the "
                 "federation's admin, who adds every node's up with `fedmesh stats merge`.\n",
                 flags.data.source.c_str());
  }
  return finish(flags, "compute", *stats);
}

int run_merge(const StatsFlags& flags) {
  std::vector<train::data::DataStats> parts;
  for (const std::string& input : flags.inputs) {
    Result<train::data::DataStats> read = train::data::read_data_stats(input);
    if (!read.is_ok()) return fail(flags, read.status());
    parts.push_back(std::move(*read));
  }
  Result<train::data::DataStats> merged = train::data::merge_data_stats(parts);
  if (!merged.is_ok()) return fail(flags, merged.status());
  if (!flags.json) {
    std::fprintf(stderr, "every node and the aggregator set data.normalize = \"stats:%s\" (the same file)\n",
                 flags.out.empty() ? "FILE" : flags.out.c_str());
  }
  return finish(flags, "merge", *merged);
}

// Who the config says this node is.
template <class Config>
federation::StatsMembership membership_of(const Config& config) {
  return {config.keys, config.name, config.roster, config.admin_public, config.federation};
}

// serve / send: the federation's statistics, already written to --out, shown.
int finish_exchange(StatsFlags flags, const std::string& action, Result<train::data::DataStats> merged) {
  if (!merged.is_ok()) {
    return report_failure("stats", flags.json, merged.status(),
                          merged.status().code() == StatusCode::kUnavailable ? 1 : 2);
  }
  flags.out.clear();  // written already
  return finish(flags, action, *merged);
}

int run_serve(const StatsFlags& flags) {
  Result<aggregator::AggregatorConfig> config = aggregator::read_aggregator_config(flags.config);
  if (!config.is_ok()) return fail(flags, config.status());
  federation::StatsServeOptions options;
  options.listen = config->listen;
  options.member = membership_of(*config);
  options.out = flags.out;
  options.timeout_seconds = flags.timeout_seconds;
  options.linger_seconds = flags.linger_seconds;
  std::optional<aggregator::SecureStatsSum> masked;
  const federation::StatsEventSink emit = stats_events(flags, "aggregator");
  std::optional<crypto::Roster> roster;  // the session's, outliving it
  if (config->is_private()) {  // the sums are taken masked, in a secure-aggregation session over the roster's sites
    Result<crypto::Membership> membership = crypto::load_membership(config->keys, config->name, config->roster,
                                                                    config->admin_public, config->federation);
    if (!membership.is_ok()) return fail(flags, membership.status());
    roster = std::move(membership->roster);
    masked.emplace(config->secure, *roster, config->federation, emit);
    options.masked = &*masked;
  }
  if (train::data::is_own_data(config->validation)) {
    // What every site's sums must describe: the features of the validation data.
    train::data::DataSource validation = config->data;
    validation.source = config->validation;
    validation.test.clear();
    Result<train::data::DataStats> expected = train::data::compute_data_stats(validation);
    if (!expected.is_ok()) return fail(flags, expected.status());
    options.expected = std::move(*expected);
  }
  return finish_exchange(flags, "serve", federation::serve_stats(options, emit));
}

int run_send(StatsFlags flags) {
  Result<node::SiteConfig> config = node::read_site_config(flags.config);
  if (!config.is_ok()) return fail(flags, config.status());
  Result<train::data::DataStats> mine = train::data::compute_data_stats(config->data);
  if (!mine.is_ok()) return fail(flags, mine.status());
  federation::StatsSendOptions options;
  options.aggregator = config->aggregator;
  options.aggregator_name = config->aggregator_name;
  options.member = membership_of(*config);
  options.out = flags.out;
  options.timeout_seconds = flags.timeout_seconds;
  const federation::StatsEventSink emit = stats_events(flags, config->name.c_str());
  if (config->privacy_mode == "private") {
    // The sums leave this site masked, in the aggregator's session.
    options.masked = [emit](protocol::ClientChannel& socket, const crypto::Membership& member,
                            std::span<const uint32_t> words) -> Result<bool> {
      Result<node::SecureUploadOutcome> outcome = node::secure_upload_words(
          socket, member.keys, member.roster, federation::stats_secagg_label(member.roster.federation), 0, 0, words,
          node::SecureUploadOptions{}, emit);
      if (!outcome.is_ok()) return outcome.status();
      return outcome->contributed;
    };
  }
  return finish_exchange(flags, "send", federation::send_stats(options, *mine, emit));
}

int run_show(const StatsFlags& flags) {
  Result<train::data::DataStats> read = train::data::read_data_stats(flags.inputs.at(0));
  if (!read.is_ok()) return fail(flags, read.status());
  return finish(flags, "show", *read);
}

}  // namespace

void add_stats_command(CLI::App& app, int& exit_code) {
  CLI::App* cmd = app.add_subcommand(
      "stats",
      "Normalization statistics a federation computes together without sharing a row: each node's sums "
      "(`compute`) added up by the admin (`merge`), or sent through the aggregator (`serve` there, `send` at each "
      "site); every node then reads them as data.normalize = \"stats:FILE\"");
  cmd->require_subcommand(1);

  auto compute = std::make_shared<StatsFlags>();
  CLI::App* c = cmd->add_subcommand("compute", "This node's count, sum and sum of squares per numeric feature "
                                               "(tables) or channel (images) over its training part");
  c->add_option("--config", compute->config, "A site or aggregator config: its data.* keys describe the data");
  c->add_option("--data", compute->data.source, "csv:FILE or images:DIR (as `fedmesh train --data`)");
  add_own_data_flags(c, compute->data);  // the test part is not counted; regression: the target's statistics last
  c->add_option("--out", compute->out, "Write the statistics here (JSON)");
  c->add_flag("--json", compute->json, "Print one JSON summary line");
  c->callback([compute, &exit_code] { exit_code = run_compute(*compute); });

  auto merge = std::make_shared<StatsFlags>();
  CLI::App* m = cmd->add_subcommand("merge", "Add up the nodes' statistics files (the same features, in order)");
  m->add_option("files", merge->inputs, "Statistics files from `fedmesh stats compute`")->required();
  m->add_option("--out", merge->out, "Write the federation's statistics here")->required();
  m->add_flag("--json", merge->json, "Print one JSON summary line");
  m->callback([merge, &exit_code] { exit_code = run_merge(*merge); });

  auto serve = std::make_shared<StatsFlags>();
  CLI::App* sv = cmd->add_subcommand(
      "serve", "As the aggregator, before the federation trains: take every roster site's sums (`stats send`) on "
               "the aggregator's endpoint, add them up, write them and send them back to each site; then exit. "
               "With privacy.mode = \"private\" the sums are added up by secure aggregation: only their total is "
               "seen here");
  sv->add_option("--config", serve->config, "The aggregator's config (agg.toml): endpoint, keys, roster")->required();
  sv->add_option("--out", serve->out, "Write the federation's statistics here")->required();
  sv->add_option("--timeout", serve->timeout_seconds, "Give up (exit 1) when not every site has sent by then (seconds)")
      ->capture_default_str();
  sv->add_option("--linger", serve->linger_seconds, "After merging, keep answering sites that ask again (seconds)")
      ->capture_default_str();
  sv->add_flag("--json", serve->json, "JSON lines: listening, stats_report, refused, merged, then a summary");
  sv->callback([serve, &exit_code] { exit_code = run_serve(*serve); });

  auto send = std::make_shared<StatsFlags>();
  CLI::App* sd = cmd->add_subcommand(
      "send", "As a site: compute this site's sums (its config's data.*), send them to the aggregator's `stats "
              "serve` (masked, in a secure-aggregation session, with privacy.mode = \"private\"), and write the "
              "federation's statistics it sends back");
  sd->add_option("--config", send->config, "The site's config (site.toml): data, endpoint, keys, roster")->required();
  sd->add_option("--out", send->out, "Write the federation's statistics here")->required();
  sd->add_option("--timeout", send->timeout_seconds, "Give up (exit 1) when they have not come back by then (seconds)")
      ->capture_default_str();
  sd->add_flag("--json", send->json, "JSON lines: waiting, merged, then a summary");
  sd->callback([send, &exit_code] { exit_code = run_send(*send); });

  auto show = std::make_shared<StatsFlags>();
  CLI::App* s = cmd->add_subcommand("show", "Print a statistics file: count, mean and std per feature");
  s->add_option("file", show->inputs, "A statistics file")->required()->expected(1);
  s->add_flag("--json", show->json, "Print one JSON summary line");
  s->callback([show, &exit_code] { exit_code = run_show(*show); });
}

}  // namespace fedmesh::cli
