#include "aggregator/operator_view.h"

#include <chrono>

#include "aggregator/site_state.h"

namespace fedmesh::aggregator {

uint64_t unix_time_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

std::optional<nlohmann::json> round_event_from_log(const store::RoundLogEntry& entry) {
  const nlohmann::json metrics = nlohmann::json::parse(entry.metrics_json, nullptr, false);
  if (!metrics.is_object()) return std::nullopt;
  const auto number_or = [&](const char* key, double otherwise) {
    const auto it = metrics.find(key);
    return it != metrics.end() && it->is_number() ? it->get<double>() : otherwise;
  };
  const auto staleness = metrics.find("staleness");
  const auto deadline = metrics.find("closed_by_deadline");
  nlohmann::json event = {
      {"event", "round"}, {"round", entry.round}, {"version", entry.model_version},
      {"updates", static_cast<int64_t>(number_or("updates", 0.0))},
      {"staleness", staleness != metrics.end() && staleness->is_array() ? *staleness : nlohmann::json::array()},
      {"closed_by_deadline", deadline != metrics.end() && deadline->is_boolean() && deadline->get<bool>()},
      {"seconds", number_or("seconds", 0.0)}, {"bytes_sent", nullptr}, {"bytes_received", nullptr},
      {"committed", entry.wall_time}, {"restored", true}};
  for (const char* key : {"test_accuracy", "test_loss", "epsilon", "val_loss", "val_perplexity", "val_bits_per_byte"}) {
    const auto it = metrics.find(key);
    if (it != metrics.end() && it->is_number()) event[key] = *it;
  }
  return event;
}

void OperatorView::update_accepted(int64_t staleness) {
  std::lock_guard lock(mutex_);
  ++accepted_;
  staleness_.observe(static_cast<double>(staleness));
}

void OperatorView::rejection(const std::string& peer, const std::string& code, const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++rejections_by_code_[code];
  rejections_.push_back({{"unix_ms", unix_time_ms()}, {"peer", peer}, {"code", code},
                         {"reason", reason.substr(0, kRejectionReasonShownChars)}});
  if (rejections_.size() > kRecentRejectionsShown) rejections_.pop_front();
}

void OperatorView::round_closed(const nlohmann::json& event) {
  std::lock_guard lock(mutex_);
  last_round_seconds_ = event.value("seconds", 0.0);
  if (event.contains("test_accuracy")) {
    last_accuracy_ = event.value("test_accuracy", -1.0);
    last_loss_ = event.value("test_loss", -1.0);
    last_r2_ = event.contains("test_r2") ? std::optional<double>(event.value("test_r2", 0.0)) : std::nullopt;
  }
  history_.push_back(event);
  if (history_.size() > kRoundHistoryShown) history_.pop_front();
}

size_t OperatorView::restore_history(const std::vector<store::RoundLogEntry>& log) {
  std::lock_guard lock(mutex_);
  history_.clear();
  for (const store::RoundLogEntry& entry : log) {
    if (std::optional<nlohmann::json> event = round_event_from_log(entry)) history_.push_back(std::move(*event));
  }
  while (history_.size() > kRoundHistoryShown) history_.pop_front();
  return history_.size();
}

void OperatorView::set_snapshot(OperatorSnapshot snapshot) {
  std::lock_guard lock(mutex_);
  snapshot_ = std::move(snapshot);
}

double OperatorView::last_accuracy() const {
  std::lock_guard lock(mutex_);
  return last_accuracy_;
}

std::string OperatorView::render_metrics(const OperatorContext& context) const {
  PrometheusText out;
  std::lock_guard lock(mutex_);
  out.gauge("fedmesh_round", "The current (or last) round", static_cast<double>(snapshot_.round));
  out.gauge("fedmesh_model_version", "The global model's version", static_cast<double>(snapshot_.version));
  int64_t connected = 0;
  for (const auto& site : snapshot_.sites) connected += site.value("connected", false) ? 1 : 0;
  out.gauge("fedmesh_connected_sites", "Sites heard from within the site timeout", static_cast<double>(connected));
  out.counter("fedmesh_updates_accepted_total", "Updates folded into an aggregate", static_cast<double>(accepted_));
  out.header("fedmesh_updates_rejected_total", "counter", "Updates and messages refused, by reason");
  for (const auto& [reason, count] : context.transport_rejections) {
    out.sample("fedmesh_updates_rejected_total", {{"reason", reason}}, count);
  }
  const auto it = rejections_by_code_.find("round-manager");
  out.sample("fedmesh_updates_rejected_total", {{"reason", "round-manager"}},
             it == rejections_by_code_.end() ? 0.0 : static_cast<double>(it->second));
  out.counter("fedmesh_transfers_expired_total",
              "Update transfers dropped because no chunk added bytes within the transfer idle timeout",
              static_cast<double>(context.transfers_expired));
  out.counter("fedmesh_bytes_received_total", "Bytes received on the federation socket",
              static_cast<double>(context.bytes_received));
  out.counter("fedmesh_bytes_sent_total", "Bytes sent on the federation socket", static_cast<double>(context.bytes_sent));
  out.histogram("fedmesh_update_staleness", "Staleness tau of accepted updates (server versions)", staleness_);
  out.gauge("fedmesh_round_duration_seconds", "Wall time of the last server step", last_round_seconds_);
  if (last_r2_) {
    out.gauge("fedmesh_global_r2", "Validation R² of the global model (regression)", *last_r2_);
  } else if (last_accuracy_ >= 0.0) {
    out.gauge("fedmesh_global_accuracy", "Validation accuracy of the global model", last_accuracy_);
  }
  out.header("fedmesh_sites", "gauge", "Sites by state (connected, training, late, dropped, revoked)");
  for (const SiteState state : {SiteState::kConnected, SiteState::kTraining, SiteState::kLate, SiteState::kDropped,
                                SiteState::kRevoked}) {
    int64_t count = 0;
    for (const auto& site : snapshot_.sites) count += site.value("state", "") == site_state_name(state) ? 1 : 0;
    out.sample("fedmesh_sites", {{"state", site_state_name(state)}}, static_cast<double>(count));
  }
  out.counter("fedmesh_http_unauthorized_total", "Requests to this endpoint refused for want of the access token",
              static_cast<double>(context.http_unauthorized));
  out.counter("fedmesh_http_refused_connections_total",
              "Connections to this endpoint closed unserved: past the connection cap, a request head late, too large "
              "or malformed, an answer not taken in time",
              static_cast<double>(context.http_refused));
  out.counter("fedmesh_refusal_log_lines_suppressed_total",
              "Refusals counted in fedmesh_updates_rejected_total but not written to the log (at most one line per "
              "peer key and reason per interval)",
              static_cast<double>(context.refusal_log_lines_suppressed));
  return out.text();
}

std::string OperatorView::render_status(const OperatorContext& context) const {
  std::lock_guard lock(mutex_);
  nlohmann::json recent_rounds = nlohmann::json::array(), history = nlohmann::json::array();
  for (size_t i = 0; i < history_.size(); ++i) {
    const nlohmann::json& e = history_[i];
    if (i + kRecentRoundsShown >= history_.size()) recent_rounds.push_back(e);
    nlohmann::json point = nlohmann::json::object();
    for (const char* key : {"round", "version", "updates", "seconds", "closed_by_deadline", "bytes_sent",
                            "bytes_received", "staleness", "test_accuracy", "test_loss", "epsilon"}) {
      if (e.contains(key)) point[key] = e[key];
    }
    history.push_back(std::move(point));
  }
  nlohmann::json rejections = nlohmann::json::array();
  for (auto it = rejections_.rbegin(); it != rejections_.rend(); ++it) rejections.push_back(*it);
  int64_t rejections_total = 0;
  for (const auto& [code, count] : rejections_by_code_) rejections_total += count;
  const Histogram& h = staleness_;
  nlohmann::json staleness = {{"bounds", h.bounds()}, {"cumulative_counts", h.counts()}, {"count", h.count()},
                              {"sum", h.sum()}};
  if (h.count() > 0) staleness["mean"] = h.sum() / static_cast<double>(h.count());
  nlohmann::json status = {{"role", "aggregator"}, {"federation", context.federation}, {"name", context.name},
                           {"round", snapshot_.round}, {"version", snapshot_.version},
                           {"round_open", snapshot_.round_open}, {"finished", snapshot_.finished},
                           {"mode", context.mode}, {"privacy_mode", context.privacy_mode},
                           {"rounds", context.rounds}, {"sites", snapshot_.sites}, {"recent_rounds", recent_rounds},
                           {"progress", snapshot_.progress}, {"history", history},
                           {"site_timeout_seconds", context.site_timeout_seconds},
                           {"updates_accepted", accepted_},
                           {"bytes_sent", context.bytes_sent}, {"bytes_received", context.bytes_received},
                           {"staleness", staleness},
                           {"recent_rejections", rejections}, {"rejections_total", rejections_total},
                           {"rejections_by_reason", rejections_by_code_},
                           {"http_unauthorized", context.http_unauthorized},
                           {"http_refused", context.http_refused},
                           {"refusal_log_lines_suppressed", context.refusal_log_lines_suppressed},
                           {"uptime_seconds", context.uptime_seconds}};
  if (last_accuracy_ >= 0.0 && !last_r2_) status["test_accuracy"] = last_accuracy_;
  if (last_r2_) status["test_r2"] = *last_r2_;
  if (last_loss_ >= 0.0) status["test_loss"] = last_loss_;
  // Reasons may quote what a peer sent: never let a stray byte fail the page.
  return status.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace fedmesh::aggregator
