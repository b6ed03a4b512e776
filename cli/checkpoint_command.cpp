#include "cli/checkpoint_command.h"

#include <algorithm>
#include <array>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "cli/output.h"
#include "crypto/keys.h"
#include "store/checkpoint_store.h"
#include "store/schema.h"
#include "store/tensor_export.h"
#include "train/hf_gpt2.h"
#include "train/lora_export.h"
#include "train/model_spec.h"

namespace fedmesh::cli {

namespace {

// Exit codes: 2 for input the user must fix (a flag, a missing database), 1
// for a database that opens but holds a corrupt checkpoint.
constexpr int kExitBadInput = 2;
constexpr int kExitCorrupt = 1;
constexpr int64_t kLatestRound = -1;

struct CheckpointFlags {
  std::string database;
  int64_t round = kLatestRound;
  std::string format = "safetensors";
  std::string role = "model";
  std::string out;
  bool json = false;
  // checkpoint export --merge-lora: the adapters merged into the frozen weights.
  bool merge_lora = false;
  std::string init, init_format;
  // checkpoint quarantine: at most one action.
  std::optional<int64_t> release_round, drop_round;
  std::optional<std::string> release_update, drop_update;
  bool force = false;
};

int fail(const CheckpointFlags& flags, const std::string& command, const Status& status, int exit_code = kExitBadInput) {
  return report_failure("checkpoint " + command, flags.json, status, exit_code);
}

std::string hex(const crypto::Hash& hash) { return crypto::to_hex(hash); }

nlohmann::json parse_object(const std::string& text) {
  nlohmann::json value = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return value.is_object() ? value : nlohmann::json::object();
}

// The round asked for, or the newest that verifies (saying which it skipped).
Result<int64_t> choose_round(store::CheckpointStore& checkpoints, const CheckpointFlags& flags, const std::string& command) {
  if (flags.round != kLatestRound) {
    Result<store::RoundInfo> info = checkpoints.round_info(flags.round);
    if (!info.is_ok()) return info.status();
    return flags.round;
  }
  std::vector<Status> skipped;
  Result<std::vector<store::RoundInfo>> rounds = checkpoints.rounds();
  if (!rounds.is_ok()) return rounds.status();
  for (auto it = rounds->rbegin(); it != rounds->rend(); ++it) {
    Status s = checkpoints.verify_round(it->round);
    if (s.is_ok()) return it->round;
    if (s.code() != StatusCode::kCorrupt) return s;
    std::fprintf(stderr, "fedmesh checkpoint %s: skipping corrupt checkpoint: %s\n", command.c_str(),
                 s.message().c_str());
  }
  if (rounds->empty()) return not_found(checkpoints.path() + ": no committed checkpoint yet");
  return corrupt(checkpoints.path() + ": every checkpoint kept is corrupt");
}

int run_list(const CheckpointFlags& flags) {
  Result<store::CheckpointStore> checkpoints = store::CheckpointStore::open_existing(flags.database);
  if (!checkpoints.is_ok()) return fail(flags, "list", checkpoints.status());
  Result<std::vector<store::RoundInfo>> rounds = checkpoints->rounds();
  if (!rounds.is_ok()) return fail(flags, "list", rounds.status());
  if (flags.json) {
    for (const store::RoundInfo& round : *rounds) {
      emit_json({{"event", "checkpoint"},
                 {"round", round.round},
                 {"model_version", round.model_version},
                 {"wall_time", round.wall_time},
                 {"tensors", round.tensor_count},
                 {"bytes", round.byte_size},
                 {"metrics", parse_object(round.metrics_json)}});
    }
    emit_json({{"event", "summary"}, {"command", "checkpoint list"}, {"rounds", rounds->size()},
               {"disk_bytes", checkpoints->disk_bytes()}});
    return 0;
  }
  std::printf("%s: %zu checkpoints, %s on disk\n", flags.database.c_str(), rounds->size(),
              format_bytes(checkpoints->disk_bytes()).c_str());
  std::printf("%8s %8s  %-24s %8s %11s  %s\n", "round", "version", "committed (UTC)", "tensors", "size", "metrics");
  for (const store::RoundInfo& round : *rounds) {
    std::printf("%8lld %8lld  %-24s %8lld %11s  %s\n", static_cast<long long>(round.round),
                static_cast<long long>(round.model_version), round.wall_time.c_str(),
                static_cast<long long>(round.tensor_count), format_bytes(round.byte_size).c_str(),
                round.metrics_json.c_str());
  }
  return 0;
}

int run_show(const CheckpointFlags& flags) {
  Result<store::CheckpointStore> checkpoints = store::CheckpointStore::open_existing(flags.database);
  if (!checkpoints.is_ok()) return fail(flags, "show", checkpoints.status());
  Result<int64_t> round = choose_round(*checkpoints, flags, "show");
  if (!round.is_ok()) return fail(flags, "show", round.status());
  Result<store::RoundInfo> info = checkpoints->round_info(*round);
  Result<std::vector<store::TensorInfo>> tensors = checkpoints->tensors(*round);
  if (!info.is_ok()) return fail(flags, "show", info.status());
  if (!tensors.is_ok()) return fail(flags, "show", tensors.status(), kExitCorrupt);
  Result<std::vector<store::PendingUpdate>> pending = checkpoints->pending_updates();
  Result<std::vector<store::PeerRecord>> peers = checkpoints->peers();
  Result<std::map<std::string, uint64_t>> counters = checkpoints->replay_counters();
  if (!pending.is_ok() || !peers.is_ok() || !counters.is_ok()) {
    return fail(flags, "show", !pending.is_ok() ? pending.status() : !peers.is_ok() ? peers.status() : counters.status());
  }
  nlohmann::json tensor_list = nlohmann::json::array();
  for (const store::TensorInfo& tensor : *tensors) {
    tensor_list.push_back({{"role", tensor.role},
                           {"name", tensor.name},
                           {"dtype", dtype_name(tensor.dtype)},
                           {"shape", tensor.shape},
                           {"bytes", tensor.byte_size},
                           {"chunks", tensor.chunk_count},
                           {"checksum", hex(tensor.checksum)},
                           {"checksum_kind", crypto::chunk_hash_name(tensor.checksum_kind)}});
  }
  if (flags.json) {
    nlohmann::json peer_list = nlohmann::json::array();
    for (const store::PeerRecord& peer : *peers) {
      peer_list.push_back({{"site", peer.site}, {"address", peer.address}, {"status", peer.status},
                           {"incarnation", peer.incarnation}});
    }
    emit_json({{"event", "checkpoint"},
               {"round", info->round},
               {"model_version", info->model_version},
               {"wall_time", info->wall_time},
               {"metrics", parse_object(info->metrics_json)},
               {"state", parse_object(info->state_json)},
               {"tensors", tensor_list},
               {"pending_updates", pending->size()},
               {"peers", peer_list},
               {"replay_counters", *counters}});
    return 0;
  }
  std::printf("round %lld (model version %lld), committed %s\n", static_cast<long long>(info->round),
              static_cast<long long>(info->model_version), info->wall_time.c_str());
  std::printf("metrics: %s\nstate: %s\n", info->metrics_json.c_str(), info->state_json.c_str());
  std::printf("%-10s %-32s %-5s %-18s %11s  %s\n", "role", "name", "dtype", "shape", "size", "checksum");
  for (const store::TensorInfo& tensor : *tensors) {
    std::printf("%-10s %-32s %-5s %-18s %11s  %s %.16s\n", tensor.role.c_str(), tensor.name.c_str(),
                dtype_name(tensor.dtype), shape_to_string(tensor.shape).c_str(),
                format_bytes(tensor.byte_size).c_str(), crypto::chunk_hash_name(tensor.checksum_kind),
                hex(tensor.checksum).c_str());
  }
  std::printf("pending updates: %zu, peers: %zu, replay counters: %zu\n", pending->size(), peers->size(),
              counters->size());
  return 0;
}

// One line (or JSON event) per quarantined round and pending update.
void print_quarantine(const CheckpointFlags& flags, const std::vector<store::QuarantinedRound>& rounds,
                      const std::vector<store::QuarantinedUpdate>& updates) {
  for (const store::QuarantinedRound& r : rounds) {
    if (flags.json) {
      emit_json({{"event", "quarantined"}, {"kind", "round"}, {"round", r.round}, {"model_version", r.model_version},
                 {"committed", r.wall_time}, {"quarantined_at", r.quarantined_at}, {"reason", r.reason},
                 {"tensors", r.tensor_count}, {"bytes", r.byte_size}});
    } else {
      std::printf("quarantined round %lld (model version %lld, committed %s), since %s: %s [%lld tensors, %s kept]\n",
                  static_cast<long long>(r.round), static_cast<long long>(r.model_version), r.wall_time.c_str(),
                  r.quarantined_at.c_str(), r.reason.c_str(), static_cast<long long>(r.tensor_count),
                  format_bytes(r.byte_size).c_str());
    }
  }
  for (const store::QuarantinedUpdate& u : updates) {
    const std::string id = store::update_id_text(u.update_id);
    if (flags.json) {
      emit_json({{"event", "quarantined"}, {"kind", "pending_update"}, {"update", id}, {"sender", u.sender},
                 {"base_version", u.base_version}, {"received", u.received_at}, {"quarantined_at", u.quarantined_at},
                 {"reason", u.reason}, {"bytes", u.byte_size}});
    } else {
      std::printf("quarantined pending update %s from %s (base version %lld, received %s), since %s: %s\n", id.c_str(),
                  u.sender.c_str(), static_cast<long long>(u.base_version), u.received_at.c_str(),
                  u.quarantined_at.c_str(), u.reason.c_str());
    }
  }
}

// The id bytes of the quarantined update written as `text` (as listed).
Result<std::vector<uint8_t>> quarantined_update_id(store::CheckpointStore& checkpoints, const std::string& text) {
  Result<std::vector<store::QuarantinedUpdate>> updates = checkpoints.quarantined_updates();
  if (!updates.is_ok()) return updates.status();
  for (const store::QuarantinedUpdate& u : *updates) {
    if (store::update_id_text(u.update_id) == text) return u.update_id;
  }
  return not_found(checkpoints.path() + ": no quarantined pending update " + text +
                   " (`fedmesh checkpoint quarantine " + checkpoints.path() + "` lists them)");
}

int run_quarantine(const CheckpointFlags& flags) {
  const int actions = (flags.release_round ? 1 : 0) + (flags.drop_round ? 1 : 0) + (flags.release_update ? 1 : 0) +
                      (flags.drop_update ? 1 : 0);
  if (actions > 1) return fail(flags, "quarantine", invalid_argument("give at most one of --release-round, --drop-round, --release-update, --drop-update"));
  if (flags.force && !flags.release_round && !flags.release_update) {
    return fail(flags, "quarantine", invalid_argument("--force goes with --release-round or --release-update"));
  }
  Result<store::CheckpointStore> checkpoints = store::CheckpointStore::open_existing(flags.database);
  if (!checkpoints.is_ok()) return fail(flags, "quarantine", checkpoints.status());
  if (actions == 0) {
    Result<std::vector<store::QuarantinedRound>> rounds = checkpoints->quarantined_rounds();
    Result<std::vector<store::QuarantinedUpdate>> updates = checkpoints->quarantined_updates();
    if (!rounds.is_ok()) return fail(flags, "quarantine", rounds.status(), kExitCorrupt);
    if (!updates.is_ok()) return fail(flags, "quarantine", updates.status(), kExitCorrupt);
    print_quarantine(flags, *rounds, *updates);
    if (flags.json) {
      emit_json({{"event", "summary"}, {"command", "checkpoint quarantine"}, {"rounds", rounds->size()},
                 {"pending_updates", updates->size()}});
    } else {
      std::printf("%s: %zu rounds and %zu pending updates in quarantine\n", flags.database.c_str(), rounds->size(),
                  updates->size());
    }
    return 0;
  }
  std::string action, item;
  Status done;
  if (flags.release_round || flags.drop_round) {
    const int64_t round = flags.release_round ? *flags.release_round : *flags.drop_round;
    action = flags.release_round ? "released" : "dropped";
    item = "round " + std::to_string(round);
    done = flags.release_round ? checkpoints->release_quarantined_round(round, flags.force)
                               : checkpoints->drop_quarantined_round(round);
  } else {
    const std::string& text = flags.release_update ? *flags.release_update : *flags.drop_update;
    action = flags.release_update ? "released" : "dropped";
    item = "pending update " + text;
    Result<std::vector<uint8_t>> id = quarantined_update_id(*checkpoints, text);
    done = !id.is_ok()             ? id.status()
           : flags.release_update ? checkpoints->release_quarantined_update(*id, flags.force)
                                  : checkpoints->drop_quarantined_update(*id);
  }
  if (!done.is_ok()) {
    return fail(flags, "quarantine", done, done.code() == StatusCode::kCorrupt ? kExitCorrupt : kExitBadInput);
  }
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "checkpoint quarantine"}, {"action", action}, {"item", item},
               {"forced", flags.force}});
  } else {
    std::printf("%s %s %s\n", action.c_str(), item.c_str(),
                action == "released" ? "from quarantine" : "and its evidence from the quarantine");
  }
  return 0;
}

int run_verify(const CheckpointFlags& flags) {
  Result<store::CheckpointStore> checkpoints = store::CheckpointStore::open_existing(flags.database);
  if (!checkpoints.is_ok()) return fail(flags, "verify", checkpoints.status());
  Status integrity = checkpoints->integrity_check();
  if (!integrity.is_ok() && integrity.code() != StatusCode::kCorrupt) return fail(flags, "verify", integrity);
  Result<std::vector<store::RoundInfo>> rounds = checkpoints->rounds();
  if (!rounds.is_ok()) return fail(flags, "verify", rounds.status(), kExitCorrupt);
  int64_t corrupt_rounds = 0, checked = 0, newest_intact = -1;
  for (const store::RoundInfo& round : *rounds) {
    if (flags.round != kLatestRound && round.round != flags.round) continue;
    ++checked;
    Status s = checkpoints->verify_round(round.round);
    if (s.is_ok()) newest_intact = round.round;
    if (!s.is_ok()) ++corrupt_rounds;
    if (flags.json) {
      nlohmann::json event = {{"event", "verify"}, {"round", round.round}, {"ok", s.is_ok()}};
      if (!s.is_ok()) event["message"] = s.message();
      emit_json(event);
    } else {
      std::printf("round %lld: %s\n", static_cast<long long>(round.round), s.is_ok() ? "ok" : s.message().c_str());
    }
  }
  if (flags.round != kLatestRound && checked == 0) {
    return fail(flags, "verify", not_found(flags.database + ": no committed round " + std::to_string(flags.round)));
  }
  // Updates received and acknowledged but not yet applied: the aggregator
  // reads each of them back when it resumes.
  std::vector<store::CheckpointStore::DamagedPending> damaged;
  Result<std::vector<store::PendingUpdate>> pending = checkpoints->pending_updates();
  if (!pending.is_ok()) return fail(flags, "verify", pending.status(), kExitCorrupt);
  if (Status s = checkpoints->verify_pending_updates(&damaged); !s.is_ok() && s.code() != StatusCode::kCorrupt) {
    return fail(flags, "verify", s);
  }
  for (const auto& d : damaged) {
    const std::string id = store::update_id_text(d.update_id);
    if (flags.json) {
      emit_json({{"event", "verify"}, {"pending_update", id}, {"sender", d.sender}, {"ok", false}, {"message", d.reason}});
    } else {
      std::printf("pending update %s from %s: %s\n", id.c_str(), d.sender.c_str(), d.reason.c_str());
    }
  }
  // What owners moved aside: reported, not counted as damage (nothing resumes from it).
  Result<std::vector<store::QuarantinedRound>> quarantined_rounds = checkpoints->quarantined_rounds();
  Result<std::vector<store::QuarantinedUpdate>> quarantined_updates = checkpoints->quarantined_updates();
  if (!quarantined_rounds.is_ok()) return fail(flags, "verify", quarantined_rounds.status(), kExitCorrupt);
  if (!quarantined_updates.is_ok()) return fail(flags, "verify", quarantined_updates.status(), kExitCorrupt);
  print_quarantine(flags, *quarantined_rounds, *quarantined_updates);
  const bool ok = integrity.is_ok() && corrupt_rounds == 0 && damaged.empty();
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "checkpoint verify"},
               {"ok", ok},
               {"integrity_check", integrity.is_ok() ? "ok" : integrity.message()},
               {"rounds_checked", checked},
               {"corrupt_rounds", corrupt_rounds},
               {"newest_intact_round", newest_intact},
               {"pending_updates_checked", pending->size()},
               {"corrupt_pending_updates", damaged.size()},
               {"quarantined_rounds", quarantined_rounds->size()},
               {"quarantined_pending_updates", quarantined_updates->size()}});
  } else {
    std::printf("integrity check: %s\n", integrity.is_ok() ? "ok" : integrity.message().c_str());
    std::printf("%s: %lld of %lld checkpoints intact%s\n", flags.database.c_str(),
                static_cast<long long>(checked - corrupt_rounds), static_cast<long long>(checked),
                newest_intact >= 0 ? (", newest intact: round " + std::to_string(newest_intact)).c_str() : "");
    std::printf("%lld of %zu pending updates intact\n", static_cast<long long>(pending->size() - damaged.size()),
                pending->size());
    if (!quarantined_rounds->empty() || !quarantined_updates->empty()) {
      std::printf("in quarantine: %zu rounds, %zu pending updates (`fedmesh checkpoint quarantine %s` lists, releases "
                  "or drops them)\n",
                  quarantined_rounds->size(), quarantined_updates->size(), flags.database.c_str());
    }
  }
  return ok ? 0 : kExitCorrupt;
}

// --format hf-gpt2: the model's weights as Hugging Face's GPT2LMHeadModel
// state dict (train/hf_gpt2.h), for a round of a gpt model.
Status check_hf_gpt2_export(store::CheckpointStore& checkpoints, int64_t round, const std::string& role) {
  if (role != "model") return invalid_argument("--format hf-gpt2 exports the model's weights: drop --role " + role);
  Result<std::vector<store::TensorInfo>> tensors = checkpoints.tensors(round);
  if (!tensors.is_ok()) return tensors.status();
  for (const store::TensorInfo& t : *tensors) {
    if (t.role == "model" && t.name == "wte.weight") return Status::ok();
  }
  for (const store::TensorInfo& t : *tensors) {
    if (t.role == "model" && t.name.ends_with(".lora_b")) {
      return invalid_argument("--format hf-gpt2: round " + std::to_string(round) +
                              " holds LoRA B factors, not the model's weights: add --merge-lora");
    }
  }
  return invalid_argument("--format hf-gpt2: round " + std::to_string(round) +
                          " holds no wte.weight: not a gpt model (export it as safetensors)");
}

// --merge-lora: the round's B factors merged into the frozen weights they
// were trained on (train/lora_export.h), every weight under the model's
// own names (or the layout's), as a model without adapters.
Result<store::ExportSummary> export_merged_lora(store::CheckpointStore& checkpoints, int64_t round,
                                                const CheckpointFlags& flags, store::ExportFormat format,
                                                const std::string& out, const store::ExportLayout& layout,
                                                std::map<std::string, std::string> metadata) {
  if (format != store::ExportFormat::kSafetensors) return invalid_argument("--merge-lora writes safetensors");
  if (flags.role != "model") return invalid_argument("--merge-lora exports the model's weights: drop --role " + flags.role);
  Result<std::unique_ptr<train::Sequential>> model =
      train::merged_lora_model(checkpoints, round, flags.init, flags.init_format);
  if (!model.is_ok()) return model.status();
  Result<store::RoundInfo> info = checkpoints.round_info(round);
  if (!info.is_ok()) return info.status();
  metadata["round"] = std::to_string(info->round);
  metadata["model_version"] = std::to_string(info->model_version);
  metadata["metrics"] = info->metrics_json;
  metadata["lora_merged"] = (*model)->lora().describe();
  std::vector<store::SafetensorsEntry> entries;
  for (size_t i = 0; i < (*model)->layer_count(); ++i) {
    for (Parameter* p : (*model)->layer(i).parameters()) {
      const Tensor host = p->value.host();
      for (store::ExportedArray& as : layout ? layout(p->name) : std::vector<store::ExportedArray>{{p->name, false}}) {
        entries.push_back({std::move(as.name), DType::kF32, host.shape(), as.transposed,
                           [host](const std::function<Status(std::span<const uint8_t>)>& consume) {
                             return consume({static_cast<const uint8_t*>(host.raw()), host.nbytes()});
                           }});
      }
    }
  }
  return store::write_safetensors(out, entries, metadata);
}

int run_export(const CheckpointFlags& flags) {
  const bool hf_gpt2 = flags.format == "hf-gpt2";
  Result<store::ExportFormat> format = store::parse_export_format(hf_gpt2 ? "safetensors" : flags.format);
  if (!format.is_ok()) return fail(flags, "export", format.status());
  Result<store::CheckpointStore> checkpoints = store::CheckpointStore::open_existing(flags.database);
  if (!checkpoints.is_ok()) return fail(flags, "export", checkpoints.status());
  Result<int64_t> round = choose_round(*checkpoints, flags, "export");
  if (!round.is_ok()) return fail(flags, "export", round.status(), round.status().code() == StatusCode::kCorrupt ? kExitCorrupt : kExitBadInput);
  std::string out = flags.out;
  if (out.empty()) {
    const std::string stem = std::filesystem::path(flags.database).stem().string();
    out = stem + "-round" + std::to_string(*round) + (*format == store::ExportFormat::kNpy ? "-npy" : ".safetensors");
  }
  const std::string role = flags.role == "all" ? "" : flags.role;
  store::ExportLayout layout;
  // What the weights are: the run's or the federation's recorded settings
  // (model, seed, data schema, ...) go into the file's metadata.
  std::map<std::string, std::string> metadata;
  for (const char* key : {"train_config", "aggregator_config", "data_schema"}) {
    Result<std::optional<std::string>> value = checkpoints->meta(key);
    if (value.is_ok() && value->has_value() && !(*value)->empty()) metadata[key] = **value;
  }
  // The model's spec (train/model_spec.h) as a file: the one a spec-file run
  // recorded, or the built-in model's written out.
  for (const char* key : {"train_config", "aggregator_config"}) {
    if (metadata.count(key) == 0 || metadata.count("model_spec") > 0) continue;
    const nlohmann::json config = nlohmann::json::parse(metadata[key], nullptr, false);
    if (!config.is_object()) continue;
    if (config.contains("model_spec") && config["model_spec"].is_string()) {
      metadata["model_spec"] = config["model_spec"].get<std::string>();
    } else if (config.contains("model") && config["model"].is_string()) {
      if (std::optional<train::ModelSpec> preset = train::preset_model_spec(config["model"].get<std::string>())) {
        metadata["model_spec"] = preset->to_toml();
      }
    }
  }
  if (hf_gpt2) {
    if (!flags.merge_lora) {
      if (Status s = check_hf_gpt2_export(*checkpoints, *round, flags.role); !s.is_ok()) return fail(flags, "export", s);
    }
    layout = [](const std::string& name) {
      std::vector<store::ExportedArray> arrays;
      for (train::HfGpt2Name& hf : train::to_hf_gpt2(name)) arrays.push_back({std::move(hf.name), hf.transposed});
      return arrays;
    };
    metadata["layout"] = "hf-gpt2";
  }
  Result<store::ExportSummary> summary =
      flags.merge_lora ? export_merged_lora(*checkpoints, *round, flags, *format, out, layout, metadata)
                       : store::export_round(*checkpoints, *round, role, *format, out, layout, metadata);
  if (!summary.is_ok()) {
    return fail(flags, "export", summary.status(),
                summary.status().code() == StatusCode::kCorrupt ? kExitCorrupt : kExitBadInput);
  }
  if (flags.json) {
    emit_json({{"event", "summary"}, {"command", "checkpoint export"}, {"round", *round}, {"format", flags.format},
               {"out", out}, {"tensors", summary->tensors}, {"bytes", summary->bytes}});
  } else {
    std::printf("exported round %lld: %lld tensors, %s, as %s to %s\n", static_cast<long long>(*round),
                static_cast<long long>(summary->tensors), format_bytes(summary->bytes).c_str(), flags.format.c_str(),
                out.c_str());
  }
  return 0;
}

}  // namespace

void add_checkpoint_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<CheckpointFlags>();
  CLI::App* cmd = app.add_subcommand(
      "checkpoint",
      "Inspect, verify and export a checkpoint database (the --db of train, node and aggregator); list, release or "
      "drop what is in quarantine.");
  cmd->require_subcommand(1);
  const auto add_common = [&](CLI::App* sub) {
    sub->add_option("DB", flags->database, "The SQLite checkpoint database")->required();
    sub->add_flag("--json", flags->json, "Print JSON lines; the last is {\"event\":\"summary\",...} where there is one");
  };
  const auto add_round = [&](CLI::App* sub) {
    sub->add_option("--round", flags->round, "Round (or training step) to use (default: the newest that verifies)");
  };

  CLI::App* list = cmd->add_subcommand("list", "List the committed rounds kept: version, time, size, metrics.");
  add_common(list);
  list->callback([flags, &exit_code] { exit_code = run_list(*flags); });

  CLI::App* show = cmd->add_subcommand("show", "Show one round: metrics, state, tensors with checksums, pending updates, peers.");
  add_common(show);
  add_round(show);
  show->callback([flags, &exit_code] { exit_code = run_show(*flags); });

  CLI::App* verify = cmd->add_subcommand(
      "verify", "Run SQLite's integrity check and recompute every checksum; exit 1 if anything is corrupt.");
  add_common(verify);
  verify->add_option("--round", flags->round, "Verify only this round (default: all)");
  verify->callback([flags, &exit_code] { exit_code = run_verify(*flags); });

  CLI::App* exported = cmd->add_subcommand(
      "export", "Write a round's tensors as safetensors (PyTorch: safetensors.torch.load_file) or .npy files.");
  add_common(exported);
  add_round(exported);
  exported->add_option("--format", flags->format,
                       "safetensors (one file), npy (a directory, one file per tensor), or hf-gpt2 (a gpt model's "
                       "weights as Hugging Face's GPT2LMHeadModel state dict, safetensors: transformer.h.N names, "
                       "Conv1D weights (in, out), lm_head.weight tied; load_state_dict(..., strict=False) takes it, "
                       "and `train --init-format hf-gpt2` reads it back)")
      ->check(CLI::IsMember({"safetensors", "npy", "hf-gpt2"}))
      ->capture_default_str();
  exported->add_option("--role", flags->role,
                       "Which tensors: model (weights), optimizer, residual, or all (names then prefixed ROLE/)")
      ->capture_default_str();
  exported->add_option("--out", flags->out,
                       "Output file (safetensors) or directory (npy); default DBNAME-roundR.safetensors or DBNAME-roundR-npy");
  exported->add_flag("--merge-lora", flags->merge_lora,
                     "For a LoRA run (train --lora-rank, training.lora): write the model with its adapters merged, "
                     "W0 + (alpha/rank)·B·A in every adapted weight, under the model's own names (with --format "
                     "hf-gpt2, Hugging Face's), a model any tool loads without adapters. The frozen weights are "
                     "rebuilt from the run's init file and seed and checked against the fingerprint it recorded");
  exported->add_option("--init", flags->init,
                       "With --merge-lora: the run's base weights file, when it moved since the run (else the recorded path)");
  exported->add_option("--init-format", flags->init_format, "With --merge-lora --init: fedmesh or hf-gpt2 (else as recorded)")
      ->check(CLI::IsMember({"fedmesh", "hf-gpt2"}));
  exported->callback([flags, &exit_code] { exit_code = run_export(*flags); });

  CLI::App* quarantine = cmd->add_subcommand(
      "quarantine",
      "List what the store's owner moved into quarantine: damaged rounds and pending updates, kept with their bytes, "
      "the reason and the time, so that it could resume from the newest intact state. Nothing changes unless one "
      "action is given: release one (put it back; refused while it still fails its checks unless --force) or drop "
      "one (delete it and its evidence). Run an action while the owner is stopped: it reads the store when it starts.");
  add_common(quarantine);
  auto round_values = std::make_shared<std::array<int64_t, 2>>();
  auto update_values = std::make_shared<std::array<std::string, 2>>();
  CLI::Option* release_round = quarantine->add_option(
      "--release-round", (*round_values)[0], "Put this quarantined round back among the rounds (when it passes its checks)");
  CLI::Option* drop_round =
      quarantine->add_option("--drop-round", (*round_values)[1], "Delete this quarantined round and its evidence");
  CLI::Option* release_update = quarantine->add_option(
      "--release-update", (*update_values)[0],
      "Put this quarantined pending update (its id as listed) back among the pending updates");
  CLI::Option* drop_update = quarantine->add_option(
      "--drop-update", (*update_values)[1], "Delete this quarantined pending update (its id as listed) and its evidence");
  quarantine->add_flag("--force", flags->force, "Release even when the item still fails its checks");
  quarantine->callback([=, &exit_code] {
    if (release_round->count() > 0) flags->release_round = (*round_values)[0];
    if (drop_round->count() > 0) flags->drop_round = (*round_values)[1];
    if (release_update->count() > 0) flags->release_update = (*update_values)[0];
    if (drop_update->count() > 0) flags->drop_update = (*update_values)[1];
    exit_code = run_quarantine(*flags);
  });
}

}  // namespace fedmesh::cli
