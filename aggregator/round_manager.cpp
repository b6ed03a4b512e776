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
  if (!failed_step_.is_ok()) return failed_step_;
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

namespace {

// Values the manager reads of a stored update at a time: its memory for a
// stored update, whatever the model's size.
constexpr int64_t kSliceValues = int64_t{1} << 20;

}  // namespace

double RoundManager::norm_factor(double norm) const {
  return options_.norm_bound > 0.0 && norm > options_.norm_bound ? options_.norm_bound / norm : 1.0;
}

Status RoundManager::check(SiteUpdate& update, double& norm, float& largest) const {
  const std::string who = "update " + update.id + " from " + update.site;
  if (update.id.empty()) return invalid_argument("an update needs an id");
  const bool stored = update.is_stored();
  if (!stored && static_cast<int64_t>(update.delta.size()) != parameter_count_) {
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
  // A stored update is read a slice at a time, in the same order.
  double squares = 0.0;
  largest = 0.0f;
  const auto scan = [&](std::span<const float> values) -> Status {
    for (float v : values) {
      if (!std::isfinite(v)) return invalid_argument(who + ": holds a non-finite value");
      if (std::fabs(v) >= federation::kMaxTermMagnitude) {
        return invalid_argument(who + ": holds a value of magnitude " + std::to_string(std::fabs(v)) +
                                ", beyond what an update may carry (2^22)");
      }
      squares += static_cast<double>(v) * v;
      largest = std::max(largest, std::fabs(v));
    }
    return Status::ok();
  };
  if (stored) {
    std::vector<float> slice(static_cast<size_t>(std::min(kSliceValues, parameter_count_)));
    Status status;
    for (int64_t first = 0; first < parameter_count_ && status.is_ok(); first += kSliceValues) {
      const std::span<float> part = std::span<float>(slice).first(static_cast<size_t>(std::min(kSliceValues, parameter_count_ - first)));
      status = update.stored->read(part);
      if (status.is_ok()) status = scan(part);
    }
    const Status finished = update.stored->finish();  // ends the pass whatever happened
    if (!status.is_ok()) return status.code() == StatusCode::kInvalidArgument ? status : Status(status.code(), who + ": " + status.message());
    if (!finished.is_ok()) return Status(finished.code(), who + ": " + finished.message());
  } else {
    FEDMESH_RETURN_IF_ERROR(scan(update.delta));
  }
  norm = std::sqrt(squares);
  if (const double factor = norm_factor(norm); factor != 1.0) {
    // As bound_norm() scales; scaling is monotone, so the largest stays the largest.
    largest = static_cast<float>(static_cast<double>(largest) * factor);
    if (!stored) {
      for (float& v : update.delta) v = static_cast<float>(static_cast<double>(v) * factor);
    }
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
  if (!failed_step_.is_ok()) return failed_step_;
  if (!streaming() && update.is_stored()) {
    // Median, trimmed mean and Krum see the round's updates together: read it in.
    update.delta.resize(static_cast<size_t>(parameter_count_));
    Status read = update.stored->read(update.delta);
    const Status finished = update.stored->finish();
    if (read.is_ok()) read = finished;
    if (!read.is_ok()) {
      ++refused_;
      return Status(read.code(), "update " + update.id + " from " + update.site + ": " + read.message());
    }
  }
  double norm = 0.0;
  float largest = 0.0f;
  if (Status s = check(update, norm, largest); !s.is_ok()) {
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
  if (Status s = take(std::move(update), std::move(info), largest); !s.is_ok()) {
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
  if (!failed_step_.is_ok()) return failed_step_;
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
  if (!failed_step_.is_ok()) return failed_step_;
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
  float largest = 0.0f;
  FEDMESH_RETURN_IF_ERROR(check(aggregate, norm, largest));
  AppliedUpdateRecord info{aggregate.id, aggregate.site, 0, 1.0, norm};
  FEDMESH_RETURN_IF_ERROR(take(std::move(aggregate), std::move(info), largest));
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

Status RoundManager::step_in_slices() {
  // FedBuff divides by the sample weights without staleness, so stale
  // updates shrink the step instead of only trading places with fresh ones:
  // delta = sum(n s(tau) d) / sum(n), both sums in fixed point. FedAsync:
  // x <- x + a s(tau) (x_site - x), with x_site - x taken as the site's delta
  // (exact when the update is based on the current version).
  double factor = 1.0;
  if (options_.asynchronous && options_.fedasync_mixing == 0.0) {
    int64_t with_staleness = 0, without = 0;
    for (const AppliedUpdateRecord& info : buffer_info_) {
      with_staleness += federation::to_fixed_point(info.weight);
      without += federation::to_fixed_point(info.weight / options_.staleness.weight(info.staleness));
    }
    factor = without > 0 ? static_cast<double>(with_staleness) / static_cast<double>(without) : 0.0;
  }
  if (options_.fedasync_mixing > 0.0) {
    factor = options_.fedasync_mixing * options_.staleness.weight(buffer_info_.front().staleness);
  }
  const size_t slice_values = static_cast<size_t>(std::min(kSliceValues, parameter_count_));
  std::vector<float> values, delta(slice_values);
  for (const SiteUpdate& update : buffer_) {
    if (update.is_stored()) values.resize(slice_values);
  }
  // Once a stored update's slice was read, the model may change: a failure
  // from there on leaves it between versions (failed_step_).
  Status status;
  int64_t offset = 0;  // of tensor i in the model laid end to end
  for (size_t i = 0; i < model_.size() && status.is_ok(); offset += model_[i].numel(), ++i) {
    const int64_t numel = model_[i].numel();
    for (int64_t first = 0; first < numel && status.is_ok(); first += kSliceValues) {
      const int64_t n = std::min(kSliceValues, numel - first);
      federation::ExactAccumulator part =
          accumulator_ ? accumulator_->slice(offset + first, n) : federation::ExactAccumulator(n);
      for (size_t u = 0; u < buffer_.size() && status.is_ok(); ++u) {
        const SiteUpdate& update = buffer_[u];
        if (!update.is_stored()) continue;
        const std::span<float> read = std::span<float>(values).first(static_cast<size_t>(n));
        status = update.stored->read(read);
        if (!status.is_ok()) {
          status = Status(status.code(), "update " + update.id + " from " + update.site + ": " + status.message());
          break;
        }
        if (const double f = norm_factor(buffer_info_[u].norm); f != 1.0) {
          for (float& v : read) v = static_cast<float>(static_cast<double>(v) * f);
        }
        status = part.add(read, buffer_info_[u].weight);
      }
      if (!status.is_ok()) break;
      const std::span<float> mean = std::span<float>(delta).first(static_cast<size_t>(n));
      part.mean(mean);
      if (factor != 1.0) {  // x 1.0 would give the same bits
        for (float& value : mean) value = static_cast<float>(value * factor);
      }
      status = server_->step_range(names_[i], model_[i], first, mean);
    }
  }
  for (const SiteUpdate& update : buffer_) {
    if (!update.is_stored()) continue;
    const Status finished = update.stored->finish();  // every pass ends, and checks what it read
    if (status.is_ok() && !finished.is_ok()) {
      status = Status(finished.code(), "update " + update.id + " from " + update.site + ": " + finished.message());
    }
  }
  if (!status.is_ok()) {
    failed_step_ = Status(status.code(), "the server step to version " + std::to_string(version_ + 1) +
                                             " failed part way, the model in memory is between versions: " +
                                             status.message() + "; restart from the store");
    return failed_step_;
  }
  server_->end_step();
  return Status::ok();
}

Result<RoundRecord> RoundManager::apply_buffer(bool closed_by_deadline) {
  if (streaming()) {
    FEDMESH_RETURN_IF_ERROR(step_in_slices());
  } else {
    std::vector<float> delta(static_cast<size_t>(parameter_count_), 0.0f);
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
  }
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

Status RoundManager::take(SiteUpdate update, AppliedUpdateRecord info, float largest) {
  if (streaming() && update.is_stored()) {
    // Left where it is stored and folded at the step, slice by slice: the
    // manager's memory is the model, whatever the round's size and the
    // model's. The sum is exact and order-independent, so the bits are
    // those of folding it whole. Whether the sum can take it (it could
    // overflow) is decided now, as ExactAccumulator::add decides, so that
    // it is refused here, alone, never at the step.
    const double largest_term = info.weight * static_cast<double>(largest);
    FEDMESH_RETURN_IF_ERROR(federation::ExactAccumulator::check_bound(
        (accumulator_ ? accumulator_->bound_used() : 0.0) + stored_bound_, largest_term));
    stored_bound_ += largest_term;
  } else if (streaming()) {
    // Given in memory: folded in now and its values dropped, so the manager
    // holds the model and one sum however many updates the round takes.
    if (!accumulator_) accumulator_ = std::make_unique<federation::ExactAccumulator>(parameter_count_);
    FEDMESH_RETURN_IF_ERROR(accumulator_->add(update.delta, info.weight, stored_bound_));
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
  stored_bound_ = 0.0;
}

int64_t RoundManager::held_update_values() const {
  int64_t held = 0;
  for (const SiteUpdate& update : buffer_) held += static_cast<int64_t>(update.delta.size());
  return held;
}

}  // namespace fedmesh::aggregator
