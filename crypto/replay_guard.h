// Replay protection: for each sender, the highest update sequence number ever
// accepted. An update whose sequence is not above it is a replay. The table is
// persisted (written to a temporary file, fsynced, renamed, directory fsynced)
// before commit() returns, so a restart does not reopen a replay window.
//
// The aggregator keeps the table in its checkpoint store instead
// (persisted_by), so counters, pending updates and rounds live in one
// database; it raises a counter in the transaction that stores the update
// and then tells the guard (note_durable).
//
// Senders are identified by their Ed25519 signing key (replay_key: 64 lower-
// case hex digits, which the site-name check admits), never by their name:
// a site re-keyed under the same name starts with a fresh counter, so what
// a stolen, revoked key sent cannot lock the site's new key out.
//
// File format, one line per sender, sorted by key:
//   fedmesh-replay-v1
//   <sender key> <sequence>
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "base/status.h"
#include "crypto/keys.h"

namespace fedmesh::crypto {

inline constexpr size_t kMaxReplaySenders = 1u << 16;

// What a sender's counter is kept by: its signing public key in hex.
std::string replay_key(const SignPublicKey& sign_public);

class ReplayGuard {
 public:
  // Loads `file` if it exists (a missing file is an empty table; a corrupt
  // one is an error, never silently reset).
  static Result<ReplayGuard> open(std::filesystem::path file);
  // An in-memory guard (tests, --insecure experiments): nothing persisted.
  static ReplayGuard in_memory();
  // A guard whose table lives elsewhere (the aggregator's checkpoint store):
  // starts from `counters`, and commit() calls `persist` for the raised
  // counter, which must be durable when it returns ok.
  using Persist = std::function<Status(const std::string& sender, uint64_t sequence)>;
  static ReplayGuard persisted_by(std::map<std::string, uint64_t> counters, Persist persist);

  // ok if sequence > last accepted for sender; kInvalidArgument naming the
  // sender, the sequence and the last accepted one otherwise.
  Status check(std::string_view sender, uint64_t sequence) const;
  // check(), then record and persist. Only after it returns ok may the
  // update be acknowledged.
  Status commit(std::string_view sender, uint64_t sequence);
  // Raises the counter in memory only: the caller has already made it
  // durable, in the same commit as the update it protects (the aggregator's
  // store). Never lowers a counter.
  void note_durable(std::string_view sender, uint64_t sequence);
  uint64_t last_accepted(std::string_view sender) const;  // 0 if none

 private:
  ReplayGuard() = default;
  Status persist() const;
  std::filesystem::path file_;  // empty: in memory (or persist_)
  Persist persist_;
  std::map<std::string, uint64_t, std::less<>> last_;
};

}  // namespace fedmesh::crypto
