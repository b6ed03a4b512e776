// `fedmesh node`: one institution's site as a process. It dials out to the
// aggregator (institution firewalls allow outbound only), polls it with
// Heartbeats, and when a round includes it: fetches the global model if it
// does not hold that version, checks the model's hash chain from the version
// it trusts (a model that fails is refused, never trained on), trains E local
// steps on its own shard, reports local metrics, and sends the signed delta
// in chunks. It checkpoints what it holds (the global model, the hash it
// trusts, its last update sequence and round) in its own store after every
// round, so a site killed at any moment restarts where it was and never
// answers a round twice. Connection loss is retried with backoff forever.
// Updates are compressed with error feedback (protocol/compressor.h); an
// update that was not delivered goes back into the residual.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "node/trainer.h"

namespace fedmesh::node {

struct SiteConfig {
  std::string federation;
  std::string name;                       // our roster name
  std::string aggregator = "tcp://127.0.0.1:7400";
  std::string aggregator_name = "aggregator";
  std::string keys, roster, admin_public;
  std::string store;                      // default: NAME.db
  std::string metrics;                    // HOST:PORT ("" = off)
  std::string model = "mlp";
  uint64_t seed = 1;                      // the federation's model seed (version 0)
  // This site's data: shard `index` of `sites` of the Fashion-MNIST training
  // set split by `partition` with `data_seed` (a stand-in for the
  // institution's own data); a tenth of it is held out for local evaluation.
  std::string data = "fashion-mnist";
  std::string partition = "dirichlet:0.5";
  int sites = 1;
  int index = 0;
  uint64_t data_seed = 1;
  int64_t train_limit = 0;
  TrainOptions local;                     // max_steps comes from the aggregator's announcement
  int threads = 1;
  double poll_seconds = 0.2;
  double step_delay_seconds = 0.0;        // experiments: make this site slower
  double give_up_seconds = 0.0;           // > 0: exit when the aggregator is silent this long
  // How updates are compressed ([compression]: default, overrides, dense_below;
  // specs as in protocol/compression_spec.h), with error feedback: the
  // residual is checkpointed with the rest (role "residual").
  std::string compress = "identity";
  std::vector<std::string> compress_overrides;
  uint64_t dense_below = 0;
  std::string compress_device = "cpu";   // cpu, cuda or auto
  std::string faults;                     // transport.faults: experiments only (protocol/fault_injection.h)

  SiteConfig();
  Status validate() const;
};

Result<SiteConfig> read_site_config(const std::string& path);

using SiteEventSink = std::function<void(const nlohmann::json& event)>;

class SiteRuntime {
 public:
  static Result<std::unique_ptr<SiteRuntime>> start(SiteConfig config, SiteEventSink emit);
  ~SiteRuntime();
  // Runs until the aggregator announces the federation finished, `stop`, or
  // (with give_up_seconds) a silent aggregator.
  Status run(const std::atomic<bool>& stop);
  const std::string& metrics_address() const;

 private:
  SiteRuntime() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fedmesh::node
