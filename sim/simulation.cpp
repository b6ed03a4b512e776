#include "sim/simulation.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "federation/compression_checkpoint.h"
#include "aggregator/manager_checkpoint.h"
#include "aggregator/secure_session.h"
#include "crypto/keys.h"
#include "crypto/masking.h"
#include "privacy/dp_settings.h"
#include "privacy/ledger.h"
#include "privacy/rdp_accountant.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "protocol/compressor.h"
#include "store/checkpoint_store.h"

namespace fedmesh::sim {

namespace {

struct VirtualSite {
  std::string name;
  std::unique_ptr<train::data::Dataset> shard;
  double speed = 1.0;  // time per local step
  bool poisoned = false;
  std::optional<protocol::UpdateCompressor> compressor;  // made at its first update
};

// The PowerSGD weights of a round: each site's sample count.
double sample_weight(const aggregator::SiteUpdate& update) { return static_cast<double>(std::max<int64_t>(1, update.sample_count)); }

class Simulation {
 public:
  Simulation(const SimulationOptions& options, SimulationData data) : options_(options), data_(std::move(data)) {}

  Status prepare() {
    if (data_.shards.size() != static_cast<size_t>(options_.sites) || data_.test == nullptr) {
      return invalid_argument("simulation data for " + std::to_string(data_.shards.size()) + " sites, options for " +
                              std::to_string(options_.sites));
    }
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
      site.shard = std::move(data_.shards[static_cast<size_t>(i)]);
      site.poisoned = i < options_.poisoned_sites;
      sites_.push_back(std::move(site));
    }
    for (int i = 0; i < stragglers; ++i) sites_[static_cast<size_t>(order[static_cast<size_t>(i)])].speed = options_.straggler_factor;
    Result<std::unique_ptr<train::Sequential>> worker =
        train::make_initial_model(options_.model, options_.seed, data_.model_input(), options_.init);
    if (!worker.is_ok()) return worker.status();
    worker_ = std::move(*worker);
    std::vector<std::string> names;
    std::vector<Tensor> model;
    for (Parameter* p : worker_->parameters()) {
      names.push_back(p->name);
      model.push_back(p->value.clone());
    }
    for (size_t t = 0; t < names.size(); ++t) manifest_.push_back({names[t], model[t].shape()});
    Result<aggregator::RoundManager> manager = aggregator::RoundManager::create(options_.rounds_options, std::move(names), std::move(model));
    if (!manager.is_ok()) return manager.status();
    manager_.emplace(std::move(*manager));
    Result<crypto::SiteKeys> keys = crypto::generate_site_keys("sim-site");
    if (!keys.is_ok()) return keys.status();
    keys_ = std::move(*keys);
    if (options_.secure) {
      // Private mode: every virtual site its own identity on a roster.
      roster_.federation = "sim";
      for (const VirtualSite& site : sites_) {
        Result<crypto::SiteKeys> own = crypto::generate_site_keys(site.name);
        if (!own.is_ok()) return own.status();
        roster_.sites.push_back({own->identity, crypto::Role::kSite, ""});
        site_keys_.push_back(std::move(*own));
      }
      accounting_.q = options_.rounds_options.sites_per_round > 0
                          ? std::min(1.0, static_cast<double>(options_.rounds_options.sites_per_round) / options_.sites)
                          : 1.0;
      accounting_.sigma = options_.dp_noise_multiplier;
      accounting_.delta = options_.dp_delta;
    }
    // The compression backend is usable (a CUDA one may not be), before any training.
    Result<kernels::CompressionKernels*> backend = kernels::compression_kernels_named(options_.compression_device);
    if (!backend.is_ok()) return backend.status();
    // PowerSGD's shared Q starts as a seeded Gaussian (cols x rank per tensor).
    Rng q_rng(mix_seed(options_.seed, 0x9b0f));
    for (const protocol::TensorShape& shape : manifest_) {
      const protocol::CompressionSpec spec = options_.compression.for_tensor(shape.name, shape.dims);
      if (spec.method != protocol::CompressionMethod::kPowerSgd) continue;
      std::vector<float>& q = shared_q_.emplace_back(static_cast<size_t>(shape.dims[1] * spec.rank));
      for (float& v : q) v = static_cast<float>(q_rng.normal());
    }
    // The manifest the Q_i factors are decoded with: each PowerSGD tensor's
    // place holds its factor's shape (cols x rank).
    q_manifest_ = manifest_;
    for (protocol::TensorShape& shape : q_manifest_) {
      const protocol::CompressionSpec spec = options_.compression.for_tensor(shape.name, shape.dims);
      if (spec.method != protocol::CompressionMethod::kPowerSgd) continue;
      shape = {protocol::powersgd_factor_name(shape.name, 'q'), {shape.dims[1], spec.rank}};
    }
    return Status::ok();
  }

  Result<protocol::UpdateCompressor> make_compressor(size_t site_index) const {
    Result<kernels::CompressionKernels*> backend = kernels::compression_kernels_named(options_.compression_device);
    if (!backend.is_ok()) return backend.status();
    return protocol::UpdateCompressor::create(options_.compression, manifest_,
                                              mix_seed(options_.seed, 0xc0de + site_index), **backend);
  }

  // Sends a batch of trained updates the way sites would: compressed with
  // each site's error feedback, signed and chunked; each update's delta
  // becomes what the aggregator decodes. Returns the uplink bytes; adds the
  // downlink of PowerSGD's shared P to `downlink`.
  Result<int64_t> transmit(std::vector<std::pair<size_t, aggregator::SiteUpdate>>& batch, int64_t& downlink) {
    int64_t bytes = 0;
    for (auto& [index, update] : batch) {
      VirtualSite& site = sites_[index];
      if (!site.compressor) {
        Result<protocol::UpdateCompressor> made = make_compressor(index);
        if (!made.is_ok()) return made.status();
        site.compressor.emplace(std::move(*made));
      }
      FEDMESH_RETURN_IF_ERROR(site.compressor->begin(tensor_spans(update.delta)));
    }
    std::vector<std::vector<float>> shared_p;
    if (!shared_q_.empty()) {
      // Exchange 1: every site sends P_i = a Q; the aggregator averages them
      // (weighted as the round manager weights updates), orthonormalizes and
      // sends P back.
      const std::vector<size_t>& tensors = sites_[batch.front().first].compressor->powersgd_tensors();
      double total_weight = 0.0;
      for (auto& [index, update] : batch) {
        Result<std::vector<std::vector<float>>> p = sites_[index].compressor->powersgd_p(shared_q_);
        if (!p.is_ok()) return p.status();
        const double w = sample_weight(update);
        total_weight += w;
        if (shared_p.empty()) shared_p.resize(p->size());
        std::vector<protocol::EncodedTensor> factors;
        for (size_t i = 0; i < p->size(); ++i) {
          std::vector<float>& sum = shared_p[i];
          sum.resize((*p)[i].size(), 0.0f);
          for (size_t e = 0; e < sum.size(); ++e) sum[e] += static_cast<float>(w) * (*p)[i][e];
          Result<std::vector<protocol::EncodedSegment>> segments =
              protocol::encode_dense(static_cast<uint32_t>(tensors[i]), (*p)[i], protocol::Encoding::kDenseF32,
                                     protocol::kDefaultChunkBytes);
          if (!segments.is_ok()) return segments.status();
          const int64_t rank = static_cast<int64_t>((*p)[i].size()) / manifest_[tensors[i]].dims[0];
          factors.push_back({{protocol::powersgd_factor_name(manifest_[tensors[i]].name, 'p'),
                              {manifest_[tensors[i]].dims[0], rank}, protocol::Encoding::kDenseF32, 0},
                             std::move(*segments)});
        }
        bytes += static_cast<int64_t>(protocol::wire_bytes(
            protocol::prepare_encoded_update(metadata_for(update), std::move(factors), keys_)));
      }
      for (size_t i = 0; i < shared_p.size(); ++i) {
        for (float& v : shared_p[i]) v = static_cast<float>(v / total_weight);
        const int64_t rows = manifest_[tensors[i]].dims[0];
        kernels::cpu_compression_kernels().orthonormalize_columns(shared_p[i], rows,
                                                                  static_cast<int64_t>(shared_p[i].size()) / rows);
        downlink += static_cast<int64_t>(batch.size() * shared_p[i].size() * sizeof(float));
      }
      for (std::vector<float>& q : shared_q_) std::fill(q.begin(), q.end(), 0.0f);
    }
    double total_weight = 0.0;
    for (auto& [index, update] : batch) {
      Result<protocol::CompressedUpdate> compressed = sites_[index].compressor->finish(shared_p);
      if (!compressed.is_ok()) return compressed.status();
      sites_[index].compressor->release_buffers();  // many sites: keep only their residuals between rounds
      size_t offset = 0;
      for (const std::vector<float>& decoded : compressed->decoded) {
        std::copy(decoded.begin(), decoded.end(), update.delta.begin() + static_cast<int64_t>(offset));
        offset += decoded.size();
      }
      if (!shared_q_.empty()) {
        // The new shared Q: the same weighted mean of the sites' Q_i, as the
        // aggregator would decode them (the factors come in manifest order).
        const double w = sample_weight(update);
        total_weight += w;
        size_t i = 0;
        for (const protocol::EncodedTensor& tensor : compressed->tensors) {
          if (!tensor.descriptor.name.ends_with("@powersgd.q")) continue;
          for (const protocol::EncodedSegment& segment : tensor.segments) {
            FEDMESH_RETURN_IF_ERROR(
                protocol::accumulate_segment(segment.view(), q_manifest_, static_cast<float>(w), shared_q_[i]));
          }
          ++i;
        }
      }
      bytes += static_cast<int64_t>(protocol::wire_bytes(
          protocol::prepare_encoded_update(metadata_for(update), std::move(compressed->tensors), keys_)));
    }
    for (std::vector<float>& q : shared_q_) {
      for (float& v : q) v = static_cast<float>(v / total_weight);
    }
    return bytes;
  }

  // Local training of `site` from the current global model.
  Result<aggregator::SiteUpdate> train_site(VirtualSite& site, int64_t round, int64_t serial) {
    load_global();
    train::TrainOptions local = options_.local;
    local.max_steps = options_.local_steps;
    local.seed = mix_seed(mix_seed(options_.seed, std::hash<std::string>{}(site.name)), static_cast<uint64_t>(serial));
    train::Trainer trainer(*worker_, local);
    const train::TrainSummary summary = trainer.fit(*site.shard, nullptr, {});
    aggregator::SiteUpdate update;
    update.id = site.name + "/" + std::to_string(serial);
    update.site = site.name;
    update.round = round;
    update.base_version = manager_->version();
    update.sample_count = std::min<int64_t>(site.shard->size(), options_.rounds_options.max_sample_count);
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

  SimulationRound evaluate(const aggregator::RoundRecord& record, double time) {
    load_global();
    train::TrainOptions options = options_.local;
    train::Trainer evaluator(*worker_, options);
    const train::EvalResult result = evaluator.evaluate(*data_.test);
    SimulationRound round;
    round.record = record;
    round.virtual_time = time;
    round.test_accuracy = result.accuracy;
    round.test_loss = result.loss;
    if (data_.tokens_per_byte > 0.0) round.bits_per_byte = train::data::bits_per_byte(result.loss, data_.tokens_per_byte);
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

  // The index of the virtual site with this name (sites_.size(): none).
  size_t site_index(std::string_view name) const {
    const auto site = std::find_if(sites_.begin(), sites_.end(), [&](const VirtualSite& s) { return s.name == name; });
    return static_cast<size_t>(site - sites_.begin());
  }
  int64_t model_bytes() const { return manager_->parameter_count() * static_cast<int64_t>(sizeof(float)); }

  std::vector<std::span<const float>> tensor_spans(const std::vector<float>& flat) const {
    std::vector<std::span<const float>> spans;
    size_t offset = 0;
    for (const protocol::TensorShape& shape : manifest_) {
      spans.emplace_back(flat.data() + offset, shape.element_count());
      offset += shape.element_count();
    }
    return spans;
  }

  static protocol::UpdateMetadata metadata_for(const aggregator::SiteUpdate& update) {
    protocol::UpdateMetadata metadata;
    metadata.federation = "sim";
    metadata.round = static_cast<uint64_t>(update.round);
    metadata.base_version = static_cast<uint64_t>(update.base_version);
    metadata.sender = update.site;
    metadata.recipient = "aggregator";
    metadata.sequence = 1;
    metadata.sample_count = static_cast<uint64_t>(update.sample_count);
    return metadata;
  }

  // The flags that decide a simulation's trajectory, kept in the store so a
  // resumed run is the same run.
  nlohmann::json fingerprint() const {
    const aggregator::RoundOptions& r = options_.rounds_options;
    const bool text = train::language_model_config(options_.model).has_value();
    return {{"sites", options_.sites}, {"partition", text ? options_.text_partition : options_.partition.to_string()},
            {"model", options_.model},
            {"local_steps", options_.local_steps}, {"batch_size", options_.local.batch_size},
            {"lr", options_.local.lr}, {"optimizer", options_.local.optimizer}, {"dropout", options_.dropout},
            {"straggler", {options_.straggler_fraction, options_.straggler_factor}},
            {"poisoned", options_.poisoned_sites}, {"seed", options_.seed}, {"strategy", r.server.name},
            {"server_lr", r.server.lr}, {"rule", r.rule}, {"norm_bound", r.norm_bound},
            {"sites_per_round", r.sites_per_round}, {"staleness", r.staleness.to_string()},
            {"compression", options_.compression.to_string()}};
  }

  nlohmann::json fingerprint_with_privacy() const {
    nlohmann::json f = fingerprint();
    // A run from a file or with LoRA says so (a seeded full run, as before, nothing).
    if (!options_.init.path.empty()) f["init"] = options_.init.path;
    if (options_.init.lora.enabled()) f["lora"] = options_.init.lora.to_json();
    if (options_.secure) {
      f["secure"] = {{"clip", options_.secure_options.clip}, {"fraction_bits", options_.secure_options.fraction_bits},
                     {"threshold", options_.secure_options.threshold}, {"dp_noise", options_.dp_noise_multiplier},
                     {"dp_delta", options_.dp_delta}};
    }
    return f;
  }

  // Private mode: the round's sampled sites run one secure-aggregation
  // session (those in `dropped` never advertise), and the round closes with
  // the decoded mean (plus DP-FedAvg noise), or with nothing on an abort.
  Result<aggregator::RoundRecord> close_secure(const std::vector<std::string>& sampled, const std::set<std::string>& dropped,
                                   std::vector<std::pair<size_t, aggregator::SiteUpdate>>& batch, double time, int64_t& bytes,
                                   int64_t& bytes_received) {
    if (sampled.size() < 2) return manager_->close_round(time);  // secure aggregation needs two sites
    std::vector<aggregator::VirtualSecureSite> sites;
    std::map<std::string, crypto::SecAggPhase> dropped_at;
    for (const std::string& name : sampled) {
      const size_t index = site_index(name);
      aggregator::VirtualSecureSite site;
      site.keys = &site_keys_[index];
      if (dropped.count(name) != 0) {
        dropped_at[name] = crypto::SecAggPhase::kAdvertise;
      } else {
        for (auto& [i, update] : batch) {
          if (i == index) site.input = crypto::quantize_clipped(update.delta, options_.secure_options.clip,
                                                                options_.secure_options.fraction_bits);
        }
      }
      sites.push_back(std::move(site));
    }
    crypto::SecAggParams params;
    params.federation = roster_.federation;
    params.round = static_cast<uint64_t>(manager_->round());
    params.session = "sim-r" + std::to_string(manager_->round());
    params.length = static_cast<uint64_t>(manager_->parameter_count());
    const uint32_t majority = crypto::secagg_min_threshold(sampled.size());
    params.threshold = std::min<uint32_t>(std::max(options_.secure_options.threshold, majority),
                                          static_cast<uint32_t>(sampled.size()));
    Result<aggregator::SecureSessionOutcome> outcome = aggregator::run_secure_session(roster_, params, std::move(sites), dropped_at);
    if (!outcome.is_ok()) return outcome.status();
    bytes += static_cast<int64_t>(outcome->bytes_up);
    bytes_received += static_cast<int64_t>(outcome->bytes_down);
    if (!outcome->done) return manager_->close_round(time);  // aborted: no step this round
    std::vector<float> mean = outcome->result.mean(options_.secure_options.fraction_bits);
    if (options_.dp_noise_multiplier > 0.0) {
      // Seeded so that a simulation replays: not private (the ledger says so).
      crypto::SeededNoiseSource noise(mix_seed(options_.seed, 0xd9f0 + static_cast<uint64_t>(manager_->round())));
      aggregator::add_dp_fedavg_noise(mean, options_.dp_noise_multiplier, options_.secure_options.clip,
                                      outcome->result.contributors.size(), noise);
      released_noised_mean_ = true;
    }
    return manager_->close_round_with_mean(std::move(mean), outcome->result.contributors);
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
    // Every site's error-feedback state, and PowerSGD's shared Q.
    std::deque<Tensor> views;
    std::vector<store::TensorToCommit> extra;
    nlohmann::json compressor_rounds = nlohmann::json::object();
    for (VirtualSite& site : sites_) {
      if (!site.compressor) continue;
      federation::add_compression_tensors(*site.compressor, site.name + "/", views, extra);
      compressor_rounds[site.name] = site.compressor->rounds();
    }
    for (size_t i = 0; i < shared_q_.size(); ++i) {
      views.push_back(Tensor::view_of(shared_q_[i].data(), Shape{static_cast<int64_t>(shared_q_[i].size())}, DType::kF32));
      extra.push_back({"powersgd_q", std::to_string(i), &views.back()});
    }
    state["compressor_rounds"] = compressor_rounds;
    // A round that released a noised mean commits its ledger entry with it.
    std::optional<store::PrivacyEntry> privacy;
    if (released_noised_mean_) {
      privacy = privacy::ledger_entry(accounting_, kSimulationDpMechanism, round.record.round, manager_->version());
      metrics["epsilon"] = privacy->epsilon;
      metrics["delta"] = privacy->delta;
    }
    return aggregator::commit_manager_round(checkpoints, *manager_, round.record, std::move(metrics), std::move(state),
                                            {}, extra, std::move(privacy));
  }

  // Restores the newest intact round; returns the round index to go on from.
  Result<int64_t> resume(store::CheckpointStore& checkpoints, double& time, int64_t& serial, Rng& dropout,
                         SimulationSummary& summary) {
    Result<store::LoadedCheckpoint> latest = checkpoints.resume_latest(
        [](const store::QuarantineNotice& n) { std::fprintf(stderr, "fedmesh sim: warning: %s\n", n.message.c_str()); });
    if (!latest.is_ok()) return latest.status();
    Result<nlohmann::json> restored = aggregator::restore_manager(*latest, *manager_);
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
      for (const auto& [name, rounds] : state.at("compressor_rounds").items()) {
        const size_t index = site_index(name);
        if (index == sites_.size()) return corrupt("the checkpoint has compression state of an unknown site " + name);
        Result<protocol::UpdateCompressor> made = make_compressor(index);
        if (!made.is_ok()) return made.status();
        VirtualSite& site = sites_[index];
        site.compressor.emplace(std::move(*made));
        site.compressor->set_rounds(rounds.get<int64_t>());
        FEDMESH_RETURN_IF_ERROR(federation::restore_compression_tensors(*site.compressor, site.name + "/", *latest));
      }
      for (size_t i = 0; i < shared_q_.size(); ++i) {
        const store::StoredTensor* q = latest->find("powersgd_q", std::to_string(i));
        if (q == nullptr || static_cast<size_t>(q->value.numel()) != shared_q_[i].size()) {
          return corrupt("the checkpoint's PowerSGD Q " + std::to_string(i) + " is missing or of the wrong size");
        }
        std::memcpy(shared_q_[i].data(), q->value.raw(), shared_q_[i].size() * sizeof(float));
      }
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
        FEDMESH_RETURN_IF_ERROR(checkpoints->set_meta("sim_config", fingerprint_with_privacy().dump()));
      } else {
        if (!stored->has_value() || nlohmann::json::parse(**stored, nullptr, false) != fingerprint_with_privacy()) {
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
      released_noised_mean_ = false;
      FEDMESH_RETURN_IF_ERROR(manager_->start_round(names, time));
      const std::vector<std::string> sampled = manager_->sampled();
      double round_time = 0.0;
      int64_t dropped = 0, bytes = 0;
      std::set<std::string> dropped_names;
      std::vector<std::pair<size_t, aggregator::SiteUpdate>> batch;
      for (const std::string& name : sampled) {
        const size_t index = site_index(name);
        VirtualSite& site = sites_[index];
        summary.bytes_received += model_bytes();
        if (dropout.uniform() < options_.dropout) {
          ++dropped;
          dropped_names.insert(name);
          continue;
        }
        Result<aggregator::SiteUpdate> update = train_site(site, manager_->round(), ++serial);
        if (!update.is_ok()) return update.status();
        round_time = std::max(round_time, static_cast<double>(options_.local_steps) * site.speed);
        batch.emplace_back(index, std::move(*update));
      }
      // Without dropouts the round closes when the slowest site reports; with
      // one, at the deadline (a silent site never holds a round past it).
      const double deadline = options_.rounds_options.round_deadline_seconds;
      const double closes_at = time + (dropped > 0 ? std::max(deadline, round_time) : round_time);
      Result<aggregator::RoundRecord> record = invalid_argument("no round");
      if (options_.secure) {
        record = close_secure(sampled, dropped_names, batch, closes_at, bytes, summary.bytes_received);
      } else {
        if (!batch.empty()) {
          Result<int64_t> sent = transmit(batch, summary.bytes_received);
          if (!sent.is_ok()) return sent.status();
          bytes = *sent;
        }
        for (auto& [index, update] : batch) {
          Result<std::optional<aggregator::RoundRecord>> submitted = manager_->submit(std::move(update), time);
          if (!submitted.is_ok()) ++summary.refused_updates;
        }
        record = manager_->close_round(closes_at);
      }
      time = closes_at;
      if (!record.is_ok()) return record.status();
      SimulationRound round = evaluate(*record, time);
      round.dropped = dropped;
      round.bytes = bytes;
      if (options_.secure && options_.dp_noise_multiplier > 0.0) {
        // Every server step released one noised mean.
        round.epsilon = accounting_.after(manager_->version()).epsilon;
        summary.epsilon = round.epsilon;
        summary.delta = options_.dp_delta;
      }
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
    // (finish time, site index) -> the update it will deliver then, and its wire bytes.
    std::multimap<std::pair<double, size_t>, std::pair<aggregator::SiteUpdate, int64_t>> in_flight;
    int64_t serial = 0;
    double time = 0.0;
    const auto launch = [&](size_t index, double start) -> Status {
      summary.bytes_received += model_bytes();
      Result<aggregator::SiteUpdate> update = train_site(sites_[index], 0, ++serial);
      if (!update.is_ok()) return update.status();
      std::vector<std::pair<size_t, aggregator::SiteUpdate>> one;
      one.emplace_back(index, std::move(*update));
      Result<int64_t> sent = transmit(one, summary.bytes_received);
      if (!sent.is_ok()) return sent.status();
      in_flight.emplace(std::make_pair(start + static_cast<double>(options_.local_steps) * sites_[index].speed, index),
                        std::make_pair(std::move(one.front().second), *sent));
      return Status::ok();
    };
    for (size_t i = 0; i < sites_.size(); ++i) FEDMESH_RETURN_IF_ERROR(launch(i, 0.0));
    int64_t bytes = 0;
    while (manager_->version() < options_.rounds && !in_flight.empty()) {
      auto next = in_flight.begin();
      time = next->first.first;
      const size_t index = next->first.second;
      aggregator::SiteUpdate update = std::move(next->second.first);
      bytes += next->second.second;
      in_flight.erase(next);
      Result<std::optional<aggregator::RoundRecord>> submitted = manager_->submit(std::move(update), time);
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
      summary.final_bits_per_byte = summary.rounds.back().bits_per_byte;
    }
  }

  const SimulationOptions& options_;
  SimulationData data_;  // the shards move to the sites in prepare()
  std::vector<VirtualSite> sites_;
  std::unique_ptr<train::Sequential> worker_;
  std::optional<aggregator::RoundManager> manager_;
  std::vector<protocol::TensorShape> manifest_;
  crypto::SiteKeys keys_;                   // signs every virtual site's updates (their size is what counts)
  // Private mode: each virtual site's identity, the roster of them, and DP-FedAvg's accounting.
  std::vector<crypto::SiteKeys> site_keys_;
  crypto::Roster roster_;
  privacy::ConstantRateAccounting accounting_;
  bool released_noised_mean_ = false;  // this round's step added DP-FedAvg noise
  std::vector<std::vector<float>> shared_q_;  // PowerSGD: one per PowerSGD tensor
  std::vector<protocol::TensorShape> q_manifest_;  // the manifest with PowerSGD tensors as their Q factors
};

}  // namespace

Status SimulationOptions::validate() const {
  if (sites < 1 || sites > kMaxSimulatedSites) {
    return invalid_argument("--sites must be in [1, " + std::to_string(kMaxSimulatedSites) + "]");
  }
  if (rounds < 1) return invalid_argument("--rounds must be at least 1");
  if (local_steps < 1) return invalid_argument("--local-steps must be at least 1");
  FEDMESH_RETURN_IF_ERROR(init.lora.validate());
  if (train::language_model_config(model)) FEDMESH_RETURN_IF_ERROR(train::data::check_text_partition(text_partition));
  if (!(dropout >= 0.0 && dropout < 1.0)) return invalid_argument("--dropout must be in [0, 1)");
  if (!(straggler_fraction >= 0.0 && straggler_fraction <= 1.0) || !(straggler_factor >= 1.0) ||
      !std::isfinite(straggler_factor)) {
    return invalid_argument("--straggler P:FACTOR needs P in [0, 1] and FACTOR >= 1");
  }
  if (poisoned_sites < 0 || poisoned_sites > sites) return invalid_argument("poisoned sites must be in [0, sites]");
  if (compression.uses_powersgd() && rounds_options.asynchronous) {
    return invalid_argument("powersgd needs the round's sites to share P, which asynchronous rounds do not have: "
                            "use synchronous rounds, or another compressor");
  }
  if (!db.empty() && rounds_options.asynchronous) {
    return invalid_argument("--db checkpoints synchronous simulations only: an asynchronous run has updates in "
                            "flight that a checkpoint does not capture yet");
  }
  FEDMESH_RETURN_IF_ERROR(validate_local_training(local, local_steps));
  if (secure) {
    if (rounds_options.asynchronous) return invalid_argument("--mode private needs synchronous rounds (no --async or --fedasync)");
    if (rounds_options.rule != "mean") {
      return invalid_argument("--rule " + rounds_options.rule + " needs each site's update, which --mode private hides "
                              "(secure aggregation reveals only the sum)");
    }
    if (rounds_options.norm_bound > 0.0) return invalid_argument("--norm-bound: in --mode private the sites clip (--dp-clip)");
    if (!compression.is_identity()) {
      return invalid_argument("--compress: --mode private sends 32-bit fixed point under masks (its own linear "
                              "compression); sparse and scaled encodings do not add up under masks");
    }
    if (poisoned_sites > 0) return invalid_argument("--poisoned: not simulated in --mode private");
    const int64_t per_round = rounds_options.sites_per_round > 0 ? rounds_options.sites_per_round : sites;
    if (per_round > static_cast<int64_t>(crypto::kMaxSecAggSites)) {
      return invalid_argument("--mode private takes at most " + std::to_string(crypto::kMaxSecAggSites) +
                              " sites a round (use --sites-per-round)");
    }
    FEDMESH_RETURN_IF_ERROR(secure_options.validate(static_cast<size_t>(per_round)));
  }
  FEDMESH_RETURN_IF_ERROR(privacy::check_dp_settings({std::nullopt, dp_noise_multiplier, dp_delta, 0.0},
                                                      {"", "--dp-noise", "--dp-delta", ""}));
  if (dp_noise_multiplier > 0.0 && !secure) {
    return invalid_argument("--dp-noise: site-level DP-FedAvg needs --mode private (an equal-weight sum of clipped updates)");
  }
  return rounds_options.validate();
}

Result<std::vector<train::data::ImageDataset>> split_among_sites(const train::data::ImageDataset& train, int sites,
                                                          const train::data::PartitionSpec& partition, uint64_t seed) {
  if (train.count < sites) {
    return invalid_argument("--sites " + std::to_string(sites) + " is more than the " + std::to_string(train.count) +
                            " training images");
  }
  Result<std::vector<std::vector<int64_t>>> parts =
      train::data::partition_indices(train.labels, train.num_classes, sites, partition, seed);
  if (!parts.is_ok()) return parts.status();
  std::vector<train::data::ImageDataset> shards;
  shards.reserve(parts->size());
  for (const std::vector<int64_t>& indices : *parts) shards.push_back(train.subset(indices));
  return shards;
}

Status validate_local_training(const train::TrainOptions& local, int64_t local_steps) {
  train::TrainOptions checked = local;
  checked.max_steps = local_steps;
  return checked.validate();
}

Result<SimulationData> image_simulation_data(const SimulationOptions& options, const train::data::ImageDataset& train,
                                             train::data::ImageDataset test) {
  if (train::language_model_config(options.model)) {
    return invalid_argument("model " + options.model + " is a language model: it trains on text, not images");
  }
  Result<std::vector<train::data::ImageDataset>> shards = split_among_sites(train, options.sites, options.partition, options.seed);
  if (!shards.is_ok()) return shards.status();
  SimulationData out;
  for (train::data::ImageDataset& shard : *shards) out.shards.push_back(std::make_unique<train::data::ImageSet>(std::move(shard)));
  out.test = std::make_unique<train::data::ImageSet>(std::move(test));
  return out;
}

Result<SimulationData> own_simulation_data(train::data::LoadedData data, int sites,
                                           const train::data::PartitionSpec& partition, uint64_t seed) {
  if (data.schema.regression) {
    return invalid_argument("fedmesh sim reports accuracy: regression (data.task = \"regression\") is trained with "
                            "`fedmesh train`, or federated with `fedmesh aggregator` and `fedmesh node`");
  }
  if (data.train->size() < sites) {
    return invalid_argument("--sites " + std::to_string(sites) + " is more than the " +
                            std::to_string(data.train->size()) + " training samples");
  }
  // Partitions tell classes apart by a byte: more classes split iid only.
  const bool by_label = partition.kind != train::data::PartitionSpec::Kind::kIid;
  if (by_label && data.schema.classes > train::data::kMaxPartitionClasses) {
    return invalid_argument("--partition " + partition.to_string() + " splits by class, and this data set has " +
                            std::to_string(data.schema.classes) + " classes, more than " +
                            std::to_string(train::data::kMaxPartitionClasses) + ": use --partition iid");
  }
  std::vector<uint8_t> labels(static_cast<size_t>(data.train->size()), 0);
  if (by_label) {
    const std::vector<int32_t> ids = train::data::class_ids(*data.train);
    for (size_t i = 0; i < ids.size() && i < labels.size(); ++i) labels[i] = static_cast<uint8_t>(ids[i]);
  }
  Result<std::vector<std::vector<int64_t>>> parts = train::data::partition_indices(
      labels, by_label ? static_cast<int>(data.schema.classes) : 1, sites, partition, seed);
  if (!parts.is_ok()) return parts.status();
  const std::shared_ptr<const train::data::Dataset> train = std::move(data.train);
  SimulationData out;
  for (std::vector<int64_t>& indices : *parts) {
    out.shards.push_back(std::make_unique<train::data::DatasetSubset>(train, std::move(indices)));
  }
  out.test = std::move(data.test);
  out.schema = std::move(data.schema);
  return out;
}

Result<SimulationData> text_simulation_data(const SimulationOptions& options, const train::data::TextCorpus& corpus,
                                            int64_t train_limit, int64_t test_limit) {
  const std::optional<train::TransformerConfig> language = train::language_model_config(options.model);
  if (!language) return invalid_argument("model " + options.model + " is not a language model: it trains on images");
  SimulationData out;  // (site_windows refuses an unknown partition by name)
  for (int i = 0; i < options.sites; ++i) {
    Result<train::data::SiteWindows> windows =
        train::data::site_windows(corpus, options.text_partition, options.sites, i, language->context, train_limit);
    if (!windows.is_ok()) return invalid_argument("--partition " + options.text_partition + ": " + windows.status().message());
    out.shards.push_back(std::make_unique<train::data::TextWindows>(std::move(windows->train)));
  }
  Result<train::data::TextWindows> test = train::data::held_out_windows(corpus, language->context, test_limit);
  if (!test.is_ok()) return test.status();
  out.tokens_per_byte = train::data::tokens_per_byte(train::data::scored_targets(test->tokens(), language->context), nullptr);
  out.test = std::make_unique<train::data::TextWindows>(std::move(*test));
  return out;
}

Result<SimulationSummary> run_simulation(const SimulationOptions& options, SimulationData data,
                                         const std::function<void(const SimulationRound&)>& on_round) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  Simulation simulation(options, std::move(data));
  FEDMESH_RETURN_IF_ERROR(simulation.prepare());
  return simulation.run(on_round);
}

Result<SimulationSummary> run_simulation(const SimulationOptions& options, const train::data::ImageDataset& train,
                                         const train::data::ImageDataset& test,
                                         const std::function<void(const SimulationRound&)>& on_round) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  Result<SimulationData> data = image_simulation_data(options, train, test);
  if (!data.is_ok()) return data.status();
  return run_simulation(options, std::move(*data), on_round);
}

}  // namespace fedmesh::sim
