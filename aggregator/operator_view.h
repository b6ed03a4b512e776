// What the aggregator shows its operator: counters, the rounds' history, the
// recent rejections and the latest snapshot of the sites and the round's
// progress, rendered as /status (JSON, which the dashboard polls) and
// /metrics (Prometheus). The serving thread records into it; the HTTP
// endpoint's thread renders from it: every member is behind one mutex.
// Everything it keeps is bounded by the constants below.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/prometheus.h"
#include "store/checkpoint_store.h"

namespace fedmesh::aggregator {

inline constexpr size_t kRoundHistoryShown = 500;         // rounds charted (and read back from the round log)
inline constexpr size_t kRecentRoundsShown = 10;          // rounds `fedmesh status` lists
inline constexpr size_t kRecentRejectionsShown = 50;      // refusals shown with their reasons
inline constexpr size_t kRejectionReasonShownChars = 240;

// Where the federation stands, recomputed by the server after each event.
struct OperatorSnapshot {
  nlohmann::json sites = nlohmann::json::array();      // a row per site: state, contact, counts
  nlohmann::json progress = nlohmann::json::object();  // the round's updates in, wanted, deadline
  int64_t round = 0, version = 0;
  bool round_open = false, finished = false;
};

// What the process knows at the moment of rendering (not kept by the view).
struct OperatorContext {
  std::string federation, name, mode, privacy_mode;
  int64_t rounds = 0;
  double site_timeout_seconds = 0.0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  std::vector<std::pair<std::string, double>> transport_rejections;  // by the wire's reject code name
  int64_t http_unauthorized = 0;
  int64_t http_refused = 0;  // HTTP connections closed unserved (HttpEndpoint::refused_connections)
  uint64_t refusal_log_lines_suppressed = 0;  // refusals counted but not logged (protocol/refusal_log.h)
  uint64_t transfers_expired = 0;  // update transfers dropped after the idle timeout without progress
  double uptime_seconds = 0.0;
};

// Milliseconds since the Unix epoch (what the page's clock reads).
uint64_t unix_time_ms();

// A round event of the history rebuilt from the store's round log: what was
// committed with the round (bytes on the wire were counted by an earlier
// process and are unknown: null). Nullopt for metrics that are not a JSON
// object.
std::optional<nlohmann::json> round_event_from_log(const store::RoundLogEntry& entry);

class OperatorView {
 public:
  void update_accepted(int64_t staleness);
  // A refusal with its reason code (a wire reject code, "round-manager",
  // "revoked") and text; the text is cut to kRejectionReasonShownChars.
  void rejection(const std::string& peer, const std::string& code, const std::string& reason);
  // A committed round, as its `round` event (with `seconds` and, where the
  // aggregator validates, `test_accuracy` and `test_loss`).
  void round_closed(const nlohmann::json& event);
  // Replaces the history with the log's rounds (oldest first); how many.
  size_t restore_history(const std::vector<store::RoundLogEntry>& log);
  void set_snapshot(OperatorSnapshot snapshot);

  double last_accuracy() const;  // -1: none yet
  std::string render_status(const OperatorContext& context) const;
  std::string render_metrics(const OperatorContext& context) const;

 private:
  mutable std::mutex mutex_;
  int64_t accepted_ = 0;
  std::map<std::string, int64_t> rejections_by_code_;
  Histogram staleness_{{0, 1, 2, 4, 8, 16, 32}};
  double last_round_seconds_ = 0.0, last_accuracy_ = -1.0, last_loss_ = -1.0;
  std::optional<double> last_r2_;  // regression: the validation R² (may be negative)
  std::deque<nlohmann::json> history_;     // round events, oldest first
  std::deque<nlohmann::json> rejections_;  // newest last
  OperatorSnapshot snapshot_;
};

}  // namespace fedmesh::aggregator
