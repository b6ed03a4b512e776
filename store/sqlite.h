// A thin, owning wrapper over the SQLite C API: a connection, prepared
// statements and transactions, with every failure turned into a Status that
// names the database file and what SQLite said. Nothing here knows about
// checkpoints; store/checkpoint_store.h builds on it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"

struct sqlite3;
struct sqlite3_stmt;

namespace fedmesh::store {

class Statement;

class Database {
 public:
  // kImmutable: read-only for a file nothing may change while it is open
  // (read-only media): SQLite takes no locks and reads no write-ahead log.
  enum class Mode { kReadWriteCreate, kReadWrite, kReadOnly, kImmutable };

  Database() = default;
  Database(Database&& other) noexcept;
  Database& operator=(Database&& other) noexcept;
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;
  ~Database();

  // Opens `path`; kNotFound when it must exist and does not. A busy timeout
  // lets a second reader (e.g. `fedmesh checkpoint list` on a live store)
  // wait for a writer instead of failing at once.
  // `vfs`: a registered SQLite VFS by name; "" is the default one.
  static Result<Database> open(const std::string& path, Mode mode, const std::string& vfs = "");

  // Runs one or more statements that return no rows of interest.
  Status execute(std::string_view sql);
  Result<Statement> prepare(std::string_view sql);
  // The single integer a query like "PRAGMA user_version" returns.
  Result<int64_t> query_int(std::string_view sql);
  Result<std::string> query_text(std::string_view sql);

  // Writes `bytes` at offset 0 of the blob in table.column of row `rowid`
  // (created with a zeroblob of at least that size): straight into SQLite's
  // pages, without the copy a bound blob takes through a record.
  Status write_blob(const char* table, const char* column, int64_t rowid, std::span<const uint8_t> bytes);
  // The same for bytes given in parts, written one after another from offset 0.
  Status write_blob(const char* table, const char* column, int64_t rowid,
                    std::span<const std::span<const uint8_t>> parts);
  int64_t last_insert_rowid() const;
  int64_t changes() const;
  const std::string& path() const { return path_; }
  sqlite3* handle() const { return db_; }
  // "PATH: CONTEXT: sqlite message (code)"
  Status error(std::string_view context, int code) const;

 private:
  sqlite3* db_ = nullptr;
  std::string path_;
};

class Statement {
 public:
  Statement() = default;
  Statement(Statement&& other) noexcept;
  Statement& operator=(Statement&& other) noexcept;
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  ~Statement();

  // Parameters count from 1, as in SQLite. Blobs and text are bound without
  // a copy: the bytes must stay alive until the statement is stepped/reset.
  Statement& bind(int index, int64_t value);
  Statement& bind(int index, double value);
  Statement& bind(int index, std::string_view text);
  Statement& bind_blob(int index, std::span<const uint8_t> bytes);
  Statement& bind_null(int index);
  Statement& bind_zeroblob(int index, int64_t bytes);

  // Advances: true with a row to read, false when done.
  Result<bool> step();
  // Steps a statement that returns no rows.
  Status run();
  // Ready to bind and step again.
  void reset();

  bool is_null(int column) const;
  int64_t column_int(int column) const;
  double column_double(int column) const;
  std::string column_text(int column) const;
  // Valid until the next step/reset.
  std::span<const uint8_t> column_blob(int column) const;

 private:
  friend class Database;
  Statement(const Database* database, sqlite3_stmt* statement) : database_(database), statement_(statement) {}
  Status first_bind_error() const;
  const Database* database_ = nullptr;
  sqlite3_stmt* statement_ = nullptr;
  int bind_error_ = 0;  // the first failed bind, reported by step()
};

// BEGIN IMMEDIATE on construction (the write lock is taken up front, so a
// commit never fails half-way for lock contention); ROLLBACK on destruction
// unless commit() succeeded.
class Transaction {
 public:
  static Result<Transaction> begin(Database& database);
  Transaction(Transaction&& other) noexcept : database_(other.database_) { other.database_ = nullptr; }
  Transaction& operator=(Transaction&&) = delete;
  Transaction(const Transaction&) = delete;
  ~Transaction();
  Status commit();

 private:
  explicit Transaction(Database* database) : database_(database) {}
  Database* database_;
};

}  // namespace fedmesh::store
