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
#include "gossip/replicas.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "protocol/update_transfer.h"

namespace fedmesh::sim {

namespace {

// Delayed shares are held whole until they are merged; a flag asking for more
// than this (peers x rounds of delay x model bytes) is refused.
constexpr uint64_t kMaxInFlightBytes = uint64_t{8} << 30;

// Replicas: one peer's update of one round, as every holder keeps it.
struct HeldUpdate {
  std::vector<std::vector<float>> decoded;
  int64_t wire_bytes = 0;
};

struct VirtualPeer {
  std::string name;
  std::unique_ptr<train::data::Dataset> shard;
  std::optional<gossip::GossipState> state;   // push-sum, pairwise
  std::optional<gossip::ReplicaState> replica;  // replicas
  // Replicas: its own updates of the rounds it still sends again, and
  // those of others received and not applied yet.
  std::map<gossip::UpdateId, std::shared_ptr<const HeldUpdate>> held;
  std::vector<gossip::UpdateId> unapplied;
  std::vector<std::vector<float>> trained;     // replicas: this round's local training
  const std::vector<std::vector<float>>& model() const { return replica ? replica->model() : state->model(); }
  Status set_model(std::span<const std::vector<float>> values) {
    if (replica) {
      trained.assign(values.begin(), values.end());
      return Status::ok();
    }
    return state->set_model(values);
  }
  int64_t version = 0;  // rounds of local training done: the counter staleness is measured in
  Rng topology_rng;     // the random topology's draws
};

// What every recipient of one share merges; shared by its messages.
struct DeliveredShare {
  std::vector<std::vector<float>> decoded;
  double weight = 0.0;  // push-sum: the share's weight
};

struct Message {
  size_t from = 0, to = 0;
  int64_t receiver_version_at_send = 0;
  int64_t wire_bytes = 0;
  std::shared_ptr<const DeliveredShare> share;
};

// Replicas: rounds of its own updates a peer keeps to send again, requests
// for a missing update per round, and a request's bytes on the wire (a
// framed message naming the sender and the round).
constexpr int64_t kRelayRounds = 8;
constexpr int kPullAttempts = 3;
constexpr int kSettleAttempts = 64;
constexpr int64_t kRequestWireBytes = 160;

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
      const uint64_t peer_seed = mix_seed(options_.seed, 0xc0de + static_cast<uint64_t>(i));
      if (options_.merge == gossip::MergeRule::kReplicas) {
        Result<gossip::ReplicaState> replica = gossip::ReplicaState::create(
            options_.compression, manifest_, reference, options_.peers, options_.outer_lr, peer_seed, **backend);
        if (!replica.is_ok()) return replica.status();
        peer.replica.emplace(std::move(*replica));
      } else {
        Result<gossip::GossipState> state =
            gossip::GossipState::create(options_.merge, options_.compression, manifest_, reference, peer_seed, **backend);
        if (!state.is_ok()) return state.status();
        peer.state.emplace(std::move(*state));
      }
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
      if (options_.merge == gossip::MergeRule::kReplicas) {
        FEDMESH_RETURN_IF_ERROR(spread(r, round, summary));
      } else {
        for (size_t i = 0; i < peers_.size(); ++i) FEDMESH_RETURN_IF_ERROR(send(i, r, round));
        FEDMESH_RETURN_IF_ERROR(deliver(r, round, summary));
      }
      const bool last = r + 1 == options_.rounds;
      if (last || (r + 1) % options_.eval_every == 0) evaluate(round);
      summary.messages_sent += round.messages_sent;
      summary.messages_lost += round.messages_lost;
      summary.messages_stale += round.messages_stale;
      summary.messages_refused += round.messages_refused;
      summary.messages_duplicate += round.messages_duplicate;
      summary.updates_missed = round.updates_missed;
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
    load_worker(peer.model());
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
    return peer.set_model(model_);
  }

  // The wire bytes of one message of `tensors` from peer i.
  int64_t wire_bytes(size_t i, size_t to, int64_t round, std::vector<protocol::EncodedTensor> tensors) {
    protocol::UpdateMetadata metadata;
    metadata.federation = "sim";
    metadata.round = static_cast<uint64_t>(round);
    metadata.base_version = static_cast<uint64_t>(peers_[i].version);
    metadata.sender = peers_[i].name;
    metadata.recipient = peers_[to].name;
    metadata.sequence = static_cast<uint64_t>(round + 1);
    metadata.sample_count = static_cast<uint64_t>(peers_[i].shard->size());
    return static_cast<int64_t>(
        protocol::wire_bytes(protocol::prepare_encoded_update(metadata, std::move(tensors), keys_)));
  }

  // The arrival of a message sent at the end of `round`: lost (nullopt),
  // or its (merge round, arrival step).
  std::optional<std::pair<int64_t, int64_t>> transit(int64_t round) {
    if (network_rng_.uniform() < options_.loss) return std::nullopt;
    int64_t delay = options_.delay_steps;
    if (options_.delay_jitter_steps > 0) {
      delay += static_cast<int64_t>(network_rng_.below(static_cast<uint64_t>(2 * options_.delay_jitter_steps + 1))) -
               options_.delay_jitter_steps;
    }
    // Merged at the end of the first round that ends at or after it arrives.
    return std::make_pair(round + (delay + options_.local_steps - 1) / options_.local_steps,
                          (round + 1) * options_.local_steps + delay);
  }

  // Replicas: every peer makes its update and sends it to every other
  // peer; then, for `kPullAttempts` exchanges, every peer asks the sender of
  // each update it lacks (of the rounds still kept) for it again (each
  // message, request or answer, lost or arriving within the round). Then
  // every peer applies what it got; what is still missing is asked for again
  // next round.
  Status spread(int64_t round, GossipSimulationRound& record, GossipSimulationSummary& summary) {
    for (size_t i = 0; i < peers_.size(); ++i) {
      VirtualPeer& peer = peers_[i];
      Result<gossip::OwnUpdate> update = peer.replica->make_update(std::move(peer.trained));
      if (!update.is_ok()) return update.status();
      auto held = std::make_shared<HeldUpdate>();
      held->decoded = std::move(update->decoded);
      held->wire_bytes = wire_bytes(i, i, round, std::move(update->tensors));
      const gossip::UpdateId id{peer.name, static_cast<uint64_t>(round)};
      peer.held.emplace(id, held);
      peer.unapplied.push_back(id);
      for (size_t to = 0; to < peers_.size(); ++to) {
        if (to != i) pass_on(to, id, held, record, summary);
      }
    }
    // After the last round the peers keep asking until every one holds every
    // update (as nodes do before they leave), so the run ends on one model.
    const bool last = round + 1 == options_.rounds;
    for (int attempt = 0; attempt < (last ? kSettleAttempts : kPullAttempts); ++attempt) {
      if (last && missing_now(round) == 0) break;
      for (size_t i = 0; i < peers_.size(); ++i) {
        for (size_t from = 0; from < peers_.size(); ++from) {
          if (from == i) continue;
          for (int64_t r = std::max<int64_t>(0, round + 1 - kRelayRounds); r <= round; ++r) {
            const gossip::UpdateId id{peers_[from].name, static_cast<uint64_t>(r)};
            if (peers_[i].held.count(id) > 0 || peers_[i].replica->applied(id)) continue;
            ++record.messages_sent;
            record.bytes += kRequestWireBytes;
            if (network_rng_.uniform() < options_.loss) {
              ++record.messages_lost;
              continue;
            }
            summary.bytes_received += kRequestWireBytes;
            pass_on(i, id, peers_[from].held.at(id), record, summary);
          }
        }
      }
    }
    for (VirtualPeer& peer : peers_) {
      std::sort(peer.unapplied.begin(), peer.unapplied.end());
      for (const gossip::UpdateId& id : peer.unapplied) {
        Result<bool> applied = peer.replica->apply(id, peer.held.at(id)->decoded);
        if (!applied.is_ok()) {
          ++record.messages_refused;
        } else if (*applied && id.sender != peer.name) {
          ++record.messages_merged;
        }
      }
      peer.unapplied.clear();
      // Forget what is too old to send again (a sender keeps its own; the
      // others are kept only until applied, here at once).
      for (auto it = peer.held.begin(); it != peer.held.end();) {
        const bool keep = it->first.sender == peer.name && static_cast<int64_t>(it->first.round) + kRelayRounds > round;
        it = keep ? std::next(it) : peer.held.erase(it);
      }
    }
    // Updates some peer never got and no longer can (their senders forgot them).
    record.updates_missed = 0;
    for (const VirtualPeer& peer : peers_) {
      const int64_t closed = std::max<int64_t>(0, round + 1 - kRelayRounds);  // rounds no one sends again
      record.updates_missed += closed * options_.peers - count_applied_before(peer, closed);
    }
    return Status::ok();
  }

  // Updates of the rounds still kept that some peer lacks.
  int64_t missing_now(int64_t round) const {
    int64_t missing = 0;
    for (const VirtualPeer& peer : peers_) {
      for (const VirtualPeer& from : peers_) {
        for (int64_t r = std::max<int64_t>(0, round + 1 - kRelayRounds); r <= round; ++r) {
          const gossip::UpdateId id{from.name, static_cast<uint64_t>(r)};
          missing += peer.held.count(id) == 0 && !peer.replica->applied(id) ? 1 : 0;
        }
      }
    }
    return missing;
  }

  // Updates of rounds before `round` that `peer` applied.
  int64_t count_applied_before(const VirtualPeer& peer, int64_t round) const {
    int64_t n = 0;
    for (const gossip::UpdateId& id : peer.replica->applied_ids()) n += static_cast<int64_t>(id.round) < round ? 1 : 0;
    return n;
  }

  // One update sent to peer `to`: lost, a duplicate it drops, or held.
  void pass_on(size_t to, const gossip::UpdateId& id, const std::shared_ptr<const HeldUpdate>& held,
               GossipSimulationRound& record, GossipSimulationSummary& summary) {
    ++record.messages_sent;
    record.bytes += held->wire_bytes;
    if (network_rng_.uniform() < options_.loss) {
      ++record.messages_lost;
      return;
    }
    summary.bytes_received += held->wire_bytes;
    VirtualPeer& receiver = peers_[to];
    if (receiver.held.count(id) > 0 || receiver.replica->applied(id)) {  // (the pulls never ask twice)
      ++record.messages_duplicate;
      return;
    }
    receiver.held.emplace(id, held);
    receiver.unapplied.push_back(id);
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
    const int64_t bytes = wire_bytes(i, targets.front(), round, std::move(share->tensors));
    for (size_t to : targets) {
      ++record.messages_sent;
      record.bytes += bytes;
      const std::optional<std::pair<int64_t, int64_t>> arrival = transit(round);
      if (!arrival) {
        ++record.messages_lost;
        continue;
      }
      Message m;
      m.from = i;
      m.to = to;
      m.receiver_version_at_send = peers_[to].version;
      m.wire_bytes = bytes;
      m.share = delivered;
      in_flight_.emplace(std::make_tuple(arrival->first, arrival->second, serial_++), std::move(m));
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
      load_worker(peers_[i].model());
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
      for (const std::vector<float>& tensor : peers_[i].model()) flat.insert(flat.end(), tensor.begin(), tensor.end());
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
  if (merge == gossip::MergeRule::kReplicas && !(outer_lr > 0.0 && outer_lr <= 1.0)) {
    return invalid_argument("the outer learning rate of replicas must be in (0, 1]");
  }
  return gossip::check_gossip_compression(compression, merge);
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
