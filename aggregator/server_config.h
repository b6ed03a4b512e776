// What `fedmesh aggregator` runs with: agg.toml's keys (every one is
// described in docs/configuration.md), read and checked, and the flags that
// win over the file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "aggregator/round_manager.h"
#include "aggregator/secure_round.h"
#include "base/status.h"
#include "train/data/data_source.h"
#include "train/initial_weights.h"
#include "store/checkpoint_store.h"

namespace fedmesh::aggregator {

// A model this large (fp32 bytes) or larger has its uploads in flight staged
// on disk unless the config says otherwise (staging_dir).
inline constexpr uint64_t kStageOnDiskFromBytes = uint64_t{64} << 20;

struct AggregatorConfig {
  std::string federation;
  std::string name = "aggregator";     // our roster name
  std::string listen = "tcp://127.0.0.1:7400";
  std::string keys;                    // our NAME.key
  std::string roster;                  // the signed roster
  std::string admin_public;            // the admin's sign key (hex), pinned here, never taken from the roster
  std::string store = "aggregator.db";
  std::string metrics;                 // HOST:PORT for /metrics, /status and /dashboard ("" = off)
  // The access token of /metrics, /status and /dashboard ("" = open, allowed
  // only while `metrics` is a loopback address). /healthz stays open.
  std::string metrics_token;
  std::string model = "mlp";
  uint64_t seed = 1;                   // the initial model (sites derive the same version 0)
  train::InitialWeights init;          // init, init_format: version 0 from a file instead (every site gives the same)
  int64_t rounds = 10;                 // server steps to run (0: until stopped)
  int64_t local_steps = 50;            // announced to sites
  int64_t min_sites = 1;               // sync: connected sites needed to open a round
  double site_timeout_seconds = 10.0;  // no message for this long: a site counts as gone
  double linger_seconds = 5.0;         // after the last round: keep answering so sites learn it
  // Updates being received are staged, each whole in fp32: on disk in
  // staging_dir as their chunks verify (the aggregator holds one chunk's
  // decode at a time, not the update), or in memory when staging_dir is
  // "memory". "" = on disk in the store's directory for a model of
  // kStageOnDiskFromBytes or more in fp32, in memory for a smaller one.
  std::string staging_dir;
  // What they may stage at once (MB); 0: the larger of 256 MB and two
  // models. Sites past it are answered BUSY and come back, so the staged
  // bytes do not grow with the sites.
  int64_t staging_mb = 0;
  // The model chunks all downloads may hold at once (MB; 0: 128 MB). A site
  // whose next chunks do not fit is answered BUSY and asks again; the copies
  // freed go to the sites in the order they were refused.
  int64_t serving_mb = 0;
  std::string faults;                  // transport.faults: experiments only (protocol/fault_injection.h)
  // What the global model is evaluated on after every step ("" = nothing):
  // the Fashion-MNIST test split for the image models; for language models
  // every document's held-out last 5% of the text corpus ("fashion-mnist":
  // the Bible), which no site trains on.
  // Own data (csv:FILE, images:DIR) is evaluated whole, read as the data.*
  // keys say (label, classes, categories, image size, channels; as the
  // sites'), and its schema decides the model's input and classes and is
  // announced every round: a site whose data has another schema refuses.
  std::string validation = "fashion-mnist";
  int64_t validation_limit = 0;        // first N images or text windows (0 = all)
  train::data::DataSource data;        // data.*: how own validation data is read (data.source is not taken)
  // Language models: a BPE tokenizer file (`fedmesh tokenizer train`) the
  // federation reads text with instead of bytes ("" = bytes). The global
  // model takes its vocabulary, the held-out text is evaluated in its
  // tokens (val_bits_per_byte over the bytes they stand for), and every
  // round announcement carries its fingerprint: a site with another
  // data.tokenizer (or none) refuses to take part.
  std::string tokenizer;
  store::StoreOptions store_options;
  RoundOptions rounds_options;
  // privacy.mode: "trusted" (the aggregator sees each site's signed update;
  // robust rules available) or "private" (secure aggregation: it sees only
  // the sum of the round's survivors; synchronous rounds and the mean rule
  // only, sites clip to secure.clip before masking).
  std::string privacy_mode = "trusted";
  SecureOptions secure;                // [secure_aggregation]
  // [dp] Site-level DP-FedAvg (private mode): Gaussian noise of standard
  // deviation noise_multiplier * clip on the sum of the clipped updates
  // (divided by the count, on their mean), accounted per round (sampling
  // rate q = sites_per_round / the roster's sites, or 1) in the store's
  // privacy ledger before the round's model is released; target_epsilon > 0
  // ends the federation before a round that would exceed it.
  double dp_noise_multiplier = 0.0;
  double dp_delta = 1e-5;
  double dp_target_epsilon = 0.0;
  bool is_private() const { return privacy_mode == "private"; }

  Status validate() const;
};

// Command-line settings that win over the file's; applied before the
// config is checked, so a token given by flag can open an exposed address.
struct AggregatorConfigOverrides {
  std::optional<std::string> metrics, metrics_token;
};

// Reads agg.toml (every key: docs/configuration.md); unknown keys
// and wrong types are refused by name.
Result<AggregatorConfig> read_aggregator_config(const std::string& path, const AggregatorConfigOverrides& overrides = {});

}  // namespace fedmesh::aggregator
