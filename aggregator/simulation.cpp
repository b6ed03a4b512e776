#include "aggregator/simulation.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "aggregator/manager_checkpoint.h"
#include "node/model.h"
#include "store/checkpoint_store.h"

namespace fedmesh::aggregator {

namespace {

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
    Rng rng(mix_seed(options_.seed, 0x517e));
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
    local.seed = mix_seed(mix_seed(options_.seed, std::hash<std::string>{}(site.name)), static_cast<uint64_t>(serial));
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

  // The flags that decide a simulation's trajectory, kept in the store so a
  // resumed run is the same run.
  nlohmann::json fingerprint() const {
    const RoundOptions& r = options_.rounds_options;
    return {{"sites", options_.sites}, {"partition", options_.partition.to_string()}, {"model", options_.model},
            {"local_steps", options_.local_steps}, {"batch_size", options_.local.batch_size},
            {"lr", options_.local.lr}, {"optimizer", options_.local.optimizer}, {"dropout", options_.dropout},
            {"straggler", {options_.straggler_fraction, options_.straggler_factor}},
            {"poisoned", options_.poisoned_sites}, {"seed", options_.seed}, {"strategy", r.server.name},
            {"server_lr", r.server.lr}, {"rule", r.rule}, {"norm_bound", r.norm_bound},
            {"sites_per_round", r.sites_per_round}, {"staleness", r.staleness.to_string()}};
  }

  Status commit(store::CheckpointStore& checkpoints, const SimulationRound& round, int64_t round_index, double time,
                int64_t serial, const Rng& dropout, const SimulationSummary& summary) {
    nlohmann::json state = {
        {"round_index", round_index}, {"time", time}, {"serial", serial},
        {"dropout_rng", {{"words", dropout.state().words}, {"spare", dropout.state().spare_normal},
                         {"has_spare", dropout.state().has_spare_normal}}},
        {"bytes_sent", summary.bytes_sent}, {"bytes_received", summary.bytes_received},
        {"refused_updates", summary.refused_updates}};
    nlohmann::json metrics = {{"test_accuracy", round.test_accuracy}, {"test_loss", round.test_loss},
                              {"dropped", round.dropped}};
    return commit_manager_round(checkpoints, *manager_, round.record, std::move(metrics), std::move(state));
  }

  // Restores the newest intact round; returns the round index to go on from.
  Result<int64_t> resume(store::CheckpointStore& checkpoints, double& time, int64_t& serial, Rng& dropout,
                         SimulationSummary& summary) {
    std::vector<Status> skipped;
    Result<store::LoadedCheckpoint> latest = checkpoints.load_latest(&skipped);
    for (const Status& s : skipped) std::fprintf(stderr, "fedmesh sim: skipping corrupt checkpoint: %s\n", s.message().c_str());
    if (!latest.is_ok()) return latest.status();
    Result<nlohmann::json> restored = restore_manager(*latest, *manager_);
    if (!restored.is_ok()) return restored.status();
    try {
      const nlohmann::json& state = *restored;
      Rng::State rng;
      rng.words = state.at("dropout_rng").at("words").get<std::array<uint64_t, 4>>();
      rng.spare_normal = state.at("dropout_rng").at("spare").get<double>();
      rng.has_spare_normal = state.at("dropout_rng").at("has_spare").get<bool>();
      dropout.set_state(rng);
      time = state.at("time").get<double>();
      serial = state.at("serial").get<int64_t>();
      summary.bytes_sent = state.at("bytes_sent").get<int64_t>();
      summary.bytes_received = state.at("bytes_received").get<int64_t>();
      summary.refused_updates = state.at("refused_updates").get<int64_t>();
      summary.resumed_from_round = latest->round.round;
      return state.at("round_index").get<int64_t>() + 1;
    } catch (const nlohmann::json::exception& error) {
      return corrupt(std::string("the simulation state in the checkpoint is malformed: ") + error.what());
    }
  }

  Result<SimulationSummary> run_sync(const std::function<void(const SimulationRound&)>& on_round) {
    SimulationSummary summary;
    Rng dropout(mix_seed(options_.seed, 0xd20b));
    std::vector<std::string> names;
    for (const VirtualSite& site : sites_) names.push_back(site.name);
    double time = 0.0;
    int64_t serial = 0;
    int64_t first_round = 0;
    std::optional<store::CheckpointStore> checkpoints;
    if (!options_.db.empty()) {
      Result<store::CheckpointStore> opened = store::CheckpointStore::open(options_.db);
      if (!opened.is_ok()) return opened.status();
      checkpoints.emplace(std::move(*opened));
      Result<std::optional<std::string>> stored = checkpoints->meta("sim_config");
      if (!stored.is_ok()) return stored.status();
      Result<std::vector<store::RoundInfo>> committed = checkpoints->rounds();
      if (!committed.is_ok()) return committed.status();
      if (committed->empty()) {
        FEDMESH_RETURN_IF_ERROR(checkpoints->set_meta("sim_config", fingerprint().dump()));
      } else {
        if (!stored->has_value() || nlohmann::json::parse(**stored, nullptr, false) != fingerprint()) {
          return invalid_argument(options_.db + " holds checkpoints of a different simulation (its flags were " +
                                  (stored->has_value() ? **stored : std::string("unrecorded")) +
                                  "); give the same flags to resume it, or a new --db");
        }
        Result<int64_t> next = resume(*checkpoints, time, serial, dropout, summary);
        if (!next.is_ok()) return next.status();
        first_round = *next;
        std::fprintf(stderr, "fedmesh sim: resuming from %s: round %lld of %lld committed\n", options_.db.c_str(),
                     static_cast<long long>(summary.resumed_from_round), static_cast<long long>(options_.rounds));
      }
    }
    for (int64_t r = first_round; r < options_.rounds; ++r) {
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
      // Commit, then announce.
      if (checkpoints) FEDMESH_RETURN_IF_ERROR(commit(*checkpoints, round, r, time, serial, dropout, summary));
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
  if (!db.empty() && rounds_options.asynchronous) {
    return invalid_argument("--db checkpoints synchronous simulations only: an asynchronous run has updates in "
                            "flight that a checkpoint does not capture yet");
  }
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
