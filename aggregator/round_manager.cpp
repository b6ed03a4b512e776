#include "aggregator/round_manager.h"

#include <algorithm>
#include <cmath>

#include "aggregator/robust_aggregation.h"

namespace fedmesh::aggregator {

Status RoundOptions::validate() const {
  if (sites_per_round < 0 || sites_per_round > kMaxSitesPerRound) {
    return invalid_argument("sites per round must be in [0, " + std::to_string(kMaxSitesPerRound) + "]");
  }
  if (min_updates < 1) return invalid_argument("min updates must be at least 1");
  if (!(round_deadline_seconds > 0.0)) return invalid_argument("the round deadline must be positive");
  if (buffer_size < 1 || buffer_size > kMaxSitesPerRound) return invalid_argument("--async K: K must be at least 1");
  if (!(fedasync_mixing >= 0.0 && fedasync_mixing <= 1.0)) return invalid_argument("FedAsync mixing must be in [0, 1]");
  if (rule != "mean" && rule != "median" && rule != "trimmed_mean" && rule != "krum") {
    return invalid_argument("unknown aggregation rule '" + rule + "' (expected mean, median, trimmed_mean or krum)");
  }
  if (!(trim_beta >= 0.0 && trim_beta < 0.5)) return invalid_argument("trimmed mean beta must be in [0, 0.5)");
  if (krum_byzantine < 0 || krum_keep < 0) return invalid_argument("krum f and m must not be negative");
  if (!(norm_bound >= 0.0) || !std::isfinite(norm_bound)) return invalid_argument("the norm bound must be >= 0");
  if (max_sample_count < 1) return invalid_argument("the sample count cap must be at least 1");
  if (rule != "mean" && (asynchronous || fold_late_updates) && fedasync_mixing > 0.0) {
    return invalid_argument("FedAsync applies one update at a time: it has no aggregation rule but the mean");
  }
  return server.validate();
}

RoundManager::RoundManager(RoundOptions options, std::vector<std::string> names, std::vector<Tensor> model)
    : options_(std::move(options)), names_(std::move(names)), model_(std::move(model)), rng_(options_.seed) {
  for (const Tensor& t : model_) parameter_count_ += t.numel();
}

Result<RoundManager> RoundManager::create(RoundOptions options, std::vector<std::string> names,
                                          std::vector<Tensor> model) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  if (names.size() != model.size() || model.empty()) return invalid_argument("the model needs one name per tensor");
  for (const Tensor& t : model) {
    if (!t.defined() || t.dtype() != DType::kF32 || t.device() != Device::kCpu) {
      return invalid_argument("the global model must be fp32 CPU tensors");
    }
  }
  Result<std::unique_ptr<ServerOptimizer>> server = make_server_optimizer(options.server);
  if (!server.is_ok()) return server.status();
  RoundManager manager(std::move(options), std::move(names), std::move(model));
  manager.server_ = std::move(*server);
  manager.link_.version = 0;
  manager.link_.hash = federation::model_version_hash(0, manager.link_.parent, manager.names_, manager.model_);
  return manager;
}

Result<RoundManagerState> RoundManager::state() const {
  if (round_open_ || !buffer_.empty()) return invalid_argument("a round manager is checkpointed between rounds only");
  RoundManagerState state;
  state.version = version_;
  state.round = round_;
  state.rng = rng_.state();
  state.server_steps = server_->steps_taken();
  state.accepted = accepted_;
  state.refused = refused_;
  state.applied_ids = applied_ids_;
  state.link = link_;
  return state;
}

Status RoundManager::restore(const RoundManagerState& state) {
  if (round_open_ || !buffer_.empty()) return invalid_argument("restore a round manager before its first round");
  if (state.version < 0 || state.round < 0 || state.server_steps < 0 || state.server_steps > state.version ||
      state.accepted < 0 || state.refused < 0) {
    return invalid_argument("round manager state out of range");
  }
  if (state.link.version != state.version) return invalid_argument("round manager state: chain link of another version");
  FEDMESH_RETURN_IF_ERROR(federation::verify_model(state.link, names_, model_));
  version_ = state.version;
  round_ = state.round;
  rng_.set_state(state.rng);
  server_->set_steps_taken(state.server_steps);
  accepted_ = state.accepted;
  refused_ = state.refused;
  applied_ids_ = state.applied_ids;
  link_ = state.link;
  return Status::ok();
}

Status parse_rule(std::string_view text_view, RoundOptions& options) {
  const std::string text(text_view);
  const size_t colon = text.find(':');
  const std::string name = text.substr(0, colon);
  const std::string rest = colon == std::string::npos ? "" : text.substr(colon + 1);
  try {
    if ((name == "mean" || name == "median") && rest.empty()) {
      options.rule = name;
      return Status::ok();
    }
    if (name == "trimmed_mean") {
      options.rule = name;
      if (!rest.empty()) options.trim_beta = std::stod(rest);
      return Status::ok();
    }
    if (name == "krum") {
      options.rule = name;
      const size_t second = rest.find(':');
      if (!rest.empty()) options.krum_byzantine = std::stoi(rest.substr(0, second));
      if (second != std::string::npos) options.krum_keep = std::stoi(rest.substr(second + 1));
      return Status::ok();
    }
  } catch (const std::exception&) {
  }
  return invalid_argument("rule '" + text + "' is not mean, median, trimmed_mean[:BETA] or krum[:F[:M]]");
}

Status RoundManager::start_round(const std::vector<std::string>& available, double now) {
  if (options_.asynchronous) return invalid_argument("asynchronous mode has no rounds to start");
  if (round_open_) return invalid_argument("round " + std::to_string(round_) + " is still open");
  if (available.empty()) return unavailable("no site is available for a round");
  std::vector<std::string> pool = available;
  std::sort(pool.begin(), pool.end());  // the sample depends on the seed, not on the order sites connected
  pool.erase(std::unique(pool.begin(), pool.end()), pool.end());
  rng_.shuffle(std::span<std::string>(pool));
  const size_t m = options_.sites_per_round == 0 ? pool.size()
                                                 : std::min(pool.size(), static_cast<size_t>(options_.sites_per_round));
  pool.resize(m);
  std::sort(pool.begin(), pool.end());
  sampled_ = std::move(pool);
  ++round_;
  round_open_ = true;
  deadline_ = now + options_.round_deadline_seconds;
  return Status::ok();
}

Status RoundManager::check(SiteUpdate& update, double& norm) const {
  const std::string who = "update " + update.id + " from " + update.site;
  if (update.id.empty()) return invalid_argument("an update needs an id");
  if (static_cast<int64_t>(update.delta.size()) != parameter_count_) {
    return invalid_argument(who + ": " + std::to_string(update.delta.size()) + " values, the model has " +
                            std::to_string(parameter_count_));
  }
  if (update.sample_count < 1 || update.sample_count > options_.max_sample_count) {
    return invalid_argument(who + ": sample count " + std::to_string(update.sample_count) + " outside [1, " +
                            std::to_string(options_.max_sample_count) + "]");
  }
  if (update.base_version > version_ || update.base_version < 0) {
    return invalid_argument(who + ": based on version " + std::to_string(update.base_version) +
                            ", the server is at " + std::to_string(version_));
  }
  if (std::find(applied_ids_.begin(), applied_ids_.end(), update.id) != applied_ids_.end()) {
    return invalid_argument(who + " was already applied");
  }
  for (const SiteUpdate& pending : buffer_) {
    if (pending.id == update.id) return invalid_argument(who + " is already in the buffer");
  }
  // One pass: finite and in range first (a NaN passes any norm comparison,
  // and the exact accumulator takes terms below 2^22 only), and the norm.
  double squares = 0.0;
  for (float v : update.delta) {
    if (!std::isfinite(v)) return invalid_argument(who + ": holds a non-finite value");
    if (std::fabs(v) >= federation::kMaxTermMagnitude) {
      return invalid_argument(who + ": holds a value of magnitude " + std::to_string(std::fabs(v)) +
                              ", beyond what an update may carry (2^22)");
    }
    squares += static_cast<double>(v) * v;
  }
  norm = std::sqrt(squares);
  if (options_.norm_bound > 0.0 && norm > options_.norm_bound) {
    const double factor = options_.norm_bound / norm;  // as bound_norm() scales
    for (float& v : update.delta) v = static_cast<float>(static_cast<double>(v) * factor);
  }
  return Status::ok();
}

Status RoundManager::admissible(const SiteUpdate& update) const {
  const int64_t tau = version_ - update.base_version;
  const double staleness_weight = options_.staleness.weight(tau);
  const std::string who = "update " + update.id + " from " + update.site;
  if (staleness_weight <= 0.0) {
    return invalid_argument(who + ": staleness " + std::to_string(tau) + " is beyond the cut-off");
  }
  if (!options_.asynchronous) {
    const bool on_time = round_open_ && update.round == round_;
    const bool late = update.round < round_ || (update.round == round_ && !round_open_);
    if (!on_time && !(late && options_.fold_late_updates && round_open_)) {
      return invalid_argument(who + " answers round " + std::to_string(update.round) + ", the open round is " +
                              (round_open_ ? std::to_string(round_) : std::string("none")) +
                              (late ? " (late updates are dropped)" : ""));
    }
    if (on_time && std::find(sampled_.begin(), sampled_.end(), update.site) == sampled_.end()) {
      return invalid_argument(who + ": the site was not sampled for round " + std::to_string(round_));
    }
    for (const SiteUpdate& pending : buffer_) {
      if (on_time && pending.site == update.site && pending.round == round_) {
        return invalid_argument(who + ": the site already reported for round " + std::to_string(round_));
      }
    }
  }
  return Status::ok();
}

Result<std::optional<RoundRecord>> RoundManager::submit(SiteUpdate update, double now) {
  (void)now;
  double norm = 0.0;
  if (Status s = check(update, norm); !s.is_ok()) {
    ++refused_;
    return s;
  }
  if (Status s = admissible(update); !s.is_ok()) {
    ++refused_;
    return s;
  }
  const int64_t tau = version_ - update.base_version;
  const double staleness_weight = options_.staleness.weight(tau);
  const double weight = static_cast<double>(update.sample_count) / static_cast<double>(options_.max_sample_count) *
                        staleness_weight;
  AppliedUpdateRecord info{update.id, update.site, tau, weight, norm};
  if (Status s = take(std::move(update), std::move(info)); !s.is_ok()) {
    ++refused_;
    return s;
  }
  ++accepted_;
  if (options_.asynchronous &&
      (options_.fedasync_mixing > 0.0 || static_cast<int64_t>(buffer_.size()) >= options_.buffer_size)) {
    Result<RoundRecord> record = apply_buffer(false);
    if (!record.is_ok()) return record.status();
    return std::optional<RoundRecord>(std::move(*record));
  }
  return std::optional<RoundRecord>();
}

bool RoundManager::drop_from_sample(const std::string& site) {
  if (options_.asynchronous || !round_open_) return false;
  const auto found = std::find(sampled_.begin(), sampled_.end(), site);
  if (found == sampled_.end()) return false;
  sampled_.erase(found);
  return true;
}

bool RoundManager::ready_to_close(double now) const {
  if (options_.asynchronous || !round_open_) return false;
  size_t on_time = 0;  // sites still sampled that reported (one update each)
  for (const SiteUpdate& update : buffer_) {
    on_time += update.round == round_ && std::find(sampled_.begin(), sampled_.end(), update.site) != sampled_.end();
  }
  if (on_time >= sampled_.size()) return true;
  return now >= deadline_;
}

Result<RoundRecord> RoundManager::close_round(double now) {
  if (options_.asynchronous || !round_open_) return invalid_argument("no open round to close");
  const bool by_deadline = now >= deadline_;
  round_open_ = false;
  if (static_cast<int64_t>(buffer_.size()) < options_.min_updates) {
    RoundRecord abandoned;  // no server step: the version stays
    abandoned.round = round_;
    abandoned.version = version_;
    abandoned.link = link_;
    abandoned.closed_by_deadline = by_deadline;
    clear_buffer();
    return abandoned;
  }
  return apply_buffer(by_deadline);
}

Result<RoundRecord> RoundManager::close_round_with_mean(std::vector<float> mean,
                                                      const std::vector<std::string>& contributors) {
  if (options_.asynchronous || !round_open_) return invalid_argument("no open round to close");
  if (!buffer_.empty()) return invalid_argument("round " + std::to_string(round_) + " already holds individual updates");
  if (contributors.empty()) return invalid_argument("an aggregate of no site");
  SiteUpdate aggregate;
  aggregate.id = "secure/round-" + std::to_string(round_);
  aggregate.site = "secure-aggregate";
  aggregate.round = round_;
  aggregate.base_version = version_;
  aggregate.sample_count = 1;
  aggregate.delta = std::move(mean);
  double norm = 0.0;
  FEDMESH_RETURN_IF_ERROR(check(aggregate, norm));
  AppliedUpdateRecord info{aggregate.id, aggregate.site, 0, 1.0, norm};
  FEDMESH_RETURN_IF_ERROR(take(std::move(aggregate), std::move(info)));
  round_open_ = false;
  Result<RoundRecord> record = apply_buffer(false);
  if (!record.is_ok()) return record.status();
  record->applied.clear();
  for (const std::string& site : contributors) {
    record->applied.push_back({"secure/round-" + std::to_string(record->round) + "/" + site, site, 0,
                               1.0 / static_cast<double>(contributors.size()), 0.0});
  }
  accepted_ += static_cast<int64_t>(contributors.size());
  return record;
}

Result<RoundRecord> RoundManager::apply_buffer(bool closed_by_deadline) {
  std::vector<float> delta(static_cast<size_t>(parameter_count_), 0.0f);
  if (streaming()) {
    accumulator_->mean(delta);
    if (options_.asynchronous && options_.fedasync_mixing == 0.0) {
      // FedBuff divides by the sample weights without staleness, so stale
      // updates shrink the step instead of only trading places with fresh
      // ones: delta = sum(n s(tau) d) / sum(n). Both sums in fixed point.
      int64_t with_staleness = 0, without = 0;
      for (const AppliedUpdateRecord& info : buffer_info_) {
        with_staleness += federation::to_fixed_point(info.weight);
        without += federation::to_fixed_point(info.weight / options_.staleness.weight(info.staleness));
      }
      const double factor = without > 0 ? static_cast<double>(with_staleness) / static_cast<double>(without) : 0.0;
      for (float& value : delta) value = static_cast<float>(value * factor);
    }
    if (options_.fedasync_mixing > 0.0) {
      // FedAsync: x <- x + a s(tau) (x_site - x), with x_site - x taken as the
      // site's delta (exact when the update is based on the current version).
      const double mix = options_.fedasync_mixing * options_.staleness.weight(buffer_info_.front().staleness);
      for (float& value : delta) value = static_cast<float>(value * mix);
    }
  } else {
    std::vector<BufferedUpdate> updates;
    for (const SiteUpdate& update : buffer_) updates.push_back({update.id, update.delta});
    Status s;
    if (options_.rule == "median") s = coordinate_median(updates, delta);
    if (options_.rule == "trimmed_mean") s = trimmed_mean(updates, options_.trim_beta, delta);
    if (options_.rule == "krum") {
      const int n = static_cast<int>(updates.size());
      const int keep = options_.krum_keep > 0 ? options_.krum_keep : n - options_.krum_byzantine;
      s = multi_krum(updates, options_.krum_byzantine, keep, delta);
    }
    FEDMESH_RETURN_IF_ERROR(s);
  }
  std::vector<Tensor> delta_views;
  std::vector<ServerStepTensor> step;
  delta_views.reserve(model_.size());
  int64_t offset = 0;
  for (size_t i = 0; i < model_.size(); ++i) {
    delta_views.push_back(Tensor::view_of(delta.data() + offset, model_[i].shape(), DType::kF32));
    offset += model_[i].numel();
  }
  for (size_t i = 0; i < model_.size(); ++i) step.push_back({names_[i], &model_[i], &delta_views[i]});
  FEDMESH_RETURN_IF_ERROR(server_->step(step));
  ++version_;
  federation::ChainLink next;
  next.version = version_;
  next.parent = link_.hash;
  next.hash = federation::model_version_hash(version_, next.parent, names_, model_);
  link_ = next;

  RoundRecord record;
  record.round = options_.asynchronous ? version_ : round_;
  record.version = version_;
  record.closed_by_deadline = closed_by_deadline;
  record.link = link_;
  record.applied = buffer_info_;
  for (const SiteUpdate& update : buffer_) {
    record.mean_local_loss += update.local_loss / static_cast<double>(buffer_.size());
    record.mean_local_accuracy += update.local_accuracy / static_cast<double>(buffer_.size());
    applied_ids_.push_back(update.id);
  }
  clear_buffer();
  return record;
}

bool RoundManager::streaming() const { return options_.rule == "mean" || options_.fedasync_mixing > 0.0; }

Status RoundManager::take(SiteUpdate update, AppliedUpdateRecord info) {
  if (streaming()) {
    // Folded in now and its values dropped: the manager's memory is the
    // model and one sum, however many updates the round takes. The sum is
    // exact and order-independent, so folding on arrival gives the same
    // bits as folding at the close. An update the sum cannot take (it could
    // overflow) is refused here, alone, instead of failing the whole step.
    if (!accumulator_) accumulator_ = std::make_unique<federation::ExactAccumulator>(parameter_count_);
    FEDMESH_RETURN_IF_ERROR(accumulator_->add(update.delta, info.weight));
    std::vector<float>().swap(update.delta);
  }
  buffer_info_.push_back(std::move(info));
  buffer_.push_back(std::move(update));
  return Status::ok();
}

void RoundManager::clear_buffer() {
  buffer_.clear();
  buffer_info_.clear();
  if (accumulator_) accumulator_->clear();
}

int64_t RoundManager::held_update_values() const {
  int64_t held = 0;
  for (const SiteUpdate& update : buffer_) held += static_cast<int64_t>(update.delta.size());
  return held;
}

}  // namespace fedmesh::aggregator
