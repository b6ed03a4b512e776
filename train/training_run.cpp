#include "train/training_run.h"

#include <filesystem>
#include <utility>

#include "kernels/parallel.h"
#include "train/parallel/data_parallel.h"
#include "train/parallel/parallel_training.h"
#include "train/initial_weights.h"
#include "train/model_spec.h"
#include "train/lora_export.h"
#include "train/training_checkpoint.h"

namespace fedmesh::train {

namespace {

constexpr int kMaxThreads = 1024;
constexpr const char* kTrainConfigKey = "train_config";
constexpr const char* kTrainThreadsKey = "train_threads";
// The run's BPE tokenizer file, whole (absent for the byte tokenizer):
// `fedmesh generate` decodes with it.
constexpr const char* kTokenizerKey = "tokenizer";

// Thrown from the step callback to leave Trainer::fit when a checkpoint
// cannot be committed.
struct CheckpointFailed {
  Status status;
};

// The options that decide a run's trajectory: a resumed run must use the
// same ones, or it would not continue the run it claims to continue. A BPE
// tokenizer is recorded by its fingerprint (the file may move); a run of the
// byte tokenizer has no "tokenizer" key.
nlohmann::json trajectory(const TrainingRunOptions& run, const TrainingData& data) {
  const TrainOptions& o = run.options;
  nlohmann::json config = {{"model", run.model},
                           {"data", run.data.source},
                           {"train_limit", run.train_limit},
                           {"test_limit", run.test_limit},
                           {"epochs", o.epochs},
                           {"steps", o.max_steps},
                           {"batch_size", o.batch_size},
                           {"grad_accumulation", o.grad_accumulation},
                           {"optimizer", o.optimizer},
                           {"lr", o.lr},
                           {"momentum", o.momentum},
                           {"nesterov", o.nesterov},
                           {"weight_decay", o.weight_decay},
                           {"schedule", run.schedule},
                           {"clip_grad_norm", o.clip_grad_norm},
                           {"precision", run.precision},
                           {"loss_scale", o.loss_scaling.initial_scale},
                           {"seed", o.seed},
                           {"dp_clip", o.dp_clip_norm},
                           {"dp_noise", o.dp_noise_multiplier},
                           {"dp_delta", run.dp_delta},
                           {"dp_target_epsilon", run.dp_target_epsilon}};
  if (data.tokenizer) config["tokenizer"] = data.tokenizer->fingerprint();
  if (o.dp_seeded_noise) config["dp_seeded_noise"] = true;  // a seeded run resumes only seeded
  // A model from a spec file records the spec itself (the file may change;
  // a built-in, as before, its name only): a resumed run must build the
  // same layers, and an export says what model it holds.
  if (is_model_spec_file(run.model)) {
    if (Result<ModelSpec> spec = read_model_spec(run.model); spec.is_ok()) config["model_spec"] = spec->to_toml();
  }
  // A LoRA run's checkpoints hold B factors for these adapters only.
  if (run.init.lora.enabled()) config["lora"] = run.init.lora.to_json();
  return config;
}

// A run resumes only with the tokenizer it started with (none: bytes).
Status check_same_tokenizer(const nlohmann::json& stored, const TrainingData& data, const std::string& db) {
  const std::string before = stored.is_object() && stored.contains("tokenizer") && stored["tokenizer"].is_string()
                                 ? stored["tokenizer"].get<std::string>()
                                 : std::string();
  const std::string now = data.tokenizer ? data.tokenizer->fingerprint() : std::string();
  if (before == now) return Status::ok();
  const auto name = [](const std::string& fingerprint) {
    return fingerprint.empty() ? std::string("the byte tokenizer (no --tokenizer)") : "the BPE tokenizer " + fingerprint;
  };
  return invalid_argument(db + " holds checkpoints of a run trained with " + name(before) + ", not " + name(now) +
                          " as given now (--tokenizer): give the run's own tokenizer to resume it, or a new --db to "
                          "start another run");
}

// Compares this run's trajectory with the one the database's run was
// started with; the message names every flag that differs.
Status check_same_run(const nlohmann::json& stored, const nlohmann::json& now, const std::string& db) {
  std::string differences;
  for (const auto& [key, value] : now.items()) {
    const auto it = stored.find(key);
    if (it != stored.end() && *it == value) continue;
    if (!differences.empty()) differences += ", ";
    std::string flag = key;  // the flag's spelling; the values as they are
    for (char& c : flag) {
      if (c == '_') c = '-';
    }
    differences += "--" + flag + " " + value.dump() + " (the run in the database used " +
                   (it == stored.end() ? std::string("nothing") : it->dump()) + ")";
  }
  if (differences.empty()) return Status::ok();
  return invalid_argument(db + " holds checkpoints of a different run: " + differences +
                          ". Give the same flags to resume it, or a new --db to start another run");
}

// What --tensor-parallel N needs: a GPT whose heads and MLP features
// divide by N, without the features that do not combine with it yet.
Status check_tensor_parallel(const TrainingRunOptions& run) {
  if (Status fits = check_tensor_parallel_model(run.model, run.group.tensor_parallel); !fits.is_ok()) {
    return invalid_argument("--tensor-parallel: " + fits.message());
  }
  if (run.zero_one) return invalid_argument("--tensor-parallel with --zero-1 is not supported yet: drop one of them");
  if (run.options.dp_clip_norm > 0.0f) {
    return invalid_argument("--tensor-parallel with DP-SGD (--dp-clip) is not supported: per-example gradients need "
                            "whole blocks");
  }
  if (run.init.lora.enabled()) return invalid_argument("--tensor-parallel with LoRA is not supported yet: drop one of them");
  return Status::ok();
}

Status check_options(TrainingRunOptions& run) {
  if (run.zero_one && run.device == "cuda") {
    return invalid_argument("--zero-1 with --device cuda: the sharded optimizer keeps its shards in host memory for "
                            "now; drop --zero-1");
  }
  FEDMESH_RETURN_IF_ERROR(run.group.validate());
  if (run.zero_one && run.group.ranks < 2) return invalid_argument("--zero-1 needs --ranks N with N >= 2");
  if (run.zero_one && !run.db.empty()) {
    return invalid_argument("--zero-1 with --db: a checkpoint would hold rank 0's shard of the optimizer state only, "
                            "so a resumed run could not continue; drop one of them");
  }
  if (run.group.tensor_parallel > 1) FEDMESH_RETURN_IF_ERROR(check_tensor_parallel(run));
  run.options.dp_seed = run.options.seed;
  run.options.data_parallel_rank = run.group.data_rank();
  run.options.data_parallel_ranks = run.group.ranks;
  Result<DType> precision = parse_dtype(run.precision);
  if (!precision.is_ok()) return precision.status();
  run.options.precision = *precision;
  Result<LrSchedule> schedule = LrSchedule::parse(run.schedule);
  if (!schedule.is_ok()) return schedule.status();
  run.options.schedule = *schedule;
  FEDMESH_RETURN_IF_ERROR(run.options.validate());
  FEDMESH_RETURN_IF_ERROR(run.init.lora.validate());
  if (run.train_limit < 0 || run.test_limit < 0) return invalid_argument("limits must be >= 0");
  if (run.checkpoint_every < 1) return invalid_argument("--checkpoint-every must be at least 1");
  if (run.resume && run.db.empty()) return invalid_argument("--resume needs --db PATH");
  if (run.threads < 0 || run.threads > kMaxThreads) {
    return invalid_argument("--threads must be in [0, " + std::to_string(kMaxThreads) + "] (0 = all cores)");
  }
  return Status::ok();
}

store::StoreOptions store_options(const TrainingRunOptions& run) {
  store::StoreOptions options;
  options.keep_last = run.keep_last;
  options.best_metric = run.keep_best == "none" ? "" : run.keep_best;
  return options;
}

}  // namespace

struct TrainingRun::Parallel {
  std::unique_ptr<RankGroup> group;     // rank 0: the processes it launched
  std::unique_ptr<Communicator> world;  // the others: every process of the group
  std::unique_ptr<ParallelTraining> training;
};

TrainingRun::~TrainingRun() = default;

Result<std::unique_ptr<TrainingRun>> TrainingRun::create(TrainingRunOptions options) {
  std::unique_ptr<TrainingRun> run(new TrainingRun());
  Result<Device> device = training_device(options.device, options.options.dp_clip_norm > 0.0f, options.data.regression());
  if (!device.is_ok()) return device.status();
  run->device_ = *device;
  FEDMESH_RETURN_IF_ERROR(check_options(options));
  if (Status s = store_options(options).validate(); !s.is_ok()) {
    return invalid_argument("--keep-last/--keep-best: " + s.message());
  }
  set_cpu_threads(options.threads);
  // Image folders are decoded once, into a cache beside the checkpoints.
  if (options.data.format() == "images" && options.data.cache.empty() && !options.db.empty()) {
    options.data.cache = options.db + ".images";
  }
  Result<TrainingData> data =
      load_training_data({options.model, options.data, options.tokenizer, options.train_limit, options.test_limit});
  if (!data.is_ok()) return data.status();
  // Regression has no accuracy: the best checkpoints are those of the highest R².
  if (data->schema.regression && options.keep_best == "test_accuracy") options.keep_best = "test_r2";
  run->data_ = std::move(*data);
  run->options_ = std::move(options);
  return run;
}

int64_t TrainingRun::total_steps() const {
  const TrainOptions& o = options_.options;
  const int64_t step_samples = o.batch_size * o.grad_accumulation;
  const int64_t steps_per_epoch = (data_.train->size() + step_samples - 1) / step_samples;
  return o.max_steps > 0 ? o.max_steps : o.epochs * steps_per_epoch;
}

Status TrainingRun::run_as_rank() {
  // The initial model as rank 0 builds it (its frozen weights, with LoRA,
  // are not broadcast: only the trainable parameters are).
  Result<std::unique_ptr<Sequential>> model =
      make_initial_model(options_.model, options_.options.seed, model_input(), options_.init);
  if (!model.is_ok()) return model.status();
  if (const std::string problem = (*model)->device_problem(device_); !problem.empty()) return invalid_argument(problem);
  model_ = std::move(*model);
  model_->to_device(device_);
  trainer_ = std::make_unique<Trainer>(*model_, options_.options);
  parallel_ = std::make_unique<Parallel>();
  Result<std::unique_ptr<Communicator>> communicator = join_rank_group(options_.group, kRankTimeout, device_);
  if (!communicator.is_ok()) return communicator.status();
  parallel_->world = std::move(*communicator);
  Result<std::optional<nlohmann::json>> command = read_rank_command();
  if (!command.is_ok()) return command.status();
  if (!command->has_value()) return Status::ok();  // rank 0 gave up before training
  Result<TrainerState> state = trainer_state_from_json((**command)["state"].dump());
  if (!state.is_ok()) return state.status();
  FEDMESH_RETURN_IF_ERROR(trainer_->restore(*state, data_.train->targets_per_sample()));
  FEDMESH_RETURN_IF_ERROR(start_parallel(*parallel_->world, options_.group));
  // Only the ranks of data-parallel rank 0 evaluate (rank 0 reports), and
  // with tensor parallelism they take part in rank 0's checkpoints.
  const bool first_data_rank = options_.group.data_rank() == 0;
  ParallelTraining& training = *parallel_->training;
  try {
    Result<TrainSummary> trained =
        fit_synced(*trainer_, training.hook(), training.data_parallel(), *data_.train,
                   first_data_rank && training.tensor() ? data_.test.get() : nullptr, tensor_checkpoint_callbacks({}));
    if (!trained.is_ok()) return trained.status();
  } catch (const CheckpointFailed& failed) {
    return Status(failed.status.code(), "gathering the model for a checkpoint failed: " + failed.status.message());
  }
  return training.gather(&trainer_->optimizer());
}

// Every process: the run's state as rank 0 holds it, then its part in the
// group's training (the model's blocks sharded with tensor parallelism).
Status TrainingRun::start_parallel(Communicator& world, const RankFlags& flags) {
  FEDMESH_RETURN_IF_ERROR(broadcast_training_state(world, *model_, *trainer_));
  DataParallelOptions options;
  options.zero_one = options_.zero_one;
  Result<std::unique_ptr<ParallelTraining>> training =
      ParallelTraining::start(world, flags, *model_, &trainer_->optimizer(), options);
  if (!training.is_ok()) return training.status();
  parallel_->training = std::move(*training);
  return Status::ok();
}

// With tensor parallelism, a checkpoint needs the whole model: at every
// step rank 0 commits one, the ranks of its tensor group gather the
// blocks with it (and cut their shards again after).
TrainCallbacks TrainingRun::tensor_checkpoint_callbacks(TrainCallbacks callbacks) {
  if (!parallel_ || !parallel_->training || !parallel_->training->tensor() || options_.db.empty() ||
      options_.group.data_rank() != 0) {
    return callbacks;
  }
  const TrainCallbacks inner = callbacks;
  callbacks.on_step = [this, inner](const StepProgress& p) {
    const bool checkpoint = p.step % options_.checkpoint_every == 0 && p.step < p.total_steps;
    if (checkpoint) {
      if (Status s = parallel_->training->gather(&trainer_->optimizer()); !s.is_ok()) throw CheckpointFailed{std::move(s)};
    }
    if (inner.on_step) inner.on_step(p);  // rank 0 commits here
    if (checkpoint) parallel_->training->scatter(&trainer_->optimizer());
  };
  return callbacks;
}

Status TrainingRun::open(PrivacyEntryAt privacy, const std::function<void(const std::string&)>& warn) {
  privacy_ = std::move(privacy);
  // A run resumed from --db takes its weights from the checkpoint instead of --init.
  Result<std::unique_ptr<Sequential>> model =
      make_initial_model(options_.model, options_.options.seed, model_input(), options_.init, &init_report_);
  if (!model.is_ok()) return model.status();
  model_ = std::move(*model);
  if (const std::string problem = model_->device_problem(device_); !problem.empty()) return invalid_argument(problem);
  model_->to_device(device_);
  trainer_ = std::make_unique<Trainer>(*model_, options_.options);
  if (options_.db.empty()) return Status::ok();
  return open_store(warn);
}

// The checkpoint store: created on first use; when it already holds a
// committed step of this run, training continues from there.
Status TrainingRun::open_store(const std::function<void(const std::string&)>& warn) {
  const std::string& db = options_.db;
  if (options_.resume && !std::filesystem::exists(db)) {
    return not_found(db + ": no such checkpoint database to resume (drop --resume to start a run)");
  }
  Result<store::CheckpointStore> opened = store::CheckpointStore::open(db, store_options(options_));
  if (!opened.is_ok()) return opened.status();
  checkpoints_.emplace(std::move(*opened));
  Result<std::vector<store::RoundInfo>> rounds = checkpoints_->rounds();
  if (!rounds.is_ok()) return rounds.status();
  nlohmann::json config = trajectory(options_, data_);
  // LoRA: the frozen weights come from --init and the seed at every start,
  // not from the checkpoint, so a resume must rebuild the same ones.
  if (model_->lora().enabled()) config["lora"]["frozen"] = model_->frozen_fingerprint();
  const auto record_base = [&] {
    return record_lora_base(*checkpoints_, options_.model, options_.options.seed, model_input(), options_.init, *model_);
  };
  if (rounds->empty()) {
    FEDMESH_RETURN_IF_ERROR(record_base());
    if (options_.resume) return not_found(db + ": no committed checkpoint to resume from");
    // Nothing committed yet (or a run killed before its first commit): this run's options are the run's.
    FEDMESH_RETURN_IF_ERROR(checkpoints_->set_meta(kTrainConfigKey, config.dump()));
    // How the data becomes samples (its schema: columns and encoding, classes, normalization): what an export
    // needs to be used elsewhere. Not compared on resume (the data's own check does that).
    FEDMESH_RETURN_IF_ERROR(checkpoints_->set_meta("data_schema", data_.schema.canonical));
    if (data_.tokenizer) {
      FEDMESH_RETURN_IF_ERROR(checkpoints_->set_meta(kTokenizerKey, data_.tokenizer->to_json()));
    } else {
      // A run that never committed may have left its tokenizer: this one has none.
      Result<std::optional<std::string>> earlier = checkpoints_->meta(kTokenizerKey);
      if (!earlier.is_ok()) return earlier.status();
      if (earlier->has_value() && !(*earlier)->empty()) FEDMESH_RETURN_IF_ERROR(checkpoints_->set_meta(kTokenizerKey, ""));
    }
    return checkpoints_->set_meta(kTrainThreadsKey, std::to_string(cpu_threads()));
  }
  Result<std::optional<std::string>> stored = checkpoints_->meta(kTrainConfigKey);
  if (!stored.is_ok()) return stored.status();
  const nlohmann::json stored_config =
      stored->has_value() ? nlohmann::json::parse(**stored, nullptr, false) : nlohmann::json::object();
  FEDMESH_RETURN_IF_ERROR(check_same_tokenizer(stored_config, data_, db));
  FEDMESH_RETURN_IF_ERROR(check_same_run(stored_config, config, db));
  FEDMESH_RETURN_IF_ERROR(record_base());
  Result<std::optional<std::string>> threads = checkpoints_->meta(kTrainThreadsKey);
  if (threads.is_ok() && threads->has_value() && **threads != std::to_string(cpu_threads())) {
    warn("warning: the run started with " + **threads + " threads, this one has " + std::to_string(cpu_threads()) +
         ": CPU kernels split work by thread count, so the resumed run's last bits may differ from an uninterrupted "
         "one (give --threads " + **threads + " for bit-exact resumption)");
  }
  ResumePoint point;
  // A damaged newest step is moved into quarantine; the run goes on from the
  // newest intact one and does the steps after it again.
  Result<store::LoadedCheckpoint> latest = checkpoints_->resume_latest([&](const store::QuarantineNotice& n) {
    ++point.corrupt_checkpoints_skipped;
    warn("warning: " + n.message);
  });
  if (!latest.is_ok()) return latest.status();
  FEDMESH_RETURN_IF_ERROR(restore_training_checkpoint(*latest, *model_, *trainer_, data_.train->targets_per_sample()));
  point.step = latest->round.round;
  point.epoch = trainer_->state().epoch;
  point.committed_at = latest->round.wall_time;
  point.metrics = nlohmann::json::parse(latest->round.metrics_json, nullptr, false);
  if (!point.metrics.is_object()) point.metrics = nlohmann::json::object();
  if (point.metrics.contains("test_accuracy")) {
    last_test_ = {{"test_accuracy", point.metrics["test_accuracy"]}, {"test_loss", point.metrics.value("test_loss", 0.0)}};
    for (const char* key : {"test_r2", "test_mae"}) {
      if (point.metrics.contains(key)) last_test_[key] = point.metrics[key];
    }
  }
  resumed_ = std::move(point);
  return Status::ok();
}

Status TrainingRun::launch_ranks() {
  if (options_.group.processes() <= 1) return Status::ok();
  parallel_ = std::make_unique<Parallel>();
  Result<std::unique_ptr<RankGroup>> launched = RankGroup::launch(options_.group.processes(), kRankTimeout, device_);
  if (!launched.is_ok()) return launched.status();
  parallel_->group = std::move(*launched);
  FEDMESH_RETURN_IF_ERROR(
      parallel_->group->command({{"command", "train"}, {"state", trainer_state_to_json(trainer_->state())}}));
  RankFlags flags = options_.group;
  flags.rendezvous = parallel_->group->directory();
  return start_parallel(parallel_->group->communicator(), flags);
}

int TrainingRun::ranks() const { return parallel_ && parallel_->group ? parallel_->group->size() : 1; }

size_t TrainingRun::gradient_buckets() const {
  DataParallel* data = parallel_ && parallel_->training ? parallel_->training->data_parallel() : nullptr;
  return data != nullptr ? data->bucket_count() : 0;
}

Status TrainingRun::commit_checkpoint(nlohmann::json metrics) {
  metrics.update(last_test_);
  std::optional<store::PrivacyEntry> privacy;
  if (privacy_) {
    privacy = privacy_(trainer_->state().step);  // the commit sets its round
    metrics["epsilon"] = privacy->epsilon;
    metrics["delta"] = privacy->delta;
  }
  FEDMESH_RETURN_IF_ERROR(commit_training_checkpoint(*checkpoints_, *model_, *trainer_, metrics, privacy));
  ++checkpoints_committed_;
  return Status::ok();
}

Result<TrainSummary> TrainingRun::fit(const TrainingRunEvents& events) {
  TrainCallbacks callbacks;
  callbacks.on_step = [&](const StepProgress& p) {
    if (checkpoints_ && p.step % options_.checkpoint_every == 0 && p.step < p.total_steps) {
      Status committed = commit_checkpoint({{"train_loss", p.result.loss}, {"lr", p.lr}, {"epoch", p.epoch}});
      if (!committed.is_ok()) throw CheckpointFailed{std::move(committed)};
      if (events.on_checkpoint) events.on_checkpoint(p.step);
    }
    if (events.progress.on_step) events.progress.on_step(p);
  };
  callbacks.on_epoch = [&](const EpochReport& r) {
    last_test_ = {{"test_accuracy", r.test.accuracy}, {"test_loss", r.test.loss}};
    if (r.test.regression) last_test_.update({{"test_r2", r.test.r2}, {"test_mae", r.test.mae}});
    if (events.progress.on_epoch) events.progress.on_epoch(r);
  };
  TrainSummary summary;
  try {
    if (parallel_) {
      ParallelTraining& training = *parallel_->training;
      Result<TrainSummary> trained = fit_synced(*trainer_, training.hook(), training.data_parallel(), *data_.train,
                                                data_.test.get(), tensor_checkpoint_callbacks(callbacks));
      // The whole model again (every rank of the tensor group takes part).
      if (trained.is_ok()) {
        if (Status gathered = training.gather(&trainer_->optimizer()); !gathered.is_ok()) trained = gathered;
      }
      const Status ranks = trained.is_ok() ? parallel_->group->join() : parallel_->group->check_ranks();
      if (!ranks.is_ok()) return ranks;
      if (!trained.is_ok()) return trained.status();
      summary = *trained;
    } else {
      summary = trainer_->fit(*data_.train, data_.test.get(), callbacks);
    }
  } catch (const CheckpointFailed& failed) {
    return Status(failed.status.code(), "checkpoint failed, training stopped: " + failed.status.message());
  }
  if (checkpoints_) {
    Status committed = commit_checkpoint({{"train_loss", summary.final_train_loss}, {"epoch", summary.epochs_completed}});
    if (!committed.is_ok()) return Status(committed.code(), "final checkpoint failed: " + committed.message());
    if (events.on_checkpoint) events.on_checkpoint(trainer_->state().step);
  }
  return summary;
}

}  // namespace fedmesh::train
