// `fedmesh aggregator`: the central server of a federation as one process.
// It listens on a CurveZMQ socket that admits only roster keys, serves the
// current global model to sites (protocol/model_transfer.h), takes their
// signed chunked updates (protocol/update_service.h), and runs the
// RoundManager on the real clock: synchronous rounds with a seeded sample, a
// deadline and a minimum number of updates, or asynchronous FedBuff/FedAsync.
//
// Nothing acknowledged is lost: a completed update is written to the
// checkpoint store's pending table (fsynced) before its Ack{complete} leaves,
// and every server step is committed (model, server optimizer, manager state,
// applied update ids, the model hash chain) before it is announced. After a
// kill -9 the same command resumes: it restores the newest intact round,
// reopens the round that was open with the same sample, and feeds it the
// pending updates that were not applied yet. Replay counters live in the
// same store.
//
// Sites learn about rounds by polling: each Heartbeat is answered with a
// RoundAnnounce (round, model version and hash, deadline, whether the site is
// sampled, whether the federation has finished).
//
// An operator watches it at the `metrics` address: Prometheus text at
// /metrics, the federation as JSON at /status, and a read-only dashboard at
// /dashboard (aggregator/dashboard_page.h) that polls /status. The address
// is loopback unless configured otherwise; an exposed one needs
// metrics_token, which then guards all three.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "aggregator/round_manager.h"
#include "aggregator/server_config.h"
#include "base/status.h"
#include "protocol/environment.h"

namespace fedmesh::aggregator {

using EventSink = std::function<void(const nlohmann::json& event)>;

class AggregatorServer {
 public:
  // Reads keys and roster (signature checked against the pinned admin key),
  // opens the store (one owner), restores its newest intact round, binds the
  // socket and the metrics endpoint. Events go to `emit`.
  // `environment`: the clock, network and store file system it runs on
  // (default: the real ones; sim/vopr passes simulated ones).
  static Result<std::unique_ptr<AggregatorServer>> start(AggregatorConfig config, EventSink emit,
                                                         protocol::RuntimeEnvironment environment = {});
  ~AggregatorServer();

  // Serves until the configured rounds are done (then lingers) or `stop`.
  Status run(const std::atomic<bool>& stop);

  const std::string& endpoint() const;
  const std::string& metrics_address() const;

 private:
  AggregatorServer() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fedmesh::aggregator
