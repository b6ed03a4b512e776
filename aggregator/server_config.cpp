#include "aggregator/server_config.h"

#include <string>

#include "base/http_endpoint.h"
#include "base/toml_input.h"
#include "privacy/dp_settings.h"
#include "federation/staleness.h"
#include "protocol/fault_injection.h"
#include "train/model.h"

namespace fedmesh::aggregator {

Status AggregatorConfig::validate() const {
  if (federation.empty()) return invalid_argument("federation is required");
  FEDMESH_RETURN_IF_ERROR(protocol::parse_fault_plan(faults).status());
  FEDMESH_RETURN_IF_ERROR(init.lora.validate());
  if (keys.empty() || roster.empty() || admin_public.empty()) {
    return invalid_argument("keys, roster and admin_public are required");
  }
  if (rounds < 0) return invalid_argument("rounds must be >= 0");
  if (local_steps < 1) return invalid_argument("local_steps must be >= 1");
  if (min_sites < 1) return invalid_argument("min_sites must be >= 1");
  if (!(site_timeout_seconds > 0.0)) return invalid_argument("site_timeout_seconds must be > 0");
  if (!(linger_seconds >= 0.0)) return invalid_argument("linger_seconds must be >= 0");
  if (staging_mb < 0 || staging_mb > (int64_t{1} << 30)) {
    return invalid_argument("staging_mb must be in [0, 2^30] (0: the larger of 256 MB and two models)");
  }
  if (serving_mb < 0 || serving_mb > (int64_t{1} << 30)) {
    return invalid_argument("serving_mb must be in [0, 2^30] (0: 128 MB of model chunks for all downloads at once)");
  }
  if (validation_limit < 0) return invalid_argument("validation_limit must be >= 0");
  if (data.source != train::data::DataSource().source) {
    return invalid_argument("data.source: the aggregator trains on nothing; it evaluates on `validation` (csv:FILE or "
                            "images:DIR for own data), which the other data.* keys describe");
  }
  if (train::data::is_token_shard(validation) && !train::language_model_config(model)) {
    return invalid_argument("validation = \"" + validation + "\": token shards are for the language models (gpt-*), "
                            "not model '" + model + "'");
  }
  if (!tokenizer.empty() && !train::language_model_config(model)) {
    return invalid_argument("tokenizer applies to the language models (gpt-*), not to model '" + model + "'");
  }
  if (!metrics.empty()) {
    std::string host;
    int port = 0;
    if (Status s = parse_host_port(metrics, host, port); !s.is_ok()) return invalid_argument("metrics: " + s.message());
    if (!metrics_token.empty()) {
      if (Status s = check_access_token(metrics_token); !s.is_ok()) return invalid_argument("metrics_token: " + s.message());
    } else if (!is_loopback_host(host)) {
      return invalid_argument("metrics = \"" + metrics + "\" serves /dashboard, /status and /metrics beyond this machine: "
                              "set metrics_token (or --metrics-token, or FEDMESH_METRICS_TOKEN) to an access token of at "
                              "least " + std::to_string(kMinAccessTokenChars) + " characters (e.g. `openssl rand -hex "
                              "32`), or bind it to 127.0.0.1");
    }
  }
  if (privacy_mode != "trusted" && privacy_mode != "private") {
    return invalid_argument("privacy.mode must be trusted or private, not '" + privacy_mode + "'");
  }
  if (is_private()) {
    if (rounds_options.asynchronous) {
      return invalid_argument("privacy.mode = \"private\" needs rounds_mode = \"sync\": secure aggregation sums one "
                              "round's sites together, and FedBuff/FedAsync apply updates one by one");
    }
    if (rounds_options.rule != "mean") {
      return invalid_argument("rule '" + rounds_options.rule + "' needs each site's update, which privacy.mode = "
                              "\"private\" hides from the aggregator (secure aggregation reveals only the sum): use "
                              "rule = \"mean\", or privacy.mode = \"trusted\" for median, trimmed mean and Krum");
    }
    if (rounds_options.norm_bound > 0.0) {
      return invalid_argument("norm_bound: in private mode the aggregator never sees an update to bound; sites clip "
                              "theirs before masking, to secure_aggregation.clip");
    }
    if (rounds_options.fold_late_updates) {
      return invalid_argument("fold_late_updates: a late site's masked input cannot join another round's sum");
    }
  }
  FEDMESH_RETURN_IF_ERROR(privacy::check_dp_settings({std::nullopt, dp_noise_multiplier, dp_delta, dp_target_epsilon},
                                                      privacy::kDpConfigKeys));
  if (dp_noise_multiplier > 0.0 && !is_private()) {
    return invalid_argument("dp.noise_multiplier: site-level DP-FedAvg needs privacy.mode = \"private\", whose "
                            "equal-weight sum of clipped updates bounds what one site changes (to "
                            "secure_aggregation.clip)");
  }
  FEDMESH_RETURN_IF_ERROR(store_options.validate());
  return rounds_options.validate();
}

Result<AggregatorConfig> read_aggregator_config(const std::string& path, const AggregatorConfigOverrides& overrides) {
  Result<toml::table> table = read_toml_file(path);
  if (!table.is_ok()) return table.status();
  AggregatorConfig c;
  ConfigReader r(*table, path);
  r.require("federation", c.federation);
  r.read("name", c.name);
  r.read("listen", c.listen);
  r.require("keys", c.keys);
  r.require("roster", c.roster);
  r.require("admin_public", c.admin_public);
  r.read("store", c.store);
  r.read("metrics", c.metrics);
  r.read("metrics_token", c.metrics_token);
  r.read("model", c.model);
  r.read("seed", c.seed);
  r.read("init", c.init.path);
  r.read("init_format", c.init.format);
  r.read("init_partial", c.init.partial);
  train::read_lora_keys(r, c.init.lora);
  r.read("rounds", c.rounds);
  r.read("local_steps", c.local_steps);
  r.read("min_sites", c.min_sites);
  r.read("site_timeout_seconds", c.site_timeout_seconds);
  r.read("linger_seconds", c.linger_seconds);
  r.read("staging_mb", c.staging_mb);
  r.read("staging_dir", c.staging_dir);
  r.read("serving_mb", c.serving_mb);
  r.read("transport.faults", c.faults);
  r.read("validation", c.validation);
  r.read("validation_limit", c.validation_limit);
  train::data::read_data_source(r, c.data);
  r.read("tokenizer", c.tokenizer);
  r.read("keep_last", c.store_options.keep_last);
  r.read("privacy.mode", c.privacy_mode);
  int64_t threshold = 0, fraction_bits = c.secure.fraction_bits;
  double clip = c.secure.clip;
  r.read("secure_aggregation.threshold", threshold);
  r.read("secure_aggregation.phase_seconds", c.secure.phase_seconds);
  r.read("secure_aggregation.clip", clip);
  r.read("secure_aggregation.fraction_bits", fraction_bits);
  if (threshold < 0 || threshold > 255) return invalid_argument(path + ": secure_aggregation.threshold must be in 0..255");
  if (fraction_bits < 0 || fraction_bits > 24) return invalid_argument(path + ": secure_aggregation.fraction_bits must be in 0..24");
  c.secure.threshold = static_cast<uint32_t>(threshold);
  c.secure.fraction_bits = static_cast<int>(fraction_bits);
  c.secure.clip = static_cast<float>(clip);
  r.read("dp.noise_multiplier", c.dp_noise_multiplier);
  r.read("dp.delta", c.dp_delta);
  r.read("dp.target_epsilon", c.dp_target_epsilon);
  c.store_options.best_metric = "test_accuracy";
  RoundOptions& o = c.rounds_options;
  std::string mode = "sync", strategy = "fedavg", rule = "mean", staleness = "polynomial:0.5";
  int64_t max_staleness = -1;
  double server_lr = 0.0;
  r.read("rounds_mode", mode);
  r.read("sites_per_round", o.sites_per_round);
  r.read("min_updates", o.min_updates);
  r.read("deadline_seconds", o.round_deadline_seconds);
  r.read("fold_late_updates", o.fold_late_updates);
  r.read("buffer_size", o.buffer_size);
  r.read("fedasync_mixing", o.fedasync_mixing);
  r.read("staleness", staleness);
  r.read("max_staleness", max_staleness);
  r.read("strategy", strategy);
  r.read("server_lr", server_lr);
  r.read("rule", rule);
  r.read("norm_bound", o.norm_bound);
  r.read("max_sample_count", o.max_sample_count);
  FEDMESH_RETURN_IF_ERROR(r.finish());
  if (mode == "sync") {
    o.asynchronous = false;
  } else if (mode == "fedbuff") {
    o.asynchronous = true;
    o.fedasync_mixing = 0.0;
  } else if (mode == "fedasync") {
    o.asynchronous = true;
    if (o.fedasync_mixing <= 0.0) o.fedasync_mixing = 0.5;
  } else {
    return invalid_argument(path + ": rounds_mode '" + mode + "' is not sync, fedbuff or fedasync");
  }
  Result<ServerOptimizerOptions> server = ServerOptimizerOptions::defaults_for(strategy);
  if (!server.is_ok()) return invalid_argument(path + ": " + server.status().message());
  if (server_lr > 0.0) server->lr = static_cast<float>(server_lr);
  o.server = *server;
  if (Status s = parse_rule(rule, o); !s.is_ok()) return invalid_argument(path + ": " + s.message());
  Result<federation::StalenessFunction> s = federation::StalenessFunction::parse(staleness, max_staleness);
  if (!s.is_ok()) return invalid_argument(path + ": " + s.status().message());
  o.staleness = *s;
  o.seed = c.seed;
  if (overrides.metrics) c.metrics = *overrides.metrics;
  if (overrides.metrics_token) c.metrics_token = *overrides.metrics_token;
  if (Status v = c.validate(); !v.is_ok()) return invalid_argument(path + ": " + v.message());
  return c;
}

}  // namespace fedmesh::aggregator
