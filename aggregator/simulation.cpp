#include "aggregator/simulation.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "node/model.h"

namespace fedmesh::aggregator {

namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

struct VirtualSite {
  std::string name;
  data::ImageDataset shard;
  double speed = 1.0;  // time per local step
  bool poisoned = false;
};

class Simulation {
 public:
  Simulation(const SimulationOptions& options, const data::ImageDataset& test) : options_(options), test_(test) {}

  Status prepare(const data::ImageDataset& train) {
    Result<std::vector<std::vector<int64_t>>> parts = data::partition_indices(
        train.labels, train.num_classes, options_.sites, options_.partition, options_.seed);
    if (!parts.is_ok()) return parts.status();
    Rng rng(mix(options_.seed, 0x517e));
    const int stragglers = static_cast<int>(std::lround(options_.straggler_fraction * options_.sites));
    std::vector<int> order(static_cast<size_t>(options_.sites));
    for (int i = 0; i < options_.sites; ++i) order[static_cast<size_t>(i)] = i;
    rng.shuffle(std::span<int>(order));
    for (int i = 0; i < options_.sites; ++i) {
      VirtualSite site;
      char name[32];
      std::snprintf(name, sizeof name, "site-%04d", i);
      site.name = name;
      site.shard = train.subset((*parts)[static_cast<size_t>(i)]);
      site.poisoned = i < options_.poisoned_sites;
      sites_.push_back(std::move(site));
    }
    for (int i = 0; i < stragglers; ++i) sites_[static_cast<size_t>(order[static_cast<size_t>(i)])].speed = options_.straggler_factor;
    Result<std::unique_ptr<node::Sequential>> worker = node::make_model(options_.model, options_.seed);
    if (!worker.is_ok()) return worker.status();
    worker_ = std::move(*worker);
    std::vector<std::string> names;
    std::vector<Tensor> model;
    for (Parameter* p : worker_->parameters()) {
      names.push_back(p->name);
      model.push_back(p->value.clone());
    }
    Result<RoundManager> manager = RoundManager::create(options_.rounds_options, std::move(names), std::move(model));
    if (!manager.is_ok()) return manager.status();
    manager_.emplace(std::move(*manager));
    return Status::ok();
  }

  // Local training of `site` from the current global model.
  Result<SiteUpdate> train_site(VirtualSite& site, int64_t round, int64_t serial) {
    load_global();
    node::TrainOptions local = options_.local;
    local.max_steps = options_.local_steps;
    local.seed = mix(mix(options_.seed, std::hash<std::string>{}(site.name)), static_cast<uint64_t>(serial));
    node::Trainer trainer(*worker_, local);
    const node::TrainSummary summary = trainer.fit(site.shard, nullptr, {});
    SiteUpdate update;
    update.id = site.name + "/" + std::to_string(serial);
    update.site = site.name;
    update.round = round;
    update.base_version = manager_->version();
    update.sample_count = std::min<int64_t>(site.shard.count, options_.rounds_options.max_sample_count);
    update.local_loss = summary.final_train_loss;
    update.delta.resize(static_cast<size_t>(manager_->parameter_count()));
    size_t offset = 0;
    const std::vector<Tensor>& global = manager_->model();
    std::vector<Parameter*> parameters = worker_->parameters();
    for (size_t t = 0; t < parameters.size(); ++t) {
      const float* local_values = parameters[t]->value.data<float>();
      const float* global_values = global[t].data<float>();
      for (int64_t i = 0; i < global[t].numel(); ++i) {
        float d = local_values[i] - global_values[i];
        if (site.poisoned) d = static_cast<float>(-options_.poison_scale * d);
        update.delta[offset++] = d;
      }
    }
    return update;
  }

  SimulationRound evaluate(const RoundRecord& record, double time) {
    load_global();
    node::TrainOptions options = options_.local;
    node::Trainer evaluator(*worker_, options);
    const node::EvalResult result = evaluator.evaluate(test_);
    SimulationRound round;
    round.record = record;
    round.virtual_time = time;
    round.test_accuracy = result.accuracy;
    round.test_loss = result.loss;
    round.updates = static_cast<int64_t>(record.applied.size());
    return round;
  }

  Result<SimulationSummary> run(const std::function<void(const SimulationRound&)>& on_round) {
    return options_.rounds_options.asynchronous ? run_async(on_round) : run_sync(on_round);
  }

 private:
  void load_global() {
    std::vector<Parameter*> parameters = worker_->parameters();
    for (size_t t = 0; t < parameters.size(); ++t) {
      std::memcpy(parameters[t]->value.raw(), manager_->model()[t].raw(), parameters[t]->value.nbytes());
    }
    worker_->refresh_compute();
  }

  int64_t model_bytes() const { return manager_->parameter_count() * static_cast<int64_t>(sizeof(float)); }

  Result<SimulationSummary> run_sync(const std::function<void(const SimulationRound&)>& on_round) {
    SimulationSummary summary;
    Rng dropout(mix(options_.seed, 0xd20b));
    std::vector<std::string> names;
    for (const VirtualSite& site : sites_) names.push_back(site.name);
    double time = 0.0;
    int64_t serial = 0;
    for (int64_t r = 0; r < options_.rounds; ++r) {
      FEDMESH_RETURN_IF_ERROR(manager_->start_round(names, time));
      const std::vector<std::string> sampled = manager_->sampled();
      double round_time = 0.0;
      int64_t dropped = 0, bytes = 0;
      for (const std::string& name : sampled) {
        VirtualSite& site = *std::find_if(sites_.begin(), sites_.end(), [&](const VirtualSite& s) { return s.name == name; });
        summary.bytes_received += model_bytes();
        if (dropout.uniform() < options_.dropout) {
          ++dropped;
          continue;
        }
        Result<SiteUpdate> update = train_site(site, manager_->round(), ++serial);
        if (!update.is_ok()) return update.status();
        round_time = std::max(round_time, static_cast<double>(options_.local_steps) * site.speed);
        bytes += model_bytes();
        Result<std::optional<RoundRecord>> submitted = manager_->submit(std::move(*update), time);
        if (!submitted.is_ok()) ++summary.refused_updates;
      }
      // Without dropouts the round closes when the slowest site reports; with
      // one, at the deadline (a silent site never holds a round past it).
      const double deadline = options_.rounds_options.round_deadline_seconds;
      time += dropped > 0 ? std::max(deadline, round_time) : round_time;
      Result<RoundRecord> record = manager_->close_round(time);
      if (!record.is_ok()) return record.status();
      SimulationRound round = evaluate(*record, time);
      round.dropped = dropped;
      round.bytes = bytes;
      summary.bytes_sent += bytes;
      summary.rounds.push_back(round);
      if (on_round) on_round(round);
    }
    finish(summary, time);
    return summary;
  }

  Result<SimulationSummary> run_async(const std::function<void(const SimulationRound&)>& on_round) {
    SimulationSummary summary;
    // (finish time, site index) -> the update it will deliver then.
    std::multimap<std::pair<double, size_t>, SiteUpdate> in_flight;
    int64_t serial = 0;
    double time = 0.0;
    const auto launch = [&](size_t index, double start) -> Status {
      summary.bytes_received += model_bytes();
      Result<SiteUpdate> update = train_site(sites_[index], 0, ++serial);
      if (!update.is_ok()) return update.status();
      in_flight.emplace(std::make_pair(start + static_cast<double>(options_.local_steps) * sites_[index].speed, index),
                        std::move(*update));
      return Status::ok();
    };
    for (size_t i = 0; i < sites_.size(); ++i) FEDMESH_RETURN_IF_ERROR(launch(i, 0.0));
    int64_t bytes = 0;
    while (manager_->version() < options_.rounds && !in_flight.empty()) {
      auto next = in_flight.begin();
      time = next->first.first;
      const size_t index = next->first.second;
      SiteUpdate update = std::move(next->second);
      in_flight.erase(next);
      bytes += model_bytes();
      Result<std::optional<RoundRecord>> submitted = manager_->submit(std::move(update), time);
      if (!submitted.is_ok()) {
        ++summary.refused_updates;
      } else if (submitted->has_value()) {
        SimulationRound round = evaluate(**submitted, time);
        round.bytes = bytes;
        summary.bytes_sent += bytes;
        bytes = 0;
        summary.rounds.push_back(round);
        if (on_round) on_round(round);
      }
      FEDMESH_RETURN_IF_ERROR(launch(index, time));
    }
    finish(summary, time);
    return summary;
  }

  void finish(SimulationSummary& summary, double time) {
    summary.virtual_time = time;
    if (!summary.rounds.empty()) {
      summary.final_accuracy = summary.rounds.back().test_accuracy;
      summary.final_loss = summary.rounds.back().test_loss;
    }
  }

  const SimulationOptions& options_;
  const data::ImageDataset& test_;
  std::vector<VirtualSite> sites_;
  std::unique_ptr<node::Sequential> worker_;
  std::optional<RoundManager> manager_;
};

}  // namespace

Status SimulationOptions::validate() const {
  if (sites < 1 || sites > kMaxSimulatedSites) {
    return invalid_argument("--sites must be in [1, " + std::to_string(kMaxSimulatedSites) + "]");
  }
  if (rounds < 1) return invalid_argument("--rounds must be at least 1");
  if (local_steps < 1) return invalid_argument("--local-steps must be at least 1");
  if (!(dropout >= 0.0 && dropout < 1.0)) return invalid_argument("--dropout must be in [0, 1)");
  if (!(straggler_fraction >= 0.0 && straggler_fraction <= 1.0) || !(straggler_factor >= 1.0) ||
      !std::isfinite(straggler_factor)) {
    return invalid_argument("--straggler P:FACTOR needs P in [0, 1] and FACTOR >= 1");
  }
  if (poisoned_sites < 0 || poisoned_sites > sites) return invalid_argument("poisoned sites must be in [0, sites]");
  node::TrainOptions local_check = local;
  local_check.max_steps = local_steps;
  FEDMESH_RETURN_IF_ERROR(local_check.validate());
  return rounds_options.validate();
}

Result<SimulationSummary> run_simulation(const SimulationOptions& options, const data::ImageDataset& train,
                                         const data::ImageDataset& test,
                                         const std::function<void(const SimulationRound&)>& on_round) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  if (train.count < options.sites) {
    return invalid_argument("--sites " + std::to_string(options.sites) + " is more than the " +
                            std::to_string(train.count) + " training images");
  }
  Simulation simulation(options, test);
  FEDMESH_RETURN_IF_ERROR(simulation.prepare(train));
  return simulation.run(on_round);
}

}  // namespace fedmesh::aggregator
