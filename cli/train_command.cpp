#include "cli/train_command.h"

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <new>
#include <string>

#include "cli/output.h"
#include "kernels/parallel.h"
#include "node/data/fashion_mnist.h"
#include "node/model.h"
#include "node/trainer.h"

namespace fedmesh::cli {

namespace {

constexpr int kMaxThreads = 1024;

struct TrainFlags {
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  std::string precision = "fp32";
  std::string device = "cpu";
  std::string schedule = "cosine";
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  int threads = 0;
  int64_t log_every = 50;
  bool json = false;
  node::TrainOptions options;
};

std::string data_directory(const std::string& data) {
  return data == "fashion-mnist" ? std::string(data::kDefaultFashionMnistDir) : data;
}

int fail(const TrainFlags& flags, const Status& status) {
  if (flags.json) {
    emit_json({{"event", "error"}, {"code", status_code_name(status.code())}, {"message", status.message()}});
  }
  std::fprintf(stderr, "fedmesh train: %s\n", status.message().c_str());
  return 2;
}

int run_train(TrainFlags& flags) {
  const auto wall_start = std::chrono::steady_clock::now();
  if (flags.device != "cpu") {
    return fail(flags, unavailable("--device " + flags.device +
                                   ": this build trains on the CPU only for now; use --device cpu "
                                   "(`fedmesh doctor` lists the GPUs this build can see)"));
  }
  Result<DType> precision = parse_dtype(flags.precision);
  if (!precision.is_ok()) return fail(flags, precision.status());
  flags.options.precision = *precision;
  Result<LrSchedule> schedule = LrSchedule::parse(flags.schedule);
  if (!schedule.is_ok()) return fail(flags, schedule.status());
  flags.options.schedule = *schedule;
  if (Status s = flags.options.validate(); !s.is_ok()) return fail(flags, s);
  if (flags.train_limit < 0 || flags.test_limit < 0) return fail(flags, invalid_argument("limits must be >= 0"));
  if (flags.log_every < 1) return fail(flags, invalid_argument("--log-every must be at least 1"));
  if (flags.threads < 0 || flags.threads > kMaxThreads)
    return fail(flags, invalid_argument("--threads must be in [0, " + std::to_string(kMaxThreads) + "] (0 = all cores)"));
  set_cpu_threads(flags.threads);

  const std::string directory = data_directory(flags.data);
  Result<data::ImageDataset> train = data::load_fashion_mnist(directory, data::Split::kTrain);
  if (!train.is_ok()) return fail(flags, train.status());
  Result<data::ImageDataset> test = data::load_fashion_mnist(directory, data::Split::kTest);
  if (!test.is_ok()) return fail(flags, test.status());
  if (flags.train_limit > 0) *train = train->head(flags.train_limit);
  if (flags.test_limit > 0) *test = test->head(flags.test_limit);

  Result<std::unique_ptr<node::Sequential>> model = node::make_model(flags.model, flags.options.seed);
  if (!model.is_ok()) return fail(flags, model.status());
  node::Sequential& net = **model;
  node::Trainer trainer(net, flags.options);

  if (flags.json) {
    emit_json({{"event", "start"},
               {"command", "train"},
               {"model", flags.model},
               {"parameters", net.parameter_count()},
               {"precision", flags.precision},
               {"device", flags.device},
               {"threads", cpu_threads()},
               {"optimizer", flags.options.optimizer},
               {"lr", flags.options.lr},
               {"schedule", flags.options.schedule.to_string()},
               {"batch_size", flags.options.batch_size},
               {"grad_accumulation", flags.options.grad_accumulation},
               {"train_samples", train->count},
               {"test_samples", test->count},
               {"seed", flags.options.seed}});
  } else {
    std::fprintf(stderr, "%s", net.summary().c_str());
    std::fprintf(stderr, "training %s on %lld Fashion-MNIST images (%lld test), %s, %d threads, batch %lld, %s lr %g\n",
                 flags.model.c_str(), static_cast<long long>(train->count), static_cast<long long>(test->count),
                 flags.precision.c_str(), cpu_threads(), static_cast<long long>(flags.options.batch_size),
                 flags.options.optimizer.c_str(), static_cast<double>(flags.options.lr));
  }

  ProgressLine line;
  node::TrainCallbacks callbacks;
  callbacks.on_step = [&](const node::StepProgress& p) {
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
  callbacks.on_epoch = [&](const node::EpochReport& r) {
    if (flags.json) {
      emit_json({{"event", "epoch"},
                 {"epoch", r.epoch},
                 {"train_loss", r.train_loss},
                 {"train_accuracy", r.train_accuracy},
                 {"test_loss", r.test.loss},
                 {"test_accuracy", r.test.accuracy},
                 {"seconds", r.seconds}});
      return;
    }
    line.finish();
    std::fprintf(stderr, "epoch %lld: train loss %.4f, train accuracy %.2f%%, test loss %.4f, test accuracy %.2f%% (%s)\n",
                 static_cast<long long>(r.epoch), r.train_loss, 100.0 * r.train_accuracy, r.test.loss,
                 100.0 * r.test.accuracy, format_duration(r.seconds).c_str());
  };

  const node::TrainSummary summary = trainer.fit(*train, &*test, callbacks);
  line.finish();
  const double wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  if (flags.json) {
    emit_json({{"event", "summary"},
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
               {"rounds", 0},
               {"bytes_sent", 0},
               {"bytes_received", 0},
               {"wall_seconds", wall_seconds}});
  } else {
    std::printf("%s %s: test accuracy %.2f%%, test loss %.4f after %lld steps (%lld skipped), %.0f samples/s, %s\n",
                flags.model.c_str(), flags.precision.c_str(), 100.0 * summary.test.accuracy, summary.test.loss,
                static_cast<long long>(summary.steps), static_cast<long long>(summary.skipped_steps),
                summary.samples_per_second, format_duration(wall_seconds).c_str());
  }
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<TrainFlags>();
  node::TrainOptions& o = flags->options;
  CLI::App* cmd = app.add_subcommand(
      "train", "Train a model locally on this machine's data (no federation) and report test accuracy.");
  cmd->add_option("--model", flags->model, "Model to train: mlp (784-512-256-10) or cnn (2 conv + 2 fc)")
      ->check(CLI::IsMember({"mlp", "cnn"}))
      ->capture_default_str();
  cmd->add_option("--data", flags->data,
                  "fashion-mnist (from /usr/share/datasets/fashion-mnist, package dataset-fashion-mnist) or a "
                  "directory holding the four Fashion-MNIST IDX files (.gz or plain)")
      ->capture_default_str();
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
  cmd->add_option("--device", flags->device, "cpu or cuda")->capture_default_str();
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
