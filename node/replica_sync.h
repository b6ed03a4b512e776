// The merge rule `replicas` in a networked gossip peer (gossip/replicas.h):
// what the peer keeps beside the replica so that every member ends up
// holding every update, through crashes and lost messages.
//
//  - Its own update of a round is made, added to its own sum and committed
//    to its store *before* it is sent (durable before it leaves: a peer
//    killed mid-send restarts knowing that update, never making a second,
//    different one for the same round), then sent to every alive member.
//  - It keeps its own updates of the last kKeptRounds rounds and sends one
//    again to a member that asks for it (UpdateRequest), before and after a
//    restart. Each is written to the store once, when made, as a pending
//    update (its encoded segments as sent, checksummed; node/own_update_bytes.h), in
//    its own transaction before the round's commit; the checkpoint names
//    the ones kept, and the commit after one leaves the window removes it
//    (as an applied update). A checkpoint thus costs the model, not 16
//    updates more.
//  - It asks each member for the updates of that member's rounds it lacks,
//    within the same window: a lost message, or updates sent while this
//    peer was down. Updates older than the window are no longer taken
//    (ReplicaState::forget_before), so peers agree only if each gets an
//    update within kKeptRounds rounds of it being made.
//
// The exact sum is checkpointed losslessly, as its own memory: the raw
// 64-bit fixed-point values viewed as twice as many fp32 words (bits, not
// numbers; no copy of the sum is made to commit it). Checkpoints of the
// earlier format, three exact float tensors of 22, 21 and 21 bits per
// value, are still read.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/clock.h"
#include "base/status.h"
#include "gossip/replicas.h"
#include "kernels/tensor.h"
#include "node/own_update_bytes.h"
#include "protocol/update_transfer.h"
#include "store/checkpoint_store.h"

namespace fedmesh::node {

class ReplicaSync {
 public:
  static constexpr uint64_t kKeptRounds = 16;

  // `clock`: the runtime's (its Unix time names our own updates in the store).
  ReplicaSync(gossip::ReplicaState state, std::string self, Clock& clock = real_clock());

  gossip::ReplicaState& state() { return state_; }
  const gossip::ReplicaState& state() const { return state_; }

  // Our update of `round` from the model local training reached: made with
  // error feedback, added to our own sum, kept to send again.
  // `trained`'s buffers are reused for the pseudo-gradient.
  Status make(uint64_t round, std::vector<std::vector<float>> trained);
  // Our update of `round` as it travels; null once it is no longer kept.
  const std::vector<protocol::EncodedTensor>* own(uint64_t round) const;
  // A member's update: true when it was new and added, false for one we
  // have (or of a round before the window); refused when it does not fit.
  Result<bool> take(const std::string& sender, uint64_t round, std::span<const std::vector<float>> values);
  // The rounds of `member` we lack among those it has made (its version
  // tells how many) and that it still keeps.
  std::vector<uint64_t> missing(const std::string& member, uint64_t member_version) const;
  // The window moved on to `version`: forget older ids and own updates.
  void advance(uint64_t version);

  // Our update of `round` (made) into the store's pending updates, durable
  // when it returns ok; before the round's commit.
  Status persist(uint64_t round, store::CheckpointStore& store);
  // Checkpoint: the exact sum (three float pieces, role "replica"), the ids
  // applied, the floor and the pending-update ids of our own updates kept
  // (in `state`); `retire` gets the own updates to drop from the store in
  // this commit (those that left the window, and strays of a crash).
  void save(std::deque<Tensor>& views, std::vector<store::TensorToCommit>& out, nlohmann::json& state,
            std::vector<store::AppliedUpdate>& retire) const;
  // The commit that save() fed succeeded: what it retired is gone.
  void committed();
  // From a checkpoint and the store's pending updates (a checkpoint of the
  // earlier format keeps its own updates as tensors: read as well). An own
  // update that cannot be read is skipped, with a line in `warnings`: it
  // is in the sum, only its resend is lost.
  Status restore(const store::LoadedCheckpoint& checkpoint, const nlohmann::json& state, store::CheckpointStore& store,
                 std::vector<std::string>& warnings);
  // The rounds of our own updates kept (after a restore: to send again).
  std::vector<uint64_t> own_rounds() const;

 private:
  gossip::ReplicaState state_;
  std::string self_;
  Clock* clock_;
  struct Own {
    std::vector<protocol::EncodedTensor> tensors;  // as sent
    std::string pending_id;  // its pending update in the store; empty until persisted
  };
  // The own update of `round` from its coordinates and values (format 1):
  // checked against the model's size, and encoded to send again.
  Result<Own> own_from(uint64_t round, std::vector<uint64_t> index, std::vector<float> value) const;
  std::map<uint64_t, Own> own_;  // by round
  std::vector<std::string> retired_;  // pending ids to drop at the next commit
  mutable size_t retiring_ = 0;       // how many of retired_ the last save() listed
};

// The three exact float pieces of a 64-bit fixed-point value, and back.
void split_fixed_point(int64_t value, float pieces[3]);
int64_t join_fixed_point(const float pieces[3]);

}  // namespace fedmesh::node
