#include "store/schema.h"

#include <array>
#include <string>

namespace fedmesh::store {

namespace {

// Index i holds migration i + 1.
constexpr std::array<const char*, kSchemaVersion> kMigrations = {
    // 1: training checkpoints.
    R"sql(
CREATE TABLE meta(
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL);
CREATE TABLE rounds(
  round INTEGER PRIMARY KEY,          -- a federation round, or a training step
  model_version INTEGER NOT NULL,
  wall_time TEXT NOT NULL,            -- UTC, ISO 8601
  metrics TEXT NOT NULL,              -- JSON object
  state TEXT NOT NULL,                -- JSON: RNG states, data position, counters
  tensor_count INTEGER NOT NULL,
  checksum BLOB NOT NULL);            -- BLAKE2b over metrics, state and every tensor's record
CREATE TABLE tensors(
  id INTEGER PRIMARY KEY,
  round INTEGER NOT NULL REFERENCES rounds(round) ON DELETE CASCADE,
  role TEXT NOT NULL,                 -- model, optimizer, residual, ...
  name TEXT NOT NULL,
  dtype TEXT NOT NULL,
  shape TEXT NOT NULL,                -- JSON array
  encoding TEXT NOT NULL,             -- raw: little-endian elements, row-major
  byte_size INTEGER NOT NULL,
  chunk_count INTEGER NOT NULL,
  checksum BLOB NOT NULL,             -- BLAKE2b-256 of the bytes (from version 8 also 0x01 + BLAKE2bp-256)
  UNIQUE(round, role, name));
CREATE TABLE tensor_chunks(
  tensor_id INTEGER NOT NULL REFERENCES tensors(id) ON DELETE CASCADE,
  chunk INTEGER NOT NULL,
  data BLOB NOT NULL,
  PRIMARY KEY(tensor_id, chunk));
)sql",
    // 2: federation membership.
    R"sql(
CREATE TABLE peers(
  site TEXT PRIMARY KEY,
  address TEXT NOT NULL,
  status TEXT NOT NULL,               -- alive, suspect, dead, left
  incarnation INTEGER NOT NULL,
  updated_round INTEGER NOT NULL);
CREATE TABLE replay_counters(
  sender TEXT PRIMARY KEY,
  sequence INTEGER NOT NULL);
)sql",
    // 3: update bookkeeping.
    R"sql(
CREATE TABLE pending_updates(
  update_id BLOB PRIMARY KEY,
  sender TEXT NOT NULL,
  base_version INTEGER NOT NULL,
  sample_count INTEGER NOT NULL,
  received_at TEXT NOT NULL,
  byte_size INTEGER NOT NULL,
  chunk_count INTEGER NOT NULL,
  checksum BLOB NOT NULL);
CREATE TABLE pending_update_chunks(
  update_id BLOB NOT NULL REFERENCES pending_updates(update_id) ON DELETE CASCADE,
  chunk INTEGER NOT NULL,
  data BLOB NOT NULL,
  PRIMARY KEY(update_id, chunk));
CREATE TABLE applied_updates(
  update_id BLOB PRIMARY KEY,
  round INTEGER NOT NULL,
  sender TEXT NOT NULL,
  staleness INTEGER NOT NULL);
CREATE INDEX applied_updates_by_round ON applied_updates(round);
)sql",
    // 4: the privacy ledger. Not tied to `rounds`: retention deletes old
    // rounds, never the budget they spent.
    R"sql(
CREATE TABLE privacy_ledger(
  round INTEGER PRIMARY KEY,          -- committed with this round, before its model is released
  mechanism TEXT NOT NULL,            -- dp-sgd, dp-fedavg, gossip-local
  sampling_rate REAL NOT NULL,        -- q of the steps this round added
  noise_multiplier REAL NOT NULL,     -- sigma of those steps
  steps INTEGER NOT NULL,             -- sampled Gaussian steps this round added
  epsilon REAL NOT NULL,              -- spent so far, at delta (never decreases)
  delta REAL NOT NULL,
  rdp TEXT NOT NULL,                  -- JSON: the accountant's total RDP per order
  wall_time TEXT NOT NULL);
)sql",
    // 5: the round log: every committed round's metrics (the operator's
    // history: accuracy and loss per round), kept whatever the retention.
    // Existing rounds are copied in.
    R"sql(
CREATE TABLE round_log(
  round INTEGER PRIMARY KEY,          -- written in the round's own commit
  model_version INTEGER NOT NULL,
  wall_time TEXT NOT NULL,
  metrics TEXT NOT NULL);             -- JSON object, as in rounds.metrics
INSERT INTO round_log(round, model_version, wall_time, metrics)
  SELECT round, model_version, wall_time, metrics FROM rounds;
)sql",
    // 6: quarantine: a damaged round or pending update moved aside by its
    // owner, with its rows and bytes as they were (the evidence), what failed
    // and when. No constraint beyond the keys: a damaged row is kept whatever
    // it holds. Entries have their own ids, so a round number or an update
    // id quarantined twice keeps both.
    R"sql(
CREATE TABLE quarantined_rounds(
  id INTEGER PRIMARY KEY,
  round INTEGER,                      -- the columns of rounds, as they were
  model_version INTEGER,
  wall_time TEXT,
  metrics TEXT,
  state TEXT,
  tensor_count INTEGER,
  checksum BLOB,
  reason TEXT NOT NULL,               -- what failed when it was checked
  quarantined_at TEXT NOT NULL);      -- UTC, ISO 8601
CREATE INDEX quarantined_rounds_by_round ON quarantined_rounds(round);
CREATE TABLE quarantined_tensors(
  id INTEGER PRIMARY KEY,
  entry INTEGER NOT NULL REFERENCES quarantined_rounds(id) ON DELETE CASCADE,
  source_id INTEGER,                  -- its id in tensors
  role TEXT, name TEXT, dtype TEXT, shape TEXT, encoding TEXT,
  byte_size INTEGER, chunk_count INTEGER, checksum BLOB);
CREATE INDEX quarantined_tensors_by_entry ON quarantined_tensors(entry);
CREATE TABLE quarantined_tensor_chunks(
  tensor_id INTEGER NOT NULL REFERENCES quarantined_tensors(id) ON DELETE CASCADE,
  chunk INTEGER,
  data BLOB);
CREATE INDEX quarantined_tensor_chunks_by_tensor ON quarantined_tensor_chunks(tensor_id);
CREATE TABLE quarantined_updates(
  id INTEGER PRIMARY KEY,
  update_id BLOB,                     -- the columns of pending_updates, as they were
  sender TEXT,
  base_version INTEGER,
  sample_count INTEGER,
  received_at TEXT,
  byte_size INTEGER,
  chunk_count INTEGER,
  checksum BLOB,
  reason TEXT NOT NULL,
  quarantined_at TEXT NOT NULL);
CREATE TABLE quarantined_update_chunks(
  entry INTEGER NOT NULL REFERENCES quarantined_updates(id) ON DELETE CASCADE,
  chunk INTEGER,
  data BLOB);
CREATE INDEX quarantined_update_chunks_by_entry ON quarantined_update_chunks(entry);
)sql",
    // 7: replay counters are kept by the sender's signing key (64 hex, in
    // the `sender` column), so that a re-keyed site starts afresh. Counters
    // kept by name move aside until the owner maps each name to the key its
    // roster holds (CheckpointStore::adopt_named_replay_counters).
    R"sql(
CREATE TABLE replay_counters_by_name(
  sender TEXT PRIMARY KEY,            -- a site name, as before version 7
  sequence INTEGER NOT NULL);
INSERT INTO replay_counters_by_name(sender, sequence) SELECT sender, sequence FROM replay_counters;
DELETE FROM replay_counters;
)sql",
    // 8: a tensor's checksum (tensors.checksum, quarantined_tensors.checksum)
    // may be BLAKE2bp-256, stored as 33 bytes: the kind byte 1, then the
    // hash; 32 bytes stay BLAKE2b-256. Nothing to change in the rows: the
    // version says that a store holding such checksums needs a fedmesh that
    // reads them (an older one would report them as damaged).
    R"sql(
-- tensor checksums: 32 bytes BLAKE2b-256, or 0x01 and 32 bytes BLAKE2bp-256
)sql",
    // 9: a pending update's checksum (pending_updates.checksum,
    // quarantined_updates.checksum) may be BLAKE2bp-256 in the same form;
    // as for 8, nothing changes in the rows.
    R"sql(
-- pending update checksums: 32 bytes BLAKE2b-256, or 0x01 and 32 bytes BLAKE2bp-256
)sql",
};

}  // namespace

Result<int> schema_version(Database& database) {
  Result<int64_t> has_table =
      database.query_int("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'");
  if (!has_table.is_ok()) return has_table.status();
  if (*has_table == 0) return 0;
  Result<int64_t> version = database.query_int("SELECT coalesce(max(version), 0) FROM schema_version");
  if (!version.is_ok()) return version.status();
  return static_cast<int>(*version);
}

Status migrate(Database& database, int target) {
  if (target < 1 || target > kSchemaVersion) {
    return invalid_argument("schema version " + std::to_string(target) + " does not exist (1.." +
                            std::to_string(kSchemaVersion) + ")");
  }
  auto newer = [&](int version) {
    return invalid_argument(database.path() + ": schema version " + std::to_string(version) +
                            " was written by a newer fedmesh (this one knows up to " +
                            std::to_string(kSchemaVersion) + "); upgrade fedmesh to open it");
  };
  Result<int> current = schema_version(database);
  if (!current.is_ok()) return current.status();
  if (*current > kSchemaVersion) return newer(*current);
  if (*current > target) {
    return invalid_argument(database.path() + ": already at schema version " + std::to_string(*current) +
                            ", cannot go back to " + std::to_string(target));
  }
  if (*current == target) return Status::ok();  // no write lock taken: an inspector never waits here
  for (;;) {
    Result<Transaction> transaction = Transaction::begin(database);
    if (!transaction.is_ok()) return transaction.status();
    // Read again under the write lock: another connection (an owner starting
    // while an operator opens the store) may have migrated since the read above.
    Result<int> now = schema_version(database);
    if (!now.is_ok()) return now.status();
    if (*now > kSchemaVersion) return newer(*now);
    if (*now >= target) return transaction->commit();
    const int version = *now + 1;
    FEDMESH_RETURN_IF_ERROR(database.execute(
        "CREATE TABLE IF NOT EXISTS schema_version(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)"));
    FEDMESH_RETURN_IF_ERROR(database.execute(kMigrations[static_cast<size_t>(version - 1)]));
    FEDMESH_RETURN_IF_ERROR(database.execute("INSERT INTO schema_version(version, applied_at) VALUES (" +
                                             std::to_string(version) +
                                             ", strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"));
    FEDMESH_RETURN_IF_ERROR(transaction->commit());
  }
}

}  // namespace fedmesh::store
