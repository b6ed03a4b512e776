// CheckpointStore's quarantine members (declared in store/checkpoint_store.h;
// the tables are schema migration 6).
#include "store/quarantine.h"

#include <algorithm>

#include "crypto/keys.h"
#include "store/checkpoint_store.h"

namespace fedmesh::store {

namespace {

// A reason is SQLite's or a checksum's message: bounded, as every stored text.
constexpr size_t kMaxReasonBytes = 2000;

const char* kNow = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

std::string round_text(int64_t round) { return "round " + std::to_string(round); }

Status not_owner(const std::string& path) {
  return invalid_argument(path +
                          ": opened for inspection; only the store's owner (the process that commits to it) moves "
                          "damaged items into quarantine");
}

// Runs `sql` with ?1 = `first` and, when given, ?2 = `second`; the rows it changed.
Result<int64_t> run_changes(Database& database, const std::string& sql, int64_t first,
                            std::optional<std::string_view> second = std::nullopt) {
  Result<Statement> statement = database.prepare(sql);
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, first);
  if (second) statement->bind(2, *second);
  FEDMESH_RETURN_IF_ERROR(statement->run());
  return database.changes();
}

// The quarantine entries (ids) of a round or of an update.
Result<std::vector<int64_t>> entries_of(Database& database, const char* sql,
                                        const std::function<void(Statement&)>& bind) {
  Result<Statement> statement = database.prepare(sql);
  if (!statement.is_ok()) return statement.status();
  bind(*statement);
  std::vector<int64_t> ids;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    ids.push_back(statement->column_int(0));
  }
  return ids;
}

std::string bounded(const std::string& reason) { return reason.substr(0, kMaxReasonBytes); }

}  // namespace

std::string update_id_text(std::span<const uint8_t> update_id) {
  const bool printable =
      !update_id.empty() && std::all_of(update_id.begin(), update_id.end(), [](uint8_t c) { return c >= 0x20 && c < 0x7f; });
  if (printable) return std::string(update_id.begin(), update_id.end());
  return crypto::to_hex(update_id);
}

Result<LoadedCheckpoint> CheckpointStore::resume_latest(const std::function<void(const QuarantineNotice&)>& notice) {
  if (!owner_) return not_owner(path());
  for (;;) {
    Result<std::vector<RoundInfo>> all = rounds();
    if (!all.is_ok()) return all.status();
    if (all->empty()) return not_found(path() + ": no intact committed checkpoint");
    const int64_t newest = all->back().round;
    Result<LoadedCheckpoint> loaded = load_round(newest);
    // Only a round whose own bytes fail is moved: an I/O error or an
    // interrupt says nothing about the round.
    if (loaded.is_ok() || loaded.status().code() != StatusCode::kCorrupt) return loaded;
    const std::string reason = loaded.status().message();
    FEDMESH_RETURN_IF_ERROR(quarantine_round(newest, reason));
    QuarantineNotice n;
    n.round = newest;
    n.reason = bounded(reason);
    n.message = "quarantined " + round_text(newest) + " of " + path() + " (it fails its checks: " + n.reason +
                "); resuming from the newest intact round. `fedmesh checkpoint quarantine " + path() +
                "` lists it";
    if (notice) notice(n);
  }
}

Status CheckpointStore::quarantine_damaged_pending_updates(const std::function<void(const QuarantineNotice&)>& notice) {
  if (!owner_) return not_owner(path());
  std::vector<DamagedPending> damaged;
  if (Status s = verify_pending_updates(&damaged); !s.is_ok() && s.code() != StatusCode::kCorrupt) return s;
  for (const DamagedPending& d : damaged) {
    FEDMESH_RETURN_IF_ERROR(quarantine_pending_update(d.update_id, d.reason));
    QuarantineNotice n;
    n.update_id = d.update_id;
    n.sender = d.sender;
    n.reason = bounded(d.reason);
    n.message = "quarantined pending update " + update_id_text(d.update_id) + " from " + d.sender + " of " + path() +
                " (it fails its checks: " + n.reason + "); it is not applied. `fedmesh checkpoint quarantine " +
                path() + "` lists it";
    if (notice) notice(n);
  }
  return Status::ok();
}

Status CheckpointStore::quarantine_round(int64_t round, const std::string& reason) {
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<Statement> record = database_.prepare(
      std::string("INSERT INTO quarantined_rounds(round, model_version, wall_time, metrics, state, tensor_count, "
                  "checksum, reason, quarantined_at) SELECT round, model_version, wall_time, metrics, state, "
                  "tensor_count, checksum, ?2, ") +
      kNow + " FROM rounds WHERE round = ?1");
  if (!record.is_ok()) return record.status();
  const std::string kept_reason = bounded(reason);  // bound without a copy: it must outlive the statement's run
  record->bind(1, round).bind(2, std::string_view(kept_reason));
  FEDMESH_RETURN_IF_ERROR(record->run());
  if (database_.changes() == 0) return not_found(path() + ": no committed " + round_text(round) + " to quarantine");
  const int64_t entry = database_.last_insert_rowid();
  Result<Statement> tensors = database_.prepare(
      "INSERT INTO quarantined_tensors(entry, source_id, role, name, dtype, shape, encoding, byte_size, chunk_count, "
      "checksum) SELECT ?1, id, role, name, dtype, shape, encoding, byte_size, chunk_count, checksum FROM tensors "
      "WHERE round = ?2 ORDER BY id");
  if (!tensors.is_ok()) return tensors.status();
  tensors->bind(1, entry).bind(2, round);
  FEDMESH_RETURN_IF_ERROR(tensors->run());
  Result<int64_t> chunks = run_changes(
      database_,
      "INSERT INTO quarantined_tensor_chunks(tensor_id, chunk, data) SELECT q.id, c.chunk, c.data "
      "FROM quarantined_tensors q JOIN tensor_chunks c ON c.tensor_id = q.source_id WHERE q.entry = ?1 "
      "ORDER BY q.id, c.chunk",
      entry);
  if (!chunks.is_ok()) return chunks.status();
  // Its tensors and their chunks go with it (ON DELETE CASCADE).
  Result<int64_t> deleted = run_changes(database_, "DELETE FROM rounds WHERE round = ?1", round);
  if (!deleted.is_ok()) return deleted.status();
  return transaction->commit();
}

Status CheckpointStore::quarantine_pending_update(std::span<const uint8_t> update_id, const std::string& reason) {
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<Statement> record = database_.prepare(
      std::string("INSERT INTO quarantined_updates(update_id, sender, base_version, sample_count, received_at, "
                  "byte_size, chunk_count, checksum, reason, quarantined_at) SELECT update_id, sender, "
                  "base_version, sample_count, received_at, byte_size, chunk_count, checksum, ?2, ") +
      kNow + " FROM pending_updates WHERE update_id = ?1");
  if (!record.is_ok()) return record.status();
  const std::string kept_reason = bounded(reason);
  record->bind_blob(1, update_id).bind(2, std::string_view(kept_reason));
  FEDMESH_RETURN_IF_ERROR(record->run());
  if (database_.changes() == 0) {
    return not_found(path() + ": no pending update " + update_id_text(update_id) + " to quarantine");
  }
  const int64_t entry = database_.last_insert_rowid();
  Result<Statement> chunks = database_.prepare(
      "INSERT INTO quarantined_update_chunks(entry, chunk, data) SELECT ?1, chunk, data FROM pending_update_chunks "
      "WHERE update_id = ?2 ORDER BY chunk");
  if (!chunks.is_ok()) return chunks.status();
  chunks->bind(1, entry).bind_blob(2, update_id);
  FEDMESH_RETURN_IF_ERROR(chunks->run());
  Result<Statement> remove = database_.prepare("DELETE FROM pending_updates WHERE update_id = ?1");
  if (!remove.is_ok()) return remove.status();
  remove->bind_blob(1, update_id);
  FEDMESH_RETURN_IF_ERROR(remove->run());
  return transaction->commit();
}

Result<std::vector<QuarantinedRound>> CheckpointStore::quarantined_rounds() {
  Result<Statement> statement = database_.prepare(
      "SELECT r.id, r.round, r.model_version, r.wall_time, r.metrics, r.state, r.tensor_count, r.reason, "
      "r.quarantined_at, (SELECT coalesce(sum(length(c.data)), 0) FROM quarantined_tensors q "
      "JOIN quarantined_tensor_chunks c ON c.tensor_id = q.id WHERE q.entry = r.id) "
      "FROM quarantined_rounds r ORDER BY r.round, r.id");
  if (!statement.is_ok()) return statement.status();
  std::vector<QuarantinedRound> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    QuarantinedRound r;
    r.entry = statement->column_int(0);
    r.round = statement->column_int(1);
    r.model_version = statement->column_int(2);
    r.wall_time = statement->column_text(3);
    r.metrics_json = statement->column_text(4);
    r.state_json = statement->column_text(5);
    r.tensor_count = statement->column_int(6);
    r.reason = statement->column_text(7);
    r.quarantined_at = statement->column_text(8);
    r.byte_size = statement->column_int(9);
    result.push_back(std::move(r));
  }
  return result;
}

Result<std::vector<QuarantinedUpdate>> CheckpointStore::quarantined_updates() {
  Result<Statement> statement = database_.prepare(
      "SELECT id, update_id, sender, base_version, sample_count, received_at, byte_size, reason, quarantined_at "
      "FROM quarantined_updates ORDER BY id");
  if (!statement.is_ok()) return statement.status();
  std::vector<QuarantinedUpdate> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    QuarantinedUpdate u;
    u.entry = statement->column_int(0);
    const std::span<const uint8_t> id = statement->column_blob(1);
    u.update_id.assign(id.begin(), id.end());
    u.sender = statement->column_text(2);
    u.base_version = statement->column_int(3);
    u.sample_count = statement->column_int(4);
    u.received_at = statement->column_text(5);
    u.byte_size = statement->column_int(6);
    u.reason = statement->column_text(7);
    u.quarantined_at = statement->column_text(8);
    result.push_back(std::move(u));
  }
  return result;
}

Status CheckpointStore::release_quarantined_round(int64_t round, bool force) {
  const std::string what = "quarantined " + round_text(round);
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<std::vector<int64_t>> entries = entries_of(database_, "SELECT id FROM quarantined_rounds WHERE round = ?1",
                                                    [round](Statement& s) { s.bind(1, round); });
  if (!entries.is_ok()) return entries.status();
  if (entries->empty()) return not_found(path() + ": no " + what);
  if (entries->size() > 1) {
    return invalid_argument(path() + ": " + round_text(round) + " was quarantined " + std::to_string(entries->size()) +
                            " times; drop the entries instead (they cannot all be put back)");
  }
  const int64_t entry = entries->front();
  Result<int64_t> taken = database_.query_int("SELECT count(*) FROM rounds WHERE round = " + std::to_string(round));
  if (!taken.is_ok()) return taken.status();
  if (*taken > 0) {
    return invalid_argument(path() + ": " + round_text(round) +
                            " was committed again after it was quarantined; the quarantined one can only be dropped");
  }
  const auto move = [&](const char* sql) -> Status {
    Result<int64_t> changed = run_changes(database_, sql, entry);
    if (!changed.is_ok()) return Status(changed.status().code(), "cannot release " + what + ": " + changed.status().message());
    return Status::ok();
  };
  FEDMESH_RETURN_IF_ERROR(move(
      "INSERT INTO rounds(round, model_version, wall_time, metrics, state, tensor_count, checksum) "
      "SELECT round, model_version, wall_time, metrics, state, tensor_count, checksum FROM quarantined_rounds "
      "WHERE id = ?1"));
  FEDMESH_RETURN_IF_ERROR(move(
      "INSERT INTO tensors(round, role, name, dtype, shape, encoding, byte_size, chunk_count, checksum) "
      "SELECT r.round, q.role, q.name, q.dtype, q.shape, q.encoding, q.byte_size, q.chunk_count, q.checksum "
      "FROM quarantined_tensors q JOIN quarantined_rounds r ON r.id = q.entry WHERE q.entry = ?1 "
      "ORDER BY q.source_id"));
  FEDMESH_RETURN_IF_ERROR(move(
      "INSERT INTO tensor_chunks(tensor_id, chunk, data) SELECT t.id, c.chunk, c.data "
      "FROM quarantined_tensor_chunks c JOIN quarantined_tensors q ON q.id = c.tensor_id "
      "JOIN quarantined_rounds r ON r.id = q.entry "
      "JOIN tensors t ON t.round = r.round AND t.role = q.role AND t.name = q.name WHERE q.entry = ?1"));
  FEDMESH_RETURN_IF_ERROR(move("DELETE FROM quarantined_rounds WHERE id = ?1"));
  if (!force) {
    if (Status s = verify_round(round); !s.is_ok()) {
      return Status(s.code(), path() + ": " + what + " still fails its checks (" + s.message() +
                                  "); it stays in quarantine (force puts it back anyway)");
    }
  }
  return transaction->commit();
}

Status CheckpointStore::release_quarantined_update(std::span<const uint8_t> update_id, bool force) {
  const std::string what = "quarantined update " + update_id_text(update_id);
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<std::vector<int64_t>> entries =
      entries_of(database_, "SELECT id FROM quarantined_updates WHERE update_id = ?1",
                 [update_id](Statement& s) { s.bind_blob(1, update_id); });
  if (!entries.is_ok()) return entries.status();
  if (entries->empty()) return not_found(path() + ": no " + what);
  if (entries->size() > 1) {
    return invalid_argument(path() + ": update " + update_id_text(update_id) + " was quarantined " +
                            std::to_string(entries->size()) + " times; drop the entries instead");
  }
  const int64_t entry = entries->front();
  Result<std::optional<int64_t>> applied = applied_round(update_id);
  if (!applied.is_ok()) return applied.status();
  if (applied->has_value()) {
    return invalid_argument(path() + ": update " + update_id_text(update_id) + " was applied in " +
                            round_text(**applied) + " since; the quarantined copy can only be dropped");
  }
  Result<Statement> pending = database_.prepare("SELECT count(*) FROM pending_updates WHERE update_id = ?1");
  if (!pending.is_ok()) return pending.status();
  pending->bind_blob(1, update_id);
  Result<bool> row = pending->step();
  if (!row.is_ok()) return row.status();
  if (*row && pending->column_int(0) > 0) {
    return invalid_argument(path() + ": update " + update_id_text(update_id) + " is pending again; the quarantined copy can only be dropped");
  }
  pending->reset();
  const auto move = [&](const char* sql) -> Status {
    Result<int64_t> changed = run_changes(database_, sql, entry);
    if (!changed.is_ok()) return Status(changed.status().code(), "cannot release " + what + ": " + changed.status().message());
    return Status::ok();
  };
  FEDMESH_RETURN_IF_ERROR(move(
      "INSERT INTO pending_updates(update_id, sender, base_version, sample_count, received_at, byte_size, "
      "chunk_count, checksum) SELECT update_id, sender, base_version, sample_count, received_at, byte_size, "
      "chunk_count, checksum FROM quarantined_updates WHERE id = ?1"));
  FEDMESH_RETURN_IF_ERROR(move(
      "INSERT INTO pending_update_chunks(update_id, chunk, data) SELECT u.update_id, c.chunk, c.data "
      "FROM quarantined_update_chunks c JOIN quarantined_updates u ON u.id = c.entry WHERE c.entry = ?1 "
      "ORDER BY c.chunk"));
  FEDMESH_RETURN_IF_ERROR(move("DELETE FROM quarantined_updates WHERE id = ?1"));
  if (!force) {
    if (Result<std::vector<uint8_t>> bytes = read_pending_update(update_id); !bytes.is_ok()) {
      return Status(bytes.status().code(), path() + ": " + what + " still fails its checks (" +
                                               bytes.status().message() +
                                               "); it stays in quarantine (force puts it back anyway)");
    }
  }
  return transaction->commit();
}

Status CheckpointStore::drop_quarantined_round(int64_t round) {
  Result<int64_t> deleted = run_changes(database_, "DELETE FROM quarantined_rounds WHERE round = ?1", round);
  if (!deleted.is_ok()) return deleted.status();
  if (*deleted == 0) return not_found(path() + ": no quarantined " + round_text(round));
  return Status::ok();
}

Status CheckpointStore::drop_quarantined_update(std::span<const uint8_t> update_id) {
  Result<Statement> statement = database_.prepare("DELETE FROM quarantined_updates WHERE update_id = ?1");
  if (!statement.is_ok()) return statement.status();
  statement->bind_blob(1, update_id);
  FEDMESH_RETURN_IF_ERROR(statement->run());
  if (database_.changes() == 0) return not_found(path() + ": no quarantined update " + update_id_text(update_id));
  return Status::ok();
}

}  // namespace fedmesh::store
