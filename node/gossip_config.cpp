#include "node/gossip_config.h"

#include <cmath>
#include <string>

#include "base/toml_input.h"
#include "federation/staleness.h"
#include "gossip/exchange.h"
#include "gossip/topology.h"
#include "privacy/dp_settings.h"
#include "gossip/replicas.h"
#include "protocol/compression_spec.h"
#include "protocol/wire.h"
#include "train/model.h"

namespace fedmesh::node {

std::string gossip_federation(const std::string& federation, const std::string& tokenizer_fingerprint,
                              const std::string& lora_fingerprint) {
  std::string name = federation;
  if (!tokenizer_fingerprint.empty()) name += "/tokenizer=" + tokenizer_fingerprint;
  // 12 hex digits of the fingerprint's BLAKE2b: the name must fit a Hello's 64 bytes.
  if (!lora_fingerprint.empty()) name += "/lora=" + lora_fingerprint.substr(lora_fingerprint.find(':') + 1, 12);
  return name;
}

Status GossipConfig::validate() const {
  Result<gossip::MergeRule> rule = gossip::parse_merge_rule(merge);
  if (!rule.is_ok()) return invalid_argument("gossip.merge: " + rule.status().message());
  if (Result<protocol::CompressionPlan> plan =
          protocol::make_compression_plan(site.compress, site.compress_overrides, site.dense_below);
      plan.is_ok()) {
    FEDMESH_RETURN_IF_ERROR(gossip::check_gossip_compression(*plan, *rule));
  }
  FEDMESH_RETURN_IF_ERROR(site.validate());
  if (site.device != "cpu") {
    return invalid_argument("training.device = \"" + site.device + "\": gossip peers train on the cpu for now (the "
                            "aggregator's sites take training.device = \"cuda\")");
  }
  if (Status s = gossip::parse_topology(topology).status(); !s.is_ok()) return invalid_argument("gossip.topology: " + s.message());
  if (Status s = federation::StalenessFunction::parse(staleness, max_staleness).status(); !s.is_ok()) {
    return invalid_argument("gossip.staleness: " + s.message());
  }
  if (Status s = swim.validate(); !s.is_ok()) return invalid_argument("swim: " + s.message());
  if (fanout < 1 || fanout > 64) return invalid_argument("gossip.fanout must be in 1..64");
  if (chunk_bytes < 4096 || chunk_bytes > protocol::kDefaultChunkBytes) {
    return invalid_argument("gossip.chunk_bytes must be in 4096.." + std::to_string(protocol::kDefaultChunkBytes));
  }
  if (local_steps < 1 || local_steps > 1'000'000) return invalid_argument("gossip.local_steps must be in 1..1000000");
  if (rounds < 0) return invalid_argument("gossip.rounds must be >= 0 (0: until stopped)");
  if (max_staleness < -1) return invalid_argument("gossip.max_staleness must be >= 0, or -1 for no cut-off");
  if (catch_up_donors < 1 || catch_up_donors > 16) return invalid_argument("gossip.catch_up_donors must be in 1..16");
  if (catch_up_lag < 1) return invalid_argument("gossip.catch_up_lag must be >= 1");
  if (!(catch_up_timeout_seconds > 0.0) || catch_up_timeout_seconds > 600.0) {
    return invalid_argument("gossip.catch_up_timeout_seconds must be in (0, 600]");
  }
  if (test_limit < 0) return invalid_argument("gossip.test_limit must be >= 0 (0: the whole test split)");
  if (eval_every < 1) return invalid_argument("gossip.eval_every must be >= 1");
  if (!(wait_for_share_seconds >= 0.0) || wait_for_share_seconds > 600.0) {
    return invalid_argument("gossip.wait_for_share_seconds must be in [0, 600]");
  }
  if (!(wait_for_updates_seconds >= 0.0) || wait_for_updates_seconds > 600.0) {
    return invalid_argument("gossip.wait_for_updates_seconds must be in [0, 600]");
  }
  return privacy::check_dp_settings({dp_clip, dp_noise_multiplier, dp_delta, dp_target_epsilon},
                                    privacy::kDpConfigKeys);
}

Result<GossipConfig> read_gossip_config(const std::string& path) {
  Result<toml::table> table = read_toml_file(path);
  if (!table.is_ok()) return table.status();
  GossipConfig c;
  ConfigReader r(*table, path);
  std::string mode;
  r.require("mode", mode);
  // Unset, the compression follows the merge rule (below).
  const std::string unset = "\x01unset";
  c.site.compress = unset;
  read_site_keys(r, c.site, /*with_aggregator=*/false);
  r.read("listen", c.listen);
  r.read("gossip.seeds", c.seeds);
  const bool topology_set = static_cast<bool>(table->at_path("gossip.topology"));
  const bool fanout_set = static_cast<bool>(table->at_path("gossip.fanout"));
  r.read("gossip.topology", c.topology);
  r.read("gossip.fanout", c.fanout);
  r.read("gossip.merge", c.merge);
  r.read("gossip.local_steps", c.local_steps);
  r.read("gossip.chunk_bytes", c.chunk_bytes);
  r.read("gossip.rounds", c.rounds);
  r.read("gossip.staleness", c.staleness);
  r.read("gossip.max_staleness", c.max_staleness);
  r.read("gossip.catch_up_donors", c.catch_up_donors);
  r.read("gossip.catch_up_lag", c.catch_up_lag);
  r.read("gossip.catch_up_timeout_seconds", c.catch_up_timeout_seconds);
  r.read("gossip.test_limit", c.test_limit);
  r.read("gossip.eval_every", c.eval_every);
  r.read("gossip.wait_for_share_seconds", c.wait_for_share_seconds);
  r.read("gossip.wait_for_updates_seconds", c.wait_for_updates_seconds);
  r.read("dp.clip", c.dp_clip);
  r.read("dp.noise_multiplier", c.dp_noise_multiplier);
  r.read("dp.delta", c.dp_delta);
  r.read("dp.target_epsilon", c.dp_target_epsilon);
  r.read("swim.period_seconds", c.swim.period_seconds);
  r.read("swim.ack_timeout_seconds", c.swim.ack_timeout_seconds);
  r.read("swim.indirect_checks", c.swim.indirect_checks);
  r.read("swim.suspicion_multiplier", c.swim.suspicion_multiplier);
  r.read("swim.suspicion_max_multiplier", c.swim.suspicion_max_multiplier);
  FEDMESH_RETURN_IF_ERROR(r.finish());
  if (mode != "gossip") return invalid_argument(path + ": mode must be \"gossip\" for a gossip node");
  if (c.merge == "replicas" && (topology_set || fanout_set)) {
    return invalid_argument(path + ": gossip.topology and gossip.fanout choose whom push-sum and pairwise send their "
                            "model to; gossip.merge = \"replicas\" (the default) sends every update to every member");
  }
  // Replicas send compressed updates (sparse after SGD, less so for a
  // language model; int4 after AdamW); model states go dense.
  if (c.site.compress == unset) {
    c.site.compress = c.merge == "replicas" ? gossip::default_gossip_compression(
                                                  c.site.local.optimizer, train::language_model_config(c.site.model).has_value())
                                            : "identity";
  }
  if (c.site.store.empty()) c.site.store = c.site.name + ".db";
  if (Status s = c.validate(); !s.is_ok()) return invalid_argument(path + ": " + s.message());
  return c;
}

}  // namespace fedmesh::node
