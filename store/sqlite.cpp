#include "store/sqlite.h"

#include <sqlite3.h>

#include <utility>

namespace fedmesh::store {

namespace {

// How long a connection waits for another connection's write lock.
constexpr int kBusyTimeoutMs = 10'000;

}  // namespace

Database::Database(Database&& other) noexcept : db_(other.db_), path_(std::move(other.path_)) { other.db_ = nullptr; }

Database& Database::operator=(Database&& other) noexcept {
  if (this != &other) {
    if (db_ != nullptr) sqlite3_close_v2(db_);
    db_ = std::exchange(other.db_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

Database::~Database() {
  if (db_ != nullptr) sqlite3_close_v2(db_);
}

Result<Database> Database::open(const std::string& path, Mode mode, const std::string& vfs) {
  int flags = SQLITE_OPEN_NOMUTEX;  // one connection is used by one thread at a time
  switch (mode) {
    case Mode::kReadWriteCreate: flags |= SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE; break;
    case Mode::kReadWrite: flags |= SQLITE_OPEN_READWRITE; break;
    case Mode::kReadOnly: flags |= SQLITE_OPEN_READONLY; break;
    case Mode::kImmutable: flags |= SQLITE_OPEN_READONLY | SQLITE_OPEN_URI; break;
  }
  Database database;
  database.path_ = path;
  std::string name = path;
  if (mode == Mode::kImmutable) {
    // A URI: the path with '%', '?' and '#' escaped.
    name = "file:";
    for (const char c : path) {
      if (c == '%' || c == '?' || c == '#') {
        static constexpr char kHex[] = "0123456789ABCDEF";
        name += '%';
        name += kHex[(static_cast<unsigned char>(c) >> 4) & 0xf];
        name += kHex[static_cast<unsigned char>(c) & 0xf];
      } else {
        name += c;
      }
    }
    name += "?immutable=1";
  }
  const int code = sqlite3_open_v2(name.c_str(), &database.db_, flags, vfs.empty() ? nullptr : vfs.c_str());
  if (code != SQLITE_OK) {
    const bool missing = code == SQLITE_CANTOPEN && mode != Mode::kReadWriteCreate;
    std::string message = path + ": cannot open database: " +
                          (database.db_ != nullptr ? sqlite3_errmsg(database.db_) : sqlite3_errstr(code));
    if (missing) return not_found(message);
    return io_error(message);
  }
  sqlite3_extended_result_codes(database.db_, 1);
  sqlite3_busy_timeout(database.db_, kBusyTimeoutMs);
  // Statement journals and sorts in memory, not in temporary files: a store
  // that is open needs no new file descriptor to commit (the write-ahead log
  // and its index stay open), so a process short of descriptors (a flood of
  // connections) keeps committing rounds.
  if (const int pragma = sqlite3_exec(database.db_, "PRAGMA temp_store = MEMORY", nullptr, nullptr, nullptr);
      pragma != SQLITE_OK) {
    return database.error("PRAGMA temp_store", pragma);
  }
  return database;
}

Status Database::error(std::string_view context, int code) const {
  std::string message = path_ + ": " + std::string(context) + ": " +
                        (db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(code)) + " (" +
                        sqlite3_errstr(code) + ")";
  switch (code & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
    case SQLITE_FORMAT: return corrupt(std::move(message));
    case SQLITE_CONSTRAINT:
    case SQLITE_MISMATCH:
    case SQLITE_RANGE:
    case SQLITE_TOOBIG: return invalid_argument(std::move(message));
    case SQLITE_BUSY:
    case SQLITE_LOCKED: return unavailable(std::move(message));
    default: return io_error(std::move(message));
  }
}

Status Database::execute(std::string_view sql) {
  const std::string text(sql);
  char* message = nullptr;
  const int code = sqlite3_exec(db_, text.c_str(), nullptr, nullptr, &message);
  if (code == SQLITE_OK) return Status::ok();
  std::string context = "executing '" + text.substr(0, 80) + "'";
  sqlite3_free(message);
  return error(context, code);
}

Result<Statement> Database::prepare(std::string_view sql) {
  sqlite3_stmt* statement = nullptr;
  const int code =
      sqlite3_prepare_v3(db_, sql.data(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &statement, nullptr);
  if (code != SQLITE_OK) return error("preparing '" + std::string(sql.substr(0, 80)) + "'", code);
  return Statement(this, statement);
}

Result<int64_t> Database::query_int(std::string_view sql) {
  Result<Statement> statement = prepare(sql);
  if (!statement.is_ok()) return statement.status();
  Result<bool> row = statement->step();
  if (!row.is_ok()) return row.status();
  if (!*row) return not_found(path_ + ": '" + std::string(sql) + "' returned no row");
  return statement->column_int(0);
}

Result<std::string> Database::query_text(std::string_view sql) {
  Result<Statement> statement = prepare(sql);
  if (!statement.is_ok()) return statement.status();
  Result<bool> row = statement->step();
  if (!row.is_ok()) return row.status();
  if (!*row) return not_found(path_ + ": '" + std::string(sql) + "' returned no row");
  return statement->column_text(0);
}

Status Database::write_blob(const char* table, const char* column, int64_t rowid, std::span<const uint8_t> bytes) {
  const std::span<const uint8_t> parts[] = {bytes};
  return write_blob(table, column, rowid, parts);
}

Status Database::write_blob(const char* table, const char* column, int64_t rowid,
                            std::span<const std::span<const uint8_t>> parts) {
  sqlite3_blob* blob = nullptr;
  int code = sqlite3_blob_open(db_, "main", table, column, rowid, /*writable=*/1, &blob);
  if (code != SQLITE_OK) return error(std::string("opening blob ") + table + "." + column, code);
  int offset = 0;
  for (const std::span<const uint8_t> part : parts) {
    if (code != SQLITE_OK) break;
    if (part.empty()) continue;
    code = sqlite3_blob_write(blob, part.data(), static_cast<int>(part.size()), offset);
    offset += static_cast<int>(part.size());
  }
  const int closed = sqlite3_blob_close(blob);
  if (code == SQLITE_OK) code = closed;
  if (code != SQLITE_OK) return error(std::string("writing blob ") + table + "." + column, code);
  return Status::ok();
}

int64_t Database::last_insert_rowid() const { return sqlite3_last_insert_rowid(db_); }
int64_t Database::changes() const { return sqlite3_changes64(db_); }

Statement::Statement(Statement&& other) noexcept
    : database_(other.database_), statement_(std::exchange(other.statement_, nullptr)), bind_error_(other.bind_error_) {}

Statement& Statement::operator=(Statement&& other) noexcept {
  if (this != &other) {
    if (statement_ != nullptr) sqlite3_finalize(statement_);
    database_ = other.database_;
    statement_ = std::exchange(other.statement_, nullptr);
    bind_error_ = other.bind_error_;
  }
  return *this;
}

Statement::~Statement() {
  if (statement_ != nullptr) sqlite3_finalize(statement_);
}

Statement& Statement::bind(int index, int64_t value) {
  const int code = sqlite3_bind_int64(statement_, index, value);
  if (code != SQLITE_OK && bind_error_ == 0) bind_error_ = code;
  return *this;
}

Statement& Statement::bind(int index, double value) {
  const int code = sqlite3_bind_double(statement_, index, value);
  if (code != SQLITE_OK && bind_error_ == 0) bind_error_ = code;
  return *this;
}

Statement& Statement::bind(int index, std::string_view text) {
  // A default-constructed view has a null data(), which SQLite would bind as
  // NULL: empty text must bind as empty text, as an empty blob does.
  const char* data = text.data() != nullptr ? text.data() : "";
  const int code = sqlite3_bind_text64(statement_, index, data, text.size(), SQLITE_STATIC, SQLITE_UTF8);
  if (code != SQLITE_OK && bind_error_ == 0) bind_error_ = code;
  return *this;
}

Statement& Statement::bind_blob(int index, std::span<const uint8_t> bytes) {
  // A zero-length blob must still bind as a blob, not NULL.
  static const uint8_t kEmpty = 0;
  const int code = sqlite3_bind_blob64(statement_, index, bytes.empty() ? &kEmpty : bytes.data(), bytes.size(),
                                       SQLITE_STATIC);
  if (code != SQLITE_OK && bind_error_ == 0) bind_error_ = code;
  return *this;
}

Statement& Statement::bind_zeroblob(int index, int64_t bytes) {
  const int code = sqlite3_bind_zeroblob64(statement_, index, static_cast<sqlite3_uint64>(bytes));
  if (code != SQLITE_OK && bind_error_ == 0) bind_error_ = code;
  return *this;
}

Statement& Statement::bind_null(int index) {
  const int code = sqlite3_bind_null(statement_, index);
  if (code != SQLITE_OK && bind_error_ == 0) bind_error_ = code;
  return *this;
}

Status Statement::first_bind_error() const {
  return database_->error(std::string("binding a parameter of '") + sqlite3_sql(statement_) + "'", bind_error_);
}

Result<bool> Statement::step() {
  if (bind_error_ != 0) return first_bind_error();
  const int code = sqlite3_step(statement_);
  if (code == SQLITE_ROW) return true;
  if (code == SQLITE_DONE) return false;
  return database_->error(std::string("running '") + std::string(sqlite3_sql(statement_)).substr(0, 80) + "'", code);
}

Status Statement::run() {
  Result<bool> row = step();
  reset();
  if (!row.is_ok()) return row.status();
  return Status::ok();
}

void Statement::reset() {
  sqlite3_reset(statement_);
  sqlite3_clear_bindings(statement_);
  bind_error_ = 0;
}

bool Statement::is_null(int column) const { return sqlite3_column_type(statement_, column) == SQLITE_NULL; }
int64_t Statement::column_int(int column) const { return sqlite3_column_int64(statement_, column); }
double Statement::column_double(int column) const { return sqlite3_column_double(statement_, column); }

std::string Statement::column_text(int column) const {
  const auto* text = reinterpret_cast<const char*>(sqlite3_column_text(statement_, column));
  const int size = sqlite3_column_bytes(statement_, column);
  return text == nullptr ? std::string() : std::string(text, static_cast<size_t>(size));
}

std::span<const uint8_t> Statement::column_blob(int column) const {
  const auto* bytes = static_cast<const uint8_t*>(sqlite3_column_blob(statement_, column));
  const int size = sqlite3_column_bytes(statement_, column);
  if (bytes == nullptr) return {};
  return {bytes, static_cast<size_t>(size)};
}

Result<Transaction> Transaction::begin(Database& database) {
  FEDMESH_RETURN_IF_ERROR(database.execute("BEGIN IMMEDIATE"));
  return Transaction(&database);
}

Transaction::~Transaction() {
  if (database_ != nullptr) sqlite3_exec(database_->handle(), "ROLLBACK", nullptr, nullptr, nullptr);
}

Status Transaction::commit() {
  FEDMESH_RETURN_IF_ERROR(database_->execute("COMMIT"));
  database_ = nullptr;
  return Status::ok();
}

}  // namespace fedmesh::store
