#include "cli/train_command.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <iostream>
#include <memory>
#include <new>
#include <string>

#include "cli/data_flags.h"
#include "cli/model_command.h"
#include "cli/output.h"
#include "kernels/cuda_ops.h"
#include "kernels/device_ops.h"
#include "kernels/parallel.h"
#include "kernels/step_profile.h"
#include "train/data/tokenized_text.h"
#include "train/model.h"
#include "train/training_run.h"
#include "privacy/dp_settings.h"
#include "privacy/ledger.h"
#include "privacy/rdp_accountant.h"

namespace fedmesh::cli {

namespace {

struct TrainFlags {
  train::TrainingRunOptions run;
  int64_t log_every = 50;
  bool json = false;
  bool profile = false;  // --profile: the step-time breakdown (kernels/step_profile.h)
};

// The process's peak resident set so far, in MB (getrusage: kB on Linux).
double peak_rss_mb() {
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return -1.0;
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// Exit codes: 2 for input the user must fix, 1 for a failure while training.
int fail(const TrainFlags& flags, const Status& status, int exit_code = 2) {
  return report_failure("train", flags.json, status, exit_code);
}

// The held-out loss (nats per token) as DESIGN.md names it for language
// models, with its perplexity and bits per byte, and the unigram baseline's
// bits per byte. Bits per byte are the nats of all held-out targets over
// ln 2 and the bytes those targets stand for (train::data::bits_per_byte: 1 token
// per byte with the byte tokenizer; fewer with BPE). The unigram
// baseline is always the byte unigram's (nats per byte), so that runs with
// and without a tokenizer compare.
// Pre-tokenized ids (tokens:FILE.bin) stand for bytes nobody told us of:
// loss and perplexity only.
nlohmann::json language_metrics(double loss, const train::TrainingData& data) {
  if (data.pretokenized) return {{"val_loss", loss}, {"val_perplexity", std::exp(loss)}};
  return {{"val_loss", loss}, {"val_perplexity", std::exp(loss)},
          {"val_bits_per_byte", train::data::bits_per_byte(loss, data.tokens_per_byte)},
          {"unigram_bits_per_byte", data.unigram_loss / std::log(2.0)}};
}

// Regression: R² (unit-free) and MAE / RMSE in the target's own units.
nlohmann::json regression_metrics(const train::EvalResult& test) {
  return {{"test_r2", test.r2}, {"test_mae", test.mae}, {"test_rmse", test.rmse}};
}

constexpr const char* kSeededNoiseNote =
    "DP-SGD noise seeded for replay (--dp-seeded-noise): not a privacy guarantee; epsilon is what the mechanism "
    "would spend with secret noise";

// DP-SGD: the accountant, and a target budget caps the steps up front, so
// that no step is taken whose epsilon would exceed it. Sampling rate q =
// examples per step / training examples (shuffled fixed-size batches,
// analysed as Poisson sampling at that rate, as Opacus and TensorFlow
// Privacy tutorials do). Nullopt for a run without DP-SGD.
Result<std::optional<privacy::ConstantRateAccounting>> dp_accounting(train::TrainingRun& run) {
  train::TrainingRunOptions& o = run.options();
  if (o.options.dp_clip_norm <= 0.0f) return std::optional<privacy::ConstantRateAccounting>();
  privacy::ConstantRateAccounting accounting;
  accounting.q = std::min(1.0, static_cast<double>(o.options.batch_size * o.options.grad_accumulation) /
                                   static_cast<double>(std::max<int64_t>(1, run.data().train->size())));
  accounting.sigma = o.options.dp_noise_multiplier;
  accounting.delta = o.dp_delta;
  const int64_t requested = run.total_steps();
  if (o.dp_target_epsilon > 0.0) {
    const int64_t allowed = accounting.steps_within(o.dp_target_epsilon, requested);
    if (allowed == 0) {
      return invalid_argument("--dp-target-epsilon " + std::to_string(o.dp_target_epsilon) +
                              " allows no step at this noise and sampling rate: raise --dp-noise");
    }
    if (allowed < requested) {
      std::fprintf(stderr, "fedmesh train: the privacy budget (epsilon %g at delta %g) allows %lld of the %lld steps; "
                   "training stops there\n", o.dp_target_epsilon, o.dp_delta, static_cast<long long>(allowed),
                   static_cast<long long>(requested));
      o.options.max_steps = allowed;
    }
  }
  return std::optional<privacy::ConstantRateAccounting>(accounting);
}

// The attention a language model's heads take: "cpu" (the CPU kernel), or
// on the GPU "flash" (the fused kernels) or "gemm" (batched GEMMs around the
// softmax rows); empty for the other models.
std::string attention_path_of(const TrainFlags& flags, train::TrainingRun& run) {
  const std::optional<train::TransformerConfig> c = train::language_model_config(flags.run.model);
  if (!c) return "";
  if (flags.run.device != "cuda") return "cpu";
  const AttentionShape shape{flags.run.options.batch_size, c->context, c->heads, c->width / c->heads};
  return device::attention_path_name(device::attention_path(shape, run.model().compute_dtype()));
}

void print_start(const TrainFlags& flags, train::TrainingRun& run) {
  const train::TrainingRunOptions& o = flags.run;
  const train::TrainingData& data = run.data();
  const std::string attention = attention_path_of(flags, run);
  if (flags.json) {
    nlohmann::json start = {{"event", "start"},
                            {"command", "train"},
                            {"model", o.model},
                            {"parameters", run.model().parameter_count()},
                            {"trainable_parameters", run.model().trainable_count()},
                            {"precision", o.precision},
                            {"device", o.device},
                            {"threads", cpu_threads()},
                            {"ranks", o.group.ranks},
                            {"tensor_parallel", o.group.tensor_parallel},
                            {"optimizer", o.options.optimizer},
                            {"lr", o.options.lr},
                            {"schedule", o.options.schedule.to_string()},
                            {"batch_size", o.options.batch_size},
                            {"grad_accumulation", o.options.grad_accumulation},
                            {"train_samples", data.train->size()},
                            {"test_samples", data.test->size()},
                            {"seed", o.options.seed}};
    if (!attention.empty()) start["attention"] = attention;
    if (o.init.lora.enabled()) {
      start["lora"] = o.init.lora.to_json();
      start["lora_adapters"] = run.model().adapters().size();
    }
    if (!o.init.path.empty()) {
      const train::InitReport& init = run.init_report();
      start["init"] = o.init.path;
      start["init_loaded"] = init.loaded;
      if (o.init.partial) {
        start["init_seeded"] = init.seeded;
        start["init_ignored"] = init.ignored;
      }
    }
    start["data"] = data.description;
    if (!data.schema.canonical.empty()) {
      start["data_schema"] = data.schema.fingerprint();
      start["classes"] = data.schema.classes;
      start["sample_shape"] = data.schema.sample_shape;
    }
    emit_json(start);
    if (data.tokenizer) {
      emit_json({{"event", "tokenizer"},
                 {"tokenizer", data.tokenizer->fingerprint()},
                 {"vocab_size", data.vocabulary},
                 {"held_out_bytes_per_token", 1.0 / data.tokens_per_byte}});
    }
    return;
  }
  std::fprintf(stderr, "%s", run.model().summary().c_str());
  std::fprintf(stderr, "training %s on %s, %s, %s, %d threads, batch %lld, %s lr %g\n", o.model.c_str(),
               data.description.c_str(), o.device.c_str(), o.precision.c_str(), cpu_threads(),
               static_cast<long long>(o.options.batch_size), o.options.optimizer.c_str(),
               static_cast<double>(o.options.lr));
  if (!attention.empty()) std::fprintf(stderr, "attention: %s\n", attention.c_str());
  if (!o.init.path.empty()) {
    const train::InitReport& init = run.init_report();
    const auto names = [](const std::vector<std::string>& list) {
      std::string text;
      for (const std::string& n : list) text += (text.empty() ? "" : ", ") + n;
      return text.empty() ? std::string("none") : text;
    };
    std::fprintf(stderr, "weights: %lld parameters from %s", static_cast<long long>(init.loaded), o.init.path.c_str());
    if (o.init.partial) {
      std::fprintf(stderr, "; kept as seeded: %s; ignored in the file: %s", names(init.seeded).c_str(),
                   names(init.ignored).c_str());
    }
    std::fprintf(stderr, "\n");
  }
  if (data.tokenizer) {
    std::fprintf(stderr, "held-out text: a byte unigram model (no context) reaches %.3f bits/byte; a unigram of "
                 "these tokens %.4f nats/token, %.3f bits/byte\n", data.unigram_loss / std::log(2.0),
                 data.token_unigram_loss, train::data::bits_per_byte(data.token_unigram_loss, data.tokens_per_byte));
  } else if (data.language && !data.pretokenized) {
    std::fprintf(stderr, "held-out text: a unigram model (no context) reaches %.4f nats/token, %.3f bits/byte\n",
                 data.unigram_loss, data.unigram_loss / std::log(2.0));
  }
  if (o.group.tensor_parallel > 1) {
    std::fprintf(stderr, "tensor parallel over %d %s: each holds 1/%d of every block's heads and MLP "
                 "features%s\n", o.group.tensor_parallel, o.device == "cuda" ? "GPU ranks (NCCL)" : "CPU ranks (Gloo)",
                 o.group.tensor_parallel,
                 o.group.ranks > 1 ? (", times " + std::to_string(o.group.ranks) + " data-parallel groups").c_str() : "");
  } else if (run.ranks() > 1) {
    std::fprintf(stderr, "data parallel over %d CPU ranks (Gloo, %zu gradient buckets%s): each takes 1/%d of every batch\n",
                 run.ranks(), run.gradient_buckets(), o.zero_one ? ", optimizer state sharded (ZeRO-1)" : "",
                 run.ranks());
  }
}

// The resumed run's position, and for a run already complete, its result.
void print_resumed(const TrainFlags& flags, const train::TrainingRun& run) {
  const train::ResumePoint& at = *run.resumed();
  const std::string& db = flags.run.db;
  if (flags.json) {
    emit_json({{"event", "resume"},
               {"db", db},
               {"step", at.step},
               {"total_steps", run.total_steps()},
               {"epoch", at.epoch},
               {"committed_at", at.committed_at},
               {"corrupt_checkpoints_skipped", at.corrupt_checkpoints_skipped}});
  }
  std::fprintf(stderr, "fedmesh train: resuming from %s: step %lld of %lld (epoch %lld), committed %s\n", db.c_str(),
               static_cast<long long>(at.step), static_cast<long long>(run.total_steps()),
               static_cast<long long>(at.epoch), at.committed_at.c_str());
  if (!run.complete()) return;
  std::fprintf(stderr, "fedmesh train: the run in %s is already complete; nothing to train\n", db.c_str());
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "train"},
               {"model", flags.run.model},
               {"precision", flags.run.precision},
               {"test_accuracy", at.metrics.value("test_accuracy", 0.0)},
               {"test_loss", at.metrics.value("test_loss", 0.0)},
               {"test_r2", at.metrics.value("test_r2", 0.0)},
               {"test_mae", at.metrics.value("test_mae", 0.0)},
               {"train_loss", at.metrics.value("train_loss", 0.0)},
               {"steps", at.step},
               {"resumed_from_step", at.step},
               {"already_complete", true},
               {"rounds", 0},
               {"bytes_sent", 0},
               {"bytes_received", 0},
               {"wall_seconds", 0.0}});
  } else {
    if (at.metrics.contains("test_r2")) {
      std::printf("%s %s: test R² %.4f, MAE %.4g (run already complete at step %lld)\n", flags.run.model.c_str(),
                  flags.run.precision.c_str(), at.metrics.value("test_r2", 0.0), at.metrics.value("test_mae", 0.0),
                  static_cast<long long>(at.step));
      return;
    }
    std::printf("%s %s: test accuracy %.2f%% (run already complete at step %lld)\n", flags.run.model.c_str(),
                flags.run.precision.c_str(), 100.0 * at.metrics.value("test_accuracy", 0.0),
                static_cast<long long>(at.step));
  }
}

// Progress lines (or JSON step and epoch events) and checkpoint events.
train::TrainingRunEvents progress_events(const TrainFlags& flags, const train::TrainingData& data, ProgressLine& line) {
  train::TrainingRunEvents events;
  events.on_checkpoint = [&flags](int64_t step) {
    if (flags.json) emit_json({{"event", "checkpoint"}, {"step", step}, {"db", flags.run.db}});
  };
  events.progress.on_step = [&flags, &line](const train::StepProgress& p) {
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
  events.progress.on_epoch = [&flags, &data, &line](const train::EpochReport& r) {
    if (flags.json) {
      nlohmann::json event = {{"event", "epoch"},
                              {"epoch", r.epoch},
                              {"train_loss", r.train_loss},
                              {"train_accuracy", r.train_accuracy},
                              {"test_loss", r.test.loss},
                              {"test_accuracy", r.test.accuracy},
                              {"seconds", r.seconds}};
      if (data.language) event.update(language_metrics(r.test.loss, data));
      if (r.test.regression) event.update(regression_metrics(r.test));
      emit_json(event);
      return;
    }
    line.finish();
    if (data.language) {
      std::fprintf(stderr, "epoch %lld: train loss %.4f, held-out loss %.4f (perplexity %.3f, %.3f bits/byte; unigram "
                   "%.3f), next-%s accuracy %.2f%% (%s)\n", static_cast<long long>(r.epoch), r.train_loss,
                   r.test.loss, std::exp(r.test.loss), train::data::bits_per_byte(r.test.loss, data.tokens_per_byte),
                   data.unigram_loss / std::log(2.0), data.tokenizer ? "token" : "byte",
                   100.0 * r.test.accuracy, format_duration(r.seconds).c_str());
      return;
    }
    if (r.test.regression) {
      std::fprintf(stderr, "epoch %lld: train loss %.4f, test loss %.4f, test R² %.4f, MAE %.4g, RMSE %.4g (%s)\n",
                   static_cast<long long>(r.epoch), r.train_loss, r.test.loss, r.test.r2, r.test.mae, r.test.rmse,
                   format_duration(r.seconds).c_str());
      return;
    }
    std::fprintf(stderr, "epoch %lld: train loss %.4f, train accuracy %.2f%%, test loss %.4f, test accuracy %.2f%% (%s)\n",
                 static_cast<long long>(r.epoch), r.train_loss, 100.0 * r.train_accuracy, r.test.loss,
                 100.0 * r.test.accuracy, format_duration(r.seconds).c_str());
  };
  return events;
}

void print_summary(const TrainFlags& flags, const train::TrainingRun& run, const train::TrainSummary& summary,
                   const std::optional<privacy::ConstantRateAccounting>& accounting, double wall_seconds) {
  const train::TrainingRunOptions& o = flags.run;
  const train::TrainingData& data = run.data();
  const int64_t resumed_step = run.resumed() ? run.resumed()->step : 0;
  // --profile: the steps' time split into GEMM, other kernels, exposed
  // communication and the host's own work (the rest of the steps' time).
  const StepTimes times = step_profile_totals();
  disable_step_profile();
  const double host_seconds =
      std::max(0.0, summary.train_seconds - times.gemm_seconds - times.kernel_seconds - times.communication_seconds -
                        times.data_seconds - times.device_wait_seconds);
  if (flags.json) {
    nlohmann::json event = {{"event", "summary"},
               {"command", "train"},
               {"model", o.model},
               {"precision", o.precision},
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
               {"checkpoints_committed", run.checkpoints_committed()},
               {"rounds", 0},
               {"bytes_sent", 0},
               {"bytes_received", 0},
               {"wall_seconds", wall_seconds},
               {"peak_rss_mb", peak_rss_mb()}};
    if (flags.profile) {
      event["step_time"] = {{"gemm_seconds", times.gemm_seconds},
                            {"kernel_seconds", times.kernel_seconds},
                            {"communication_seconds", times.communication_seconds},
                            {"data_seconds", times.data_seconds},
                            {"device_wait_seconds", times.device_wait_seconds},
                            {"load_seconds", data.load_seconds},
                            {"host_seconds", host_seconds},
                            {"train_seconds", summary.train_seconds}};
    }
    if (accounting) {
      const privacy::PrivacySpent spent = accounting->after(summary.steps);
      event["epsilon"] = spent.epsilon;
      event["delta"] = accounting->delta;
      event["dp_noise_multiplier"] = accounting->sigma;
      event["dp_sampling_rate"] = accounting->q;
      // Seeded noise replays and protects nothing: the summary says so.
      event["dp_noise"] = o.options.dp_seeded_noise ? "seeded" : "csprng";
      if (o.options.dp_seeded_noise) event["dp_noise_note"] = kSeededNoiseNote;
    }
    if (summary.test.regression) event.update(regression_metrics(summary.test));
    if (data.language) {
      event.update(language_metrics(summary.test.loss, data));
      event["tokens_per_second"] = summary.samples_per_second * static_cast<double>(data.train->targets_per_sample());
    }
    if (data.tokenizer) {
      event["tokenizer"] = data.tokenizer->fingerprint();
      event["vocab_size"] = data.vocabulary;
      event["held_out_bytes_per_token"] = 1.0 / data.tokens_per_byte;
      event["token_unigram_bits_per_byte"] = train::data::bits_per_byte(data.token_unigram_loss, data.tokens_per_byte);
    }
    emit_json(event);
  } else if (data.language) {
    std::printf("%s %s: held-out loss %.4f (perplexity %.3f, %.3f bits/byte; a unigram model %.3f) after %lld steps, "
                "%.0f tokens/s, %s\n", o.model.c_str(), o.precision.c_str(), summary.test.loss,
                std::exp(summary.test.loss), train::data::bits_per_byte(summary.test.loss, data.tokens_per_byte),
                data.unigram_loss / std::log(2.0),
                static_cast<long long>(summary.steps),
                summary.samples_per_second * static_cast<double>(data.train->targets_per_sample()),
                format_duration(wall_seconds).c_str());
  } else {
    if (summary.test.regression) {
      std::printf("%s %s: test R² %.4f, MAE %.4g, RMSE %.4g (test loss %.4f) after %lld steps (%lld skipped), "
                  "%.0f samples/s, %s\n", o.model.c_str(), o.precision.c_str(), summary.test.r2, summary.test.mae,
                  summary.test.rmse, summary.test.loss, static_cast<long long>(summary.steps),
                  static_cast<long long>(summary.skipped_steps), summary.samples_per_second,
                  format_duration(wall_seconds).c_str());
    } else {
      std::printf("%s %s: test accuracy %.2f%%, test loss %.4f after %lld steps (%lld skipped), %.0f samples/s, %s\n",
                  o.model.c_str(), o.precision.c_str(), 100.0 * summary.test.accuracy, summary.test.loss,
                  static_cast<long long>(summary.steps), static_cast<long long>(summary.skipped_steps),
                  summary.samples_per_second, format_duration(wall_seconds).c_str());
    }
    if (!o.db.empty()) {
      std::printf("%lld checkpoints committed to %s (newest: step %lld)%s\n",
                  static_cast<long long>(run.checkpoints_committed()), o.db.c_str(),
                  static_cast<long long>(summary.steps),
                  resumed_step > 0 ? (", resumed from step " + std::to_string(resumed_step)).c_str() : "");
    }
  }
  if (flags.profile && !flags.json && summary.train_seconds > 0.0) {
    const auto share = [&](double seconds) { return 100.0 * seconds / summary.train_seconds; };
    std::printf("step time %s: GEMM %.1f%%, other kernels %.1f%%, communication %.1f%%, batches %.1f%%, host %.1f%%",
                format_duration(summary.train_seconds).c_str(), share(times.gemm_seconds), share(times.kernel_seconds),
                share(times.communication_seconds), share(times.data_seconds), share(host_seconds));
    // On a device, GEMM and kernels are the time to enqueue them; waiting for the device is apart.
    if (times.device_wait_seconds > 0.0) std::printf(", waiting for the device %.1f%%", share(times.device_wait_seconds));
    std::printf("\n");
    std::printf("data loaded (read, decoded, split) in %s before training\n", format_duration(data.load_seconds).c_str());
  }
  if (accounting && !flags.json) {
    std::printf("differential privacy (DP-SGD, clip %g, noise %g, q %.4g): (epsilon %.4f, delta %g) spent over %lld steps\n",
                static_cast<double>(o.options.dp_clip_norm), accounting->sigma, accounting->q,
                accounting->after(summary.steps).epsilon, accounting->delta, static_cast<long long>(summary.steps));
    if (o.options.dp_seeded_noise) std::printf("%s\n", kSeededNoiseNote);
  }
}

int run_train(TrainFlags& flags) {
  const auto wall_start = std::chrono::steady_clock::now();
  if (flags.run.device == "cuda" && flags.run.group.launched()) {
    // A GPU rank takes its own device before anything makes a CUDA context.
    if (Result<int> index = cuda::use_device_for_rank(flags.run.group.rank); !index.is_ok()) {
      return fail(flags, index.status(), 1);
    }
  }
  const train::TrainOptions& o = flags.run.options;
  if (Status s = privacy::check_dp_settings({o.dp_clip_norm, o.dp_noise_multiplier, flags.run.dp_delta,
                                             flags.run.dp_target_epsilon}, privacy::kDpFlags);
      !s.is_ok()) {
    return fail(flags, s);
  }
  if (flags.log_every < 1) return fail(flags, invalid_argument("--log-every must be at least 1"));
  if (o.dp_seeded_noise && o.dp_noise_multiplier <= 0.0f) {
    return fail(flags, invalid_argument("--dp-seeded-noise needs --dp-noise (it seeds the DP-SGD noise)"));
  }
  if (o.dp_seeded_noise) std::fprintf(stderr, "fedmesh train: %s\n", kSeededNoiseNote);
  Result<std::unique_ptr<train::TrainingRun>> created = train::TrainingRun::create(flags.run);
  if (!created.is_ok()) return fail(flags, created.status());
  train::TrainingRun& run = **created;
  if (run.options().group.launched()) {
    const Status ranked = run.run_as_rank();
    return ranked.is_ok() ? 0 : fail(flags, ranked, 1);
  }
  Result<std::optional<privacy::ConstantRateAccounting>> accounting = dp_accounting(run);
  if (!accounting.is_ok()) return fail(flags, accounting.status());
  flags.run = run.options();  // as the run completed them (precision, schedule, a budget's steps)
  train::PrivacyEntryAt privacy;
  if (*accounting) {
    const std::string mechanism = flags.run.options.dp_seeded_noise ? "dp-sgd-seeded" : "dp-sgd";
    privacy = [spent = **accounting, mechanism](int64_t step) { return privacy::ledger_entry(spent, mechanism, 0, step); };
  }
  const auto warn = [](const std::string& warning) { std::fprintf(stderr, "fedmesh train: %s\n", warning.c_str()); };
  if (Status s = run.open(std::move(privacy), warn); !s.is_ok()) return fail(flags, s);
  if (run.resumed()) {
    print_resumed(flags, run);
    if (run.complete()) return 0;
  }
  // Ranks 1..N-1 start now that the flags, the data and the store are known good.
  if (Status s = run.launch_ranks(); !s.is_ok()) return fail(flags, s, 1);
  print_start(flags, run);

  ProgressLine line;
  const train::TrainingRunEvents events = progress_events(flags, run.data(), line);
  if (flags.profile) enable_step_profile();
  Result<train::TrainSummary> summary = run.fit(events);
  line.finish();
  if (!summary.is_ok()) return fail(flags, summary.status(), 1);
  const double wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  print_summary(flags, run, *summary, *accounting, wall_seconds);
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<TrainFlags>();
  train::TrainOptions& o = flags->run.options;
  CLI::App* cmd = app.add_subcommand(
      "train", "Train a model locally on this machine's data (no federation) and report test accuracy.");
  cmd->add_option("--model", flags->run.model,
                  "Model to train: mlp (flatten-512-256-classes) or cnn (2 conv + 2 fc) on images or tables, sized "
                  "by the data (Fashion-MNIST: 784 inputs, 10 classes); or a GPT-style "
                  "language model on text with the byte tokenizer (or --tokenizer FILE): gpt-nano (0.1M parameters), gpt-tiny (1.8M), "
                  "gpt-small (10.8M), gpt2 (124M); or a model spec file FILE.toml (layers, or a GPT: docs/models.md)")
      ->check(model_name_check())
      ->capture_default_str();
  cmd->add_option("--data", flags->run.data.source,
                  "Your own data: csv:FILE (a table with a header row; --label names the label column), images:DIR "
                  "(one folder of PNG/JPEG images per class) or arrays:FILE (x and y in a .npz, .npy or safetensors "
                  "file); mlp and cnn take its shape and classes (docs/data.md); tokens:FILE.bin for the language "
                  "models. "
                  "Demo sets: fashion-mnist (package dataset-fashion-mnist) or a directory of IDX files. Language "
                  "models: bible-kjv (the default; Debian's bible-kjv, one document per book) or a directory of "
                  "plain-text files (one document each); 5% of every document is held out. --train-limit/--test-limit "
                  "count windows")
      ->capture_default_str();
  add_own_data_flags(cmd, flags->run.data);
  cmd->add_option("--tokenizer", flags->run.tokenizer,
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
  cmd->add_option("--schedule", flags->run.schedule,
                  "Learning-rate schedule: cosine (decays to 0 over the run), cosine:WARMUP (linear warm-up steps first), constant, step:EVERY:GAMMA")
      ->capture_default_str();
  cmd->add_option("--clip-grad-norm", o.clip_grad_norm, "Clip the global gradient norm to this (0 = off)")
      ->capture_default_str();
  cmd->add_option("--precision", flags->run.precision,
                  "fp32, or bf16/fp16 compute copies of fp32 master weights (fp16 uses dynamic loss scaling)")
      ->capture_default_str();
  cmd->add_option("--loss-scale", o.loss_scaling.initial_scale, "Initial loss scale for fp16")->capture_default_str();
  cmd->add_option("--device", flags->run.device,
                  "cpu, or cuda: the model, its activations, gradients and optimizer state on the GPU (with --ranks N: "
                  "one rank per GPU, NCCL; no --dp-clip or --zero-1); checkpoints are the same either way")
      ->capture_default_str();
  cmd->add_option("--ranks", flags->run.group.ranks,
                  "Data-parallel CPU ranks: processes launched by this one, each training on 1/N of every batch, "
                  "gradients all-reduced with Gloo (the run equals one process on the whole batches)")
      ->capture_default_str();
  cmd->add_option("--tensor-parallel", flags->run.group.tensor_parallel,
                  "GPTs: split every transformer block over N ranks (Megatron-style: attention heads and MLP "
                  "features; Gloo on CPU ranks, NCCL with --device cuda, one GPU per rank). With --ranks M: N x M "
                  "processes, M data-parallel groups of N. Checkpoints, evaluation and exports hold the whole model")
      ->capture_default_str();
  cmd->add_option("--dp-clip", o.dp_clip_norm,
                  "Differential privacy (DP-SGD): clip every example's gradient to this L2 norm (0 = off)")
      ->capture_default_str();
  cmd->add_option("--dp-noise", o.dp_noise_multiplier,
                  "DP-SGD noise multiplier sigma: N(0, (sigma * clip)^2) added to each step's summed gradient")
      ->capture_default_str();
  cmd->add_option("--dp-delta", flags->run.dp_delta, "The delta the RDP accountant reports epsilon at")->capture_default_str();
  cmd->add_flag("--dp-seeded-noise", o.dp_seeded_noise,
                "Draw the DP-SGD noise from --seed so that a run (and a resumed one) replays exactly, for simulations "
                "and tests: NOT PRIVATE (whoever knows the seed can remove the noise). Without it the noise comes from "
                "the OS CSPRNG");
  cmd->add_option("--dp-target-epsilon", flags->run.dp_target_epsilon,
                  "Stop before the step that would spend more than this epsilon (0 = no target)")
      ->capture_default_str();
  cmd->add_flag("--zero-1", flags->run.zero_one,
                "With --ranks: shard the optimizer state across the ranks (ZeRO stage 1: each holds 1/N of the "
                "moments and steps 1/N of the weights; the same weights as without it)");
  cmd->add_option("--rank", flags->run.group.rank)->group("");  // set by rank 0 for the ranks it launches
  cmd->add_option("--rendezvous", flags->run.group.rendezvous)->group("");
  cmd->add_option("--threads", flags->run.threads, "CPU threads for kernels and OpenBLAS (0 = all cores)")
      ->capture_default_str();
  cmd->add_option("--train-limit", flags->run.train_limit, "Use only the first N training images (0 = all)")
      ->capture_default_str();
  cmd->add_option("--test-limit", flags->run.test_limit, "Evaluate on only the first N test images (0 = all)")
      ->capture_default_str();
  cmd->add_option("--eval-batch-size", o.eval_batch_size, "Batch size for evaluation")->capture_default_str();
  cmd->add_option("--log-every", flags->log_every, "Steps between progress reports (JSON and logs)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed for initialization and shuffling (runs replay exactly)")
      ->capture_default_str();
  cmd->add_option("--init", flags->run.init.path,
                  "Start from these weights instead of the seeded initialization: a safetensors, .npz or .npy file "
                  "with one f4/f8 array per parameter under fedmesh's names (what `fedmesh checkpoint export` "
                  "writes; bench/torch_gpt.py --write-init for PyTorch's). Every parameter must be there with its "
                  "shape, nothing else; a run resumed from --db takes the checkpoint's weights instead");
  cmd->add_option("--init-format", flags->run.init.format,
                  "Names and layout of --init: fedmesh, or hf-gpt2 (a GPT-2 state dict as Hugging Face saves it: "
                  "h.N.* names, Conv1D weights stored (in, out), attention-mask buffers and the tied lm_head "
                  "dropped) for the gpt models")
      ->check(CLI::IsMember({"fedmesh", "hf-gpt2"}))
      ->capture_default_str();
  cmd->add_flag("--init-partial", flags->run.init.partial,
                "With --init: take the parameters the file has with the model's shapes, keep the others as seeded "
                "and ignore the file's other arrays (a new head on a pretrained trunk); both lists are printed. "
                "Without it any difference is refused");
  cmd->add_option("--lora-rank", flags->run.init.lora.rank,
                  "Fine-tune by LoRA: freeze every weight and train rank-R adapters W0 + (alpha/R)·B·A of the weights "
                  "--lora-targets names, A drawn from --seed and frozen, only B trained (what a federation sends and "
                  "averages exactly; docs/models.md). 0: off, every parameter trains")
      ->capture_default_str();
  cmd->add_option("--lora-alpha", flags->run.init.lora.alpha,
                  "LoRA's alpha: the adapters' update is scaled by alpha / rank (0: 2 x rank)")
      ->capture_default_str();
  cmd->add_option("--lora-targets", flags->run.init.lora.targets,
                  "Globs over parameter names of the weights to adapt, e.g. 'h*.attn.c_attn.weight' 'h*.mlp.*.weight' "
                  "(`fedmesh model show` lists the names); none: every weight of 2 or more dimensions")
      ->expected(1, -1);
  cmd->add_option("--db", flags->run.db,
                  "SQLite checkpoint database: commits every --checkpoint-every steps and at the end; when it already "
                  "holds a checkpoint of this run, training resumes from the newest intact one");
  cmd->add_option("--checkpoint-every", flags->run.checkpoint_every, "Optimizer steps between checkpoints (with --db)")
      ->capture_default_str();
  cmd->add_flag("--resume", flags->run.resume,
                "Require a checkpoint in --db to resume from (without it, an empty --db starts a new run)");
  cmd->add_option("--keep-last", flags->run.keep_last, "Checkpoints kept besides the best one (with --db)")
      ->capture_default_str();
  cmd->add_option("--keep-best", flags->run.keep_best,
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
