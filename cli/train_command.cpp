#include "cli/train_command.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <iostream>
#include <memory>
#include <new>
#include <string>

#include "cli/output.h"
#include "kernels/cuda_ops.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/fashion_mnist.h"
#include "train/data/text_corpus.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "train/parallel/data_parallel.h"
#include "train/parallel/rank_group.h"
#include "train/trainer.h"
#include "train/training_checkpoint.h"
#include "privacy/ledger.h"
#include "privacy/rdp_accountant.h"
#include "store/checkpoint_store.h"

namespace fedmesh::cli {

namespace {

constexpr int kMaxThreads = 1024;

struct TrainFlags {
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  std::string precision = "fp32";
  std::string device = "cpu";
  std::string schedule = "cosine";
  std::string tokenizer;  // language models: a BPE tokenizer file (`fedmesh tokenizer train`); "": bytes
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  int threads = 0;
  int64_t log_every = 50;
  bool json = false;
  // Checkpoints: none without --db.
  std::string db;
  int64_t checkpoint_every = 100;
  bool resume = false;
  int64_t keep_last = 3;
  std::string keep_best = "test_accuracy";
  train::TrainOptions options;
  train::RankFlags group;  // --ranks N: data-parallel CPU ranks (Gloo)
  bool zero_one = false;  // --zero-1: shard the optimizer state across the ranks
  bool profile = false;   // --profile: the step-time breakdown (kernels/step_profile.h)
  // Differential privacy (DP-SGD): --dp-clip, --dp-noise in options; these
  // say what the accountant reports and when the budget stops the run.
  double dp_delta = 1e-5;
  double dp_target_epsilon = 0.0;  // 0: no target
};

// Exit codes: 2 for input the user must fix, 1 for a failure while training.
int fail(const TrainFlags& flags, const Status& status, int exit_code = 2) {
  return report_failure("train", flags.json, status, exit_code);
}

// Thrown from the step callback to leave Trainer::fit when a checkpoint
// cannot be committed.
struct CheckpointFailed {};

// What a run trains and evaluates on: Fashion-MNIST images for the image
// models, windows of a text corpus (95% of every document to train on, the
// rest held out) for the language models.
// The held-out loss (nats per token) as DESIGN.md names it for language
// models, with its perplexity and bits per byte, and the unigram baseline's
// bits per byte. Bits per byte are the nats of all held-out targets over
// ln 2 and the bytes those targets stand for (train::data::bits_per_byte: 1 token
// per byte with the byte tokenizer; fewer with BPE). The unigram
// baseline is always the byte unigram's (nats per byte), so that runs with
// and without a tokenizer compare.
nlohmann::json language_metrics(double loss, double unigram_loss, double tokens_per_byte) {
  return {{"val_loss", loss}, {"val_perplexity", std::exp(loss)},
          {"val_bits_per_byte", train::data::bits_per_byte(loss, tokens_per_byte)},
          {"unigram_bits_per_byte", unigram_loss / std::log(2.0)}};
}

struct TrainingData {
  std::unique_ptr<train::data::FashionMnistSplits> images;
  std::unique_ptr<train::data::Dataset> train, test;
  bool language = false;
  std::string description;  // "60000 Fashion-MNIST images (10000 test)"
  double unigram_loss = 0.0;  // language models: the byte unigram's nats per byte on the held-out text
  // --tokenizer: the BPE tokenizer, the model's vocabulary (0: the model's
  // own), held-out target tokens per byte they stand for, and the token
  // unigram's nats per token on them.
  std::optional<train::data::BpeTokenizer> tokenizer;
  int64_t vocabulary = 0;
  double tokens_per_byte = 1.0;
  double token_unigram_loss = 0.0;
};

// `value` with `digits` decimals.
std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

Result<TrainingData> load_training_data(const TrainFlags& flags) {
  TrainingData out;
  const std::optional<train::TransformerConfig> language = train::language_model_config(flags.model);
  if (!language && !flags.tokenizer.empty()) {
    return invalid_argument("--tokenizer applies to the language models (gpt-*), not to " + flags.model);
  }
  if (!language) {
    Result<train::data::FashionMnistSplits> splits =
        train::data::load_fashion_mnist_splits(flags.data, flags.train_limit, flags.test_limit);
    if (!splits.is_ok()) return splits.status();
    out.images = std::make_unique<train::data::FashionMnistSplits>(std::move(*splits));
    out.train = std::make_unique<train::data::ImageBatches>(out.images->train);
    out.test = std::make_unique<train::data::ImageBatches>(out.images->test);
    out.description = std::to_string(out.images->train.count) + " Fashion-MNIST images (" +
                      std::to_string(out.images->test.count) + " test)";
    return out;
  }
  if (!flags.tokenizer.empty()) {
    Result<train::data::BpeTokenizer> tokenizer = train::data::BpeTokenizer::load(flags.tokenizer);
    if (!tokenizer.is_ok()) return tokenizer.status();
    out.tokenizer.emplace(std::move(*tokenizer));
    out.vocabulary = out.tokenizer->vocabulary();
  }
  const std::string source = train::data::text_source(flags.data);
  Result<train::data::TextCorpus> corpus = train::data::load_text_corpus(source);
  if (!corpus.is_ok()) return corpus.status();
  std::vector<size_t> all(corpus->documents.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = d;
  const train::data::BpeTokenizer* tokenizer = out.tokenizer ? &*out.tokenizer : nullptr;
  train::data::TextSplit split = train::data::split_text(*corpus, all, train::data::kHeldOutText, tokenizer);
  const int64_t context = language->context;
  // --train-limit / --test-limit count windows of `context` tokens.
  const auto cut = [context](std::vector<int32_t>& tokens, int64_t windows) {
    if (windows > 0) tokens.resize(std::min(tokens.size(), static_cast<size_t>(windows * context + 1)));
  };
  cut(split.train, flags.train_limit);
  cut(split.validation, flags.test_limit);
  const train::data::HeldOutBaseline baseline = train::data::held_out_baseline(split.train, split.validation, context, tokenizer);
  out.unigram_loss = baseline.byte_unigram_loss;
  out.token_unigram_loss = baseline.token_unigram_loss;
  out.tokens_per_byte = baseline.tokens_per_byte;
  const size_t train_tokens = split.train.size(), validation_tokens = split.validation.size();
  out.train = std::make_unique<train::data::TextWindows>(std::move(split.train), context, context);
  out.test = std::make_unique<train::data::TextWindows>(std::move(split.validation), context, context);
  if (out.train->size() == 0 || out.test->size() == 0) {
    return invalid_argument(source + " is too short for windows of " + std::to_string(context) + " tokens");
  }
  out.language = true;
  out.description = std::to_string(train_tokens) +
                    (out.tokenizer ? " BPE tokens (vocabulary " + std::to_string(out.vocabulary) + ", " +
                                         fixed(1.0 / out.tokens_per_byte, 3) + " bytes per token held out) of "
                                   : std::string(" byte tokens of ")) +
                    source + " (" +
                    std::to_string(corpus->documents.size()) + " documents; " + std::to_string(validation_tokens) +
                    " held out) in windows of " + std::to_string(context);
  return out;
}

// Ranks 1..N-1 of `fedmesh train --ranks N`: the same run's arguments
// (launched by rank 0 with --rank and --rendezvous), no output, no store.
// They take rank 0's position and state (restored from its checkpoint, or
// fresh), train their part of every batch and exit when the run ends.
int run_train_rank(TrainFlags& flags, const train::data::Dataset& train, int64_t vocabulary, Device device) {
  Result<std::unique_ptr<train::Sequential>> model = train::make_model(flags.model, flags.options.seed, vocabulary);
  if (!model.is_ok()) return fail(flags, model.status());
  (*model)->to_device(device);
  train::Trainer trainer(**model, flags.options);
  Result<std::unique_ptr<train::Communicator>> communicator =
      train::join_rank_group(flags.group, train::kRankTimeout, device);
  if (!communicator.is_ok()) return fail(flags, communicator.status(), 1);
  Result<std::optional<nlohmann::json>> command = train::read_rank_command();
  if (!command.is_ok()) return fail(flags, command.status(), 1);
  if (!command->has_value()) return 0;  // rank 0 gave up before training
  Result<train::TrainerState> state = train::trainer_state_from_json((**command)["state"].dump());
  if (!state.is_ok()) return fail(flags, state.status(), 1);
  if (Status s = trainer.restore(*state); !s.is_ok()) return fail(flags, s, 1);
  if (Status s = train::broadcast_training_state(**communicator, **model, trainer); !s.is_ok()) return fail(flags, s, 1);
  train::DataParallelOptions parallel;
  parallel.zero_one = flags.zero_one;
  train::DataParallel sync(**communicator, **model, parallel);
  Result<train::TrainSummary> trained = train::fit_data_parallel(trainer, sync, train, nullptr, {});
  return trained.is_ok() ? 0 : fail(flags, trained.status(), 1);
}

// The flags that decide a run's trajectory: a resumed run must use the same
// ones, or it would not continue the run it claims to continue. A BPE
// tokenizer is recorded by its fingerprint (the file may move); a run of the
// byte tokenizer has no "tokenizer" key, as before tokenizers existed.
nlohmann::json trajectory_options(const TrainFlags& flags) {
  const train::TrainOptions& o = flags.options;
  return {{"model", flags.model},
          {"data", flags.data},
          {"train_limit", flags.train_limit},
          {"test_limit", flags.test_limit},
          {"epochs", o.epochs},
          {"steps", o.max_steps},
          {"batch_size", o.batch_size},
          {"grad_accumulation", o.grad_accumulation},
          {"optimizer", o.optimizer},
          {"lr", o.lr},
          {"momentum", o.momentum},
          {"nesterov", o.nesterov},
          {"weight_decay", o.weight_decay},
          {"schedule", flags.schedule},
          {"clip_grad_norm", o.clip_grad_norm},
          {"precision", flags.precision},
          {"loss_scale", o.loss_scaling.initial_scale},
          {"seed", o.seed},
          {"dp_clip", o.dp_clip_norm},
          {"dp_noise", o.dp_noise_multiplier},
          {"dp_delta", flags.dp_delta},
          {"dp_target_epsilon", flags.dp_target_epsilon}};
}

nlohmann::json trajectory_flags(const TrainFlags& flags, const TrainingData& data) {
  nlohmann::json config = trajectory_options(flags);
  if (data.tokenizer) config["tokenizer"] = data.tokenizer->fingerprint();
  return config;
}

constexpr const char* kTrainConfigKey = "train_config";
constexpr const char* kTrainThreadsKey = "train_threads";
// The run's BPE tokenizer file, whole (absent for the byte tokenizer):
// `fedmesh generate` decodes with it.
constexpr const char* kTokenizerKey = "tokenizer";

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

// Compares this command's trajectory flags with those the database's run was
// started with; the message names every flag that differs.
Status check_same_run(const nlohmann::json& stored, const nlohmann::json& now, const std::string& db) {
  std::string differences;
  for (const auto& [key, value] : now.items()) {
    const auto it = stored.find(key);
    if (it != stored.end() && *it == value) continue;
    if (!differences.empty()) differences += ", ";
    differences += "--" + key + " " + value.dump() + " (the run in the database used " +
                   (it == stored.end() ? std::string("nothing") : it->dump()) + ")";
  }
  for (char& c : differences) {
    if (c == '_' ) c = '-';
  }
  if (differences.empty()) return Status::ok();
  return invalid_argument(db + " holds checkpoints of a different run: " + differences +
                          ". Give the same flags to resume it, or a new --db to start another run");
}

int64_t total_steps_of(const train::TrainOptions& options, int64_t train_count) {
  const int64_t step_samples = options.batch_size * options.grad_accumulation;
  const int64_t steps_per_epoch = (train_count + step_samples - 1) / step_samples;
  return options.max_steps > 0 ? options.max_steps : options.epochs * steps_per_epoch;
}

int run_train(TrainFlags& flags) {
  const auto wall_start = std::chrono::steady_clock::now();
  if (flags.device == "cuda" && flags.group.launched()) {
    // A GPU rank takes its own device before anything makes a CUDA context.
    if (Result<int> index = cuda::use_device_for_rank(flags.group.rank); !index.is_ok()) {
      return fail(flags, index.status(), 1);
    }
  }
  Result<Device> device = train::training_device(flags.device, flags.options.dp_clip_norm > 0.0f);
  if (!device.is_ok()) return fail(flags, device.status());
  if (*device == Device::kCuda && flags.zero_one) {
    return fail(flags, invalid_argument("--zero-1 with --device cuda: the sharded optimizer keeps its shards in host "
                                        "memory for now; drop --zero-1"));
  }
  if (Status s = flags.group.validate(); !s.is_ok()) return fail(flags, s);
  if (flags.zero_one && flags.group.ranks < 2) return fail(flags, invalid_argument("--zero-1 needs --ranks N with N >= 2"));
  if (flags.zero_one && !flags.db.empty()) {
    return fail(flags, invalid_argument("--zero-1 with --db: a checkpoint would hold rank 0's shard of the optimizer "
                                        "state only, so a resumed run could not continue; drop one of them"));
  }
  if (!(flags.dp_delta > 0.0 && flags.dp_delta < 1.0)) return fail(flags, invalid_argument("--dp-delta must be in (0, 1)"));
  if (!(flags.dp_target_epsilon >= 0.0)) return fail(flags, invalid_argument("--dp-target-epsilon must be >= 0"));
  if (flags.dp_target_epsilon > 0.0 && flags.options.dp_clip_norm == 0.0f) {
    return fail(flags, invalid_argument("--dp-target-epsilon needs --dp-clip and --dp-noise"));
  }
  flags.options.dp_seed = flags.options.seed;
  flags.options.data_parallel_rank = flags.group.rank;
  flags.options.data_parallel_ranks = flags.group.ranks;
  Result<DType> precision = parse_dtype(flags.precision);
  if (!precision.is_ok()) return fail(flags, precision.status());
  flags.options.precision = *precision;
  Result<LrSchedule> schedule = LrSchedule::parse(flags.schedule);
  if (!schedule.is_ok()) return fail(flags, schedule.status());
  flags.options.schedule = *schedule;
  if (Status s = flags.options.validate(); !s.is_ok()) return fail(flags, s);
  if (flags.train_limit < 0 || flags.test_limit < 0) return fail(flags, invalid_argument("limits must be >= 0"));
  if (flags.log_every < 1) return fail(flags, invalid_argument("--log-every must be at least 1"));
  if (flags.checkpoint_every < 1) return fail(flags, invalid_argument("--checkpoint-every must be at least 1"));
  if (flags.resume && flags.db.empty()) return fail(flags, invalid_argument("--resume needs --db PATH"));
  store::StoreOptions store_options;
  store_options.keep_last = flags.keep_last;
  store_options.best_metric = flags.keep_best == "none" ? "" : flags.keep_best;
  if (Status s = store_options.validate(); !s.is_ok()) return fail(flags, invalid_argument("--keep-last/--keep-best: " + s.message()));
  if (flags.threads < 0 || flags.threads > kMaxThreads)
    return fail(flags, invalid_argument("--threads must be in [0, " + std::to_string(kMaxThreads) + "] (0 = all cores)"));
  set_cpu_threads(flags.threads);

  Result<TrainingData> loaded = load_training_data(flags);
  if (!loaded.is_ok()) return fail(flags, loaded.status());
  const train::data::Dataset* train = loaded->train.get();
  const train::data::Dataset* test = loaded->test.get();
  if (flags.group.launched()) return run_train_rank(flags, *train, loaded->vocabulary, *device);

  // DP-SGD: the accountant, and a target budget caps the steps up front, so
  // that no step is taken whose epsilon would exceed it. Sampling rate q =
  // examples per step / training examples (shuffled fixed-size batches,
  // analysed as Poisson sampling at that rate, as Opacus and TensorFlow
  // Privacy tutorials do).
  std::optional<privacy::ConstantRateAccounting> accounting;
  if (flags.options.dp_clip_norm > 0.0f) {
    accounting.emplace();
    accounting->q = std::min(1.0, static_cast<double>(flags.options.batch_size * flags.options.grad_accumulation) /
                                      static_cast<double>(std::max<int64_t>(1, train->size())));
    accounting->sigma = flags.options.dp_noise_multiplier;
    accounting->delta = flags.dp_delta;
    const int64_t requested = total_steps_of(flags.options, train->size());
    if (flags.dp_target_epsilon > 0.0) {
      const int64_t allowed = accounting->steps_within(flags.dp_target_epsilon, requested);
      if (allowed == 0) {
        return fail(flags, invalid_argument("--dp-target-epsilon " + std::to_string(flags.dp_target_epsilon) +
                                            " allows no step at this noise and sampling rate: raise --dp-noise"));
      }
      if (allowed < requested) {
        std::fprintf(stderr, "fedmesh train: the privacy budget (epsilon %g at delta %g) allows %lld of the %lld steps; "
                     "training stops there\n", flags.dp_target_epsilon, flags.dp_delta, static_cast<long long>(allowed),
                     static_cast<long long>(requested));
        flags.options.max_steps = allowed;
      }
    }
  }
  Result<std::unique_ptr<train::Sequential>> model = train::make_model(flags.model, flags.options.seed, loaded->vocabulary);
  if (!model.is_ok()) return fail(flags, model.status());
  train::Sequential& net = **model;
  net.to_device(*device);
  train::Trainer trainer(net, flags.options);
  const int64_t total_steps = total_steps_of(flags.options, train->size());

  // The checkpoint store: created on first use; when it already holds a
  // committed step of this run, training continues from there.
  std::optional<store::CheckpointStore> checkpoints;
  int64_t resumed_step = 0;
  nlohmann::json last_test = nlohmann::json::object();  // the latest evaluation, carried in later checkpoints' metrics
  if (!flags.db.empty()) {
    if (flags.resume && !std::filesystem::exists(flags.db)) {
      return fail(flags, not_found(flags.db + ": no such checkpoint database to resume (drop --resume to start a run)"));
    }
    Result<store::CheckpointStore> opened = store::CheckpointStore::open(flags.db, store_options);
    if (!opened.is_ok()) return fail(flags, opened.status());
    checkpoints.emplace(std::move(*opened));
    Result<std::vector<store::RoundInfo>> rounds = checkpoints->rounds();
    if (!rounds.is_ok()) return fail(flags, rounds.status());
    const nlohmann::json config = trajectory_flags(flags, *loaded);
    if (rounds->empty()) {
      if (flags.resume) return fail(flags, not_found(flags.db + ": no committed checkpoint to resume from"));
      // Nothing committed yet (or a run killed before its first commit): this run's flags are the run's.
      if (Status s = checkpoints->set_meta(kTrainConfigKey, config.dump()); !s.is_ok()) return fail(flags, s);
      if (loaded->tokenizer) {
        if (Status s = checkpoints->set_meta(kTokenizerKey, loaded->tokenizer->to_json()); !s.is_ok()) return fail(flags, s);
      } else {
        // A run that never committed may have left its tokenizer: this one has none.
        Result<std::optional<std::string>> earlier = checkpoints->meta(kTokenizerKey);
        if (!earlier.is_ok()) return fail(flags, earlier.status());
        if (earlier->has_value() && !(*earlier)->empty()) {
          if (Status s = checkpoints->set_meta(kTokenizerKey, ""); !s.is_ok()) return fail(flags, s);
        }
      }
      if (Status s = checkpoints->set_meta(kTrainThreadsKey, std::to_string(cpu_threads())); !s.is_ok()) return fail(flags, s);
    } else {
      Result<std::optional<std::string>> stored = checkpoints->meta(kTrainConfigKey);
      if (!stored.is_ok()) return fail(flags, stored.status());
      const nlohmann::json stored_config =
          stored->has_value() ? nlohmann::json::parse(**stored, nullptr, false) : nlohmann::json::object();
      if (Status s = check_same_tokenizer(stored_config, *loaded, flags.db); !s.is_ok()) return fail(flags, s);
      if (Status s = check_same_run(stored_config, config, flags.db); !s.is_ok()) return fail(flags, s);
      Result<std::optional<std::string>> threads = checkpoints->meta(kTrainThreadsKey);
      if (threads.is_ok() && threads->has_value() && **threads != std::to_string(cpu_threads())) {
        std::fprintf(stderr,
                     "fedmesh train: warning: the run started with %s threads, this one has %d: CPU kernels split "
                     "work by thread count, so the resumed run's last bits may differ from an uninterrupted one "
                     "(give --threads %s for bit-exact resumption)\n",
                     (*threads)->c_str(), cpu_threads(), (*threads)->c_str());
      }
      size_t skipped = 0;  // corrupt checkpoints passed over
      Result<store::LoadedCheckpoint> latest = checkpoints->load_latest([&skipped](const std::string& warning) {
        ++skipped;
        std::fprintf(stderr, "fedmesh train: %s\n", warning.c_str());
      });
      if (!latest.is_ok()) return fail(flags, latest.status());
      if (Status s = train::restore_training_checkpoint(*latest, net, trainer); !s.is_ok()) return fail(flags, s);
      resumed_step = latest->round.round;
      const nlohmann::json metrics = nlohmann::json::parse(latest->round.metrics_json, nullptr, false);
      if (metrics.is_object() && metrics.contains("test_accuracy")) {
        last_test = {{"test_accuracy", metrics["test_accuracy"]}, {"test_loss", metrics.value("test_loss", 0.0)}};
      }
      const train::TrainerState state = trainer.state();
      if (flags.json) {
        emit_json({{"event", "resume"},
                   {"db", flags.db},
                   {"step", resumed_step},
                   {"total_steps", total_steps},
                   {"epoch", state.epoch},
                   {"committed_at", latest->round.wall_time},
                   {"corrupt_checkpoints_skipped", skipped}});
      }
      std::fprintf(stderr, "fedmesh train: resuming from %s: step %lld of %lld (epoch %lld), committed %s\n",
                   flags.db.c_str(), static_cast<long long>(resumed_step), static_cast<long long>(total_steps),
                   static_cast<long long>(state.epoch), latest->round.wall_time.c_str());
      if (resumed_step >= total_steps) {
        std::fprintf(stderr, "fedmesh train: the run in %s is already complete; nothing to train\n", flags.db.c_str());
        if (flags.json) {
          emit_json({{"event", "summary"},
                     {"command", "train"},
                     {"model", flags.model},
                     {"precision", flags.precision},
                     {"test_accuracy", metrics.value("test_accuracy", 0.0)},
                     {"test_loss", metrics.value("test_loss", 0.0)},
                     {"train_loss", metrics.value("train_loss", 0.0)},
                     {"steps", resumed_step},
                     {"resumed_from_step", resumed_step},
                     {"already_complete", true},
                     {"rounds", 0},
                     {"bytes_sent", 0},
                     {"bytes_received", 0},
                     {"wall_seconds", 0.0}});
        } else {
          std::printf("%s %s: test accuracy %.2f%% (run already complete at step %lld)\n", flags.model.c_str(),
                      flags.precision.c_str(), 100.0 * metrics.value("test_accuracy", 0.0),
                      static_cast<long long>(resumed_step));
        }
        return 0;
      }
    }
  }
  // Commits the trainer's current position; a failure stops the run (a
  // checkpoint that cannot be written must not be silently skipped).
  Status checkpoint_status = Status::ok();
  int64_t checkpoints_committed = 0;
  const auto commit_checkpoint = [&](nlohmann::json metrics) {
    if (!checkpoints || !checkpoint_status.is_ok()) return;
    metrics.update(last_test);
    std::optional<store::PrivacyEntry> privacy;
    if (accounting) {
      privacy = privacy::ledger_entry(*accounting, "dp-sgd", 0, trainer.state().step);  // commit sets the round
      metrics["epsilon"] = privacy->epsilon;
      metrics["delta"] = privacy->delta;
    }
    checkpoint_status = train::commit_training_checkpoint(*checkpoints, net, trainer, metrics, privacy);
    if (!checkpoint_status.is_ok()) return;
    ++checkpoints_committed;
    const int64_t step = trainer.state().step;
    if (flags.json) emit_json({{"event", "checkpoint"}, {"step", step}, {"db", flags.db}});
  };

  // --ranks N: launch ranks 1..N-1 now that the flags, the data and the
  // store are known good, and hand them this run's position and state.
  std::unique_ptr<train::RankGroup> group;
  std::optional<train::DataParallel> sync;
  if (flags.group.ranks > 1) {
    Result<std::unique_ptr<train::RankGroup>> launched =
        train::RankGroup::launch(flags.group.ranks, train::kRankTimeout, *device);
    if (!launched.is_ok()) return fail(flags, launched.status(), 1);
    group = std::move(*launched);
    Status shared = group->command({{"command", "train"}, {"state", train::trainer_state_to_json(trainer.state())}});
    if (shared.is_ok()) shared = train::broadcast_training_state(group->communicator(), net, trainer);
    if (!shared.is_ok()) return fail(flags, shared, 1);
    train::DataParallelOptions parallel;
    parallel.zero_one = flags.zero_one;
    sync.emplace(group->communicator(), net, parallel);
  }

  if (flags.json) {
    emit_json({{"event", "start"},
               {"command", "train"},
               {"model", flags.model},
               {"parameters", net.parameter_count()},
               {"precision", flags.precision},
               {"device", flags.device},
               {"threads", cpu_threads()},
               {"ranks", flags.group.ranks},
               {"optimizer", flags.options.optimizer},
               {"lr", flags.options.lr},
               {"schedule", flags.options.schedule.to_string()},
               {"batch_size", flags.options.batch_size},
               {"grad_accumulation", flags.options.grad_accumulation},
               {"train_samples", train->size()},
               {"test_samples", test->size()},
               {"seed", flags.options.seed}});
    if (loaded->tokenizer) {
      emit_json({{"event", "tokenizer"},
                 {"tokenizer", loaded->tokenizer->fingerprint()},
                 {"vocab_size", loaded->vocabulary},
                 {"held_out_bytes_per_token", 1.0 / loaded->tokens_per_byte}});
    }
  } else {
    std::fprintf(stderr, "%s", net.summary().c_str());
    std::fprintf(stderr, "training %s on %s, %s, %s, %d threads, batch %lld, %s lr %g\n", flags.model.c_str(),
                 loaded->description.c_str(), flags.device.c_str(), flags.precision.c_str(), cpu_threads(),
                 static_cast<long long>(flags.options.batch_size), flags.options.optimizer.c_str(),
                 static_cast<double>(flags.options.lr));
    if (loaded->tokenizer) {
      std::fprintf(stderr, "held-out text: a byte unigram model (no context) reaches %.3f bits/byte; a unigram of "
                   "these tokens %.4f nats/token, %.3f bits/byte\n", loaded->unigram_loss / std::log(2.0),
                   loaded->token_unigram_loss, train::data::bits_per_byte(loaded->token_unigram_loss, loaded->tokens_per_byte));
    } else if (loaded->language) {
      std::fprintf(stderr, "held-out text: a unigram model (no context) reaches %.4f nats/token, %.3f bits/byte\n",
                   loaded->unigram_loss, loaded->unigram_loss / std::log(2.0));
    }
    if (group) {
      std::fprintf(stderr, "data parallel over %d CPU ranks (Gloo, %zu gradient buckets%s): each takes 1/%d of every batch\n",
                   group->size(), sync->bucket_count(), flags.zero_one ? ", optimizer state sharded (ZeRO-1)" : "",
                   group->size());
    }
  }

  ProgressLine line;
  train::TrainCallbacks callbacks;
  callbacks.on_step = [&](const train::StepProgress& p) {
    if (p.step % flags.checkpoint_every == 0 && p.step < p.total_steps) {
      commit_checkpoint({{"train_loss", p.result.loss}, {"lr", p.lr}, {"epoch", p.epoch}});
      if (!checkpoint_status.is_ok()) throw CheckpointFailed{};
    }
    const bool report = p.step % flags.log_every == 0 || p.step == p.total_steps;
    if (flags.json) {
      if (!report) return;
      emit_json({{"event", "step"},
                 {"epoch", p.epoch},
                 {"step", p.step},
                 {"total_steps", p.total_steps},
                 {"loss", p.result.loss},
                 {"lr", p.lr},
                 {"grad_norm", p.result.grad_norm},
                 {"applied", p.result.applied},
                 {"loss_scale", p.loss_scale},
                 {"samples_per_second", p.samples_per_second},
                 {"eta_seconds", p.eta_seconds}});
      return;
    }
    char text[256];
    std::snprintf(text, sizeof text, "epoch %lld/%lld  step %lld/%lld  loss %.4f  %.0f samples/s  ETA %s%s",
                  static_cast<long long>(p.epoch), static_cast<long long>(p.epochs), static_cast<long long>(p.step),
                  static_cast<long long>(p.total_steps), p.result.loss, p.samples_per_second,
                  format_duration(p.eta_seconds).c_str(), p.result.applied ? "" : "  (step skipped: overflow)");
    line.update(text, report);
  };
  callbacks.on_epoch = [&](const train::EpochReport& r) {
    last_test = {{"test_accuracy", r.test.accuracy}, {"test_loss", r.test.loss}};
    if (flags.json) {
      nlohmann::json event = {{"event", "epoch"},
                              {"epoch", r.epoch},
                              {"train_loss", r.train_loss},
                              {"train_accuracy", r.train_accuracy},
                              {"test_loss", r.test.loss},
                              {"test_accuracy", r.test.accuracy},
                              {"seconds", r.seconds}};
      if (loaded->language) event.update(language_metrics(r.test.loss, loaded->unigram_loss, loaded->tokens_per_byte));
      emit_json(event);
      return;
    }
    line.finish();
    if (loaded->language) {
      std::fprintf(stderr, "epoch %lld: train loss %.4f, held-out loss %.4f (perplexity %.3f, %.3f bits/byte; unigram "
                   "%.3f), next-%s accuracy %.2f%% (%s)\n", static_cast<long long>(r.epoch), r.train_loss,
                   r.test.loss, std::exp(r.test.loss), train::data::bits_per_byte(r.test.loss, loaded->tokens_per_byte),
                   loaded->unigram_loss / std::log(2.0), loaded->tokenizer ? "token" : "byte",
                   100.0 * r.test.accuracy, format_duration(r.seconds).c_str());
      return;
    }
    std::fprintf(stderr, "epoch %lld: train loss %.4f, train accuracy %.2f%%, test loss %.4f, test accuracy %.2f%% (%s)\n",
                 static_cast<long long>(r.epoch), r.train_loss, 100.0 * r.train_accuracy, r.test.loss,
                 100.0 * r.test.accuracy, format_duration(r.seconds).c_str());
  };

  if (flags.profile) enable_step_profile();
  train::TrainSummary summary;
  try {
    if (sync) {
      Result<train::TrainSummary> trained = train::fit_data_parallel(trainer, *sync, *train, test, callbacks);
      Status ranks = trained.is_ok() ? group->join() : group->check_ranks();
      if (!ranks.is_ok() || !trained.is_ok()) {
        line.finish();
        return fail(flags, !ranks.is_ok() ? ranks : trained.status(), 1);
      }
      summary = *trained;
    } else {
      summary = trainer.fit(*train, test, callbacks);
    }
  } catch (const CheckpointFailed&) {
    line.finish();
    return fail(flags, Status(checkpoint_status.code(), "checkpoint failed, training stopped: " + checkpoint_status.message()), 1);
  }
  line.finish();
  if (checkpoints) {
    commit_checkpoint({{"train_loss", summary.final_train_loss}, {"epoch", summary.epochs_completed}});
    if (!checkpoint_status.is_ok()) {
      return fail(flags, Status(checkpoint_status.code(), "final checkpoint failed: " + checkpoint_status.message()), 1);
    }
  }
  const double wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  // --profile: the steps' time split into GEMM, other kernels, exposed
  // communication and the host's own work (the rest of the steps' time).
  const StepTimes times = step_profile_totals();
  disable_step_profile();
  const double host_seconds =
      std::max(0.0, summary.train_seconds - times.gemm_seconds - times.kernel_seconds - times.communication_seconds);
  if (flags.json) {
    nlohmann::json event = {{"event", "summary"},
               {"command", "train"},
               {"model", flags.model},
               {"precision", flags.precision},
               {"test_accuracy", summary.test.accuracy},
               {"test_loss", summary.test.loss},
               {"train_loss", summary.final_train_loss},
               {"epochs", summary.epochs_completed},
               {"steps", summary.steps},
               {"skipped_steps", summary.skipped_steps},
               {"samples", summary.samples},
               {"samples_per_second", summary.samples_per_second},
               {"train_seconds", summary.train_seconds},
               {"loss_scale", summary.final_loss_scale},
               {"threads", cpu_threads()},
               {"resumed_from_step", resumed_step},
               {"checkpoints_committed", checkpoints_committed},
               {"rounds", 0},
               {"bytes_sent", 0},
               {"bytes_received", 0},
               {"wall_seconds", wall_seconds}};
    if (flags.profile) {
      event["step_time"] = {{"gemm_seconds", times.gemm_seconds},
                            {"kernel_seconds", times.kernel_seconds},
                            {"communication_seconds", times.communication_seconds},
                            {"host_seconds", host_seconds},
                            {"train_seconds", summary.train_seconds}};
    }
    if (accounting) {
      const privacy::PrivacySpent spent = accounting->after(summary.steps);
      event["epsilon"] = spent.epsilon;
      event["delta"] = accounting->delta;
      event["dp_noise_multiplier"] = accounting->sigma;
      event["dp_sampling_rate"] = accounting->q;
    }
    if (loaded->language) {
      event.update(language_metrics(summary.test.loss, loaded->unigram_loss, loaded->tokens_per_byte));
      event["tokens_per_second"] = summary.samples_per_second * static_cast<double>(train->targets_per_sample());
    }
    if (loaded->tokenizer) {
      event["tokenizer"] = loaded->tokenizer->fingerprint();
      event["vocab_size"] = loaded->vocabulary;
      event["held_out_bytes_per_token"] = 1.0 / loaded->tokens_per_byte;
      event["token_unigram_bits_per_byte"] = train::data::bits_per_byte(loaded->token_unigram_loss, loaded->tokens_per_byte);
    }
    emit_json(event);
  } else if (loaded->language) {
    std::printf("%s %s: held-out loss %.4f (perplexity %.3f, %.3f bits/byte; a unigram model %.3f) after %lld steps, "
                "%.0f tokens/s, %s\n", flags.model.c_str(), flags.precision.c_str(), summary.test.loss,
                std::exp(summary.test.loss), train::data::bits_per_byte(summary.test.loss, loaded->tokens_per_byte),
                loaded->unigram_loss / std::log(2.0),
                static_cast<long long>(summary.steps),
                summary.samples_per_second * static_cast<double>(train->targets_per_sample()),
                format_duration(wall_seconds).c_str());
  } else {
    std::printf("%s %s: test accuracy %.2f%%, test loss %.4f after %lld steps (%lld skipped), %.0f samples/s, %s\n",
                flags.model.c_str(), flags.precision.c_str(), 100.0 * summary.test.accuracy, summary.test.loss,
                static_cast<long long>(summary.steps), static_cast<long long>(summary.skipped_steps),
                summary.samples_per_second, format_duration(wall_seconds).c_str());
    if (checkpoints) {
      std::printf("%lld checkpoints committed to %s (newest: step %lld)%s\n", static_cast<long long>(checkpoints_committed),
                  flags.db.c_str(), static_cast<long long>(summary.steps),
                  resumed_step > 0 ? (", resumed from step " + std::to_string(resumed_step)).c_str() : "");
    }
  }
  if (flags.profile && !flags.json && summary.train_seconds > 0.0) {
    const auto share = [&](double seconds) { return 100.0 * seconds / summary.train_seconds; };
    std::printf("step time %s: GEMM %.1f%%, other kernels %.1f%%, communication %.1f%%, host %.1f%%\n",
                format_duration(summary.train_seconds).c_str(), share(times.gemm_seconds), share(times.kernel_seconds),
                share(times.communication_seconds), share(host_seconds));
  }
  if (accounting && !flags.json) {
    std::printf("differential privacy (DP-SGD, clip %g, noise %g, q %.4g): (epsilon %.4f, delta %g) spent over %lld steps\n",
                static_cast<double>(flags.options.dp_clip_norm), accounting->sigma, accounting->q,
                accounting->after(summary.steps).epsilon, accounting->delta, static_cast<long long>(summary.steps));
  }
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<TrainFlags>();
  train::TrainOptions& o = flags->options;
  CLI::App* cmd = app.add_subcommand(
      "train", "Train a model locally on this machine's data (no federation) and report test accuracy.");
  cmd->add_option("--model", flags->model,
                  "Model to train: mlp (784-512-256-10) or cnn (2 conv + 2 fc) on Fashion-MNIST; or a GPT-style "
                  "language model on text with the byte tokenizer (or --tokenizer FILE): gpt-nano (0.1M parameters), gpt-tiny (1.8M), "
                  "gpt-small (10.8M), gpt2 (124M)")
      ->check(CLI::IsMember(train::model_names()))
      ->capture_default_str();
  cmd->add_option("--data", flags->data,
                  "Image models: fashion-mnist (from /usr/share/datasets/fashion-mnist, package dataset-fashion-mnist) "
                  "or a directory holding the four Fashion-MNIST IDX files (.gz or plain). Language models: bible-kjv "
                  "(the default; Debian's bible-kjv, one document per book) or a directory of plain-text files (one "
                  "document each); 5% of every document is held out. --train-limit/--test-limit count windows")
      ->capture_default_str();
  cmd->add_option("--tokenizer", flags->tokenizer,
                  "Language models: a BPE tokenizer file from `fedmesh tokenizer train` instead of the byte tokenizer; "
                  "the model's vocabulary becomes the tokenizer's size, the tokenizer is kept in --db for `fedmesh "
                  "generate`, and a resume must give the same one. val_bits_per_byte divides the held-out nats by "
                  "ln 2 and by the bytes the held-out tokens stand for; unigram_bits_per_byte stays the byte unigram's");
  cmd->add_option("--epochs", o.epochs, "Passes over the training set")->capture_default_str();
  cmd->add_option("--steps", o.max_steps, "Stop after this many optimizer steps (overrides --epochs; 0 = off)")
      ->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "Samples per micro-batch")->capture_default_str();
  cmd->add_option("--grad-accumulation", o.grad_accumulation,
                  "Micro-batches accumulated per optimizer step (effective batch = batch-size x this)")
      ->capture_default_str();
  cmd->add_option("--optimizer", o.optimizer, "adamw or sgd")->capture_default_str();
  cmd->add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  cmd->add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  cmd->add_flag("--nesterov", o.nesterov, "Nesterov momentum for SGD");
  cmd->add_option("--weight-decay", o.weight_decay, "Weight decay (decoupled for adamw, L2 for sgd)")
      ->capture_default_str();
  cmd->add_option("--schedule", flags->schedule,
                  "Learning-rate schedule: cosine (decays to 0 over the run), cosine:WARMUP (linear warm-up steps first), constant, step:EVERY:GAMMA")
      ->capture_default_str();
  cmd->add_option("--clip-grad-norm", o.clip_grad_norm, "Clip the global gradient norm to this (0 = off)")
      ->capture_default_str();
  cmd->add_option("--precision", flags->precision,
                  "fp32, or bf16/fp16 compute copies of fp32 master weights (fp16 uses dynamic loss scaling)")
      ->capture_default_str();
  cmd->add_option("--loss-scale", o.loss_scaling.initial_scale, "Initial loss scale for fp16")->capture_default_str();
  cmd->add_option("--device", flags->device,
                  "cpu, or cuda: the model, its activations, gradients and optimizer state on the GPU (with --ranks N: "
                  "one rank per GPU, NCCL; no --dp-clip or --zero-1); checkpoints are the same either way")
      ->capture_default_str();
  cmd->add_option("--ranks", flags->group.ranks,
                  "Data-parallel CPU ranks: processes launched by this one, each training on 1/N of every batch, "
                  "gradients all-reduced with Gloo (the run equals one process on the whole batches)")
      ->capture_default_str();
  cmd->add_option("--dp-clip", o.dp_clip_norm,
                  "Differential privacy (DP-SGD): clip every example's gradient to this L2 norm (0 = off)")
      ->capture_default_str();
  cmd->add_option("--dp-noise", o.dp_noise_multiplier,
                  "DP-SGD noise multiplier sigma: N(0, (sigma * clip)^2) added to each step's summed gradient")
      ->capture_default_str();
  cmd->add_option("--dp-delta", flags->dp_delta, "The delta the RDP accountant reports epsilon at")->capture_default_str();
  cmd->add_option("--dp-target-epsilon", flags->dp_target_epsilon,
                  "Stop before the step that would spend more than this epsilon (0 = no target)")
      ->capture_default_str();
  cmd->add_flag("--zero-1", flags->zero_one,
                "With --ranks: shard the optimizer state across the ranks (ZeRO stage 1: each holds 1/N of the "
                "moments and steps 1/N of the weights; the same weights as without it)");
  cmd->add_option("--rank", flags->group.rank)->group("");  // set by rank 0 for the ranks it launches
  cmd->add_option("--rendezvous", flags->group.rendezvous)->group("");
  cmd->add_option("--threads", flags->threads, "CPU threads for kernels and OpenBLAS (0 = all cores)")
      ->capture_default_str();
  cmd->add_option("--train-limit", flags->train_limit, "Use only the first N training images (0 = all)")
      ->capture_default_str();
  cmd->add_option("--test-limit", flags->test_limit, "Evaluate on only the first N test images (0 = all)")
      ->capture_default_str();
  cmd->add_option("--eval-batch-size", o.eval_batch_size, "Batch size for evaluation")->capture_default_str();
  cmd->add_option("--log-every", flags->log_every, "Steps between progress reports (JSON and logs)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed for initialization and shuffling (runs replay exactly)")
      ->capture_default_str();
  cmd->add_option("--db", flags->db,
                  "SQLite checkpoint database: commits every --checkpoint-every steps and at the end; when it already "
                  "holds a checkpoint of this run, training resumes from the newest intact one");
  cmd->add_option("--checkpoint-every", flags->checkpoint_every, "Optimizer steps between checkpoints (with --db)")
      ->capture_default_str();
  cmd->add_flag("--resume", flags->resume,
                "Require a checkpoint in --db to resume from (without it, an empty --db starts a new run)");
  cmd->add_option("--keep-last", flags->keep_last, "Checkpoints kept besides the best one (with --db)")
      ->capture_default_str();
  cmd->add_option("--keep-best", flags->keep_best,
                  "Also keep the checkpoint with the highest value of this metric (none: keep only the last ones)")
      ->capture_default_str();
  cmd->add_flag("--profile", flags->profile,
                "Split the steps' time into GEMM, other kernels, exposed communication (--ranks) and host work, "
                "printed at the end (\"step_time\" in the --json summary). On the CPU; with --device cuda the "
                "kernels' share is the time to enqueue them and to wait for the device");
  cmd->add_flag("--json", flags->json, "Print JSON lines; the last is {\"event\":\"summary\",...}");
  cmd->callback([flags, &exit_code] {
    try {
      exit_code = run_train(*flags);
    } catch (const std::bad_alloc&) {
      exit_code = fail(*flags, unavailable("out of memory: try a smaller --batch-size or --eval-batch-size"));
    }
  });
}

}  // namespace fedmesh::cli
