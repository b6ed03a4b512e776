#include "cli/checkpoint_command.h"

#include <algorithm>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/output.h"
#include "crypto/keys.h"
#include "store/checkpoint_store.h"
#include "store/schema.h"
#include "store/tensor_export.h"

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
                           {"checksum", hex(tensor.checksum)}});
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
  std::printf("%-10s %-32s %-5s %-18s %11s  %s\n", "role", "name", "dtype", "shape", "size", "blake2b");
  for (const store::TensorInfo& tensor : *tensors) {
    std::printf("%-10s %-32s %-5s %-18s %11s  %.16s\n", tensor.role.c_str(), tensor.name.c_str(),
                dtype_name(tensor.dtype), shape_to_string(tensor.shape).c_str(),
                format_bytes(tensor.byte_size).c_str(), hex(tensor.checksum).c_str());
  }
  std::printf("pending updates: %zu, peers: %zu, replay counters: %zu\n", pending->size(), peers->size(),
              counters->size());
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
    // The aggregator's ids are SENDER/SEQUENCE text; anything else in hex.
    const bool printable = std::all_of(d.update_id.begin(), d.update_id.end(), [](uint8_t c) { return c >= 0x20 && c < 0x7f; });
    std::string id;
    if (printable) {
      id.assign(d.update_id.begin(), d.update_id.end());
    } else {
      for (const uint8_t c : d.update_id) {
        id += "0123456789abcdef"[c >> 4];
        id += "0123456789abcdef"[c & 15];
      }
    }
    if (flags.json) {
      emit_json({{"event", "verify"}, {"pending_update", id}, {"sender", d.sender}, {"ok", false}, {"message", d.reason}});
    } else {
      std::printf("pending update %s from %s: %s\n", id.c_str(), d.sender.c_str(), d.reason.c_str());
    }
  }
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
               {"corrupt_pending_updates", damaged.size()}});
  } else {
    std::printf("integrity check: %s\n", integrity.is_ok() ? "ok" : integrity.message().c_str());
    std::printf("%s: %lld of %lld checkpoints intact%s\n", flags.database.c_str(),
                static_cast<long long>(checked - corrupt_rounds), static_cast<long long>(checked),
                newest_intact >= 0 ? (", newest intact: round " + std::to_string(newest_intact)).c_str() : "");
    std::printf("%lld of %zu pending updates intact\n", static_cast<long long>(pending->size() - damaged.size()),
                pending->size());
  }
  return ok ? 0 : kExitCorrupt;
}

int run_export(const CheckpointFlags& flags) {
  Result<store::ExportFormat> format = store::parse_export_format(flags.format);
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
  Result<store::ExportSummary> summary = store::export_round(*checkpoints, *round, role, *format, out);
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
      "checkpoint", "Inspect, verify and export a checkpoint database (the --db of train, node and aggregator).");
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
  exported->add_option("--format", flags->format, "safetensors (one file) or npy (a directory, one file per tensor)")
      ->check(CLI::IsMember({"safetensors", "npy"}))
      ->capture_default_str();
  exported->add_option("--role", flags->role,
                       "Which tensors: model (weights), optimizer, residual, or all (names then prefixed ROLE/)")
      ->capture_default_str();
  exported->add_option("--out", flags->out,
                       "Output file (safetensors) or directory (npy); default DBNAME-roundR.safetensors or DBNAME-roundR-npy");
  exported->callback([flags, &exit_code] { exit_code = run_export(*flags); });
}

}  // namespace fedmesh::cli
