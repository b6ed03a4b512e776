// The checkpoint database's schema, as a list of forward migrations. Version
// N is reached by applying migrations 1..N in order, each in its own
// transaction together with its row in schema_version, so a crash during a
// migration leaves the database at the previous version, never half-way.
//
//   1  training checkpoints: meta, rounds (with state and metrics JSON and a
//      round checksum), tensors and their chunks
//   2  federation membership: peers (the membership view) and replay
//      counters (highest update sequence accepted per sender)
//   3  update bookkeeping: pending updates (received, durable, not yet
//      applied) with chunked payloads, and applied update ids, so that an
//      update applied in round r is never applied again after a restart
//   4  the privacy ledger
//   5  the round log
//   6  quarantine: damaged rounds and pending updates moved aside with their
//      bytes, the reason and the time (store/quarantine.h)
//
// A migration is never edited once released: a change is a new migration.
#pragma once

#include "base/status.h"
#include "store/sqlite.h"

namespace fedmesh::store {

inline constexpr int kSchemaVersion = 9;

// The version the database is at (0 for an empty database).
Result<int> schema_version(Database& database);

// Applies the migrations from the database's version up to `target`
// (1..kSchemaVersion). A database at a version above kSchemaVersion was
// written by a newer fedmesh and is refused with that explanation. Migrating
// to a version below the current one is refused too (migrations go forward).
Status migrate(Database& database, int target = kSchemaVersion);

}  // namespace fedmesh::store
