#include "sim/gossip_simulation.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "sim/simulation.h"
#include "crypto/keys.h"
#include "gossip/averaging.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "protocol/update_transfer.h"

namespace fedmesh::sim {

namespace {

// Delayed shares are held whole until they are merged; a flag asking for more
// than this (peers x rounds of delay x model bytes) is refused.
constexpr uint64_t kMaxInFlightBytes = uint64_t{8} << 30;

struct VirtualPeer {
  std::string name;
  std::unique_ptr<train::data::Dataset> shard;
  std::optional<gossip::GossipState> state;
  int64_t version = 0;  // rounds of local training done: the counter staleness is measured in
  Rng topology_rng;     // the random topology's draws
};

// What every recipient of one share merges; shared by its messages.
struct DeliveredShare {
  std::vector<std::vector<float>> decoded;
  double weight = 0.0;  // push-sum: the share's weight
};

struct Message {
  size_t to = 0;
  int64_t receiver_version_at_send = 0;
  int64_t wire_bytes = 0;
  std::shared_ptr<const DeliveredShare> share;
};

class GossipSimulation {
 public:
  GossipSimulation(const GossipSimulationOptions& options, sim::SimulationData data)
      : options_(options), data_(std::move(data)), network_rng_(mix_seed(options.seed, 0x6e37)) {}

  Status prepare() {
    if (data_.shards.size() != static_cast<size_t>(options_.peers) || data_.test == nullptr) {
      return invalid_argument("simulation data for " + std::to_string(data_.shards.size()) + " peers, options for " +
                              std::to_string(options_.peers));
    }
    Result<std::unique_ptr<train::Sequential>> worker =
        train::make_initial_model(options_.model, options_.seed, data_.model_input(), options_.init);
    if (!worker.is_ok()) return worker.status();
    worker_ = std::move(*worker);
    // x0: the seeded model every peer rebuilds and starts from.
    std::vector<std::vector<float>> reference;
    for (Parameter* p : worker_->parameters()) {
      manifest_.push_back({p->name, p->value.shape()});
      const float* values = p->value.data<float>();
      reference.emplace_back(values, values + p->value.numel());
      parameter_count_ += p->value.numel();
    }
    const int64_t delay_rounds =
        (options_.delay_steps + options_.delay_jitter_steps + options_.local_steps - 1) / options_.local_steps;
    const uint64_t in_flight_bytes = static_cast<uint64_t>(options_.peers) * static_cast<uint64_t>(delay_rounds + 1) *
                                     static_cast<uint64_t>(parameter_count_) * sizeof(float);
    if (in_flight_bytes > kMaxInFlightBytes) {
      return invalid_argument("--delay holds about " + std::to_string(in_flight_bytes >> 20) +
                              " MiB of shares in flight at once, more than the " +
                              std::to_string(kMaxInFlightBytes >> 20) + " MiB this simulation allows: "
                              "use fewer peers or a shorter delay");
    }
    Result<kernels::CompressionKernels*> backend = kernels::compression_kernels_named(options_.compression_device);
    if (!backend.is_ok()) return backend.status();
    for (int i = 0; i < options_.peers; ++i) {
      VirtualPeer peer;
      char name[32];
      std::snprintf(name, sizeof name, "peer-%04d", i);
      peer.name = name;
      peer.shard = std::move(data_.shards[static_cast<size_t>(i)]);
      peer.topology_rng.reseed(mix_seed(options_.seed, 0x7090 + static_cast<uint64_t>(i)));
      Result<gossip::GossipState> state = gossip::GossipState::create(options_.merge, options_.compression, manifest_, reference,
                                                      mix_seed(options_.seed, 0xc0de + static_cast<uint64_t>(i)),
                                                      **backend);
      if (!state.is_ok()) return state.status();
      peer.state.emplace(std::move(*state));
      peers_.push_back(std::move(peer));
    }
    Result<crypto::SiteKeys> keys = crypto::generate_site_keys("sim-peer");
    if (!keys.is_ok()) return keys.status();
    keys_ = std::move(*keys);
    return Status::ok();
  }

  Result<GossipSimulationSummary> run(const std::function<void(const GossipSimulationRound&)>& on_round) {
    GossipSimulationSummary summary;
    for (int64_t r = 0; r < options_.rounds; ++r) {
      GossipSimulationRound round;
      round.round = r + 1;
      round.virtual_time = static_cast<double>((r + 1) * options_.local_steps);
      for (size_t i = 0; i < peers_.size(); ++i) FEDMESH_RETURN_IF_ERROR(train_peer(i, r));
      for (size_t i = 0; i < peers_.size(); ++i) FEDMESH_RETURN_IF_ERROR(send(i, r, round));
      FEDMESH_RETURN_IF_ERROR(deliver(r, round, summary));
      const bool last = r + 1 == options_.rounds;
      if (last || (r + 1) % options_.eval_every == 0) evaluate(round);
      summary.messages_sent += round.messages_sent;
      summary.messages_lost += round.messages_lost;
      summary.messages_stale += round.messages_stale;
      summary.messages_refused += round.messages_refused;
      summary.bytes_sent += round.bytes;
      round.bytes_sent = summary.bytes_sent;
      round.messages_lost_total = summary.messages_lost;
      summary.rounds.push_back(round);
      if (on_round) on_round(round);
    }
    summary.messages_in_flight = static_cast<int64_t>(in_flight_.size());
    return summary;
  }

 private:
  // Puts a model (one flat vector per tensor) into the worker.
  void load_worker(const std::vector<std::vector<float>>& model) {
    std::vector<Parameter*> parameters = worker_->parameters();
    for (size_t t = 0; t < parameters.size(); ++t) {
      std::memcpy(parameters[t]->value.raw(), model[t].data(), parameters[t]->value.nbytes());
    }
    worker_->refresh_compute();
  }

  // H local steps of peer i from the model it holds.
  Status train_peer(size_t i, int64_t round) {
    VirtualPeer& peer = peers_[i];
    load_worker(peer.state->model());
    train::TrainOptions local = options_.local;
    local.max_steps = options_.local_steps;
    local.seed = mix_seed(mix_seed(options_.seed, 0x7ea1 + static_cast<uint64_t>(i)), static_cast<uint64_t>(round));
    train::Trainer trainer(*worker_, local);
    trainer.fit(*peer.shard, nullptr, {});
    std::vector<Parameter*> parameters = worker_->parameters();
    model_.resize(parameters.size());
    for (size_t t = 0; t < parameters.size(); ++t) {
      const float* values = parameters[t]->value.data<float>();
      model_[t].assign(values, values + parameters[t]->value.numel());
    }
    ++peer.version;
    return peer.state->set_model(model_);
  }

  // Peer i shares with the peers the topology picks; each message is lost,
  // or queued for the round in which it arrives.
  Status send(size_t i, int64_t round, GossipSimulationRound& record) {
    VirtualPeer& peer = peers_[i];
    const std::vector<size_t> targets =
        gossip::choose_peers(options_.topology, i, peers_.size(), options_.fanout, round, peer.topology_rng);
    if (targets.empty()) return Status::ok();
    Result<gossip::GossipShare> share = peer.state->share(static_cast<int>(targets.size()));
    if (!share.is_ok()) return share.status();
    auto delivered = std::make_shared<DeliveredShare>();
    delivered->decoded = std::move(share->decoded);
    delivered->weight = share->weight;
    // Every copy is the same bytes but for the recipient's name, and the
    // names are all as long: one copy prepared stands for all of them.
    protocol::UpdateMetadata metadata;
    metadata.federation = "sim";
    metadata.round = static_cast<uint64_t>(round);
    metadata.base_version = static_cast<uint64_t>(peer.version);
    metadata.sender = peer.name;
    metadata.recipient = peers_[targets.front()].name;
    metadata.sequence = static_cast<uint64_t>(round + 1);
    metadata.sample_count = static_cast<uint64_t>(peer.shard->size());
    const auto bytes = static_cast<int64_t>(
        protocol::wire_bytes(protocol::prepare_encoded_update(metadata, std::move(share->tensors), keys_)));
    for (size_t to : targets) {
      ++record.messages_sent;
      record.bytes += bytes;
      if (network_rng_.uniform() < options_.loss) {
        ++record.messages_lost;
        continue;
      }
      int64_t delay = options_.delay_steps;
      if (options_.delay_jitter_steps > 0) {
        delay += static_cast<int64_t>(network_rng_.below(static_cast<uint64_t>(2 * options_.delay_jitter_steps + 1))) -
                 options_.delay_jitter_steps;
      }
      // Merged at the end of the first round that ends at or after it arrives.
      const int64_t merge_round = round + (delay + options_.local_steps - 1) / options_.local_steps;
      const int64_t arrival_step = (round + 1) * options_.local_steps + delay;
      in_flight_.emplace(std::make_tuple(merge_round, arrival_step, serial_++),
                         Message{to, peers_[to].version, bytes, delivered});
    }
    return Status::ok();
  }

  // Merges what arrives by the end of `round`, in arrival order.
  Status deliver(int64_t round, GossipSimulationRound& record, GossipSimulationSummary& summary) {
    double staleness_sum = 0.0;
    const int64_t max_staleness = options_.staleness.max_staleness();
    while (!in_flight_.empty() && std::get<0>(in_flight_.begin()->first) <= round) {
      Message message = std::move(in_flight_.begin()->second);
      in_flight_.erase(in_flight_.begin());
      VirtualPeer& receiver = peers_[message.to];
      summary.bytes_received += message.wire_bytes;
      const int64_t tau = receiver.version - message.receiver_version_at_send;
      if (max_staleness >= 0 && tau > max_staleness) {
        ++record.messages_stale;
        continue;
      }
      const double weight = options_.merge == gossip::MergeRule::kPairwise ? options_.staleness.weight(tau) : 1.0;
      // A receiver refuses what would make its model non-finite (a peer
      // whose training diverged) and goes on, as a real node does.
      if (!receiver.state->merge(message.share->decoded, message.share->weight, weight).is_ok()) {
        ++record.messages_refused;
        continue;
      }
      ++record.messages_merged;
      staleness_sum += static_cast<double>(tau);
    }
    if (record.messages_merged > 0) record.mean_staleness = staleness_sum / static_cast<double>(record.messages_merged);
    return Status::ok();
  }

  // Every peer's test accuracy, and how far apart the peers' models are.
  void evaluate(GossipSimulationRound& record) {
    record.evaluated = true;
    record.min_test_accuracy = 1.0;
    flat_models_.resize(peers_.size());
    for (size_t i = 0; i < peers_.size(); ++i) {
      load_worker(peers_[i].state->model());
      train::Trainer evaluator(*worker_, options_.local);
      const train::EvalResult result = evaluator.evaluate(*data_.test);
      record.mean_test_accuracy += result.accuracy;
      record.mean_test_loss += result.loss;
      record.max_test_loss = std::max(record.max_test_loss, result.loss);
      record.min_test_accuracy = std::min(record.min_test_accuracy, result.accuracy);
      record.max_test_accuracy = std::max(record.max_test_accuracy, result.accuracy);
      std::vector<float>& flat = flat_models_[i];
      flat.clear();
      flat.reserve(static_cast<size_t>(parameter_count_));
      for (const std::vector<float>& tensor : peers_[i].state->model()) flat.insert(flat.end(), tensor.begin(), tensor.end());
    }
    const auto n = static_cast<double>(peers_.size());
    record.mean_test_accuracy /= n;
    record.mean_test_loss /= n;
    if (data_.tokens_per_byte > 0.0) {  // bits per byte are linear in the loss
      record.mean_bits_per_byte = train::data::bits_per_byte(record.mean_test_loss, data_.tokens_per_byte);
      record.max_bits_per_byte = train::data::bits_per_byte(record.max_test_loss, data_.tokens_per_byte);
    }
    double distance_sum = 0.0;
    int64_t pairs = 0;
    for (size_t i = 0; i < peers_.size(); ++i) {
      for (size_t j = i + 1; j < peers_.size(); ++j) {
        const double d = gossip::model_distance(flat_models_[i], flat_models_[j]);
        record.max_model_distance = std::max(record.max_model_distance, d);
        distance_sum += d;
        ++pairs;
      }
    }
    if (pairs > 0) record.mean_model_distance = distance_sum / static_cast<double>(pairs);
  }

  const GossipSimulationOptions& options_;
  sim::SimulationData data_;  // the shards move to the peers in prepare()
  std::vector<VirtualPeer> peers_;
  std::unique_ptr<train::Sequential> worker_;
  std::vector<protocol::TensorShape> manifest_;
  int64_t parameter_count_ = 0;
  crypto::SiteKeys keys_;  // signs every virtual peer's messages (their size is what counts)
  Rng network_rng_;        // every loss and delay, drawn in send order
  // (merge round, arrival in virtual steps, send serial) -> the message:
  // merged in that order.
  std::map<std::tuple<int64_t, int64_t, uint64_t>, Message> in_flight_;
  uint64_t serial_ = 0;
  std::vector<std::vector<float>> model_;        // scratch: a peer's trained model, per tensor
  std::vector<std::vector<float>> flat_models_;  // scratch: every peer's model, flat, for the distances
};

}  // namespace

Status GossipSimulationOptions::validate() const {
  if (peers < 2 || peers > kMaxSimulatedPeers) {
    return invalid_argument("gossip needs --sites (peers) in [2, " + std::to_string(kMaxSimulatedPeers) + "]");
  }
  if (rounds < 1) return invalid_argument("--rounds must be at least 1");
  if (local_steps < 1) return invalid_argument("--local-steps must be at least 1");
  if (fanout < 1 || fanout > kMaxGossipFanout || fanout >= peers) {
    return invalid_argument("--fanout must be in [1, min(" + std::to_string(kMaxGossipFanout) +
                            ", peers - 1)]: it is " + std::to_string(fanout) + " with " + std::to_string(peers) +
                            " peers");
  }
  if (!(loss >= 0.0 && loss < 1.0)) return invalid_argument("--loss must be in [0, 1)");
  if (delay_steps < 0 || delay_steps > kMaxMessageDelaySteps) {
    return invalid_argument("--delay must be in [0, " + std::to_string(kMaxMessageDelaySteps) + "] steps");
  }
  if (delay_jitter_steps < 0 || delay_jitter_steps > delay_steps) {
    return invalid_argument(
        "--delay STEPS:JITTER needs 0 <= JITTER <= STEPS (a message never arrives before it is sent)");
  }
  if (eval_every < 1) return invalid_argument("--eval-every must be at least 1");
  FEDMESH_RETURN_IF_ERROR(sim::validate_local_training(local, local_steps));
  // The model and the compression plan, before any data is read.
  FEDMESH_RETURN_IF_ERROR(train::make_model(model, seed).status());
  return gossip::check_gossip_compression(compression);
}

Result<GossipSimulationSummary> run_gossip_simulation(
    const GossipSimulationOptions& options, sim::SimulationData data,
    const std::function<void(const GossipSimulationRound&)>& on_round) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  GossipSimulation simulation(options, std::move(data));
  FEDMESH_RETURN_IF_ERROR(simulation.prepare());
  return simulation.run(on_round);
}

Result<GossipSimulationSummary> run_gossip_simulation(
    const GossipSimulationOptions& options, const train::data::ImageDataset& train, const train::data::ImageDataset& test,
    const std::function<void(const GossipSimulationRound&)>& on_round) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  sim::SimulationOptions split;
  split.sites = options.peers;
  split.partition = options.partition;
  split.model = options.model;
  split.seed = options.seed;
  Result<sim::SimulationData> data = sim::image_simulation_data(split, train, test);
  if (!data.is_ok()) return data.status();
  return run_gossip_simulation(options, std::move(*data), on_round);
}

}  // namespace fedmesh::sim
