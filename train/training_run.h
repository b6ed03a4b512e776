// A local training run (`fedmesh train`): its data loaded, its model and
// trainer built, resumed from its checkpoint database when that holds a
// checkpoint of the same run (the same trajectory flags and tokenizer),
// trained on one process or data-parallel over launched CPU/GPU ranks, and
// committed every `checkpoint_every` steps and at the end. A run killed at
// any point and started again with the same flags ends with the same
// weights as one that never stopped (same thread count).
//
// The command parses flags and prints; this does the rest. What the
// privacy accountant decides (privacy/ sits above train/) comes in from the
// caller: the steps a target epsilon allows (set options().options.max_steps
// before open()) and the ledger entry each checkpoint records.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "store/checkpoint_store.h"
#include "train/initial_weights.h"
#include "train/model.h"
#include "train/parallel/rank_group.h"
#include "train/trainer.h"
#include "train/training_data.h"

namespace fedmesh::train {

struct TrainingRunOptions {
  std::string model = "cnn";
  data::DataSource data;  // --data and the flags of own data
  std::string precision = "fp32";
  std::string device = "cpu";
  std::string schedule = "cosine";
  std::string tokenizer;  // language models: a BPE tokenizer file; "": bytes
  InitialWeights init;    // --init/--init-format: weights to start from instead of the seeded ones
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  int threads = 0;        // CPU threads (0: all cores)
  // Checkpoints: none without a database.
  std::string db;
  int64_t checkpoint_every = 100;
  bool resume = false;    // a checkpoint to resume from is required
  int64_t keep_last = 3;
  std::string keep_best = "test_accuracy";  // "none": keep only the last ones
  TrainOptions options;   // precision and schedule are set from the names above
  RankFlags group;        // data-parallel ranks and tensor parallelism
  bool zero_one = false;  // shard the optimizer state across the ranks
  // Differential privacy: what the accountant reports at, and the budget.
  // Recorded with the run: a resumed run must use the same.
  double dp_delta = 1e-5;
  double dp_target_epsilon = 0.0;  // 0: no target
};

// Where a resumed run took up.
struct ResumePoint {
  int64_t step = 0;
  int64_t epoch = 0;
  std::string committed_at;
  size_t corrupt_checkpoints_skipped = 0;
  nlohmann::json metrics;  // the checkpoint's (test_accuracy, test_loss, train_loss, ...)
};

struct TrainingRunEvents {
  std::function<void(int64_t step)> on_checkpoint;  // a checkpoint committed
  TrainCallbacks progress;                           // every step, every epoch
};

// The privacy ledger's entry for a checkpoint at `step` of a DP-SGD run.
using PrivacyEntryAt = std::function<store::PrivacyEntry(int64_t step)>;

class TrainingRun {
 public:
  // Checks the options (kInvalidArgument naming the flag), takes the device,
  // sets the CPU threads and loads the data.
  static Result<std::unique_ptr<TrainingRun>> create(TrainingRunOptions options);
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  TrainingRunOptions& options() { return options_; }
  const TrainingData& data() const { return data_; }
  Device device() const { return device_; }
  // The optimizer steps the run takes in all, from its options as they are now.
  int64_t total_steps() const;

  // Ranks 1..N-1 of a parallel run (options().group.launched()): they take
  // rank 0's position and state, train their part of every batch (and with
  // tensor parallelism their shard of every block) and return when the run
  // ends.
  Status run_as_rank();

  // Builds the model and trainer; with a database, records this run in it
  // or resumes the run it holds (kInvalidArgument naming every flag that
  // differs when it holds another). `warn` hears of corrupt checkpoints
  // passed over and of a thread count that differs from the run's.
  Status open(PrivacyEntryAt privacy, const std::function<void(const std::string&)>& warn);
  const std::optional<ResumePoint>& resumed() const { return resumed_; }
  // What --init loaded (after open; empty without --init).
  const InitReport& init_report() const { return init_report_; }
  bool complete() const { return resumed_ && resumed_->step >= total_steps(); }

  // Launches ranks 1..N-1 (N = options().group.processes() > 1) and hands
  // them the run's position and state; with tensor parallelism the model's
  // blocks are then this rank's shards until fit() ends (the whole model
  // again, gathered, for every checkpoint and at the end).
  Status launch_ranks();
  int ranks() const;
  size_t gradient_buckets() const;
  Sequential& model() { return *model_; }

  // Trains to the end, committing a checkpoint every checkpoint_every steps
  // and at the end; a checkpoint that cannot be committed stops the run
  // with its error.
  Result<TrainSummary> fit(const TrainingRunEvents& events);
  int64_t checkpoints_committed() const { return checkpoints_committed_; }

 private:
  struct Parallel;
  TrainingRun() = default;
  Status open_store(const std::function<void(const std::string&)>& warn);
  Status commit_checkpoint(nlohmann::json metrics);
  Status start_parallel(Communicator& world, const RankFlags& flags);
  TrainCallbacks tensor_checkpoint_callbacks(TrainCallbacks callbacks);

  TrainingRunOptions options_;
  TrainingData data_;
  // What the model is built for: the tokenizer's vocabulary, the data's sample shape and classes.
  ModelInput model_input() const { return {data_.vocabulary, data_.schema.sample_shape, data_.schema.classes, data_.schema.regression};
  }
  Device device_ = Device::kCpu;
  std::unique_ptr<Sequential> model_;
  std::unique_ptr<Trainer> trainer_;
  std::optional<store::CheckpointStore> checkpoints_;
  PrivacyEntryAt privacy_;
  std::optional<ResumePoint> resumed_;
  InitReport init_report_;
  nlohmann::json last_test_ = nlohmann::json::object();  // the latest evaluation, carried in later checkpoints
  int64_t checkpoints_committed_ = 0;
  std::unique_ptr<Parallel> parallel_;
};

}  // namespace fedmesh::train
