// CheckpointStore: one SQLite database per process holding its committed
// rounds (or training steps): model and optimizer tensors, error-feedback
// residuals, the JSON state that decides the rest of a run (RNG states, data
// position, counters), metrics, the membership view, replay counters,
// updates received but not yet applied, and the ids of applied updates.
//
// Guarantees (the aggregator, gossip and training rely on them):
// - commit_round() is one transaction in WAL mode with synchronous=FULL: when
//   it returns ok, the round is on disk and survives kill -9 or power loss;
//   when the process dies inside it, the round is absent as a whole. Announce
//   a new model version only after commit_round() returned ok.
// - Every tensor carries a checksum of its bytes (BLAKE2bp-256, on a second
//   core while the bytes are written; BLAKE2b-256 in rounds from before) and every round
//   a checksum over its metrics, state and tensor records; both are verified
//   on load. load_latest() reports a corrupt round by number and what failed,
//   and falls back to the newest round that verifies.
// - An update id recorded as applied in a committed round cannot be applied
//   again: commit_round() refuses it, and is_applied() says so after restart.
// - Tensor bytes live in rows of at most kTensorChunkBytes, written and read
//   one chunk at a time: no single allocation beyond the tensor itself.
// - Retention: the newest keep_last rounds plus the best by a chosen metric
//   survive; deleted rounds' pages are reused.
// - Two chores are taken off the commit path (with background_maintenance,
//   the default): a thread with its own connection applies retention after
//   each commit, in its own transaction, and copies the write-ahead log into
//   the database file (SQLite's WAL checkpoint). A commit then costs one
//   write of its bytes plus an fsync. Neither needs care on a crash: a round
//   that should have been deleted is deleted after the next commit, and
//   SQLite replays the committed log when the store reopens. A commit waits
//   for the previous commit's chores, so they run while the caller trains
//   and never fall more than one commit behind. settle() waits for both.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "crypto/hash.h"
#include "crypto/update_signature.h"
#include "kernels/tensor.h"
#include "store/checksum.h"
#include "store/payload_source.h"
#include "store/quarantine.h"
#include "store/sqlite.h"

namespace fedmesh::store {

// Rows of tensor and update payload bytes.
inline constexpr int64_t kTensorChunkBytes = int64_t{1} << 20;
// Bounds on what a database may declare before it decides an allocation:
// a database is a file from outside the process.
inline constexpr int64_t kMaxTensorBytes = int64_t{64} << 30;
inline constexpr int64_t kMaxUpdateBytes = int64_t{16} << 30;
inline constexpr int kMaxTensorRank = 8;
inline constexpr int64_t kMaxTensorsPerRound = 1'000'000;
inline constexpr size_t kMaxJsonBytes = size_t{16} << 20;
inline constexpr size_t kMaxNameBytes = 1024;

struct StoreOptions {
  int64_t keep_last = 3;     // newest committed rounds kept, >= 1
  std::string best_metric;   // a key of the metrics JSON, e.g. "test_accuracy"; "" keeps no best
  bool best_is_max = true;   // false: the lowest value is best (e.g. "val_loss")
  // Retention and the log copy on a background thread after each commit;
  // false: retention inside the commit's transaction, and SQLite copies the
  // log inside commits once it passes 1000 pages.
  bool background_maintenance = true;
  // The SQLite VFS the store's files are read and written through; "" is
  // SQLite's default. The fault simulator (sim/vopr) names one that can lose
  // unsynced writes on a simulated power cut.
  std::string vfs;
  Status validate() const;
};

struct TensorToCommit {
  std::string role;  // "model", "optimizer", "residual", ...
  std::string name;  // e.g. "fc1.weight"
  const Tensor* tensor = nullptr;  // a CPU tensor
};

struct AppliedUpdate {
  std::vector<uint8_t> update_id;  // unique per update, e.g. its header hash
  std::string sender;
  int64_t staleness = 0;  // server version at apply time - the version it was based on
};

struct PeerRecord {
  std::string site;
  std::string address;
  std::string status;  // alive | suspect | dead | left
  int64_t incarnation = 0;
  int64_t updated_round = 0;
};

// The mechanisms a privacy ledger entry may name.
inline bool is_privacy_mechanism(std::string_view m) {
  return m == "dp-sgd" || m == "dp-fedavg" || m == "gossip-local" || m == "dp-sgd-seeded" || m == "dp-fedavg-seeded";
}
// A mechanism whose noise was seeded for replay: no privacy guarantee.
inline bool is_seeded_privacy_mechanism(std::string_view m) { return m.ends_with("-seeded"); }

// One round's entry in the privacy ledger: what the round spent and the
// total so far, written in the round's own transaction.
struct PrivacyEntry {
  int64_t round = 0;
  // dp-sgd, dp-fedavg, gossip-local; dp-sgd-seeded and dp-fedavg-seeded when
  // the noise was seeded for replay (a simulation, a test): not private.
  std::string mechanism;
  double sampling_rate = 0.0;
  double noise_multiplier = 0.0;
  int64_t steps = 0;
  double epsilon = 0.0;         // cumulative; commit_round refuses a decrease
  double delta = 0.0;
  std::string rdp_json = "[]";  // the accountant's total RDP per order
  std::string wall_time;        // set by the store
};

struct RoundToCommit {
  int64_t round = 0;  // strictly above every committed round
  int64_t model_version = 0;
  std::string metrics_json = "{}";  // a JSON object
  std::string state_json = "{}";    // a JSON object
  std::vector<TensorToCommit> tensors;
  std::vector<AppliedUpdate> applied_updates;     // removed from pending in the same transaction
  std::optional<std::vector<PeerRecord>> peers;   // replaces the stored view when set
  std::map<std::string, uint64_t> replay_counters;  // raised to these values, never lowered
  std::optional<PrivacyEntry> privacy;  // the ledger entry of this round (its round must be this one)
};

struct RoundInfo {
  int64_t round = 0;
  int64_t model_version = 0;
  std::string wall_time;
  std::string metrics_json;
  std::string state_json;
  int64_t tensor_count = 0;
  int64_t byte_size = 0;  // sum of its tensors' bytes
};

// One committed round in the round log: what its metrics were, kept after
// retention has dropped the round's checkpoint.
struct RoundLogEntry {
  int64_t round = 0;
  int64_t model_version = 0;
  std::string wall_time;
  std::string metrics_json;
};

struct TensorInfo {
  int64_t id = 0;
  std::string role, name;
  DType dtype = DType::kF32;
  Shape shape;
  std::string encoding;
  int64_t byte_size = 0;
  int64_t chunk_count = 0;
  crypto::Hash checksum{};
  // What `checksum` is: BLAKE2bp-256 for tensors committed since schema
  // version 8 (stored as 33 bytes, the kind byte 1 first), BLAKE2b-256 for
  // those before (32 bytes).
  crypto::ChunkHash checksum_kind = crypto::ChunkHash::kBlake2b;
};

struct StoredTensor {
  TensorInfo info;
  Tensor value;
};

struct LoadedCheckpoint {
  RoundInfo round;
  std::vector<StoredTensor> tensors;
  // The tensor with this role and name, or null.
  const StoredTensor* find(std::string_view role, std::string_view name) const;
};

struct PendingUpdate {
  std::vector<uint8_t> update_id;
  std::string sender;
  int64_t base_version = 0;
  int64_t sample_count = 0;
  std::string received_at;  // filled by the store
  int64_t byte_size = 0;    // filled by the store
  // Above 0: the sender's replay counter is raised to it (never lowered) in
  // the transaction that stores the update, so the counter is never durable
  // without the update it protects.
  uint64_t replay_sequence = 0;
  // Whose counter replay_sequence raises: the sender's signing key
  // (crypto::replay_key); empty: `sender`.
  std::string replay_key;
};

// One pending update's payload read front to back, a chunk row at a time,
// so that an update of any size is read with the memory of one row (the
// aggregator folds a round's updates slice by slice from here). Valid while
// its store is open and not moved. Between the first read of a pass and
// finish() it holds a read of the database.
class PendingStream {
 public:
  int64_t size() const { return size_; }
  // The next out.size() bytes of the pass; kCorrupt when a row is missing,
  // out of order or oversized, or when the payload ends first.
  Status read(std::span<uint8_t> out);
  // Ends the pass (the next read starts again at the first byte): reads
  // what is left, then kCorrupt unless the payload has its recorded size
  // and checksum.
  Status finish();
  // Ends the pass without reading the rest or checking it.
  void rewind();

 private:
  friend class CheckpointStore;
  PendingStream() = default;
  Status next_row();
  std::vector<uint8_t> update_id_;  // bound in rows_
  std::string what_;
  int64_t size_ = 0;
  StoredChecksum expected_;
  Statement rows_;
  std::unique_ptr<ChecksumHasher> hasher_;  // the pass's, once begun
  std::span<const uint8_t> row_;            // the current row's bytes not read yet
  int64_t next_chunk_ = 0, fetched_ = 0;    // rows and bytes taken so far in the pass
};

class CheckpointStore {
 public:
  // Opens or creates `path` as its owner: the process that commits its
  // rounds. Migrates it to kSchemaVersion and sets WAL mode with
  // synchronous=FULL. Only one process owns a store at a time: an flock on
  // PATH.owner (which holds the owner's pid) is held while the store is open,
  // and a second owner is refused with kUnavailable naming that pid.
  // A store whose SQLite quick check fails is refused (kCorrupt, naming
  // SQLite's findings): nothing is written on a damaged file.
  static Result<CheckpointStore> open(const std::string& path, StoreOptions options = {});
  // Opens an existing store (kNotFound when absent) to inspect it, as the
  // operator commands do, also while its owner runs; migrates it forward.
  // A file that is not a fedmesh store (an empty file included) is refused,
  // never turned into one. A store this process cannot write (read-only
  // media, a read-only copy) is opened read-only as it is, without its
  // write-ahead log; it must be at the current schema version.
  static Result<CheckpointStore> open_existing(const std::string& path, StoreOptions options = {});

  const std::string& path() const { return database_.path(); }

  Status commit_round(const RoundToCommit& round);

  Result<std::vector<RoundInfo>> rounds();  // ascending by round
  Result<RoundInfo> round_info(int64_t round);
  Result<std::vector<TensorInfo>> tensors(int64_t round);
  // Streams a tensor's bytes in chunk order; the checksum is verified after the
  // last chunk, so a consumer must discard what it received on error.
  Status read_tensor(const TensorInfo& tensor, const std::function<Status(std::span<const uint8_t>)>& consume);
  // Recomputes every checksum of the round; kCorrupt names the round and what failed.
  Status verify_round(int64_t round);
  // Reads and verifies one round.
  Result<LoadedCheckpoint> load_round(int64_t round);
  // The newest round that verifies. Each newer round that failed is appended
  // to `skipped` (when given) with its reason. kNotFound when there is none.
  Result<LoadedCheckpoint> load_latest(std::vector<Status>* skipped = nullptr);
  // The same, telling `warn` "skipping corrupt checkpoint: REASON" for each
  // newer round it passes over (how every role resumes).
  Result<LoadedCheckpoint> load_latest(const std::function<void(const std::string& warning)>& warn);

  // Run-wide facts (e.g. the configuration a run was started with).
  Status set_meta(const std::string& key, const std::string& value);
  Result<std::optional<std::string>> meta(const std::string& key);

  // Durable when it returns ok, before any acknowledgement is sent; the
  // update and its replay counter (replay_sequence) in one transaction.
  Status add_pending_update(const PendingUpdate& update, std::span<const uint8_t> payload);
  Result<std::vector<PendingUpdate>> pending_updates();  // by arrival
  Result<std::vector<uint8_t>> read_pending_update(std::span<const uint8_t> update_id);
  // The same payload given in pieces laid end to end (a header and a model's
  // tensors where they lie), stored and hashed without joining them.
  Status add_pending_update_in_pieces(const PendingUpdate& update, std::span<const std::span<const uint8_t>> pieces);
  // The same payload read from `source` (e.g. an upload staged on disk),
  // written and hashed in one pass (a retransmission of one already pending
  // is hashed in a pass of its own and compared).
  Status add_pending_update_from(const PendingUpdate& update, PayloadSource& source);
  // The payload read as a stream (kNotFound when it is not pending; kCorrupt
  // when its record is out of bounds).
  Result<PendingStream> open_pending_stream(std::span<const uint8_t> update_id);
  // Drops every pending update. The aggregator calls it after each
  // committed step, when its buffer is empty: what is still pending then was
  // refused and never will be applied (the commit removed the applied ones).
  Status clear_pending_updates();
  // The round an update was applied in, or nullopt.
  Result<std::optional<int64_t>> applied_round(std::span<const uint8_t> update_id);

  Result<std::vector<PeerRecord>> peers();
  // Replay counters by sender key (crypto::replay_key).
  Result<std::map<std::string, uint64_t>> replay_counters();
  // Counters a store from before schema version 7 kept by site name, not yet adopted.
  Result<std::map<std::string, uint64_t>> named_replay_counters();
  // In one transaction: each counter kept by a name in `key_of_name` raises
  // that key's counter; then every counter kept by name is dropped (a name
  // not in the map has no key on the roster: when it comes back it has a new
  // key, which starts afresh).
  Status adopt_named_replay_counters(const std::map<std::string, std::string>& key_of_name);
  // The privacy ledger, oldest first (kept whatever the retention).
  Result<std::vector<PrivacyEntry>> privacy_ledger();
  // The round log, oldest first: the newest `newest` rounds (0: all). Every
  // committed round has its entry, written in its commit, whatever the
  // retention.
  Result<std::vector<RoundLogEntry>> round_log(int64_t newest = 0);
  // Raises one sender's counter (durably); lowering is refused.
  Status record_replay_counter(const std::string& sender, uint64_t sequence);

  // PRAGMA integrity_check: ok, or kCorrupt with SQLite's findings.
  Status integrity_check();
  // Every pending update's bytes against its recorded size and checksum;
  // the damaged ones appended to `damaged` (id in hex, sender, reason).
  // kCorrupt when any is damaged.
  struct DamagedPending {
    std::vector<uint8_t> update_id;
    std::string sender;
    std::string reason;
  };
  Status verify_pending_updates(std::vector<DamagedPending>* damaged = nullptr);
  // Quarantine (store/quarantine.h). For an owner: the newest round that
  // verifies, each newer round that fails its checks (kCorrupt) moved into
  // quarantine first and told to `notice`; kNotFound when no intact round is
  // left. Refused on a store opened by open_existing (inspectors never move
  // anything).
  Result<LoadedCheckpoint> resume_latest(const std::function<void(const QuarantineNotice&)>& notice);
  // For an owner: every pending update that fails its size or checksum is
  // moved into quarantine and told to `notice`.
  Status quarantine_damaged_pending_updates(const std::function<void(const QuarantineNotice&)>& notice);
  // Moves one committed round (its record, tensors and bytes) or one pending
  // update into quarantine with `reason`; kNotFound when it is not there.
  Status quarantine_round(int64_t round, const std::string& reason);
  Status quarantine_pending_update(std::span<const uint8_t> update_id, const std::string& reason);
  Result<std::vector<QuarantinedRound>> quarantined_rounds();    // by round, then entry
  Result<std::vector<QuarantinedUpdate>> quarantined_updates();  // by entry
  // Puts an entry back among the rounds (the pending updates). Refused
  // (kCorrupt, naming what still fails, nothing moved) when it does not pass
  // its checks, unless `force`; refused when that round number (update id)
  // is taken again, or when the round number has several entries.
  Status release_quarantined_round(int64_t round, bool force = false);
  Status release_quarantined_update(std::span<const uint8_t> update_id, bool force = false);
  // Deletes the entries of that round (update) and their evidence; kNotFound when none.
  Status drop_quarantined_round(int64_t round);
  Status drop_quarantined_update(std::span<const uint8_t> update_id);

  // Waits for background retention and log copying to finish, then copies
  // what is left of the write-ahead log into the database file and truncates
  // the log. Reports a failure of the background work since the last call.
  Status settle();
  // Bytes of the database file plus its write-ahead log.
  int64_t disk_bytes() const;

 private:
  Status run_check(const char* pragma);  // integrity_check or quick_check
  Status insert_privacy_entry(int64_t round, const PrivacyEntry& entry);
  Status write_checksums(const RoundToCommit& round, std::vector<TensorInfo>& infos,
                         const std::vector<crypto::Hash>& checksums);
  class BackgroundMaintenance;
  class OwnerLock;
  CheckpointStore(std::unique_ptr<OwnerLock> owner, Database database, StoreOptions options,
                  std::unique_ptr<BackgroundMaintenance> maintenance);
  static Result<CheckpointStore> open_with(const std::string& path, StoreOptions options, Database::Mode mode);
  Result<TensorInfo> read_tensor_info(Statement& statement);
  Result<crypto::Hash> round_checksum(const RoundInfo& round, const std::vector<TensorInfo>& tensors);

  std::unique_ptr<OwnerLock> owner_;  // first: released after the database is closed
  Database database_;
  StoreOptions options_;
  std::unique_ptr<BackgroundMaintenance> maintenance_;  // null without background_maintenance

 public:
  CheckpointStore(CheckpointStore&&) noexcept;
  CheckpointStore& operator=(CheckpointStore&&) noexcept;
  ~CheckpointStore();
};

}  // namespace fedmesh::store
