// `fedmesh sim --mode gossip`: a decentralized federation in one process.
// Virtual peers hold shards of Fashion-MNIST split by a partitioner (or, for
// the language models, their part of a text corpus split as the nodes split
// it: sim::text_simulation_data), train H local steps per round with
// the node's real Trainer, and gossip their models
// through the real gossip::GossipState (gossip/exchange.h: push-sum or pairwise
// merge, compression with error feedback) to the peers a topology picks
// (gossip/topology.h). No server, no global model: each peer's model is its
// own, and the run reports how good the worst and the average peer are
// (accuracy; for text also held-out bits per byte) and how far apart they
// still are.
//
// Time is virtual and in local-step units, as in sim/simulation.h:
// every peer does H steps per round, so round r ends at (r + 1) H. At the end
// of a round every peer shares; a message is lost with the given
// probability, or arrives d = delay +- jitter steps later and is merged at
// the end of the first round that ends at or after its arrival (d = 0: the
// round it was sent in). Staleness tau is counted in the receiver's version
// counter (its rounds of training): the rounds it did between the send and
// the merge. Push-sum takes staleness as a cut-off only (a message staler
// than max_staleness is dropped, its mass lost with it); pairwise scales its
// step by s(tau). A seed decides the split, the training, the peers chosen,
// every loss and every delay: a run replays exactly.
//
// Bytes are counted on the wire: each message is the share's tensors as the
// codec encodes them, signed and chunked by prepare_encoded_update, framed as
// on a CurveZMQ connection (protocol::wire_bytes); a lost message still
// went out (bytes_sent), only a delivered one is received.
//
// Peers are trained and evaluated one after another on one worker model (the
// kernels use every core inside each step). Evaluating every peer is the
// expensive part of a big run: eval_every evaluates every K rounds (and the
// last).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sim/simulation.h"
#include "federation/staleness.h"
#include "base/status.h"
#include "gossip/exchange.h"
#include "gossip/topology.h"
#include "train/data/fashion_mnist.h"
#include "train/data/partition.h"
#include "train/trainer.h"
#include "protocol/compression_spec.h"

namespace fedmesh::sim {

// Bounds on what a flag may ask for.
inline constexpr int kMaxSimulatedPeers = 1'000;
inline constexpr int kMaxGossipFanout = 64;
inline constexpr int64_t kMaxMessageDelaySteps = 1'000'000;

struct GossipSimulationOptions {
  int peers = 8;
  train::data::PartitionSpec partition;   // images: how the training set is split (default iid)
  std::string model = "mlp";
  train::InitialWeights init;      // version 0 from a file, LoRA adapters (as SimulationOptions::init)
  int64_t rounds = 20;
  int64_t local_steps = 20;        // H: optimizer steps per peer per round
  train::TrainOptions local;        // batch size, optimizer, lr... (max_steps set from local_steps)
  gossip::Topology topology = gossip::Topology::kRandom;
  int fanout = 1;                  // peers per share (random, ring; exponential topologies ignore it)
  gossip::MergeRule merge = gossip::MergeRule::kPushSum;
  federation::StalenessFunction staleness;  // pairwise: s(tau); both: its max_staleness cut-off
  protocol::CompressionPlan compression;    // what gossip::check_gossip_compression allows for `merge`
  double outer_lr = 1.0;           // replicas: each update is added with weight outer_lr / peers
  std::string compression_device = "cpu";   // cpu, cuda or auto (kernels::compression_kernels_named)
  double loss = 0.0;               // chance that a message is lost
  int64_t delay_steps = 0;         // message delay, in local steps ...
  int64_t delay_jitter_steps = 0;  // ... plus or minus up to this (uniform, never below 0)
  int64_t eval_every = 1;          // evaluate the peers every K rounds (and after the last)
  uint64_t seed = 0;

  // Checks ranges, the model's name and that gossip can carry the
  // compression plan; the message names the flag.
  Status validate() const;
};

struct GossipSimulationRound {
  int64_t round = 0;             // 1-based
  double virtual_time = 0.0;     // end of the round, in local-step units
  bool evaluated = false;        // accuracy and loss below are from this round's evaluation
  double mean_test_accuracy = 0.0, min_test_accuracy = 0.0, max_test_accuracy = 0.0;
  double mean_test_loss = 0.0, max_test_loss = 0.0;
  // Language models: the mean and the worst peer's held-out loss as bits per
  // byte of text (-1: images).
  double mean_bits_per_byte = -1.0, max_bits_per_byte = -1.0;
  double max_model_distance = 0.0;   // the largest L2 distance between two peers' models
  double mean_model_distance = 0.0;  // ... and the mean over all pairs
  int64_t messages_sent = 0;     // this round
  int64_t messages_lost = 0;     // this round: lost on the way
  int64_t messages_merged = 0;   // this round: delivered and merged (some sent in earlier rounds)
  int64_t messages_stale = 0;    // this round: delivered but past max_staleness, dropped
  int64_t messages_refused = 0;  // this round: delivered but refused (the merge would not be finite)
  int64_t messages_duplicate = 0;    // replicas: delivered, but the receiver held that update already
  int64_t updates_missed = 0;        // replicas: updates some peer lacks and no peer passes on any more (so far)
  double mean_staleness = 0.0;   // of the messages merged this round
  int64_t bytes = 0;             // sent this round, on the wire
  int64_t bytes_sent = 0;        // so far
  int64_t messages_lost_total = 0;  // so far
};

struct GossipSimulationSummary {
  std::vector<GossipSimulationRound> rounds;  // at least one; the last is always evaluated
  const GossipSimulationRound& last() const { return rounds.back(); }
  int64_t bytes_sent = 0;        // every message sent, lost ones included
  int64_t bytes_received = 0;    // the messages that arrived (stale ones included)
  int64_t messages_sent = 0, messages_lost = 0, messages_stale = 0, messages_refused = 0;
  int64_t messages_duplicate = 0;  // replicas
  int64_t updates_missed = 0;      // replicas: at the end
  int64_t messages_in_flight = 0;  // still delayed when the run ended
};

// Runs the federation on one shard per peer (in peer order) and the test set
// every peer is scored on (sim::image_simulation_data or
// text_simulation_data); `on_round` sees each round as it ends.
Result<GossipSimulationSummary> run_gossip_simulation(
    const GossipSimulationOptions& options, sim::SimulationData data,
    const std::function<void(const GossipSimulationRound&)>& on_round);
// The same on Fashion-MNIST, split among the peers by options.partition.
Result<GossipSimulationSummary> run_gossip_simulation(
    const GossipSimulationOptions& options, const train::data::ImageDataset& train, const train::data::ImageDataset& test,
    const std::function<void(const GossipSimulationRound&)>& on_round);

}  // namespace fedmesh::sim
