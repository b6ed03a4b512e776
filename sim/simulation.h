// `fedmesh sim`: a whole federation in one process. Virtual sites hold
// shards of Fashion-MNIST split by a partitioner (or, for the language
// models, their part of a text corpus split as the nodes split it), train
// locally with the
// node's real Trainer, and hand their updates to the real aggregator::RoundManager; time
// is virtual (a site's round takes local_steps x its speed factor), so a run
// is deterministic for a seed and replays exactly, stragglers and dropouts
// included. Sites are trained one after another on one worker model (the
// kernels use every core inside each step).
//
// Each site's update goes through the real compression path: the site's own
// UpdateCompressor (error feedback, residual kept per site), the codec's
// bytes, prepare_encoded_update's signed chunks, and the round manager gets
// what the receiver decodes. Bytes are counted on the wire: every message
// framed as on a CurveZMQ connection (protocol::wire_bytes). PowerSGD runs
// its two exchanges per round with the P shared by the round's sites.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "aggregator/round_manager.h"
#include "aggregator/secure_round.h"
#include "base/status.h"
#include "train/data/dataset.h"
#include "train/data/fashion_mnist.h"
#include "train/data/partition.h"
#include "train/data/text_corpus.h"
#include "train/initial_weights.h"
#include "train/trainer.h"
#include "protocol/compression_spec.h"

namespace fedmesh::sim {

inline constexpr int kMaxSimulatedSites = 10'000;

struct SimulationOptions {
  int sites = 10;
  train::data::PartitionSpec partition;        // default iid
  // Language models: the text partition (text_corpus.h: iid, books,
  // contiguous, testament) instead of `partition`.
  std::string text_partition = "iid";
  std::string model = "mlp";
  // Version 0 from a file instead of the seed, and LoRA adapters
  // (train/initial_weights.h): the sites then send the B factors only.
  train::InitialWeights init;
  int64_t rounds = 10;                  // sync rounds, or async server steps
  int64_t local_steps = 20;             // optimizer steps per site per round
  train::TrainOptions local;             // batch size, optimizer, lr... (max_steps set from local_steps)
  double dropout = 0.0;                 // chance a sampled site never reports in a round
  double straggler_fraction = 0.0;      // share of sites that are slow ...
  double straggler_factor = 1.0;        // ... by this factor
  int poisoned_sites = 0;               // the first N sites send -scale x their update
  double poison_scale = 10.0;
  aggregator::RoundOptions rounds_options;
  protocol::CompressionPlan compression;  // identity: dense fp32
  std::string compression_device = "cpu";  // cpu, cuda or auto (kernels::compression_kernels_named)
  uint64_t seed = 0;
  // --mode private: each round's updates go through secure aggregation
  // (aggregator/secure_session.h, the real protocol in one process): every
  // site clips its update to secure_options.clip and quantizes it, sampled
  // sites that drop out never advertise keys, and the round takes the mean
  // of the survivors (equal weights), or nothing when fewer than t are left.
  // dp_noise_multiplier > 0 adds DP-FedAvg noise N(0, (sigma clip / k)^2) to
  // that mean and reports epsilon at dp_delta; with db, each round that
  // released a noised mean commits its privacy ledger entry (mechanism
  // kSimulationDpMechanism) with it. The noise is the aggregator's sampler
  // (a discrete Gaussian on a grid) drawn from the seed, so a simulation
  // replays: it is no privacy guarantee.
  bool secure = false;
  aggregator::SecureOptions secure_options;
  double dp_noise_multiplier = 0.0;
  double dp_delta = 1e-5;
  // Synchronous runs only: commit every round to this checkpoint store (the
  // model, the server optimizer, the round manager and the simulation's own
  // state) before reporting it, and resume from its newest intact round.
  std::string db;

  Status validate() const;
};

// The ledger's mechanism for a simulation's DP-FedAvg: seeded, not private.
inline constexpr const char* kSimulationDpMechanism = "dp-fedavg-seeded";

struct SimulationRound {
  aggregator::RoundRecord record;
  double virtual_time = 0.0;   // when the step was applied, in local-step units
  double test_accuracy = 0.0;
  double test_loss = 0.0;
  int64_t updates = 0;
  int64_t dropped = 0;         // sampled sites that did not report
  int64_t bytes = 0;           // update bytes the sites sent, on the wire (signed, chunked, CurveZMQ-framed)
  double epsilon = -1.0;       // DP-FedAvg: the privacy spent so far (-1: no DP)
  double bits_per_byte = -1.0; // language models: the test loss as bits per byte of text (-1: images)
};

struct SimulationSummary {
  std::vector<SimulationRound> rounds;  // the rounds this run did (after a resume, the rest)
  int64_t resumed_from_round = 0;       // 0: started fresh
  double final_accuracy = 0.0, final_loss = 0.0;
  double final_bits_per_byte = -1.0;  // language models (-1: images)
  double virtual_time = 0.0;
  int64_t bytes_sent = 0;      // sites -> aggregator
  int64_t bytes_received = 0;  // aggregator -> sites (the global model, dense fp32; PowerSGD's shared P)
  int64_t refused_updates = 0;
  double epsilon = -1.0, delta = 0.0;  // DP-FedAvg (-1: no DP)
};

// The pieces every simulated federation (this one and the gossip one,
// sim/) shares: the training set split among `sites` virtual
// sites by the partitioner, replayed by the seed (kInvalidArgument when there
// are fewer images than sites), and the local training options a site runs
// each round, checked with max_steps = local_steps.
Result<std::vector<train::data::ImageDataset>> split_among_sites(const train::data::ImageDataset& train, int sites,
                                                          const train::data::PartitionSpec& partition, uint64_t seed);
Status validate_local_training(const train::TrainOptions& local, int64_t local_steps);

// What a simulated federation trains and is evaluated on: one training set
// per virtual site (in site order) and the test set the aggregator scores
// each model on.
struct SimulationData {
  std::vector<std::unique_ptr<train::data::Dataset>> shards;
  std::unique_ptr<train::data::Dataset> test;
  int64_t vocabulary = 0;        // language models: the model's vocabulary (0: the model's own)
  double tokens_per_byte = 0.0;  // language models: the test's scored tokens per byte of text; 0: images
  // Own data: its schema decides the model's input and classes (empty: Fashion-MNIST's).
  train::data::DataSchema schema;
  train::ModelInput model_input() const {
    return {vocabulary, schema.sample_shape, schema.classes, schema.regression};
  }
};
// Fashion-MNIST split among the sites by options.partition.
Result<SimulationData> image_simulation_data(const SimulationOptions& options, const train::data::ImageDataset& train,
                                             train::data::ImageDataset test);
// Own data (train::data::load_own_data) split among `sites` virtual sites
// by `partition` (seeded), tested on its test part. Classification only:
// regression is refused (the simulation reports accuracy).
Result<SimulationData> own_simulation_data(train::data::LoadedData data, int sites,
                                           const train::data::PartitionSpec& partition, uint64_t seed);
// A corpus split among the sites by options.text_partition as the nodes
// split it (train::data::site_windows: each site trains on 90% of its text), and
// every document's held-out last 5% (the first test_limit windows, 0: all)
// as the test set; byte tokens.
Result<SimulationData> text_simulation_data(const SimulationOptions& options, const train::data::TextCorpus& corpus,
                                            int64_t train_limit, int64_t test_limit);

// Runs the federation; `on_round` sees each server step as it happens (after
// its checkpoint is committed, with db).
Result<SimulationSummary> run_simulation(const SimulationOptions& options, SimulationData data,
                                         const std::function<void(const SimulationRound&)>& on_round);
// The same on Fashion-MNIST (image_simulation_data).
Result<SimulationSummary> run_simulation(const SimulationOptions& options, const train::data::ImageDataset& train,
                                         const train::data::ImageDataset& test,
                                         const std::function<void(const SimulationRound&)>& on_round);

}  // namespace fedmesh::sim
