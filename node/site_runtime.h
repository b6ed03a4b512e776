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
#include "node/site_config.h"
#include "protocol/environment.h"

namespace fedmesh::node {

using SiteEventSink = std::function<void(const nlohmann::json& event)>;

// Faults a test injects into private mode, through the command line built for
// tests (tests/support/fedmesh_with_faults.cpp); nothing a user runs sets
// them. exit_at: "ROUND:PHASE[,...]", die with SIGKILL on reaching that
// secure-aggregation phase of that round; dump_dir: write each round's
// fixed-point input, before masking, to DIR/SITE-round-R.u32.
struct SecureUploadFaults {
  std::string exit_at;
  std::string dump_dir;
};

class SiteRuntime {
 public:
  // `environment`: the clock, network and store file system it runs on
  // (default: the real ones; sim/vopr passes simulated ones).
  static Result<std::unique_ptr<SiteRuntime>> start(SiteConfig config, SiteEventSink emit,
                                                    SecureUploadFaults faults = {},
                                                    protocol::RuntimeEnvironment environment = {});
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
