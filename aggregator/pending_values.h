// A pending update's values where the aggregator's store keeps them: the
// round manager reads them through this (StoredValues) a slice at a time,
// to check the update and again at the server step, so the aggregator holds
// neither the round's updates nor a model-sized sum (issue 30).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "aggregator/round_manager.h"
#include "base/spill_file.h"
#include "base/status.h"
#include "store/checkpoint_store.h"
#include "store/pending_payload.h"

namespace fedmesh::aggregator {

class PendingValues final : public StoredValues {
 public:
  // The update `update_id` of `store` (which must outlive it and not move),
  // a delta of `values` values: its header is read and checked now (kCorrupt
  // as store::read_pending_layout says; kNotFound when it is not pending),
  // and the first pass is under way.
  static Result<std::shared_ptr<PendingValues>> open(store::CheckpointStore& store, std::span<const uint8_t> update_id,
                                                     int64_t values);
  const store::PendingHeader& header() const { return header_; }
  // The values just stored, still in memory (a model's tensors back to
  // back): the first pass reads them instead of the store, and ends by
  // dropping them (the aggregator checks an update it has just written
  // without reading it back).
  void read_first_pass_from(std::vector<std::vector<float>> values);
  // The same for values staged on disk as they arrived (fp32 back to back,
  // as protocol::ReceivedUpdate::spilled): read from there a slice at a time,
  // and the file is let go when the pass ends.
  void read_first_pass_from(std::shared_ptr<const SpillFile> values);

  Status read(std::span<float> out) override;
  // Ends the pass: reads what is left and checks the payload's size and
  // checksum (kCorrupt when they do not match).
  Status finish() override;

 private:
  explicit PendingValues(store::PendingStream stream, int64_t values) : stream_(std::move(stream)), values_(values) {}
  // Reads the payload's front: the header, and the values' first bytes.
  Status begin_pass();

  store::PendingStream stream_;
  int64_t values_ = 0;
  store::PendingHeader header_;
  bool in_pass_ = false;
  std::vector<uint8_t> front_;  // the front read past the header: the first values' bytes
  size_t front_at_ = 0;         // how much of them was handed out
  std::vector<std::vector<float>> in_memory_;  // read_first_pass_from's, until that pass ends
  size_t piece_ = 0, within_ = 0;              // where its pass is
  std::shared_ptr<const SpillFile> spilled_;   // or the values on disk, until that pass ends
  uint64_t spilled_at_ = 0;                    // the next byte of them
};

}  // namespace fedmesh::aggregator
