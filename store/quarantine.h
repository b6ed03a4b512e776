// Quarantine: where a store's owner moves a damaged round or pending update
// so that it resumes from the newest intact state instead of stopping on it.
// An entry keeps the rows as they were (the round's record, its tensors'
// records and bytes; the update's record and bytes), what failed and when,
// in the quarantined_* tables of the same SQLite file (schema version 6).
// Moving is one transaction: an item is either where it was or in
// quarantine, never half-way.
//
// The CheckpointStore members that move, list, release and drop entries are
// declared in store/checkpoint_store.h and defined in store/quarantine.cpp.
// Releasing puts an entry back where it came from (refused while it still
// fails its checks, unless forced); dropping deletes it and its evidence.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace fedmesh::store {

struct QuarantinedRound {
  int64_t entry = 0;  // the quarantine entry's id
  int64_t round = 0;
  int64_t model_version = 0;
  std::string wall_time;     // when the round was committed
  std::string metrics_json;  // as stored: a damaged record may hold anything
  std::string state_json;
  int64_t tensor_count = 0;
  int64_t byte_size = 0;     // the bytes kept of its tensors
  std::string reason;        // what failed when its owner checked it
  std::string quarantined_at;
};

struct QuarantinedUpdate {
  int64_t entry = 0;
  std::vector<uint8_t> update_id;
  std::string sender;
  int64_t base_version = 0;
  int64_t sample_count = 0;
  std::string received_at;
  int64_t byte_size = 0;  // as recorded
  std::string reason;
  std::string quarantined_at;
};

// What an owner is told for each item it quarantines while resuming.
struct QuarantineNotice {
  std::optional<int64_t> round;     // a round, or
  std::vector<uint8_t> update_id;   // a pending update
  std::string sender;               // the update's
  std::string reason;
  // "quarantined round 12 (its checks failed: REASON); ..." for a warning.
  std::string message;
};

// An update id as a person reads it: the text of an aggregator's
// SENDER/SEQUENCE ids, hex for anything not printable.
std::string update_id_text(std::span<const uint8_t> update_id);

}  // namespace fedmesh::store
