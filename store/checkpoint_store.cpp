#include "store/checkpoint_store.h"

#include <fcntl.h>
#include <sodium.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <system_error>

#include "base/file_io.h"
#include "crypto/keys.h"
#include "crypto/tree_hash.h"
#include "store/checksum.h"
#include "store/schema.h"

namespace fedmesh::store {

namespace {

// A database created here uses 64 KiB pages: a 1 MiB chunk then spans 16
// overflow pages instead of 256, and the write-ahead log carries 16 frame
// headers per chunk instead of 256.
constexpr int kNewDatabasePageSize = 65536;
// After a checkpoint of the write-ahead log, SQLite truncates the log to this
// size, so one large commit does not leave a log of its size on disk forever.
constexpr int64_t kWalSizeLimitBytes = int64_t{64} << 20;

std::string round_name(int64_t round) { return "round " + std::to_string(round); }

// Pending updates are checksummed with BLAKE2bp from schema version 9
// (before it, BLAKE2b, which is still read).
constexpr crypto::ChunkHash kPendingChecksum = crypto::ChunkHash::kBlake2bp;

std::string checksum_size_problem(size_t size) {
  return "checksum is " + std::to_string(size) +
         " bytes, neither a BLAKE2b-256 (32) nor a kind byte 1 and a BLAKE2bp-256 (33)";
}

std::vector<uint8_t> stored_checksum(const TensorInfo& tensor) {
  return checksum_blob({tensor.checksum_kind, tensor.checksum});
}

// The first `limit` bytes in hex: enough to tell ids and checksums apart in a message.
std::string hex(std::span<const uint8_t> bytes, size_t limit = 8) {
  return crypto::to_hex(bytes.subspan(0, std::min(bytes.size(), limit)));
}

std::string shape_json(const Shape& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ',';
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

// Parses what shape_json writes; anything else is nullopt.
std::optional<Shape> parse_shape_json(std::string_view text) {
  if (text.size() < 2 || text.front() != '[' || text.back() != ']') return std::nullopt;
  text = text.substr(1, text.size() - 2);
  Shape shape;
  while (!text.empty()) {
    if (shape.size() >= static_cast<size_t>(kMaxTensorRank)) return std::nullopt;
    int64_t dim = -1;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), dim);
    if (error != std::errc() || dim < 0) return std::nullopt;
    shape.push_back(dim);
    text.remove_prefix(static_cast<size_t>(end - text.data()));
    if (text.empty()) break;
    if (text.front() != ',' || text.size() == 1) return std::nullopt;
    text.remove_prefix(1);
  }
  return shape;
}

int64_t chunks_for(int64_t bytes) { return (bytes + kTensorChunkBytes - 1) / kTensorChunkBytes; }

// Checked element count times element size; nullopt on overflow or beyond the bound.
std::optional<int64_t> shape_bytes(const Shape& shape, DType dtype) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && count > kMaxTensorBytes / dim) return std::nullopt;
    count *= dim;
  }
  const int64_t bytes = count * static_cast<int64_t>(dtype_size(dtype));
  if (bytes > kMaxTensorBytes) return std::nullopt;
  return bytes;
}

std::span<const uint8_t> tensor_bytes(const Tensor& tensor) {
  return {static_cast<const uint8_t*>(tensor.raw()), tensor.nbytes()};
}

bool valid_name(std::string_view name) { return !name.empty() && name.size() <= kMaxNameBytes; }

bool valid_metric_name(std::string_view name) {
  return !name.empty() && name.size() <= 128 &&
         std::all_of(name.begin(), name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

// `json` must be valid JSON of the type `type` ("object", "array").
Status check_json_of_type(Database& database, std::string_view what, const std::string& json, std::string_view type) {
  if (json.size() > kMaxJsonBytes) {
    return invalid_argument(std::string(what) + " JSON is " + std::to_string(json.size()) +
                            " bytes, above the limit of " + std::to_string(kMaxJsonBytes));
  }
  Result<Statement> statement = database.prepare("SELECT CASE WHEN json_valid(?1) THEN json_type(?1) = ?2 ELSE 0 END");
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, std::string_view(json)).bind(2, type);
  Result<bool> row = statement->step();
  if (!row.is_ok()) return row.status();
  if (!*row || statement->column_int(0) == 0) {
    return invalid_argument(std::string(what) + " must be a JSON " + std::string(type) + ", got '" + json.substr(0, 60) + "'");
  }
  return Status::ok();
}

Status check_json_object(Database& database, std::string_view what, const std::string& json) {
  return check_json_of_type(database, what, json, "object");
}

Status check_json_array(Database& database, std::string_view what, const std::string& json) {
  return check_json_of_type(database, what, json, "array");
}

// Inserts the bytes of `source`, front to back, as rows of at most
// kTensorChunkBytes of `table` through `insert` (parameters: 1 = owner key,
// bound by the caller; 2 = chunk index; 3 = data). Each row is inserted with
// a zeroblob and its bytes written through incremental blob I/O, straight
// into the pages, from the parts where they lie (a row may take parts of
// several pieces). `hasher`, if given, is fed every byte on the way.
Status insert_chunks(Database& database, const char* table, Statement& insert,
                     const std::function<void(Statement&)>& bind_owner, PayloadSource& source,
                     ChecksumHasher* hasher = nullptr) {
  const uint64_t total = source.size();
  std::vector<std::span<const uint8_t>> parts;
  int64_t chunk = 0;
  for (uint64_t offset = 0; offset < total; ++chunk) {
    const size_t size = static_cast<size_t>(std::min<uint64_t>(total - offset, kTensorChunkBytes));
    FEDMESH_RETURN_IF_ERROR(source.next(size, parts));
    if (hasher != nullptr) {
      for (const std::span<const uint8_t> part : parts) hasher->update(part);
    }
    bind_owner(insert);
    insert.bind(2, chunk).bind_zeroblob(3, static_cast<int64_t>(size));
    FEDMESH_RETURN_IF_ERROR(insert.run());
    FEDMESH_RETURN_IF_ERROR(database.write_blob(table, "data", database.last_insert_rowid(), parts));
    offset += size;
  }
  return Status::ok();
}

Status insert_chunks(Database& database, const char* table, Statement& insert,
                     const std::function<void(Statement&)>& bind_owner, std::span<const uint8_t> bytes) {
  const std::span<const uint8_t> pieces[] = {bytes};
  PiecesSource source(pieces);
  return insert_chunks(database, table, insert, bind_owner, source);
}

// Deletes the rounds retention does not keep (their tensors and chunks go
// with them, by cascade); their pages join the free list and are reused.
Status apply_retention(Database& database, const StoreOptions& options) {
  std::string sql =
      "DELETE FROM rounds WHERE round NOT IN (SELECT round FROM rounds ORDER BY round DESC LIMIT ?1)";
  if (!options.best_metric.empty()) {
    // The metric name was checked to be [A-Za-z0-9_]+, so it can be spliced into a JSON path.
    const std::string path = "'$.\"" + options.best_metric + "\"'";
    sql += " AND round IS NOT (SELECT round FROM rounds WHERE json_type(metrics, " + path +
           ") IN ('integer', 'real') ORDER BY json_extract(metrics, " + path + ") " +
           (options.best_is_max ? "DESC" : "ASC") + ", round DESC LIMIT 1)";
  }
  Result<Statement> statement = database.prepare(sql);
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, options.keep_last);
  return statement->run();
}

// One snapshot of the database for the statements of a load. Each statement
// on its own reads the newest commit: retention deleting a round between the
// reads of its record, its tensors' records and their chunks (on the
// maintenance connection, or by the owner while an operator inspects the
// store) would make a round being retired look corrupt. Nested use joins the
// outer snapshot.
class ReadSnapshot {
 public:
  explicit ReadSnapshot(Database& database) : database_(database) {}
  ReadSnapshot(const ReadSnapshot&) = delete;
  ReadSnapshot& operator=(const ReadSnapshot&) = delete;
  ~ReadSnapshot() {
    if (open_) (void)database_.execute("ROLLBACK");  // it only read
  }
  Status begin() {
    if (sqlite3_get_autocommit(database_.handle()) == 0) return Status::ok();
    FEDMESH_RETURN_IF_ERROR(database_.execute("BEGIN"));
    open_ = true;
    return Status::ok();
  }

 private:
  Database& database_;
  bool open_ = false;
};

const char* kSelectTensorColumns =
    "SELECT id, role, name, dtype, shape, encoding, byte_size, chunk_count, checksum FROM tensors ";

}  // namespace

Status StoreOptions::validate() const {
  if (keep_last < 1) return invalid_argument("keep-last must be at least 1 (got " + std::to_string(keep_last) + ")");
  if (!best_metric.empty() && !valid_metric_name(best_metric)) {
    return invalid_argument("best metric '" + best_metric + "' must be a metric name of letters, digits and _");
  }
  return Status::ok();
}

const StoredTensor* LoadedCheckpoint::find(std::string_view role, std::string_view name) const {
  for (const StoredTensor& tensor : tensors) {
    if (tensor.info.role == role && tensor.info.name == name) return &tensor;
  }
  return nullptr;
}

// A thread with its own connection that, each time it is poked after a
// commit, applies retention (its own transaction: deleting a large round
// means walking its pages, which need not delay the commit) and then runs a
// PASSIVE WAL checkpoint, copying committed frames into the database file (a
// PASSIVE checkpoint never blocks a writer). A commit that arrives while the
// retention transaction holds the write lock waits for it (busy timeout).
// Failures are kept and reported by settle().
class CheckpointStore::BackgroundMaintenance {
 public:
  BackgroundMaintenance(Database database, StoreOptions options)
      : database_(std::move(database)), options_(std::move(options)), thread_([this] { run(); }) {}
  ~BackgroundMaintenance() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void poke() {
    {
      std::lock_guard lock(mutex_);
      ++requested_;
    }
    wake_.notify_all();
  }
  // Waits until every poke so far has been served; returns the first failure.
  Status drain() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return served_ == requested_; });
    return std::exchange(failure_, Status::ok());
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || served_ != requested_; });
      if (served_ == requested_ && stopping_) return;
      const uint64_t target = requested_;
      lock.unlock();
      Status s = retain();
      if (s.is_ok()) s = database_.execute("PRAGMA wal_checkpoint(PASSIVE)");
      lock.lock();
      if (!s.is_ok() && failure_.is_ok()) failure_ = s;
      served_ = target;
      idle_.notify_all();
    }
  }

  Status retain() {
    Result<Transaction> transaction = Transaction::begin(database_);
    if (!transaction.is_ok()) return transaction.status();
    FEDMESH_RETURN_IF_ERROR(apply_retention(database_, options_));
    return transaction->commit();
  }

  Database database_;
  StoreOptions options_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  uint64_t requested_ = 0, served_ = 0;
  bool stopping_ = false;
  Status failure_;
  std::thread thread_;  // last: starts after the members it uses exist
};

// An flock on PATH.owner for as long as the store is open. flock locks are
// separate from the POSIX record locks SQLite takes on the database file, and
// this descriptor is of another file, so closing it never drops SQLite's.
class CheckpointStore::OwnerLock {
 public:
  static Result<std::unique_ptr<OwnerLock>> acquire(const std::string& database_path) {
    const std::string path = database_path + ".owner";
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return io_error(path + ": cannot open the owner lock: " + errno_text(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      char pid[32] = {};
      const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
      ::close(fd);
      if (error == EWOULDBLOCK) {
        return unavailable(database_path + " is in use by another process (pid " +
                           std::string(pid, static_cast<size_t>(std::max<ssize_t>(n, 0))) +
                           "): one process owns a checkpoint store at a time; stop it or give another --db");
      }
      return io_error(path + ": cannot lock: " + errno_text(error));
    }
    const std::string text = std::to_string(::getpid());
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
      ::close(fd);
      return io_error(path + ": cannot record the owner's pid: " + errno_text(errno));
    }
    return std::unique_ptr<OwnerLock>(new OwnerLock(fd));
  }
  ~OwnerLock() { ::close(fd_); }
  OwnerLock(const OwnerLock&) = delete;
  OwnerLock& operator=(const OwnerLock&) = delete;

 private:
  explicit OwnerLock(int fd) : fd_(fd) {}
  int fd_;
};

Result<CheckpointStore> CheckpointStore::open(const std::string& path, StoreOptions options) {
  Result<std::unique_ptr<OwnerLock>> owner = OwnerLock::acquire(path);
  if (!owner.is_ok()) return owner.status();
  Result<CheckpointStore> store = open_with(path, std::move(options), Database::Mode::kReadWriteCreate);
  if (!store.is_ok()) return store;
  // An owner writes on top of what it finds: never on a damaged b-tree.
  if (Status check = store->run_check("PRAGMA quick_check"); !check.is_ok()) {
    if (check.code() != StatusCode::kCorrupt) return check;
    return corrupt("SQLite's integrity check of the store failed: " + check.message() +
                   "; the store is not opened for writing. `fedmesh checkpoint verify " + path +
                   "` shows which rounds are intact; restore the store from a backup (or start a new one)");
  }
  store->owner_ = std::move(*owner);
  return store;
}

Result<CheckpointStore> CheckpointStore::open_existing(const std::string& path, StoreOptions options) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return not_found(path + ": no such checkpoint database");
  // SQLite writes beside a store (its -wal and -shm files): the folder too
  // must be writable to open it for writing.
  const std::filesystem::path folder = std::filesystem::absolute(path, error).parent_path();
  const bool writable = ::access(path.c_str(), W_OK) == 0 && ::access(folder.c_str(), W_OK) == 0;
  return open_with(path, std::move(options), writable ? Database::Mode::kReadWrite : Database::Mode::kImmutable);
}

Result<CheckpointStore> CheckpointStore::open_with(const std::string& path, StoreOptions options,
                                                   Database::Mode mode) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  if (sodium_init() < 0) return unavailable("libsodium failed to initialize");
  Result<Database> database = Database::open(path, mode, options.vfs);
  if (!database.is_ok()) return database.status();
  // The first read tells an SQLite file from anything else.
  Result<int64_t> tables = database->query_int("SELECT count(*) FROM sqlite_master");
  if (!tables.is_ok()) {
    return Status(tables.status().code(), tables.status().message() + " (is it a fedmesh checkpoint database?)");
  }
  if (*tables == 0 && mode != Database::Mode::kReadWriteCreate) {
    return invalid_argument(path + ": not a fedmesh checkpoint database (it holds no tables)");
  }
  if (mode == Database::Mode::kImmutable) {
    Result<int> version = schema_version(*database);
    if (!version.is_ok()) return version.status();
    if (*version != kSchemaVersion) {
      return unavailable(path + " is read-only and at schema version " + std::to_string(*version) +
                                 ", not " + std::to_string(kSchemaVersion) +
                                 ": copy it somewhere writable to open it (it is migrated there)");
    }
    return CheckpointStore(nullptr, std::move(*database), std::move(options), nullptr);
  }
  if (*tables == 0) {
    FEDMESH_RETURN_IF_ERROR(database->execute("PRAGMA page_size = " + std::to_string(kNewDatabasePageSize)));
  }
  Result<std::string> journal = database->query_text("PRAGMA journal_mode = WAL");
  if (!journal.is_ok()) return journal.status();
  if (*journal != "wal") return io_error(path + ": cannot switch to WAL mode (journal mode is " + *journal + ")");
  // FULL: every commit fsyncs the write-ahead log, so a committed round
  // survives power loss, not only a process crash. Nothing here relaxes it.
  FEDMESH_RETURN_IF_ERROR(database->execute("PRAGMA synchronous = FULL"));
  FEDMESH_RETURN_IF_ERROR(database->execute("PRAGMA foreign_keys = ON"));
  // Debian builds SQLite with SECURE_DELETE on: every deleted round would be
  // overwritten with zeros through the log (another 400 MB written per
  // retired 100M-parameter round). FAST keeps zeroing only where it costs no
  // extra I/O; the file holds model state, not raw data, and is itself the
  // thing to protect (mode, disk encryption).
  FEDMESH_RETURN_IF_ERROR(database->execute("PRAGMA secure_delete = FAST"));
  FEDMESH_RETURN_IF_ERROR(database->execute("PRAGMA journal_size_limit = " + std::to_string(kWalSizeLimitBytes)));
  std::unique_ptr<BackgroundMaintenance> maintenance;
  if (options.background_maintenance) {
    // Commits only append to the log; the maintenance thread moves it into the database.
    FEDMESH_RETURN_IF_ERROR(database->execute("PRAGMA wal_autocheckpoint = 0"));
    Result<Database> second = Database::open(path, Database::Mode::kReadWrite, options.vfs);
    if (!second.is_ok()) return second.status();
    FEDMESH_RETURN_IF_ERROR(second->execute("PRAGMA foreign_keys = ON"));
    FEDMESH_RETURN_IF_ERROR(second->execute("PRAGMA secure_delete = FAST"));
    FEDMESH_RETURN_IF_ERROR(second->execute("PRAGMA synchronous = FULL"));
    maintenance = std::make_unique<BackgroundMaintenance>(std::move(*second), options);
  }
  FEDMESH_RETURN_IF_ERROR(migrate(*database));
  return CheckpointStore(nullptr, std::move(*database), std::move(options), std::move(maintenance));
}

CheckpointStore::CheckpointStore(std::unique_ptr<OwnerLock> owner, Database database, StoreOptions options,
                                 std::unique_ptr<BackgroundMaintenance> maintenance)
    : owner_(std::move(owner)),
      database_(std::move(database)),
      options_(std::move(options)),
      maintenance_(std::move(maintenance)) {}
CheckpointStore::CheckpointStore(CheckpointStore&&) noexcept = default;
CheckpointStore& CheckpointStore::operator=(CheckpointStore&&) noexcept = default;
CheckpointStore::~CheckpointStore() {
  // Stop the maintenance thread first (it finishes what it was asked to do);
  // then one last copy leaves a short log behind.
  maintenance_.reset();
  if (database_.handle() != nullptr) (void)database_.execute("PRAGMA wal_checkpoint(TRUNCATE)");
}

namespace {

// The rows commit_round writes, one writer per table; each runs inside the
// round's one transaction, which commit_round opens and commits.

// What each tensor of the round will be stored as, its bounds checked.
Result<std::vector<TensorInfo>> describe_round_tensors(const RoundToCommit& round) {
  std::vector<TensorInfo> infos;
  infos.reserve(round.tensors.size());
  for (const TensorToCommit& tensor : round.tensors) {
    if (!valid_name(tensor.role) || !valid_name(tensor.name)) {
      return invalid_argument(round_name(round.round) + ": tensor role and name must be 1.." +
                              std::to_string(kMaxNameBytes) + " bytes");
    }
    if (tensor.tensor == nullptr || !tensor.tensor->defined() || tensor.tensor->device() != Device::kCpu) {
      return invalid_argument(round_name(round.round) + ": tensor " + tensor.role + "/" + tensor.name +
                              " is not a CPU tensor");
    }
    if (tensor.tensor->rank() > kMaxTensorRank || static_cast<int64_t>(tensor.tensor->nbytes()) > kMaxTensorBytes) {
      return invalid_argument(round_name(round.round) + ": tensor " + tensor.role + "/" + tensor.name +
                              " is beyond the store's bounds");
    }
    TensorInfo info;
    info.role = tensor.role;
    info.name = tensor.name;
    info.dtype = tensor.tensor->dtype();
    info.shape = tensor.tensor->shape();
    info.encoding = "raw";
    info.byte_size = static_cast<int64_t>(tensor.tensor->nbytes());
    info.chunk_count = chunks_for(info.byte_size);
    infos.push_back(std::move(info));
  }
  return infos;
}

// rounds (its checksum filled in later) and round_log, which keeps the
// round's metrics after retention drops the round.
Status write_round_row(Database& database, const RoundToCommit& round, size_t tensor_count) {
  Result<Statement> insert_round = database.prepare(
      "INSERT INTO rounds(round, model_version, wall_time, metrics, state, tensor_count, checksum) "
      "VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), ?3, ?4, ?5, zeroblob(32))");
  if (!insert_round.is_ok()) return insert_round.status();
  insert_round->bind(1, round.round)
      .bind(2, round.model_version)
      .bind(3, std::string_view(round.metrics_json))
      .bind(4, std::string_view(round.state_json))
      .bind(5, static_cast<int64_t>(tensor_count));
  FEDMESH_RETURN_IF_ERROR(insert_round->run());
  // A round number committed again after its round was quarantined (a
  // trainer redoing its steps) replaces its log entry: the log describes the
  // round the store holds, the quarantine keeps the other.
  Result<Statement> log_round = database.prepare(
      "INSERT OR REPLACE INTO round_log(round, model_version, wall_time, metrics) "
      "SELECT round, model_version, wall_time, metrics FROM rounds WHERE round = ?1");
  if (!log_round.is_ok()) return log_round.status();
  log_round->bind(1, round.round);
  return log_round->run();
}

// tensors and tensor_chunks (checksums filled in later); sets each info's id.
Status write_tensors(Database& database, const RoundToCommit& round, std::vector<TensorInfo>& infos) {
  Result<Statement> insert_tensor = database.prepare(
      "INSERT INTO tensors(round, role, name, dtype, shape, encoding, byte_size, chunk_count, checksum) "
      "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, zeroblob(32))");
  if (!insert_tensor.is_ok()) return insert_tensor.status();
  Result<Statement> insert_chunk =
      database.prepare("INSERT INTO tensor_chunks(tensor_id, chunk, data) VALUES (?1, ?2, ?3)");
  if (!insert_chunk.is_ok()) return insert_chunk.status();
  for (size_t i = 0; i < infos.size(); ++i) {
    TensorInfo& info = infos[i];
    const std::string shape = shape_json(info.shape);
    insert_tensor->bind(1, round.round)
        .bind(2, std::string_view(info.role))
        .bind(3, std::string_view(info.name))
        .bind(4, std::string_view(dtype_name(info.dtype)))
        .bind(5, std::string_view(shape))
        .bind(6, std::string_view(info.encoding))
        .bind(7, info.byte_size)
        .bind(8, info.chunk_count);
    if (Status s = insert_tensor->run(); !s.is_ok()) {
      if (s.code() == StatusCode::kInvalidArgument) {
        return invalid_argument(round_name(round.round) + ": tensor " + info.role + "/" + info.name +
                                " appears twice");
      }
      return s;
    }
    info.id = database.last_insert_rowid();
    const int64_t id = info.id;
    FEDMESH_RETURN_IF_ERROR(insert_chunks(database, "tensor_chunks", *insert_chunk,
                                          [id](Statement& s) { s.bind(1, id); }, tensor_bytes(*round.tensors[i].tensor)));
  }
  return Status::ok();
}

// applied_updates, and the applied updates out of pending_updates.
Status write_applied_updates(Database& database, const RoundToCommit& round) {
  Result<Statement> insert_applied = database.prepare(
      "INSERT INTO applied_updates(update_id, round, sender, staleness) VALUES (?1, ?2, ?3, ?4)");
  if (!insert_applied.is_ok()) return insert_applied.status();
  Result<Statement> delete_pending = database.prepare("DELETE FROM pending_updates WHERE update_id = ?1");
  if (!delete_pending.is_ok()) return delete_pending.status();
  for (const AppliedUpdate& update : round.applied_updates) {
    if (update.update_id.empty() || update.update_id.size() > kMaxNameBytes) {
      return invalid_argument("an applied update id must be 1.." + std::to_string(kMaxNameBytes) + " bytes");
    }
    insert_applied->bind_blob(1, update.update_id)
        .bind(2, round.round)
        .bind(3, std::string_view(update.sender))
        .bind(4, update.staleness);
    if (Status s = insert_applied->run(); !s.is_ok()) {
      if (s.code() != StatusCode::kInvalidArgument) return s;  // not the caller's list: the disk, an interrupt
      return invalid_argument(round_name(round.round) + ": update " + hex(update.update_id) +
                              " is listed twice in the round");
    }
    delete_pending->bind_blob(1, update.update_id);
    FEDMESH_RETURN_IF_ERROR(delete_pending->run());
  }
  return Status::ok();
}

// peers: a gossip node's membership as of this round, replacing the last.
Status write_peers(Database& database, const std::vector<PeerRecord>& peers) {
  FEDMESH_RETURN_IF_ERROR(database.execute("DELETE FROM peers"));
  Result<Statement> insert_peer = database.prepare(
      "INSERT INTO peers(site, address, status, incarnation, updated_round) VALUES (?1, ?2, ?3, ?4, ?5)");
  if (!insert_peer.is_ok()) return insert_peer.status();
  for (const PeerRecord& peer : peers) {
    if (!valid_name(peer.site) || peer.address.size() > kMaxNameBytes) {
      return invalid_argument("peer '" + peer.site.substr(0, 64) + "': site must be 1.." +
                              std::to_string(kMaxNameBytes) + " bytes");
    }
    if (peer.status != "alive" && peer.status != "suspect" && peer.status != "dead" && peer.status != "left") {
      return invalid_argument("peer " + peer.site + ": status '" + peer.status +
                              "' is not alive, suspect, dead or left");
    }
    insert_peer->bind(1, std::string_view(peer.site))
        .bind(2, std::string_view(peer.address))
        .bind(3, std::string_view(peer.status))
        .bind(4, peer.incarnation)
        .bind(5, peer.updated_round);
    if (Status s = insert_peer->run(); !s.is_ok()) {
      if (s.code() != StatusCode::kInvalidArgument) return s;
      return invalid_argument("peer " + peer.site + " is listed twice");
    }
  }
  return Status::ok();
}

// replay_counters: each sender's highest sequence, only ever raised.
// Sequences are uint64 stored as int64 (two's complement): compared as
// unsigned, so a counter at or above 2^63 is never "raised" to a small one.
Result<Statement> prepare_raise_counter(Database& database) {
  return database.prepare(
      "INSERT INTO replay_counters(sender, sequence) VALUES (?1, ?2) "
      "ON CONFLICT(sender) DO UPDATE SET sequence = CASE "
      "WHEN (sequence < 0) = (excluded.sequence < 0) THEN max(sequence, excluded.sequence) "
      "WHEN excluded.sequence < 0 THEN excluded.sequence ELSE sequence END");
}

Status raise_replay_counters(Database& database, const RoundToCommit& round) {
  Result<Statement> raise_counter = prepare_raise_counter(database);
  if (!raise_counter.is_ok()) return raise_counter.status();
  for (const auto& [sender, sequence] : round.replay_counters) {
    if (!valid_name(sender)) return invalid_argument("a replay counter's sender must be 1..1024 bytes");
    raise_counter->bind(1, std::string_view(sender)).bind(2, static_cast<int64_t>(sequence));
    FEDMESH_RETURN_IF_ERROR(raise_counter->run());
  }
  return Status::ok();
}

}  // namespace

Status CheckpointStore::commit_round(const RoundToCommit& round) {
  if (round.round < 0 || round.model_version < 0) return invalid_argument("round and model version must be >= 0");
  if (static_cast<int64_t>(round.tensors.size()) > kMaxTensorsPerRound) {
    return invalid_argument(round_name(round.round) + ": more than " + std::to_string(kMaxTensorsPerRound) + " tensors");
  }
  FEDMESH_RETURN_IF_ERROR(check_json_object(database_, "metrics", round.metrics_json));
  FEDMESH_RETURN_IF_ERROR(check_json_object(database_, "state", round.state_json));
  Result<std::vector<TensorInfo>> described = describe_round_tensors(round);
  if (!described.is_ok()) return described.status();
  std::vector<TensorInfo>& infos = *described;

  // The previous commit's retention and log copy finish first: they are at
  // most one commit behind, so the store never holds more than keep_last + 1
  // rounds besides the best, however fast commits come.
  if (maintenance_) {
    if (Status s = maintenance_->drain(); !s.is_ok()) {
      return Status(s.code(), "the store's background retention or log copy failed: " + s.message());
    }
  }
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<int64_t> newest = database_.query_int("SELECT coalesce(max(round), -1) FROM rounds");
  if (!newest.is_ok()) return newest.status();
  if (round.round <= *newest) {
    return invalid_argument(round_name(round.round) + " is not above the newest committed round " +
                            std::to_string(*newest) + ": rounds only move forward");
  }
  for (const AppliedUpdate& update : round.applied_updates) {
    Result<std::optional<int64_t>> applied = applied_round(update.update_id);
    if (!applied.is_ok()) return applied.status();
    if (applied->has_value()) {
      return invalid_argument("update " + hex(update.update_id) + " from " + update.sender +
                              " was already applied in round " + std::to_string(**applied) +
                              "; it is never applied twice");
    }
  }

  // Hash on a second thread while this one hands the same bytes to SQLite.
  auto hashes = std::async(std::launch::async, [&round] {
    std::vector<crypto::Hash> result;
    result.reserve(round.tensors.size());
    for (const TensorToCommit& tensor : round.tensors) result.push_back(crypto::tree_hash(tensor_bytes(*tensor.tensor)));
    return result;
  });
  // Whatever happens below, the hashing thread is joined before `round` can go away.
  struct JoinOnExit {
    std::future<std::vector<crypto::Hash>>& future;
    ~JoinOnExit() {
      if (future.valid()) future.wait();
    }
  } join_on_exit{hashes};

  FEDMESH_RETURN_IF_ERROR(write_round_row(database_, round, infos.size()));
  FEDMESH_RETURN_IF_ERROR(write_tensors(database_, round, infos));
  FEDMESH_RETURN_IF_ERROR(write_checksums(round, infos, hashes.get()));
  FEDMESH_RETURN_IF_ERROR(write_applied_updates(database_, round));
  if (round.peers.has_value()) FEDMESH_RETURN_IF_ERROR(write_peers(database_, *round.peers));
  FEDMESH_RETURN_IF_ERROR(raise_replay_counters(database_, round));
  if (round.privacy.has_value()) FEDMESH_RETURN_IF_ERROR(insert_privacy_entry(round.round, *round.privacy));

  if (!maintenance_) FEDMESH_RETURN_IF_ERROR(apply_retention(database_, options_));
  FEDMESH_RETURN_IF_ERROR(transaction->commit());
  if (maintenance_) maintenance_->poke();
  return Status::ok();
}

// The tensors' checksums (hashed beside the writes) and the round's, which
// covers its row and every tensor's.
Status CheckpointStore::write_checksums(const RoundToCommit& round, std::vector<TensorInfo>& infos,
                                        const std::vector<crypto::Hash>& checksums) {
  Result<Statement> set_tensor_checksum = database_.prepare("UPDATE tensors SET checksum = ?2 WHERE id = ?1");
  if (!set_tensor_checksum.is_ok()) return set_tensor_checksum.status();
  for (size_t i = 0; i < infos.size(); ++i) {
    infos[i].checksum = checksums[i];
    infos[i].checksum_kind = crypto::ChunkHash::kBlake2bp;
    const std::vector<uint8_t> stored = stored_checksum(infos[i]);
    set_tensor_checksum->bind(1, infos[i].id).bind_blob(2, stored);
    FEDMESH_RETURN_IF_ERROR(set_tensor_checksum->run());
  }
  RoundInfo info;
  info.round = round.round;
  info.model_version = round.model_version;
  info.metrics_json = round.metrics_json;
  info.state_json = round.state_json;
  Result<crypto::Hash> checksum = round_checksum(info, infos);
  if (!checksum.is_ok()) return checksum.status();
  Result<Statement> set_round_checksum = database_.prepare("UPDATE rounds SET checksum = ?2 WHERE round = ?1");
  if (!set_round_checksum.is_ok()) return set_round_checksum.status();
  set_round_checksum->bind(1, round.round).bind_blob(2, *checksum);
  return set_round_checksum->run();
}

Result<crypto::Hash> CheckpointStore::round_checksum(const RoundInfo& round, const std::vector<TensorInfo>& tensors) {
  crypto::Hasher hasher;
  hasher.update_text("fedmesh-round-v1");
  hasher.update_u64(static_cast<uint64_t>(round.round));
  hasher.update_u64(static_cast<uint64_t>(round.model_version));
  hasher.update_text(round.metrics_json);
  hasher.update_text(round.state_json);
  hasher.update_u64(tensors.size());
  for (const TensorInfo& tensor : tensors) {
    hasher.update_text(tensor.role);
    hasher.update_text(tensor.name);
    hasher.update_text(dtype_name(tensor.dtype));
    hasher.update_text(shape_json(tensor.shape));
    hasher.update_text(tensor.encoding);
    hasher.update_u64(static_cast<uint64_t>(tensor.byte_size));
    hasher.update(tensor.checksum);
    // Rounds of BLAKE2b tensors hash as they always did.
    if (tensor.checksum_kind == crypto::ChunkHash::kBlake2bp) hasher.update_text("blake2bp");
  }
  return hasher.finish();
}

Result<std::vector<RoundInfo>> CheckpointStore::rounds() {
  Result<Statement> statement = database_.prepare(
      "SELECT r.round, r.model_version, r.wall_time, r.metrics, r.state, r.tensor_count, "
      "(SELECT coalesce(sum(t.byte_size), 0) FROM tensors t WHERE t.round = r.round) "
      "FROM rounds r ORDER BY r.round");
  if (!statement.is_ok()) return statement.status();
  std::vector<RoundInfo> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    RoundInfo info;
    info.round = statement->column_int(0);
    info.model_version = statement->column_int(1);
    info.wall_time = statement->column_text(2);
    info.metrics_json = statement->column_text(3);
    info.state_json = statement->column_text(4);
    info.tensor_count = statement->column_int(5);
    info.byte_size = statement->column_int(6);
    result.push_back(std::move(info));
  }
  return result;
}

Result<RoundInfo> CheckpointStore::round_info(int64_t round) {
  Result<std::vector<RoundInfo>> all = rounds();
  if (!all.is_ok()) return all.status();
  for (RoundInfo& info : *all) {
    if (info.round == round) return std::move(info);
  }
  return not_found(path() + ": no committed " + round_name(round) + " (`fedmesh checkpoint list " + path() +
                   "` shows the rounds kept)");
}

Result<TensorInfo> CheckpointStore::read_tensor_info(Statement& statement) {
  TensorInfo info;
  info.id = statement.column_int(0);
  info.role = statement.column_text(1);
  info.name = statement.column_text(2);
  const std::string what = "tensor " + info.role + "/" + info.name;
  Result<DType> dtype = parse_dtype(statement.column_text(3));
  if (!dtype.is_ok()) return corrupt(what + ": unknown dtype '" + statement.column_text(3) + "'");
  info.dtype = *dtype;
  std::optional<Shape> shape = parse_shape_json(statement.column_text(4));
  if (!shape) return corrupt(what + ": malformed shape '" + statement.column_text(4).substr(0, 64) + "'");
  info.shape = std::move(*shape);
  info.encoding = statement.column_text(5);
  if (info.encoding != "raw") return corrupt(what + ": unknown encoding '" + info.encoding.substr(0, 64) + "'");
  info.byte_size = statement.column_int(6);
  info.chunk_count = statement.column_int(7);
  const std::optional<int64_t> expected = shape_bytes(info.shape, info.dtype);
  if (!expected || *expected != info.byte_size) {
    return corrupt(what + ": byte size " + std::to_string(info.byte_size) + " does not match shape " +
                   shape_json(info.shape) + " of " + dtype_name(info.dtype) + " (or exceeds the store's bounds)");
  }
  if (info.chunk_count != chunks_for(info.byte_size)) {
    return corrupt(what + ": " + std::to_string(info.chunk_count) + " chunks recorded for " +
                   std::to_string(info.byte_size) + " bytes");
  }
  const std::span<const uint8_t> checksum = statement.column_blob(8);
  const std::optional<StoredChecksum> parsed = parse_checksum_blob(checksum);
  if (!parsed) return corrupt(what + ": " + checksum_size_problem(checksum.size()));
  info.checksum_kind = parsed->kind;
  info.checksum = parsed->hash;
  return info;
}

Result<std::vector<TensorInfo>> CheckpointStore::tensors(int64_t round) {
  Result<Statement> statement = database_.prepare(std::string(kSelectTensorColumns) + "WHERE round = ?1 ORDER BY id");
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, round);
  std::vector<TensorInfo> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    Result<TensorInfo> info = read_tensor_info(*statement);
    if (!info.is_ok()) return corrupt(round_name(round) + ": " + info.status().message());
    result.push_back(std::move(*info));
  }
  return result;
}

Status CheckpointStore::read_tensor(const TensorInfo& tensor,
                                    const std::function<Status(std::span<const uint8_t>)>& consume) {
  const std::string what = "tensor " + tensor.role + "/" + tensor.name;
  Result<Statement> statement =
      database_.prepare("SELECT chunk, data FROM tensor_chunks WHERE tensor_id = ?1 ORDER BY chunk");
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, tensor.id);
  ChecksumHasher hasher(tensor.checksum_kind);
  int64_t expected_chunk = 0, bytes = 0;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    const int64_t chunk = statement->column_int(0);
    const std::span<const uint8_t> data = statement->column_blob(1);
    if (chunk != expected_chunk) {
      return corrupt(what + ": chunk " + std::to_string(expected_chunk) + " is missing (found " +
                     std::to_string(chunk) + ")");
    }
    if (static_cast<int64_t>(data.size()) > kTensorChunkBytes || bytes + static_cast<int64_t>(data.size()) > tensor.byte_size) {
      return corrupt(what + ": chunk " + std::to_string(chunk) + " holds more bytes than recorded");
    }
    hasher.update(data);
    FEDMESH_RETURN_IF_ERROR(consume(data));
    bytes += static_cast<int64_t>(data.size());
    ++expected_chunk;
  }
  if (expected_chunk != tensor.chunk_count || bytes != tensor.byte_size) {
    return corrupt(what + ": " + std::to_string(bytes) + " bytes in " + std::to_string(expected_chunk) +
                   " chunks, recorded " + std::to_string(tensor.byte_size) + " in " +
                   std::to_string(tensor.chunk_count));
  }
  const crypto::Hash computed = hasher.finish();
  if (computed != tensor.checksum) {
    return corrupt(what + ": checksum mismatch (recorded " + hex(tensor.checksum) + "..., computed " +
                   hex(computed) + "...): its bytes changed on disk");
  }
  return Status::ok();
}

Status CheckpointStore::verify_round(int64_t round) {
  Result<LoadedCheckpoint> loaded = load_round(round);
  return loaded.status();
}

Result<LoadedCheckpoint> CheckpointStore::load_round(int64_t round) {
  ReadSnapshot snapshot(database_);
  FEDMESH_RETURN_IF_ERROR(snapshot.begin());
  Result<RoundInfo> info = round_info(round);
  if (!info.is_ok()) return info.status();
  Result<std::vector<TensorInfo>> infos = tensors(round);
  if (!infos.is_ok()) return infos.status();
  LoadedCheckpoint checkpoint;
  if (static_cast<int64_t>(infos->size()) != info->tensor_count) {
    return corrupt(round_name(round) + ": " + std::to_string(infos->size()) + " tensors found, " +
                   std::to_string(info->tensor_count) + " recorded");
  }
  Result<Statement> stored = database_.prepare("SELECT checksum FROM rounds WHERE round = ?1");
  if (!stored.is_ok()) return stored.status();
  stored->bind(1, round);
  Result<bool> row = stored->step();
  if (!row.is_ok()) return row.status();
  if (!*row) return not_found(round_name(round) + " vanished while loading");
  const std::span<const uint8_t> stored_checksum = stored->column_blob(0);
  Result<crypto::Hash> computed = round_checksum(*info, *infos);
  if (!computed.is_ok()) return computed.status();
  if (stored_checksum.size() != computed->size() ||
      std::memcmp(stored_checksum.data(), computed->data(), computed->size()) != 0) {
    return corrupt(round_name(round) + ": round checksum mismatch: its metrics, state or tensor records changed");
  }
  checkpoint.tensors.reserve(infos->size());
  for (TensorInfo& tensor : *infos) {
    StoredTensor stored_tensor;
    stored_tensor.value = Tensor::empty(tensor.shape, tensor.dtype);
    auto* destination = static_cast<uint8_t*>(stored_tensor.value.raw());
    size_t offset = 0;
    Status s = read_tensor(tensor, [&](std::span<const uint8_t> data) {
      if (data.empty()) return Status::ok();  // an empty blob has no pointer to copy from
      std::memcpy(destination + offset, data.data(), data.size());
      offset += data.size();
      return Status::ok();
    });
    // Keeps the code: a read that failed for another reason (I/O, an
    // interrupt) is not a corrupt round for load_latest() to skip.
    if (!s.is_ok()) return Status(s.code(), round_name(round) + ": " + s.message());
    stored_tensor.info = std::move(tensor);
    checkpoint.tensors.push_back(std::move(stored_tensor));
  }
  checkpoint.round = std::move(*info);
  return checkpoint;
}

Result<LoadedCheckpoint> CheckpointStore::load_latest(std::vector<Status>* skipped) {
  ReadSnapshot snapshot(database_);
  FEDMESH_RETURN_IF_ERROR(snapshot.begin());
  Result<std::vector<RoundInfo>> all = rounds();
  if (!all.is_ok()) return all.status();
  for (auto it = all->rbegin(); it != all->rend(); ++it) {
    Result<LoadedCheckpoint> loaded = load_round(it->round);
    if (loaded.is_ok()) return loaded;
    if (loaded.status().code() != StatusCode::kCorrupt) return loaded.status();
    if (skipped != nullptr) skipped->push_back(loaded.status());
  }
  if (all->empty()) return not_found(path() + ": no committed checkpoint yet");
  return corrupt(path() + ": every one of the " + std::to_string(all->size()) + " checkpoints kept is corrupt");
}

Result<LoadedCheckpoint> CheckpointStore::load_latest(const std::function<void(const std::string& warning)>& warn) {
  std::vector<Status> skipped;
  Result<LoadedCheckpoint> latest = load_latest(&skipped);
  for (const Status& s : skipped) warn("skipping corrupt checkpoint: " + s.message());
  return latest;
}

Status CheckpointStore::set_meta(const std::string& key, const std::string& value) {
  if (!valid_name(key) || value.size() > kMaxJsonBytes) return invalid_argument("meta key or value out of bounds");
  Result<Statement> statement = database_.prepare(
      "INSERT INTO meta(key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = excluded.value");
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, std::string_view(key)).bind(2, std::string_view(value));
  return statement->run();
}

Result<std::optional<std::string>> CheckpointStore::meta(const std::string& key) {
  Result<Statement> statement = database_.prepare("SELECT value FROM meta WHERE key = ?1");
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, std::string_view(key));
  Result<bool> row = statement->step();
  if (!row.is_ok()) return row.status();
  if (!*row) return std::optional<std::string>();
  return std::optional<std::string>(statement->column_text(0));
}

Status CheckpointStore::add_pending_update(const PendingUpdate& update, std::span<const uint8_t> payload) {
  const std::span<const uint8_t> pieces[] = {payload};
  return add_pending_update_in_pieces(update, pieces);
}

Status CheckpointStore::add_pending_update_in_pieces(const PendingUpdate& update,
                                                     std::span<const std::span<const uint8_t>> pieces) {
  PiecesSource source(pieces);
  return add_pending_update_from(update, source);
}

Status CheckpointStore::add_pending_update_from(const PendingUpdate& update, PayloadSource& source) {
  const uint64_t payload_size = source.size();
  if (update.update_id.empty() || update.update_id.size() > kMaxNameBytes || !valid_name(update.sender)) {
    return invalid_argument("a pending update needs an id and a sender of 1.." + std::to_string(kMaxNameBytes) +
                            " bytes");
  }
  if (payload_size > static_cast<uint64_t>(kMaxUpdateBytes)) {
    return invalid_argument("update " + hex(update.update_id) + " is " + std::to_string(payload_size) +
                            " bytes, above the limit of " + std::to_string(kMaxUpdateBytes));
  }
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<std::optional<int64_t>> applied = applied_round(update.update_id);
  if (!applied.is_ok()) return applied.status();
  if (applied->has_value()) {
    return invalid_argument("update " + hex(update.update_id) + " from " + update.sender +
                            " was already applied in round " + std::to_string(**applied));
  }
  Result<Statement> existing = database_.prepare("SELECT checksum FROM pending_updates WHERE update_id = ?1");
  if (!existing.is_ok()) return existing.status();
  existing->bind_blob(1, update.update_id);
  Result<bool> row = existing->step();
  if (!row.is_ok()) return row.status();
  const bool already_pending = *row;
  if (already_pending) {
    // A retransmission after a crash or a lost acknowledgement: same id, same
    // bytes (hashed here in a pass of their own; a new update is hashed as
    // it is written).
    const std::optional<StoredChecksum> stored = parse_checksum_blob(existing->column_blob(0));
    if (!stored) {
      return corrupt("update " + hex(update.update_id) + " is pending with a damaged record: " +
                     checksum_size_problem(existing->column_blob(0).size()));
    }
    ChecksumHasher hasher(stored->kind);
    std::vector<std::span<const uint8_t>> parts;
    source.rewind();
    for (uint64_t at = 0; at < payload_size;) {
      const size_t size = static_cast<size_t>(std::min<uint64_t>(payload_size - at, kTensorChunkBytes));
      FEDMESH_RETURN_IF_ERROR(source.next(size, parts));
      for (const std::span<const uint8_t> part : parts) hasher.update(part);
      at += size;
    }
    if (hasher.finish() != stored->hash) {
      return invalid_argument("update " + hex(update.update_id) + " from " + update.sender +
                              " is already pending with different bytes");
    }
  }
  existing->reset();
  if (update.replay_sequence > 0) {
    Result<Statement> raise = prepare_raise_counter(database_);
    if (!raise.is_ok()) return raise.status();
    const std::string& counter = update.replay_key.empty() ? update.sender : update.replay_key;
    if (!valid_name(counter)) return invalid_argument("a replay counter's key must be 1..1024 bytes");
    raise->bind(1, std::string_view(counter)).bind(2, static_cast<int64_t>(update.replay_sequence));
    FEDMESH_RETURN_IF_ERROR(raise->run());
  }
  if (already_pending) return transaction->commit();
  // The checksum is known once the rows are written: the record holds a
  // placeholder until then, inside the same transaction.
  Result<Statement> insert = database_.prepare(
      "INSERT INTO pending_updates(update_id, sender, base_version, sample_count, received_at, byte_size, "
      "chunk_count, checksum) VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), ?5, ?6, ?7)");
  if (!insert.is_ok()) return insert.status();
  const std::vector<uint8_t> placeholder = checksum_blob({kPendingChecksum, crypto::Hash{}});
  insert->bind_blob(1, update.update_id)
      .bind(2, std::string_view(update.sender))
      .bind(3, update.base_version)
      .bind(4, update.sample_count)
      .bind(5, static_cast<int64_t>(payload_size))
      .bind(6, chunks_for(static_cast<int64_t>(payload_size)))
      .bind_blob(7, placeholder);
  FEDMESH_RETURN_IF_ERROR(insert->run());
  Result<Statement> insert_chunk =
      database_.prepare("INSERT INTO pending_update_chunks(update_id, chunk, data) VALUES (?1, ?2, ?3)");
  if (!insert_chunk.is_ok()) return insert_chunk.status();
  const std::span<const uint8_t> id = update.update_id;
  ChecksumHasher hasher(kPendingChecksum);
  source.rewind();
  FEDMESH_RETURN_IF_ERROR(insert_chunks(database_, "pending_update_chunks", *insert_chunk,
                                        [id](Statement& s) { s.bind_blob(1, id); }, source, &hasher));
  const std::vector<uint8_t> checksum = checksum_blob({kPendingChecksum, hasher.finish()});
  Result<Statement> set_checksum = database_.prepare("UPDATE pending_updates SET checksum = ?1 WHERE update_id = ?2");
  if (!set_checksum.is_ok()) return set_checksum.status();
  set_checksum->bind_blob(1, checksum).bind_blob(2, update.update_id);
  FEDMESH_RETURN_IF_ERROR(set_checksum->run());
  return transaction->commit();
}

Status CheckpointStore::clear_pending_updates() {
  Result<Statement> clear = database_.prepare("DELETE FROM pending_updates");
  if (!clear.is_ok()) return clear.status();
  return clear->run();
}

Result<std::vector<PendingUpdate>> CheckpointStore::pending_updates() {
  Result<Statement> statement = database_.prepare(
      "SELECT update_id, sender, base_version, sample_count, received_at, byte_size FROM pending_updates "
      "ORDER BY rowid");
  if (!statement.is_ok()) return statement.status();
  std::vector<PendingUpdate> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    PendingUpdate update;
    const std::span<const uint8_t> id = statement->column_blob(0);
    update.update_id.assign(id.begin(), id.end());
    update.sender = statement->column_text(1);
    update.base_version = statement->column_int(2);
    update.sample_count = statement->column_int(3);
    update.received_at = statement->column_text(4);
    update.byte_size = statement->column_int(5);
    result.push_back(std::move(update));
  }
  return result;
}

Result<PendingStream> CheckpointStore::open_pending_stream(std::span<const uint8_t> update_id) {
  PendingStream stream;
  stream.update_id_.assign(update_id.begin(), update_id.end());
  stream.what_ = "pending update " + hex(update_id);
  Result<Statement> header =
      database_.prepare("SELECT byte_size, chunk_count, checksum FROM pending_updates WHERE update_id = ?1");
  if (!header.is_ok()) return header.status();
  header->bind_blob(1, update_id);
  Result<bool> row = header->step();
  if (!row.is_ok()) return row.status();
  if (!*row) return not_found(stream.what_ + " is not in the store");
  stream.size_ = header->column_int(0);
  const std::optional<StoredChecksum> checksum = parse_checksum_blob(header->column_blob(2));
  if (stream.size_ < 0 || stream.size_ > kMaxUpdateBytes || header->column_int(1) != chunks_for(stream.size_) ||
      !checksum) {
    return corrupt(stream.what_ + ": its record is out of bounds");
  }
  stream.expected_ = *checksum;
  Result<Statement> rows =
      database_.prepare("SELECT chunk, data FROM pending_update_chunks WHERE update_id = ?1 ORDER BY chunk");
  if (!rows.is_ok()) return rows.status();
  stream.rows_ = std::move(*rows);
  stream.rows_.bind_blob(1, stream.update_id_);
  return stream;
}

Status PendingStream::next_row() {
  if (!hasher_) hasher_ = std::make_unique<ChecksumHasher>(expected_.kind);
  Result<bool> row = rows_.step();
  if (!row.is_ok()) return row.status();
  if (!*row) {
    return corrupt(what_ + ": it ends after " + std::to_string(fetched_) + " bytes, its record says " +
                   std::to_string(size_));
  }
  row_ = rows_.column_blob(1);
  if (rows_.column_int(0) != next_chunk_ || static_cast<int64_t>(row_.size()) > kTensorChunkBytes ||
      fetched_ + static_cast<int64_t>(row_.size()) > size_) {
    return corrupt(what_ + ": chunk " + std::to_string(next_chunk_) + " is missing or oversized");
  }
  hasher_->update(row_);
  fetched_ += static_cast<int64_t>(row_.size());
  ++next_chunk_;
  return Status::ok();
}

Status PendingStream::read(std::span<uint8_t> out) {
  while (!out.empty()) {
    if (row_.empty()) FEDMESH_RETURN_IF_ERROR(next_row());
    const size_t take = std::min(out.size(), row_.size());
    if (take == 0) continue;  // an empty row (its data() may be null, which memcpy must not get): the next
    std::memcpy(out.data(), row_.data(), take);
    out = out.subspan(take);
    row_ = row_.subspan(take);
  }
  return Status::ok();
}

Status PendingStream::finish() {
  Status status;
  while (status.is_ok() && fetched_ < size_) status = next_row();
  if (status.is_ok()) {
    Result<bool> extra = rows_.step();  // nothing past the recorded size
    if (!extra.is_ok()) status = extra.status();
    else if (*extra) status = corrupt(what_ + ": it holds more rows than its record says");
  }
  if (status.is_ok()) {
    if (!hasher_) hasher_ = std::make_unique<ChecksumHasher>(expected_.kind);  // an empty payload
    if (hasher_->finish() != expected_.hash) status = corrupt(what_ + ": its bytes do not match the recorded size and checksum");
  }
  rewind();
  return status;
}

void PendingStream::rewind() {
  rows_.reset();
  rows_.bind_blob(1, update_id_);
  hasher_.reset();
  row_ = {};
  next_chunk_ = fetched_ = 0;
}

Result<std::vector<uint8_t>> CheckpointStore::read_pending_update(std::span<const uint8_t> update_id) {
  Result<PendingStream> stream = open_pending_stream(update_id);
  if (!stream.is_ok()) return stream.status();
  std::vector<uint8_t> payload(static_cast<size_t>(stream->size()));
  Status read = stream->read(payload);
  const Status finished = stream->finish();
  if (!read.is_ok()) return read;
  if (!finished.is_ok()) return finished;
  return payload;
}

Status CheckpointStore::verify_pending_updates(std::vector<DamagedPending>* damaged) {
  Result<std::vector<PendingUpdate>> pending = pending_updates();
  if (!pending.is_ok()) return pending.status();
  int64_t bad = 0;
  std::string first;
  for (const PendingUpdate& update : *pending) {
    Result<std::vector<uint8_t>> bytes = read_pending_update(update.update_id);
    if (bytes.is_ok()) continue;
    if (bytes.status().code() != StatusCode::kCorrupt) return bytes.status();
    if (++bad == 1) first = bytes.status().message();
    if (damaged != nullptr) damaged->push_back({update.update_id, update.sender, bytes.status().message()});
  }
  if (bad == 0) return Status::ok();
  return corrupt(std::to_string(bad) + " damaged pending update(s), the first: " + first);
}

Result<std::optional<int64_t>> CheckpointStore::applied_round(std::span<const uint8_t> update_id) {
  Result<Statement> statement = database_.prepare("SELECT round FROM applied_updates WHERE update_id = ?1");
  if (!statement.is_ok()) return statement.status();
  statement->bind_blob(1, update_id);
  Result<bool> row = statement->step();
  if (!row.is_ok()) return row.status();
  if (!*row) return std::optional<int64_t>();
  return std::optional<int64_t>(statement->column_int(0));
}

Result<std::vector<PeerRecord>> CheckpointStore::peers() {
  Result<Statement> statement =
      database_.prepare("SELECT site, address, status, incarnation, updated_round FROM peers ORDER BY site");
  if (!statement.is_ok()) return statement.status();
  std::vector<PeerRecord> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    result.push_back({statement->column_text(0), statement->column_text(1), statement->column_text(2),
                      statement->column_int(3), statement->column_int(4)});
  }
  return result;
}

Status CheckpointStore::insert_privacy_entry(int64_t round, const PrivacyEntry& entry) {
  const std::string what = "privacy ledger entry of round " + std::to_string(round);
  if (entry.round != round) return invalid_argument(what + ": it names round " + std::to_string(entry.round));
  if (!is_privacy_mechanism(entry.mechanism)) {
    return invalid_argument(what + ": mechanism '" + entry.mechanism.substr(0, 64) +
                            "' is not dp-sgd, dp-fedavg, gossip-local, dp-sgd-seeded or dp-fedavg-seeded");
  }
  if (!(entry.sampling_rate >= 0.0 && entry.sampling_rate <= 1.0) || !(entry.noise_multiplier >= 0.0) ||
      entry.steps < 0 || !(entry.epsilon >= 0.0) || !(entry.delta > 0.0 && entry.delta < 1.0)) {
    return invalid_argument(what + ": q in [0, 1], sigma >= 0, steps >= 0, epsilon >= 0 and delta in (0, 1) are required");
  }
  FEDMESH_RETURN_IF_ERROR(check_json_array(database_, "rdp", entry.rdp_json));
  Result<Statement> last = database_.prepare("SELECT epsilon, delta FROM privacy_ledger ORDER BY round DESC LIMIT 1");
  if (!last.is_ok()) return last.status();
  Result<bool> row = last->step();
  if (!row.is_ok()) return row.status();
  if (*row && entry.epsilon < last->column_double(0)) {
    return invalid_argument(what + ": epsilon " + std::to_string(entry.epsilon) + " is below the " +
                            std::to_string(last->column_double(0)) + " already spent; the budget never shrinks");
  }
  Result<Statement> insert = database_.prepare(
      "INSERT INTO privacy_ledger(round, mechanism, sampling_rate, noise_multiplier, steps, epsilon, delta, rdp, wall_time) "
      "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))");
  if (!insert.is_ok()) return insert.status();
  insert->bind(1, round)
      .bind(2, std::string_view(entry.mechanism))
      .bind(3, entry.sampling_rate)
      .bind(4, entry.noise_multiplier)
      .bind(5, entry.steps)
      .bind(6, entry.epsilon)
      .bind(7, entry.delta)
      .bind(8, std::string_view(entry.rdp_json));
  return insert->run();
}

Result<std::vector<PrivacyEntry>> CheckpointStore::privacy_ledger() {
  Result<Statement> statement = database_.prepare(
      "SELECT round, mechanism, sampling_rate, noise_multiplier, steps, epsilon, delta, rdp, wall_time "
      "FROM privacy_ledger ORDER BY round");
  if (!statement.is_ok()) return statement.status();
  std::vector<PrivacyEntry> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    PrivacyEntry e;
    e.round = statement->column_int(0);
    e.mechanism = statement->column_text(1);
    e.sampling_rate = statement->column_double(2);
    e.noise_multiplier = statement->column_double(3);
    e.steps = statement->column_int(4);
    e.epsilon = statement->column_double(5);
    e.delta = statement->column_double(6);
    e.rdp_json = statement->column_text(7);
    e.wall_time = statement->column_text(8);
    result.push_back(std::move(e));
  }
  return result;
}

Result<std::vector<RoundLogEntry>> CheckpointStore::round_log(int64_t newest) {
  if (newest < 0) return invalid_argument("round_log: a negative count of rounds");
  Result<Statement> statement = database_.prepare(
      "SELECT round, model_version, wall_time, metrics FROM "
      "(SELECT * FROM round_log ORDER BY round DESC LIMIT ?1) ORDER BY round");
  if (!statement.is_ok()) return statement.status();
  statement->bind(1, newest == 0 ? int64_t{-1} : newest);  // LIMIT -1: no limit
  std::vector<RoundLogEntry> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    RoundLogEntry e;
    e.round = statement->column_int(0);
    e.model_version = statement->column_int(1);
    e.wall_time = statement->column_text(2);
    e.metrics_json = statement->column_text(3);
    result.push_back(std::move(e));
  }
  return result;
}

namespace {

// Every (sender, sequence) row of a replay-counter table.
Result<std::map<std::string, uint64_t>> read_counters(Database& database, const char* sql) {
  Result<Statement> statement = database.prepare(sql);
  if (!statement.is_ok()) return statement.status();
  std::map<std::string, uint64_t> result;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    result[statement->column_text(0)] = static_cast<uint64_t>(statement->column_int(1));
  }
  return result;
}

}  // namespace

Result<std::map<std::string, uint64_t>> CheckpointStore::replay_counters() {
  return read_counters(database_, "SELECT sender, sequence FROM replay_counters");
}

Result<std::map<std::string, uint64_t>> CheckpointStore::named_replay_counters() {
  return read_counters(database_, "SELECT sender, sequence FROM replay_counters_by_name");
}

Status CheckpointStore::adopt_named_replay_counters(const std::map<std::string, std::string>& key_of_name) {
  Result<std::map<std::string, uint64_t>> named = named_replay_counters();
  if (!named.is_ok()) return named.status();
  if (named->empty()) return Status::ok();
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<Statement> raise = prepare_raise_counter(database_);
  if (!raise.is_ok()) return raise.status();
  for (const auto& [name, sequence] : *named) {
    const auto key = key_of_name.find(name);
    if (key == key_of_name.end()) continue;
    if (!valid_name(key->second)) return invalid_argument("a replay counter's key must be 1..1024 bytes");
    raise->bind(1, std::string_view(key->second)).bind(2, static_cast<int64_t>(sequence));
    FEDMESH_RETURN_IF_ERROR(raise->run());
  }
  FEDMESH_RETURN_IF_ERROR(database_.execute("DELETE FROM replay_counters_by_name"));
  return transaction->commit();
}

Status CheckpointStore::record_replay_counter(const std::string& sender, uint64_t sequence) {
  if (!valid_name(sender)) return invalid_argument("a replay counter's sender must be 1..1024 bytes");
  Result<Transaction> transaction = Transaction::begin(database_);
  if (!transaction.is_ok()) return transaction.status();
  Result<Statement> current = database_.prepare("SELECT sequence FROM replay_counters WHERE sender = ?1");
  if (!current.is_ok()) return current.status();
  current->bind(1, std::string_view(sender));
  Result<bool> row = current->step();
  if (!row.is_ok()) return row.status();
  if (*row && static_cast<uint64_t>(current->column_int(0)) >= sequence) {
    return invalid_argument("replay counter of " + sender + " is already " +
                            std::to_string(static_cast<uint64_t>(current->column_int(0))) + ", not below " +
                            std::to_string(sequence) + ": counters only rise");
  }
  current->reset();
  Result<Statement> upsert = database_.prepare(
      "INSERT INTO replay_counters(sender, sequence) VALUES (?1, ?2) "
      "ON CONFLICT(sender) DO UPDATE SET sequence = excluded.sequence");
  if (!upsert.is_ok()) return upsert.status();
  upsert->bind(1, std::string_view(sender)).bind(2, static_cast<int64_t>(sequence));
  FEDMESH_RETURN_IF_ERROR(upsert->run());
  return transaction->commit();
}

Status CheckpointStore::integrity_check() { return run_check("PRAGMA integrity_check"); }

Status CheckpointStore::run_check(const char* pragma) {
  Result<Statement> statement = database_.prepare(pragma);
  if (!statement.is_ok()) return statement.status();
  std::string findings;
  for (;;) {
    Result<bool> row = statement->step();
    if (!row.is_ok()) return row.status();
    if (!*row) break;
    const std::string line = statement->column_text(0);
    if (line == "ok") continue;
    if (!findings.empty()) findings += "; ";
    findings += line;
  }
  if (findings.empty()) return Status::ok();
  return corrupt(path() + ": SQLite's integrity check failed: " + findings.substr(0, 2000));
}

Status CheckpointStore::settle() {
  if (maintenance_) FEDMESH_RETURN_IF_ERROR(maintenance_->drain());
  return database_.execute("PRAGMA wal_checkpoint(TRUNCATE)");
}

int64_t CheckpointStore::disk_bytes() const {
  std::error_code error;
  int64_t total = 0;
  for (const std::string& file : {path(), path() + "-wal"}) {
    const auto size = std::filesystem::file_size(file, error);
    if (!error) total += static_cast<int64_t>(size);
  }
  return total;
}

}  // namespace fedmesh::store
