// Sparse gossip with identical replicas (the DiLoCo/DeMo design): every peer
// applies every peer's compressed update, so peers that hold the same set of
// updates hold bit-identical models, with no aggregator anywhere.
//
// Each round a peer trains H local steps from the model it holds, z, and
// compresses its pseudo-gradient (trained - z) with error feedback (top-k
// with int8 values, say: what is not sent stays in its residual). That
// update, identified by (sender, round) and signed by its sender, is spread
// to every member (node/gossip_runtime: pushed to the peer's neighbours,
// then pulled by whoever lacks it from whoever advertises it). Every peer
// adds every update it holds, once, into an exact order-independent sum
// (federation/exact_accumulator.h, 64-bit fixed point):
//
//   z = x0 + sum over the updates held of (lr / members) * D(C(update))
//
// with x0 the seeded model. The sum is exact integer arithmetic, so the
// order updates arrive in does not matter: two peers holding the same set
// hold the same bits (`digest()`), and a late update (a lost message pulled
// again, a peer that was down) is simply added when it arrives; its
// staleness is that its sender trained from an older z, as in asynchronous
// federated learning. With lr = 1 and every update of a round arriving
// before the next, this is FedAvg with the aggregator path's error-fed
// compression, so the model is as good as the aggregator's.
//
// What a peer applied is a set of (sender, round) ids; a second copy of an
// update (a duplicate delivery, a second neighbour answering the same pull)
// is recognized and not applied twice.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "federation/exact_accumulator.h"
#include "base/status.h"
#include "crypto/hash.h"
#include "kernels/compression_kernels.h"
#include "protocol/compression_spec.h"
#include "protocol/compressor.h"
#include "protocol/update_transfer.h"

namespace fedmesh::gossip {

// What replicas compress with unless told otherwise, by the local
// optimizer and the model (docs/gossip.md, "Which compression"):
// - SGD: 1.5 % of the coordinates with int8 values, about 118x fewer bytes
//   than dense fp32 at the same accuracy. SGD's pseudo-gradient is
//   concentrated in few coordinates; error feedback carries the rest.
// - SGD, a language model: 5 % (about 30x fewer). Its pseudo-gradient is
//   less concentrated: at 1.5 % gpt-nano by book ended 0.067 bits per byte
//   behind the aggregator path, at 5 % 0.012 (0.013 with 20 % loss).
// - AdamW: dense int4 (8x fewer). Adam normalizes every coordinate's step, so
//   its pseudo-gradient is spread over all of them: top-k 1.5 % lost 0.8 bits
//   per byte on gpt-nano and 1.7 points on the mlp, int4 nothing.
inline constexpr const char* kSgdGossipCompression = "topk:0.015+int8";
inline constexpr const char* kSgdLanguageModelGossipCompression = "topk:0.05+int8";
inline constexpr const char* kAdamGossipCompression = "int4";
const char* default_gossip_compression(std::string_view local_optimizer, bool language_model);

struct UpdateId {
  std::string sender;
  uint64_t round = 0;
  auto operator<=>(const UpdateId&) const = default;
};

// This peer's own update of a round, as it travels.
struct OwnUpdate {
  std::vector<protocol::EncodedTensor> tensors;
  std::vector<std::vector<float>> decoded;  // D(C(...)) per tensor: what every peer adds
  uint64_t payload_bytes = 0;
};

class ReplicaState {
 public:
  // `reference` is x0; every update is added with weight lr / members
  // (members: the federation's peers, the same number at every peer; lr in
  // (0, 1], the outer learning rate).
  static Result<ReplicaState> create(const protocol::CompressionPlan& plan, std::vector<protocol::TensorShape> manifest,
                                     std::vector<std::vector<float>> reference, int members, double lr, uint64_t seed,
                                     kernels::CompressionKernels& kernels,
                                     size_t max_segment_bytes = protocol::kDefaultChunkBytes);
  ReplicaState(ReplicaState&&) noexcept = default;
  ReplicaState& operator=(ReplicaState&&) noexcept = default;

  const std::vector<protocol::TensorShape>& manifest() const { return manifest_; }
  // The most payload bytes per encoded segment (and so per chunk sent).
  size_t max_segment_bytes() const { return max_segment_bytes_; }
  const std::vector<std::vector<float>>& reference() const { return reference_; }
  // z: x0 plus the sum of the updates held.
  const std::vector<std::vector<float>>& model() const { return model_; }
  // z's own buffers, for a worker that trains in them (its parameters
  // viewing them: no second copy of the model). They are never reallocated.
  // Training overwrites z there: restore_model() writes it back before
  // anything else reads model() or makes an update.
  std::vector<std::vector<float>>& model_storage() { return model_; }
  void restore_model() { refresh_model(); }
  double weight() const { return weight_; }

  // Local training took model() to `trained`: the compressed pseudo-gradient,
  // with error feedback (the residual keeps what was not sent). The caller
  // spreads it and applies it to its own model with apply(). `trained`'s
  // buffers become the pseudo-gradient and then the compressor's input (no
  // copy of the model's size is made for either); after a successful apply
  // the caller may release the compressor's buffers (take_back then has
  // nothing to restore).
  Result<OwnUpdate> make_update(std::vector<std::vector<float>> trained);
  // The last update could not be spread at all: its input goes back into
  // the residual.
  void take_back();

  // Adds an update (decoded values, per tensor) once: false when this id was
  // applied already (nothing changes). Refuses (changing nothing) values of
  // the wrong shape, non-finite values, or ones that would break the exact
  // sum's bounds.
  Result<bool> apply(const UpdateId& id, std::span<const std::vector<float>> decoded);
  // Whether `id` was applied, or is of a round before the floor (those are
  // no longer taken: see forget_before).
  bool applied(const UpdateId& id) const { return id.round < floor_ || applied_.count(id) > 0; }
  const std::set<UpdateId>& applied_ids() const { return applied_; }
  // Forgets the ids of rounds before `round` and takes no update of those
  // rounds any more (a networked peer keeps a window of rounds, not the whole
  // history); the floor only rises.
  void forget_before(uint64_t round);
  uint64_t floor() const { return floor_; }
  // BLAKE2b of the exact sum: equal digests, identical models.
  crypto::Hash digest() const;

  // Checkpoint state: the exact sum, the ids applied, and the compressor's
  // residual (protocol::UpdateCompressor::state_tensors).
  federation::ExactAccumulator::Saved saved_sum() const { return sum_->save(); }
  // The same without a copy: the counters, and the raw sums to write out.
  federation::ExactAccumulator::Saved saved_counters() const { return sum_->save_counters(); }
  std::span<const int64_t> raw_sum() const { return sum_->raw(); }
  Status restore(federation::ExactAccumulator::Saved sum, std::set<UpdateId> applied, uint64_t floor = 0);
  protocol::UpdateCompressor& compressor() { return *compressor_; }

 private:
  ReplicaState() = default;
  void refresh_model();
  std::vector<protocol::TensorShape> manifest_;
  size_t max_segment_bytes_ = protocol::kDefaultChunkBytes;
  std::vector<std::vector<float>> reference_;  // x0
  std::vector<std::vector<float>> model_;      // z
  double weight_ = 1.0;                        // lr / members
  std::optional<federation::ExactAccumulator> sum_;
  std::set<UpdateId> applied_;
  uint64_t floor_ = 0;
  std::optional<protocol::UpdateCompressor> compressor_;
};

// Every spec of a plan with where it comes from ("the default",
// "override GLOB"), for the checks that refuse a method by name.
std::vector<std::pair<std::string, protocol::CompressionSpec>> plan_specs(const protocol::CompressionPlan& plan);

// Ok for a plan replicas can carry: anything but PowerSGD (which needs a
// factor shared by all senders of a round, computed by a server).
Status check_replica_compression(const protocol::CompressionPlan& plan);

}  // namespace fedmesh::gossip
